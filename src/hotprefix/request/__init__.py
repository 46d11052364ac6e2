"""The request side: what a request asks for and how its tokens are drawn: sampling parameters and
the sampler (``sampling``, ``sampling_limits``), the request's own logits processing (``logits``) and
structured outputs (``structured``). Knows nothing of the cache, the scheduler or the server."""
