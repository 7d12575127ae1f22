"""`pagedllm serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pagedllm.entrypoints.cli_args import add_chat_template_arg, add_engine_args, parse_bytes

logger = logging.getLogger("pagedllm")

# The default limit on request bodies: far above any prompt that fits a context.
DEFAULT_MAX_BODY_BYTES = 16 << 20
# As nginx's client_body_timeout: the longest pause allowed between two parts of a request body.
DEFAULT_BODY_IDLE_TIMEOUT_S = 60.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        usage="pagedllm serve [MODEL] [options]   (vLLM's and llama-server's flags are taken too: docs/serving.md)",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
        description="Serve a model over OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health, /version, /metrics, and llama-server's /completion, /props, /slots.",
    )
    add_engine_args(p, launch="serve")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    server.add_argument(
        "--api-key", nargs="+", action="extend", default=None,
        help="require 'Authorization: Bearer <key>' with one of these keys on every route but /health and "
        "/metrics; give several, or the flag several times (default: $PAGEDLLM_API_KEY, else none)",
    )
    add_chat_template_arg(server)
    server.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let requests bring their own chat_template (a template is code run on this server)",
    )
    server.add_argument(
        "--root-path", default="",
        help="the path prefix a reverse proxy serves this server under (e.g. /llm); requests may carry it or not",
    )
    cors = p.add_argument_group("CORS (no CORS headers unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins", default=None, help="""origins allowed: a JSON list ('["https://a.example"]', '["*"]') or one origin""",
    )
    cors.add_argument("--allowed-methods", default=None, help="methods allowed, a JSON list (default: all)")
    cors.add_argument("--allowed-headers", default=None, help="headers allowed, a JSON list (default: all)")
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies) in CORS requests")
    server.add_argument(
        "--served-model-name", "-a", "--alias", nargs="+", default=None,
        help="model name(s) clients use; the first is reported in responses (default: a file's stem, and MODEL "
        "as given)",
    )
    sampling = p.add_argument_group("default sampling of requests that leave a field unset (llama-server's flags)")
    sampling.add_argument("--temp", type=float, default=None, dest="default_temperature", help="temperature")
    sampling.add_argument("--top-k", type=int, default=None, dest="default_top_k", help="top_k")
    sampling.add_argument("--top-p", type=float, default=None, dest="default_top_p", help="top_p")
    sampling.add_argument("--min-p", type=float, default=None, dest="default_min_p", help="min_p")
    sampling.add_argument("--repeat-penalty", type=float, default=None, dest="default_repetition_penalty",
                          help="repetition_penalty")
    sampling.add_argument("--override-generation-config", default=None, metavar="JSON",
                          help="vLLM's: generation_config.json keys over the model's, e.g. '{\"temperature\": 0.5}'")
    sampling.add_argument("-n", "--n-predict", type=int, default=None, dest="default_max_tokens",
                          help="the most tokens a request may generate (-1: no cap but the context)")
    server.add_argument(
        "--max-body-bytes", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES,
        help="refuse request bodies larger than this with 413 (e.g. 16MiB, the default)",
    )
    server.add_argument(
        "--body-idle-timeout", type=float, default=DEFAULT_BODY_IDLE_TIMEOUT_S,
        help="seconds a client may pause while sending a request body, and the most its request's headers may "
        "take to arrive, before it gets 408 and its connection is closed (default: %(default)s)",
    )
    server.add_argument(
        "--responses-store-bytes", type=parse_bytes, default=64 * 1024 * 1024,
        help="the most bytes of responses kept for /v1/responses' previous_response_id and GET (least recently "
        "used dropped first; 0: none kept; default 64MiB)",
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=10.0,
        help="on SIGTERM/SIGINT, seconds to let requests in flight finish before ending them with an error",
    )
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    server.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates against")
    server.add_argument("--uvicorn-log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"))
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=run)


def served_model_names(args: argparse.Namespace) -> list[str]:
    """`--served-model-name`'s names, else a model file's stem (the name llama-server and
    clients use) and the model as given (its full path still matches)."""
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.model).expanduser()
    return [path.stem, args.model] if path.is_file() else [args.model]


def default_sampling_flags(args: argparse.Namespace) -> dict:
    """vLLM's `--override-generation-config` and llama-server's `--temp`, `--top-k`, ... `-n` as
    SamplingParams fields (llama-server's win where both set one)."""
    import json

    from pagedllm.entrypoints.generation_config import sampling_fields

    fields = {}
    if getattr(args, "override_generation_config", None):
        try:
            override = json.loads(args.override_generation_config)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config must be a JSON object: {exc}") from None
        fields = sampling_fields(override, "--override-generation-config: {key}")
    fields |= {name.removeprefix("default_"): value for name, value in vars(args).items()
               if name.startswith("default_") and value is not None}
    if fields.get("max_tokens") == -1:
        del fields["max_tokens"]
    return fields


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import create_server

    server = create_server(args)
    logger.info("Serving %s as %s", args.model, ", ".join(served_model_names(args)))
    server.run()
    return 1 if server.engine_died else 0  # a supervisor restarts a server whose engine died
