"""hotprefix: an LLM serving runtime whose prefix cache actually works."""

from hotprefix.llm import LLM
from hotprefix.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
