"""One request in flight: its choices' events from the engine thread, streamed to the client as
server-sent events (``stream_events``) or gathered into one response (``gather``); the deadline,
and a client that goes away frees its rows at the engine's next pass."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from ..api import TextStream
from .responses import FINISH, ApiError, Reply, error_body, sse

DISCONNECT_POLL = 0.25  # seconds between checks that a non-streamed request's client is still there


class Call:
    """The events of one request's jobs (``(index, (kind, data))``, kind: tokens | done | error),
    put by the engine thread, taken here; each choice's text as the stream shows it."""

    def __init__(self, decode, stop: list[str], choices: int, timeout: float, metrics, endpoint: str):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.streams = [TextStream(decode, stop) for _ in range(choices)]
        self.timeout, self.metrics, self.endpoint = timeout, metrics, endpoint
        self.arrived = time.monotonic()
        self.first = True  # no token out yet (time to first token)

    def sink_for(self, index: int):
        """The engine thread's callback for choice ``index``."""
        def sink(event):
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (index, event))
            except RuntimeError:  # the event loop is gone (server stopping)
                pass
        return sink

    async def next_event(self, poll: float | None = None):
        """The next event; None after ``poll`` seconds without one; TimeoutError past the deadline."""
        left = self.timeout - (time.monotonic() - self.arrived)
        if left <= 0:
            raise asyncio.TimeoutError
        try:
            event = await asyncio.wait_for(self.events.get(), min(left, poll or left))
        except asyncio.TimeoutError:
            if poll is not None and poll < left:
                return None
            raise
        if event[1][0] == "tokens" and self.first:
            self.metrics.first_token.observe(time.monotonic() - self.arrived)
            self.first = False
        return event

    def pieces(self, i: int, new) -> list[dict]:
        """Each new token's text (as the stream shows it) and where it came from."""
        return [{"text": self.streams[i].add([t]), "draft": k < new.from_draft} for k, t in enumerate(new)]

    def answered(self, status: int) -> None:
        self.metrics.requests.labels(self.endpoint, str(status)).inc()
        if status == 200:
            self.metrics.latency.observe(time.monotonic() - self.arrived)

    def too_long(self) -> str:
        return f"the request took longer than {self.timeout:g} s"


async def stream_events(call: Call, reply: Reply, choices: int, n: int, include_usage: bool,
                        cancel) -> AsyncIterator[str]:
    """Server-sent events of a streamed response: each choice's text as it comes, its last chunk
    with the finish reason, then (when asked) usage and [DONE]. ``cancel()`` frees the rows."""
    done, outputs, ended = 0, [None] * choices, False
    try:
        while done < choices:
            try:
                i, (kind, data) = await call.next_event()
            except asyncio.TimeoutError:
                yield sse(error_body(408, call.too_long()))
                call.answered(408)
                ended = True
                return
            if kind == "error":
                status = getattr(data, "status", 500)  # a Refused request's own 4xx
                yield sse(error_body(status, data))
                call.answered(status)
                ended = True
                return
            if kind == "tokens":
                if reply.tools is not None:  # a tool call goes out whole, at its end
                    continue
                toks = call.pieces(i, data)
                yield sse(reply.chunk(i, "".join(t["text"] for t in toks), None, toks))
            else:
                done += 1
                outputs[i] = data
                if reply.tools is not None:
                    yield sse(reply.tool_chunk(i, data))
                    continue
                rest = call.streams[i].finish(data.text)
                yield sse(reply.chunk(i, rest, FINISH.get(data.finish_reason), [], data))
        if include_usage:
            yield sse(reply.usage_chunk(outputs, n))
        yield "data: [DONE]\n\n"
        ended = True
        call.answered(200)
    finally:  # a client that goes away frees its rows at the next pass
        cancel()
        if not ended and done < choices:
            call.answered(499)  # the client left (nginx's code)


async def gather(call: Call, choices: int, cancel, disconnected) -> list | None:
    """Every choice's Output for a non-streamed response; None if the client left
    (``disconnected()``, checked every DISCONNECT_POLL seconds). ``cancel()`` frees the rows."""
    outputs, checked = [None] * choices, time.monotonic()
    try:
        while any(o is None for o in outputs):
            event = await call.next_event(poll=DISCONNECT_POLL)
            if time.monotonic() - checked >= DISCONNECT_POLL:  # a client that left frees its rows
                checked = time.monotonic()
                if await disconnected():
                    call.answered(499)
                    return None
            if event is None:
                continue
            i, (kind, data) = event
            if kind == "error":
                raise ApiError(getattr(data, "status", 500), str(data))
            if kind == "done":
                outputs[i] = data
    except asyncio.TimeoutError:
        raise ApiError(408, call.too_long()) from None
    finally:
        cancel()
    call.answered(200)
    return outputs
