"""OpenAI-compatible request/response schemas (pydantic) and the error shape.

Requests are strict (no string-to-number coercion, no NaN/inf) and refuse unknown top-level fields,
as the OpenAI API does. A few extensions are accepted: ``top_k``, ``ignore_eos``, ``stop_token_ids``
and the ``hotprefix`` object (per-request cache retention). Parameters that exist in the OpenAI
API but that this server does not implement (``suffix``) are accepted only at their neutral value
and otherwise refused with a clear message. vLLM's ``repetition_penalty`` is accepted too.

Knows nothing about the engine or HTTP routing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotprefix.request.sampling_limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N

MAX_TTL_S = 86400.0
"""Longest retention pin a request may ask for (seconds)."""
MAX_PRIORITY = 1000
"""Retention priorities are clamped to [-MAX_PRIORITY, MAX_PRIORITY]."""
CACHE_KEY_PRIORITY = 1
"""Retention priority added for a request that carries a ``prompt_cache_key`` (under ``freq`` one
level is worth one doubling of a block's reuse count); the sum stays within MAX_PRIORITY."""
RETENTION_24H_S = 86400.0
"""Pin requested by ``prompt_cache_retention: "24h"`` (then clamped to the server's maximum TTL)."""
MAX_CACHE_KEY_CHARS = 1024
"""Longest ``prompt_cache_key`` accepted."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class APIError(Exception):
    """An error answered as OpenAI-style JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def check_encodable(value: Any) -> Any:
    """``value`` if every string in it can be encoded as UTF-8 (no lone surrogate such as
    ``"\\ud800"``, which JSON allows and a tokenizer cannot take); else ValueError."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the text contains a lone surrogate code point and is not valid "
                             "Unicode") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_encodable(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_encodable(k)
            check_encodable(v)
    return value


class _Checked(BaseModel):
    @field_validator("*")
    @classmethod
    def _encodable(cls, v: Any) -> Any:
        return check_encodable(v)


class _Strict(_Checked):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Lenient(_Checked):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    """Send a last chunk (empty choices) carrying ``usage``."""


class CacheControl(_Strict):
    """The ``hotprefix`` request extension: how this request's blocks are retained."""

    cache: Literal["none", "default"] | None = None
    """``none``: read the prefix cache but write nothing to it; ``default``: normal."""
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Retention priority of the blocks this request writes (higher = kept longer)."""
    ttl_s: float | None = Field(None, ge=0, le=MAX_TTL_S)
    """Pin the blocks this request writes for this many seconds (0 = no pin)."""


class _SamplingFields(_Strict):
    model: str = Field(..., max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=1e6)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    """Choices for the prompt, computed once (``server/logprobs.py``)."""
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=1e6)
    """vLLM's: over the prompt and output tokens, 1 = off."""
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    """Token id (as a string) -> bias in [-100, 100]."""
    user: str | None = None
    hotprefix: CacheControl | None = None
    prompt_cache_key: str | None = Field(None, max_length=MAX_CACHE_KEY_CHARS)
    """OpenAI's reuse hint: requests carrying a key are expected to recur, so their blocks are
    admitted even past ``--admission-tail-tokens`` and get CACHE_KEY_PRIORITY more retention. It
    never enters a block key: it cannot reach another tenant's blocks."""
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    """``24h`` pins the prompt's blocks for a day (within the server's maximum TTL and the pool's
    pin share); ``in_memory`` (the default) is ordinary retention."""
    response_format: dict[str, Any] | None = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}``
    (``server/constraints.py``)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""
    guided_json: str | dict[str, Any] | None = None
    """vLLM's older names for the same constraints."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """vLLM's choice of library: accepted and ignored (llguidance serves every constraint)."""


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (a string or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    """Return the prompt before the completion (with ``logprobs``, its tokens' log probabilities)."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str = Field(..., max_length=64)
    arguments: str = ""
    """The arguments as JSON text (OpenAI's shape)."""


class ToolCall(_Lenient):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls, sent back with the conversation."""
    tool_call_id: str | None = Field(None, max_length=256)
    """A ``tool`` turn's answer to that call."""


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class WarmRequest(_Strict):
    """``POST /v1/cache/warm``: prefill these prompts (one token each) so the next user hits."""

    prompts: list[str | list[int]] | None = Field(None, max_length=256)
    messages: list[list[ChatMessage]] | None = Field(None, max_length=256)
    model: str | None = None


def unsupported(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, str] | None:
    """(param, message) for the first OpenAI parameter set to a value this server cannot honor."""
    checks: list[tuple[str, bool]] = []
    if isinstance(req, CompletionRequest):
        checks += [("suffix", bool(req.suffix))]
    for param, bad in checks:
        if bad:
            return param, f"{param} is not supported by this server (use its default)"
    return None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them (text parts joined)."""
    out = []
    for m in messages:
        if isinstance(m.content, list):
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": int(num_cached)}}
