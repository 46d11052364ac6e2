"""``hotprefix lint --tokenizers A B``: tokenize every input text with two tokenizers and report
where their prefix blocks part (``tokenizer_drift``) and whether their fingerprints differ
(``tokenizer_fingerprint``: hotprefix roots every block hash in it, so a change reuses nothing).

Knows the tokenizers; knows nothing about the KV pool or the engine.
"""

from __future__ import annotations

from typing import Any, Sequence

from hotprefix.lint.rendering import render
from hotprefix.lint.report import Finding, Report, by_kind, cost, short
from hotprefix.lint.samples import Sample
from hotprefix.lint.sources import load_samples
from hotprefix.text.common import common_prefix_len
from hotprefix.text.tokenizer import Tokenizer


def _render_ids(sample: Sample, tok: Tokenizer) -> tuple[list[int] | None, str | None]:
    if sample.kind in ("chat", "system") and not tok.chat_template:
        return None, f"{tok.source} has no chat template"
    p = render(sample, tok)
    return p.token_ids, None


def check_drift(paths: Sequence[str], tok_a: Tokenizer, tok_b: Tokenizer, block_size: int) -> Report:
    """Tokenize every input text with two tokenizers and report where their prefix blocks part.

    Chat requests are rendered with each tokenizer's own chat template, as each server would.

    Raises:
        LintUsageError: an input file is missing or malformed.
    """
    per_file = [(p, load_samples(p)) for p in paths]
    findings: list[Finding] = []
    texts: list[dict[str, Any]] = []
    if tok_a.fingerprint != tok_b.fingerprint:
        findings.append(Finding(
            kind="tokenizer_fingerprint", file=None, line=None, column=None, field=None,
            text=f"{tok_a.fingerprint} != {tok_b.fingerprint}", token=0, block=0, tokens_lost=0,
            blocks_lost=0,
            message=(f"tokenizer_fingerprint: fingerprints differ ({tok_a.fingerprint} vs {tok_b.fingerprint}): "
                     "hotprefix roots every block hash in the tokenizer fingerprint, so switching "
                     "reuses no cached block, even where the token ids agree"),
            details={"tokenizer_a": tok_a.source, "tokenizer_b": tok_b.source}))
    for _, samples in per_file:
        for s in samples:
            ids_a, err_a = _render_ids(s, tok_a)
            ids_b, err_b = _render_ids(s, tok_b)
            where = s.fields[0].path if s.kind != "chat" else "rendered chat prompt"
            entry: dict[str, Any] = {"file": s.source.path, "line": s.line, "field": where}
            if ids_a is None or ids_b is None:
                entry.update(error=err_a or err_b, blocks_match=False)
                texts.append(entry)
                findings.append(Finding(
                    kind="tokenizer_drift", file=s.source.path, line=s.line, column=None,
                    field=where, text="", token=0, block=0, tokens_lost=len(ids_a or ids_b or []),
                    blocks_lost=len(ids_a or ids_b or []) // block_size,
                    message=f"tokenizer_drift in {where}: {err_a or err_b}"))
                continue
            diff = common_prefix_len(ids_a, ids_b)
            full_a, full_b = len(ids_a) // block_size, len(ids_b) // block_size
            same_blocks = min(diff // block_size, full_a, full_b)
            identical = ids_a == ids_b
            entry.update(num_tokens_a=len(ids_a), num_tokens_b=len(ids_b),
                         first_diff=None if identical else diff, matching_blocks=same_blocks,
                         full_blocks=full_a, blocks_match=identical or same_blocks == full_a == full_b)
            texts.append(entry)
            if identical:
                continue
            block, lost, blocks_lost = cost(len(ids_a), diff, block_size)
            ta = tok_a.decode(ids_a[diff:diff + 4], skip_special_tokens=False)
            tb = tok_b.decode(ids_b[diff:diff + 4], skip_special_tokens=False)
            findings.append(Finding(
                kind="tokenizer_drift", file=s.source.path, line=s.line, column=None, field=where,
                text=short(ta, 40), token=diff, block=block, tokens_lost=lost,
                blocks_lost=blocks_lost,
                message=(f"tokenizer_drift in {where}: first differing token {diff} (block {block}): "
                         f"A {ids_a[diff:diff + 4]} \"{short(ta, 30)}\" vs B {ids_b[diff:diff + 4]} "
                         f"\"{short(tb, 30)}\"; {same_blocks} of {full_a} full blocks still match; "
                         f"costs {lost:,} tokens of reuse per request"),
                details={"num_tokens_a": len(ids_a), "num_tokens_b": len(ids_b),
                         "ids_a": ids_a[diff:diff + 8], "ids_b": ids_b[diff:diff + 8],
                         "matching_blocks": same_blocks, "full_blocks": full_a}))
    summary = {
        "files": len(paths), "prompts": len(texts), "findings": len(findings),
        "by_kind": by_kind(findings), "clean": not findings,
        "max_tokens_lost": max((f.tokens_lost for f in findings), default=0),
        "block_size": block_size,
        "drift": {"tokenizer_a": tok_a.source, "tokenizer_b": tok_b.source,
                  "fingerprint_a": tok_a.fingerprint, "fingerprint_b": tok_b.fingerprint,
                  "fingerprints_match": tok_a.fingerprint == tok_b.fingerprint, "texts": texts},
    }
    return Report(findings, summary)
