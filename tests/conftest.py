"""Suite-wide hygiene: compile fast (no LLVM optimisation), free compiled executables after each test module.

One pytest process compiles thousands of XLA CPU executables; each keeps memory mappings for its
JIT-compiled code, and a process that accumulates them all can exhaust the kernel's mapping limit
(vm.max_map_count) and crash inside a later compile. Modules build their own targets and compile
their own loops, so dropping JAX's caches between modules costs nothing but the memory.
"""

from __future__ import annotations

import gc
import os

# Compile without LLVM's optimisation passes: the suite compiles thousands of small XLA CPU executables
# and, run cold, spends most of its time compiling them. Measured cold, side by side on this 2-core
# machine: tests/test_speculative.py 301 -> 214 s, tests/test_dynamic_tree.py 168 -> 128 s, numerics within
# every tolerance (XLA_FLAGS=--xla_backend_optimization_level=0 python -m pytest tests/<file> with an
# empty SPECJAX_COMPILE_CACHE). Set before jax is imported (xdist workers import this file first too);
# flags the caller set are kept, and an explicit optimisation level wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    yield
    jax.clear_caches()
    gc.collect()
