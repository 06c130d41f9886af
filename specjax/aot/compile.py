"""`specjax compile`: compile the production graphs for an H100 or H200 (deviceless without one) and report each.

A record per graph: compile seconds (XLA + Triton + ptxas, after lowering), the compiler's memory analysis
(argument, temp, output and alias bytes of the executable), the Pallas kernels and XLA's own Triton fusions in the
optimized HLO, and the collectives in it on a mesh. A graph that fails to compile is a record with its error, and
the command exits 1, so a lent GPU session never spends its minutes on a compile error (scripts/gpu_checks.sh).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax

from specjax.aot.device import DEVICE_TARGETS, TOPOLOGIES, Placement, parse_topology, placement
from specjax.aot.graphs import DRAFTS, LOOP_PRESETS, Graph, fp8_matmul_sweep, kernel_sweep, loop_graphs
from specjax.kernels import targeting_gpu
from specjax.models.sharding import use_mesh

PALLAS_CALL = "__gpu$xla.gpu.triton"
COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
TRITON_FUSION = re.compile(r'"kind":"(__triton[a-z_]*)"')
KERNEL_NAME = re.compile(r', name = "([^"]+)"')
# Deviceless only: XLA rewrites a large sort (lax.top_k of more than 16 over a 128k vocabulary, the sampling path's
# candidates) into CUB's radix sort, and sizes CUB's scratch by asking the device at compile time: without one that
# fails ("cudaErrorInvalidDevice: invalid device ordinal", jaxlib 0.10.2; its xla_gpu_deviceless_cub_mode settings do
# not avoid it). XLA's own sort compiles instead; on a GPU host the same graph gets CUB's.
DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


# a fused computation's header reading FP8 / int4 / int8 values and returning a float matrix (at least 2 dims)
QUANT_CONVERT = re.compile(r"%[\w.\-]+ \([^)]*(?:f8e4m3fn|s4|u4|s8)\[[^)]*\) -> (?:bf16|f16|f32)\[\d+,\d+[\d,]*\]")


def scan_hlo(text: str) -> dict[str, Any]:
    """What the optimized HLO holds: Pallas kernels by name, XLA's Triton fusions by kind, collectives by op (each
    counted once per instruction; one inside the decode while loop runs every round)."""
    kernels: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if PALLAS_CALL in line:
            name = KERNEL_NAME.search(line)
            kernels[name.group(1) if name else "pallas_call"] += 1
    return {"pallas_kernels": dict(kernels), "triton_fusions": dict(collections.Counter(TRITON_FUSION.findall(text))),
            "collectives": dict(collections.Counter(COLLECTIVE.findall(text))),
            "dequantized_weights": dequantized_weights(text)}


def dequantized_weights(text: str) -> int:
    """Fused computations that read FP8 / int values and write a whole weight matrix in a float type with no dot
    inside: a dequantized weight written to memory before its GEMM reads it (the convert not fused into the GEMM)."""
    count = 0
    for block in text.split("\n\n"):
        header = QUANT_CONVERT.match(block.lstrip())
        if header and "dot(" not in block:
            count += 1
    return count


@contextlib.contextmanager
def not_written_to_the_cache():
    """Compile without writing JAX's persistent cache (an entry is written only past this compile time): a deviceless
    executable cannot be loaded back without a GPU ("PjRtCompiler must be constructed with a Client"), so an entry
    would only make the next compile of the same graph here warn and compile again."""
    name = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, old)


def compile_graph(graph: Graph, where: Placement) -> tuple[dict[str, Any], Any]:
    """Lower and compile one graph on `where`'s mesh: (its record, the compiled executable or None on an error)."""
    record: dict[str, Any] = {"graph": graph.name, "device": where.device, "topology": where.topology,
                              "on_gpu": where.on_gpu, "device_kind": where.device_kind, **graph.info}
    compiled = None
    try:
        start = time.perf_counter()
        with targeting_gpu(), use_mesh(where.mesh if where.mesh.size > 1 else None):
            lowered = graph.fn.trace(*graph.place(where.mesh), **graph.static).lower()
        record["lower_s"] = round(time.perf_counter() - start, 2)
        options = {} if where.on_gpu else DEVICELESS_OPTIONS
        record["compiler_options"] = options
        start, cpu = time.perf_counter(), cpu_seconds()
        with contextlib.nullcontext() if where.on_gpu else not_written_to_the_cache():
            compiled = lowered.compile(compiler_options=options or None)
        record["compile_s"] = round(time.perf_counter() - start, 2)
        record["compile_cpu_s"] = round(cpu_seconds() - cpu, 2)
    except Exception as err:  # noqa: BLE001 - any compile failure is this graph's result, reported and counted
        record["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:2000]}"
        return record, None
    mem = compiled.memory_analysis()
    record.update(argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
                  output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
                  generated_code_bytes=mem.generated_code_size_in_bytes, **scan_hlo(compiled.as_text()))
    return record, compiled


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its finished children (ptxas runs as one per kernel): on a
    shared machine the wall time also holds the waits for a core."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_all(graphs: list[Graph], where: Placement, log: Callable[[str], None] = print,
                after: Callable[[list], None] | None = None) -> list[dict[str, Any]]:
    """Compile every graph in turn; `after(records so far)` runs after each (the command rewrites its JSON, so a run
    stopped early keeps what it finished)."""
    records = []
    for graph in graphs:
        record, _ = compile_graph(graph, where)
        records.append(record)
        log(one_line(record))
        if after:
            after(records)
    return records


def total_bytes(record: dict[str, Any]) -> int:
    """The executable's device memory: arguments + temp + outputs, less the outputs that alias arguments."""
    return record["argument_bytes"] + record["temp_bytes"] + record["output_bytes"] - record["alias_bytes"]


def one_line(record: dict[str, Any]) -> str:
    if "error" in record:
        return f"{record['graph']}: FAILED {record['error'][:300]}"
    gib = 2.0**30
    return (f"{record['graph']}: {record['compile_s']:.1f} s, args {record['argument_bytes'] / gib:.2f} GiB, "
            f"temp {record['temp_bytes'] / gib:.2f} GiB, kernels {record['pallas_kernels']}, "
            f"collectives {record['collectives']}")


def format_table(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table (GiB, powers of 2)."""
    gib = 2.0**30
    lines = ["| graph | device | topology | compile s (CPU s) | arguments GiB | temp GiB | output GiB | alias GiB | "
             "Pallas kernels | Triton fusions | collectives |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['graph']} | {r['device']} | {r['topology']} | FAILED: {r['error'][:200]} |"
                         + " |" * 7)
            continue
        counts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"  # noqa: E731
        cpu = f" ({r['compile_cpu_s']:.1f})" if "compile_cpu_s" in r else ""
        lines.append(f"| {r['graph']} | {r['device']} | {r['topology']} | {r['compile_s']:.1f}{cpu} | "
                     f"{r['argument_bytes'] / gib:.2f} | {r['temp_bytes'] / gib:.2f} | {r['output_bytes'] / gib:.3f} | "
                     f"{r['alias_bytes'] / gib:.2f} | {counts(r['pallas_kernels'])} | "
                     f"{sum(r['triton_fusions'].values())} | {counts(r['collectives'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command

KERNEL_SETS = ("full", "ci", "none")


def select_graphs(args: argparse.Namespace) -> list[Graph]:
    """The graphs one `specjax compile` run compiles (add_arguments says which)."""
    hosts, per_host = parse_topology(args.topology)
    graphs: list[Graph] = []
    if args.kernels != "none":
        graphs += (kernel_sweep() if args.kernels == "full" else ci_kernel_sweep()) + fp8_matmul_sweep()
    drafts = tuple(args.drafts.split(",")) if args.drafts else DRAFTS
    for preset in args.preset:
        graphs += loop_graphs(preset, tuple(args.batch), drafts, tensor_parallel=hosts * per_host > 1,
                              quantized=getattr(args, "quantized", None))
    return graphs


def ci_kernel_sweep() -> list[Graph]:
    """A reduced sweep (what tests/test_gpu_compile.py compiles): every head_dim in bf16 at block_m 16 and 64, one M
    block and 32, one split and 33; and fp32 (IEEE dots: slow to compile, see docs/gpu_compile.md) at head_dim 64."""
    return (kernel_sweep(dtypes=("bfloat16",), ng=((1, 1), (16, 4), (256, 8)))
            + kernel_sweep(head_dims=(64,), dtypes=("float32",), ng=((16, 4),), sb=((2048, 64),)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=sorted(DEVICE_TARGETS), required=True,
                   help="the card to compile for (deviceless unless one is attached)")
    p.add_argument("--topology", default="1x1x1",
                   help=f"HOSTSx1xGPUS_PER_HOST, e.g. {', '.join(TOPOLOGIES)}: above one GPU the loops run tensor "
                        "parallel over all of them (the kernel under shard_map)")
    p.add_argument("--preset", nargs="*", default=["8b"], choices=sorted(LOOP_PRESETS),
                   help="targets whose loops compile (none: the kernel only)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--drafts", default=None, help=f"comma-separated subset of {','.join(DRAFTS)} (default: all)")
    p.add_argument("--quantized", choices=["fp8"], default=None,
                   help="the target's linears as a block-FP8 checkpoint loads them (values FP8, one scale per 128 x "
                        "128 block); records count the dequantized weights written before their GEMM")
    p.add_argument("--kernels", choices=KERNEL_SETS, default="full",
                   help="the tree-attention kernel's block-plan sweep: full (60 configurations), ci (a reduced 12), "
                        "none; full and ci add the block-FP8 matmul at 4 decode shapes")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list instead of the table")
    p.add_argument("--out", default=None, help="also write the records (with the command and machine) as JSON here")


def main(args: argparse.Namespace) -> int:
    if min(args.batch) < 1:
        raise ValueError(f"--batch sizes must be positive, got {args.batch}")
    # Compile cold, without the persistent cache specjax turns on at import (JAX decides once per process, at its
    # first compile, which this is): the times are the compiler's, on a GPU host too.
    jax.config.update("jax_enable_compilation_cache", False)
    where = placement(args.device, args.topology)
    graphs = select_graphs(args)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    log(f"compiling {len(graphs)} graphs {where.where} (jax {jax.__version__})")

    def write(records):
        report = {"command": " ".join(["specjax", *sys.argv[1:]]), "jax": jax.__version__, "where": where.where,
                  "machine": (where.device_kind if where.on_gpu
                              else f"{os.cpu_count()}-core {platform.machine()}, no GPU"),
                  "records": records}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    records = compile_all(graphs, where, log, write if args.out else None)
    print(json.dumps(records, indent=1) if args.json else format_table(records))
    failed = [r["graph"] for r in records if "error" in r]
    if failed:
        print(f"{len(failed)} of {len(records)} graphs failed to compile: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
