"""The README's main command: `specjax demo` on the embedded pair runs end to end."""

import io
import subprocess
import sys

from rich.console import Console

from specjax.demo import run_demo


def test_demo_runs_and_every_method_matches_plain_decoding():
    console = Console(file=io.StringIO(), width=100)
    rows = run_demo(max_new_tokens=16, console=console)  # raises if any method's output differs from plain
    methods = [r["method"] for r in rows]
    assert methods[0] == "plain decoding" and len(rows) == 10
    assert any(m.startswith("EAGLE-3, dynamic tree") for m in methods) and "MTP, chain of 3" in methods
    assert any(m.startswith("DFlash") for m in methods) and any(m.endswith("confidence scheduler") for m in methods)
    assert all(r["tau"] >= 1.0 for r in rows)
    assert all(r["match_rate"] == 1.0 and r["first_divergence"] is None for r in rows)  # fp32: exact
    draft_chain = rows[1]
    assert draft_chain["tau"] > 2.0, draft_chain  # the shipped draft model is a real guesser
    assert "tau" in console.file.getvalue()


def test_cli_entry_point_reports_bad_paths_cleanly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specjax.cli", "demo", "--target", str(tmp_path / "none")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no embedded model" in result.stderr


def test_demo_in_bf16_reports_agreement_instead_of_raising():
    console = Console(file=io.StringIO(), width=160)
    rows = run_demo(max_new_tokens=16, console=console, dtype="bfloat16", methods_like="draft model")
    assert [r["method"] for r in rows] == ["plain decoding", "draft model, chain of 4", "draft model, tree kary:3,2,1"]
    for row in rows:  # a near-tie may flip in bf16: measured and shown, never an AssertionError
        assert 0.0 <= row["match_rate"] <= 1.0 and "first_divergence" in row, row
    shown = console.file.getvalue()
    assert "bfloat16: agreement with plain greedy decoding measured" in shown and "match" in shown


def test_hybrid_demo_matches_plain_decoding_and_its_mtp_layer_drafts():
    """The embedded hybrid (Qwen3.5-style) with the MTP layer it carries: every method equals plain decoding."""
    from specjax.demo import EMBEDDED, hybrid_demo

    console = Console(file=io.StringIO(), width=120)
    rows = hybrid_demo(EMBEDDED / "hybrid", EMBEDDED / "draft", 16, 4, console, None)
    assert [r["method"] for r in rows][:3] == ["plain decoding", "MTP (its own layer), chain of 1",
                                               "MTP (its own layer), chain of 3"]
    assert all(r["match_rate"] == 1.0 and r["first_divergence"] is None for r in rows)
    assert rows[2]["tau"] > 1.5  # the shipped MTP layer really drafts
    assert "linear attention" in console.file.getvalue()
