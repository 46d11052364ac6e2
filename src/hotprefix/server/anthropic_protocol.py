"""Anthropic Messages API schemas (pydantic): the request, its conversion to the chat template's
messages with its cache breakpoints, the usage figures and the error shape of that API.

Requests are strict as the OpenAI ones are (exact JSON types, unknown fields refused). Content is
text, ``tool_use`` and ``tool_result`` blocks (tools: ``server/anthropic_tools.py``); other block
types (images, documents) are refused with a clear 400.

``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` may mark system blocks, message
content blocks and the request itself (top level: the whole prompt). Each mark is a *breakpoint*:
the prompt up to it should stay cached for its TTL. ``conversation`` returns the prompt and, for
each breakpoint, the prompt cut just after the marked block; the route tokenizes both and takes
their common prefix as the breakpoint's end token.

Knows nothing about the engine or HTTP routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from hotprefix.server.anthropic_tools import history
from hotprefix.server.protocol import APIError, _Strict
from hotprefix.text.tokenizer import Tokenizer

CACHE_TTLS_S = {"5m": 300.0, "1h": 3600.0}
"""Seconds of each ``cache_control.ttl`` (``5m`` when omitted), before the server's maximum TTL."""
MAX_BREAKPOINTS = 4
"""Most blocks with ``cache_control`` in one request (the top-level mark counts), as Anthropic's."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's ``error.type`` for each HTTP status this server answers on ``/v1/messages``."""


MESSAGES_PATH = "/v1/messages"
"""The Messages API's route (and the prefix of any route under it)."""


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is the Messages API's (its errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for an HTTP status."""
    typ = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": typ, "message": message}}


class CacheControlEphemeral(_Strict):
    """A cache breakpoint: keep the prompt up to here cached for ``ttl``."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None
    """``5m`` (the default) or ``1h``."""

    @property
    def ttl_s(self) -> float:
        return CACHE_TTLS_S[self.ttl or "5m"]


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControlEphemeral | None = None


class ToolUseBlock(_Strict):
    """An assistant's call of a tool, sent back with the conversation."""

    type: Literal["tool_use"]
    id: str = Field(..., max_length=256)
    name: str = Field(..., max_length=64)
    input: dict[str, Any]
    cache_control: CacheControlEphemeral | None = None


class ToolResultBlock(_Strict):
    """A tool's answer to the call ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControlEphemeral | None = None


def _text_blocks_only(value: Any, what: str, allowed: tuple[str, ...] = ("text",)) -> Any:
    if isinstance(value, list):
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                raise ValueError(f"{what} blocks of type '{kind}' are not supported by this server "
                                 f"({', '.join(allowed)} blocks only)")
    return value


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _text_blocks_only(data.get("content"), "content", ("text", "tool_use", "tool_result"))
        return data


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)
    """An opaque id of the end user; accepted and not used."""


class MessagesRequest(_Strict):
    """``POST /v1/messages``: a conversation through the model's chat template."""

    model: str = Field(..., max_length=512)
    messages: list[Message]
    max_tokens: int = Field(..., ge=1)
    system: str | list[TextBlock] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    cache_control: CacheControlEphemeral | None = None
    """A breakpoint at the end of the whole prompt (Anthropic's automatic caching)."""
    tools: list[dict[str, Any]] | None = None
    """Client tools ``{name, description, input_schema}`` (``server/anthropic_tools.py``)."""
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _text_blocks_only(data.get("system"), "system")
        return data


def unsupported(req: MessagesRequest) -> tuple[str, str] | None:
    """(param, message) for the first parameter set to something this server cannot honor."""
    if req.thinking and req.thinking.get("type") != "disabled":
        return "thinking", "extended thinking is not supported by this server"
    return None


@dataclass(frozen=True)
class Prompt:
    """A conversation as the tokenizer takes it: chat template messages (system first) and, when
    the last message is the assistant's, its text to continue (Anthropic's prefill)."""

    messages: list[dict[str, Any]]
    prefill: str | None = None


@dataclass
class Conversation:
    """The request's prompt and its breakpoints (each: the prompt cut after the marked block)."""

    prompt: Prompt
    breakpoints: list[tuple[Prompt, float]] = field(default_factory=list)
    """``(prompt up to and including the marked block, ttl_s)`` in request order."""
    whole_prompt_ttl_s: float | None = None
    """TTL of the top-level ``cache_control`` (a breakpoint after the last block), if any."""


def _join(blocks: list[TextBlock]) -> str:
    return "".join(b.text for b in blocks)


def _prompt(messages: list[dict[str, Any]]) -> Prompt:
    if messages and messages[-1]["role"] == "assistant":
        return Prompt(messages[:-1], messages[-1]["content"])
    return Prompt(messages)


def conversation(req: MessagesRequest) -> Conversation:
    """The chat template's messages (the system prompt first, text blocks joined) and the prompt
    cut at each ``cache_control`` mark.

    Raises:
        APIError: no messages, or more than MAX_BREAKPOINTS marks.
    """
    if not req.messages:
        raise APIError(400, "messages: at least one message is required", param="messages")
    msgs: list[dict[str, Any]] = []
    cuts: list[tuple[list[dict[str, Any]], float]] = []
    if isinstance(req.system, list):
        for k, block in enumerate(req.system):
            if block.cache_control is not None:
                cuts.append(([{"role": "system", "content": _join(req.system[:k + 1])}],
                             block.cache_control.ttl_s))
        system = _join(req.system)
    else:
        system = req.system or ""
    if system:
        msgs.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, list):
            for k, block in enumerate(m.content):
                if block.cache_control is not None:
                    cuts.append((msgs + history(m.role, m.content[:k + 1]), block.cache_control.ttl_s))
            msgs += history(m.role, m.content)
        else:
            msgs.append({"role": m.role, "content": m.content})
    marks = len(cuts) + (req.cache_control is not None)
    if marks > MAX_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                            f"provided. Found {marks}.", param="cache_control")
    return Conversation(_prompt(msgs), [(_prompt(c), ttl) for c, ttl in cuts],
                        req.cache_control.ttl_s if req.cache_control is not None else None)


def usage(num_prompt: int, num_output: int, num_cached: int, written_blocks: int,
          block_size: int) -> dict[str, int]:
    """Anthropic's usage: ``cache_read_input_tokens`` came from the prefix cache,
    ``cache_creation_input_tokens`` were written to it by this request (its written blocks, at most
    the prompt's full blocks that were not read: a block that the answer completes is not prompt),
    ``input_tokens`` the prompt tokens neither read nor written; the three add up to the prompt."""
    full_prompt = num_prompt // block_size * block_size
    creation = max(0, min(written_blocks * block_size, full_prompt - num_cached))
    return {"input_tokens": num_prompt - num_cached - creation,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": num_cached,
            "output_tokens": num_output}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    """Anthropic's ``stop_reason`` for the engine's finish reason."""
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, tools: list[dict[str, Any]] | None = None,
                  scope: str | None = None) -> list[int]:
    """Token ids of a conversation; a final assistant message is continued, not closed.
    ``tools``: for a template that renders them (``Tokenizer.renders_tools``); ``scope``: the
    tokenizer's prefix-cache scope (``Tokenizer.encode``)."""
    if prompt.prefill is None:
        return tokenizer.encode_chat(prompt.messages, tools=tools, scope=scope)
    text = tokenizer.render_chat(prompt.messages, add_generation_prompt=True, tools=tools) + prompt.prefill
    return tokenizer.encode(text, add_special_tokens=False, scope=scope)
