"""A Qwen3.5 hybrid target (Gated DeltaNet + gated attention) split over a mesh (8 fake CPU devices, in a subprocess:
tests/sharded_check.py "hybrid"): plain and n-gram tokens equal one device's at TP 2, TP 8 and DP 2 x TP 4, sampled
ones at DP 2 x TP 4; DeltaNet value heads, conv channels, attention heads and the recurrent state split as the rules
say.
"""

from __future__ import annotations

import pytest
from sharded_check import failed, run_part


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    checks, _ = run_part("hybrid", tmp_path_factory.mktemp("sharded_hybrid"))
    return checks


def test_hybrid_tokens_equal_one_device(hybrid):
    count, bad = failed(hybrid, "equals one device")  # per mesh plain and n-gram, sampled at DP 2 x TP 4
    assert count == 3 * 2 + 1 and bad == {}


def test_hybrid_weights_and_recurrent_state_split(hybrid):
    count, bad = failed(hybrid, "split")  # per mesh: 7 DeltaNet weights, 4 attention weights, 3 caches
    assert count == 3 * 14 and bad == {}
