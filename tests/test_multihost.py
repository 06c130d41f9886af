"""Two processes on localhost, one jax.distributed job of 8 CPU devices (4 each), decode what one device decodes.

The processes (tests/multihost_check.py) load a safetensors target and draft model built here and the shipped
orbax target with its EAGLE-3 and DSpark heads on a TP-8 and a DP-2 x TP-4 mesh spanning both; each must get one
device's tokens for plain, speculative (draft chain and tree, EAGLE-3, DSpark with the confidence scheduler),
sampled (per-prompt seeds), streamed decoding and inspect_draft, reading only its own devices' slices of the weights,
and every host-made decision must be process 0's. The CLI's --coordinator form likewise. specjax.Engine runs over
the DP 2 x TP 4 mesh with requests arriving at random on process 0 and its shape switching at random: each request
equals one device's decoding, both processes run the same chunks, and neither compiles after warmup; and
`specjax serve` across both processes answers from process 0 what one device decodes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import build_hf_model, save_hf_model
from multihost_check import (ENGINE_ABORTED, ENGINE_REQUESTS, LOCAL_DEVICES, LOOPS, MESHES, NUM_PROCESSES, ONE_DEVICE,
                             READ, decode, load_all, loops, one_device_tokens, prompts)
from serve_fake_engine import until_serving

import specjax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def job_env() -> dict:
    """A child's environment: this checkout's specjax and the tests' helpers importable, 4 CPU devices, no GPU."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["SPECJAX_CPU_LAYOUT"] = "per_layer"  # CPU's own layout: the checks read per-layer weight slices
    root = str(Path(specjax.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_job(commands: list[list[str]], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Start one process per command at once (a job's processes wait for each other), wait for all."""
    procs = [subprocess.Popen(c, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    done = [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(commands, procs, outs)]
    for d in done:
        assert d.returncode == 0, f"{' '.join(d.args[1:3])} failed ({d.returncode}):\n{d.stdout[-2000:]}\n" \
                                  f"{d.stderr[-5000:]}"
    return done


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("multihost")
    save_hf_model(build_hf_model("qwen2", seed=5, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2,
                                 intermediate_size=128), work / "dense")
    save_hf_model(build_hf_model("llama", seed=6, num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                  work / "draft")
    return work


@pytest.fixture(scope="module")
def reports(work) -> list[dict]:
    port = free_port()
    run_job([[sys.executable, str(HERE / "multihost_check.py"), str(i), str(port), str(work)]
             for i in range(NUM_PROCESSES)])
    return [json.loads((work / f"process-{i}.json").read_text()) for i in range(NUM_PROCESSES)]


def test_every_process_decodes_one_devices_tokens_on_both_meshes(work, reports):
    want = decode(*load_all(work), only=ONE_DEVICE)
    every_loop = set(loops(*[None] * 5))  # the table's names (building it runs nothing)
    assert want["dense/sampled_plain"] != want["dense/plain"] and len({tuple(t) for t in want["dense/plain"]}) == 3
    for report in reports:
        assert (report["devices"], report["local_devices"]) == (NUM_PROCESSES * LOCAL_DEVICES, LOCAL_DEVICES)
        assert report["agreed"] == [0, {"from": 0}]
        for mesh in MESHES:
            got = report["meshes"][mesh]["tokens"]
            assert set(got) == set(LOOPS[mesh] or every_loop), (mesh, sorted(got))
            wrong = {k: (tokens, right) for k, tokens in got.items() if tokens != (right := one_device_tokens(want, k))}
            assert not wrong, f"process {report['process_index']} on {mesh}: {wrong}"


def test_unseeded_sampling_is_one_draw_and_different_prompts_are_refused_everywhere(reports):
    assert reports[0]["unseeded"] == reports[1]["unseeded"]
    for report in reports:
        assert "must pass the same prompts and settings: processes [1] differ" in report["different_prompts"]


def test_each_process_reads_and_holds_only_its_devices_slices(reports):
    for report in reports:
        for mesh, (data, model) in MESHES.items():
            r = report["meshes"][mesh]
            assert r["largest_read"] == {k: pytest.approx(1 / model) for k in READ}, (mesh, r["largest_read"])
            # wq [64, 8 heads x 8]: split over the model axis, this process's 4 devices hold 64 / model columns each
            assert r["q_proj_local_shards"] == [[64, 64 // model]] * LOCAL_DEVICES, (mesh, r["q_proj_local_shards"])


def test_the_engine_across_processes_decodes_one_devices_tokens_from_process_0s_decisions(work, reports):
    dense = specjax.load(work / "dense")
    want = [specjax.generate(dense, [p], max_new_tokens=n, eos_token_id=[]).tokens[0] for p, n in ENGINE_REQUESTS]
    leader, follower = (r["engine"] for r in reports)
    for i, (tokens, reason) in enumerate(zip(leader["tokens"], leader["finish_reasons"])):
        if i == ENGINE_ABORTED:  # stopped mid-decoding: what it emitted is plain decoding's start
            assert reason == "abort" and 0 < len(tokens) < len(want[i]) and tokens == want[i][:len(tokens)]
            continue
        assert (tokens, reason) == (want[i], "length"), f"request {i}"
    assert "requests enter a multi-process engine on process 0" in follower["submit_elsewhere"]
    # the same chunks on both processes: every shape change at the same live count, the same counts of everything
    assert {label for _, label in leader["shapes"]} == {"off", "chain:2"}
    assert leader["shapes"] == follower["shapes"]
    assert leader["counters"] == follower["counters"]
    assert leader["counters"]["catch_up_rows"] > 0 and leader["counters"]["requests_aborted"] == 1
    for r in (leader, follower):
        assert (r["compiled_after_warmup"], r["jax_compiles_after_warmup"]) == ([], 0), r


def test_the_cli_joins_a_job_and_process_0_prints_one_devices_output(work):
    model, draft = work / "dense", work / "draft"
    ids = [" ".join(map(str, p)) for p in prompts()[:2]]
    args = ["generate", str(model), "--prompt", ids[0], "--prompt", ids[1], "--max-new-tokens", "6", "--eos", "",
            "--drafter", str(draft), "--num-draft-tokens", "2"]
    port = free_port()
    job = run_job([[sys.executable, "-m", "specjax.cli", *args, "--mesh", "2,4", "--coordinator", f"localhost:{port}",
                    "--num-processes", "2", "--process-id", str(i)] for i in range(2)])
    one = subprocess.run([sys.executable, "-m", "specjax.cli", *args], env={**job_env(), "XLA_FLAGS": ""},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]

    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("--- ")]

    assert len(lines(one.stdout)) == 2
    assert lines(job[0].stdout) == lines(one.stdout)
    assert lines(job[1].stdout) == []  # every process decodes, process 0 prints


def test_serve_across_processes_answers_from_process_0_and_stops_with_it():
    httpx = pytest.importorskip("httpx")
    tiny = ROOT / "checkpoints/tiny/target"
    port, http_port = free_port(), free_port()
    cmds = [[sys.executable, "-m", "specjax.cli", "serve", str(tiny), "--mesh", "2,4", "--max-slots", "2",
             "--max-len", "32", "--greedy-only", "--no-penalties", "--max-logprobs", "-1", "--port", str(http_port),
             "--log-level", "warning", "--coordinator", f"localhost:{port}", "--num-processes", "2",
             "--process-id", str(i)] for i in range(2)]
    procs = [subprocess.Popen(c, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        url = f"http://127.0.0.1:{http_port}"
        printed = until_serving(procs[0], url, 60)
        assert "\nwarm-up:" in "\n" + printed, printed
        answers = [httpx.post(f"{url}/v1/completions", json={"model": "target", "prompt": p, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True}, timeout=300).json()
                   for p in ("def f(x):", "import os")]
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
        rest = [p.stdout.read() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], rest
    printed_by_1 = [line for line in rest[1].splitlines() if line.startswith(("memory plan", "warm", "serving"))]
    assert printed_by_1 == []  # process 1 runs the engine, process 0 serves and prints
    one = specjax.load(tiny)
    want = specjax.generate(one, ["def f(x):", "import os"], max_new_tokens=8, eos_token_id=[]).texts
    assert [a["choices"][0]["text"] for a in answers] == want


def test_the_clis_job_and_mesh_flags_refuse_what_is_incomplete(capsys):
    from specjax.cli import main

    tiny = str(ROOT / "checkpoints/tiny/target")
    for flags, message in ((["--num-processes", "2"], "--num-processes join a multi-process job: add --coordinator"),
                           (["--coordinator", "localhost:1"], "--coordinator needs --num-processes N and --process-id"),
                           (["--mesh", "1,1", "--tensor-parallel", "1"], "pass --mesh D,M or --tensor-parallel N"),
                           (["--mesh", "1,2"], "a (1, 2) mesh needs 2 devices, but this process sees 1")):
        assert main(["generate", tiny, "--prompt", "x", *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", tiny, "--prompt", "x", "--mesh", "2x4"])
    assert "expected D,M (data-parallel replicas, tensor-parallel devices) like 2,4" in capsys.readouterr().err
