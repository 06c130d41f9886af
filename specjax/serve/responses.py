"""The OpenAI response objects: completions and chat completions, whole or as stream chunks, usage, and each
endpoint's logprobs.

Logprobs. /v1/completions (the legacy format): {"tokens": [text of each token], "token_logprobs": [its
log-probability], "top_logprobs": [{token text: logprob} of the n most likely, the sampled token added when not among
them, so up to n + 1 entries], "text_offset": [where each token starts in the completion's text]}. /v1/chat/completions:
{"content": [{"token", "logprob", "bytes" (the UTF-8 bytes of the token's text), "top_logprobs": [{"token",
"logprob", "bytes"} of the n most likely]}]}. A token's text is its id decoded alone, special tokens kept (as vLLM
shows it); a token that is part of a multi-byte character decodes to U+FFFD.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Builds one request's response objects: `chat` picks the endpoint; `token_text(id)` gives a token's text."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str]):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def _envelope(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ---- logprobs
    def logprobs(self, index: int, token_ids: list[int], logprobs: list[float] | None,
                 top: list[list[tuple[int, float]]] | None) -> dict[str, Any] | None:
        """This endpoint's logprobs of some tokens of choice `index` (None when none were asked)."""
        if logprobs is None:
            return None
        top = top or [[] for _ in token_ids]
        if self.chat:
            return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(i, v) for i, v in alts]}
                                for t, lp, alts in zip(token_ids, logprobs, top)]}
        texts = [self.token_text(t) for t in token_ids]
        offsets, at = [], self.offsets.get(index, 0)
        for text in texts:
            offsets.append(at)
            at += len(text)
        self.offsets[index] = at
        tops = []
        for t, lp, alts in zip(token_ids, logprobs, top):
            entry = {self.token_text(i): v for i, v in alts}
            entry.setdefault(self.token_text(t), lp)
            tops.append(entry)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    # ---- whole responses
    def choice(self, index: int, text: str, finish_reason: str, stop_reason: Any,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def response(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self._envelope(False), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    # ---- stream chunks
    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat choice's first chunk: the assistant role, no content yet."""
        return {**self._envelope(True), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None, stop_reason: Any,
              logprobs: dict[str, Any] | None, chunk_usage: dict[str, int] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text or finish_reason is None else {},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self._envelope(True), "choices": [choice], **({"usage": chunk_usage} if chunk_usage else {})}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: usage, no choices."""
        return {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
