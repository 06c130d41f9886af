"""Every network is a Flax NNX module: its weights nnx.Params naming their axes, usable from a notebook."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.config import ModelConfig
from specjax.loading.embedded import EMBEDDED_DIR
from specjax.models.decoder import Decoder, with_layout
from specjax.models.model import merge, param_shapes
from specjax.models.state import to_params

AXES = {"embed", "heads", "kv_heads", "mlp", "vocab", "layers", None}
HEADS = ("draft", "eagle3", "mtp", "dflash", "dspark")


@pytest.fixture(scope="module")
def target():
    return specjax.load(EMBEDDED_DIR / "target", layout="per_layer")  # what "auto" gives on a CPU


@pytest.fixture(scope="module")
def drafters(target):
    return {name: specjax.load_drafter(EMBEDDED_DIR / name, target) for name in HEADS}


def params_of(module: nnx.Module):
    return [(path, v) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]


def test_every_weight_names_its_axes(target, drafters):
    """Logical axis names on every Param (one per dimension), so a mesh can map them without renaming."""
    named = [("target", target.model)] + [(k, m) for k, d in drafters.items() for m in modules_of(d)]
    for name, module in named:
        found = params_of(module)
        assert found, name
        for path, var in found:
            axes = var.get_metadata()["out_sharding"]
            assert len(axes) == var[...].ndim and set(axes) <= AXES, (name, path, axes, var[...].shape)


def test_stacked_layers_name_their_layer_axis(target):
    model = merge(target.cfg, with_layout(target.params, per_layer=False))
    assert not model.per_layer
    for path, var in params_of(model.layers):
        assert var.get_metadata()["out_sharding"][0] == "layers", path


def test_params_are_the_modules_state_without_a_copy(target):
    """target.params is the module's state as a plain dict; target.model holds those very arrays."""
    model = target.model
    assert isinstance(model, Decoder) and model.per_layer  # the CPU layout
    chex.assert_trees_all_equal_structs(to_params(model), target.params)
    assert model.embed[...] is target.params["embed"]
    assert model.layers[1].wq[...] is target.params["layers"][1]["wq"]


def test_notebook_forward_agrees_with_generate(target, capsys):
    """`target.model(ids)` is a plain forward: its last-position argmax is generate's first greedy token."""
    ids = target.encode("def fibonacci(n):\n")
    logits_BTV = target.model(jnp.asarray([ids]))
    chex.assert_shape(logits_BTV, (1, len(ids), target.cfg.vocab_size))
    first = specjax.generate(target, [ids], max_new_tokens=1).tokens[0][0]
    assert int(jnp.argmax(logits_BTV[0, -1])) == first
    nnx.display(target.model.final_norm)
    assert capsys.readouterr().out


def test_random_init_comes_from_rngs():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, qkv_bias=True, qk_norm=True)
    a, b = (to_params(Decoder(cfg, rngs=nnx.Rngs(s))) for s in (0, 0))
    chex.assert_trees_all_equal(a, b)
    other = to_params(Decoder(cfg, rngs=nnx.Rngs(1)))
    assert not np.array_equal(a["embed"], other["embed"])
    assert jax.tree.map(lambda x: tuple(x.shape), a) == param_shapes(cfg)
    np.testing.assert_array_equal(a["layers"]["bq"], 0)
    np.testing.assert_array_equal(a["layers"]["q_norm"], 1)


def modules_of(drafter) -> list[nnx.Module]:
    model = drafter.model
    return [m for m in model if isinstance(m, nnx.Module)] if isinstance(model, tuple) else [model]


def test_a_drafters_modules_hold_its_params(drafters):
    """Each learned drafter exposes its network (`drafter.model`) over the very arrays of its params."""
    for name, drafter in drafters.items():
        held = {id(x) for x in jax.tree.leaves(drafter.params)}
        for module in modules_of(drafter):
            leaves = jax.tree.leaves(to_params(module))
            assert leaves and all(id(x) in held for x in leaves), name
