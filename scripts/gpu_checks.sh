#!/usr/bin/env bash
# The GPU checks, as one short prepared command for a lent H100/H200.
#   scripts/gpu_checks.sh          the dense checks (kernel, 8B decode, 8B speculative, GPU-path tests)
#   scripts/gpu_checks.sh hybrid   the Qwen3.5-9B checks (random weights): decode bandwidth, verify cost
#                                  against nodes with the MTP layer's drafting, speculative decoding
#   scripts/gpu_checks.sh moe      the Qwen3-30B-A3B checks (random weights): decode bandwidth of the active
#                                  experts, verify cost against nodes, both expert paths on one layer
#   scripts/gpu_checks.sh serve    the live curve behind `specjax serve`: a random 8B target (bf16) and its random
#                                  1B-shaped draft model, speculation off and "auto", `specjax bench serve`'s load at
#                                  concurrency 1..64 (needs the serve extra: fastapi, uvicorn, prometheus-client, httpx)
#   scripts/gpu_checks.sh quant    quantized weights: bf16 / FP8 / INT4 matmuls, the fused block-FP8 kernel vs XLA's
#                                  dequantize-then-dot, whether XLA fuses the dequantization into the GEMM, a random
#                                  8B target's decode in bf16 vs FP8 vs INT4, speculation on the FP8 target, the
#                                  kernel's and the quantized-format tests
#   scripts/gpu_checks.sh blocktrees  one-pass block trees (DFlash/DSpark, JetSpec's construction): the compiled
#                                  kernel on a 256-node tree, the parity tests, the tiny heads' trees vs chains
#   scripts/gpu_checks.sh compile [PART]  no GPU needed: compile PART's graphs (dense by default) deviceless for
#                                  $SPECJAX_GPU_KIND (h100 | h200; default h100) here, before asking for a lent
#                                  machine (specjax compile, docs/gpu_compile.md); exits non-zero on a compile error
#   scripts/gpu_checks.sh tp       tensor parallelism: jax's all-reduce of [tokens, hidden] bf16 over 2, 4, 8 GPUs
#                                  against the planner's ring model; a random 8B target on one GPU and split over
#                                  all of them (plain and a replay chain, tokens compared, times side by side, the
#                                  kernel under shard_map). Skipped, saying so, on one GPU
#   scripts/gpu_checks.sh engine   the engine (continuous batching, speculation following the live load) on a random
#                                  8B target: replay at 0.6 / 0.9 and a random draft model, concurrency 1..64
# Every command runs under `timeout`; on a GPU every part first compiles the kernel's block-plan sweep deviceless for
# the lent card's kind (30 s; when a graph fails to compile the script stops there, before any GPU step); with it and
# the install (30 s) the dense part's timeouts add up to 595 s (9 min 55 s), the hybrid part's to 595 s (9 min 55 s),
# the moe part's to 585 s (9 min 45 s), the serve part's to 575 s (9 min 35 s), the quant part's to 595 s (9 min 55 s),
# the blocktrees part's to 575 s (9 min 35 s), the tp part's to 555 s (9 min 15 s) and the engine part's to 575 s
# (9 min 35 s), under the device's 10-minute limit per command. Every step runs even when an earlier one fails; each
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
if [ "${1:-}" = "compile" ]; then
    # Deviceless, on this machine: the graphs the named part runs, compiled for the card it will run on.
    kind=${SPECJAX_GPU_KIND:-h100}
    case ${2:-dense} in
        hybrid) graphs=(--preset qwen35_9b --batch 1 8 --drafts plain,chain --kernels ci) ;;
        moe) graphs=(--preset qwen3_30b_a3b --batch 1 8 --drafts plain,chain --kernels ci) ;;
        tp) graphs=(--topology 1x1x8 --preset 8b --batch 1 16 --drafts plain,chain --kernels none) ;;
        *) graphs=(--preset 8b --batch 1 8 64 --drafts plain,chain --kernels ci) ;;
    esac
    step compile env JAX_PLATFORMS=cpu python -m specjax.cli compile --device "$kind" "${graphs[@]}" \
        --out "$out/compile.json"
    exit "${codes[0]}"
fi
step gpu timeout 15 nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
# 0. The kernel's block-plan sweep compiled deviceless for this card's kind (CPU only, no GPU time): a compile error
#    stops the script here, before the GPU steps spend the session's minutes on it.
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | grep -io 'h100\|h200' | tr 'A-Z' 'a-z')
step compile timeout 30 env JAX_PLATFORMS=cpu python -m specjax.cli compile --device "${kind:-h100}" --preset \
    --kernels ci --out "$out/compile.json"
if [ "${codes[-1]}" = 1 ]; then  # a graph failed to compile (a timeout, 124, lets the GPU steps run)
    echo "=== the deviceless compile failed: no GPU step runs (see $out/compile.log)"
    exit 1
fi
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
elif [ "${1:-}" = "moe" ]; then
# M1. Qwen3-30B-A3B shapes, bf16 (61 GB of weights), decode at B = 1, 8: the bandwidth of what a step reads (shared
#     weights and the experts its tokens route to; weight_read_GBps counts those bytes, not all 30.5B).
step bench_ar_moe timeout 160 python scripts/bench.py ar --preset qwen3_30b_a3b --batch 1 8 \
    --out "$out/bench_ar_moe.json"
# M2. Verify round cost against nodes per row (1, 4, 16, 64) at B = 1, 8, cache 1024: the expert-read curve.
step profile_moe timeout 190 python scripts/profile_preset.py --preset qwen3_30b_a3b --batches 1,8 \
    --nodes 1,4,16,64 --out "$out/profile_moe.json"
# M3. The expert paths (gather, sorted blocks, ragged_dot) on one layer's shape, 1 to 4096 tokens per pass.
step bench_moe_paths timeout 120 python scripts/bench_moe.py --paths-only --preset qwen3_30b_a3b --dtype bfloat16 \
    --tokens 1,2,8,32,128,512,4096 --out "$out/bench_moe_paths.json"
step moe_gpu_tests timeout 40 python -m pytest -q tests/test_gpu_path.py -k moe
elif [ "${1:-}" = "serve" ]; then
# S1. Throughput and TPOT against concurrency 1, 4, 16, 64 with speculation off and "auto" (random weights accept
#     little, so auto should settle on off or a short chain; the curve shows what serving and the engine cost under
#     load), each server warmed up first. The JSON is rewritten after every setting.
if python -c "import fastapi, uvicorn, httpx, prometheus_client" 2>/dev/null; then
    step serve_curve_8b timeout 500 python scripts/serve_curve.py --preset 8b --settings off,auto \
        --concurrency 1,4,16,64 --max-slots 64 --max-len 512 --input-len 128 --output-len 64 --prompts-per-slot 2 \
        --out "$out/serve_curve_8b.json" --plot "$out/serve_curve_8b.png"
else
    echo "=== serve_curve_8b: skipped (the serve extra is not installed here: pip install -e '.[serve]')"
    echo "serve_curve_8b: skipped, no serve extra" >"$out/serve_curve_8b.log"
fi
elif [ "${1:-}" = "quant" ]; then
# Q1. Quantized matmuls (docs/quantization.md): [M, 4096] x [4096, 14336], M = 1..8 (decode) and 64, 512 (where a
#     GEMM turns compute-bound: is the untuned kernel still ahead?), in bf16 / block FP8 / INT4 (group 128)
#     as `x @ w` runs them (block FP8 through the fused Pallas kernel on a GPU, INT4 dequantized inside the jitted
#     matmul); the fused block-FP8 kernel against XLA's dequantize-then-dot and bf16 over 8 distinct weights under
#     lax.scan (--fp8-kernel 8: us per matmul, the kernel's GB/s, its output against XLA's); whether XLA fuses the
#     dequantization into the GEMM and what x @ w compiles to (compiled HLO, kept beside the JSON).
step bench_quant_matmul_8b timeout 90 python scripts/bench_quant.py --matmul 4096,14336 --rows 1,2,4,8,64,512 \
    --formats fp8 int4 --repeats 5 --fp8-kernel 8 --hlo --no-decode --out "$out/bench_quant_matmul_8b.json"
# Q2. A random 8B target's batch-1 decode in bf16, FP8 (the kernel) and INT4 (ms per token, bytes held); replay
#     chains of 3 at acceptance 0.8 on the bf16 and the FP8 target (output equal to plain decoding).
step bench_quant_8b timeout 280 python scripts/bench_quant.py --preset 8b --matmul '' --formats fp8 int4 \
    --tokens 64 --repeats 3 --spec 3 --out "$out/bench_quant_8b.json"
# Q3. The compiled block-FP8 kernel against the exact product, and the quantized-format parity tests on the GPU
#     (block FP8 end to end through the kernel, compressed-tensors, AWQ).
step quant_tests timeout 150 python -m pytest -q tests/test_fp8_matmul.py tests/test_quantized.py \
    tests/test_quantized_formats.py
elif [ "${1:-}" = "blocktrees" ]; then
# B1. One-pass block trees on the GPU: the 256-node tree's mask through the compiled Pallas kernel against XLA,
#     JetSpec's fixtures (head forward, tree, accepted path), and the trees' greedy equality with plain decoding.
step block_tree_tests timeout 150 python -m pytest -q tests/test_block_tree.py tests/test_jetspec.py \
    tests/test_dflash.py -k "block_tree or jetspec or one_pass or heap or template or load"
# B2. The embedded DFlash / DSpark heads: chains vs trees of 15, 63, 255 drafts at B = 1, 8, 32 (tau, tokens/s,
#     outputs equal to plain decoding) and the planner's pick per batch on this GPU's roofline.
step bench_block_trees timeout 350 python scripts/bench_block_trees.py --batches 1,8,32 \
    --out "$out/block_trees.json"
elif [ "${1:-}" = "tp" ]; then
# T1. What `specjax plan --tensor-parallel` charges per all-reduce, measured: a psum of [tokens, 8192] bf16
#     (Llama-3.3-70B's hidden) for 1 to 1024 tokens over 2, 4, ... of the GPUs, next to the ring model (NCCL's
#     latency + 2 (n-1)/n x bytes / 450 GB/s); where they disagree, its figures replace profile.py's nccl-tests ones.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$gpus" -gt 1 ]; then
    step bench_allreduce timeout 180 python scripts/bench_allreduce.py --hidden 8192 --tokens 1,16,64,256,1024 \
        --out "$out/bench_allreduce.json"
    # T2. The 8B target split over every GPU against one GPU, batch 1 and 16: decode times and equal rows (attention
    #     by the Pallas kernel under shard_map, compiled Triton on each GPU).
    step bench_tp timeout 300 python scripts/bench_tp.py --preset 8b --batches 1,16 --repeats 2 \
        --out "$out/bench_tp.json"
else
    echo "=== bench_allreduce: skipped ($gpus GPU here: an all-reduce needs more than one; the planner keeps the"
    echo "    nccl-tests figures in specjax/planning/profile.py)"
    echo "bench_allreduce: skipped, $gpus GPU" >"$out/bench_allreduce.log"
    echo "=== bench_tp: skipped ($gpus GPU here: tensor parallelism needs more than one)"
fi
elif [ "${1:-}" = "engine" ]; then
# E1. specjax.Engine, random 8B target in bf16, 64 slots: per drafter (replay 0.6, replay 0.9, the random 1B-shaped
#     draft model) "auto" against "off" and chains of 1, 2, 4 at concurrency 1, 4, 16, 64, then a ramp 1 -> 64 -> 1
#     with the shape chosen against time (JSON and plot).
step engine_load timeout 500 python scripts/bench_engine_load.py --preset 8b --slots 64 --concurrency 1,4,16,64 \
    --requests 64 --tokens 64 --repeats 1 --step-s 3 --out "$out/engine_load.json" --plot "$out/engine_load.png"
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
