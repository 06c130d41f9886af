"""The HTTP routes of `specjax serve`: OpenAI's completions and chat completions on a running Engine.

An HTTP request becomes one engine request per prompt and choice (`n`), submitted at once; the route then streams
their chunks as server-sent events, or waits for them all and answers with one object. The engine runs on its own
thread; the routes only await its handles, so the event loop stays free to accept requests and stream.

Policies:
- Prompts are tokenised here (a chat by the checkpoint's template), so a request that cannot fit is refused before it
  queues: prompt + max_tokens must fit in --max-len. max_tokens defaults to 16 on /v1/completions (OpenAI's) and to
  what is left of --max-len on /v1/chat/completions.
- Unset sampling values come from the checkpoint's generation_config.json when it has them, else OpenAI's defaults
  (temperature 1, top_p 1, top_k and min_p off), as vLLM does; on a greedy-only engine (--greedy-only) temperature
  defaults to 0. With `seed` and n > 1, choice j uses seed + j.
- Bounded queue: at most --max-slots + --max-queue engine requests may be unfinished at once; a request that would
  go past that is answered 503 at once (type "service_unavailable", a Retry-After header), never queued.
- A client that disconnects aborts its requests: the engine frees their slots.
- Errors are OpenAI error objects. Bad input is a 400 naming the field; an engine failure is a 500 whose message
  says what failed, never a traceback (that goes to the server's log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.chat import apply_chat_template
from specjax.serve.metrics import ServerMetrics
from specjax.serve.protocol import ChatRequest, CompletionRequest, OpenAIError, chat_messages, parse
from specjax.serve.responses import Formatter

log = logging.getLogger("specjax.serve")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
RETRY_AFTER_S = 1


class Server:
    """What every route shares: the engine, the target (its tokenizer and chat template), the limits, the metrics."""

    def __init__(self, engine, target, model_name: str, *, max_len: int, max_queue: int = 256,
                 max_logprobs: int | None = None):
        if max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine, self.target, self.model_name, self.max_len = engine, target, model_name, max_len
        self.max_logprobs = max_logprobs
        self.limit = int(engine.stats()["max_slots"]) + max_queue
        self.pending = 0  # engine requests submitted and not finished
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        gen = target.generation_config or {}
        self.defaults = {k: gen.get(k) if gen.get(k) is not None else v for k, v in OPENAI_DEFAULTS.items()}
        if not getattr(engine, "sampling", True):  # a greedy-only engine (serve --greedy-only)
            self.defaults["temperature"] = 0.0
        self._token_texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        if token not in self._token_texts:
            self._token_texts[token] = self.target.decode([token], skip_special_tokens=False)
        return self._token_texts[token]

    # ---- a request, checked and made into engine submissions
    def prompts(self, req) -> list[list[int]]:
        """The prompt ids of a request: each completion prompt, or the chat rendered by the template."""
        if isinstance(req, ChatRequest):
            try:
                return [apply_chat_template(self.target, chat_messages(req.messages),
                                            **(req.chat_template_kwargs or {}))]
            except (ValueError, TypeError) as err:
                raise OpenAIError(str(err), param="messages") from None
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts or any(len(p) == 0 for p in prompts):
            raise OpenAIError("prompt is empty: give a string, a list of token ids, or a list of either",
                              param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.target.tokenizer is None:
                    raise OpenAIError("this checkpoint has no tokenizer: send the prompt as token ids", param="prompt")
                p = self.target.encode(p)
            vocab = self.target.cfg.vocab_size
            if any(not 0 <= t < vocab for t in p):
                raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append(list(p))
        return out

    def settings(self, req, prompt_len: int) -> dict[str, Any]:
        """Engine.submit's settings for one prompt of the request (seed set per choice by the caller)."""
        chat = isinstance(req, ChatRequest)
        max_tokens = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
        if max_tokens is None:
            max_tokens = self.max_len - prompt_len if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if prompt_len + max_tokens > self.max_len or max_tokens < 1:
            raise OpenAIError(f"this model's maximum context length is {self.max_len} tokens; the request asks "
                              f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate): "
                              f"shorten the prompt or lower max_tokens", param="max_tokens")
        s: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in OPENAI_DEFAULTS:
            value = getattr(req, name)
            s[name] = self.defaults[name] if value is None else value
        s["top_k"] = max(0, s["top_k"])  # -1 means off, as 0 does
        if req.stop:
            s["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.stop_token_ids:
            s["stop_token_ids"] = list(req.stop_token_ids)
        if req.include_stop_str_in_output:
            s["include_stop_str_in_output"] = True
        if not req.skip_special_tokens:
            s["skip_special_tokens"] = False
        if req.ignore_eos:
            s["eos_token_id"] = []  # no EOS ids: only max_tokens, stop strings and stop_token_ids end it
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_tokens", 0)):
            if getattr(req, name) != neutral:
                s[name] = getattr(req, name)
        if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
            s["repetition_penalty"] = req.repetition_penalty
        top = self._top_logprobs(req)
        if top is not None:
            s["logprobs"], s["top_logprobs"] = True, top
        return s

    def _top_logprobs(self, req) -> int | None:
        """How many alternatives a request asks at each position (None: no logprobs), checked against the server's
        --max-logprobs."""
        if isinstance(req, ChatRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
            top, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
        else:
            top, param = req.logprobs, "logprobs"
        if top is not None and (self.max_logprobs is None or top > self.max_logprobs):
            allowed = "none (start it with --max-logprobs N)" if self.max_logprobs is None else \
                f"at most {self.max_logprobs}"
            raise OpenAIError(f"{param}={top}: this server returns {allowed} alternatives per token", param=param)
        return top

    def submit(self, req, arrival: float) -> Job:
        """Check a request and submit its engine requests (prompts x n); OpenAIError when it cannot be."""
        if req.model != self.model_name:
            raise OpenAIError(f"the model {req.model!r} does not exist here; this server serves {self.model_name!r}",
                              param="model")
        prompts = self.prompts(req)
        plans = [self.settings(req, len(p)) for p in prompts]
        count = len(prompts) * req.n
        if self.pending + count > self.limit:
            raise OpenAIError(f"the server is full: {self.pending} requests are running or queued, and it takes at "
                              f"most {self.limit} (--max-slots + --max-queue); retry later", status=503)
        job = Job(self, arrival, req.n)
        try:
            for p, s in zip(prompts, plans):
                for j in range(req.n):
                    seed = None if req.seed is None else req.seed + j
                    job.add(self.engine.submit(p, seed=seed, **s), len(p))
        except (ValueError, TypeError) as err:
            job.close()
            raise OpenAIError(str(err)) from None
        except BaseException:
            job.close()
            raise
        return job


class Choice:
    """One engine request of a Job, as the route reports it."""

    def __init__(self, handle, prompt_len: int):
        self.handle, self.prompt_len = handle, prompt_len
        self.times: list[float] = []  # each chunk's arrival, s after the HTTP request's
        self.counts: list[int] = []  # its token count
        self.tokens = 0
        self.finished = False


class Job:
    """One HTTP request's engine requests (its prompts x n choices), read together."""

    def __init__(self, server: Server, arrival: float, n: int):
        self.server, self.arrival, self.n = server, arrival, n
        self.choices: list[Choice] = []  # prompt-major: prompt p's choice j at p * n + j

    def add(self, handle, prompt_len: int) -> None:
        self.choices.append(Choice(handle, prompt_len))
        self.server.pending += 1

    def abort(self) -> None:
        """Abort every choice not finished yet (a disconnect, a shutdown, a refused sibling)."""
        for c in self.choices:
            if not c.finished and not c.handle.done():
                self.server.engine.abort(c.handle)

    async def chunks(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, StreamChunk) as the engine produces them, every choice's interleaved; then each choice's
        accounting is closed (metrics observed, its place in the queue bound released)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read(i: int, c: Choice):
            try:
                async for chunk in c.handle:
                    await queue.put((i, chunk))
            except Exception as err:  # the engine failed this request: reported by finish()
                log.warning("engine request failed: %s", err)
            finally:
                await queue.put((i, None))

        readers = [asyncio.create_task(read(i, c)) for i, c in enumerate(self.choices)]
        try:
            left = len(readers)
            while left:
                i, chunk = await queue.get()
                if chunk is None:
                    left -= 1
                    self._finish(self.choices[i])
                    continue
                c = self.choices[i]
                if chunk.token_ids:
                    c.times.append(time.perf_counter() - self.arrival)
                    c.counts.append(len(chunk.token_ids))
                    c.tokens += len(chunk.token_ids)
                yield i, chunk
        finally:
            for r in readers:
                r.cancel()
            self.close()

    def close(self) -> None:
        """Abort what is unfinished and close every choice's accounting (idempotent)."""
        self.abort()
        for c in self.choices:
            self._finish(c)

    def _finish(self, c: Choice) -> None:
        if c.finished:
            return
        c.finished = True
        self.server.pending -= 1
        reason = "abort"
        if c.handle.done():
            try:
                reason = c.handle.result().finish_reason
            except Exception:
                reason = "error"
        self.server.metrics.observe(reason, c.prompt_len, c.times, c.counts, time.perf_counter() - self.arrival)

    @staticmethod
    def output(c: Choice):
        """A finished choice's RequestOutput; OpenAIError (500) when the engine failed it, (503) when aborted."""
        try:
            out = c.handle.result(timeout=0)
        except Exception as err:
            raise OpenAIError(f"the engine failed this request: {err}", status=500, kind="server_error") from None
        if out.finish_reason == "abort":
            raise OpenAIError("the request was aborted (the server is shutting down)", status=503)
        return out


def build_app(server: Server) -> FastAPI:
    """The FastAPI application over a Server (its engine already warmed up; closed by whoever made it)."""

    app = FastAPI(title="specjax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(OpenAIError(str(err.detail), err.status_code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        body = OpenAIError(f"internal server error ({type(err).__name__}); the server's log has the details", 500,
                           kind="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "specjax", "root": str(server.target.path),
                                            "max_model_len": server.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, ChatRequest)

    async def _generate(request: Request, kind):
        arrival = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise OpenAIError(f"the request body is not valid JSON ({err})") from None
        req = parse(kind, body)
        job = server.submit(req, arrival)
        fmt = Formatter(kind is ChatRequest, server.model_name, server.token_text)
        watcher = asyncio.create_task(_abort_on_disconnect(request, job))
        if req.stream:
            return StreamingResponse(_sse(job, fmt, req, watcher), media_type="text/event-stream")
        try:
            return await _whole(job, fmt)
        finally:
            watcher.cancel()

    return app


async def _abort_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to go away, then abort the job's unfinished requests and release them (a no-op once they
    are done; also when a stream's body never started, so nothing else would)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.close()


async def _whole(job: Job, fmt: Formatter) -> dict[str, Any]:
    """The non-streamed response: every choice's whole output."""
    parts: dict[int, list] = {i: [] for i in range(len(job.choices))}
    async for i, chunk in job.chunks():
        parts[i].append(chunk)
    choices, completion = [], 0
    for i, c in enumerate(job.choices):
        out = Job.output(c)
        lp = fmt.logprobs(i, out.tokens, out.logprobs, out.top_logprobs)
        choices.append(fmt.choice(i, out.text or "", out.finish_reason, out.stop_reason, lp))
        completion += len(out.tokens)
    return fmt.response(choices, _prompt_tokens(job), completion)


async def _sse(job: Job, fmt: Formatter, req, watcher: asyncio.Task) -> AsyncIterator[str]:
    """The streamed response: a `data: {json}` event per chunk (chat choices open with the assistant role), the
    usage chunk when asked, `data: [DONE]`. A failed or aborted request ends its stream with an error event."""
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    started: set[int] = set()
    try:
        async for i, chunk in job.chunks():
            c = job.choices[i]
            if fmt.chat and i not in started:
                started.add(i)
                yield _event(fmt.role_chunk(i))
            reason = chunk.finish_reason
            if reason == "abort":
                break
            lp = fmt.logprobs(i, chunk.token_ids, getattr(chunk, "logprobs", None),
                              getattr(chunk, "top_logprobs", None))
            stop_reason = getattr(chunk, "stop_reason", None)
            if reason is not None and stop_reason is None and c.handle.done():
                stop_reason = Job.output(c).stop_reason
            usage = {"prompt_tokens": c.prompt_len, "completion_tokens": c.tokens,
                     "total_tokens": c.prompt_len + c.tokens} if continuous else None
            yield _event(fmt.chunk(i, chunk.text or "", reason, stop_reason, lp, usage))
        for c in job.choices:
            Job.output(c)  # raises for a failed or aborted choice
        if include_usage:
            yield _event(fmt.usage_chunk(_prompt_tokens(job), sum(c.tokens for c in job.choices)))
    except OpenAIError as err:
        yield _event(err.body())
    finally:
        watcher.cancel()
    yield "data: [DONE]\n\n"


def _prompt_tokens(job: Job) -> int:
    """Usage's prompt_tokens: each prompt counted once, however many choices it has (as OpenAI counts it)."""
    return sum(c.prompt_len for c in job.choices[:: job.n])


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
