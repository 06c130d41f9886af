"""The benchmarks run end to end in miniature, so the commands quoted in the README keep working."""

import json
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
