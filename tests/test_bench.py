"""The benchmarks run end to end in miniature, so the commands quoted in the README and docs/benchmarks.md keep
working."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args], capture_output=True,
                          text=True, timeout=600)


def test_spec_benchmark_and_replay_sweep(tmp_path):
    out = tmp_path / "spec.json"
    result = run_bench("spec", "--batches", "2", "--repeats", "1", "--max-new-tokens", "8", "--tree", "kary:2",
                       "--sweep", "--sweep-k", "2", "--sweep-accept", "0.5,1.0", "--sweep-batches", "1",
                       "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    methods = [r["method"] for r in data["drafters"]]
    assert methods == ["plain", "draft chain:4", "draft kary:2", "ngram chain:4"]
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1.0 for r in data["drafters"])
    perfect = next(r for r in data["replay_sweep"] if r["accept_rate"] == 1.0)
    assert perfect["tau"] > 2.0  # every replayed draft is right: K=2 chains accepted whole until the budget
    assert "replay sweep" in result.stdout


def test_ar_benchmark_against_transformers(tmp_path):
    out = tmp_path / "ar.json"
    result = run_bench("ar", "--preset", "tiny20m", "--batch", "1", "--prompt-len", "8", "--max-new-tokens", "4",
                       "--repeats", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["batch"] == 1
    assert rows[0]["greedy_rows_identical"] == 1, rows[0]  # both sides decoded the same tokens


def test_spec_preset_runs_random_target_and_draft_on_cpu_in_bf16(tmp_path):
    out = tmp_path / "spec_preset.json"
    result = run_bench("spec", "--preset", "tiny20m", "--dtype", "bfloat16", "--batches", "1", "--repeats", "1",
                       "--max-new-tokens", "4", "--prompt-len", "8", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny20m" and data["dtype"] == "bfloat16" and data["machine"]["jax_backend"] == "cpu"
    assert [r["method"] for r in data["drafters"]] == ["plain", "draft chain:4", "replay chain:4 @0.80"]
    for row in data["drafters"]:  # bf16: agreement with plain decoding is reported, not enforced
        assert 0.0 <= row["match_rate"] <= 1.0 and "first_divergence" in row, row
    assert "match" in result.stdout


def test_spec_8b_preset_refuses_cpu_clearly():
    result = run_bench("spec", "--preset", "8b", "--batches", "1")
    assert result.returncode == 2
    assert "needs a GPU" in result.stderr and "--preset tiny20m" in result.stderr


# ---------------------------------------------------------------- scripts/gpu_checks.sh

GPU_CHECKS = ROOT / "scripts" / "gpu_checks.sh"
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ -n "${FAKE_FAIL:-}" ]; then case "$*" in *"$FAKE_FAIL"*) exit 3 ;; esac; fi
exit 0
"""


def run_gpu_checks(tmp_path, fail: str = "", *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script with fake `python` and `nvidia-smi` first on PATH; (result, the fake python's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho fake-gpu\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "FAKE_LOG": str(log), "FAKE_FAIL": fail}
    result = subprocess.run(["bash", str(GPU_CHECKS), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    return result, log.read_text().splitlines()


def test_gpu_checks_parses():
    result = subprocess.run(["bash", "-n", str(GPU_CHECKS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_checks_runs_every_step_and_fails_when_one_fails(tmp_path):
    result, calls = run_gpu_checks(tmp_path, fail="bench_kernel.py")
    assert result.returncode != 0, result.stdout
    assert any("bench.py ar --preset 8b" in c for c in calls)  # the steps after the failure still ran
    assert any("bench.py spec --preset 8b --batches 1,8,64" in c for c in calls)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "bench_kernel     FAILED (exit 3)" in summary and "bench_spec_8b    ok" in summary


def test_gpu_checks_exits_zero_when_every_step_succeeds(tmp_path):
    result, calls = run_gpu_checks(tmp_path)
    assert result.returncode == 0, result.stdout
    assert any("pytest -q tests/kernels" in c for c in calls)
    assert "FAILED" not in (tmp_path / "out" / "summary.txt").read_text()


def test_gpu_checks_tp_skips_the_allreduce_on_one_gpu(tmp_path):
    result, calls = run_gpu_checks(tmp_path, "", "tp")
    assert result.returncode == 0, result.stdout
    assert "bench_allreduce: skipped (0 GPU here" in result.stdout
    assert not any("bench_allreduce.py" in c for c in calls)


def test_gpu_checks_header_states_the_sum_of_its_timeouts():
    """Each part (dense: no argument; one branch per named part) runs the common steps and its own branch: the sum
    its header states holds, under the device's 10-minute limit per command."""
    text = GPU_CHECKS.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    before, after = code.split('if [ "${1:-}" = "compile" ]; then', 1)
    code = before + after.split("\nfi\n", 1)[1]  # the compile mode runs no GPU step and exits
    marker = re.compile(r'^(?:if|elif) \[ "\$\{1:-\}" = "(\w+)" \]; then$', re.M)
    starts = list(marker.finditer(code))
    common = code[:starts[0].start()]
    branches = {m.group(1): code[m.end(): starts[k + 1].start() if k + 1 < len(starts) else len(code)]
                for k, m in enumerate(starts)}
    last = starts[-1].group(1)  # its text runs on into the final else: the dense part
    branches[last], branches["dense"] = re.split(r"^else$", branches[last], maxsplit=1, flags=re.M)

    def total(part: str) -> int:
        return sum(int(t) for t in re.findall(r"\btimeout (\d+)\b", part))

    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert set(branches) >= {"dense", "hybrid", "moe", "tp", "quant", "blocktrees", "serve", "engine"}
    for name, branch in branches.items():
        stated = re.search(rf"{name} part's (?:timeouts add up )?to (\d+) s \((\d+) min (\d+) s\)", header)
        assert stated, f"the header must state the {name} part's sum: 'N s (M min S s)'"
        s, m, sec = stated.groups()
        part = common + branch
        assert int(s) == total(part) and int(m) * 60 + int(sec) == total(part), (name, total(part))
        assert total(part) < 600, f"{name}: the device allows 10 minutes a command"
