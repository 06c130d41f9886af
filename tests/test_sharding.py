"""Multi-device loading and decoding (models/sharding.py, convert/lazy.py).

On one device here: the rules table applied to shapes (an abstract mesh needs no devices) and the errors for a
wrong mesh (test_lazy_reads.py checks the per-slice reading). On 8 fake CPU devices, in
a subprocess (tests/sharded_check.py, part "dense"): an HF dense target at TP 2, TP 8 and DP 2 x TP 4, whose plain
and draft-model chain outputs (and at DP 2 x TP 4 also the draft tree, n-gram, sampled and inspect_draft ones)
equal one device's, whose weights and caches split as the rules say, and whose devices each read only their slice
of the safetensors files; there profile() times its passes on the mesh and "auto" plans from that profile.
test_sharding_drafters.py, test_sharding_hybrid.py and test_sharding_moe.py run the other parts.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from sharded_check import failed, run_part

import specjax
from specjax.config import ModelConfig
from specjax.decoding.request import batch_bucket
from specjax.loading.embedded import embedded
from specjax.models.model import init_params, merge
from specjax.models.sharding import EXPERT_PARALLEL, abstract, logical_axes, partition_spec

TP8 = AbstractMesh((1, 8), ("data", "model"))
DP2_TP4 = AbstractMesh((2, 4), ("data", "model"))


# ---- the rules, on shapes -------------------------------------------------------------------------------------


def test_heads_split_only_in_whole_heads():
    counts = {"heads": 8, "kv_heads": 4}
    assert partition_spec(("embed", "heads"), (64, 8 * 16), TP8, counts) == P(None, "model")
    # 4 kv heads of 16 on 8 devices: the flattened width 64 divides by 8, the heads do not: replicated
    assert partition_spec(("embed", "kv_heads"), (64, 4 * 16), TP8, counts) == P(None, None)
    assert partition_spec(("embed", "kv_heads"), (64, 4 * 16), DP2_TP4, counts) == P(None, "model")
    assert partition_spec(("heads", "embed"), (8 * 16, 64), TP8, counts) == P("model", None)


def test_a_dimension_the_axis_does_not_divide_stays_replicated():
    assert partition_spec(("vocab", "embed"), (250, 64), TP8, {}) == P(None, None)
    assert partition_spec(("vocab", "embed"), (256, 64), TP8, {}) == P("model", None)
    assert partition_spec(("embed", "mlp"), (64, 688), TP8, {}) == P(None, "model")  # 688 = 8 x 86
    assert partition_spec(("embed", "mlp"), (64, 690), TP8, {}) == P(None, None)


def test_size_one_axes_and_unnamed_dimensions_are_never_in_a_spec():
    one = AbstractMesh((1, 1), ("data", "model"))
    assert partition_spec(("embed", "heads"), (64, 128), one, {"heads": 8}) == P(None, None)
    assert partition_spec((None, "embed"), (4, 64), TP8, {}) == P(None, None)
    assert partition_spec(("layers", "embed", "mlp"), (8, 64, 128), TP8, {}) == P(None, None, "model")


def test_experts_split_inside_by_default_whole_under_expert_parallel():
    # [E, D, I] and [E, I, D]: the mlp width takes the model axis; with EXPERT_PARALLEL the experts take it first
    assert partition_spec(("experts", "embed", "mlp"), (8, 64, 32), TP8, {}) == P(None, None, "model")
    assert partition_spec(("experts", "mlp", "embed"), (8, 32, 64), TP8, {}) == P(None, "model", None)
    assert partition_spec(("experts", "embed", "mlp"), (8, 64, 32), TP8, {}, EXPERT_PARALLEL) == P("model", None, None)
    # 6 experts on 8 devices: expert parallel falls back to the mlp width
    assert partition_spec(("experts", "embed", "mlp"), (6, 64, 32), TP8, {}, EXPERT_PARALLEL) == P(None, None, "model")


def test_logical_axes_follow_the_params_tree():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=4)
    params = init_params(cfg, jax.random.key(0), per_layer=True)
    axes = logical_axes(merge(cfg, abstract(params)))
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)
    assert axes["embed"] == ("vocab", "embed") and axes["layers"][1]["wk"] == ("embed", "kv_heads")
    assert axes["layers"][0]["w_down"] == ("mlp", "embed")


def test_batch_bucket_is_a_multiple_of_the_data_parallel_size():
    assert [batch_bucket(n) for n in (1, 3, 5)] == [1, 4, 8]
    assert [batch_bucket(n, 2) for n in (1, 3, 5)] == [2, 4, 8]
    assert [batch_bucket(n, 3) for n in (1, 3, 5)] == [3, 6, 9]


# ---- errors -----------------------------------------------------------------------------------------------------


def test_a_wrong_mesh_or_device_count_is_refused_with_what_to_pass():
    path = embedded("target")
    with pytest.raises(ValueError, match=r"tensor_parallel=4 needs 4 devices, but this process sees 1 \(cpu\): use at most 1"):
        specjax.load(path, tensor_parallel=4)
    with pytest.raises(ValueError, match="positive number of devices"):
        specjax.load(path, tensor_parallel=0)
    wrong = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("batch", "tensor"))
    with pytest.raises(ValueError, match=r"mesh axes must be \('data', 'model'\), got \('batch', 'tensor'\)"):
        specjax.load(path, mesh=wrong)
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        specjax.load(path, mesh=(1, 8))
    with pytest.raises(ValueError, match="not both"):
        specjax.load(path, mesh=wrong, tensor_parallel=1)
    with pytest.raises(ValueError, match="pass mesh= or tensor_parallel= with it"):
        specjax.load(path, rules=EXPERT_PARALLEL)
    with pytest.raises(ValueError, match="rules map logical axis names"):
        specjax.load(path, tensor_parallel=1, rules={"heads": "tensor"})


def test_a_one_device_mesh_decodes_as_no_mesh(tmp_path):
    path = save_hf_model(build_hf_model("qwen2", seed=3, num_hidden_layers=1), tmp_path / "m")
    plain, meshed = specjax.load(path), specjax.load(path, tensor_parallel=1)
    assert "mesh={'data': 1, 'model': 1}" in repr(meshed)
    assert isinstance(meshed.params["embed"].sharding, jax.sharding.NamedSharding)
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert specjax.generate(meshed, prompts, **kw).tokens == specjax.generate(plain, prompts, **kw).tokens
    ids = np.asarray([[5, 6, 7, 9]])
    np.testing.assert_allclose(np.asarray(meshed.model(ids)), np.asarray(plain.model(ids)), rtol=1e-5, atol=1e-5)


# ---- 8 fake devices, in a subprocess ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    checks, _ = run_part("dense", tmp_path_factory.mktemp("sharded_dense"))
    return checks


def test_dense_tokens_equal_one_device(dense):
    # per mesh: plain and draft chain; at DP 2 x TP 4 also draft tree, n-gram, sampled, inspect_draft and "auto"
    count, bad = failed(dense, "equals one device")
    assert count == 2 + 2 + 8 and bad == {}
    assert failed(dense, "dense/greedy rows differ")[1] == {} and failed(dense, "sampling differs")[1] == {}


def test_profile_and_auto_run_on_the_mesh(dense):
    # profile() at DP 2 x TP 4: finite positive times under the key device|model|dtype|dp2xtp4, saved beside a
    # one-device entry (written as before: no "mesh" field); "auto" with $SPECJAX_PROFILE at that file plans from
    # the mesh's entry (its tokens are checked above)
    for words in ("profile times finite and positive", "profile keyed by the mesh", "one-device profile entry",
                  "auto planned from the mesh's profile"):
        count, bad = failed(dense, "dense/dp2_tp4/" + words)
        assert count == 1 and bad == {}, words


def test_dense_weights_split_by_the_rules(dense):
    count, bad = failed(dense, "split")  # per mesh: 12 weights, 2 kv caches, prompts, per-row settings
    assert count == 3 * 16 and bad == {}
    count, bad = failed(dense, "replicated")
    assert count == 3 and bad == {}


def test_dense_devices_read_only_their_slices(dense):
    count, bad = failed(dense, "/read ")
    assert count == 3 * 5 and bad == {}


def test_dense_caches_and_prompts_split(dense):
    for words in (("kv cache",), ("prompts split over data",), ("per-row settings",)):
        count, bad = failed(dense, *words)
        assert count >= 3 and bad == {}, words
