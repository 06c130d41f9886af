"""One streamed request to an OpenAI-compatible server, with the time of every chunk.

The request asks for usage (`stream_options.include_usage`) and, unless turned off, usage on every chunk
(`continuous_usage_stats`, which vLLM and SGLang accept): the completion token count each chunk carries is what
gives the per-token inter-token latency (metrics.py), since a speculative server sends several tokens a chunk.

What is timed (seconds from the moment the request is sent):
- each *content* chunk: a chunk whose first choice carries non-empty text (`text` on /v1/completions,
  `delta.content` on /v1/chat/completions); the first one is the TTFT;
- each chunk whose usage says more tokens were generated (for the per-token ITL);
- the last chunk that carries a choice (content or a finish_reason): the end-to-end latency, as vLLM's
  completions client takes it.
A request succeeds when the status is 200, at least one content chunk came and no error object arrived.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import httpx

from specjax.bench.serving.args import CHAT
from specjax.bench.serving.datasets import Sample



@dataclasses.dataclass
class RequestResult:
    """A request's timings and counts; times in seconds after `start` (a time.perf_counter() reading)."""

    prompt_len: int  # the usage's prompt_tokens when the server sent it, else the sample's count
    output_tokens: int | None = None  # the usage's completion_tokens; None without a usage chunk
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    content_times: list[float] = dataclasses.field(default_factory=list)
    # with usage on every chunk: the chunks whose completion_tokens grew, and by how much (else empty)
    token_times: list[float] = dataclasses.field(default_factory=list)
    token_counts: list[int] = dataclasses.field(default_factory=list)
    text: str = ""

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks (vLLM's ITL, one value a chunk)."""
        return [b - a for a, b in zip(self.content_times, self.content_times[1:])]


def payload(endpoint: str, model: str, sample: Sample, sampling: dict[str, Any], continuous_usage: bool,
            ignore_eos: bool) -> dict[str, Any]:
    """The request body for /v1/completions or /v1/chat/completions."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True, **({"continuous_usage_stats": True}
                                                                         if continuous_usage else {})}}
    if endpoint.endswith(CHAT):
        if not isinstance(sample.prompt, str):
            raise ValueError(f"{CHAT} takes text messages; this dataset gives token ids: pass --tokenizer")
        body |= {"messages": [{"role": "user", "content": sample.prompt}], "max_completion_tokens": sample.output_len}
    else:
        body |= {"prompt": sample.prompt, "max_tokens": sample.output_len}
    if ignore_eos:
        body["ignore_eos"] = True
    return body | {k: v for k, v in sampling.items() if v is not None}


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], sample: Sample) -> RequestResult:
    """POST one streamed request and time its chunks; never raises (a failure is in .error)."""
    out = RequestResult(prompt_len=sample.prompt_len)
    chat = url.endswith(CHAT)
    tokens_seen = 0
    usage_per_chunk = False  # usage came with choices: continuous usage, so token counts per chunk are known
    out.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                out.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - out.start
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error in stream: {chunk['error']}"
                    return out
                choices = chunk.get("choices") or []
                if choices:
                    content = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                    if content:
                        out.content_times.append(now)
                        out.text += content
                    out.latency = now
                usage = chunk.get("usage")
                if usage:
                    usage_per_chunk |= bool(choices)
                    out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
                    count = usage.get("completion_tokens")
                    if count is not None:
                        if count > tokens_seen:
                            out.token_times.append(now)
                            out.token_counts.append(count - tokens_seen)
                            tokens_seen = count
                        out.output_tokens = count
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    if not usage_per_chunk:  # one usage chunk at the end: how the tokens spread over the chunks is unknown
        out.token_times, out.token_counts = [], []
    if not out.content_times:
        out.error = "no chunk with content came: nothing to time the first token by"
        return out
    out.ttft = out.content_times[0]
    out.success = True
    return out


def _error_message(response: httpx.Response) -> str:
    """An OpenAI error object's message, or the body's start."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
