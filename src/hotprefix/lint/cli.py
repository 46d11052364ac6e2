"""``hotprefix lint FILE... [--json] [--tokenizer PATH | --tokenizers A B] [--block-size N]``.

Exit status: 0 clean, 1 findings, 2 bad usage (missing file, unreadable JSON or Python, bad flags).
``add_arguments`` and ``run`` let a parent parser mount the command as a real subcommand; ``main``
parses ``argv`` itself. Knows nothing about the model's weights beyond where the default
tokenizer lives.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from hotprefix.config.sections import CacheConfig
from hotprefix.lint.checks import lint_files
from hotprefix.lint.drift import check_drift
from hotprefix.lint.report import format_human
from hotprefix.lint.samples import LintUsageError
from hotprefix.lint.sources import check_input_file
from hotprefix.text.tokenizer import Tokenizer, TokenizerError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

DESCRIPTION = ("Static checks for prompt templates, request samples and the code that builds "
               "prompts, for what would defeat the prefix cache: volatile content before stable "
               "content, system prompts that vary between requests, tokenizer drift. Exit status: "
               "0 clean, 1 findings, 2 bad usage.")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` returns 2 rather than raising."""

    def error(self, message: str) -> NoReturn:
        raise LintUsageError(f"{message}\n{self.format_usage().rstrip()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


class _Exit(Exception):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the lint command's arguments to ``p`` (its own parser, or a subcommand's)."""
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="prompt templates (.txt/.j2/.md...), JSON requests (.json), JSONL "
                        "request logs (.jsonl), or Python/JavaScript/TypeScript source whose "
                        "f-strings, str.format/%% templates and template literals build prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object {findings, summary}")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer (.gguf, HF directory or tokenizer.json); default: the "
                            "default model's")
    group.add_argument("--tokenizers", nargs=2, metavar=("A", "B"),
                       help="drift check: tokenize every text with A and with B and report where "
                            "their prefix blocks stop matching")
    p.add_argument("--block-size", type=_positive, default=CacheConfig.block_size, metavar="N",
                   help=f"tokens per KV block (default {CacheConfig.block_size})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hotprefix lint", description=DESCRIPTION)
    add_arguments(p)
    return p


def _load_tokenizer(path: str | None) -> Tokenizer:
    if path is None:
        from hotprefix.model.loader import ModelLoadError, default_model_path  # needs torch: lazily
        try:
            path = default_model_path()
        except ModelLoadError as e:
            raise LintUsageError(f"{e}; or pass --tokenizer PATH") from e
    try:
        return Tokenizer.load(path)
    except TokenizerError as e:
        raise LintUsageError(str(e)) from e


def run(args: argparse.Namespace) -> int:
    """Lint with parsed arguments (see ``add_arguments``); prints the report.

    Returns:
        0 when clean, 1 on findings, 2 on bad usage (the message goes to stderr).
    """
    try:
        for path in args.files:  # fail on a missing input before spending seconds on a tokenizer
            check_input_file(path)
        if args.tokenizers:
            tok_a, tok_b = (_load_tokenizer(p) for p in args.tokenizers)
            report = check_drift(args.files, tok_a, tok_b, args.block_size)
        else:
            report = lint_files(args.files, _load_tokenizer(args.tokenizer), args.block_size)
    except LintUsageError as e:
        sys.stderr.write(f"hotprefix lint: error: {e}\n")
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        print(format_human(report))
    return EXIT_FINDINGS if report.findings else EXIT_CLEAN


def main(argv: list[str]) -> int:
    """``hotprefix lint FILE... [--json] [--tokenizer PATH | --tokenizers A B] [--block-size N]``.

    Returns:
        0 when clean, 1 on findings, 2 on bad usage (the message goes to stderr).
    """
    try:
        args = build_parser().parse_args(argv)
    except _Exit as e:
        return e.status
    except LintUsageError as e:
        sys.stderr.write(f"hotprefix lint: error: {e}\n")
        return EXIT_USAGE
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
