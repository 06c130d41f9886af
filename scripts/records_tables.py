"""Render docs/benchmarks.md from the JSON records under docs/records/tables/.

Every benchmark table in the documentation comes from a record, never from hand-edited prose: a record holds the
table (or points at a raw record a script wrote, with the renderer that reads it), what was measured, the command
that reproduces it, the machine, the date and the commit. `tests/test_docs.py` checks that the committed page is
this script's output.

    python scripts/records_tables.py            # rewrite docs/benchmarks.md
    python scripts/records_tables.py --check    # exit 1 when docs/benchmarks.md is not up to date
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLES = ROOT / "docs" / "records" / "tables"
PAGE = ROOT / "docs" / "benchmarks.md"

# The page's sections, each a list of table records (docs/records/tables/<name>.json), in reading order.
SECTIONS = {
    "Plain decoding": ["ar_vs_transformers", "decode_vs_cache_len", "hybrid_vs_transformers", "compile_cache"],
    "Speculative decoding": ["families", "spec_embedded_pair", "replay_sweep", "scheduler"],
    "Requests": ["sampling_vs_greedy", "stream"],
    "Planning under load": ["load_curve", "plan_check", "moe_verify"],
    "The embedded models and the suite": ["demo_quality", "ci_suite"],
}

HEADER = """# Benchmarks

Every table on this page is rendered by `python scripts/records_tables.py` from a JSON record under
`docs/records/tables/` (some point at the raw record their script wrote); each names the command that reproduces it,
the machine, the date and the commit it was measured at. No GPU figures yet: `scripts/gpu_checks.sh` produces them
(see [GPU recipes](gpu.md)). Figures that live with their feature: [the engine](engine.md),
[serving](serving.md), [quantized checkpoints](quantization.md), [block-drafter trees](block_trees.md),
[GPU compiles](gpu_compile.md) and [the planner's earlier checks](planner_checks.md).

Unless a table says otherwise: medians of timed calls after a warm-up, compile excluded and reported separately;
greedy speculative output checked equal to plain decoding on every row.
"""


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _bench_stream(raw: dict) -> str:
    """scripts/bench_stream.py's record: one row per (loop, batch)."""
    rows = [[r["loop"], r["batch"], f"{r['generate_tokens_per_s']:.0f}", f"{r['stream_tokens_per_s']:.0f}",
             f"{r['ratio']:.2f}", r["stream_chunks"]] for r in raw["rows"]]
    return _markdown_table(["loop", "batch", "generate tok/s", "stream tok/s", "stream / generate",
                            "chunks handed out"], rows)


def _plan_check(raw: dict) -> str:
    """scripts/plan_check.py's record: its summary's table, as the script printed it."""
    return "\n".join(line for line in raw["summary"].splitlines() if line.startswith("|"))


RENDERERS = {"bench_stream": _bench_stream, "plan_check": _plan_check}


def render_record(name: str) -> str:
    """One record's section: title, what was measured, the table, notes, and where it came from."""
    rec = json.loads((TABLES / f"{name}.json").read_text())
    if "renderer" in rec:
        table = RENDERERS[rec["renderer"]](json.loads((ROOT / rec["record"]).read_text()))
    else:
        table = _markdown_table(rec["columns"], rec["rows"])
    parts = [f"### {rec['title']}", rec["what"], table]
    if rec.get("notes"):
        parts.append(rec["notes"])
    provenance = (f"Reproduce: `{rec['command']}`. Machine: {rec['machine']}. Date: {rec['date']}, commit "
                  f"{rec['commit']}. Source: {rec['source']}; record `docs/records/tables/{name}.json`.")
    if rec.get("raw"):
        provenance += f" Raw record: `{rec['raw']}`."
    parts.append(provenance)
    return "\n\n".join(parts)


def render_page() -> str:
    """The whole benchmarks page, every table from its record."""
    listed = [n for names in SECTIONS.values() for n in names]
    unlisted = sorted(p.stem for p in TABLES.glob("*.json") if p.stem not in listed)
    if unlisted:
        raise ValueError(f"records under {TABLES} not placed in SECTIONS: {unlisted}; add each to a section")
    body = [HEADER]
    for section, names in SECTIONS.items():
        body.append(f"## {section}")
        body += [render_record(n) for n in names]
    return "\n\n".join(body).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is not up to date")
    args = parser.parse_args(argv)
    page = render_page()
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python scripts/records_tables.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
