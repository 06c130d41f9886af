"""Suite-wide hygiene: compile fast (no LLVM optimisation), free compiled executables after each test module, long files
first.

One pytest process compiles thousands of XLA CPU executables; each keeps memory mappings for its
JIT-compiled code as long as JAX's process-wide caches hold it (closing an engine does not release them), and a
process that accumulates them all can exhaust the kernel's mapping limit (vm.max_map_count) and crash inside a later
compile. Modules build their own targets and compile their own loops, so dropping JAX's caches between modules costs
nothing but the memory; within a module they are dropped once the mappings run high.
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
# Also without XLA:CPU's newer fusion emitters: the embedded pair's draft-model and EAGLE-3 speculative loops and
# the plain loop compiled in 7.28 s instead of 8.37 s (medians of 3 interleaved fresh processes, compile cache
# off; the emitters generate the same arithmetic through another path).
for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

# Run dense targets in the stacked layout (their layers under one lax.scan, the accelerator graph) rather than CPU's
# per-layer default: a layer compiles once instead of once per layer. Cold, one process, this machine:
# tests/test_speculative.py 91 -> 70 s, tests/test_eagle3_tree.py 84 -> 61 s (SPECJAX_CPU_LAYOUT=<layout>
# SPECJAX_COMPILE_CACHE=<new dir> python -m pytest tests/<file>). The per-layer CPU path keeps its own tests (listed
# in docs/architecture.md, "Models as Flax modules"); hybrids and MoE targets with dense layers are per-layer always.
# Export SPECJAX_CPU_LAYOUT=per_layer to run the whole suite per-layer.
os.environ.setdefault("SPECJAX_CPU_LAYOUT", "stacked")

import jax  # noqa: E402
import pytest


def free_compiled_executables() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables_after_each_module():
    yield
    free_compiled_executables()


# Within a module too, once the mappings pass this share of the limit: tests/test_engine.py alone compiles enough (its
# engines' executables, each test a new configuration) to reach 65,530 mappings and crash in a compile (a segfault or
# an abort inside XLA, in cold runs only: cache hits map less), and one test adds at most ~16,000
# (test_no_compiles_after_warmup).
MAP_BUDGET = 0.4
try:
    with open("/proc/sys/vm/max_map_count") as f:
        MAP_LIMIT: int | None = int(f.read())
except OSError:  # not Linux: no such limit to watch
    MAP_LIMIT = None


@pytest.fixture(autouse=True)
def _free_compiled_executables_when_mappings_run_high():
    yield
    if MAP_LIMIT is None:
        return
    with open("/proc/self/maps") as f:
        mappings = sum(1 for _ in f)
    if mappings > MAP_BUDGET * MAP_LIMIT:
        free_compiled_executables()


# The longest test files, longest first (cold, on 2 cores: test_moe_speculative.py ~4.5 min, the others 1.5-3.5
# min). With `--dist loadfile` a file runs whole on one worker in collection order, so a long file collected last
# (pytest collects alphabetically) leaves the other worker idle at the end; starting the long ones first balances the
# run.
LONGEST_FIRST = ("test_engine.py", "test_moe_speculative.py", "test_planner.py", "test_hybrid_speculative.py", "test_multihost.py",
                 "test_moe.py", "test_stop_stream.py", "test_speculative.py", "test_eagle3_tree.py", "test_demo.py",
                 "test_scheduler.py", "test_sharding.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file is kept
