"""Suite-wide hygiene: free compiled executables after each test module.

One pytest process compiles thousands of XLA CPU executables; each keeps memory mappings for its
JIT-compiled code, and a process that accumulates them all can exhaust the kernel's mapping limit
(vm.max_map_count) and crash inside a later compile. Modules build their own targets and compile
their own loops, so dropping JAX's caches between modules costs nothing but the memory.
"""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    yield
    jax.clear_caches()
    gc.collect()
