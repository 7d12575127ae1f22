"""The `pagedllm` command: generate, chat, demo, serve and bench.

The top layer: it dispatches to the entry points (`pagedllm.entrypoints`) and the benchmarks
(`pagedllm.bench`, which drive the entry points themselves)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm import __version__
from pagedllm.utils import ExactArgumentParser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # Hub look-ups never happen: everything is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.bench import register_bench
    from pagedllm.entrypoints import cli_generate

    parser = ExactArgumentParser(prog="pagedllm", description="An LLM serving engine built on PagedAttention.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_generate.register(sub)
    try:
        from pagedllm.entrypoints.openai import cli_serve

        cli_serve.register(sub)
    except ImportError:  # the server is optional
        pass
    register_bench(sub)
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its `prog` ("pagedllm bench latency"), each naming itself
    in the namespace (`command_prog`: text, so that benchmarks can write their arguments as JSON)."""
    parser.set_defaults(command_prog=parser.prog)
    found = {parser.prog: parser}
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for child in action.choices.values():
            found.update(_commands(child))
    return found


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command; a flag no command knows is named under its command's usage, with the
    closest known flags."""
    import difflib

    from pagedllm.entrypoints.launch_flags import expand_config_file

    commands = _commands(parser)
    try:
        argv = expand_config_file(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        parser.error(str(exc))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = commands[args.command_prog]
        known = [flag for action in command._actions for flag in action.option_strings]
        hints = [f"for {flag}, did you mean {' or '.join(close)}?" for flag in unknown
                 if flag.startswith("-") and (close := difflib.get_close_matches(flag, known, 2))]
        command.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"; {hint}" for hint in hints))
    return args


def _serve_as_torchrun_worker(args: argparse.Namespace) -> None:
    """Under torchrun every rank runs the same command; ranks other than 0 become tensor-parallel
    workers here (building the engine enters the worker loop and exits when the driver stops)."""
    from pagedllm.distributed.init import env_rank

    if getattr(args, "tensor_parallel_size", 1) > 1 and getattr(args, "distributed_init_method", None) == "env://":
        if env_rank() > 0:
            from pagedllm.engine.llm_engine import LLMEngine
            from pagedllm.entrypoints.cli_args import engine_args_from

            LLMEngine.from_engine_args(engine_args_from(args))  # raises SystemExit when the driver shuts down


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(build_parser(), argv)
    _setup_logging(args.verbose)
    try:
        if hasattr(args, "model_flag"):  # a command that builds an engine: its flags settled first
            from pagedllm.entrypoints.cli_args import prepare_engine_namespace

            prepare_engine_namespace(args)
        _serve_as_torchrun_worker(args)
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
