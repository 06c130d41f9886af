"""`specjax serve` on the real engine, through the official `openai` client: greedy output equal to
specjax.generate's, usage counts, logprobs in each endpoint's format, bad input, 200 concurrent streams with a
quarter disconnected midway, and a clean SIGTERM shutdown of the command itself.

One server for the module: the embedded target (with a chat template beside it) and its draft model, chains of 2,
2 slots, greedy only (half the executables to warm up)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
from serve_fake_engine import until_serving  # noqa: E402

from specjax import generate, load, load_drafter  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.loading.embedded import EMBEDDED_DIR, embedded  # noqa: E402
from specjax.serve.app import Server, build_app  # noqa: E402
from specjax.serve.main import serve_in_thread as serving  # noqa: E402

MAX_LEN, NEW = 128, 12
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = [p["text"][-120:] for p in json.loads((EMBEDDED_DIR / "manifest.json").read_text())["held_out_prompts"]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny-chat"
    shutil.copytree(embedded("target"), path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    target = load(path)
    engine = Engine(target, load_drafter(embedded("draft"), target), max_slots=2, max_len=MAX_LEN,
                    num_draft_tokens=2, logprobs=2, sampling=False, max_prefill_batch=2)
    engine.warmup()
    server = Server(engine, target, "tiny", max_len=MAX_LEN, max_logprobs=2)
    with serving(build_app(server)) as url:
        yield url, engine, server, target
    engine.close()


@pytest.fixture(scope="module")
def reference(served):
    """Plain greedy decoding of each prompt (no drafter): what every server response must equal."""
    target = served[3]
    out = generate(target, PROMPTS, max_new_tokens=NEW, temperature=0.0, logprobs=True, top_logprobs=2)
    return {p: (out.tokens[i], out.texts[i], out.finish_reasons[i], out.logprobs[i], out.top_logprobs[i])
            for i, p in enumerate(PROMPTS)}


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_completions_equal_generate(served, reference):
    url, engine, server, target = served
    c = client(url)
    for prompt in PROMPTS[:3]:
        tokens, text, reason, _, _ = reference[prompt]
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW)
        assert out.choices[0].text == text and out.choices[0].finish_reason == reason
        assert out.usage.prompt_tokens == len(target.encode(prompt)) and out.usage.completion_tokens == len(tokens)
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert chunks[-1].usage.completion_tokens == len(tokens) and chunks[-1].choices == []
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert server.pending == 0


def test_chat_equals_generate(served):
    url, _, _, target = served
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ref = generate(target, [messages], max_new_tokens=NEW, temperature=0.0)
    out = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=NEW)
    assert out.choices[0].message.content == ref.texts[0]
    assert out.usage.completion_tokens == len(ref.tokens[0])
    chunks = list(client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.texts[0]


def test_logprobs_equal_generate(served, reference):
    url, _, _, target = served
    prompt = PROMPTS[0]
    tokens, _, _, logprobs, top = reference[prompt]
    out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=NEW, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert lp.tokens == [target.decode([t], skip_special_tokens=False) for t in tokens]
    for entry, alts in zip(lp.top_logprobs, top):
        for i, v in alts:
            assert entry[target.decode([i], skip_special_tokens=False)] == pytest.approx(v, abs=1e-4)
    chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    stream = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=NEW, logprobs=2, stream=True)
    streamed = [v for ch in stream if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs, abs=1e-4)


def test_bad_input(served):
    url, _, server, _ = served
    cases = [({"prompt": "x", "max_tokens": MAX_LEN}, "max_tokens", "maximum context length"),
             ({"prompt": "x", "temperature": 0.5}, None, "sampl"),  # the engine refuses: greedy only
             ({"prompt": "x", "logprobs": 3}, "logprobs", "at most 2"),
             ({"prompt": "x", "model": "other"}, "model", "does not exist")]
    for body, param, words in cases:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert server.pending == 0


def test_200_streams_a_quarter_disconnected(served, reference):
    """Every fourth client hangs up after its first chunk: the others get exactly generate's text, nothing is left
    in a slot or the queue, nothing compiles, and the server goes on answering."""
    url, engine, server, _ = served
    compiles = engine.stats()["compiles"]
    executables = set(getattr(engine, "_executables", {}))

    async def one(http, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "stream": True}
        text, reason = "", None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text, reason = text + choice["text"], choice["finish_reason"] or reason
                if i % 4 == 3 and text:
                    return None  # hang up midway
        return prompt, text, reason

    async def main():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(main())
    done = [r for r in results if r is not None]
    deadline = time.time() + 30
    while (server.pending or engine.stats()["occupancy"] or engine.stats()["queue_length"]) and time.time() < deadline:
        time.sleep(0.1)
    stats = engine.stats()
    assert server.pending == 0 and stats["occupancy"] == 0 and stats["queue_length"] == 0
    assert httpx.get(f"{url}/health").status_code == 200
    out = client(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=NEW)
    assert out.choices[0].text == reference[PROMPTS[1]][1]
    # (the engine's first version failed both of these here: a few requests ended at once with no text after
    # requests with logprobs, and a row move compiled after warm-up)
    wrong = [(prompt[-40:], text, reason) for prompt, text, reason in done if text != reference[prompt][1]]
    assert not wrong, (len(wrong), wrong[:3])
    assert len(done) == 150
    new = sorted(map(str, set(getattr(engine, "_executables", {})) - executables))
    assert stats["compiles"] == compiles, f"compiled after warm-up: {new}"

def test_command_prints_its_plan_and_stops_cleanly_on_sigterm(tmp_path):
    """`specjax serve` as a user runs it: memory plan, warm-up time and URL at startup; SIGTERM with a request in
    flight lets it finish, then the process exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "specjax.cli", "serve", str(embedded("target")), "--max-slots", "4", "--max-len",
           "64", "--greedy-only", "--max-logprobs", "-1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        printed = until_serving(proc, url, 30)
        assert "memory plan" in printed and "4 slots x 64 tokens" in printed and "warm-up:" in printed
        assert f"{url}/v1" in printed
        body = {"model": "target", "prompt": "def f(x):", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = r.iter_lines()
            assert next(e for e in events if e.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [e for e in events if e.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the request in flight finished
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
