"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex, choice, Lark or
GBNF grammar), compiled by llguidance, and the per-request matcher that masks the logits.

The library is llguidance (the Rust engine behind Guidance, one of vLLM's and SGLang's backends):
a wheel with no dependencies (xgrammar pulls in torch and its own build), JSON schemas, regexes
and Lark grammars (with ``%json`` inside a grammar: the tool-call grammars use it) in one
format, masks computed lazily in tens of microseconds a token with the GIL dropped, and an error
state instead of exceptions for bad input.

- ``StructuredOutputsParams``: what a request asks for, in vLLM's shape (exactly one of ``json``,
  ``regex``, ``choice``, ``grammar``, ``json_object``); ``SamplingParams.structured_outputs``.
- JSON schemas compile in llguidance's lenient mode (``JSON_OPTIONS``): a keyword no grammar can
  enforce (``uniqueItems``, what pydantic writes for a set) is left out and named in
  ``Grammar.unenforced``, which the server reports; a schema that cannot be honoured is refused.
- ``GrammarCompiler`` (one an engine): compiles and validates a spec against the model's
  vocabulary and keeps the compiled grammars in an LRU keyed by ``(scope, sha256 of the spec)``.
  The scope is the tenant's cache salt, so one tenant's compiled grammars are never another's
  (not even as a faster compile). A spec that does not compile is a ``GrammarError`` naming the
  library's message about that spec, never unconstrained output.
- ``GrammarState`` (one a request): the matcher. The next token's mask is computed in a worker
  thread right after a token is accepted, so it overlaps the next forward pass; the sampler
  waits for it (``allowed``) and sets every disallowed logit to -inf. The mask depends only on
  the grammar and the request's own tokens, so a constrained request's tokens do not depend on
  the batch or on cache hits.

Knows nothing about HTTP, the scheduler or the model; takes the Hugging Face tokenizer object.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch only where a mask meets the logits: the fleet front end imports this module
    import torch

MAX_SPEC_BYTES = 256 * 1024
"""Largest grammar or schema a request may give (bytes of its JSON text)."""
MAX_CHOICES = 1024
"""Most strings of a ``choice`` constraint."""
GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per engine (LRU over every tenant's)."""
MASK_THREADS = 2
"""Worker threads that compute next-token masks while the forward pass runs."""
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": True}
"""llguidance JSON options: one fixed spacing, so an output ends where its value ends (a model
cannot pad a JSON value with whitespace until max_tokens) and the same value is the same text;
``lenient``: a keyword the grammar cannot enforce (``uniqueItems``, ``not``, an unknown
``format``...) is compiled without that constraint and reported (``Grammar.unenforced``) instead of
refusing the schema: what pydantic writes for a ``set`` field compiles. A schema that cannot be
honoured at all (a bad type, a missing ``$ref``, an unsatisfiable one) is still refused."""


KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
              "choice": "choice", "grammar": "grammar"}


class GrammarError(ValueError):
    """A structured-output spec is malformed or does not compile; the message names the problem
    (and, for the API, ``param``: the request field it came from)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one field set."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict, or its JSON text): the output is one JSON value valid against it."""
    regex: str | None = None
    """A regular expression (Rust ``regex`` syntax, anchored): the output matches it whole."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) or a llama.cpp GBNF grammar."""
    json_object: bool | None = None
    """The output is some JSON object (OpenAI's ``response_format: json_object``)."""

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise GrammarError("structured outputs take exactly one of json, regex, choice, grammar, "
                               f"json_object; got {set_ or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise GrammarError("choice must be a non-empty list of strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise GrammarError(f"choice takes at most {MAX_CHOICES} strings")
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise GrammarError(f"{k} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise GrammarError("json must be a JSON schema (an object or its JSON text)")
        if len(self.source) > MAX_SPEC_BYTES:
            raise GrammarError(f"the structured-output spec is larger than {MAX_SPEC_BYTES} bytes")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The spec as one canonical text (what the cache key hashes)."""
        v = getattr(self, self.kind)
        if self.kind == "json" and isinstance(v, str):
            return v
        return v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False)

    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode("utf-8", "surrogatepass")).hexdigest()

    def grammar_text(self) -> str:
        """The llguidance grammar (a JSON document) of this spec; GrammarError if it cannot be built."""
        import llguidance as llg

        try:
            if self.kind == "json":
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError("the JSON schema must be an object")
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
            if self.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                              defaults=dict(JSON_OPTIONS))
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.regex or "")
            if self.kind == "choice":
                lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice or [])
                return llg.LLMatcher.grammar_from_lark(lark)
            return llg.grammar_from("grammar", self.grammar or "")
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {self.kind}: {e}") from None


def structured_from_vllm(value: Any) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` / ``guided_decoding`` value (a StructuredOutputsParams, a
    GuidedDecodingParams-like object, or a dict of its fields) as ours."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        value = {k: getattr(value, k, None) for k in ("json", "regex", "choice", "grammar", "json_object")}
    extra = [k for k, v in value.items()
             if k not in ("json", "regex", "choice", "grammar", "json_object") and v not in (None, False)]
    if extra:
        raise GrammarError(f"structured outputs: {', '.join(sorted(extra))} not supported (hotprefix "
                           "takes json, regex, choice, grammar, json_object)")
    return StructuredOutputsParams(**{k: v for k, v in value.items()
                                      if k in ("json", "regex", "choice", "grammar", "json_object")})


_UNIMPLEMENTED = re.compile(r"^Unimplemented keys?: (\[.*\])$")
_UNKNOWN_FORMAT = re.compile(r"^Unknown format: (.+)$")


def unenforced_keywords(warnings: list[str]) -> tuple[str, ...]:
    """The JSON-schema keywords llguidance's lenient mode compiled without enforcing, from its
    warnings (``uniqueItems``; an unknown format as ``format:NAME``), sorted, each once."""
    out: set[str] = set()
    for w in warnings:
        w = w.strip()
        m = _UNIMPLEMENTED.match(w)
        if m:
            try:
                out.update(str(k) for k in json.loads(m.group(1)))
            except ValueError:
                out.add(m.group(1))
            continue
        m = _UNKNOWN_FORMAT.match(w)
        if m:
            out.add(f"format:{m.group(1).strip()}")
    return tuple(sorted(out))


class Grammar:
    """A compiled, validated grammar: a template matcher that each request's state copies."""

    def __init__(self, template: Any, vocab_size: int, executor: ThreadPoolExecutor,
                 unenforced: tuple[str, ...] = ()):
        self._template = template
        self.vocab_size = vocab_size
        self._executor = executor
        self.unenforced = unenforced
        """JSON-schema keywords of the spec that the grammar does not enforce (lenient mode):
        the output may not satisfy them. Empty for every other spec."""

    def new_state(self) -> "GrammarState":
        return GrammarState(self._template.deep_copy(), self.vocab_size, self._executor)


class GrammarState:
    """One request's matcher and its next-token mask (computed in the background).

    Not thread-safe beyond its own contract: the engine thread calls ``allowed``, ``accept`` and
    ``fork``; the worker thread only fills the mask between ``accept`` and the next ``allowed``.
    """

    def __init__(self, matcher: Any, vocab_size: int, executor: ThreadPoolExecutor):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._executor = executor
        self._bits = np.empty((vocab_size + 31) // 32, dtype=np.int32)
        self._future: Future | None = None
        self._start()

    def _fill(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def _start(self) -> None:
        self._future = self._executor.submit(self._fill) if not self._matcher.is_stopped() else None

    def _wait(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None

    def _allowed(self) -> np.ndarray:
        self._wait()
        if self._matcher.is_error():
            raise RuntimeError(f"structured output: {self._matcher.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._vocab_size)
        return bits.view(np.bool_)

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (waits for the mask)."""
        import torch

        return torch.from_numpy(self._allowed().copy())

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token and start computing the next mask."""
        self._wait()
        if not self._matcher.consume_token(int(token_id)):
            raise RuntimeError(f"structured output: token {token_id} refused: {self._matcher.get_error()}")
        self._start()

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: no token may follow (the sequence ends here)."""
        self._wait()
        return bool(self._matcher.is_stopped())

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (n > 1 sequences)."""
        self._wait()
        return GrammarState(self._matcher.deep_copy(), self._vocab_size, self._executor)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([vocab], the row after bias and penalties) with every token the grammar
        disallows set to -inf, in place (``hotprefix.request.logits.RowInput.mask``). Columns past the
        grammar's vocabulary (padding of the model's) are disallowed too."""
        import torch

        allowed = self._allowed()
        n = min(logits.shape[0], allowed.shape[0])
        if logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype == torch.float32:
            # numpy, one thread: torch's masked_fill_ goes through its thread pool, 10-20x slower
            # on a busy machine for a vocabulary-sized row
            np.copyto(logits.numpy()[:n], -np.inf, where=~allowed[:n])
        else:
            logits[:n].masked_fill_(~torch.from_numpy(allowed[:n].copy()).to(logits.device), float("-inf"))
        if logits.shape[0] > n:
            logits[n:] = float("-inf")
        return logits


class GrammarCompiler:
    """Compiles structured-output specs against one tokenizer and vocabulary; an LRU of the
    compiled grammars keyed by (scope, spec digest). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]):
        """Args:
            tokenizer: ``hotprefix.text.tokenizer.Tokenizer``; its transformers object (``hf``) is
                asked for on the first constrained request only (it may import transformers).
        """
        self._text = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._cache: OrderedDict[tuple[str | None, str], Grammar] = OrderedDict()
        self._executor = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="hotprefix-grammar")

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:  # ~1 s: built on the first constrained request
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self._text.hf, n_vocab=max(self.vocab_size, self._text.vocab_size),
                    eos_token=self._eos or None)
            return self._lltok

    def compile(self, spec: StructuredOutputsParams, scope: str | None = None) -> Grammar:
        """The compiled grammar of ``spec`` for ``scope`` (a tenant's salt). Raises GrammarError
        with the library's message when the spec does not compile."""
        import llguidance as llg

        key = (scope, spec.digest())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        text = spec.grammar_text()
        tok = self._tokenizer()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tok)
        if is_error:
            raise GrammarError(f"the {KIND_NAMES[spec.kind]} does not compile: "
                               f"{(messages or ['unknown error'])[0].strip()}")
        matcher = llg.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {KIND_NAMES[spec.kind]} does not compile: {matcher.get_error()}")
        grammar = Grammar(matcher, max(self.vocab_size, self._text.vocab_size), self._executor,
                          unenforced_keywords(messages or []))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
