"""The ``hotprefix`` command line: every command is a real subcommand, config fields become flags."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import pytest

from hotprefix.cli import build_parser, main
from hotprefix.config.flags import add_config_flags
from hotprefix.config.sections import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig

COMMANDS = ("serve", "generate", "lint", "simulate", "warm")


def _hotprefix(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotprefix.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_help_lists_every_command():
    out = _hotprefix("--help")
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("positional arguments:")[1]
    for cmd in COMMANDS:
        assert f"\n    {cmd} " in listed, cmd


@pytest.mark.parametrize("cmd", ["lint", "simulate", "warm"])
def test_each_tool_has_its_own_help(cmd):
    out = _hotprefix(cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: hotprefix {cmd} ")
    assert "FILE" in out.stdout or "trace" in out.stdout


def test_serve_and_generate_help(capsys):
    for cmd in ("serve", "generate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert f"usage: hotprefix {cmd}" in capsys.readouterr().out


def test_every_config_field_is_a_flag():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = {a.dest: a for a in sub.choices["serve"]._actions}
    for dc in (ModelConfig, CacheConfig, SchedulerConfig, ServerConfig):
        for f in dataclasses.fields(dc):
            assert f.name in serve, f"{dc.__name__}.{f.name} has no serve flag"
            action = serve[f.name]
            default = tuple(action.default) if isinstance(action.default, list) else action.default
            assert default == f.default
            assert ("--" + f.name.replace("_", "-")) in action.option_strings
            if isinstance(f.default, bool):
                assert isinstance(action, argparse.BooleanOptionalAction), f.name
    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--block-size", "32",
                                      "--port", "9001"])
    assert args.enable_prefix_caching is False and args.block_size == 32 and args.port == 9001


def test_unknown_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-such-flag"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_passthrough_hands_the_rest_of_the_line_to_lint(monkeypatch):
    import hotprefix.lint

    seen = []
    monkeypatch.setattr(hotprefix.lint, "main", lambda argv: seen.append(argv) or 7)
    argv = ["a.txt", "--json", "--tokenizers", "x", "y", "--block-size=4", "--", "-b.txt"]
    assert main(["lint", *argv]) == 7
    assert seen == [argv]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class _Demo:
    """A demo section."""

    mode: Literal["a", "b"] = "a"
    """A literal."""
    color: Color = Color.RED
    """An enum."""
    names: tuple[str, ...] = ()
    """A tuple."""
    limit: int | None = None
    """An optional int."""
    fast: bool = False
    """A bool."""


def test_field_types_become_typed_flags():
    p = argparse.ArgumentParser()
    add_config_flags(p, (_Demo,))
    a = p.parse_args([])
    assert (a.mode, a.color, a.names, a.limit, a.fast) == ("a", Color.RED, [], None, False)
    a = p.parse_args(["--mode", "b", "--color", "blue", "--names", "x", "y", "--limit", "3", "--fast"])
    assert (a.mode, a.color, a.names, a.limit, a.fast) == ("b", Color.BLUE, ["x", "y"], 3, True)
    a = p.parse_args(["--names", "x", "--names", "y", "z"])  # repeatable (--kv-store a --kv-store b)
    assert a.names == ["x", "y", "z"]
    assert p.parse_args([]).names == []  # the default list is not shared between parses
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])
