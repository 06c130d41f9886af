"""A quantized (block FP8) target over a mesh, on 8 fake CPU devices in a subprocess (tests/sharded_check.py, part
"quantized"): greedy plain and draft-model outputs equal one device's at TP 2 and DP 2 x TP 4, and each weight's
scales split with their blocks (or the weight stays whole where a device's slice would cut a block); block-FP8 MoE
experts and a block-FP8 hybrid (linear_attn, the gated attention's per-head split) likewise."""

from __future__ import annotations

import pytest
from sharded_check import failed, run_part


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return run_part("quantized", tmp_path_factory.mktemp("quantized"))[0]


@pytest.mark.parametrize("words", [("equals one device",), ("values and scales",), ("shard",)])
def test_quantized_target_on_a_mesh(checks, words):
    count, bad = failed(checks, *words)
    assert count >= 2 and not bad
