"""Compatibility with other runtimes' names: vLLM's options, sampling fields, outputs and metrics
(``vllm``), translated at the edges (the offline ``LLM``, the CLI's flags, the metrics export)."""
