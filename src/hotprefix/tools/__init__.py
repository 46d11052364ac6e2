"""Small tools beside the runtime: ``warm`` (``hotprefix warm``: prefill system prompts on a
running server) and ``quality`` (output quality of a configuration against a reference). The larger
tools are packages of their own (``hotprefix.lint``, ``hotprefix.simulate``)."""
