"""The memory plan (planning/memory.py) next to the compiler's figure for the same compiled loop.

The plan counts what is held: the target's weights, its KV cache for batch x context tokens, the draft's weights
and cache. The compiler's `memory_analysis()` counts the executable's buffers on one device: arguments (the
weights, a draft's weights, the request's small arrays), temp (everything the loop allocates inside the jit: the
KV caches, which never cross the jit boundary, plus each pass's activations, logits and the kernel's partials) and
outputs (the token buffers). So compiler - plan = the request arrays + outputs + the workspace of a pass, which the
plan leaves out ("Not counted" in planning/memory.py); `compare` splits the difference that way.
"""

from __future__ import annotations

import argparse
from typing import Any

from specjax.aot.compile import compile_graph, total_bytes
from specjax.aot.device import placement
from specjax.aot.graphs import OUT_LEN, PROMPT_LEN, Graph, loop_graph
from specjax.config import ModelConfig
from specjax.planning.memory import Draft, MemoryPlan, format_memory, kv_bytes_per_token, memory_plan
from specjax.planning.profile import DEVICES
from specjax.planning.tensor_parallel import TensorParallel

GIB = 2.0**30


def graph_draft(graph: Graph) -> Draft:
    """The plan's draft share for a loop graph: its draft model's weights and KV per token (none for a plain loop;
    other drafters are not priced here)."""
    d = graph.draft_model
    if d is None:
        return Draft("none (plain loop)", 0.0, 0.0)
    return Draft(f"draft model ({d.num_layers} layers of {d.hidden_size})", float(d.num_params() * 2),
                 kv_bytes_per_token(d, TensorParallel(1), d.num_layers))


def graph_plan(graph: Graph, device: str, tensor_parallel: int) -> MemoryPlan:
    """The memory plan of the configuration `graph` compiles: its target, batch, cache length and draft."""
    info = graph.info
    return memory_plan(graph.model, info["preset"], DEVICES[device], tensor_parallel, info["batch"],
                       info["cache_len"], graph_draft(graph))


def compare(record: dict[str, Any], plan: MemoryPlan) -> dict[str, Any]:
    """The plan's and the compiler's bytes side by side, and where they differ (module docstring)."""
    held = plan.weight_bytes + plan.draft.weight_bytes
    cache = plan.cache_bytes + plan.batch * plan.context * plan.draft.kv_bytes_per_token
    compiled = total_bytes(record)
    return {"plan_bytes": held + cache, "compiled_bytes": compiled, "ratio": compiled / (held + cache),
            "weights_plan": held, "arguments_compiled": record["argument_bytes"],
            "cache_plan": cache, "temp_compiled": record["temp_bytes"],
            "workspace": record["temp_bytes"] - cache, "request_and_outputs":
                record["argument_bytes"] - held + record["output_bytes"] - record["alias_bytes"]}


def format_comparison(rows: list[dict[str, Any]]) -> str:
    lines = ["| graph | device | plan GiB (weights + KV) | compiled GiB (args + temp + out - alias) "
             "| compiled / plan | weights: plan / args GiB | KV: plan GiB / temp GiB | workspace GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['device']} | {r['plan_bytes'] / GIB:.2f} | {r['compiled_bytes'] / GIB:.2f} "
                     f"| {r['ratio']:.3f} | {r['weights_plan'] / GIB:.2f} / {r['arguments_compiled'] / GIB:.2f} | "
                     f"{r['cache_plan'] / GIB:.2f} / {r['temp_compiled'] / GIB:.2f} | {r['workspace'] / GIB:.2f} |")
    return "\n".join(lines)


def compiled_plan(cfg: ModelConfig, name: str, device: str, tensor_parallel: int, batch: int,
                  context: int) -> tuple[MemoryPlan, dict[str, Any]]:
    """`plan --memory --compiled`: the plan for the plain loop at batch x context, and the compiler's figure for that
    loop compiled for `device` (deviceless without one) over `tensor_parallel` GPUs of one host; the plan's free
    memory then comes from the compiler's total (weights, cache and the workspace of a pass)."""
    cache_len = max(16, -(-context // 16) * 16)  # the kernel needs S a multiple of 16
    prompt, out = min(PROMPT_LEN, cache_len // 2), min(OUT_LEN, cache_len // 2)
    graph = loop_graph(name, "plain", batch, cache_len=cache_len, prompt_len=prompt, out_len=out,
                       tensor_parallel=tensor_parallel > 1, cfg=cfg)
    record, _ = compile_graph(graph, placement(device, f"1x1x{tensor_parallel}"))
    if "error" in record:
        raise ValueError(f"the plain loop of {name} did not compile for {device}: {record['error'][:500]}")
    plan = memory_plan(cfg, name, DEVICES[device], tensor_parallel, batch, cache_len,
                       Draft("none (plain loop)", 0.0, 0.0))
    return plan, {**record, **compare(record, plan), "free_bytes_compiled": plan.capacity - total_bytes(record)}


def compiled_memory_main(args: argparse.Namespace, cases: list[tuple[ModelConfig, str, str, int, int]]) -> int:
    """Print the plan table and, per case (cfg, name, device, TP, MTP layers), the compiler's figure and the free
    memory it leaves (`specjax plan --memory --compiled`)."""
    plans, rows = [], []
    for cfg, name, device, n, _ in cases:  # the plain loop: no draft, so no MTP layers either
        plan, row = compiled_plan(cfg, name, device, n, args.batch, args.context)
        plans.append(plan)
        rows.append(row)
    print(format_memory(plans))
    print()
    print(format_comparison(rows))
    for row in rows:
        print(f"{row['graph']} on {row['device']}: free by the compiler {row['free_bytes_compiled'] / GIB:.2f} GiB "
              f"(plan: {(DEVICES[row['device']].memory_bytes - row['plan_bytes']) / GIB:.2f} GiB)")
    if getattr(args, "json", None):
        from specjax.planning.advisor import write_report

        write_report({"memory": [p.as_dict() for p in plans], "compiled": rows}, args.json)
    return 0
