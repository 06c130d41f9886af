"""Drafters on a target split over a mesh (8 fake CPU devices, in a subprocess: tests/sharded_check.py "heads").

The embedded target (an orbax checkpoint, restored straight into its shardings) with its EAGLE-3 head (replicated on
every device), its MTP layers (split like the target) and its DFlash and DSpark heads (replicated) at TP 2, TP 8
and DP 2 x TP 4: plain and EAGLE-3 chains everywhere; at DP 2 x TP 4 the other greedy chains, an EAGLE-3 tree, a
stream and DSpark under the prefix scheduler (its cost curve measured on the mesh) equal one device's tokens.
"""

from __future__ import annotations

import pytest
from sharded_check import failed, run_part


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    checks, _ = run_part("heads", tmp_path_factory.mktemp("sharded_heads"))
    return checks


def test_eagle3_and_mtp_tokens_equal_one_device(heads):
    # per mesh: plain and EAGLE-3 chain; at DP 2 x TP 4 also an EAGLE-3 tree, MTP, DFlash and DSpark chains, a
    # stream (the chunked loop) and DSpark under the scheduler
    count, bad = failed(heads, "equals one device")
    assert count == 2 + 2 + 8 and bad == {}
    count, bad = failed(heads, "scheduler cost measured on the mesh")
    assert count == 1 and bad == {}


def test_orbax_restore_splits_the_target_and_mtp_blocks_heads_stay_whole(heads):
    count, bad = failed(heads, "split")  # per mesh: 6 target weights, 2 MTP block weights
    assert count == 3 * 8 and bad == {}
    count, bad = failed(heads, "replicated")  # the EAGLE-3 head's weights and its cache's heads
    assert count == 3 * 2 and bad == {}
