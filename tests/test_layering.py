"""The import graph flows one way (generate -> loops -> request), and the repository explains itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specjax"
# Front ends above the API may import generate; nothing below it may.
ABOVE_GENERATE = {"__init__.py", "cli.py", "demo.py", "bench_spec.py", "bench_ar.py", "bench_plan.py"}


def imported_modules(path: Path) -> set[str]:
    """Module names imported by a file, relative imports resolved against the specjax package."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(ROOT).with_suffix("").parts[:-1]  # the file's package, e.g. ("specjax", "drafters")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = list(parts[: len(parts) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_nothing_below_the_api_imports_generate():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if p.name not in ABOVE_GENERATE and p.parent.name != "train"
                 and "specjax.generate" in imported_modules(p)]
    assert offenders == []


def test_loops_share_request_preparation_from_below():
    for loop in ("speculative.py", "decode.py", "request.py"):
        assert "specjax.generate" not in imported_modules(PACKAGE / loop), loop
    assert "specjax.request" in imported_modules(PACKAGE / "speculative.py")
    assert "specjax.speculative" not in imported_modules(PACKAGE / "request.py")


def test_architecture_document_exists_and_is_linked():
    doc = ROOT / "docs" / "architecture.md"
    assert doc.is_file()
    text = doc.read_text()
    for topic in ("One speculative round", "Draft", "Verdict", "Drafter protocol", "KV cache layouts"):
        assert topic in text, topic
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
