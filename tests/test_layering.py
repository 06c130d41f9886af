"""The package's import graph: acyclic (imports inside functions count) and pointing one way between folders."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specjax"
# Each concept's rank: a module may import its own concept and lower ranks only. One name a folder
# (or a top-level module); the layout in docs/design.md and docs/architecture.md describe each.
RANKS = {
    "config": 0, "compile_cache": 0, "kernels": 0,
    "multihost": 0,   # what crosses processes in a jax.distributed job (results, agreed decisions, moves)
    "quant": 0,       # quantized weights (QuantizedWeight) that models multiply and convert reads checkpoints into
    "models": 1,      # the Flax target and its KV cache
    "chat": 1,        # chat templates: a conversation -> prompt ids (below decoding's request.py, above Target)
    "decoding": 2,    # the plain and speculative loops, drafts, verification, sampling, trees, statistics
    "drafters": 3,    # one module a family, behind decoding's Drafter protocol
    "convert": 4,     # checkpoint formats in and out (Hugging Face, EAGLE-3, DFlash, DSpark, MTP, orbax)
    "loading": 5,     # targets and drafters from a path
    "planning": 6,    # load-aware shape choice: planner, profile, calibration, "auto", advisor
    "generate": 7,    # specjax.generate
    "bench": 8, "train": 8,
    "engine": 8,      # continuous batching: slots, the load policy, the engine's thread
    "aot": 8,         # deviceless compilation of the production graphs for H100/H200 (specjax compile)
    "serve": 9,       # the OpenAI-compatible HTTP server on the engine
    "demo": 10, "cli": 10, "__init__": 10,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> dict[str, Path]:
    files = list(PACKAGE.rglob("*.py"))
    return {module_name(p): p for p in files}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The specjax modules a file imports, anywhere in it (inside functions too), relative imports resolved."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from specjax.drafters import mtp` imports a module
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = package_files()
    return {m: imports_of(p, set(files)) for m, p in files.items()}


def concept(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_rank():
    assert sorted({concept(m) for m in graph()} - set(RANKS)) == []


def test_import_graph_is_acyclic():
    g = graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(g[m]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [m, dep]))
            if dep not in state:
                visit(dep, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])


def test_imports_point_down_the_layers():
    upward = [f"{m} -> {dep}" for m, deps in graph().items() for dep in sorted(deps)
              if concept(m) != concept(dep) and RANKS[concept(dep)] > RANKS[concept(m)]
              and not (m == "specjax" and dep.startswith("specjax."))]
    assert upward == []


def test_drafters_do_not_read_checkpoint_formats():
    """A drafter knows its network and the loop; reading its directory is loading's job."""
    offenders = [f"{m} -> {dep}" for m, deps in graph().items() if concept(m) == "drafters"
                 for dep in deps if concept(dep) in ("convert", "loading")]
    assert offenders == []


def test_architecture_document_exists_and_is_linked():
    doc = ROOT / "docs" / "architecture.md"
    assert doc.is_file()
    text = doc.read_text()
    for topic in ("One speculative round", "Draft", "Verdict", "Drafter protocol", "KV cache layouts"):
        assert topic in text, topic
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme
    layout = (ROOT / "docs" / "design.md").read_text()  # the package layout, one line a folder
    for folder in ("models", "decoding", "drafters", "convert", "loading", "planning", "bench", "train"):
        assert f"specjax/{folder}/" in layout and f"{folder}/" in text, folder
