"""The command line's flags, built from the config dataclasses: one place that both the CLI
(``hotprefix.cli``) and the fleet's Ray Serve entry (``hotprefix.fleet.app.build_app``) import.

Every field of a config dataclass becomes a flag whose type, default and help text are read from
the field (``add_config_flags``), so a default is written in one place only and a new field becomes
a flag by itself. ``add_serve_flags`` adds ``hotprefix serve``'s whole set (engine, server, fleet and
router sections, ``--api-key``) and returns each spelling's action, so a caller that turns a mapping
into a command line (``serve_argv``) needs no argparse internals.

This is the command line's edge for vLLM's names: ``vllm serve``'s spellings are flag aliases
(``--gpu-memory-utilization``), its options hotprefix lacks are hidden flags answered with an error
naming them, and its value spellings (``--dtype half``) are translated in ``engine_config_from_args``
(through ``hotprefix.compat.vllm``); the dataclasses (``hotprefix.config.sections``) know nothing of
vLLM. Knows nothing of the engine, the server or Ray: nothing heavy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any, Mapping

from hotprefix.compat.vllm import UNSUPPORTED, engine_options, flag_aliases, rejection
from hotprefix.config.sections import (CacheConfig, ConfigError, EngineConfig, ModelConfig,
                                       SchedulerConfig, ServerConfig, field_docs)
from hotprefix.fleet.config import FleetConfig
from hotprefix.router.config import RouterConfig

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)
"""The config dataclasses of the engine, whose flags ``serve`` and ``generate`` both take."""

Actions = dict[str, argparse.Action]
"""Flag spelling (``--block-size``) -> the parser's action for it."""


def _base_type(tp: Any) -> Any:
    """``X | None`` -> ``X`` (the first non-None member of a union); anything else unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _flag_kwargs(tp: Any) -> dict[str, Any]:
    """``add_argument`` keywords that parse a value of the (resolved) field type ``tp``."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        return {"type": type(choices[0]), "choices": choices}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": tp, "choices": list(tp), "metavar": "{" + ",".join(str(m.value) for m in tp) + "}"}
    if origin in (list, tuple, set, frozenset):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else str
        # repeatable and multi-valued: --kv-store a --kv-store b, or --kv-store a b
        return {"type": _base_type(item) if isinstance(_base_type(item), type) else str,
                "nargs": "+", "action": "extend"}
    if tp in (int, float, str):
        return {"type": tp}
    return {"type": str}  # any other type: the dataclass (or its validation) converts the text


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _spellings(action: argparse.Action) -> Actions:
    return {s: action for s in action.option_strings}


def add_config_flags(parser: argparse.ArgumentParser, sections, skip: tuple[str, ...] = (),
                     aliases: dict[str, list[str]] | None = None) -> Actions:
    """One flag per field of each config dataclass in ``sections``: ``--field-name``, typed from
    the field's annotation (bool -> ``--x/--no-x``), default and help from the field; ``aliases``
    maps a field to more spellings of its flag (vLLM's). Returns every spelling's action."""
    aliases = aliases or {}
    added: Actions = {}
    for dc in sections:
        group = parser.add_argument_group(dc.__name__, (dc.__doc__ or "").strip())
        docs = field_docs(dc)
        hints = typing.get_type_hints(dc)  # annotations are strings under `from __future__ import annotations`
        for f in dataclasses.fields(dc):
            if f.name in skip or not f.init:
                continue
            default = _field_default(f)
            if isinstance(default, tuple):
                default = list(default)  # argparse's "extend" appends to a list
            help_ = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
            added |= _spellings(group.add_argument(
                "--" + f.name.replace("_", "-"), *aliases.get(f.name, ()), dest=f.name,
                default=default, help=help_, **_flag_kwargs(_base_type(hints[f.name]))))
    return added


def add_engine_flags(parser: argparse.ArgumentParser) -> Actions:
    """The engine's flags (``ENGINE_SECTIONS``), with vLLM's spellings as aliases."""
    return add_config_flags(parser, ENGINE_SECTIONS, aliases=flag_aliases())


VLLM_DEST = "vllm_unsupported_"
"""Prefix of the hidden ``serve`` flags that catch vLLM options hotprefix does not have."""


def add_vllm_unsupported_flags(parser: argparse.ArgumentParser, taken: Actions) -> Actions:
    """Hidden flags for vLLM's options that hotprefix lacks (those not already in ``taken``), so
    ``check_vllm_unsupported`` can name them (and accept the values that ask for what hotprefix does
    anyway, such as ``--tensor-parallel-size 1``)."""
    added: Actions = {}
    for name, entry in UNSUPPORTED.items():
        flag = "--" + name.replace("_", "-")
        if flag in taken:
            continue
        kwargs: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if entry.switch
                                  else {"type": str})
        added |= _spellings(parser.add_argument(flag, dest=VLLM_DEST + name, default=argparse.SUPPRESS,
                                                help=argparse.SUPPRESS, **kwargs))
    return added


def check_vllm_unsupported(args: argparse.Namespace) -> None:
    """Raises ConfigError for the first vLLM flag given with a value hotprefix cannot honour."""
    for name, entry in UNSUPPORTED.items():
        if hasattr(args, VLLM_DEST + name):
            why = rejection(name, getattr(args, VLLM_DEST + name), entry, flag=True)
            if why:
                raise ConfigError(why)


def add_serve_flags(parser: argparse.ArgumentParser) -> Actions:
    """``hotprefix serve``'s arguments: the model, the engine's, server's, fleet's and routing core's
    flags, ``--api-key`` and vLLM's hidden ones. Returns every flag spelling's action."""
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                        help="a .gguf file or HF directory (default: the embedded SmolLM2-135M-Instruct)")
    actions = add_engine_flags(parser)
    actions |= add_config_flags(parser, (ServerConfig, FleetConfig))
    # --replicas N: the routing core's settings (its policy is --router; --seed stays vLLM's flag)
    actions |= add_config_flags(parser, (RouterConfig,), skip=("policy", "seed"))
    actions |= _spellings(parser.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="a single API key, as vllm serve's: one tenant, whose key is also the admin "
             "key; every /v1 route and /metrics need it (instead of --api-keys)"))
    actions |= add_vllm_unsupported_flags(parser, actions)
    return actions


def serve_argv(options: Mapping[str, Any], actions: Actions) -> list[str]:
    """``serve``'s command line for options named as its flags without the dashes (``replicas``,
    ``api_keys``, ``block_size``...): ``true``/``false`` (or a bool) for a switch, a list or one
    value for the others; None leaves an option at its default.

    Raises:
        ConfigError: an option ``serve`` has no flag for.
    """
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None:
            raise ConfigError(f"unknown option {key!r} (see hotprefix serve --help)")
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            on = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            argv.append(flag if on else "--no-" + flag[2:])
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            argv += [flag, *map(str, values)]
    return argv


def section_kwargs(args: argparse.Namespace, dc) -> dict[str, Any]:
    """The parsed values of the fields of config dataclass ``dc`` (lists made tuples)."""
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(dc) if hasattr(args, f.name)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from parsed flags (vLLM's value spellings translated).

    Raises:
        ConfigError: an invalid value.
    """
    opts: dict[str, Any] = {}
    for dc in ENGINE_SECTIONS:
        opts.update(section_kwargs(args, dc))
    if getattr(args, "model_pos", None):
        opts["model"] = args.model_pos
    return EngineConfig.from_options(**engine_options(opts))


@dataclasses.dataclass(frozen=True)
class ServeConfigs:
    """What ``hotprefix serve``'s flags configure."""

    engine: EngineConfig
    server: ServerConfig
    fleet: FleetConfig
    router: RouterConfig


def serve_configs(args: argparse.Namespace) -> ServeConfigs:
    """The configs of parsed ``serve`` flags (``--api-key`` is the caller's: it makes a key file).

    Raises:
        ConfigError: a vLLM option hotprefix cannot honour, or an invalid value.
    """
    check_vllm_unsupported(args)
    return ServeConfigs(engine_config_from_args(args), ServerConfig(**section_kwargs(args, ServerConfig)),
                        FleetConfig(**section_kwargs(args, FleetConfig)),
                        RouterConfig(**section_kwargs(args, RouterConfig)))
