"""The model: loading weights (``loader``: GGUF or a Hugging Face directory; ``metadata``: the
torch-free facts about a model file, such as KV bytes per token), our Llama-family forward
(``llama``) and paged attention over block tables (``attention``).

Knows tensors and weights; knows nothing about the cache's keys, requests or text.
"""
