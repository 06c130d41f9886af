"""The Pallas tree-attention kernel on a mesh (kernels/sharded.py), and the TP-8 loop lowered for CUDA.

On one device: the specs the kernel runs under. On 8 fake CPU devices (tests/sharded_check.py "kernel", in a
subprocess): the kernel under shard_map (interpret mode) equals the XLA reference at TP 2, TP 8 and DP 2 x TP 4,
kv heads split or whole, one layer or a stacked cache; the plain loop and a draft tree with attn_impl="pallas" on
the stacked layout give one device's tokens; a Llama-3-8B-shaped speculative loop at TP 8 lowers for CUDA with
the Triton kernel inside the shard_map, each device's kernel reading its one kv head.
"""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from sharded_check import failed, run_part

from specjax.kernels.sharded import mesh_specs

TP8 = AbstractMesh((1, 8), ("data", "model"))
DP2_TP4 = AbstractMesh((2, 4), ("data", "model"))


def test_rows_and_kv_heads_split_where_the_axes_divide_them():
    q, kv, lengths, mask = mesh_specs((4, 5, 32, 16), (4, 64, 8, 16), TP8, "data", "model")
    assert (q, kv, lengths, mask) == (P(None, None, "model", None), P(None, None, "model", None), P(None),
                                      P(None, None, None))
    q, kv, lengths, mask = mesh_specs((4, 5, 32, 16), (3, 4, 64, 8, 16), DP2_TP4, "data", "model")
    assert q == P("data", None, "model", None) and kv == P(None, "data", None, "model", None)
    assert lengths == P("data") and mask == P("data", None, None)
    # 4 kv heads on 8 devices, 3 rows on 2 replicas: both whole (every device computes them)
    q, kv, _, _ = mesh_specs((3, 5, 16, 16), (3, 64, 4, 16), DP2_TP4, "data", "model")
    assert kv == P(None, None, "model", None) and q == P(None, None, "model", None)
    q, kv, _, _ = mesh_specs((4, 5, 16, 16), (4, 64, 4, 16), TP8, "data", "model")
    assert q == P(None, None, None, None) and kv == P(None, None, None, None)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    checks, _ = run_part("kernel", tmp_path_factory.mktemp("sharded_kernel"))
    return checks


def test_the_kernel_under_shard_map_equals_the_reference(kernel):
    count, bad = failed(kernel, "equals the reference")
    assert count == 3 * 2 and bad == {}


def test_loops_with_the_kernel_on_a_mesh_equal_one_device(kernel):
    count, bad = failed(kernel, "pallas")
    assert count == 2 * 2 and bad == {}


def test_the_tp8_speculative_loop_lowers_for_cuda_with_the_kernel_per_device(kernel):
    count, bad = failed(kernel, "lowering")
    assert count == 5 and bad == {}
