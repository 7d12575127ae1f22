"""The FastAPI app: OpenAI's `/v1` routes (behind the optional API key), vLLM's `/tokenize`,
`/detokenize`, `/health`, `/version`, `/metrics`, `/stats` (the engine's counters), the live
KV-cache dashboard (`/dashboard`, `/debug/kv`: `dashboard.py`), and llama-server's `/completion`,
`/props` and `/slots` (`serving_llama.py`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import threading
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm import __version__
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.stat_logger import LoggingStatLogger
from pagedllm.entrypoints.openai.body_limit import BodyLimits
from pagedllm.entrypoints.openai.cli_serve import DEFAULT_BODY_IDLE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from pagedllm.entrypoints.openai.dashboard import dashboard_router
from pagedllm.entrypoints.openai.errors import (
    bad_request,
    documented_errors,
    error_body,
    install_error_handlers,
)
from pagedllm.entrypoints.openai.metrics import PrometheusStatLogger
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.server_options import (
    CurlBodies,
    RequestFields,
    RootPath,
    ServerOptions,
    api_key_check,
    install_cors,
    json_list,
    load_chat_template,
)
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.entrypoints.openai.serving_anthropic import anthropic_router
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, embedding_router
from pagedllm.entrypoints.openai.serving_llama import llama_router
from pagedllm.entrypoints.openai.serving_responses import responses_router
from pagedllm.entrypoints.openai.streaming import SSE_EVENT_SCHEMA

logger = logging.getLogger("pagedllm")

# After the shutdown timeout has ended the last requests, the seconds their handlers get to send
# the error and close.
SHUTDOWN_GRACE_S = 3.0
# The same after a second signal, which must exit at once.
FORCED_EXIT_GRACE_S = 1.0



# The generation routes answer JSON, or with `"stream": true`, server-sent events: the schema
# of each event, whose data is a chunk in OpenAI's shape (JSON), the last one `[DONE]`.
# Answered by the body-limit middleware (body_limit.py) for any route that reads a body.
_BODY_LIMITS = (408, 413)
_STREAMED_200 = {
    200: {
        "description": "The completion; with `stream`, server-sent events ending in `data: [DONE]`.",
        "content": {
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA}
        },
    }
}


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    api_key: str | None = None,
    log_stats: bool = True,
    log_stats_interval_s: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The server's app over `engine`; the engine's loop runs while the app is up. `api_key`
    adds one key to `options.api_keys`."""
    options = options or ServerOptions()
    api_keys = options.api_keys + ([api_key] if api_key else [])
    metrics = PrometheusStatLogger(served_model_names[0])
    engine.stat_loggers.append(metrics)
    if log_stats:
        engine.stat_loggers.append(LoggingStatLogger(log_stats_interval_s))
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)
    chat.in_flight = completions.in_flight  # one list of requests in flight (llama-server's /slots)
    completions.max_tokens_cap = chat.max_tokens_cap = options.default_sampling.get("max_tokens")
    if options.chat_template is not None:  # the served tokenizers' template, not the engine's
        completions.tokenizer.chat_template = chat.tokenizer.chat_template = options.chat_template
    chat.reasoning_parser = ReasoningParser.for_server(options.reasoning_parser, chat.tokenizer)
    chat.tool_parser_class = TOOL_PARSERS[options.tool_call_parser]
    request_fields = RequestFields(options)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, idle_timeout_s=body_idle_timeout_s)
    app.add_middleware(RootPath, root_path=options.root_path)
    app.add_middleware(CurlBodies)
    install_cors(app, options)  # outermost: preflights are answered before any other check
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_keys))], responses=documented_errors(401))

    @v1.get("/models")
    async def list_models() -> dict:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": engine.model_name,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in served_model_names
        ]
        return {"object": "list", "data": cards}

    @v1.post("/completions", responses={**_STREAMED_200, **documented_errors(400, 404, *_BODY_LIMITS, 503)})
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        request_fields.prepare(request)
        return await completions.create_completion(request, raw_request)

    @v1.post("/chat/completions", responses={**_STREAMED_200, **documented_errors(400, 404, *_BODY_LIMITS, 503)})
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        request_fields.prepare(request)
        return await chat.create_chat_completion(request, raw_request)

    app.include_router(v1)
    app.include_router(dashboard_router(engine, api_keys))  # /dashboard, its events, /debug/kv
    app.include_router(llama_router(completions, options.default_sampling, api_keys))  # /completion, /props, /slots
    embeddings = OpenAIServingEmbedding(engine, served_model_names)
    app.include_router(embedding_router(embeddings, request_fields, api_keys))  # /v1/embeddings, /pooling
    app.include_router(anthropic_router(chat, request_fields, api_keys))  # /v1/messages (x-api-key too)
    store = ResponseStore(options.responses_store_bytes)  # previous_response_id, GET/DELETE
    app.include_router(responses_router(chat, request_fields, api_keys, store))  # /v1/responses

    # Every route but /health and /metrics (a load balancer's and a scraper's) needs the key
    # when keys are set: /tokenize, /detokenize and /stats spend or reveal the server's work.
    keyed = [Depends(api_key_check(api_keys))]

    @app.post("/tokenize", responses=documented_errors(400, 401, 404, *_BODY_LIMITS), dependencies=keyed)
    async def tokenize(request: TokenizeRequest) -> dict:
        completions.check_model(request.model)
        if request.content is not None and request.prompt is None:  # llama-server's name
            request.prompt, request.content = request.content, None
        if (request.prompt is None) == (request.messages is None) or request.content is not None:
            raise bad_request("Give exactly one of prompt (or llama-server's content) or messages.", "prompt")
        if request.messages is not None:
            tokens = await completions.chat_prompt(request.messages, request.add_generation_prompt)
        else:
            tokens = await completions.encode(request.prompt, request.add_special_tokens, within_context=False)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", responses=documented_errors(400, 401, 404, *_BODY_LIMITS), dependencies=keyed)
    async def detokenize(request: DetokenizeRequest) -> dict:
        completions.check_model(request.model)
        vocab = completions.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"Token ids must be in [0, {vocab}); got {bad[:5]}.", "tokens")
        text = await completions.decode(request.tokens)
        return {"prompt": text, "content": text}  # vLLM's name and llama-server's

    @app.get(
        "/health",
        response_class=JSONResponse,
        responses={
            200: {
                "description": "The engine runs: `{\"status\": \"ok\"}`, as llama-server answers.",
                "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"status": {"type": "string", "enum": ["ok"]}}, "required": ["status"],
                }}},
            },
            **documented_errors(503),
        },
    )
    async def health() -> Response:
        if engine.refusing is not None:  # shutting down: take this server out of rotation
            return JSONResponse(error_body(503, engine.refusing), status_code=503)
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, f"The engine is not running: {engine.dead_error!r}"), status_code=503)

    @app.get("/version", responses=documented_errors(401), dependencies=keyed)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/stats", responses=documented_errors(401), dependencies=keyed)
    async def stats() -> dict:
        # Tasks alive on the server's event loop (this request's own included) and threads: a
        # leak of either shows as growth between two idle moments.
        server = {"num_tasks": len(asyncio.all_tasks()), "num_threads": threading.active_count()}
        return {**engine.stats.as_dict(), "healthy": engine.is_healthy, **server}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format."}})
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class GracefulShutdown:
    """What `pagedllm serve` does on SIGTERM or SIGINT. New requests get 503 (/health included)
    from the signal on, while the listening socket stays open, so a load balancer sees the
    server leave rotation rather than refuse connections. The requests in flight get
    `shutdown_timeout` seconds to finish; then the engine shuts down, which ends the rest with
    an error in OpenAI's shape (an error event and `[DONE]` for a stream), and they get
    SHUTDOWN_GRACE_S to send it. Only then does uvicorn close the socket and the connections.
    (A second signal exits at once: `create_server`'s `Server`.)"""

    def __init__(self, engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.began_at: float | None = None  # time.monotonic() at the first signal
        self.ended_at: float | None = None  # when the engine was shut down to end the rest
        self._announced = False
        self._ending: asyncio.Task | None = None

    @property
    def began(self) -> bool:
        return self.began_at is not None

    def begin(self) -> None:
        """Called in the signal handler, so it only sets attributes: new requests are refused
        from here on. `is_over`, on uvicorn's loop, does the rest."""
        if self.began_at is None:
            self.began_at = time.monotonic()
            self.engine.stop_admitting("The server is shutting down; retry on another server or later.")

    async def is_over(self, num_in_flight: int) -> bool:
        """Whether the server may close, asked on each tick of uvicorn's loop (every 0.1 s)
        once the signal came; `num_in_flight`: the HTTP requests still running."""
        now = time.monotonic()
        if not self._announced:
            self._announced = True
            logger.info(
                "Shutting down: new requests get 503; those in flight (%d) get up to %g s to finish",
                num_in_flight, self.shutdown_timeout,
            )
        if num_in_flight == 0 or self.engine.dead_error is not None:
            return True
        if self.ended_at is None and now - self.began_at >= self.shutdown_timeout:
            logger.info("Shutdown timeout passed; ending the requests still in flight (%d)", num_in_flight)
            self.ended_at = now
            self._ending = asyncio.create_task(self.end_requests())  # held: the loop keeps only weak references
        return self.ended_at is not None and now - self.ended_at >= SHUTDOWN_GRACE_S

    async def end_requests(self) -> None:
        """Shut the engine down: every request still in flight gets its error (a stream its
        error event and `[DONE]`). The engine's thread finishes its step first."""
        await asyncio.to_thread(self.engine.shutdown)


def seconds_since_process_start() -> float:
    """How long this process has run (from /proc: its start in clock ticks after boot, and the
    time since boot), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


_IMPORTED_AT = time.monotonic()


def create_server(args: argparse.Namespace, engine: AsyncLLMEngine | None = None):
    """A uvicorn server for `pagedllm serve`'s arguments (the engine is built, i.e. the model
    loaded, unless given); `server.run()` serves until interrupted."""
    import uvicorn

    from pagedllm.entrypoints.openai.header_timeout import header_timeout_protocol

    from pagedllm.entrypoints.cli_args import engine_args_from, prepare_engine_namespace
    from pagedllm.entrypoints.openai.cli_serve import served_model_names

    prepare_engine_namespace(args)  # the model named, other engines' flags folded in
    options = server_options_from(args)  # bad option values fail before the model loads
    if engine is None:
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(args))
    names = served_model_names(args)
    app = build_app(
        engine,
        names,
        log_stats=not args.disable_log_stats,
        max_body_bytes=args.max_body_bytes,
        body_idle_timeout_s=args.body_idle_timeout,
        options=options,
    )
    drain = GracefulShutdown(engine, args.shutdown_timeout)

    class Server(uvicorn.Server):
        """uvicorn's server, draining on a signal (`GracefulShutdown`), exiting at once on a
        second one, and exiting once the engine is dead: a server that can only answer 503 is
        better restarted by its supervisor (`pagedllm serve` then exits with status 1). The
        requests in flight have had their error by then, and /health answers 503 until the
        listening socket closes, within uvicorn's 0.1 s tick.

        uvicorn's own handling would close the listening socket on the first signal (new
        clients refused, not answered 503), take only a second SIGINT as a forced exit, and
        on a forced exit skip the app's shutdown, so that the event loop's end cancels the
        requests in flight: streams cut without `[DONE]`, a traceback for each."""

        engine_died = False
        ended_at_once = False

        def handle_exit(self, sig, frame) -> None:
            # A signal handler: it only sets flags, which uvicorn's loop acts on (on_tick, shutdown).
            if drain.began:
                self.force_exit = True  # any second signal, SIGTERM or SIGINT
            drain.begin()
            super().handle_exit(sig, frame)  # should_exit; the signal is re-raised once shut down

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: connections are accepted from here on
                logger.info("Ready in %.1f s (from process start to accepting connections)", seconds_since_process_start())

        async def on_tick(self, counter: int) -> bool:
            if engine.dead_error is not None and not self.engine_died:
                self.engine_died = True
                self.should_exit = True
                logger.error("The engine stopped (%s); the server exits", engine.dead_error)
            leave = await super().on_tick(counter)
            if leave and drain.began and not self.force_exit:
                return await drain.is_over(len(self.server_state.tasks))  # listening meanwhile
            return leave

        async def shutdown(self, sockets=None) -> None:
            if self.force_exit:
                await self._end_requests_at_once()
            await super().shutdown(sockets)
            if self.force_exit:
                await self._end_requests_at_once()  # if the second signal came during uvicorn's wait
                await self.lifespan.shutdown()  # uvicorn skips it on a forced exit; ours only joins the engine

        async def _end_requests_at_once(self) -> None:
            """The engine shuts down, so every request in flight gets its error (a stream its
            error event and `[DONE]`); they get FORCED_EXIT_GRACE_S to send it, then their
            connections close (quietly: a cancelled task would log a traceback)."""
            if self.ended_at_once:
                return
            self.ended_at_once = True
            num_in_flight = len(self.server_state.tasks)
            logger.warning("Second signal: exiting now; ending the requests in flight (%d)", num_in_flight)
            await drain.end_requests()
            deadline = time.monotonic() + FORCED_EXIT_GRACE_S
            while self.server_state.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for connection in list(self.server_state.connections):
                connection.transport.close()

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=header_timeout_protocol(args.body_idle_timeout),  # uvicorn waits for headers forever
        log_level=args.uvicorn_log_level,
        ssl_keyfile=getattr(args, "ssl_keyfile", None),
        ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
        access_log=not args.disable_uvicorn_access_log,
        # uvicorn's wait comes after the drain (Server.on_tick): the requests left by then have
        # had their error and only need to send it.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return Server(config)


def server_options_from(args: argparse.Namespace) -> ServerOptions:
    """`pagedllm serve`'s HTTP options; a bad value is a `ValueError` saying which flag."""
    from pagedllm.entrypoints.generation_config import default_sampling
    from pagedllm.entrypoints.openai.cli_serve import default_sampling_flags

    try:
        cors = {name: json_list(value) for name in ("allowed_origins", "allowed_methods", "allowed_headers")
                if (value := getattr(args, name)) is not None}
    except ValueError as exc:
        raise ValueError(f"--allowed-origins/--allowed-methods/--allowed-headers: {exc}") from None
    return ServerOptions(
        api_keys=args.api_key or ([os.environ["PAGEDLLM_API_KEY"]] if os.environ.get("PAGEDLLM_API_KEY") else []),
        **cors,
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        # llama-server's flags (--temp, -n, ...) over the generation config's.
        default_sampling={**default_sampling(args.generation_config, args.model), **default_sampling_flags(args)},
        reasoning_parser=getattr(args, "reasoning_parser", None),
        tool_call_parser=getattr(args, "tool_call_parser", None) or "hermes",
        responses_store_bytes=getattr(args, "responses_store_bytes", 64 * 1024 * 1024),
    )
