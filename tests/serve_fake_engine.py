"""A stand-in for specjax.Engine with its interface, for testing the HTTP layer alone: fast, and exact about what
it produces, so each response can be checked against what the fake was scripted to do.

Its "model" continues a prompt with token (last * 7 + 3) % vocab, `tokens_per_chunk` tokens a step to every slot
(as a speculative round hands out several), a step every `step_s` seconds; logprob of each token -0.25 x
(its position + 1), its alternatives the next ids with lower logprobs. `max_slots` requests run at once; the rest
queue. Stop strings end a request on the text. Bad settings raise at submit, as the engine's do.
"""

from __future__ import annotations

import threading
import time

from specjax.decoding.stream import StreamChunk
from specjax.engine.handle import RequestHandle, RequestOutput

SETTINGS = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "logprobs",
            "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
            "include_stop_str_in_output", "skip_special_tokens", "chat_template_kwargs", "eos_token_id"}


def next_token(last: int, vocab: int) -> int:
    return (last * 7 + 3) % vocab


def continuation(prompt: list[int], n: int, vocab: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last, vocab)
        out.append(last)
    return out


def token_logprob(position: int) -> float:
    return -0.25 * (position + 1)


class Handle(RequestHandle):
    """The engine's own handle (result, sync and async streaming), with what the fake needs beside it."""

    def __init__(self, request_id: int, prompt: list[int], settings: dict):
        super().__init__(request_id)
        self.prompt, self.settings = prompt, settings
        self.tokens: list[int] = []
        self.text = ""
        self.aborted = False

    def push(self, chunk: StreamChunk, output: RequestOutput | None = None):
        self._push(chunk)
        if output is not None:
            self._finish(output)


class FakeEngine:
    def __init__(self, target, max_slots: int = 4, step_s: float = 0.01, tokens_per_chunk: int = 2,
                 max_len: int = 256):
        self.target, self.max_slots, self.step_s, self.max_len = target, max_slots, step_s, max_len
        self.k = tokens_per_chunk
        self.vocab = target.cfg.vocab_size
        self.waiting: list[Handle] = []
        self.running: list[Handle] = []
        self.lock = threading.Lock()
        self.finished = self.emitted = self.rounds = 0
        self.closed = threading.Event()
        self.submitted: list[dict] = []  # every submit's settings, for the tests to read
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, prompt, **settings) -> Handle:
        unknown = set(settings) - SETTINGS
        if unknown:
            raise TypeError(f"submit() got unexpected settings {sorted(unknown)}")
        if settings.get("temperature", 0) < 0:
            raise ValueError(f"temperature must be >= 0, got {settings['temperature']}")
        if len(prompt) + settings.get("max_new_tokens", 16) > self.max_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_len {self.max_len}")
        h = Handle(len(self.submitted), list(prompt), settings)
        with self.lock:
            self.submitted.append(settings)
            self.waiting.append(h)
        return h

    def abort(self, h: Handle) -> None:
        with self.lock:
            h.aborted = True

    def stats(self) -> dict:
        with self.lock:
            return {"occupancy": len(self.running), "max_slots": self.max_slots, "queue_length": len(self.waiting),
                    "shape": "chain:3", "offered_at_depth": [self.rounds] * 3,
                    "accepted_at_depth": [self.rounds, self.rounds // 2, 0], "compiles": 0,
                    "requests_finished": self.finished, "tokens_emitted": self.emitted}

    def close(self) -> None:
        self.closed.set()
        self.thread.join()

    def _loop(self):
        while not self.closed.is_set():
            time.sleep(self.step_s)
            with self.lock:
                while self.waiting and len(self.running) < self.max_slots:
                    self.running.append(self.waiting.pop(0))
                for h in list(self.running):
                    self._step(h)
                for h in [h for h in self.waiting if h.aborted]:
                    self.waiting.remove(h)
                    self._finish(h, [], "abort")

    def _step(self, h: Handle):
        if h.aborted:
            return self._finish(h, [], "abort")
        self.rounds += 1
        s = h.settings
        budget = s.get("max_new_tokens", 16) - len(h.tokens)
        new = continuation(h.prompt + h.tokens, min(self.k, budget), self.vocab)
        start = len(h.tokens)
        h.tokens += new
        self.emitted += len(new)
        text = self.target.decode(h.tokens)
        for stop in s.get("stop") or []:
            at = text.find(stop)
            if at >= 0:
                text = text[: at + len(stop)] if s.get("include_stop_str_in_output") else text[:at]
                return self._finish(h, new, "stop", stop, text, start)
        reason = "length" if len(h.tokens) >= s.get("max_new_tokens", 16) else None
        if reason:
            return self._finish(h, new, reason, None, text, start)
        h.push(self._chunk(h, new, text[len(h.text):], None, None, start))
        h.text = text

    def _chunk(self, h, new, text, reason, stop, start) -> StreamChunk:
        lp = top = None
        if h.settings.get("logprobs"):
            lp = [token_logprob(start + i) for i in range(len(new))]
            n = h.settings.get("top_logprobs", 0)
            top = [[((t + j) % self.vocab, token_logprob(start + i) - j) for j in range(n)] for i, t in enumerate(new)]
        return StreamChunk(0, new, text, reason, lp, top, stop)

    def _finish(self, h, new, reason, stop=None, text=None, start=0):
        text = h.text if text is None else text
        if h in self.running:
            self.running.remove(h)
        self.finished += 1
        all_lp = all_top = None
        if h.settings.get("logprobs"):
            chunk = self._chunk(h, h.tokens, "", None, None, 0)
            all_lp, all_top = chunk.logprobs, chunk.top_logprobs
        out = RequestOutput(h.request_id, h.prompt, list(h.tokens), text, reason, stop, all_lp, all_top)
        last = self._chunk(h, new, text[len(h.text):], reason, stop, start)
        h.text = text
        h.push(last, out)


def until_serving(proc, url: str, timeout_s: float) -> str:
    """What a `specjax serve` subprocess printed up to its "serving" line, once `url`/health answers 200 (or
    timeout_s has passed): the start-up every command-line server test waits for."""
    import httpx

    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.startswith("serving"):
            break
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return "".join(printed)

