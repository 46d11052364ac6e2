"""What the front end tells the router about a request: its block keys, computed exactly as the
replica that serves it will compute them.

The same tokenizer (loaded from the replicas' model), the same chat template and conversion of
OpenAI and Anthropic bodies (``hotprefix.server.protocol``, ``anthropic_protocol``), the same
namespace (model + tokenizer fingerprints, reported by a replica) and the same tenant salt (the
same key file, ``hotprefix.server.tenants``) as the single server: the keys match the replicas'
KV events byte for byte.

A body the router cannot read (bad JSON, a bad key, too long) gets an empty hint: it is routed by
load, and the replica answers it with the single server's error. Knows nothing about Ray. Imports
no torch.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError

from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.server import anthropic_protocol as A
from hotprefix.server import protocol as P
from hotprefix.server.tenants import AuthError, TenantRegistry, bearer_key
from hotprefix.text.tokenizer import Tokenizer, TokenizerError

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
"""Routes whose requests are routed by their prompt (the rest by load)."""


@dataclass(frozen=True)
class RouteHint:
    """One request, as the request router sees it (passed as the ``hotprefix_route`` keyword)."""

    keys: tuple[BlockKey, ...] = ()
    """Block keys of the prompt's full blocks (tenant salt included)."""
    num_tokens: int = 0
    """Prompt tokens."""
    prompt_cache_key: str | None = None
    """OpenAI's ``prompt_cache_key`` (an affinity key), scoped to the tenant."""
    fleet_seq: int | None = None
    """The front end's number for the request (``x-hotprefix-fleet-seq``), when it numbers them:
    the replica reports the numbers its scheduler holds, so the router knows which of the requests
    it sent there a report already counts."""


class PromptKeys:
    """Computes ``RouteHint``s from raw HTTP requests (see the module docstring).

    Args:
        tokenizer: the replicas' tokenizer.
        namespace: the replicas' namespace key (``LLMEngine.namespace``).
        block_size: the replicas' block size.
        hash_algo: the replicas' hash (``sha256``; ``fast`` is valid inside one process only).
        tenants: the replicas' key file.
        max_model_len: the replicas' context length (longer prompts are not tokenized here).
    """

    def __init__(self, tokenizer: Tokenizer, namespace: BlockKey, block_size: int, hash_algo: str,
                 tenants: TenantRegistry, max_model_len: int):
        self.tokenizer = tokenizer
        self.hasher = BlockHasher(namespace, block_size, hash_algo)
        self.block_size = block_size
        self.tenants = tenants
        self.max_bytes = max_model_len * tokenizer.max_token_bytes
        self._lock = threading.Lock()  # one tokenization at a time, as the server's

    def hint(self, path: str, headers: Mapping[str, str], body: bytes) -> RouteHint:
        """The hint of one request (``headers`` with lower-case names); empty when unreadable."""
        if path not in ROUTED_PATHS or len(body) > 2 * self.max_bytes:
            return RouteHint()
        try:
            tenant = self.tenants.authenticate(bearer_key(headers))
            with self._lock:
                ids, cache_key = self._prompt(path, json.loads(body))
        except (AuthError, ValidationError, TokenizerError, ValueError, TypeError, P.APIError):
            return RouteHint()
        if not ids:
            return RouteHint()
        n = len(ids) // self.block_size
        keys = self.hasher.keys(ids[:n * self.block_size], tenant.salt,
                                tenant.shared_prefix_tokens // self.block_size)
        scoped = None if cache_key is None else f"{tenant.name}\0{cache_key}"
        return RouteHint(tuple(keys), len(ids), scoped)

    def _prompt(self, path: str, data: Any) -> tuple[list[int], str | None]:
        tok = self.tokenizer
        if path == "/v1/chat/completions":
            chat = P.ChatCompletionRequest.model_validate(data)
            return tok.encode_chat(P.message_dicts(chat.messages)), chat.prompt_cache_key
        if path == "/v1/completions":
            comp = P.CompletionRequest.model_validate(data)
            prompt: Any = comp.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0] if len(prompt) == 1 else ""
            ids = tok.encode(prompt) if isinstance(prompt, str) and prompt else list(prompt or [])
            return [int(i) for i in ids], comp.prompt_cache_key
        msg = A.MessagesRequest.model_validate(data)
        return A.encode_prompt(tok, A.conversation(msg).prompt), None
