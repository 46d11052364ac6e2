"""Command line: ``hotprefix serve | generate | lint | simulate | warm``, one argparse subcommand each.

Every engine/cache/scheduler/server option of ``serve`` and ``generate`` is a flag whose type,
default and help text are read from the config dataclasses (``hotprefix.config.sections``), so a default is
written in one place only and a new field becomes a flag by itself. ``simulate`` takes its
arguments from the simulator (``hotprefix.simulate.cli.add_arguments``). ``lint`` and ``warm`` own
their parsers: their subcommand hands the rest of the line to the module's ``main(argv)``, so
``hotprefix lint --help`` is lint's own help. Nothing heavy is imported to build the parser.

``serve`` and ``generate`` also take ``vllm serve``'s spellings (``--gpu-memory-utilization``, aliases
from ``hotprefix.compat.vllm``); ``serve`` takes ``--api-key KEY`` (a single key, as vLLM's) and
answers a vLLM flag hotprefix does not have (``--tensor-parallel-size 2``) with an error naming it
and what to use instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import logging
import sys
import types
import typing
from typing import Any

from hotprefix.config.sections import (CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig,
                              ServerConfig, field_docs)
from hotprefix.fleet.config import FleetConfig
from hotprefix.router.config import RouterConfig
from hotprefix.simulate import cli as simulate_cli
from hotprefix.compat.vllm import UNSUPPORTED, flag_aliases, rejection

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)


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


def add_config_flags(parser: argparse.ArgumentParser, sections, skip: tuple[str, ...] = (),
                     aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per field of each config dataclass in ``sections``: ``--field-name``, typed from
    the field's annotation (bool -> ``--x/--no-x``), default and help from the field; ``aliases``
    maps a field to more spellings of its flag (vLLM's)."""
    aliases = aliases or {}
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
            group.add_argument("--" + f.name.replace("_", "-"), *aliases.get(f.name, ()), dest=f.name,
                               default=default, help=help_, **_flag_kwargs(_base_type(hints[f.name])))


VLLM_DEST = "vllm_unsupported_"
"""Prefix of the hidden ``serve`` flags that catch vLLM options hotprefix does not have."""


def add_vllm_unsupported_flags(parser: argparse.ArgumentParser) -> None:
    """Hidden flags for vLLM's options that hotprefix lacks, so ``_cmd_serve`` can name them (and
    accept the values that ask for what hotprefix does anyway, such as ``--tensor-parallel-size 1``)."""
    taken = set(parser._option_string_actions)
    for name, entry in UNSUPPORTED.items():
        flag = "--" + name.replace("_", "-")
        if flag in taken:
            continue
        kwargs: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if entry.switch
                                  else {"type": str})
        parser.add_argument(flag, dest=VLLM_DEST + name, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, **kwargs)


def check_vllm_unsupported(args: argparse.Namespace) -> None:
    """Raises ConfigError for the first vLLM flag given with a value hotprefix cannot honour."""
    for name, entry in UNSUPPORTED.items():
        if hasattr(args, VLLM_DEST + name):
            why = rejection(name, getattr(args, VLLM_DEST + name), entry, flag=True)
            if why:
                raise ConfigError(why)


def _section_kwargs(args: argparse.Namespace, dc) -> dict[str, Any]:
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(dc) if hasattr(args, f.name)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    opts: dict[str, Any] = {}
    for dc in ENGINE_SECTIONS:
        opts.update(_section_kwargs(args, dc))
    if getattr(args, "model_pos", None):
        opts["model"] = args.model_pos
    return EngineConfig.from_options(**opts)


def _cmd_generate(args: argparse.Namespace) -> int:
    from hotprefix.engine.engine import LLMEngine
    from hotprefix.request.sampling import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.raw:
        prompt: Any = args.prompt
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        prompt = engine.tokenizer.encode_chat(msgs)
    req = engine.add_request(prompt, params, cache_salt=None)
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == req.request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose and out is not None:
        print(f"[ttft {out.ttft_s:.3f}s, {len(out.token_ids)} tokens, "
              f"cached {out.num_cached_tokens}, finish {out.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    check_vllm_unsupported(args)
    server_cfg = ServerConfig(**_section_kwargs(args, ServerConfig))
    if args.api_key is not None:
        from hotprefix.server.tenants import single_key_file

        if server_cfg.api_keys:
            raise ConfigError("give --api-key (one key) or --api-keys (a key file), not both")
        server_cfg = dataclasses.replace(server_cfg, api_keys=single_key_file(args.api_key))
    fleet_cfg = FleetConfig(**_section_kwargs(args, FleetConfig))
    if fleet_cfg.replicas > 1:  # engine replicas on Ray Serve (hotprefix.fleet, imports Ray)
        from hotprefix.fleet.app import serve_fleet

        router_cfg = RouterConfig(**_section_kwargs(args, RouterConfig))
        serve_fleet(engine_config_from_args(args), server_cfg, fleet_cfg, router_cfg)
        return 0
    from hotprefix.server.app import serve

    serve(engine_config_from_args(args), server_cfg)
    return 0


PASSTHROUGH = {
    "lint": "static checks of prompt templates and request samples for prefix-cache traps",
    "warm": "prefill system prompts on a running server (POST /v1/cache/warm)",
}
"""Commands whose module parses its own arguments (``main(argv)``): ``PASSTHROUGH_MODULES``."""

PASSTHROUGH_MODULES = {"lint": "hotprefix.lint", "warm": "hotprefix.tools.warm"}
"""Command -> the module whose ``main(argv)`` runs it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotprefix",
                                description="An LLM serving runtime whose prefix cache actually works.",
                                epilog="Run 'hotprefix COMMAND --help' for the options of a command.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="a .gguf file or HF directory (default: the embedded SmolLM2-135M-Instruct)")
    add_config_flags(s, ENGINE_SECTIONS, aliases=flag_aliases())
    add_config_flags(s, (ServerConfig, FleetConfig))
    # --replicas N: the routing core's settings (its policy is --router; --seed stays vLLM's flag)
    add_config_flags(s, (RouterConfig,), skip=("policy", "seed"))
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="a single API key, as vllm serve's: one tenant, whose key is also the admin "
                        "key; every /v1 route and /metrics need it (instead of --api-keys)")
    add_vllm_unsupported_flags(s)
    s.set_defaults(func=_cmd_serve)

    g = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    g.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    g.add_argument("--system", default=None, help="a system message")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-v", "--verbose", action="store_true")
    add_config_flags(g, ENGINE_SECTIONS, aliases=flag_aliases())
    g.set_defaults(func=_cmd_generate)

    sub.add_parser("lint", help=PASSTHROUGH["lint"], add_help=False).set_defaults(passthrough="lint")

    m = sub.add_parser("simulate", help="replay a request trace through the prefix cache: hit "
                       "ratios, Belady's MIN, the miss-ratio curve and pool sizing",
                       description=simulate_cli.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate_cli.add_arguments(m)
    m.set_defaults(func=simulate_cli.run)

    sub.add_parser("warm", help=PASSTHROUGH["warm"], add_help=False).set_defaults(passthrough="warm")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hotprefix COMMAND ...``; returns the exit status (2: bad usage or configuration)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    passthrough = getattr(args, "passthrough", None)
    if passthrough is not None:  # lint, warm: their own parser reads the rest of the line
        return importlib.import_module(PASSTHROUGH_MODULES[passthrough]).main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
