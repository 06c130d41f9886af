"""JAX's persistent compilation cache, on by default: compile each loop once per machine, not per process.

specjax's jitted loops take 1-10 s to compile; with the cache a fresh process loads the
executable from disk instead. `setup()` runs when specjax is imported:

  * SPECJAX_COMPILE_CACHE=<path> puts the cache there; "0", "off", "false", "no" or ""
    turn it off; unset means `$XDG_CACHE_HOME/specjax/jax` (else `~/.cache/specjax/jax`).
  * A cache directory already configured in jax (`jax.config.jax_compilation_cache_dir`,
    e.g. from the JAX_COMPILATION_CACHE_DIR environment variable) is respected, and its
    thresholds are left as the user set them.
  * Otherwise the thresholds are lowered so every computation is written: JAX's default only
    keeps ones that took at least 1 s to compile, which misses small models' loops. A
    threshold the user changed from JAX's default (e.g. JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS)
    is kept.

JAX opens the directory when it next compiles, so the setting applies even when jax was
imported, and had compiled things, before specjax. The cache is trusted code: do not point
it at a directory that others can write to.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "SPECJAX_COMPILE_CACHE"
OFF_VALUES = ("", "0", "off", "false", "no")
# Cache every computation, however quickly it compiled. JAX's default (1 s) would skip the loops
# of small models on a fast machine, and any threshold near a computation's compile time makes
# caching depend on the machine's load. The small eager executables it adds (random init,
# casts) are kilobytes each and, on a busy CPU, take 0.1 s apiece to compile too.
MIN_COMPILE_TIME_S = 0.0
_JAX_DEFAULTS = {"jax_persistent_cache_min_compile_time_secs": 1.0, "jax_persistent_cache_min_entry_size_bytes": 0}
_OURS = {"jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_TIME_S,
         "jax_persistent_cache_min_entry_size_bytes": -1}  # -1: no size floor


def setup() -> str | None:
    """Turn the cache on as described in the module docstring; return the directory in use, or None."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return configured
    try:
        path = cache_dir_from_env(os.environ)
    except RuntimeError:  # no home directory to put the default under: run without the cache
        return None
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    for name, value in _OURS.items():
        if getattr(jax.config, name) == _JAX_DEFAULTS[name]:  # not set by the user
            jax.config.update(name, value)
    return str(path)


def cache_dir_from_env(environ) -> Path | None:
    """The directory SPECJAX_COMPILE_CACHE asks for (the default when unset), or None when it says off."""
    value = environ.get(ENV)
    if value is None:
        return default_dir(environ)
    if value.strip().lower() in OFF_VALUES:
        return None
    return Path(value).expanduser().absolute()


def default_dir(environ) -> Path:
    """`$XDG_CACHE_HOME/specjax/jax` when XDG_CACHE_HOME is an absolute path, else `~/.cache/specjax/jax`."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "specjax" / "jax"


def status() -> str | None:
    """The persistent cache directory jax will use in this process, or None when the cache is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None
