"""hotprefix: an LLM serving runtime whose prefix cache actually works.

``LLM`` and ``SamplingParams`` are imported lazily so that torch-free parts (``hotprefix.cache``,
``hotprefix.lint``, the simulator) do not pull in torch.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from hotprefix.llm import LLM
    from hotprefix.request.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from hotprefix.llm import LLM
        return LLM
    if name == "SamplingParams":
        from hotprefix.request.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
