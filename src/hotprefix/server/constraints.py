"""What an OpenAI-style request constrains its output to, from whichever field it used:
``response_format`` (OpenAI), ``structured_outputs`` and ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (vLLM), or a ``tool_choice`` that requires a call (the tool
grammar of ``server/tools.py``). One request, one constraint: two of them is a 400.

The spec is compiled here, in a worker thread before the request is queued, so a schema that does
not compile is a 400 naming the schema's error (and the field it came from), never a 500 and never
unconstrained output; the engine then finds the compiled grammar in its per-tenant cache.

Knows the request bodies and ``hotprefix.request.structured``; not the routes or the engine's internals.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from hotprefix.server import protocol as P
from hotprefix.server import tool_formats as F
from hotprefix.server import tools as T
from hotprefix.request.structured import GrammarError, StructuredOutputsParams, structured_from_vllm

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and its tool-call handling."""

    spec: StructuredOutputsParams | None = None
    """The grammar the output must match (None: unconstrained)."""
    param: str | None = None
    """The request field the spec came from (named in errors)."""
    tool_mode: str = "none"
    """``none``: no tool calls are read; ``auto``: calls are parsed from the text; ``required``:
    the grammar makes the answer one or more calls (a named function: a call of it)."""
    functions: list[T.Function] = field(default_factory=list)
    """The functions the answer may call."""
    parallel: bool = True
    """Several calls may be made in one answer (``parallel_tool_calls``)."""
    offered: list[T.Function] = field(default_factory=list)
    """Every function of ``tools``: all are rendered into the prompt, whatever ``tool_choice``
    says (so the prompt's prefix stays the same, and cached, across choices)."""
    format: F.ToolFormat = F.HERMES
    """How the model writes its calls (``server/tool_formats.py``, chosen from the chat template)."""
    unenforced: tuple[str, ...] = ()
    """JSON-schema keywords of the spec its grammar does not enforce (set by ``compile_for``);
    answered in the ``x-hotprefix-unenforced`` header (``unenforced_header``)."""


def _bad(message: str, param: str) -> P.APIError:
    return P.APIError(400, message, param=param, code="invalid_request_error")


def response_format_spec(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a spec (None for ``text`` or absent)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise _bad(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}",
                   "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema must be an object with name and schema",
                   "response_format.json_schema")
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not T.NAME_RE.match(name)):
        raise _bad("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
                   "response_format.json_schema.name")
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise _bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON schema object",
                   "response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)


def _vllm_specs(body: P._SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    out = []
    fields = [("structured_outputs", None), ("guided_json", "json"), ("guided_regex", "regex"),
              ("guided_choice", "choice"), ("guided_grammar", "grammar")]
    for name, key in fields:
        value = getattr(body, name)
        if value is None:
            continue
        try:
            spec = structured_from_vllm(value) if key is None else StructuredOutputsParams(**{key: value})
        except GrammarError as e:
            raise GrammarError(str(e), name) from None
        if spec is not None:
            out.append((name, spec))
    return out


def from_request(body: P.CompletionRequest | P.ChatCompletionRequest,
                 fmt: F.ToolFormat = F.HERMES) -> Constraint:
    """The request's constraint; an APIError (400) naming the field for anything malformed."""
    chat = isinstance(body, P.ChatCompletionRequest)
    return from_parts(body.response_format, body.tools if chat else None,
                      body.tool_choice if chat else None,
                      body.parallel_tool_calls if chat else None, fmt, body)


def from_parts(response_format: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
               tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None,
               fmt: F.ToolFormat = F.HERMES, vllm: P._SamplingFields | None = None) -> Constraint:
    """A constraint from OpenAI's fields (chat's shapes: ``response_format``, ``tools``,
    ``tool_choice``) and, with ``vllm``, that body's vLLM constraint fields; ``fmt``: how the
    model writes tool calls. An APIError (400) naming the field for anything malformed."""
    specs: list[tuple[str, StructuredOutputsParams]] = []
    try:
        rf = response_format_spec(response_format)
        if rf is not None:
            specs.append(("response_format", rf))
        if vllm is not None:
            specs += _vllm_specs(vllm)
        offered = T.parse_tools(tools)
        mode, functions = T.pick(offered, tool_choice)
        parallel = parallel_tool_calls is not False
        if mode == "required":
            named = isinstance(tool_choice, dict)
            specs.append(("tool_choice", fmt.grammar(functions, parallel and not named)))
            parallel = parallel and not named
    except GrammarError as e:
        raise _bad(str(e), e.param or "response_format") from None
    except T.ToolError as e:
        raise _bad(str(e), e.param) from None
    if len(specs) > 1:
        raise _bad(f"one output constraint per request: got {', '.join(n for n, _ in specs)}", specs[1][0])
    param, spec = specs[0] if specs else (None, None)
    return Constraint(spec, param, mode, functions, parallel, offered, fmt)


async def compile_for(engine: Any, c: Constraint, scope: str | None) -> Constraint:
    """Compile ``c``'s spec for the tenant ``scope`` in a worker thread (the engine's cache keeps
    it); a 400 naming the field and the library's message when it does not compile. Returns ``c``
    with the keywords its grammar does not enforce (``unenforced``)."""
    if c.spec is None:
        return c
    try:
        grammar = await asyncio.to_thread(engine.grammars.compile, c.spec, scope)
    except GrammarError as e:
        raise P.APIError(400, f"{c.param}: {e}", param=c.param, code="invalid_schema") from None
    unenforced = tuple(getattr(grammar, "unenforced", ()) or ())
    return replace(c, unenforced=unenforced) if unenforced else c


UNENFORCED_HEADER = "x-hotprefix-unenforced"
"""Response header naming the JSON-schema keywords the output constraint did not enforce."""


def unenforced_header(c: Constraint) -> dict[str, str]:
    """``{UNENFORCED_HEADER: "uniqueItems, format:foo"}`` when the constraint left keywords out."""
    return {UNENFORCED_HEADER: ", ".join(c.unenforced)} if c.unenforced else {}


def unenforced_warning(c: Constraint) -> list[dict[str, Any]]:
    """The same as a body field's list (``hotprefix.warnings``)."""
    if not c.unenforced:
        return []
    return [{"code": "unenforced_schema_keywords", "param": c.param, "keywords": list(c.unenforced),
             "message": f"the output constraint ({c.param}) does not enforce "
                        f"{', '.join(c.unenforced)}: the output may not satisfy them"}]


def answer(c: Constraint, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message for a finished answer (``content`` and, when it called tools,
    ``tool_calls``) and its finish reason (``tool_calls`` when it called and was not cut)."""
    if c.tool_mode == "none" or not c.functions:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = c.format.parse(text, c.functions, c.parallel)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    msg = {"role": "assistant", "content": content, "tool_calls": calls}
    return msg, ("tool_calls" if finish_reason == "stop" else finish_reason)
