"""The front door and the manual stay true: the README's commands and Python blocks, the MkDocs site, the API
reference's coverage of `specjax.__all__`, and the generated pages (CLI reference, benchmarks) being up to date.

README convention: every ```python block runs, in order, in one namespace, against the embedded models; a block that
needs a GPU, a download or minutes carries `<!-- readme-test: skip (why) -->` on the line before its fence.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import specjax

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SKIP = "<!-- readme-test: skip"


def _load_script(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _api_paths() -> dict[str, str]:
    """Public name -> the path docs/api.md renders it from (`specjax.NAME`, or its module's path where a submodule of
    the same name would shadow it, as specjax.generate and specjax.convert)."""
    api = (ROOT / "docs" / "api.md").read_text()
    paths = {}
    for path in re.findall(r"^::: (specjax[\w.]*)$", api, re.M):
        module, name = path.rsplit(".", 1)
        if name in specjax.__all__ and getattr(importlib.import_module(module), name, None) is getattr(specjax, name):
            paths[name] = path
    return paths


def _python_blocks(text: str) -> list[tuple[str, bool]]:
    """(code, skipped) for every ```python block, in order."""
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), before.startswith(SKIP)))
    return out


def test_readme_is_short_and_has_no_dated_narrative():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the limit is 250: move detail into docs/"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "dates belong in docs/records/, not in the README"


def test_readme_test_command_is_what_ci_runs():
    """The README's second set-up command installs what .ci/run installs and runs the same pytest command."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme_cmd = next(line for line in README.splitlines() if "python -m pytest" in line and "pip install" in line)
    ci_pytest = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    assert readme_cmd.endswith(ci_pytest), (readme_cmd, ci_pytest)
    extras = re.search(r'pip install -e "\.\[([^\]]+)\]"', readme_cmd).group(1)
    assert f'-e ".[{extras}]"' in ci, f"README installs .[{extras}], .ci/run does not"
    assert "torch==" in readme_cmd and re.search(r"torch==[\d.]+", readme_cmd).group(0) in ci


def test_readme_python_blocks_run():
    blocks = _python_blocks(README)
    assert blocks and any(not skipped for _, skipped in blocks)
    namespace: dict = {"__name__": "readme"}
    for i, (code, skipped) in enumerate(blocks):
        if not skipped:
            exec(compile(code, f"README.md python block {i}", "exec"), namespace)


def test_every_public_name_has_a_docstring_and_a_reference_entry():
    paths = _api_paths()
    missing_ref = [n for n in specjax.__all__ if n not in paths]
    assert not missing_ref, f"docs/api.md lacks `::: specjax.NAME` (or its defining module's path) for {missing_ref}"
    # A dataclass without a docstring gets its signature as __doc__: that is not documentation.
    undocumented = [n for n in specjax.__all__ if n != "__version__"
                    and (not (doc := (inspect.getdoc(getattr(specjax, n)) or "").strip()) or doc.startswith(f"{n}("))]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_cli_reference_is_up_to_date():
    gen = _load_script(ROOT / "docs" / "gen_cli.py")
    assert gen.PAGE.read_text() == gen.render(), "docs/cli.md is out of date: run python docs/gen_cli.py"


def test_benchmarks_page_is_rendered_from_the_records():
    tables = _load_script(ROOT / "scripts" / "records_tables.py")
    assert tables.PAGE.read_text() == tables.render_page(), (
        "docs/benchmarks.md is out of date: run python scripts/records_tables.py")
    for path in tables.TABLES.glob("*.json"):
        rec = json.loads(path.read_text())
        for key in ("title", "command", "machine", "date", "commit", "source"):
            assert rec.get(key), f"{path.name} lacks {key!r}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
           "-d", str(tmp_path / "site")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"{shlex.join(cmd)} failed:\n{run.stdout}\n{run.stderr}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name, path in _api_paths().items():
        assert f'id="{path}"' in api, f"the built API reference does not render {path}"
