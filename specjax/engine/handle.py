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
    """One finished request: its tokens and text, why it ended, its logprobs, and its own statistics.

    What `RequestHandle.result()` (or `await handle`) returns once the request is retired.

    Attributes:
        request_id: the engine's id for the request, counted from 0 in submission order (`RequestHandle.request_id`).
        prompt_ids: the prompt's token ids as the target read them (a chat rendered by the checkpoint's template).
        tokens: the generated token ids, without the prompt; a stop string's tokens are cut as `generate` cuts them.
        text: the generated text (None when the target has no tokenizer).
        finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_new_tokens reached) or
            "abort" (`Engine.abort`, or `Engine.close` while it was queued or decoding).
        stop_reason: the stop string or stop token id (EOS included) that ended it; None for "length" and
            "abort".
        logprobs: each generated token's log-probability under the target's raw logits, when the request asked
            `logprobs=True` or `top_logprobs=n`; None otherwise.
        top_logprobs: per generated token, the n most likely (token id, logprob) pairs, when the request asked
            `top_logprobs=n` with n > 0; None otherwise.
        stats: this request alone: prompt_tokens, completion_tokens, rounds (speculative rounds it took part in),
            accepted_drafts, acceptance_length (tokens per round, None without rounds), ttft_s (submission to the
            first token), e2e_s (submission to the end), queue_s (None: not measured yet) and seed (the seed
            its sampling used).
    """

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
    """A submitted request as its caller holds it; `Engine.submit` returns it at once.

    Four ways to read it, from any thread:

    - `result()` blocks for the `RequestOutput`;
    - iterating (`for chunk in handle`) yields `StreamChunk`s as the engine decodes them, until the last one, which
      carries finish_reason; it blocks between chunks;
    - `await handle` returns the `RequestOutput` from an asyncio event loop without blocking it;
    - `async for chunk in handle` yields the chunks from an event loop (the engine's thread wakes it).

    Any number of readers may iterate, each from the first chunk: each sees every chunk. A request the engine
    failed on raises `RuntimeError` from `result()`, at the end of an iteration, and from `await`.

    Attributes:
        request_id: the engine's id for the request (`RequestOutput.request_id`).

    Example:
        ```python
        handle = engine.submit("The capital of France is", max_new_tokens=16)
        for chunk in handle:
            print(chunk.text, end="")
        print(handle.result().finish_reason)
        ```
    """

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
        """Whether the request has ended (finished, aborted or failed); never blocks.

        Returns:
            True once `result()` would return (or raise) at once.
        """
        return self._output is not None or self._error is not None

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request ends and return its output.

        Args:
            timeout: seconds to wait at most; None waits for as long as the request takes.

        Returns:
            The `RequestOutput`: tokens, text, finish_reason ("stop", "length" or "abort"), logprobs and stats.

        Raises:
            TimeoutError: the request had not ended within `timeout` seconds (it keeps running).
            RuntimeError: the engine failed while running it (the cause is chained), or stopped after an error.
        """
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
