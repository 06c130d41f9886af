"""A Qwen3-MoE target split over a mesh (8 fake CPU devices, in a subprocess: tests/sharded_check.py "moe"): plain,
n-gram tokens equal one device's at TP 2, TP 8 and DP 2 x TP 4 (sampled too at DP 2 x TP 4), with the experts split
inside (the default rules) and, at DP 2 x TP 4, whole experts per device (EXPERT_PARALLEL: each device runs the
slots routed to its own experts under shard_map, models/moe.py expert_parallel_experts).
"""

from __future__ import annotations

import pytest
from sharded_check import failed, run_part


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    checks, _ = run_part("moe", tmp_path_factory.mktemp("sharded_moe"))
    return checks


def test_moe_tokens_equal_one_device(moe):
    # per mesh plain and n-gram; at DP 2 x TP 4 also sampled, and expert-parallel plain and n-gram
    count, bad = failed(moe, "equals one device")
    assert count == 3 * 2 + 3 and bad == {}


def test_moe_experts_split_inside_or_whole_under_expert_parallel(moe):
    count, bad = failed(moe, "split")  # per mesh: 2 expert tensors, a dense layer, an attention weight
    assert count == 3 * 4 and bad == {}
    count, bad = failed(moe, "expert parallel w_")
    assert count == 2 and bad == {}
    count, bad = failed(moe, "router replicated")
    assert count == 3 and bad == {}
    count, bad = failed(moe, "under shard_map")  # EXPERT_PARALLEL sets the MoE layers' expert-parallel path
    assert count == 1 and bad == {}
