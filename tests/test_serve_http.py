"""`specjax serve`'s HTTP layer on a fake engine (tests/serve_fake_engine.py): the OpenAI formats through the official
client, streaming, logprobs, n, usage, /metrics, every bad-input case, the bounded queue and disconnects. The real
engine's outputs are tested in test_serve.py."""

from __future__ import annotations

import json
import shutil
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from serve_fake_engine import FakeEngine, continuation, token_logprob  # noqa: E402
from specjax import load  # noqa: E402
from specjax.loading.embedded import embedded  # noqa: E402
from specjax.serve.app import Server, build_app  # noqa: E402
from specjax.serve.main import serve_in_thread as serving  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MAX_LEN = 128


@pytest.fixture(scope="module")
def target():
    return load(embedded("target"))


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The embedded target with a chat template beside it."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(embedded("target"), path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return load(path)


def start(target, max_queue=16, max_logprobs=5, **engine_kw):
    engine = FakeEngine(target, max_len=MAX_LEN, **engine_kw)
    server = Server(engine, target, "tiny", max_len=MAX_LEN, max_queue=max_queue, max_logprobs=max_logprobs)
    return engine, server


@pytest.fixture(scope="module")
def chat_server(chat_target):
    engine, server = start(chat_target)
    with serving(build_app(server)) as url:
        yield url, engine, server
    engine.close()


@pytest.fixture(scope="module")
def plain_server(target):
    """A checkpoint without a chat template."""
    engine, server = start(target)
    with serving(build_app(server)) as url:
        yield url, engine, server
    engine.close()


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def expected_text(target, prompt: str, n: int) -> str:
    return target.decode(continuation(target.encode(prompt), n, target.cfg.vocab_size))


def test_models_health_metrics(chat_server):
    url, engine, _ = chat_server
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/health").status_code == 200
    page = httpx.get(f"{url}/metrics").text
    for name in ("specjax:num_requests_running", "specjax:num_requests_waiting", "specjax:spec_decode_num_drafts_total",
                 "specjax:spec_decode_num_draft_tokens_total", "specjax:spec_decode_num_accepted_tokens_total",
                 'specjax:spec_decode_num_accepted_tokens_per_pos_total{position="1"}',
                 'specjax:spec_decode_shape_info{shape="chain:3"} 1.0', "specjax:spec_decode_shape_nodes 3.0",
                 "specjax:time_to_first_token_seconds_bucket", "specjax:e2e_request_latency_seconds_count",
                 "specjax:compiles_total"):
        assert name in page, name


def test_completion(chat_server, chat_target):
    url, engine, server = chat_server
    out = client(url).completions.create(model="tiny", prompt="def f(x):", max_tokens=7, temperature=0)
    want = expected_text(chat_target, "def f(x):", 7)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    prompt_len = len(chat_target.encode("def f(x):"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (prompt_len, 7,
                                                                                           prompt_len + 7)
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    settings = engine.submitted[-1]
    assert settings["max_new_tokens"] == 7 and settings["temperature"] == 0 and "logprobs" not in settings
    assert "eos_token_id" not in settings
    client(url).completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert engine.submitted[-1]["eos_token_id"] == []
    # unset: OpenAI's defaults (this checkpoint's generation_config.json sets none); 16 tokens on /v1/completions
    client(url).completions.create(model="tiny", prompt=[5, 6, 7])
    assert {k: engine.submitted[-1][k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p")} == \
        {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    assert server.pending == 0


def test_completion_stream_and_usage(chat_server, chat_target):
    url, _, _ = chat_server
    stream = client(url).completions.create(model="tiny", prompt="import os", max_tokens=9, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected_text(chat_target, "import os", 9)
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert len(chunks) - 1 == 5  # two tokens a step: 2, 2, 2, 2, 1
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage(chat_server):
    url, _, _ = chat_server
    body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    counts = [json.loads(e)["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts == [2, 4, 5] and json.loads(events[-2])["usage"]["prompt_tokens"] == 2


def test_chat(chat_server, chat_target):
    url, engine, _ = chat_server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = chat_target.encode("system: be brief\nuser: hello\nassistant:")[1:]  # the template writes no BOS
    out = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == chat_target.decode(continuation(ids, 6, chat_target.cfg.vocab_size))
    assert out.usage.prompt_tokens == len(ids) and out.object == "chat.completion"
    # text parts are joined; max_tokens unset is what is left of the context
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    client(url).chat.completions.create(model="tiny", messages=parts, max_completion_tokens=3)
    assert engine.submitted[-1]["max_new_tokens"] == 3
    stream = client(url).chat.completions.create(model="tiny", messages=messages, stream=True, max_tokens=4)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content[:len(
        chat_target.decode(continuation(ids, 4, chat_target.cfg.vocab_size)))]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    left = MAX_LEN - len(chat_target.encode("user: x\nassistant:")[1:])
    assert engine.submitted[-1]["max_new_tokens"] == left


def test_logprobs_formats(chat_server, chat_target):
    url, engine, _ = chat_server
    out = client(url).completions.create(model="tiny", prompt=[9], max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    toks = continuation([9], 3, chat_target.cfg.vocab_size)
    texts = [chat_target.decode([t], skip_special_tokens=False) for t in toks]
    assert lp.tokens == texts and lp.token_logprobs == [token_logprob(i) for i in range(3)]
    assert lp.text_offset == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    assert all(len(d) <= 3 and d[texts[i]] == token_logprob(i) for i, d in enumerate(lp.top_logprobs))
    assert engine.submitted[-1]["logprobs"] is True and engine.submitted[-1]["top_logprobs"] == 2

    chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == [token_logprob(i) for i in range(3)]
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert content[0].top_logprobs[1].logprob == token_logprob(0) - 1
    # streamed: each chunk carries its own tokens' entries
    stream = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, logprobs=True, top_logprobs=1, stream=True)
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [token_logprob(i) for i in range(3)]


def test_n_choices_and_seeds(chat_server):
    url, engine, _ = chat_server
    out = client(url).completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=2, n=2, seed=10)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert [s["seed"] for s in engine.submitted[-4:]] == [10, 11, 10, 11]
    assert out.usage.completion_tokens == 8
    stream = client(url).completions.create(model="tiny", prompt="ab", max_tokens=4, n=3, stream=True)
    got = {}
    for c in stream:
        got.setdefault(c.choices[0].index, []).append(c.choices[0].text)
    assert sorted(got) == [0, 1, 2] and len({"".join(v) for v in got.values()}) == 1


def error_of(url, path, body, raw=None):
    r = httpx.post(f"{url}{path}", json=body if raw is None else None, content=raw,
                   headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return r.status_code, err


@pytest.mark.parametrize("body,param,words", [
    ({"model": "nope", "prompt": "x"}, "model", "does not exist"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 500}, "max_tokens", "maximum context length is 128"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"model": "tiny", "prompt": "x", "logprobs": 9}, "logprobs", "at most 5"),
    ({"model": "tiny", "prompt": "x", "best_of": 2}, "best_of", "unknown field"),
    ({"model": "tiny", "prompt": []}, "prompt", "empty"),
    ({"model": "tiny", "prompt": [99999]}, "prompt", "[0, 4096)"),
    ({"prompt": "x"}, "model", "Field required"),
])
def test_bad_completions(chat_server, body, param, words):
    url, _, server = chat_server
    status, err = error_of(url, "/v1/completions", body)
    assert status == 400 and err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error" and server.pending == 0


def test_bad_input_other_cases(chat_server, plain_server):
    url, _, _ = chat_server
    status, err = error_of(url, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in err["message"]
    status, err = error_of(url, "/v1/completions", None, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in err["message"]
    one = [{"role": "user", "content": "x"}]
    status, err = error_of(url, "/v1/chat/completions", {"model": "tiny", "messages": one, "top_logprobs": 2})
    assert status == 400 and err["param"] == "top_logprobs"
    status, err = error_of(url, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert status == 400 and "text only" in err["message"]
    plain_url = plain_server[0]
    status, err = error_of(plain_url, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}]})
    assert status == 400 and err["param"] == "messages" and "template" in err["message"]
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):  # the client sees an OpenAI error too
        client(url).completions.create(model="tiny", prompt="x", temperature=-2)


def test_engine_refusal_and_failure_reach_the_client_without_traceback(target):
    class Refusing(FakeEngine):
        def submit(self, prompt, **settings):
            if settings.get("seed") == 1:
                raise ValueError("seed 1 is refused here: use another")
            if settings.get("seed") == 2:
                raise RuntimeError("boom")
            return super().submit(prompt, **settings)

    engine = Refusing(target, max_len=MAX_LEN)
    server = Server(engine, target, "tiny", max_len=MAX_LEN)
    with serving(build_app(server)) as url:
        status, err = error_of(url, "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 1})
        assert status == 400 and err["message"] == "seed 1 is refused here: use another"
        status, err = error_of(url, "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2})
        assert status == 500 and err["type"] == "server_error" and "RuntimeError" in err["message"]
        assert "boom" not in err["message"]
        # n=3 where the second choice is refused: the first is aborted, nothing stays pending
        status, err = error_of(url, "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 0, "n": 3})
        assert status == 400 and server.pending == 0
    engine.close()


def test_full_queue_is_503_and_disconnect_aborts(target):
    engine, server = start(target, max_queue=1, max_slots=1, step_s=0.05, tokens_per_chunk=1)
    with serving(build_app(server)) as url:
        body = {"model": "tiny", "prompt": [3], "max_tokens": 120, "stream": True}  # 6 s each on its own
        with httpx.Client(timeout=10) as http, http.stream("POST", f"{url}/v1/completions", json=body) as first, \
                http.stream("POST", f"{url}/v1/completions", json=body) as second:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming has begun
            r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "full" in r.json()["error"]["message"] and server.pending == 2
            del second
        # both clients went away mid-stream: their requests are aborted and the slot is free again
        deadline = time.time() + 5
        while (server.pending or engine.running or engine.waiting) and time.time() < deadline:
            time.sleep(0.05)
        assert server.pending == 0 and not engine.running and not engine.waiting
        out = client(url).completions.create(model="tiny", prompt=[3], max_tokens=2)
        assert out.choices[0].finish_reason == "length"
        page = httpx.get(f"{url}/metrics").text
        assert 'specjax:request_success_total{finished_reason="abort"} 2.0' in page
    engine.close()


def test_non_streamed_disconnect_aborts(target):
    engine, server = start(target, max_slots=1, step_s=0.1, tokens_per_chunk=1)  # 12 s to finish on its own
    with serving(build_app(server)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [3], "max_tokens": 120}, timeout=0.3)
        deadline = time.time() + 5
        while (server.pending or engine.running) and time.time() < deadline:
            time.sleep(0.05)
        assert server.pending == 0 and not engine.running
        assert 'specjax:request_success_total{finished_reason="abort"} 1.0' in httpx.get(f"{url}/metrics").text
    engine.close()
