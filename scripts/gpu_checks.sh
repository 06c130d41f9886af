#!/usr/bin/env bash
# The GPU checks, as one short prepared command for a lent H100/H200 (about 8 minutes).
# Writes logs and JSON under ${OUT:-runs/gpu}. Assumes jax with CUDA, flax, optax, orbax, chex
# are installed; installs specjax itself without dependencies.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
# 1. Kernel correctness on the GPU itself (compiled Triton, not interpret mode).
timeout 240 python -m pytest -q tests/kernels 2>&1 | tail -n 15 | tee "$out/kernel_tests.log"
# 2. Kernel vs XLA reference (and jax's decode kernel for N=1): time, bandwidth, roofline fraction.
timeout 300 python scripts/bench_kernel.py --out "$out/bench_kernel.json" 2>&1 | tee "$out/bench_kernel.log"
# 3. 8B-shaped random bf16 model, batch-1 decode: weight-read bandwidth vs measured device bandwidth.
timeout 240 python scripts/bench.py ar --preset 8b --batch 1 --out "$out/bench_ar_8b.json" 2>&1 | tee "$out/bench_ar_8b.log"
