"""hotprefix: an LLM serving runtime whose prefix cache actually works."""
