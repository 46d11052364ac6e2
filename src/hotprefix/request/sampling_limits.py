"""The ranges of the sampling parameters beyond temperature and top-p: one place for the sampler
(``hotprefix.request.sampling``) and the API schemas (``hotprefix.server.protocol``). Imports nothing."""

MAX_N = 64
"""Most sequences one request may ask for (``n``, ``best_of``): each decodes like a request."""
MAX_LOGPROBS = 20
"""Most top log probabilities per token (OpenAI's chat limit; its completions API takes 5)."""
MAX_LOGIT_BIAS = 1024
"""Most tokens one ``logit_bias`` may name."""
MAX_ABS_BIAS = 100.0
"""``logit_bias`` values lie in [-MAX_ABS_BIAS, MAX_ABS_BIAS] (OpenAI's range)."""
MAX_ABS_PENALTY = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in [-2, 2] (OpenAI's range)."""
