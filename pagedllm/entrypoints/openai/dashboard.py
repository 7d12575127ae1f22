"""The live KV-cache dashboard: `GET /dashboard` (one self-contained page), its server-sent
events at `GET /dashboard/events` (about 2 per second), and the same snapshot as JSON at
`GET /debug/kv`.

The engine publishes snapshots between steps (`engine.kv_monitor.KVMonitor`) only while a page
or a `/debug/kv` caller is watching; this module serves them as JSON (`engine.kv_json`, the
format the README documents) and streams them.

With an API key set, every route here wants it, in one of three forms, since a browser's
`EventSource` cannot send an `Authorization` header: that header (`Bearer <key>`), a
`?api_key=<key>` query parameter, or the cookie `/dashboard?api_key=<key>` sets (an HMAC of the
key, not the key, valid for these routes only, HttpOnly, SameSite=Strict).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from importlib import resources

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.kv_json import DEFAULT_MAX_CELLS, snapshot_json
from pagedllm.engine.kv_monitor import KVMonitor
from pagedllm.entrypoints.openai.errors import OpenAIError, documented_errors, error_body
from pagedllm.entrypoints.openai.server_options import api_key_check

COOKIE = "pagedllm_dashboard"
EVENT_INTERVAL_S = 0.5
# How long /debug/kv waits for the engine's loop to publish a first snapshot (an idle loop
# wakes once a second).
FIRST_SNAPSHOT_TIMEOUT_S = 5.0
MAX_CELLS_LIMIT = 65536


def _cookie_token(api_key: str) -> str:
    return hmac.new(api_key.encode(), b"pagedllm-dashboard", hashlib.sha256).hexdigest()


def _auth_check(api_keys: list[str]):
    """A dependency accepting one of `api_keys` as an `api_key` query parameter, as the
    dashboard's cookie, or as the bearer header `/v1` takes (see the module docstring)."""
    header_check = api_key_check(api_keys)
    tokens = [_cookie_token(key) for key in api_keys]

    async def check(request: Request) -> None:
        if not api_keys:
            return
        offered = request.query_params.get("api_key", "").encode()
        cookie = request.cookies.get(COOKIE, "").encode()
        # compare_digest against every key: the time taken must not reveal how much matched.
        matches = [hmac.compare_digest(offered, key.encode()) for key in api_keys]
        matches += [hmac.compare_digest(cookie, token.encode()) for token in tokens]
        if any(matches):
            return
        try:
            await header_check(request)
        except OpenAIError:
            raise OpenAIError(
                401,
                "Missing or incorrect API key; open /dashboard?api_key=<key> or send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            ) from None

    return check


def _matching_key(request: Request, api_keys: list[str]) -> str | None:
    offered = request.query_params.get("api_key", "").encode()
    return next((key for key in api_keys if hmac.compare_digest(offered, key.encode())), None)


# --- JSON ------------------------------------------------------------------------------------


class _EncodedKV:
    """The latest snapshot as JSON text per (max_cells, with_blocks), encoded once for every
    reader, its encoding time reported to the monitor (which spaces snapshots by their cost)."""

    def __init__(self, monitor: KVMonitor) -> None:
        self.monitor = monitor
        self._snapshot = None  # the snapshot `_text` encodes (held: its id is never reused meanwhile)
        self._params: tuple | None = None
        self._text = "null"

    def get(self, max_cells: int, with_blocks: bool) -> str:
        snapshot = self.monitor.latest
        if snapshot is None:
            return "null"
        if snapshot is not self._snapshot or (max_cells, with_blocks) != self._params:
            # This thread's CPU time: wall time would count the engine's turns with the GIL.
            start = time.thread_time()
            self._text = json.dumps(snapshot_json(snapshot, max_cells, with_blocks))
            self._snapshot, self._params = snapshot, (max_cells, with_blocks)
            self.monitor.note_reader_cost(time.thread_time() - start)
        return self._text


def _counters(monitor: KVMonitor) -> dict:
    stats = monitor.latest_stats
    cost = monitor.cost
    counters = {
        "cost": {
            "num_snapshots": cost.num_snapshots,
            "snapshot_seconds": cost.snapshot_seconds,
            "reader_seconds": cost.reader_seconds,
            "step_seconds_watched": cost.step_seconds_watched,
            "share_of_step_time": cost.share_of_step_time,
        }
    }
    if stats is not None:
        counters.update(
            num_copy_on_writes=stats.num_copy_on_writes,
            num_preemptions=stats.num_preemptions,
            num_blocks_swapped_in=stats.num_blocks_swapped_in,
            num_blocks_swapped_out=stats.num_blocks_swapped_out,
            kv_breakdown=stats.kv_breakdown,
            spec_decode_num_drafts=stats.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=stats.spec_decode_num_accepted_tokens_per_pos,
        )
    return counters


def _document(encoded: _EncodedKV, max_cells: int, with_blocks: bool, series: list[dict], with_kv: bool = True) -> str:
    """The JSON text of /debug/kv and of each event (`kv` null without `with_kv`: an event
    whose snapshot the page already has). The snapshot's part is encoded once for all."""
    monitor = encoded.monitor
    head = json.dumps({"time": time.time(), "version": monitor.version})[:-1]
    tail = json.dumps({"counters": _counters(monitor), "series": series})[1:]
    kv = encoded.get(max_cells, with_blocks) if with_kv else "null"
    return f'{head}, "kv": {kv}, {tail}'


# --- routes ------------------------------------------------------------------------------------

_KV_200 = {
    200: {
        "description": "The latest KV-cache snapshot (README: 'Live KV-cache dashboard').",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["time", "version", "kv", "counters", "series"],
                    "properties": {
                        "time": {"type": "number"},
                        "version": {"type": "integer"},
                        "kv": {"type": "object"},
                        "counters": {"type": "object"},
                        "series": {"type": "array", "items": {"type": "object"}},
                    },
                }
            }
        },
    }
}
_MAX_CELLS = Query(
    DEFAULT_MAX_CELLS, ge=1, le=MAX_CELLS_LIMIT, description="Most cells per pool: larger pools fold consecutive blocks."
)


def dashboard_router(engine: AsyncLLMEngine, api_keys: list[str] | None = None) -> APIRouter:
    """The dashboard's routes over `engine`, behind `api_keys` when there are any; adds the
    engine's `KVMonitor` stat logger."""
    api_keys = list(api_keys or [])
    monitor = KVMonitor(engine.engine)
    engine.stat_loggers.append(monitor)
    encoded = _EncodedKV(monitor)
    router = APIRouter(dependencies=[Depends(_auth_check(api_keys))], responses=documented_errors(401))
    page = resources.files("pagedllm.entrypoints.openai").joinpath("static/dashboard.html").read_text()

    @router.get("/dashboard", response_class=HTMLResponse, responses={200: {"description": "The dashboard (HTML)."}})
    async def dashboard(request: Request) -> Response:
        response = HTMLResponse(page)
        key = _matching_key(request, api_keys)
        if key is not None:  # the page's event stream then needs no key in its address
            response.set_cookie(COOKIE, _cookie_token(key), httponly=True, samesite="strict")
        return response

    @router.get("/debug/kv", responses={**_KV_200, **documented_errors(400, 503)})
    async def debug_kv(max_cells: int = _MAX_CELLS) -> Response:
        monitor.want()
        deadline = time.monotonic() + FIRST_SNAPSHOT_TIMEOUT_S
        while monitor.latest is None and engine.is_healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if monitor.latest is None:
            return JSONResponse(error_body(503, "The engine has published no KV snapshot; is it running?"), status_code=503)
        return Response(_document(encoded, max_cells, True, monitor.series()), media_type="application/json")

    @router.get("/dashboard/events", include_in_schema=False)
    async def events(max_cells: int = _MAX_CELLS) -> Response:
        return StreamingResponse(_event_stream(engine, encoded, max_cells), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return router


async def _event_stream(engine: AsyncLLMEngine, encoded: _EncodedKV, max_cells: int):
    """One event per new snapshot, at most every `EVENT_INTERVAL_S`: the first with the whole
    series of counters, later ones with the points since, and the snapshot only when it is new.
    Ends when the engine stops or the server drains (so that it does not hold a shutdown up)."""
    monitor = encoded.monitor
    sent_version = -1
    last_point = None
    while engine.is_healthy and engine.refusing is None:
        monitor.want()
        series = monitor.series(last_point)
        version = monitor.version
        if version != sent_version or series:
            if series:
                last_point = series[-1]["time"]
            yield f"data: {_document(encoded, max_cells, False, series, with_kv=version != sent_version)}\n\n"
            sent_version = version
        else:
            yield ": idle\n\n"  # a comment: keeps the connection alive
        await asyncio.sleep(EVENT_INTERVAL_S)
