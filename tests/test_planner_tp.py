"""Planning with tensor parallelism: the split by the sharding rules, the roofline's per-device terms and its
collectives (numbers checked by hand), the CLI's flags, and the memory plan. Pure Python: no model is run."""

from __future__ import annotations

import json

import pytest

from specjax.config import ModelConfig
from specjax.planning.presets import LLAMA3_8B, LLAMA33_70B, QWEN35_27B, QWEN35_122B_A10B
from specjax.planning.profile import DEVICES, QWEN3_30B_A3B, Roofline, cost_model
from specjax.planning.tensor_parallel import replicated, split_model

H100 = DEVICES["h100"]


def config(hf) -> ModelConfig:
    return ModelConfig.from_hf(hf)


# ---------------------------------------------------------------- the split


def test_the_split_follows_the_sharding_rules():
    llama = config(LLAMA33_70B)
    tp = split_model(llama, 8)
    assert (tp.heads, tp.kv_heads, tp.mlp, tp.vocab) == (8, 8, 8, 8) and replicated(llama, tp) == []
    qwen = config(QWEN35_122B_A10B)  # 2 kv heads on 8 devices: whole on every device; 256 experts: 32 a device
    tp = split_model(qwen, 8)
    assert (tp.heads, tp.kv_heads, tp.v_heads, tp.conv, tp.experts, tp.shared) == (8, 1, 8, 8, 8, 8)
    assert tp.expert_layout == "expert parallel"
    assert replicated(qwen, tp) == ["kv heads (2, not divisible by 8): k, v and the KV cache whole on every device"]
    for hf in (LLAMA3_8B, LLAMA33_70B, QWEN35_27B, QWEN35_122B_A10B, QWEN3_30B_A3B):
        cfg = config(hf)  # one device of one holds the model: the sharded count is the plain one
        assert cfg.num_params(shards=split_model(cfg, 1).shards) == cfg.num_params()


def test_a_degree_that_does_not_divide_the_heads_says_what_would_be_replicated():
    with pytest.raises(ValueError, match=r"does not divide the 64 attention heads: the sharding rules would "
                                         r"replicate q, k, v and o .* 1, 2, 4, 8, 16, 32, 64"):
        split_model(config(LLAMA33_70B), 3)
    with pytest.raises(ValueError, match="a positive number of devices"):
        split_model(config(LLAMA33_70B), 0)


def test_tensor_parallelism_needs_a_link_and_one_nvlink_domain():
    cfg = config(LLAMA3_8B)
    with pytest.raises(ValueError, match="needs a device link to price: .* has none in DEVICES; use --device h100 or h200"):
        Roofline.for_config(cfg, DEVICES["cpu"], 0, 2)
    with pytest.raises(ValueError, match="spans more than one NVLink domain .* use 8 or fewer"):
        Roofline.for_config(cfg, H100, 0, 16)


# ---------------------------------------------------------------- the roofline


def test_llama3_8b_at_tp8_on_h100_by_hand():
    """Meta-Llama-3-8B (32 layers, hidden 4096, 32 heads, 8 kv heads of 128, MLP 14336, vocab 128256, untied,
    bf16) split over 8 H100s. Everything divides by 8, so one device holds:
      per layer q + o 2 x 4096 x 4096 / 8 = 4,194,304, k + v 2 x 4096 x 1024 / 8 = 1,048,576,
      MLP 3 x 4096 x 14336 / 8 = 22,020,096, two norms 8,192: 27,271,168; x 32 = 872,677,376;
      embedding and lm_head 2 x 128256 x 4096 / 8 = 131,334,144; final norm 4,096: 1,004,015,616 params,
      2,008,031,232 bytes: 0.5994 ms at 3.35 TB/s.
    Compute 2 x 1.004e9 / 989e12 = 2.0304 us a token: the knee stays at 0.5994 ms / 2.0304 us = 295 tokens,
    as on one device (both sides fall by 8; a dense knee is peak x 2 bytes / (2 x bandwidth) whatever the size).
    Collectives: 2 all-reduces a layer (after o_proj, after down_proj) + 1 after the vocabulary-split embedding
    = 65 of [T, 4096] bf16 (8192 T bytes), each 15.5 us + 2 x 7/8 x 8192 T / 450e9 = 15.5 + 0.031858 T us,
    and the greedy lm_head's argmax all-reduce, 15.5 us + 1.75 x 8 T / 450e9.
    T = 1: 66 x 15.5 + 65 x 0.031858 = 1025.1 us; the pass 0.5994 + 1.0251 = 1.6245 ms, 63% all-reduce.
    T = 256 (8 rows x 32 nodes, below the knee): weights still bound (256 x 2.0304 = 519.8 us < 599.4), but the
    all-reduces move 256 x as many bytes: 1023 + 65 x 0.031858 x 256 = 1553.1 us; the pass 2.1525 ms: tokens
    below the knee are no longer free (on one device both passes cost 4.794 ms)."""
    one = Roofline.for_config(config(LLAMA3_8B), H100, 0, 1)
    tp8 = Roofline.for_config(config(LLAMA3_8B), H100, 0, 8)
    assert tp8.params == 1_004_015_616 and tp8.weight_bytes == 2_008_031_232
    assert tp8.weights_s(1) == pytest.approx(0.5994e-3, abs=1e-7)
    assert tp8.knee == pytest.approx(one.knee) == pytest.approx(295.2, abs=0.1)
    assert tp8.allreduces == 65 and tp8.activation_bytes == 8192 and tp8.logits_bytes == 8
    assert tp8.collective_s(1) == pytest.approx(1025.1e-6, abs=0.1e-6)
    assert tp8.verify_s(1, 1) == pytest.approx(1.6245e-3, abs=1e-7)
    assert tp8.collective_s(1) / tp8.verify_s(1, 1) == pytest.approx(0.63, abs=0.01)
    assert tp8.collective_s(256) == pytest.approx(1553.1e-6, abs=0.1e-6)
    assert tp8.verify_s(8, 32) == pytest.approx(2.1525e-3, abs=1e-7)
    assert one.verify_s(8, 32) == one.verify_s(1, 1) == pytest.approx(4.794e-3, abs=1e-6)
    assert one.collective_s(256) == 0.0


def test_a_sampled_verify_gathers_the_logits():
    """Sampling reads whole rows of logits: the split lm_head's fp32 logits are all-gathered, 4 x 128256 bytes a
    token: at T = 64, 15.5 us + 7/8 x 64 x 513,024 / 450e9 = 79.3 us in place of the argmax's 15.5."""
    greedy = Roofline.for_config(config(LLAMA3_8B), H100, 0, 8)
    sampled = Roofline.for_config(config(LLAMA3_8B), H100, 0, 8, sampled=True)
    assert sampled.gather_logits and sampled.logits_bytes == 4 * 128256
    gathered = sampled.collective_s(64) - greedy.collective_s(64) + H100.allreduce_s(8, 64 * 8)
    assert gathered == pytest.approx(15.5e-6 + 7 / 8 * 64 * 513024 / 450e9)
    assert gathered == pytest.approx(79.3e-6, abs=0.1e-6)


def test_an_moe_reads_its_experts_per_device_and_its_knee_moves():
    """Qwen3-30B-A3B at TP 8: 128 experts, 16 a device (expert parallelism), so a pass reads D(T) / 8 experts'
    bytes per device; its 4 kv heads do not divide by 8 and stay whole, a larger share of the 3.3B active
    params than of the weights a pass reads, so compute per device falls less than the bytes: the knee moves
    from ~2690 tokens to ~2230."""
    cfg = config(QWEN3_30B_A3B)
    one, tp8 = Roofline.for_config(cfg, H100, 0, 1), Roofline.for_config(cfg, H100, 0, 8)
    assert tp8.expert_bytes == pytest.approx(one.expert_bytes / 8)
    assert tp8.experts_read(64) == one.experts_read(64)  # model-wide distinct experts; the bytes are per device
    assert one.knee == pytest.approx(2688, abs=5) and tp8.knee == pytest.approx(2230, abs=5)
    assert tp8.allreduces == 2 * 48 + 1  # the MoE layer's all-reduce sums the experts' shares, as a dense MLP's


def test_the_hybrid_state_splits_by_value_heads():
    """Qwen3.5-27B at TP 2: 48 DeltaNet layers of 48 value heads of 128 x 128 (fp32), 24 a device:
    48 x 24 x 128 x 128 x 4 = 75,497,472 bytes of state a row; KV 16 layers x 2 x 2 kv heads x 256 x 2 bytes."""
    tp2 = Roofline.for_config(config(QWEN35_27B), H100, 4096, 2)
    assert tp2.state_bytes_per_row == 75_497_472
    assert tp2.kv_bytes_per_position == 16 * 2 * 2 * 256 * 2
    assert tp2.allreduces == 2 * 64 + 1


def test_the_allreduce_formula_against_the_measured_nccl_tests():
    """The ring formula against nccl-tests' all_reduce_perf on 8 H100 SXM (NVIDIA aiconfigurator's table, the
    DeviceSpec's source): 16 KB 16.6 us, 512 MiB 2112 us measured; within 10% there. At 1 MiB NCCL measured
    38.6 us where the formula gives 19.6: the model is low between 1 and 16 MiB (stated in DeviceSpec)."""
    assert H100.allreduce_s(8, 16384) == pytest.approx(16.6e-6, rel=0.1)
    assert H100.allreduce_s(8, 2**29) == pytest.approx(2112e-6, rel=0.1)
    assert H100.allreduce_s(8, 2**20) == pytest.approx(19.6e-6, abs=0.1e-6)
    assert H100.latency(1) == 0.0 and H100.latency(2) == 6.2e-6 and H100.latency(3) == pytest.approx(7.85e-6)


def test_a_profile_json_refuses_tensor_parallelism(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profiles": {}}))
    with pytest.raises(ValueError, match="a profile JSON holds times measured where it ran"):
        cost_model(str(path), config(LLAMA3_8B), None, 0, 0.05, tensor_parallel=8)


# ---------------------------------------------------------------- the CLI


def test_plan_cli_prices_a_sharded_target_and_reports_its_allreduces(capsys, tmp_path):
    from specjax.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model-only", "--tensor-parallel", "8", "--concurrency", "1,128", "--max-nodes", "64",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel 8 (per device; 65 all-reduces" in text  # the cost line
    assert "tensor parallel 8: each best shape's verify pass, and its all-reduces" in text
    saved = json.loads(out.read_text())
    assert saved["tensor_parallel"] == 8
    row = saved["collectives"][0]
    assert row["batch"] == 1 and row["tokens"] == saved["choices"][0]["best"]["nodes"]
    assert 0.5 < row["allreduce_share"] < 0.8 and row["collective_s"] < row["verify_s"]
    assert main(["plan", "--model-only", "--concurrency", "1", "--max-nodes", "16", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["tensor_parallel"] == 1 and "collectives" not in saved


def test_plan_cli_moe_at_tensor_parallel_reports_both_models(capsys, tmp_path):
    from specjax.cli import main

    out = tmp_path / "moe.json"
    assert main(["plan", "--model-only", "--moe", "--tensor-parallel", "8", "--concurrency", "1,32",
                 "--max-nodes", "32", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["collectives"]) == {"dense", "moe"} and saved["tensor_parallel"] == 8
    text = capsys.readouterr().out  # what stays whole is said with the cost
    assert "replicated: kv heads (4, not divisible by 8): k, v and the KV cache whole on every device" in text
    assert "Qwen3-30B-A3B (30.5B, 3.35B active)" in text


@pytest.mark.parametrize("argv, says", [
    (["--model-only", "--tensor-parallel", "3"], "does not divide the 32 attention heads"),
    (["--model-only", "--tensor-parallel", "2", "--device", "cpu"], "use --device h100 or h200"),
    (["--model-only", "--tensor-parallel", "16"], "spans more than one NVLink domain"),
    (["--drafter", "ngram", "--tensor-parallel", "8"], "add --device h100 or --device h200"),
    (["--memory", "--tensor-parallel", "4"], "drop --tensor-parallel, or pass --target"),
    (["--memory", "--device", "cpu"], "has no memory size in DEVICES"),
])
def test_plan_cli_tensor_parallel_errors_say_what_would_be_right(capsys, argv, says):
    from specjax.cli import main

    assert main(["plan", *argv]) == 2
    assert says in capsys.readouterr().err


# ---------------------------------------------------------------- the memory plan


def test_memory_plan_llama33_70b_at_tp8_on_h100_by_hand():
    """Llama-3.3-70B (80 layers, hidden 8192, 64 heads, 8 kv heads of 128, MLP 28672, vocab 128256, untied, bf16)
    on 8 H100s: 70,553,706,496 params, every part divisible by 8. One device:
      per layer q + o 2 x 8192 x 8192 / 8 = 16,777,216, k + v 2 x 8192 x 1024 / 8 = 2,097,152,
      MLP 3 x 8192 x 28672 / 8 = 88,080,384, norms 16,384: 106,971,136; x 80 = 8,557,690,880;
      embedding + lm_head 2 x 128256 x 8192 / 8 = 262,668,288; final norm 8,192: 8,820,367,360 params,
      17,640,734,720 bytes (16.43 GiB): an eighth of the model but its 1,318,912 norm weights, whole on each.
    KV: 80 layers x K and V x 1 kv head x 128 x 2 bytes = 40,960 bytes a token (40 KiB; 40.96 MB per 1k tokens).
    32 rows x 8192 tokens: 10,737,418,240 bytes (10 GiB).
    The typical EAGLE-3 head, whole on each device: fc 3 x 8192 x 8192 = 201,326,592; q 16384 x 8192 =
    134,217,728; k, v 2 x 16384 x 1024 = 33,554,432; o 67,108,864; MLP 704,643,072; three norms + final norm
    32,768; lm_head 8192 x 32000 = 262,144,000: 1,403,027,456 params = 2,806,054,912 bytes, + d2t 32000 x 4;
    its KV 2 x 8 x 128 x 2 = 4,096 bytes a token, 1,073,741,824 for the batch.
    Free: 81559 MiB = 85,520,809,984 - 17,640,734,720 - 10,737,418,240 - 2,806,182,912 - 1,073,741,824
    = 53,262,732,288 bytes (49.60 GiB)."""
    from specjax.planning.memory import memory_plan

    cfg = config(LLAMA33_70B)
    assert cfg.num_params() == 70_553_706_496
    plan = memory_plan(cfg, "Llama-3.3-70B", H100, 8, 32, 8192)
    assert plan.weight_bytes == 17_640_734_720 == 2 * ((cfg.num_params() - 1_318_912) / 8 + 1_318_912)
    assert plan.kv_bytes_per_token == 40_960 and plan.state_bytes_per_row == 0
    assert plan.cache_bytes == 10_737_418_240
    assert plan.draft.weight_bytes == 2_806_054_912 + 4 * 32000 and plan.draft.kv_bytes_per_token == 4096
    assert plan.capacity == 85_520_809_984
    assert plan.free_bytes == 53_262_732_288
    assert plan.max_batch == int((85_520_809_984 - 17_640_734_720 - 2_806_182_912) // (8192 * (40_960 + 4096)))
    assert plan.replicated == ()


def test_memory_plan_qwen35_hybrids_by_hand():
    """Qwen3.5-27B at TP 2: 48 DeltaNet layers, each a row's fp32 state of 24 of the 48 value heads
    (24 x 128 x 128 x 4 = 1,572,864) and the conv window of half the 10240 channels (3 x 5120 x 2 = 30,720):
    76,972,032 bytes a row; KV 16 layers x 2 x 2 kv heads x 256 x 2 = 32,768 a token.
    Qwen3.5-122B-A10B at TP 8: its 2 kv heads stay whole: 12 x 2 x 2 x 256 x 2 = 24,576 bytes a token; 36 DeltaNet
    layers of 8 value heads and 1536 channels: 36 x (524,288 + 9,216) = 19,206,144 a row; the MTP layer's 256
    experts split 32 a device."""
    from specjax.planning.memory import memory_plan

    dense = memory_plan(config(QWEN35_27B), "Qwen3.5-27B", H100, 2, 1, 0, mtp_layers=1)
    assert dense.state_bytes_per_row == 76_972_032 and dense.kv_bytes_per_token == 32_768
    assert dense.weight_bytes == pytest.approx(config(QWEN35_27B).num_params(), rel=1e-4)  # bf16, halved (+ norms)
    moe = memory_plan(config(QWEN35_122B_A10B), "Qwen3.5-122B-A10B", DEVICES["h200"], 8, 1, 0, mtp_layers=1)
    assert moe.kv_bytes_per_token == 24_576 and moe.state_bytes_per_row == 19_206_144
    assert moe.replicated == ("kv heads (2, not divisible by 8): k, v and the KV cache whole on every device",)
    assert moe.draft.what.startswith("1 MTP layer") and moe.draft.kv_bytes_per_token == 2 * 2 * 256 * 2


def test_the_mtp_draft_matches_the_mtp_layers_own_shapes():
    """At TP 1 the MTP draft's bytes are the MTP layer's parameters as drafters/mtp.py builds them."""
    import math

    import jax

    from specjax.drafters.mtp import layer_shapes
    from specjax.planning.memory import mtp_draft
    from specjax.planning.tensor_parallel import TensorParallel

    for hf in (QWEN35_27B, QWEN35_122B_A10B):
        cfg = config(hf)
        shapes = layer_shapes(cfg, sparse=cfg.moe is not None)
        count = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
        assert mtp_draft(cfg, TensorParallel(1), 1).weight_bytes == 2 * count


def test_plan_cli_memory_prints_the_table_and_writes_json(capsys, tmp_path):
    from specjax.cli import main

    out = tmp_path / "memory.json"
    assert main(["plan", "--memory", "--batch", "32", "--context", "8192", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| Llama-3.3-70B | NVIDIA H100 SXM (79.6 GiB) | 8 | 16.43 | 40 | 39.1 | 0.0 |" in text
    assert "replicated: Qwen3.5-122B-A10B at TP 8: kv heads (2, not divisible by 8)" in text
    rows = json.loads(out.read_text())["memory"]
    assert [(r["model"], r["tensor_parallel"]) for r in rows][::2] == [("Llama-3.3-70B", 8), ("Qwen3.5-27B", 2),
                                                                      ("Qwen3.5-122B-A10B", 8)]
    assert rows[0]["free_bytes"] == 53_262_732_288


def test_plan_cli_memory_of_a_checkpoint_with_its_drafter(capsys, tmp_path):
    """--target's config.json at --tensor-parallel; --drafter's checkpoint priced by its safetensors headers."""
    from specjax.cli import main
    from specjax.convert.hf_files import safetensors_files
    from specjax.loading.embedded import EMBEDDED_DIR
    from specjax.planning.memory import checkpoint_draft

    draft_dir = EMBEDDED_DIR / "eagle3"
    out = tmp_path / "m.json"
    assert main(["plan", "--memory", "--target", str(EMBEDDED_DIR / "target" / "config.json"), "--device", "h100",
                 "--tensor-parallel", "2", "--drafter", str(draft_dir), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["memory"][0]
    assert row["tensor_parallel"] == 2 and row["draft"]["what"].startswith("drafter eagle3")
    stored = sum(f.stat().st_size for f in safetensors_files(draft_dir))
    assert 0.9 * stored < checkpoint_draft(draft_dir).weight_bytes < stored  # the tensors, less the headers


def test_the_allreduce_benchmark_runs_on_two_host_devices(tmp_path):
    """scripts/bench_allreduce.py (gpu_checks.sh tp) end to end on two CPU devices: a psum per size, the JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "allreduce.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, str(root / "scripts" / "bench_allreduce.py"), "--hidden", "64",
                             "--tokens", "1,8", "--repeats", "1", "--inner", "2", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["devices"], r["tokens"], r["bytes"]) for r in rows] == [(2, 1, 128), (2, 8, 1024)]
    assert all(r["measured_s"] > 0 and r["model_s"] is None for r in rows)  # the CPU has no link to model


def test_the_docs_memory_table_is_what_the_command_prints(capsys):
    """docs/planning.md's multi-device memory table is `specjax plan --memory --batch 32 --context 8192`, row for row."""
    from pathlib import Path

    from specjax.cli import main

    assert main(["plan", "--memory", "--batch", "32", "--context", "8192"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    readme = (Path(__file__).resolve().parent.parent / "docs" / "planning.md").read_text()
    assert len(rows) == 7 and all(row in readme for row in rows)
