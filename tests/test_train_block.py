"""DFlash / DSpark head training: training and serving compute the same block; the losses are the originals';
only the head trains; the shipped heads draft losslessly; exports round-trip.

A 4-layer random target (hidden 64, vocabulary 256) and random heads with non-trivial norms, so every
weight matters in the comparisons. The training forward runs several anchors of a sequence in one pass;
each anchor's block must equal the serving drafter after a teacher-forced prefill of the tokens before
it (write_context + block_hidden, and the drafter's own propose) at 1e-5 in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import specjax
from specjax.config import ModelConfig, SamplingConfig
from specjax.convert.export import export, export_dflash, export_dspark
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.drafters import DFlashDrafter, DSparkDrafter, dspark
from specjax.drafters import dflash as dfl
from specjax.models.cache import KVCache
from specjax.models.decoder import unstack_layers
from specjax.models.model import init_params
from specjax.models.target import Target
from specjax.train import block as tb
from specjax.train import trainer
from specjax.train.tiny import llama_hf_config

S = 24
ANCHORS = (3, 9, 14)
TINY = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"
BUDGET = 40_000_000  # bytes: checkpoints/ in all (the brief's limit; issue 18 let the embedded hybrid take it from 25 MB)


@pytest.fixture(scope="module")
def tgt():
    hf = llama_hf_config(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=256)
    tcfg = ModelConfig.from_hf(hf)
    tparams = unstack_layers(init_params(tcfg, jax.random.key(0), scale=0.2))
    return hf, tcfg, tparams


def random_head(family: str, tcfg: ModelConfig, block_size: int, seed: int = 1) -> tuple:
    """(cfg, trainable params) of a 2-layer head with the drafters' test init (norms ~ 1 + 0.1 N, 1/sqrt(fan_in))."""
    cfg = tb.head_config(family, tcfg, target_layer_ids=[0, 2], block_size=block_size, mask_token_id=255,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                         markov_rank=8)
    if family == "dflash":
        return cfg, dfl.init_params(cfg, jax.random.key(seed))
    params = dspark.init_params(cfg, jax.random.key(seed))
    return cfg, {k: v for k, v in params.items() if k not in ("embed", "lm_head", "confidence_temperature")}


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(1, 255, (1, S)), jnp.int32)


def served(drafter, params, taps, tokens, anchors, k):
    """The serving drafter after a prefill of tokens[:a] (one row per anchor a), root tokens[a]: its propose."""
    b = len(anchors)
    lens_B = jnp.asarray(anchors, jnp.int32)
    seq_BS = jnp.broadcast_to(tokens, (b, S))
    feats = tuple(jnp.broadcast_to(f, (b, *f.shape[1:])) for f in taps)
    settings = Settings(chain(k), SamplingConfig(), cache_len=S + 16, max_new_tokens=16, record_logits=True)
    d = drafter.configure(settings)
    root_B = seq_BS[jnp.arange(b), lens_B]
    state = d.init(params, PrefillContext(seq_BS, lens_B, root_B, feats))
    draft, _ = d.propose(params, state, root_B, jax.random.split(jax.random.key(0), b))
    return d, state, root_B, draft


@pytest.mark.parametrize("family", tb.FAMILIES)
def test_training_forward_equals_serving(tgt, tokens, family):
    _, tcfg, tparams = tgt
    k = 5
    cfg, head = random_head(family, tcfg, k)
    block = tb.block_of(cfg)
    frozen = tb.frozen_params(tparams, tcfg)
    full = tb.serving_params(cfg, head, frozen)
    taps, _ = tb.target_taps_and_logits(tparams, tcfg, tokens, block.feature_layers)
    anchors_BA = jnp.asarray([ANCHORS], jnp.int32)
    backbone, vocab = dfl.backbone(block, full), dfl.tables(block, full)
    h_AKH = tb.anchor_hidden(backbone, vocab, taps, tokens, anchors_BA)[0]  # all anchors in one pass
    # serving's methods, one anchor per row: context rows 0..a-1, then the block at a
    b = len(ANCHORS)
    cache = backbone.init_cache(b, S + 16)  # full: stacked layers, as training
    ctx = backbone.context(tuple(jnp.broadcast_to(f, (b, *f.shape[1:])) for f in taps))
    cache = backbone.write_context(ctx, cache, jnp.zeros((b,), jnp.int32))
    cache = KVCache(cache.k, cache.v, jnp.asarray(ANCHORS, jnp.int32))
    roots = tokens[0, jnp.asarray(ANCHORS)]
    h_serve_AKH, _ = backbone.block_hidden(vocab.block_embeddings(roots), cache, attn_impl="xla")
    assert float(jnp.max(jnp.abs(h_serve_AKH))) > 0.5
    np.testing.assert_allclose(h_AKH, h_serve_AKH, atol=1e-5, rtol=1e-5)
    # and the drafter itself (its params layout, its propose)
    if family == "dflash":
        drafter = DFlashDrafter(block, dfl.drafter_params(head, {"embed": tparams["embed"]}, True, True),
                                attn_impl="xla")
        d, _, _, draft = served(drafter, drafter.params, taps, tokens, ANCHORS, k - 1)
        train_logits = vocab.logits(h_AKH[:, 1:])
        np.testing.assert_allclose(draft.logits[:, 1:], train_logits, atol=1e-5, rtol=1e-5)
    else:
        heads = {**{n: v for n, v in head.items() if n.startswith(("markov", "confidence"))},
                 "embed": tparams["embed"], "lm_head": tparams["embed"].T,
                 "confidence_temperature": jnp.ones((k,), jnp.float32)}
        backbone = {n: v for n, v in head.items() if n not in heads}
        drafter = DSparkDrafter(cfg, dspark.drafter_params(backbone, heads, True), attn_impl="xla")
        _, _, _, draft = served(drafter, drafter.params, taps, tokens, ANCHORS, k)
        net = dspark.networks(cfg, full)
        prev_AK = tb.prev_tokens(tokens, anchors_BA, k)[0]
        train_logits_AKV = tb.dspark_logits(net, h_AKH[None], prev_AK[None])[0]
        # row 0: both feed the anchor to the Markov head; later rows: the drafter feeds its own drafts
        np.testing.assert_allclose(draft.logits[:, 1], train_logits_AKV[:, 0], atol=1e-4, rtol=1e-5)
        conf = net.confidence.calibrated(net.confidence_logits(h_AKH, prev_AK))
        np.testing.assert_allclose(draft.confidence[:, 1], conf[:, 0], atol=1e-5)
        teacher = net.markov(vocab.logits(h_serve_AKH)[:, 2], prev_AK[:, 2])
        np.testing.assert_allclose(train_logits_AKV[:, 2], teacher, atol=1e-4, rtol=1e-5)


def test_row_weights_are_the_originals():
    np.testing.assert_allclose(tb.dflash_weights(8, 4.0),
                               [0.0, 1.0, np.exp(-0.25), np.exp(-0.5), np.exp(-0.75), np.exp(-1.0), np.exp(-1.25),
                                np.exp(-1.5)], rtol=1e-6)
    np.testing.assert_allclose(tb.dspark_weights(7), np.exp(-np.arange(7) / 4.0), rtol=1e-6)
    assert tb.default_gamma(16) == 7.0 and tb.default_gamma(8) == 4.0
    with pytest.raises(ValueError, match="pass gamma explicitly"):
        tb.default_gamma(6)


def hand_batch(k: int) -> dict:
    """One sequence with two anchors: one mid-sequence with a label-mask hole, one whose block runs off the end."""
    tokens = np.random.default_rng(2).integers(1, 255, (1, S)).astype(np.int32)
    loss_mask = np.ones((1, S), np.float32)
    loss_mask[0, :4] = 0.0  # the prompt
    loss_mask[0, 8] = 0.0  # a hole inside the first block's labels
    return {"tokens": tokens, "loss_mask": loss_mask, "anchors": np.asarray([[6, S - 3]], np.int32),
            "keep": np.ones((1, 2), np.float32)}


def test_dflash_loss_by_hand(tgt):
    _, tcfg, tparams = tgt
    k = 5
    cfg, head = random_head("dflash", tcfg, k)
    frozen = tb.frozen_params(tparams, tcfg)
    batch = hand_batch(k)
    taps, target_SV = tb.target_taps_and_logits(tparams, tcfg, jnp.asarray(batch["tokens"]), cfg.feature_layers)
    full = tb.serving_params(cfg, head, frozen)
    vocab = dfl.tables(cfg, {"embed": tparams["embed"]})
    h = tb.anchor_hidden(dfl.backbone(cfg, full), vocab, taps, jnp.asarray(batch["tokens"]),
                         jnp.asarray(batch["anchors"]))
    logq = np.asarray(jax.nn.log_softmax(vocab.logits(h[0]), axis=-1), np.float64)
    p_target = np.asarray(jax.nn.softmax(target_SV[0], axis=-1), np.float64)
    t = batch["tokens"][0]
    for objective in ("hard", "soft"):
        num = den = 0.0
        for i, a in enumerate(batch["anchors"][0]):
            for j in range(1, k):  # row j predicts t[a + j]; the anchor row is not a prediction
                if a + j >= S or batch["loss_mask"][0, a + j] == 0:
                    continue  # a hole does not stop later rows (SpecForge's mask is not cumulative)
                ce = -logq[i, j, t[a + j]] if objective == "hard" else -np.sum(p_target[a + j - 1] * logq[i, j])
                w = np.exp(-(j - 1) / 4.0)  # gamma = 4, passed to dflash_loss below
                num, den = num + w * ce, den + w
        loss, metrics = tb.dflash_loss(cfg, tcfg, gamma=4.0, objective=objective)(head, batch, frozen)
        np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)
    assert float(metrics["tokens"]) == 4 - 1 + 2  # anchor 6: rows 1, 3, 4 (row 2 = position 8 masked); 21: rows 1, 2


def test_dspark_loss_by_hand(tgt):
    _, tcfg, tparams = tgt
    k = 5
    cfg, head = random_head("dspark", tcfg, k)
    frozen = tb.frozen_params(tparams, tcfg)
    net = dspark.networks(cfg, tb.serving_params(cfg, head, frozen))
    batch = hand_batch(k)
    tok = jnp.asarray(batch["tokens"])
    taps, target_SV = tb.target_taps_and_logits(tparams, tcfg, tok, cfg.block.feature_layers)
    h = tb.anchor_hidden(net.backbone, net.tables, taps, tok, jnp.asarray(batch["anchors"]))
    prev = tb.prev_tokens(tok, jnp.asarray(batch["anchors"]), k)
    logits = np.asarray(tb.dspark_logits(net, h, prev)[0], np.float64)
    conf = np.asarray(net.confidence_logits(h[0].reshape(2 * k, -1), prev[0].reshape(-1)).reshape(2, k),
                      np.float64)
    t = batch["tokens"][0]
    p_target = np.asarray(jax.nn.softmax(target_SV[0], axis=-1), np.float64)
    sums, den = np.zeros(3), 0.0
    for i, a in enumerate(batch["anchors"][0]):
        for j in range(k):  # row j predicts t[a + j + 1]; stop at the first unsupervised label (contiguous)
            label = a + j + 1
            if label >= S or batch["loss_mask"][0, label] == 0:
                break
            z = logits[i, j] - logits[i, j].max()
            logq = z - np.log(np.exp(z).sum())
            l1 = np.abs(np.exp(logq) - p_target[label - 1]).sum()
            y = np.clip(1 - 0.5 * l1, 0, 1)
            c = conf[i, j]
            bce = max(c, 0) - c * y + np.log1p(np.exp(-abs(c)))
            w = np.exp(-j / 4.0)
            sums += w * np.asarray([-logq[t[label]], l1, bce])
            den += w
    want = 0.1 * sums[0] / den + 0.9 * sums[1] / den + 1.0 * sums[2] / den
    loss, metrics = tb.dspark_loss(cfg, tcfg)(head, batch, frozen)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["tokens"]) == 1 + 2  # anchor 6: row 0 only (label 8 masked); anchor 21: rows 0, 1


@pytest.mark.parametrize("family", tb.FAMILIES)
def test_only_the_head_trains(tgt, tmp_path, family):
    _, tcfg, tparams = tgt
    k = 8 if family == "dflash" else 7  # the shipped heads' blocks (DFlash's gamma 4 is the paper's for 8)
    cfg = tb.head_config(family, tcfg, target_layer_ids=[0, 2], block_size=k, mask_token_id=255, head_dim=16,
                         num_heads=4, num_kv_heads=2, intermediate_size=96)
    head = tb.init_head(cfg, jax.random.key(3))
    frozen = tb.frozen_params(tparams, tcfg)
    frozen_before = trainer.host(frozen)
    head_before = trainer.host(head)
    seq = np.random.default_rng(4).integers(1, 255, (2, S)).astype(np.int32)
    mask = np.zeros((2, S - 1), bool)
    mask[:, 6:] = True
    batch = tb.block_batch(family, seq, mask, block_size=k, num_anchors=4, seed=0, step=0)
    assert batch["keep"].all() and (batch["anchors"] >= 7).all()
    tc = trainer.TrainConfig(steps=2, peak_lr=1e-2, warmup_steps=1, weight_decay=0.0, log_every=1,
                             eval_every=1000, ckpt_every=1000)
    state = trainer.train(tmp_path / "run", tc, head, tb.block_loss(cfg, tcfg), lambda step: batch, frozen=frozen,
                          desc=family)
    assert jax.tree.structure(state["params"]) == jax.tree.structure(head)
    assert not {"embed", "lm_head", "target"} & set(state["params"])
    for before, after in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(trainer.host(frozen))):
        np.testing.assert_array_equal(before, after)  # bitwise: the target and its tables are not trained
    for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(head_before),
                                     jax.tree.leaves(trainer.host(state["params"]))):
        assert not np.array_equal(before, after), f"{jax.tree_util.keystr(path)} did not train"


@pytest.mark.parametrize("family", tb.FAMILIES)
def test_written_head_loads_with_the_same_draft_logits(tgt, tokens, tmp_path, family):
    hf, tcfg, tparams = tgt
    target = Target(tparams, tcfg, hf, attn_impl="xla")
    k = 5
    cfg, head = random_head(family, tcfg, k)
    if family == "dflash":
        out = export_dflash(cfg, head, tmp_path / "head", num_target_layers=4, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [0, 2]
        full = tb.serving_params(cfg, head, tb.frozen_params(tparams, tcfg))
    else:
        full = {**head, "embed": tparams["embed"], "lm_head": tparams["embed"].T}
        out = export_dspark(cfg, full, tmp_path / "head", num_target_layers=4, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 8
    names = set(load_file(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert ("embed_tokens.weight" in names) == (family == "dspark")
    drafter = specjax.load_drafter(out, target)
    block = tb.block_of(cfg)
    taps, _ = tb.target_taps_and_logits(tparams, tcfg, tokens, block.feature_layers)
    serving = tb.serving_params(cfg, head, tb.frozen_params(tparams, tcfg))
    vocab = dfl.tables(block, {"embed": tparams["embed"]})
    h = tb.anchor_hidden(dfl.backbone(block, serving), vocab, taps, tokens, jnp.asarray([ANCHORS], jnp.int32))[0]
    n = k - 1 if family == "dflash" else k
    _, _, _, draft = served(drafter, drafter.params, taps, tokens, ANCHORS, n)
    want = vocab.logits(h)
    if family == "dflash":
        np.testing.assert_allclose(draft.logits[:, 1:], want[:, 1:], atol=1e-5, rtol=1e-5)
    else:
        want0 = dspark.networks(cfg, serving).markov(want[:, 0], tokens[0, jnp.asarray(ANCHORS)])
        np.testing.assert_allclose(draft.logits[:, 1], want0, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- the shipped heads for the embedded target


@pytest.fixture(scope="module")
def embedded():
    for family in tb.FAMILIES:
        if not (TINY / family / "config.json").is_file():
            pytest.fail(f"checkpoints/tiny/{family} is missing: run python scripts/train_block.py --family {family}")
    return specjax.load(TINY / "target")


@pytest.mark.parametrize("family", tb.FAMILIES)
def test_shipped_head_drafts_losslessly(embedded, family):
    drafter = specjax.load_drafter(TINY / family, embedded)
    assert isinstance(drafter, DFlashDrafter if family == "dflash" else DSparkDrafter)
    assert drafter.max_draft_tokens == 7
    prompts = [p["text"] for p in json.loads((TINY / "manifest.json").read_text())["held_out_prompts"][:2]]
    plain = specjax.generate(embedded, prompts, max_new_tokens=16)
    spec = specjax.generate(embedded, prompts, max_new_tokens=16, drafter=drafter, num_draft_tokens=7)
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_length"] > 1.3  # a trained head: random drafts would give ~1.0


def test_shipped_heads_fit_the_budget_and_are_recorded():
    manifest = json.loads((TINY / "manifest.json").read_text())
    for family in tb.FAMILIES:
        entry = manifest["heads"][family]
        assert entry["acceptance"]["num_draft_tokens"] == 7 and entry["acceptance"]["outputs_equal_plain_greedy"]
        assert entry["acceptance_by_chain"]["chain_7"] == entry["acceptance"]
        assert entry["dtype"] == "bfloat16"
        names = set(load_file(TINY / family / "model.safetensors"))
        assert not {"embed_tokens.weight", "lm_head.weight"} & names  # the target's tables are never stored
    assert "ece_fit_after" in manifest["heads"]["dspark"]["calibration"]
    total = sum(p.stat().st_size for p in (TINY.parent).rglob("*") if p.is_file())
    assert total < BUDGET


def test_shipped_heads_export_round_trip(embedded, tmp_path):
    for family in tb.FAMILIES:
        out = export(TINY / family, tmp_path / family, dtype="float32")  # DSpark: tables from its ../target
        config = json.loads((out / "config.json").read_text())
        assert not any(key.startswith("specjax") for key in config)
        names = set(load_file(out / "model.safetensors"))
        assert ("embed_tokens.weight" in names and "lm_head.weight" in names) == (family == "dspark")
        shipped = specjax.load_drafter(TINY / family, embedded)
        exported = specjax.load_drafter(out, embedded)
        prompt = json.loads((TINY / "manifest.json").read_text())["held_out_prompts"][0]["text"]
        settings = Settings(chain(7), SamplingConfig(), cache_len=64, max_new_tokens=16, record_logits=True)
        ids = jnp.asarray([embedded.tokenizer.encode(prompt).ids[:12]], jnp.int32)
        taps, _ = tb.target_taps_and_logits(embedded.params, embedded.cfg, ids, shipped.feature_layers)
        logits = []
        for d in (shipped, exported):
            d = d.configure(settings)
            root = ids[:, -1]
            state = d.init(d.params, PrefillContext(ids, jnp.asarray([11], jnp.int32), root, taps))
            draft, _ = d.propose(d.params, state, root, jax.random.split(jax.random.key(0), 1))
            logits.append(draft.logits)
        np.testing.assert_allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)
