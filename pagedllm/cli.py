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


def _serve_as_torchrun_worker(args: argparse.Namespace) -> None:
    """Under torchrun every rank runs the same command; ranks other than 0 become tensor-parallel
    workers here (building the engine enters the worker loop and exits when the driver stops)."""
    from pagedllm.distributed.init import env_rank

    if getattr(args, "tensor_parallel_size", 1) > 1 and getattr(args, "distributed_init_method", None) == "env://":
        if env_rank() > 0:
            from pagedllm.engine.llm_engine import LLMEngine
            from pagedllm.entrypoints.cli_args import engine_args_from

            engine_args = engine_args_from(args)
            if getattr(args, "model", None):
                engine_args.model = args.model
            LLMEngine.from_engine_args(engine_args)  # raises SystemExit when the driver shuts down


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        _serve_as_torchrun_worker(args)
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
