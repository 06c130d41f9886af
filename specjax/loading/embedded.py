"""Where the embedded tiny models live, wherever specjax is installed.

A checkout (an editable install) reads `checkpoints/tiny/` at the repository root; a built wheel carries the
same files as the package data `specjax/_checkpoints/tiny/` (pyproject.toml maps one onto the other).
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_NAMES = ("target", "draft", "eagle3", "mtp", "dflash", "dspark", "hybrid")


def _embedded_dir() -> Path:
    checkout = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parents[1] / "_checkpoints" / "tiny"


EMBEDDED_DIR = _embedded_dir()


def embedded(name: str = "target") -> Path:
    """The directory of a shipped tiny model, wherever specjax is installed.

    Args:
        name: "target" (the 3.95M-parameter code model), or a drafter trained for it: "draft" (a draft model),
            "eagle3", "mtp", "dflash", "dspark"; or "hybrid" (a Qwen3.5-style target carrying its own MTP layer).

    Returns:
        The model's directory: pass it to `specjax.load` / `specjax.load_drafter`.

    Raises:
        ValueError: an unknown name (the shipped ones are listed).
    """
    if name not in EMBEDDED_NAMES:
        raise ValueError(f"no embedded model {name!r}; the shipped ones are {', '.join(EMBEDDED_NAMES)}")
    path = EMBEDDED_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is missing: this install carries no embedded models (reinstall specjax from "
                                f"its repository, `pip install -e .`)")
    return path
