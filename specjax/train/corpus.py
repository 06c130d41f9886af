"""The training corpus every machine has: the Python standard library's own source.

Files are split into train / validation / test by a hash of their path relative to the
stdlib root, so a file lands in the same split on every machine and every Python version
that has it; only the set of files differs between versions (record `python_version()`).
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

# Path components that exclude a file: tests, vendored or generated code, IDE and porting tools.
EXCLUDED_PARTS = frozenset({
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
    "encodings",  # generated charmap tables
    "pydoc_data",  # one 750 kB string literal of documentation
})
EXCLUDED_PREFIXES = ("config-",)  # config-3.x-<platform>/: build-machine specific
SPLITS = ("train", "validation", "test")
SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}
SPLIT_RULE = ("bucket = int(sha256(relative posix path).hexdigest()[:8], 16) % 100; "
              "train if bucket < 90, validation if bucket < 95, else test")


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return platform.python_version()


def is_included(rel: str) -> bool:
    """Whether a stdlib-relative posix path belongs to the corpus."""
    parts = rel.split("/")
    return (rel.endswith(".py") and not EXCLUDED_PARTS.intersection(parts)
            and not parts[0].startswith(EXCLUDED_PREFIXES))


def split_of(rel: str) -> str:
    """'train', 'validation' or 'test' for a stdlib-relative posix path (see SPLIT_RULE)."""
    bucket = int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    return "validation" if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["validation"] else "test"


def list_files(root: Path | None = None) -> list[str]:
    """Sorted stdlib-relative posix paths of every corpus file under root."""
    root = Path(root or stdlib_root())
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory: pass the Python standard library's source directory")
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    return sorted(r for r in rels if is_included(r))


def read_text(root: Path, rel: str) -> str | None:
    """A file's UTF-8 text, or None when it is not valid UTF-8 (a handful of legacy files)."""
    try:
        return (Path(root) / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def load_split(split: str, root: Path | None = None) -> dict[str, str]:
    """{relative path: text} of one split, in sorted path order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root or stdlib_root())
    texts = {rel: read_text(root, rel) for rel in list_files(root) if split_of(rel) == split}
    return {rel: text for rel, text in texts.items() if text}
