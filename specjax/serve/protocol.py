"""The OpenAI request bodies the server takes, checked field by field, and the error object it answers with.

Fields are OpenAI's, plus vLLM's extras for what OpenAI lacks (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, chat_template_kwargs, and
stream_options.continuous_usage_stats). Parsing is strict (no "5" for 5, no true for 1) and refuses unknown fields,
so a request that relies on something this server does not do (best_of, logit_bias, tools, echo, ...) is told so
instead of being silently answered without it. The numeric ranges are vLLM's `SamplingParams` checks.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class OpenAIError(Exception):
    """A request the server refuses: answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # vLLM's: generate past EOS (benchmarks at set output lengths)
    user: str | None = None  # OpenAI's end-user id: accepted, unused


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)  # the top n at each position, with the sampled token's


class ChatRequest(Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None


def parse(kind: type[BaseModel], body: Any) -> BaseModel:
    """The request of `kind` from a decoded JSON body, or an OpenAIError naming the first wrong field."""
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not isinstance(p, int)) or None
        if first["type"] == "extra_forbidden":
            known = ", ".join(sorted(kind.model_fields))
            raise OpenAIError(f"unknown field {param!r}: this server does not support it; the fields it takes are "
                              f"{known}", param=param) from None
        given = f" (got {first['input']!r})" if first["type"] != "missing" else ""
        raise OpenAIError(f"{param}: {first['msg']}{given}", param=param) from None


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with their content as text: a list of {"type": "text", "text"} parts is joined; other parts
    (images, audio) are refused."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                raise OpenAIError(f"messages[{i}].content holds {sorted(kinds - {'text'})} parts: this server takes "
                                  "text only", param="messages")
            message = {**message, "content": "".join(p.get("text", "") for p in content)}
        out.append(message)
    return out
