"""The checks of ``hotprefix lint``: volatile content before stable content in one prompt
(``volatile_findings``), system prompts that vary across one file's requests
(``sample_findings``), and a whole run over files with one tokenizer (``lint_files``).

Volatile text in the per-request tail (the final chat message, or template text after the first
stable placeholder such as ``{{ question }}``) is not reported: it changes per request anyway.
Knows the tokenizer; knows nothing about the KV pool or the engine.
"""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from hotprefix.lint.rendering import Prompt, render, token_index
from hotprefix.lint.report import Finding, Report, blocks, by_kind, cost, cost_words, short
from hotprefix.lint.samples import Field, Sample
from hotprefix.lint.sources import load_samples
from hotprefix.text.common import common_prefix_len
from hotprefix.text.tokenizer import Tokenizer
from hotprefix.text.volatile import Match, find_volatile, placeholder_matches


def _where(fld: Field | None, sample: Sample) -> str:
    if fld is None:
        return "text added by the chat template"
    if sample.kind == "template":
        return "template" if fld.path == "template" else fld.path
    if fld.role == "system":
        return f"system prompt ({fld.path})"
    if fld.role is None:
        return fld.path
    return f"{fld.role} message ({fld.path})"


def _matches(text: str, fld: Field | None) -> list[Match]:
    # a code reader's placeholders were judged by their values; literal code text never varies
    if fld is not None and fld.placeholders is not None:
        return placeholder_matches(fld.placeholders)
    return find_volatile(text)


def volatile_findings(prompt: Prompt, tok: Tokenizer, block_size: int) -> list[Finding]:
    """Volatile spans of one prompt that sit before stable content, with their reuse cost."""
    sample = prompt.sample
    # scan every located field, and the gaps between them (text the chat template itself adds)
    pieces: list[tuple[int, str, Field | None]] = []
    covered: list[tuple[int, int]] = []
    for fld, start in zip(sample.fields, prompt.field_starts):
        if start is not None:
            pieces.append((start, fld.text, fld))
            covered.append((start, start + len(fld.text)))
    covered.sort()
    cursor = 0
    for s, e in covered + [(len(prompt.text), len(prompt.text))]:
        if s > cursor:
            pieces.append((cursor, prompt.text[cursor:s], None))
        cursor = max(cursor, e)
    hits: list[tuple[int, Match, Field | None]] = []
    for start, text, fld in pieces:
        for m in _matches(text, fld):
            hits.append((start + m.start, m, fld))
    hits.sort(key=lambda h: h[0])
    spans = [(pos, pos + len(m.text)) for pos, m, _ in hits]

    findings: list[Finding] = []
    for pos, m, fld in hits:
        end = pos + len(m.text)
        if pos >= prompt.stable_end or not _stable_after(prompt.text, end, prompt.stable_end, spans):
            continue
        token = token_index(tok, prompt, pos)
        block, lost, blocks_lost = cost(len(prompt.token_ids), token, block_size)
        if fld is not None:
            line, col = fld.line_col(m.start)
        else:
            line, col = sample.line, None
        findings.append(Finding(
            kind=m.kind, file=sample.source.path, line=line, column=col,
            field=fld.path if fld is not None else "chat_template", text=m.text, token=token,
            block=block, tokens_lost=lost, blocks_lost=blocks_lost,
            message=(f'{m.kind} "{short(m.text)}" in {_where(fld, sample)} at token {token} '
                     + cost_words(block, lost, block_size)),
            details={"evaluates_to": m.cause} if m.cause else {},
        ))
    return findings


def _stable_after(text: str, end: int, stable_end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether stable words follow ``end`` before the per-request tail (other volatile spans and
    mere whitespace/punctuation do not count)."""
    i = end
    for s, e in spans:
        if e <= i or s >= stable_end:
            continue
        if any(c.isalnum() for c in text[i:min(s, stable_end)]):
            return True
        i = max(i, e)
    return any(c.isalnum() for c in text[i:stable_end])


def _mask(text: str) -> str:
    out, last = [], 0
    for m in find_volatile(text):
        out.append(text[last:m.start])
        out.append(f"<{m.kind}>")
        last = m.end
    return "".join(out) + text[last:]


def _same_template(a: str, b: str) -> bool:
    if _mask(a) == _mask(b):
        return True
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sm.real_quick_ratio() >= 0.5 and sm.quick_ratio() >= 0.5 and sm.ratio() >= 0.5


def _excerpt(text: str, at: int) -> str:
    lo, hi = max(0, at - 20), min(len(text), at + 30)
    return ("…" if lo else "") + text[lo:hi].replace("\n", "\\n") + ("…" if hi < len(text) else "")


def sample_findings(prompts: list[Prompt], block_size: int) -> tuple[list[Finding], dict[str, Any]]:
    """Cross-request checks over one file's prompts: ``system_prompt_varies`` and the shared prefix.

    Chat requests are grouped by template (system prompts equal once volatile spans are masked, or
    at least half similar); a group whose system prompts differ yields one finding at its first
    request that differs from the group's first.
    """
    stats: dict[str, Any] = {
        "file": prompts[0].sample.source.path, "requests": len(prompts),
        "shared_prefix_tokens": 0, "shared_prefix_blocks": 0,
    }
    shared = len(prompts[0].token_ids)
    for p in prompts[1:]:
        shared = min(shared, common_prefix_len(prompts[0].token_ids, p.token_ids))
    stats["shared_prefix_tokens"] = shared
    stats["shared_prefix_blocks"] = shared // block_size

    groups: list[list[Prompt]] = []
    for p in prompts:
        if p.sample.kind not in ("chat", "system"):
            continue
        sys_text = p.system_text or ""
        for g in groups:
            if _same_template(g[0].system_text or "", sys_text):
                g.append(p)
                break
        else:
            groups.append([p])
    findings: list[Finding] = []
    for g in groups:
        ref = g[0]
        variants = {p.system_text for p in g}
        if len(variants) < 2:
            continue
        other = next(p for p in g if p.system_text != ref.system_text)
        token = common_prefix_len(ref.token_ids, other.token_ids)
        group_shared = min(common_prefix_len(ref.token_ids, p.token_ids) for p in g)
        block, lost, blocks_lost = cost(len(other.token_ids), token, block_size)
        a, b = ref.system_text or "", other.system_text or ""
        at = common_prefix_len(a, b)
        line, col, path = other.sample.line, None, None
        sys_fields = [(f, owner) for f, owner in zip(other.sample.fields, other.sample.field_message)
                      if f.role == "system"]
        if sys_fields and other.system_text is not None:
            # the first differing character, mapped into the system field that holds it (parts of
            # one message are joined with nothing, system messages with a newline)
            off = at
            for k, (f, owner) in enumerate(sys_fields):
                if off <= len(f.text):
                    line, col = f.line_col(off)
                    path = f.path
                    break
                same_message = k + 1 < len(sys_fields) and sys_fields[k + 1][1] == owner
                off -= len(f.text) + (0 if same_message else 1)
        findings.append(Finding(
            kind="system_prompt_varies", file=other.sample.source.path, line=line, column=col,
            field=path, text=_excerpt(b, at), token=token, block=block, tokens_lost=lost,
            blocks_lost=blocks_lost,
            message=(f"system_prompt_varies: system prompt differs from line {ref.sample.line}'s at token {token} "
                     f"(block {block}): \"{_excerpt(a, at)}\" vs \"{_excerpt(b, at)}\"; "
                     f"{len(variants)} variants in {len(g)} requests share only {group_shared:,} "
                     f"tokens ({blocks(group_shared // block_size)}); costs {lost:,} tokens of "
                     "reuse per request"),
            details={"reference_line": ref.sample.line, "reference_excerpt": _excerpt(a, at),
                     "variant_excerpt": _excerpt(b, at), "num_variants": len(variants),
                     "num_requests": len(g), "shared_prefix_tokens": group_shared,
                     "shared_prefix_blocks": group_shared // block_size},
        ))
    return findings, stats


def lint_files(paths: Sequence[str], tok: Tokenizer, block_size: int) -> Report:
    """Volatile-content and cross-request checks over ``paths`` with one tokenizer.

    Raises:
        LintUsageError: an input file is missing or malformed.
    """
    per_file = [(p, load_samples(p)) for p in paths]
    findings: list[Finding] = []
    samples_stats: list[dict[str, Any]] = []
    warnings: list[str] = []
    num_prompts = 0
    for _, samples in per_file:
        prompts = [render(s, tok) for s in samples]
        num_prompts += len(prompts)
        for p in prompts:
            warnings += p.warnings
            findings += volatile_findings(p, tok, block_size)
        requests = [p for p in prompts if p.sample.kind != "template"]  # not a code file's templates
        if len(requests) > 1:
            more, stats = sample_findings(requests, block_size)
            findings += more
            samples_stats.append(stats)
    findings.sort(key=lambda f: (paths.index(f.file) if f.file in paths else -1, f.line or 0,
                                 f.column or 0, f.kind))
    summary = {
        "files": len(paths), "prompts": num_prompts, "findings": len(findings),
        "by_kind": by_kind(findings), "clean": not findings,
        "max_tokens_lost": max((f.tokens_lost for f in findings), default=0),
        "block_size": block_size, "tokenizer": tok.source,
        "tokenizer_fingerprint": tok.fingerprint, "samples": samples_stats, "warnings": warnings,
    }
    return Report(findings, summary)
