#!/usr/bin/env bash
# The GPU checks, as one short prepared command for a lent H100/H200.
#   scripts/gpu_checks.sh          the dense checks (kernel, 8B decode, 8B speculative, GPU-path tests)
#   scripts/gpu_checks.sh hybrid   the Qwen3.5-9B checks (random weights): decode bandwidth, verify cost
#                                  against nodes with the MTP layer's drafting, speculative decoding
# Every command runs under `timeout`; the dense part's timeouts add up to 565 s (9 min 25 s) and the
# hybrid part's to 565 s (9 min 25 s), under the device's 10-minute limit per command. Every step runs even when an earlier one fails; each
# step's exit status is recorded, a summary is printed (and written to summary.txt), and the
# script exits non-zero when any step failed (124 = timed out).
# Writes logs and JSON under ${OUT:-runs/gpu}. Assumes jax with CUDA, flax, optax, orbax, chex
# are installed; installs specjax itself without dependencies.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
names=()
codes=()

# step NAME COMMAND...: run COMMAND with its output in $out/NAME.log, show the log's tail, record its status.
step() {
    local name=$1 rc
    shift
    echo "=== $name: $*"
    "$@" >"$out/$name.log" 2>&1
    rc=$?
    tail -n 25 "$out/$name.log"
    echo "=== $name: exit $rc"
    names+=("$name")
    codes+=("$rc")
}

timeout 30 python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
step gpu timeout 15 nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
if [ "${1:-}" = "hybrid" ]; then
# H1. Qwen3.5-9B shapes, bf16, batch-1 decode: weight-read bandwidth (the DeltaNet state adds 96 MiB per row).
step bench_ar_qwen35 timeout 120 python scripts/bench.py ar --preset qwen35_9b --batch 1 \
    --out "$out/bench_ar_qwen35.json"
# H2. Verify round cost against nodes per row (1, 4, 16, 64) at B = 1, 8, cache 1024, and the MTP layer's drafting.
step profile_qwen35 timeout 180 python scripts/profile_preset.py --preset qwen35_9b --batches 1,8 \
    --nodes 1,4,16,64 --mtp --out "$out/profile_qwen35.json"
# H3. Speculative decoding on the hybrid: dense draft model, replay at 0.8, the MTP layer; chains of 3, B = 1, 8.
step bench_spec_qwen35 timeout 180 python scripts/bench.py spec --preset qwen35_9b --batches 1,8 \
    --num-draft-tokens 3 --replay-accept 0.8 --max-new-tokens 64 --repeats 2 --out "$out/bench_spec_qwen35.json"
step hybrid_gpu_tests timeout 40 python -m pytest -q tests/test_gpu_path.py -k hybrid
else
# 1. Kernel correctness on the GPU itself (compiled Triton, not interpret mode).
step kernel_tests timeout 100 python -m pytest -q tests/kernels
# 2. Kernel vs XLA reference (and jax's decode kernel for N=1): time, bandwidth, roofline fraction.
step bench_kernel timeout 130 python scripts/bench_kernel.py --repeats 3 --out "$out/bench_kernel.json"
# 3. 8B-shaped random bf16 model, batch-1 decode: weight-read bandwidth vs measured device bandwidth.
step bench_ar_8b timeout 80 python scripts/bench.py ar --preset 8b --batch 1 --out "$out/bench_ar_8b.json"
# 4. Speculative decoding, random 8B target + random 1B-shaped draft model, bf16, B = 1, 8, 64: plain vs draft
#    model chain of 4 (cost, agreement) vs replay chain of 4 at acceptance 0.8 (speedup). The JSON is rewritten
#    after every row, so a timeout still leaves the finished rows.
step bench_spec_8b timeout 180 python scripts/bench.py spec --preset 8b --batches 1,8,64 --num-draft-tokens 4 \
    --replay-accept 0.8 --max-new-tokens 64 --repeats 2 --out "$out/bench_spec_8b.json"
# 5. The accelerator production path's tests (stacked layers under scan, Pallas kernel), now on the GPU.
if [ -f tests/test_gpu_path.py ]; then
    step gpu_path_tests timeout 30 python -m pytest -q tests/test_gpu_path.py
else
    echo "=== gpu_path_tests: skipped (tests/test_gpu_path.py not present)"
fi
fi

failed=0
echo "=== summary" >"$out/summary.txt"
for i in "${!names[@]}"; do
    case ${codes[$i]} in
        0) status=ok ;;
        124) status="FAILED (timed out)"; failed=1 ;;
        *) status="FAILED (exit ${codes[$i]})"; failed=1 ;;
    esac
    printf '%-16s %s\n' "${names[$i]}" "$status" >>"$out/summary.txt"
done
cat "$out/summary.txt"
exit "$failed"
