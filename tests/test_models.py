"""Logits and greedy-generation parity with Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import FAMILIES, build_hf_model, save_hf_model

import specjax
from specjax.models.cache import KVCache, init_cache
from specjax.models.decoder import Decoder, with_layout
from specjax.models.model import forward, merge

# fp32 everywhere; observed max |diff| is ~1e-5 on logits of magnitude ~10.
LOGIT_ATOL = 2e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request, tmp_path_factory):
    """(family, HF torch model, specjax target loaded straight from the HF directory)."""
    hf_model = build_hf_model(request.param)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))
    return request.param, hf_model, specjax.load(path, layout="per_layer")  # CPU's "auto"; each test sets its own


@pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer", "stacked"])
def test_logits_match_transformers(family_pair, per_layer):
    """The Flax module's plain forward (`target.model(ids)`, what a notebook calls) in either layer layout."""
    _, hf_model, target = family_pair
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, target.cfg.vocab_size, size=(2, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    model = merge(target.cfg, with_layout(target.params, per_layer))
    assert isinstance(model, Decoder) and model.per_layer == per_layer
    chex.assert_trees_all_close(np.asarray(model(tokens, attn_impl="xla")), ref, atol=LOGIT_ATOL, rtol=0)


def test_cached_forward_equals_the_plain_forward(family_pair):
    """Prefill 25 tokens, then the rest one at a time through the cache: the logits of one pass over all 40."""
    _, _, target = family_pair
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, target.cfg.vocab_size, size=(2, 40)), jnp.int32)
    model = target.model
    cache = model.init_cache(2, 64)
    h, _, cache = model.forward(tokens[:, :25], cache, attn_impl="xla")
    steps = [model.logits(h)]
    cache = KVCache(cache.k, cache.v, cache.lengths + 25)
    for t in range(25, 40):
        h, _, cache = model.forward(tokens[:, t:t + 1], cache, attn_impl="xla")
        cache = KVCache(cache.k, cache.v, cache.lengths + 1)
        steps.append(model.logits(h))
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), model(tokens, attn_impl="xla"), atol=1e-4, rtol=0)


def test_hidden_state_capture_matches_hf_numbering(family_pair):
    _, hf_model, target = family_pair
    tokens = np.random.default_rng(1).integers(3, target.cfg.vocab_size, size=(1, 12))
    with torch.no_grad():
        hs = hf_model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    n = target.cfg.num_layers
    model = target.model
    _, captured, _ = model.forward(jnp.asarray(tokens, jnp.int32), model.init_cache(1, 16), capture=(0, 1, n - 1),
                                   attn_impl="xla")
    for got, i in zip(captured, (0, 1, n - 1)):
        np.testing.assert_allclose(np.asarray(got), hs[i].numpy(), atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(family_pair):
    """A ragged batch through specjax equals each prompt generated alone by transformers."""
    _, hf_model, target = family_pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, target.cfg.vocab_size, size=n).tolist() for n in (5, 17, 1, 30)]
    out = specjax.generate(target, prompts, max_new_tokens=32, eos_token_id=[])
    for prompt, got in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert got == ref[0, len(prompt):].tolist()


def test_eos_stops_each_row_where_transformers_does(family_pair):
    _, hf_model, target = family_pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, target.cfg.vocab_size, size=n).tolist() for n in (4, 9)]
    free = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[])
    # Make the 6th generated token of the first row the EOS token: it must stop right there.
    eos = free.tokens[0][5]
    out = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=eos)
    for row_free, row in zip(free.tokens, out.tokens):
        stop = row_free.index(eos) + 1 if eos in row_free else len(row_free)
        assert row == row_free[:stop]
    assert out.tokens[0][-1] == eos and len(out.tokens[0]) <= 6


def test_legacy_config_fields_load_identically(family_pair, tmp_path):
    """Older transformers wrote rope_theta / rope_scaling at top level; both spellings give one config."""
    family, hf_model, target = family_pair
    path = save_hf_model(hf_model, tmp_path / "legacy")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(cfg))
    assert specjax.load(path).cfg == target.cfg


def test_cpu_layout_follows_the_environment(family_pair, monkeypatch):
    """"auto" on CPU: per-layer unless SPECJAX_CPU_LAYOUT says stacked; any other value is refused by name."""
    from specjax.models.target import serving_layout

    params = family_pair[2].params
    for env, per_layer in (("per_layer", True), ("stacked", False)):
        monkeypatch.setenv("SPECJAX_CPU_LAYOUT", env)
        assert merge(family_pair[2].cfg, serving_layout(params)).per_layer == per_layer
    monkeypatch.setenv("SPECJAX_CPU_LAYOUT", "scan")
    with pytest.raises(ValueError, match="SPECJAX_CPU_LAYOUT must be 'per_layer' or 'stacked', got 'scan'"):
        serving_layout(params)


def test_param_and_cache_layouts_agree(family_pair):
    """Stacked params under scan (accelerators), per-layer params with a stacked cache, and per-layer
    params with per-layer cache buffers (CPU) give the same logits and the same cache contents."""
    from specjax.models.cache import commit
    from specjax.models.decoder import stacked_layers

    _, _, target = family_pair
    cfg = target.cfg
    stacked = {**target.params, "layers": stacked_layers(target.params)}
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, cfg.vocab_size, size=(2, 9)), jnp.int32)
    results = []
    for params, per_layer in ((stacked, False), (target.params, False), (target.params, True)):
        h, _, cache = forward(params, cfg, tokens, init_cache(cfg, 2, 16, per_layer=per_layer), attn_impl="xla")
        path = jnp.asarray([[0, 2, 5, 0], [0, 1, 2, 3]], jnp.int32)
        cache = commit(cache, path, jnp.asarray([3, 4], jnp.int32))
        results.append((np.asarray(h), np.stack([np.asarray(x) for x in jax.tree.leaves(cache.k)]).reshape(-1),
                        np.asarray(cache.lengths)))
    for h, k, lengths in results[1:]:
        np.testing.assert_allclose(h, results[0][0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(k, results[0][1], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(lengths, results[0][2])


def test_captures_are_written_by_index_in_every_layout(family_pair):
    """Every layout returns the same captures (duplicates and the pre-norm output included), and under scan
    the capture buffer is updated by one indexed write per layer, not a select over the whole buffer."""
    from specjax.models.decoder import stacked_layers

    _, _, target = family_pair
    cfg = target.cfg
    stacked = {**target.params, "layers": stacked_layers(target.params)}
    tokens = jnp.asarray(np.random.default_rng(5).integers(3, cfg.vocab_size, size=(2, 7)), jnp.int32)
    capture = (cfg.num_layers, 1, 1, 0)
    runs = [forward(params, cfg, tokens, init_cache(cfg, 2, 16, per_layer=per_layer), capture=capture,
                    attn_impl="xla")[1] for params, per_layer in ((stacked, False), (target.params, True))]
    for got in runs[1:]:
        for a, b in zip(got, runs[0]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(runs[0][1]), np.asarray(runs[0][2]))

    text = str(jax.make_jaxpr(lambda p: forward(p, cfg, tokens, init_cache(cfg, 2, 16), capture=capture,
                                                attn_impl="xla")[1])(stacked))
    buffer = re.compile(rf"\[\d+,2,7,{cfg.hidden_size}\]")  # a [captures, B, T, D] array
    assert "scatter" in text
    assert [line for line in text.splitlines() if "select_n" in line and buffer.search(line.replace(" ", ""))] == []
