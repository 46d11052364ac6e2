"""``hotprefix lint``: static checks for the traps that silently disable prefix caching.

Reads prompt templates (.txt/.j2/.md...: the whole file is one prompt), JSON request files and JSONL
request logs, and the Python/JavaScript code that builds prompts (its f-strings, ``str.format`` and
``%`` templates, concatenations and template literals); renders each prompt the way the server
would (chat requests through the tokenizer's chat template), tokenizes it, and reports:

- volatile content (timestamps, dates, UUIDs, hex/trace ids, request ids, random numbers, counters,
  and placeholders in any common template language whose value is the time, a random value, a UUID,
  a counter or a request id: ``{{ now() }}``, ``{datetime.now().isoformat()}``, ``${Date.now()}``,
  ``%(ts)s``) that sits *before* stable content, with the token position where it starts and the
  prompt tokens it costs in lost reuse: everything from the start of the KV block holding it to
  the end of the prompt is recomputed whenever its value differs (the article's trap 1);
- ``system_prompt_varies``: requests in one file that look like the same template but whose system
  prompts differ, with the first differing token, excerpts of both sides and the shared prefix;
- with ``--tokenizers A B``: ``tokenizer_drift`` and ``tokenizer_fingerprint`` (trap 2).

Files: ``samples`` (what a read input is), ``jsonpos`` (JSON with file positions), ``sources``
(readers of request files and prompts, also used by ``hotprefix warm``), ``python_source``,
``python_module`` and ``js_source`` (templates in code), ``rendering`` (chat template + tokenizer), ``checks`` (volatile
content, varying system prompts, a whole run), ``drift`` (two tokenizers), ``report`` (findings and
their text), ``cli``. The detectors themselves live in ``hotprefix.text.volatile``, shared with the
runtime's miss diagnosis, which never imports this package.

This package knows nothing about the model's weights, the KV pool or the engine; it needs only a
tokenizer and imports no torch itself. Its names are imported lazily, so that reading request files
(``hotprefix.lint.sources``) does not load the tokenizer library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LintUsageError": "samples", "SourceFile": "samples", "Field": "samples", "Sample": "samples",
    "load_samples": "sources", "read_source": "sources", "is_code": "sources",
    "Prompt": "rendering", "render": "rendering", "token_index": "rendering",
    "Finding": "report", "Report": "report", "format_human": "report",
    "volatile_findings": "checks", "sample_findings": "checks", "lint_files": "checks",
    "check_drift": "drift",
    "main": "cli", "run": "cli", "add_arguments": "cli", "build_parser": "cli",
    "EXIT_CLEAN": "cli", "EXIT_FINDINGS": "cli", "EXIT_USAGE": "cli",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from hotprefix.lint.checks import lint_files, sample_findings, volatile_findings
    from hotprefix.lint.cli import (EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, add_arguments,
                                    build_parser, main, run)
    from hotprefix.lint.drift import check_drift
    from hotprefix.lint.rendering import Prompt, render, token_index
    from hotprefix.lint.report import Finding, Report, format_human
    from hotprefix.lint.samples import Field, LintUsageError, Sample, SourceFile
    from hotprefix.lint.sources import is_code, load_samples, read_source


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hotprefix.lint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hotprefix.lint.{module}"), name)
