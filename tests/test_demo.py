"""The README's main command: `specjax demo` on the embedded pair runs end to end."""

import io
import subprocess
import sys

from rich.console import Console

from specjax.demo import run_demo


def test_demo_runs_and_every_method_matches_plain_decoding():
    console = Console(file=io.StringIO(), width=100)
    rows = run_demo(max_new_tokens=16, console=console)  # raises if any method's output differs from plain
    assert [r["method"] for r in rows][0] == "plain decoding" and len(rows) == 4
    assert all(r["tau"] >= 1.0 for r in rows)
    draft_chain = rows[1]
    assert draft_chain["tau"] > 2.0, draft_chain  # the shipped draft model is a real guesser
    assert "tau" in console.file.getvalue()


def test_cli_entry_point_reports_bad_paths_cleanly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specjax.cli", "demo", "--target", str(tmp_path / "none")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no embedded model" in result.stderr
