"""Command line: ``hotprefix serve | generate | lint | simulate | warm``, one argparse subcommand each.

Every engine/cache/scheduler/server option of ``serve`` and ``generate`` is a flag whose type,
default and help text are read from the config dataclasses (``hotprefix.config.sections``), so a
default is written in one place only and a new field becomes a flag by itself; the flags are built
by ``hotprefix.config.flags``, which the fleet's ``build_app`` reads too. ``serve`` and ``generate``
also take ``vllm serve``'s spellings (``--gpu-memory-utilization``), and ``serve`` answers a vLLM
flag hotprefix does not have (``--tensor-parallel-size 2``) with an error naming it and what to use
instead (both in ``hotprefix.config.flags``). ``simulate`` takes its arguments from the simulator
(``hotprefix.simulate.cli.add_arguments``). ``lint`` and ``warm`` own their parsers: their subcommand
hands the rest of the line to the module's ``main(argv)``, so ``hotprefix lint --help`` is lint's own
help.

What it does not know: how a flag becomes a setting (the config dataclasses and ``config.flags``
decide), vLLM's names (``compat.vllm``, through ``config.flags``), and anything of the engine, the
server or the fleet beyond the one function each command starts; nothing heavy is imported to
build the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from typing import Any

from hotprefix.config.flags import add_engine_flags, add_serve_flags, engine_config_from_args, serve_configs
from hotprefix.config.sections import ConfigError
from hotprefix.simulate import cli as simulate_cli


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
    cfg = serve_configs(args)
    server_cfg = cfg.server
    if args.api_key is not None:
        from hotprefix.server.tenants import single_key_file

        if server_cfg.api_keys:
            raise ConfigError("give --api-key (one key) or --api-keys (a key file), not both")
        server_cfg = dataclasses.replace(server_cfg, api_keys=single_key_file(args.api_key))
    if cfg.fleet.replicas > 1:  # engine replicas on Ray Serve (hotprefix.fleet, imports Ray)
        from hotprefix.fleet.app import serve_fleet

        serve_fleet(cfg.engine, server_cfg, cfg.fleet, cfg.router)
        return 0
    from hotprefix.server.app import serve

    serve(cfg.engine, server_cfg)
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
    add_serve_flags(s)
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
    add_engine_flags(g)
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
