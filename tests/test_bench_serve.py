"""`specjax bench serve`: vLLM's metrics computed by hand on known timings, and measured against a scripted server.

The scripted server (standard library, 127.0.0.1 only) streams each request's chunks after set delays, with
per-chunk usage, and serves /v1/models and a /metrics page whose speculative counters grow with every request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("httpx")

from specjax.bench.serving import arrivals, datasets, metrics, server_metrics  # noqa: E402
from specjax.bench.serving.client import RequestResult  # noqa: E402
from specjax.bench.serving.main import benchmark, print_table, report  # noqa: E402
from specjax.cli import build_parser  # noqa: E402
from specjax.loading.embedded import EMBEDDED_DIR, embedded  # noqa: E402

# ---- the metrics, by hand --------------------------------------------------------------------------------------


def hand_results() -> list[RequestResult]:
    """Two requests with known chunk times and one failure (times in s after each send; starts after the run's)."""
    r1 = RequestResult(prompt_len=10, output_tokens=4, success=True, start=0.0, ttft=0.1, latency=0.4,
                       content_times=[0.1, 0.3, 0.35], token_times=[0.1, 0.3, 0.35], token_counts=[1, 2, 1])
    r2 = RequestResult(prompt_len=6, output_tokens=3, success=True, start=0.9, ttft=0.2, latency=0.25,
                       content_times=[0.2], token_times=[0.2], token_counts=[3])
    r3 = RequestResult(prompt_len=5, error="HTTP 400: bad", start=1.0)
    return [r1, r2, r3]


def test_metrics_by_hand():
    out = metrics.calculate(hand_results(), duration_s=2.0, percentiles=(90.0, 99.0))
    assert (out["completed"], out["failed"], out["total_input_tokens"], out["total_output_tokens"]) == (2, 1, 16, 7)
    assert out["request_throughput"] == pytest.approx(1.0)
    assert out["output_throughput"] == pytest.approx(3.5)
    assert out["total_token_throughput"] == pytest.approx(11.5)
    assert out["request_goodput"] is None
    # TTFT 100, 200 ms; TPOT (400 - 100) / 3 = 100 and (250 - 200) / 2 = 25; ITL per chunk 200, 50;
    # ITL per token: r1's chunk of 2 after 200 ms -> 100, 100, then 50; r2's one chunk of 3 -> 0, 0; E2EL 400, 250
    expect = {"ttft": [100, 200], "tpot": [100, 25], "itl": [200, 50], "itl_per_token": [100, 100, 50, 0, 0],
              "e2el": [400, 250]}
    for name, ms in expect.items():
        assert out[f"mean_{name}_ms"] == pytest.approx(np.mean(ms)), name
        assert out[f"median_{name}_ms"] == pytest.approx(np.median(ms)), name
        assert out[f"std_{name}_ms"] == pytest.approx(np.std(ms)), name
    assert out["p90_ttft_ms"] == pytest.approx(190.0)  # linear interpolation: 100 + 0.9 x 100
    assert out["p99_e2el_ms"] == pytest.approx(250 + 0.99 * 150)
    assert out["p90_itl_per_token_ms"] == pytest.approx(100.0)
    # whole seconds from the first send: r1's 4 tokens and r2's... r2's 3 tokens come at 0.9 + 0.2 = 1.1 s
    assert out["max_output_tokens_per_s"] == 4 and out["max_concurrent_requests"] == 2


def test_goodput_by_hand():
    results = hand_results()
    assert metrics.calculate(results, 2.0, goodput={"ttft": 120})["request_goodput"] == pytest.approx(0.5)
    assert metrics.calculate(results, 2.0, goodput={"ttft": 120, "tpot": 50})["request_goodput"] == 0
    assert metrics.calculate(results, 2.0, goodput={"e2el": 400})["request_goodput"] == pytest.approx(1.0)
    assert metrics.parse_goodput(["ttft:120", "tpot:50"]) == {"ttft": 120.0, "tpot": 50.0}
    assert metrics.parse_goodput(["ttft:120,e2el:9"]) == {"ttft": 120.0, "e2el": 9.0}
    for bad in (["ttfx:1"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            metrics.parse_goodput(bad)


def test_output_tokens_fall_back_to_the_text_then_the_chunks():
    r = RequestResult(prompt_len=1, success=True, ttft=0.1, latency=0.3, content_times=[0.1, 0.2, 0.3], text="abcd")
    assert metrics.output_len(r, count_tokens=len) == 4
    assert metrics.output_len(r) == 3
    assert metrics.itl_per_token(r) == []  # no per-chunk usage: no per-token ITL, and no key for it
    assert "mean_itl_per_token_ms" not in metrics.calculate([r], 1.0)


# ---- arrivals and datasets ---------------------------------------------------------------------------------------


def test_arrivals():
    poisson = arrivals.send_offsets(200, rate=10.0, seed=1)
    assert np.all(np.diff(poisson) >= 0) and poisson[-1] == pytest.approx(20.0)  # rescaled to n / rate, as vLLM
    assert poisson == arrivals.send_offsets(200, rate=10.0, seed=1) != arrivals.send_offsets(200, rate=10.0, seed=2)
    gaps = np.diff(poisson)
    assert 0.7 < np.std(gaps) / np.mean(gaps) < 1.3  # exponential gaps: coefficient of variation 1
    even = np.diff(arrivals.send_offsets(200, rate=10.0, burstiness=100.0, seed=1))
    assert np.std(even) / np.mean(even) < 0.2  # Gamma of shape 100: CV 0.1
    assert arrivals.send_offsets(5, float("inf")) == [0.0] * 5
    rates = arrivals.request_rates(5, 1.0, "updown", 1.0, 9.0)
    assert rates == [1.0, 5.0, 9.0, 5.0, 1.0]
    assert arrivals.request_rates(3, 1.0, "exponential", 1.0, 4.0) == pytest.approx([1.0, 2.0, 4.0])
    with pytest.raises(ValueError, match="--ramp-up-start-rps"):
        arrivals.send_offsets(5, 1.0, ramp="linear")
    with pytest.raises(ValueError, match="--burstiness"):
        arrivals.send_offsets(5, 1.0, burstiness=0)


def test_datasets(tmp_path):
    tok = datasets.load_tokenizer(embedded("target"))
    rand = datasets.random_samples(tok, 20, input_len=32, output_len=8, range_ratio=0.25, seed=0)
    assert all(6 <= s.output_len <= 10 for s in rand) and len({s.output_len for s in rand}) > 1
    assert all(isinstance(s.prompt, str) and s.prompt_len > 0 for s in rand)
    assert rand == datasets.random_samples(tok, 20, 32, 8, 0.25, seed=0)
    with pytest.raises(ValueError, match="--tokenizer"):
        datasets.random_samples(None, 2, 8, 8, 0.0, 0)

    long = "word " * 20
    convs = [{"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long * 2}]},
             {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},  # prompt < 4
             {"conversations": [{"role": "user", "content": long + "?"}, {"role": "assistant", "content": long}]},
             {"prompt": long + "!"}]
    file = tmp_path / "share.json"
    file.write_text(json.dumps(convs[:3]))
    got = datasets.file_samples(file, tok, 2, None, seed=0)
    assert sorted(s.prompt for s in got) == sorted([long, long + "?"])  # the short prompt is skipped
    assert {s.output_len for s in got} == {len(tok.encode(long * 2, add_special_tokens=False).ids),
                                           len(tok.encode(long, add_special_tokens=False).ids)}
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(c) for c in convs))
    assert len(datasets.file_samples(jsonl, None, 4, 16, seed=0)) == 4
    with pytest.raises(ValueError, match="--sharegpt-output-len"):
        datasets.file_samples(jsonl, None, 4, None, seed=0)
    with pytest.raises(ValueError, match="fewer than --num-prompts"):
        datasets.file_samples(file, tok, 3, None, seed=0)

    held = datasets.embedded_samples(EMBEDDED_DIR / "manifest.json", tok, 10, None)
    assert len(held) == 10 and held[0].prompt == held[8].prompt and held[0].output_len == 64


# ---- against a scripted server -----------------------------------------------------------------------------------

# Each request's stream: (delay before the chunk in s, its text, tokens it carries). The finish chunk follows.
# The server records when it actually wrote each chunk (sleeps overrun on a busy machine): those are the known
# timings the client's measurements and the metrics are checked against, computed by hand.
SCRIPT = [(0.15, "a", 1), (0.2, "bc", 2), (0.1, "d", 1)]
TOLERANCE_S = 0.05  # between a chunk's write and its read on the loopback
WRITES: dict[str, list[float]] = {}  # prompt -> perf_counter at each content chunk's write, then the finish chunk's


class ScriptedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: no chunked encoding to write
    served = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"object": "list", "data": [{"id": "scripted"}]}).encode())
        n = ScriptedHandler.served
        page = (f"# TYPE scripted:spec_decode_num_drafts counter\nscripted:spec_decode_num_drafts_total {3 * n}\n"
                f"# TYPE scripted:spec_decode_num_draft_tokens counter\n"
                f"scripted:spec_decode_num_draft_tokens_total {9 * n}\n"
                f"# TYPE scripted:spec_decode_num_accepted_tokens counter\n"
                f"scripted:spec_decode_num_accepted_tokens_total {4 * n}\n"
                f"# TYPE scripted:spec_decode_num_accepted_tokens_per_pos counter\n"
                + "".join(f'scripted:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {c * n}\n'
                          for i, c in enumerate((2, 1, 1)))
                + "# TYPE scripted:spec_decode_shape_info gauge\n"
                  'scripted:spec_decode_shape_info{shape="chain:3"} 1\n'
                  f"# TYPE scripted:num_requests_running gauge\nscripted:num_requests_running 1\n")
        self._send(200, page.encode(), "text/plain; version=0.0.4")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path.endswith("/chat/completions")
        if body.get("max_tokens", body.get("max_completion_tokens")) == 13:  # the request the script refuses
            err = {"error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": None}}
            return self._send(400, json.dumps(err).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        usage_each = body.get("stream_options", {}).get("continuous_usage_stats", False)

        def emit(obj):
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def choice(text, finish=None):
            return {"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat else \
                {"index": 0, "text": text, "finish_reason": finish}

        if chat:  # the role chunk comes at once and carries no content: it must not count as the first token
            emit({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        done, writes = 0, WRITES.setdefault(body.get("prompt") or body["messages"][0]["content"], [])
        for delay, text, k in SCRIPT:
            time.sleep(delay)
            done += k
            usage = {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}
            writes.append(time.perf_counter())
            emit({"choices": [choice(text)], **({"usage": usage} if usage_each else {})})
        with ScriptedHandler.lock:  # counted before the client can see the end (as a server's counters are), so a
            ScriptedHandler.served += 1  # /metrics scrape right after a response always includes it
        writes.append(time.perf_counter())
        emit({"choices": [choice("", "length")]})
        emit({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def scripted_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def bench_args(*extra: str):
    return build_parser().parse_args(["bench", "serve", "--dataset-name", "embedded", "--disable-tqdm", *extra])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_against_the_scripted_server(scripted_url, endpoint, tmp_path, capsys):
    tag = endpoint.split("/")[-2]
    samples = [datasets.Sample(f"{tag}{i}", 3, 4) for i in range(4)] + [datasets.Sample("y", 3, 13)]
    run = asyncio.run(benchmark(scripted_url, endpoint, None, samples, max_concurrency=2, progress=False,
                                metrics_interval_s=0.05))
    assert run["model"] == "scripted"
    ok = [r for r in run["results"] if r.success]
    assert len(ok) == 4 and "too long" in run["results"][4].error
    # by hand, from when the server wrote each chunk: TTFT w0; ITL per chunk w1 - w0, w2 - w1; per token
    # (w1 - w0) / 2 twice (that chunk held 2 tokens), then w2 - w1; E2EL at the finish chunk w3; TPOT (w3 - w0) / 3
    hand = {name: [] for name in metrics.METRICS}
    for i, r in enumerate(ok):
        w = [t - (run["t0"] + r.start) for t in WRITES[f"{tag}{i}"][-4:]]  # (the first also served the test request)
        assert (r.output_tokens, r.prompt_len, r.text) == (4, 7, "abcd")
        assert r.content_times == pytest.approx(w[:3], abs=TOLERANCE_S)
        assert r.latency == pytest.approx(w[3], abs=TOLERANCE_S) and r.token_counts == [1, 2, 1]
        hand["ttft"].append(w[0])
        hand["tpot"].append((w[3] - w[0]) / 3)
        hand["itl"] += [w[1] - w[0], w[2] - w[1]]
        hand["itl_per_token"] += [(w[1] - w[0]) / 2] * 2 + [w[2] - w[1]]
        hand["e2el"].append(w[3])
    args = bench_args("--endpoint", endpoint, "--goodput", "ttft:1000", "tpot:1")
    result = report(run, args)
    assert result["completed"] == 4 and result["failed"] == 1
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] == 28  # from the usage chunks
    for name, values in hand.items():
        for stat, f in (("mean", np.mean), ("median", np.median), ("p99", lambda v: np.percentile(v, 99))):
            assert result[f"{stat}_{name}_ms"] == pytest.approx(1000 * f(values), abs=1000 * TOLERANCE_S), name
    assert result["request_goodput"] == 0  # TPOT ~150 ms > 1 ms
    assert result["request_throughput"] == pytest.approx(4 / run["duration"])
    # the server's counters grew by 3 drafts, 9 draft tokens, 4 accepted a request, over the 4 it served in the run
    server = result["server"]
    assert server["spec_decode_num_drafts"] == 12 and server["spec_decode_num_accepted_tokens"] == 16
    assert server["spec_decode_acceptance_rate"] == pytest.approx(16 / 36)
    assert server["spec_decode_mean_acceptance_length"] == pytest.approx(1 + 16 / 12)
    assert server["spec_decode_acceptance_per_position"] == pytest.approx([8 / 12, 4 / 12, 4 / 12])
    assert result["server_gauges"] and result["server_gauges"][0]["shape"] == "chain:3"
    print_table(result, list(metrics.METRICS))
    printed = capsys.readouterr().out
    assert "Mean TTFT (ms):" in printed and "P99 ITL per token (ms):" in printed and "Mean acceptance length" in printed


def test_command_end_to_end(scripted_url, tmp_path, capsys):
    """The subcommand as a user runs it: vLLM's flags, the JSON written, the picture drawn."""
    from specjax.cli import main

    out = tmp_path / "run.json"
    code = main(["bench", "serve", "--base-url", scripted_url, "--dataset-name", "embedded", "--num-prompts", "3",
                 "--request-rate", "20", "--burstiness", "0.5", "--seed", "3", "--disable-tqdm", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", out.name, "--percentile-metrics", "ttft,itl",
                 "--metrics-interval", "0.05", "--plot", str(tmp_path / "run.png")])
    assert code == 0
    saved = json.loads(out.read_text())
    for key in ("completed", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "p90_itl_ms", "input_lens", "output_lens", "ttfts", "itls",
                "errors"):
        assert key in saved, key
    assert "mean_tpot_ms" not in saved  # not among --percentile-metrics
    assert saved["completed"] == 3 and saved["num_prompts"] == 3 and saved["output_lens"] == [4, 4, 4]
    assert (tmp_path / "run.png").stat().st_size > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_parse_metrics_page():
    page = ('# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens counter\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0\n')
    before = server_metrics.parse(page.replace("10.0", "0").replace("30.0", "0").replace("15.0", "0"))
    after = server_metrics.parse(page)
    got = server_metrics.acceptance(before, after)  # vLLM's own names read the same
    assert got["spec_decode_acceptance_rate"] == 0.5 and got["spec_decode_mean_acceptance_length"] == 2.5
    assert server_metrics.acceptance(None, after) is None
