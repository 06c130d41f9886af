"""A training script's log and stage timer, kept in its run directory so a resumed run adds up.

`log` prints a line and appends it to `<run_dir>/<name>.log`; `timed(stage, fn, *args)` runs a stage
and adds its wall time to `<run_dir>/wall_s.json`, which survives interruptions and resumes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable


class RunLog:
    def __init__(self, run_dir: Path, name: str):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / f"{name}.log", "a")
        self._wall_path = run_dir / "wall_s.json"
        self.wall_s: dict[str, float] = json.loads(self._wall_path.read_text()) if self._wall_path.is_file() else {}

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self._file.write(msg + "\n")
        self._file.flush()

    def timed(self, stage: str, fn: Callable[..., Any], *args) -> Any:
        start = time.perf_counter()
        result = fn(*args)
        self.wall_s[stage] = self.wall_s.get(stage, 0.0) + time.perf_counter() - start
        self._wall_path.write_text(json.dumps(self.wall_s))
        return result
