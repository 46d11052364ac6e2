"""What a lint run reports: ``Finding``s with their reuse cost, the ``Report`` that holds them and a
summary, and the report as compiler-style text (``format_human``) or JSON (``Report.to_json``).

Knows nothing about tokenizers or input files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Finding:
    """One reported trap."""

    kind: str
    """timestamp, date, uuid, hex_id, request_id, random_number, counter, template_placeholder,
    system_prompt_varies, tokenizer_drift or tokenizer_fingerprint."""
    file: str | None
    """Input file (None for findings about the tokenizers themselves)."""
    line: int | None
    """1-based line in the file."""
    column: int | None
    """1-based column in the file (None when the text is not in the file verbatim)."""
    field: str | None
    """Where in the request: ``messages[0].content``, ``prompt``, ``system``, ``template``,
    ``chat_template`` (text the chat template added), or for a template in source code the name
    it is bound to and its syntax (``SYSTEM (f-string)``)."""
    text: str
    """The volatile text (or a short excerpt)."""
    token: int | None
    """0-based index of the first prompt token it changes."""
    block: int | None
    """0-based KV block holding that token."""
    tokens_lost: int
    """Prompt tokens from the start of that block to the end of the prompt: recomputed on every
    request whose value differs."""
    blocks_lost: int
    """Full KV blocks from that block on that can no longer be reused."""
    message: str
    """One human-readable sentence."""
    details: dict[str, Any] = field(default_factory=dict)
    """Kind-specific extras (what a placeholder evaluates to, excerpts, variant counts,
    per-tokenizer ids...)."""


def cost(num_tokens: int, token: int, block_size: int) -> tuple[int, int, int]:
    """``(block, tokens_lost, blocks_lost)`` of a change at ``token`` of a ``num_tokens`` prompt:
    nothing is lost when no full block starts there (a partial block is never cached)."""
    block = token // block_size
    blocks_lost = max(0, num_tokens // block_size - block)
    return block, num_tokens - block * block_size if blocks_lost else 0, blocks_lost


def cost_words(block: int, lost: int, block_size: int) -> str:
    """How a finding's cost reads: its block and the tokens of reuse it costs."""
    if not lost:
        return (f"(block {block}): no full block of {block_size} tokens starts there, so no reuse "
                "is lost at this block size")
    return f"(block {block}): costs {lost:,} tokens of reuse per request"


def blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def short(text: str, limit: int = 60) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class Report:
    """What one lint run found."""

    findings: list[Finding]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"findings": [asdict(f) for f in self.findings], "summary": self.summary}


def by_kind(findings: list[Finding]) -> dict[str, int]:
    return dict(sorted(Counter(f.kind for f in findings).items()))


def format_human(report: Report) -> str:
    """The report as compiler-style lines plus a summary."""
    lines = []
    for f in report.findings:
        loc = ":".join(str(x) for x in (f.file or "<tokenizers>", f.line, f.column) if x is not None)
        lines.append(f"{loc}: {f.message}")
    s = report.summary
    for w in s.get("warnings", []):
        lines.append(f"warning: {w}")
    for st in s.get("samples", []):
        lines.append(f"{st['file']}: {st['requests']} requests share a {st['shared_prefix_tokens']:,}"
                     f"-token prefix ({blocks(st['shared_prefix_blocks'])} of {s['block_size']} tokens)")
    drift = s.get("drift")
    if drift:
        ok = sum(1 for t in drift["texts"] if t.get("first_diff") is None and "error" not in t)
        lines.append(f"tokenizers: A={drift['tokenizer_a']} ({drift['fingerprint_a']}) "
                     f"B={drift['tokenizer_b']} ({drift['fingerprint_b']}); "
                     f"{ok} of {len(drift['texts'])} texts tokenize identically")
    if report.findings:
        kinds = ", ".join(f"{n} {k}" for k, n in s["by_kind"].items())
        lines.append(f"{s['findings']} finding{'s' if s['findings'] != 1 else ''} ({kinds}) in "
                     f"{s['prompts']} prompts from {s['files']} files; worst costs "
                     f"{s['max_tokens_lost']:,} tokens of reuse per request")
    else:
        lines.append(f"clean: {s['prompts']} prompts from {s['files']} files, no prefix-cache traps")
    return "\n".join(lines)
