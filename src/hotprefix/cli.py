"""Command line: ``hotprefix serve | generate | lint | simulate | warm``.

Every engine/cache/scheduler/server option is a flag whose default and help text are read from the
config dataclasses (``hotprefix.config``), so a default is written in one place only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from typing import Any

from hotprefix.config import (CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig,
                              ServerConfig, field_docs)

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)


def _base_type(tp: Any) -> Any:
    if isinstance(tp, str):
        tp = eval(tp, {}, {})  # annotations are strings under `from __future__ import annotations`
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_config_flags(parser: argparse.ArgumentParser, sections, skip: tuple[str, ...] = ()) -> None:
    for dc in sections:
        group = parser.add_argument_group(dc.__name__, (dc.__doc__ or "").strip())
        docs = field_docs(dc)
        for f in dataclasses.fields(dc):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            tp = _base_type(f.type)
            help_ = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
            if tp is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=f.default, help=help_)
            else:
                group.add_argument(flag, dest=f.name, type=tp, default=f.default, help=help_)


def _section_kwargs(args: argparse.Namespace, dc) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(dc) if hasattr(args, f.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    opts: dict[str, Any] = {}
    for dc in ENGINE_SECTIONS:
        opts.update(_section_kwargs(args, dc))
    if getattr(args, "model_pos", None):
        opts["model"] = args.model_pos
    return EngineConfig.from_options(**opts)


def _cmd_generate(args: argparse.Namespace) -> int:
    from hotprefix.engine.engine import LLMEngine
    from hotprefix.sampling import SamplingParams

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
    from hotprefix.server.app import serve

    server_cfg = ServerConfig(**_section_kwargs(args, ServerConfig))
    serve(engine_config_from_args(args), server_cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotprefix", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

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
    add_config_flags(g, ENGINE_SECTIONS)
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="a .gguf file or HF directory (default: the embedded SmolLM2-135M-Instruct)")
    add_config_flags(s, ENGINE_SECTIONS)
    add_config_flags(s, (ServerConfig,))
    s.set_defaults(func=_cmd_serve)
    return p


EXTERNAL = {"lint": "hotprefix.lint", "simulate": "hotprefix.simulate", "warm": "hotprefix.warm"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in EXTERNAL:
        import importlib

        return importlib.import_module(EXTERNAL[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
