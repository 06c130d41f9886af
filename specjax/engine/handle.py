"""A submitted request as its caller holds it: streamed chunks, the final output, sync and asyncio alike.

The engine's thread pushes `StreamChunk`s and finally a `RequestOutput` (or an error); the caller blocks on
`result()`, iterates the chunks, or awaits / async-iterates them from an event loop (woken thread-safely).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, AsyncIterator, Iterator

from specjax.decoding.stream import StreamChunk


@dataclasses.dataclass
class RequestOutput:
    """One finished request: its tokens and text, why it ended, its logprobs, and its own statistics."""

    request_id: int
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: Any = None  # the stop string or token id that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


class RequestHandle:
    """Returned by `Engine.submit` at once. `result()` blocks for the RequestOutput; iterating yields StreamChunks
    until the last (which carries finish_reason); `await handle` and `async for chunk in handle` do the same from
    asyncio. Any number of readers may iterate; each sees every chunk."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self._chunks: list[StreamChunk] = []
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def __repr__(self) -> str:
        state = "running" if not self.done() else (self._output.finish_reason if self._output else "failed")
        return f"RequestHandle(id={self.request_id}, {state}, chunks={len(self._chunks)})"

    # ---- engine side
    def _push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._cond.notify_all()
        self._wake()

    def _finish(self, output: RequestOutput | None = None, error: BaseException | None = None) -> None:
        with self._cond:
            if self.done():
                return
            self._output, self._error = output, error
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        for loop, event in list(self._wakers):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop is closed
                self._wakers.remove((loop, event))

    # ---- caller side
    def done(self) -> bool:
        return self._output is not None or self._error is not None

    def result(self, timeout: float | None = None) -> RequestOutput:
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise TimeoutError(f"request {self.request_id} not finished within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._error}") from self._error
        return self._output

    def __iter__(self) -> Iterator[StreamChunk]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: i < len(self._chunks) or self.done())
                chunks, finished = self._chunks[i:], self.done()
            yield from chunks
            i += len(chunks)
            if finished and i == len(self._chunks):
                break
        self.result()  # raise the error a failed request ended with

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        event = asyncio.Event()
        waker = (asyncio.get_running_loop(), event)
        self._wakers.append(waker)
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    chunks, finished = self._chunks[i:], self.done()
                for chunk in chunks:
                    yield chunk
                i += len(chunks)
                if finished and i == len(self._chunks):
                    break
                if not chunks:
                    await event.wait()
        finally:
            self._wakers.remove(waker)
        self.result()

    def __await__(self):
        async def wait() -> RequestOutput:
            async for _ in self:
                pass
            return self.result()

        return wait().__await__()
