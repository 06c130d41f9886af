"""JAX's persistent compilation cache, turned on by importing specjax (specjax/compile_cache.py).

Every check runs in a fresh subprocess: the cache settings are read at import and at the
first compilation, so only a new process shows what a user gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax import compile_cache

REPO = Path(__file__).resolve().parents[1]
REPORT = """
import json, jax, specjax
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "status": specjax.compile_cache.status(),
                  "min_s": jax.config.jax_persistent_cache_min_compile_time_secs}))
"""
# A tiny random model generating a few tokens: its loop compiles for about a second, like specjax's real ones.
GENERATE = """
import json, jax, specjax
from specjax.config import ModelConfig
from specjax.models.model import init_params

hits = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: hits.append(event) if event == "/jax/compilation_cache/compile_time_saved_sec" else None)
cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=128)
target = specjax.Target(init_params(cfg, jax.random.key(0), scale=0.5), cfg, {})
out = specjax.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=6, eos_token_id=[])
print(json.dumps({"tokens": out.tokens, "compile_s": out.stats["compile_s"], "cache_hits": len(hits),
                  "status": specjax.compile_cache.status()}))
"""


def run_python(code: str, **env: str | None) -> dict:
    """Run `code` in a fresh interpreter with `env` applied (None removes a variable); its last stdout line as JSON."""
    full = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for key in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
        full.pop(key, None)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def test_env_path_sets_jax_cache_dir(tmp_path):
    got = run_python(REPORT, SPECJAX_COMPILE_CACHE=str(tmp_path / "cache"))
    assert got["dir"] == got["status"] == str(tmp_path / "cache")
    assert got["min_s"] == compile_cache.MIN_COMPILE_TIME_S  # low enough for loops compiling in ~1 s


@pytest.mark.parametrize("value", ["off", "0", "", "OFF"])
def test_env_off_leaves_it_unset(value, tmp_path):
    got = run_python(REPORT, SPECJAX_COMPILE_CACHE=value, XDG_CACHE_HOME=str(tmp_path))
    assert got["dir"] is None and got["status"] is None
    assert got["min_s"] == 1.0  # jax's default, untouched
    assert not (tmp_path / "specjax").exists()


def test_default_dir_is_the_user_cache(tmp_path):
    got = run_python(REPORT, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert got["dir"] == str(tmp_path / "xdg" / "specjax" / "jax")
    got = run_python(REPORT, HOME=str(tmp_path / "home"))
    assert got["dir"] == str(tmp_path / "home" / ".cache" / "specjax" / "jax")


def test_a_cache_dir_configured_in_jax_is_respected(tmp_path):
    mine = str(tmp_path / "mine")
    got = run_python(REPORT, JAX_COMPILATION_CACHE_DIR=mine, SPECJAX_COMPILE_CACHE=str(tmp_path / "specjax"))
    assert got["dir"] == got["status"] == mine
    assert got["min_s"] == 1.0  # the user's cache, the user's thresholds
    configured_in_code = f"import jax; jax.config.update('jax_compilation_cache_dir', {mine!r})\n" + REPORT
    got = run_python(configured_in_code, SPECJAX_COMPILE_CACHE=str(tmp_path / "specjax"))
    assert got["dir"] == mine


def test_second_process_compiles_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = run_python(GENERATE, SPECJAX_COMPILE_CACHE=str(cache))
    assert first["status"] == str(cache)
    written = cache_files(cache)
    assert written, "the first process wrote nothing to the cache"
    assert first["cache_hits"] == 0

    second = run_python(GENERATE, SPECJAX_COMPILE_CACHE=str(cache))
    assert cache_files(cache) == written  # nothing new: everything came from the cache
    assert second["cache_hits"] >= 1
    assert second["tokens"] == first["tokens"]


def test_status_in_this_process_reports_jax_setting():
    import jax

    assert compile_cache.status() == (jax.config.jax_compilation_cache_dir or None)


def test_cache_dir_from_env():
    home = Path.home()
    assert compile_cache.cache_dir_from_env({}) == home / ".cache" / "specjax" / "jax"
    assert compile_cache.cache_dir_from_env({"XDG_CACHE_HOME": "relative"}) == home / ".cache" / "specjax" / "jax"
    assert compile_cache.cache_dir_from_env({"XDG_CACHE_HOME": "/x"}) == Path("/x/specjax/jax")
    assert compile_cache.cache_dir_from_env({"SPECJAX_COMPILE_CACHE": "/c"}) == Path("/c")
    assert compile_cache.cache_dir_from_env({"SPECJAX_COMPILE_CACHE": " off "}) is None


def test_a_threshold_the_user_set_is_kept(tmp_path):
    got = run_python(REPORT, SPECJAX_COMPILE_CACHE=str(tmp_path / "cache"),
                     JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="5")
    assert got["dir"] == str(tmp_path / "cache") and got["min_s"] == 5.0


def test_cache_is_used_when_jax_compiled_before_specjax_was_imported(tmp_path):
    """JAX opens the directory lazily, so earlier compilations do not stop specjax's setting from applying."""
    early = "import jax, jax.numpy as jnp\njax.jit(lambda x: x * 3 + 1)(jnp.ones(5))\n" + GENERATE
    first = run_python(early, SPECJAX_COMPILE_CACHE=str(tmp_path / "cache"))
    assert first["status"] == str(tmp_path / "cache") and cache_files(tmp_path / "cache")
    assert run_python(early, SPECJAX_COMPILE_CACHE=str(tmp_path / "cache"))["cache_hits"] >= 1
