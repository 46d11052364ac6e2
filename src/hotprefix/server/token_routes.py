"""Token utilities: ``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and response
shapes, llama-server's accepted too) and Anthropic's ``POST /v1/messages/count_tokens``.

They tokenize exactly as the generation routes do (the same functions: ``generate.text_prompt``,
``generate.chat_prompt_and_ends`` with the request's tools, ``messages.prompt_and_hints``), so a
count equals ``usage.prompt_tokens`` (``input_tokens``) of the same request. They never touch the
KV pool, the prefix cache or another tenant's anything: the answer depends only on the body and
the model's tokenizer (a caller still needs a valid key where keys are configured).

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or
  ``{"messages": [...], "add_generation_prompt": true, "tools": [...]}`` (llama-server's
  ``{"content", "add_special", "with_pieces"}`` too) -> ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs`` with ``return_token_strs``; llama-server's ``with_pieces`` gives
  ``tokens`` as ``[{"id", "piece"}]``, each token's text).
- ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}`` (and llama-server's ``content``).
- ``/v1/messages/count_tokens``: a Messages API body without ``max_tokens`` ->
  ``{"input_tokens": n}``, errors in Anthropic's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import Field

from hotprefix.server import anthropic_protocol as A
from hotprefix.server import anthropic_tools as AT
from hotprefix.server import protocol as P
from hotprefix.server import tools as T
from hotprefix.server.deps import get_state, tenant_dep
from hotprefix.server.generate import chat_prompt_and_ends, check_model, text_prompt
from hotprefix.server.messages import AnthropicRoute, prompt_and_hints
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import Tenant

MAX_DETOKENIZE = 1 << 20
"""Most token ids one ``/detokenize`` takes."""

router = APIRouter()
anthropic_router = APIRouter(route_class=AnthropicRoute)


class TokenizeRequest(P._Lenient):
    """``POST /tokenize``: a prompt, or chat messages (exactly one)."""

    model: str | None = Field(None, max_length=512)
    prompt: str | None = None
    content: str | None = None
    """llama-server's name for ``prompt``."""
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """The tokenizer's BOS/EOS around a prompt (default true); for messages (default false) the
    chat template places its own."""
    add_special: bool | None = None
    """llama-server's name for ``add_special_tokens``."""
    add_generation_prompt: bool = True
    """Messages: end with the assistant turn's opening, as a chat request's prompt does."""
    tools: list[dict[str, Any]] | None = None
    """Messages: the request's tools, rendered as a chat request renders them."""
    return_token_strs: bool = False
    """vLLM's: each token's text (``token_strs``)."""
    with_pieces: bool = False
    """llama-server's: ``tokens`` as ``[{"id", "piece"}]``."""


class DetokenizeRequest(P._Lenient):
    model: str | None = Field(None, max_length=512)
    tokens: list[int] = Field(..., max_length=MAX_DETOKENIZE)


class CountTokensRequest(A.MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages body; ``max_tokens`` not needed."""

    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, tenant: Tenant = Depends(tenant_dep),
                   state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    prompt = body.prompt if body.prompt is not None else body.content
    if (prompt is None) == (body.messages is None):
        raise P.APIError(400, "give exactly one of prompt (or content) and messages", param="prompt")
    special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
    if body.messages is not None:
        try:
            functions = T.parse_tools(body.tools)
        except T.ToolError as e:
            raise P.APIError(400, str(e), param=e.param) from None
        ids, _ = await chat_prompt_and_ends(state, body.messages, functions=functions, ends=False,
                                            add_generation_prompt=body.add_generation_prompt)
        if special:  # vLLM: the tokenizer's specials around the rendered template
            ids = state.tokenizer.add_specials(ids)
    elif special is False:
        ids = await state.encode(state.tokenizer.encode, prompt, False) if prompt else []
    else:
        ids = await text_prompt(state, prompt, "prompt") if prompt else []
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:  # vLLM's: the vocabulary's pieces (``Ġworld``)
        out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    if body.with_pieces:  # llama-server's: each token's text
        out["tokens"] = [{"id": i, "piece": state.tokenizer.decode([i], skip_special_tokens=False,
                                                                   continuation=n > 0)}
                         for n, i in enumerate(ids)]
    return JSONResponse(out)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, tenant: Tenant = Depends(tenant_dep),
                     state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < state.tokenizer.vocab_size), None)
    if bad is not None:
        raise P.APIError(400, f"tokens[{bad}] = {body.tokens[bad]} is not a token id of this model "
                              f"(0..{state.tokenizer.vocab_size - 1})", param=f"tokens[{bad}]")
    text = await state.encode(state.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text, "content": text})


@anthropic_router.post(A.MESSAGES_PATH + "/count_tokens")
async def count_tokens(body: CountTokensRequest, tenant: Tenant = Depends(tenant_dep),
                       state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    constraint = AT.constraint(body.tools, body.tool_choice, state.tool_format)
    ids, _ = await prompt_and_hints(state, A.conversation(body), constraint.offered)
    return JSONResponse({"input_tokens": len(ids)})
