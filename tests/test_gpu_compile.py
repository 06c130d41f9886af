"""The production graphs compiled for an H100 on this CPU machine (deviceless AOT, specjax/aot), failing on any
compile error: the tree-attention kernel over a reduced block-plan sweep and the Llama-3-8B-shaped loops (plain,
a chain, a dynamic tree, sampled with penalties and log-probs, DFlash, DSpark under the prefix scheduler; the static
tree, the chain's code with another mask, only in `specjax compile`). Runs where jaxlib's CUDA plugin is installed (`pip install -e '.[test,cuda12]'`, as .ci/run does);
`specjax compile --device h100` compiles the full set (docs/gpu_compile.md).
"""

from __future__ import annotations

import argparse

import pytest

from specjax.aot.compile import ci_kernel_sweep, compile_graph, format_table, main, scan_hlo, total_bytes
from specjax.aot.device import cuda_plugin_available, parse_topology, placement
from specjax.aot.graphs import fp8_matmul_sweep, loop_graph
from specjax.aot.memory import compare, graph_plan
from specjax.kernels import on_gpu, targeting_gpu

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(), reason="needs jaxlib's CUDA plugin: pip install "
                                                                        "-e '.[cuda12]'")
GIB = 2.0**30


def test_topology_names_and_bad_input():
    assert parse_topology("2x1x4") == (2, 4) and parse_topology("1x1x1") == (1, 1)
    for bad in ("8", "1x2x4", "0x1x8", "ax1x8"):
        with pytest.raises(ValueError, match="HOSTSx1xGPUS_PER_HOST"):
            parse_topology(bad)
    with pytest.raises(ValueError, match="device must be one of"):
        placement("a100")
    with pytest.raises(ValueError, match="cache_len must be a multiple of 16"):
        loop_graph("8b", "plain", 1, cache_len=1000)
    with pytest.raises(ValueError, match="draft must be one of"):
        loop_graph("8b", "medusa", 1)


def test_targeting_gpu_is_scoped():
    assert not on_gpu()
    with targeting_gpu():
        assert on_gpu()
    assert not on_gpu()


def test_scan_hlo_counts_kernels_fusions_and_collectives():
    text = ('  %pallas_call.2 = bf16[8] custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", '
            'backend_config={grid_x = 8 : i32, name = "tree_attention", num_warps = 4}\n'
            '  %f = bf16[8] fusion(%a), kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__triton_nested'
            '_gemm_fusion"}}\n  %all-reduce.1 = bf16[8]{0} all-reduce(%f), replica_groups={{0,1}}\n'
            '  %ag = (bf16[8], bf16[16]) all-gather-start(%f)\n'
            '\n%fused_convert.6 (param_0: f8e4m3fn[32,4096,14336], param_1: s32[]) -> bf16[4096,14336] {\n'
            '  %c = bf16[4096,14336]{1,0} convert(%b)\n}\n'
            '\n%gemm (param_0: f8e4m3fn[64,64], param_1: bf16[8,64]) -> bf16[8,64] {\n  %d = dot(%a, %b)\n}\n')
    assert scan_hlo(text) == {"pallas_kernels": {"tree_attention": 1},
                              "triton_fusions": {"__triton_nested_gemm_fusion": 1},
                              "collectives": {"all-reduce": 1, "all-gather": 1},
                              "dequantized_weights": 1}  # the convert written to memory; not the fused GEMM


@pytest.fixture(scope="module")
def h100():
    return placement("h100")


@needs_plugin
def test_the_kernel_sweep_compiles_for_h100(h100):
    records = [compile_graph(g, h100)[0] for g in ci_kernel_sweep()]
    assert [r for r in records if "error" in r] == []
    assert all(r["pallas_kernels"] == {"tree_attention": 1} for r in records)
    assert not h100.on_gpu and "H100" in h100.device_kind
    assert "kernel/d64/g4/n16/s2048/b64/fp32" in format_table(records)


@pytest.fixture(scope="module")
def loops(h100):
    """The 8B loops: plain at batch 1, the speculative ones at batch 8 (cache 2048 a row, prompts of 128)."""
    graphs = [loop_graph("8b", "plain", 1)] + [loop_graph("8b", d, 8) for d in
                                              ("chain", "dynamic", "sampled", "dflash", "dspark_prefix")]
    return {g.info["draft"]: (g, compile_graph(g, h100)[0]) for g in graphs}


@needs_plugin
def test_the_8b_loops_compile_for_h100_with_the_kernel(loops):
    failed = {name: r["error"] for name, (_, r) in loops.items() if "error" in r}
    assert failed == {}
    for name, (_, r) in loops.items():
        # the target's verify/decode and prefill, and the drafter's passes, run the Pallas kernel
        assert r["pallas_kernels"].get("tree_attention", 0) >= (2 if name != "plain" else 1), name
        assert r["collectives"] == {}, name  # one GPU: nothing to communicate
        assert r["argument_bytes"] > 14.9 * GIB  # the 8.03B bf16 weights are arguments


@needs_plugin
def test_the_memory_plan_matches_the_compiler_within_10_percent(loops):
    """Plan = weights + KV caches; the compiler adds the request arrays, outputs and a pass's workspace."""
    for name in ("plain", "chain"):
        graph, record = loops[name]
        row = compare(record, graph_plan(graph, "h100", 1))
        assert 1.0 < row["ratio"] < 1.10, (name, row)
        assert abs(row["arguments_compiled"] - row["weights_plan"]) < 0.01 * row["weights_plan"]
        assert row["temp_compiled"] > row["cache_plan"]  # the caches live inside the loop's temp
        assert total_bytes(record) == row["compiled_bytes"]


@needs_plugin
def test_the_command_prints_and_writes_the_records(monkeypatch, capsys, tmp_path):
    import json

    import specjax.aot.compile as command
    from specjax.aot.graphs import kernel_graph

    graph = kernel_graph(head_dim=128, group=4, nodes=8, max_len=1024, batch=2, dtype="bfloat16")
    monkeypatch.setattr(command, "select_graphs", lambda args: [graph])
    args = argparse.Namespace(device="h200", topology="1x1x1", preset=[], batch=[1], drafts=None, kernels="ci",
                              json=True, out=str(tmp_path / "records.json"))
    assert main(args) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["graph"] == graph.name and record["device"] == "h200" and record["topology"] == "1x1x1"
    qkv = 2 * 8 * 32 * 128 * 2 + 2 * (4 * 2 * 1024 * 8 * 128 * 2)  # q [2, 8, 32, 128], k and v [4, 2, 1024, 8, 128]
    assert record["compile_s"] > 0 and qkv < record["argument_bytes"] < qkv + 1024
    assert {"temp_bytes", "output_bytes", "alias_bytes"} <= set(record) and "H200" in record["device_kind"]
    assert json.loads((tmp_path / "records.json").read_text())["records"] == [record]


@needs_plugin
def test_the_block_fp8_matmul_compiles_for_h100(h100):
    """The fused FP8 kernel alone at an 8B's decode rows (specjax/aot/graphs.py FP8_MATMULS): Triton to sm_90a, no
    dequantized weight anywhere; the split-K shape adds one reduce fusion for its partials."""
    records = [compile_graph(g, h100)[0] for g in fp8_matmul_sweep()]
    assert [r for r in records if "error" in r] == []
    assert all(r["pallas_kernels"] == {"block_fp8_matmul": 1} and r["dequantized_weights"] == 0 for r in records)
    assert all(r["temp_bytes"] == 0 for r in records if r["n"] == 14336)  # no split: the output written in place


@needs_plugin
def test_a_block_fp8_8b_target_holds_its_quantized_size_on_h100(h100):
    """The 8B plain loop with its linears as a block-FP8 checkpoint loads them: the compiled arguments are the FP8
    size (~8.5 GiB: 1 byte a linear weight, f32 block scales, the bf16 embedding and lm_head), not bf16's 15 GiB.
    Every linear runs the fused block-FP8 kernel: XLA alone wrote each dequantized weight to memory before its GEMM
    (12 such fusions at batch 1, jax 0.10.2: docs/quantization.md); with the kernel there are none."""
    graph = loop_graph("8b", "plain", 1, quantized="fp8")
    record, _ = compile_graph(graph, h100)
    assert "error" not in record, record.get("error")
    assert 8.3 * GIB < record["argument_bytes"] < 8.6 * GIB
    assert record["pallas_kernels"].get("tree_attention", 0) >= 1
    assert graph.name == "plain/8b/b1/fp8"
    # the 7 linears of the layer scan in the prefill and in the decode step
    assert record["pallas_kernels"].get("block_fp8_matmul") == 14
    assert record["dequantized_weights"] == 0
    assert record["temp_bytes"] < 0.4 * GIB
