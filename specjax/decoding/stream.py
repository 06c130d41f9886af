"""Running a loop in chunks: streaming, stop strings, finish reasons (host side, between jitted chunks).

A chunked run calls the loop's `start` once (prefill and the first token), then `advance` until a
step bound that grows chunk by chunk, reading each row's new tokens in between. Each row's tokens are
detokenised incrementally (tokenizers' DecodeStream, whose pieces concatenate to `decode`) and
searched for stop strings as vLLM does (vllm/v1/engine/detokenizer.py): only once a row has more than
min_tokens tokens, each new piece searched together with the stop string's length before it, the first
stop string of the list found wins, the text cut before it (or after it with include_stop_str_in_output)
and the token ids kept up to the token that completed it. A stopped row is marked done in the loop state the
next dispatch gets (chunks are pipelined, so one more chunk may already run); what it emitted past the stop is
dropped here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers.decoders import DecodeStream

from specjax.multihost import agreed, on_like, to_host

# A chunk grows (4x its steps, from 1) until it takes this long: the first tokens come at once, and the per-chunk
# cost (one dispatch, one small read, the host's detokenising) stays a few percent of the decode
# (scripts/bench_stream.py measures stream against generate).
CHUNK_TARGET_S = 0.05
CHUNK_GROWTH = 4
MAX_CHUNK_STEPS = 256


@dataclasses.dataclass
class StreamChunk:
    """New output of one prompt since its last chunk, as `specjax.stream` (and an engine handle) yields it.

    Attributes:
        index: the prompt's position in the call's prompts.
        token_ids: the new token ids.
        text: the new text (held back at the end while it could begin a stop string); None without a tokenizer.
        finish_reason: on the prompt's last chunk, "stop" (EOS, a stop token or a stop string) or "length".
        logprobs: with logprobs=True, each new token's raw log-probability, as GenerateOutput.logprobs holds them.
        top_logprobs: with top_logprobs=n, each new token's n most likely (id, logprob) pairs.
        stop_reason: on the last chunk, the stop string or token id that ended the row (vLLM's); None for "length".
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the row (last chunk; vLLM's)


class RowText:
    """One row's text, built a token at a time, and where a stop string ends it."""

    def __init__(self, target, stop: tuple[str, ...], include_stop: bool, skip_special: bool, min_tokens: int):
        self.tokenizer = target.tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special) if self.tokenizer is not None else None
        self.stop, self.include_stop, self.min_tokens = stop, include_stop, min_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None
        self.sent_tokens = self.sent_chars = 0

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token: int) -> None:
        """Add one token; past min_tokens, look for a stop string in what it adds (plus a stop's length before)."""
        self.tokens.append(token)
        if self.stream is None:
            return
        piece = self.stream.step(self.tokenizer, token) or ""
        self.text += piece
        if not self.stop or not piece or len(self.tokens) <= self.min_tokens:
            return
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) - len(piece) - len(s) + 1))
            if at >= 0:
                self.text = self.text[: at + len(s) if self.include_stop else at]
                self.stop_reason = s
                return

    def new_output(self, finished: bool) -> tuple[list[int], str | None]:
        """Tokens and text not yet handed out. While running, the last (longest stop - 1) characters are held
        back: they may be the start of a stop string that must not be shown."""
        held = 0 if finished or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self.sent_chars, len(self.text) - held)
        tokens, text = self.tokens[self.sent_tokens:], self.text[self.sent_chars:end]
        self.sent_tokens, self.sent_chars = len(self.tokens), end
        return tokens, (text if self.stream is not None else None)


class ChunkedRun:
    """Drive a loop's start/advance executables chunk by chunk, tracking every row's text and stops.

    start() -> state; advance(state, until) -> state (the state donated). Iterating
    yields the StreamChunks of each chunk; afterwards `state` is the final loop state and `kept` the tokens each
    row keeps (a stop string may end a row before its last emitted token)."""

    def __init__(self, start: Callable, advance: Callable, first_step: int, out_len: int, rows: list[RowText],
                 stop_ids: tuple[int, ...]):
        self.start, self.advance = start, advance
        self.step, self.out_len = first_step, out_len
        self.rows, self.stop_ids = rows, set(stop_ids)
        self.state: Any = None
        self.run_s = 0.0
        self.finished = [False] * len(rows)

    def __iter__(self) -> Iterator[list[StreamChunk]]:
        """Pipelined: the next chunk is dispatched before this one's tokens are read (from a snapshot of the buffers
        taken after it), so the device runs while the host waits for, detokenises and hands out the last chunk. A
        row a stop string ended is marked done in the state the next dispatch gets; what it emitted past the stop
        meanwhile is dropped, and the loop may run one chunk more than needed (a no-op once every row is done)."""
        clock = time.perf_counter()
        self.state = self.start()
        snap = _snapshot(self.state)
        steps = 1
        while True:
            begin = time.perf_counter()
            more = not all(self.finished) and self.step < self.out_len
            if more:
                self.step = min(self.step + steps, self.out_len)
                self.state = self.advance(self.state, jnp.int32(self.step))
                next_snap = _snapshot(self.state)
            chunks, stopped = self._take(snap)
            if stopped:
                done_B = np.zeros(len(self.state.done_B), bool)
                done_B[stopped] = True
                self.state = dataclasses.replace(self.state, done_B=self.state.done_B | on_like(done_B, self.state.done_B))
            yield chunks
            if not more:
                break
            snap = next_snap
            # timed on each process: process 0's verdict everywhere, or the processes would run different chunks
            if agreed(np.asarray(time.perf_counter() - begin < CHUNK_TARGET_S)):
                steps = min(CHUNK_GROWTH * steps, MAX_CHUNK_STEPS)
        self.run_s = time.perf_counter() - clock

    def _take(self, snap) -> tuple[list[StreamChunk], list[int]]:
        """Read a snapshot of the loop's outputs, push each row's new tokens, hand out chunks: (chunks, the rows a
        stop string ended now)."""
        out_BO, count_B, done_B, lp = to_host(snap)
        stopped_now = []
        chunks = []
        for i, row in enumerate(self.rows):
            if self.finished[i]:
                continue
            for tok in out_BO[i, len(row.tokens): count_B[i]].tolist():
                row.push(tok)
                if row.stopped:
                    stopped_now.append(i)
                    break
            self.finished[i] = row.stopped or bool(done_B[i])
            first = row.sent_tokens
            tokens, text = row.new_output(self.finished[i])
            if tokens or text or self.finished[i]:
                reason, stop = finish_reason(row.tokens, row.stop_reason, self.stop_ids) if self.finished[i] else \
                    (None, None)
                chunk = StreamChunk(i, tokens, text, reason, stop_reason=stop)
                if lp is not None:
                    end = first + len(tokens)
                    chunk.logprobs = lp.token_BO[i, first:end].tolist()
                    if lp.top_BOK.shape[-1] > 0:
                        chunk.top_logprobs = [list(zip(lp.top_ids_BOK[i, j].tolist(), lp.top_BOK[i, j].tolist()))
                                              for j in range(first, end)]
                chunks.append(chunk)
        return chunks, stopped_now

    @property
    def kept(self) -> np.ndarray:
        return np.asarray([len(r.tokens) for r in self.rows], np.int32)


def finish_reason(tokens: list[int], stop_string: str | None, stop_ids) -> tuple[str, Any]:
    """(finish reason, stop reason) of a finished row, vLLM's: "stop" with the string or token that ended it, else
    "length" (the budget; a row ending on a stop token at its budget stopped)."""
    if stop_string is not None:
        return "stop", stop_string
    if tokens and tokens[-1] in stop_ids:
        return "stop", tokens[-1]
    return "length", None


@jax.jit
def _copy(out_BO, count_B, done_B, logprobs):
    """Copies of a state's output buffers (the state itself is donated to the next chunk)."""
    return out_BO, count_B, done_B, logprobs


def _snapshot(state):
    """The buffers the host reads (logprobs: None without them), copied on the device (dispatched, not waited
    for)."""
    return _copy(state.out_BO, state.count_B, state.done_B, state.logprobs)
