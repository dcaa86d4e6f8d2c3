"""The bounds a hostile client meets before a handler runs. A body over ``--max-request-bytes`` is a 413
before it is read whole (``BodyLimit``, ASGI middleware); a connection must send a request's headers
within ``--idle-timeout`` seconds of opening (or of its last response), and its body with no longer pause
than that, or it is closed (``idle_protocol``, uvicorn's HTTP/1.1 protocol: uvicorn itself would wait
forever); past ``--max-connections`` a request gets a 503 (``uvicorn_config``)."""
from __future__ import annotations

import asyncio

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import Json, RequestError


class BodyLimit:
    """ASGI middleware: a request body of more than ``limit`` bytes is refused (``refusal``, a 413) as
    soon as that is known: at once from its Content-Length, before any of it is read; else (chunked)
    when the parts read so far pass the limit."""

    def __init__(self, app, limit: int, refusal: RequestError):
        self.app, self.limit, self.refusal = app, limit, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await Json(self.refusal.body(), status_code=413)(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:  # raised in the body's reading: the app answers it (http_error)
                raise HTTPException(413)
            return message
        await self.app(scope, counted, send)


def uvicorn_config(app, max_connections: int, idle_timeout: float) -> uvicorn.Config:
    """uvicorn's configuration of the server: at most ``max_connections`` connections, each closed after
    ``idle_timeout`` seconds of silence (``idle_protocol``)."""
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30, limit_concurrency=max_connections,
                          http=idle_protocol(idle_timeout))


def idle_protocol(timeout: float):
    """uvicorn's HTTP/1.1 protocol (h11), which closes a connection that has not sent a request's headers
    within ``timeout`` seconds of opening or of its last response, or whose body pauses longer (uvicorn
    itself waits for headers forever: a few hundred silent clients would hold every socket)."""
    class Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.SEND_BODY:  # the body's parts: each within the timeout
                self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            super().connection_lost(exc)
            if self.deadline is not None:
                self.deadline.cancel()

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(timeout, self._expire)

        def _expire(self) -> None:
            # headers not (all) there, or a body stalled; a request received whole is the app's to answer
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

    return Protocol
