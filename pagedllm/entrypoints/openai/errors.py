"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status that says who has to change something."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's error types by status; clients (the `openai` package) map the status to an exception.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body the server sends (for the OpenAPI document)."""

    error: ErrorDetail


_ERROR_DESCRIPTIONS = {
    400: "A bad parameter, a malformed body or a prompt too long for the context; `param` names the field.",
    401: "Missing or incorrect API key.",
    404: "The model does not exist.",
    408: "The client paused longer than --body-idle-timeout while sending the body; the connection is closed.",
    413: "The body is larger than --max-body-bytes (refused before it is read).",
    503: "The engine is not running.",
}


def documented_errors(*statuses: int) -> dict[int | str, dict]:
    """A route's error responses for the OpenAPI document."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


class OpenAIError(Exception):
    """An error a route raises to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value" if param else None)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


def invalid_input(exc: ValueError, prompt_param: str) -> OpenAIError:
    """A `ValueError` from `SamplingParams` or `LLMEngine.add_request` as a 400 naming the field."""
    message = str(exc)
    match = _SAMPLING_FIELD.search(message)
    if getattr(exc, "param", None):
        param = exc.param
    elif match:
        param = match.group(1)
    elif message.lower().startswith(("the prompt", "prompt")):
        param = prompt_param
    else:
        words = re.findall(r"[a-z_]+", message)
        param = next((w for w in ("best_of", "n", "stop_token_ids", "top_p", "top_k", "min_p") if w in words), None)
    return bad_request(message, param)


# The body-wide check of extra fields (protocol.OpenAIBaseModel) names the field in its message.
_EXTRA_FIELD = re.compile(r"the extra field '([^']+)'")
# Fields that accept several forms: what to send, instead of why each form failed.
_FORMS = {"prompt": "give a non-empty string, a non-empty list of token ids, or a non-empty list of either",
          "input": "give a non-empty string, a non-empty list of token ids, or a non-empty list of either"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return f"The request body is not valid JSON: {detail}.", None
    parts, first_param = [], None
    for error in errors:
        # A body field's location starts with "body", a query parameter's with "query": the
        # field's own name is what a client must change.
        loc = [str(p) for p in error.get("loc", ())]
        loc = loc[1:] if loc[:1] in (["body"], ["query"], ["path"], ["header"]) else loc
        named = _EXTRA_FIELD.search(error.get("msg", "")) if not loc else None  # the body's own check names it
        first_param = first_param or (loc[0] if loc else named.group(1) if named else None)
        if loc and loc[0] in _FORMS:  # one line for a field of several forms, not one per form
            part = f"{loc[0]}: {_FORMS[loc[0]]}"
        else:
            part = f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}"
        if part not in parts:
            parts.append(part)
    return "Invalid request: " + "; ".join(parts[:5]), first_param


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers (ours, validation, unknown routes) in OpenAI's shape, and an
    OpenAPI document that says so: FastAPI's default 422 for validation errors never happens
    here (they are 400s), so it is taken out."""
    _document_without_422(app)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param, "invalid_value" if param else None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        if isinstance(exc.__cause__, RecursionError):  # the JSON parser's own limit (~1000 levels)
            message = "The request body nests its objects and lists too deeply to be read; flatten it."
        if exc.status_code == 404 and message == phrase:  # no route (or static file) at this path
            message = (f"This server has no route {request.method} {request.url.path}; "
                       "its routes are listed at /openapi.json.")
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


def _document_without_422(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in document["paths"].values():
                for operation in item.values():
                    operation["responses"].pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
