"""The server's HTTP options with vLLM's names: API keys (any of several), CORS, the root path
behind a proxy, the chat template given at start-up, default sampling for fields a request
leaves unset, and the log of request fields this server does not know."""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.config import CHATML_TEMPLATE
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.llama_protocol import sampler_left_on

logger = logging.getLogger("pagedllm")

# The most unknown field names remembered (and logged): a client sending a new name with every
# request must not grow the server's memory or flood its log.
MAX_LOGGED_FIELDS = 256
# Fields other servers take that would change the output and that this server does not
# implement: refused with a 400 naming them, never silently ignored (llama-server's samplers are
# refused too unless set to the value that turns them off: llama_protocol.sampler_left_on).
UNSUPPORTED_FIELDS = {
    "n_keep": "prompts longer than the context are refused, never shifted; drop it",
    "guided_whitespace_pattern": "give disable_any_whitespace in structured_outputs instead",
    "structural_tag": "structural tags are not supported; give a JSON schema or a grammar",
    "truncate_prompt_tokens": "prompts are never truncated here; shorten the prompt",
    "logits_processors": "logits processors are not supported; give logit_bias, allowed_token_ids or bad_words",
    "lora_request": "LoRA adapters are not supported",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
}


@dataclass
class ServerOptions:
    """What `pagedllm serve` passes to `build_app` besides the engine."""

    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    allowed_origins: list[str] = field(default_factory=list)  # empty: no CORS headers at all
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""
    chat_template: str | None = None  # replaces the tokenizer's own
    # Whether a request may bring its own chat template (a template is code run on the server).
    trust_request_chat_template: bool = False
    default_sampling: dict = field(default_factory=dict)  # from the generation config
    # --reasoning-parser's name ("auto": llama-server's --reasoning-format, chosen by the chat
    # template); None: thinking text stays in the content.
    reasoning_parser: str | None = None
    # --tool-call-parser's name (tool_parsers.TOOL_PARSERS): the format of "auto" calls.
    tool_call_parser: str = "hermes"
    responses_store_bytes: int = 64 * 1024 * 1024  # --responses-store-bytes: /v1/responses' store


def json_list(text: str) -> list[str]:
    """A flag value as vLLM writes it, a JSON list (`'["https://a.example", "https://b.example"]'`),
    or one plain value."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings or one value, got {text!r}")
    return value


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, the template itself, or chatml."""
    if value is None:
        return None
    if value == "chatml":
        return CHATML_TEMPLATE
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file, a Jinja template nor chatml.")


def api_key_check(api_keys: list[str]):
    """A dependency refusing requests without `Authorization: Bearer <key>` for one of `api_keys`."""
    expected = [key.encode() for key in api_keys]

    async def check(request: Request) -> None:
        if not expected:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # compare_digest against every key: the time taken must not reveal which or how much matched.
        matches = [secrets.compare_digest(given, key) for key in expected]
        if scheme.lower() != "bearer" or not any(matches):
            raise OpenAIError(401, "Missing or incorrect API key; send 'Authorization: Bearer <key>'.", code="invalid_api_key")

    return check


def install_cors(app: FastAPI, options: ServerOptions) -> None:
    """CORS headers for the allowed origins (none unless `--allowed-origins` is given)."""
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=options.allowed_origins,
            allow_methods=options.allowed_methods,
            allow_headers=options.allowed_headers,
            allow_credentials=options.allow_credentials,
        )


class RootPath:
    """Serves the app under `root_path` behind a proxy, as vLLM's `--root-path`: routes answer
    with the prefix or without it (a proxy that strips it), and the OpenAPI document names it."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.root_path:
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)


class CurlBodies:
    """A POST body sent as `curl -d '{...}'` sends it without `-H 'Content-Type:
    application/json'` (as a form, curl's default) is read as the JSON it is, as llama-server and
    OpenAI's API read it: every POST route of this server takes JSON, none a form."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = scope["headers"]
            if any(name == b"content-type" and value.split(b";")[0].strip() == _FORM for name, value in headers):
                scope = dict(scope, headers=[(n, b"application/json" if n == b"content-type" else v) for n, v in headers])
        await self.app(scope, receive, send)


_FORM = b"application/x-www-form-urlencoded"


class RequestFields:
    """Fills the sampling fields a request left unset with the generation config's, refuses a
    request's own chat template unless trusted and fields that would change the output that this
    server does not implement, and logs each other field name this server does not know, once (clients that send newer fields keep working, and the operator learns what is
    being ignored)."""

    def __init__(self, options: ServerOptions) -> None:
        self.default_sampling = options.default_sampling
        self.trust_request_chat_template = options.trust_request_chat_template
        self._logged: set[str] = set()

    def prepare(self, request: BaseModel) -> None:
        self._log_unknown(request)
        if getattr(request, "chat_template", None) and not self.trust_request_chat_template:
            raise bad_request(
                "This server does not run chat templates sent with requests; start it with "
                "--trust-request-chat-template to allow them, or drop chat_template.",
                "chat_template",
            )
        if getattr(request, "use_beam_search", False):  # beams are greedy: no sampling knobs
            return
        sent = request.model_fields_set
        for name, value in self.default_sampling.items():  # max_tokens is a cap: OpenAIServing.check_length
            if name != "max_tokens" and name in type(request).model_fields and name not in sent:
                setattr(request, name, value)

    def _log_unknown(self, request: BaseModel) -> None:
        for name in request.model_extra or {}:
            if name in UNSUPPORTED_FIELDS:
                raise bad_request(f"{name} would change the output and is not supported: {UNSUPPORTED_FIELDS[name]}.", name)
        if (left_on := sampler_left_on(request.model_extra or {})) is not None:
            name, off = left_on
            raise bad_request(f"{name} would change the output and is not supported here; send {off} (off) or drop it.", name)
        for name in request.model_extra or {}:
            if name in self._logged or len(self._logged) > MAX_LOGGED_FIELDS:
                continue
            self._logged.add(name)
            if len(self._logged) > MAX_LOGGED_FIELDS:
                logger.warning("More than %d unknown request field names; no more are logged.", MAX_LOGGED_FIELDS)
                continue
            logger.warning(
                "Request field %r is not known to this server and is ignored (logged once per field name).", name[:100]
            )
