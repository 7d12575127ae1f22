"""A deadline on request headers, which uvicorn does not have.

uvicorn reads a request's headers before the app sees anything, and waits for them without
limit: a client that opens a connection and sends nothing, or half a header line, holds that
connection (and its memory) for as long as it likes, and enough of them exhaust the server's
file descriptors (the slowloris attack). Its keep-alive timeout covers only the pause after a
response. This protocol gives every request's headers the same deadline as a stalled body
(`--body-idle-timeout`, as nginx's client_header_timeout): counted from the connection's
opening, or from the first byte of a later request on it; when it passes with the headers
incomplete, the client gets 408 in OpenAI's error shape and the connection is closed.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_body


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with request headers due within `timeout_s` seconds."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers() and self.conn.trailing_data[0]:
                if self._header_timer is None:  # the first bytes of a request: its clock starts
                    self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._awaiting_headers() and self.conn.trailing_data[0]:
                # The next request began in the same packets: its headers' deadline applies, not the
                # keep-alive timeout (which would close the connection without a word).
                self._unset_keepalive_if_required()
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            payload = json.dumps(error_body(408, (
                f"The request's headers did not arrive within {timeout_s:g} s (--body-idle-timeout); "
                "the connection is closed."
            ))).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(payload)).encode() + b"\r\nconnection: close\r\n\r\n" + payload
            )
            self.transport.close()

    return HeaderTimeoutProtocol
