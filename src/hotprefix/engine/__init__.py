"""The engine: requests, continuous batching and the step loop.

  * ``engine``        ``LLMEngine``: add_request / step / abort; builds the pieces from the config
  * ``request``       ``Request``: a request's tokens, progress and timings
  * ``scheduler``     admission (cache-aware, fair), chunked prefill, preemption
  * ``runner``        the model and the KV pool tensors; one forward pass per step
  * ``kv_io``         whole KV blocks to bytes and back, for the KV tiers
  * ``detokenizer``   incremental decoding and stop strings, linear in the output
  * ``async_engine``  the engine in its own thread, with an asyncio front for the server

Knows the model, the cache and the tokenizer; knows nothing about HTTP, tenants' keys or routing.
"""
