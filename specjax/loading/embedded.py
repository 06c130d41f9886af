"""Where the embedded tiny models live: `checkpoints/tiny/` at the repository root (an editable install)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny"
