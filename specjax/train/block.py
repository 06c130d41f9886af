"""Training DFlash and DSpark heads: the block backbone over many anchors in one dense pass, and their losses.

One training example is a token sequence t_0..t_{S-1} the target generated itself (a prompt and
its greedy continuation). The frozen target's serving forward gives the taps g_p at every
position (`models.decoder.forward(..., capture=feature_layers)`, what prefill computes) and its
next-token logits z_p. Per sequence, A anchors a_1..a_A are drawn at random (numpy, from the
batch's seed and step, so batches are pure functions of the step). Anchor i's block
[t_{a_i}, MASK x (K - 1)] sits at positions a_i .. a_i + K - 1 and, in every drafter layer,
attends to

    the context rows p < a_i:  K/V of c_p = hidden_norm(fc(taps_p)) projected by that layer's own
                               wk / wv, k_norm and RoPE at p, no input norm  (serving's write_context)
    its own K rows, bidirectionally                                          (serving's block_hidden)

and never to another anchor's block. All A blocks of a sequence run in one pass: queries
[A*K], keys [S + A*K] (the context rows once, then every block), one boolean mask [A*K, S + A*K].
The layer math is the decoder's (`project_qkv` for the context, `qkv` / `attn_out_and_mlp` for
the block), so the hidden states of an anchor equal serving's `write_context` + `block_hidden`
after a prefill of t_0..t_{a-1} with root t_a (tests/test_train_block.py, 1e-5 in fp32).

DFlash (z-lab/dflash; its training recipe is the paper's Eq. 4, as SpecForge implements it):
block row j = 1..K-1 predicts t_{a+j}; the anchor row is not a prediction. Loss: cross-entropy
weighted w_j = exp(-(j - 1) / gamma), gamma 7 for K = 16, 5 for K = 10, 4 for K = 8 (the paper's
suggestions, `DFLASH_GAMMA`), over rows whose label is a generated token inside the sequence,
divided by the summed weights. Anchors: generated tokens a with a + K <= S (full blocks).
`objective="soft"` (the shipped head's) replaces the hard label by the target's distribution of
t_{a+j} given the true prefix (softmax z_{a+j-1}): on the target's own greedy continuations the
hard label is that distribution's argmax, so the soft cross-entropy (= KL(target || draft) + a
constant) carries the same top-1 and the target's whole ranking besides: more signal per row for
a small head on little data (specjax.train.mtp measured the same choice: higher chain tau).

DSpark (deepseek-ai/DeepSpec, modeling/dspark/qwen3 + loss.py): block row k = 0..K-1 predicts
t_{a+k+1} (the anchor row too: K drafts). Markov logits with teacher forcing,

    logits_k = lm_head(h_k) + W2 W1[x_{k-1}],     x_{-1} = t_a (the anchor), x_{k-1} = t_{a+k} after,

and the confidence head's logit on [h_k; W1[x_{k-1}]]. With p_k = softmax(logits_k) and
q_k = the target's distribution of t_{a+k+1} (softmax z_{a+k}), per row:

    ce   = -log p_k(t_{a+k+1})
    l1   = sum_v |p_k(v) - q_k(v)|                     (DeepSpec's "l1_loss": the full L1, 2 x TV)
    bce  = BCE(confidence logit, y),  y = clip(1 - 0.5 l1, 0, 1), no gradient through y
    loss = 0.1 mean_w(ce) + 0.9 mean_w(l1) + 1.0 mean_w(bce),    w_k = exp(-k / 4)

mean_w: weighted by w_k over the supervised rows, divided by their summed weights. Supervised
rows (DeepSpec's eval_mask): the label lies inside the sequence and is a generated token, and so
do all earlier rows of the block (a contiguous prefix). Anchors: generated tokens a whose next
token is generated too. DSpark's embed / lm_head are frozen copies of the target's (here the
target's arrays themselves, outside the trainable tree, as the z-lab DFlash head's).

What trains: the block backbone (fc, hidden_norm, layers, final_norm) and DSpark's Markov and
confidence heads. The target and its tables are the loss's `frozen` argument, never given to
the optimizer.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.config import ModelConfig, RopeConfig
from specjax.drafters import dflash, dspark
from specjax.drafters.dflash import BlockBackbone, BlockConfig, Tables
from specjax.models.cache import KVCache
from specjax.models.decoder import run_layers
from specjax.models.layers import rms_norm, rope_inv_freq
from specjax.models.model import sequence_forward
from specjax.train.losses import LossFn
from specjax.train.model import NEG_INF

FAMILIES = ("dflash", "dspark")
OBJECTIVES = ("soft", "hard")
DFLASH_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the DFlash paper's loss-decay gamma by block size (Eq. 4)
DSPARK_DECAY = 4.0  # DeepSpec's loss_decay_gamma: weight exp(-k / 4), k = 0..K-1
DSPARK_ALPHAS = (0.1, 0.9, 1.0)  # DeepSpec's ce_loss_alpha, l1_loss_alpha, confidence_head_alpha


# ---- configs and params ------------------------------------------------------------------------------------


def layer_config(target: ModelConfig, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, dtype: str = "float32") -> ModelConfig:
    """The drafter's Qwen3-style decoder layers on `target`: its width, vocabulary, RoPE base and norm epsilon."""
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                       intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=target.rms_norm_eps,
                       rope=RopeConfig(theta=target.rope.theta), qkv_bias=False, qk_norm=True, family="qwen3",
                       max_position_embeddings=target.max_position_embeddings, dtype=dtype)


def head_config(family: str, target: ModelConfig, *, target_layer_ids: Sequence[int], block_size: int,
                mask_token_id: int, num_layers: int = 1, num_heads: int = 2, num_kv_heads: int = 1,
                head_dim: int = 64, intermediate_size: int = 192, markov_rank: int = 8,
                confidence: bool = True, dtype: str = "float32") -> BlockConfig | dspark.DSparkConfig:
    """A BlockConfig (dflash) or DSparkConfig (dspark, confidence head on [h; W1[x]]) for a new head on `target`.

    target_layer_ids use the originals' numbering (HF hidden_states[id + 1]); the target's last layer
    (id L - 1) is refused, as both readers refuse it.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    ids = tuple(int(i) for i in target_layer_ids)
    if not ids or any(not 0 <= i <= target.num_layers - 2 for i in ids) or list(ids) != sorted(set(ids)):
        raise ValueError(f"target_layer_ids {list(ids)} must be strictly increasing layer ids in "
                         f"0..{target.num_layers - 2} (the last layer's output is never a tap)")
    layers = layer_config(target, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, intermediate_size=intermediate_size, dtype=dtype)
    block = BlockConfig(layers=layers, target_layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id)
    if family == "dflash":
        return block
    return dspark.DSparkConfig(block=block, markov_rank=markov_rank, confidence=confidence,
                               confidence_with_markov=confidence and markov_rank > 0)


def block_of(cfg: BlockConfig | dspark.DSparkConfig) -> BlockConfig:
    """The backbone's BlockConfig of either family's config."""
    return cfg.block if isinstance(cfg, dspark.DSparkConfig) else cfg


def init_head(cfg: BlockConfig | dspark.DSparkConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Trainable params (stacked layers): matrices normal(0, scale), norms ones, biases zero (HF's init).

    At init a row's hidden is mostly its own input embedding, so the tied lm_head scores that token
    (MASK, or the anchor) far above the rest: first cross-entropies are ~40-50 nats; warm-up absorbs it.

    DFlash: the BlockBackbone. DSpark: the backbone plus the MarkovHead and the ConfidenceHead's Params;
    never its Tables (frozen: the target's) or its confidence temperatures (a Calibration, fitted after).
    """
    rngs = nnx.Rngs(params=key)
    modules = [BlockBackbone(block_of(cfg), rngs=rngs, scale=scale)]
    if isinstance(cfg, dspark.DSparkConfig):
        modules.append(dspark.MarkovHead(cfg, rngs=rngs, scale=scale))
        if cfg.confidence:
            modules.append(dspark.ConfidenceHead(cfg, rngs=rngs, scale=scale))
    return {k: v for m in modules for k, v in nnx.to_pure_dict(nnx.state(m, nnx.Param)).items()}


def frozen_params(target_params: dict, target_cfg: ModelConfig) -> dict:
    """The loss's `frozen` pytree: the target's params and the tables the head borrows (the same arrays)."""
    frozen = {"target": target_params, "embed": target_params["embed"]}
    if not target_cfg.tie_word_embeddings:
        frozen["lm_head"] = target_params["lm_head"]
    return frozen


def serving_params(cfg: BlockConfig | dspark.DSparkConfig, trainable: dict, frozen: dict) -> dict:
    """What the serving drafter runs: the trained weights plus the target's embed (and lm_head when untied).

    DSpark also gets confidence temperatures of 1 (uncalibrated). A tied target's lm_head is its
    embedding, which `Tables.logits` reads when there is no `lm_head`.
    """
    params = {**trainable, **{k: frozen[k] for k in ("embed", "lm_head") if k in frozen}}
    if isinstance(cfg, dspark.DSparkConfig) and cfg.confidence:
        params["confidence_temperature"] = jnp.ones((cfg.block_size,), jnp.float32)
    return params


def num_params(tree) -> int:
    """Parameter count of a pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# ---- batches: sequences and random anchors -----------------------------------------------------------------


def token_loss_mask(label_mask_BT: np.ndarray) -> np.ndarray:
    """[B, S] from `data.continuations`' label mask [B, S - 1]: 1 where token p is a generated token."""
    label_mask_BT = np.asarray(label_mask_BT, bool)
    return np.concatenate([np.zeros_like(label_mask_BT[:, :1]), label_mask_BT], axis=1)


def anchor_candidates(family: str, loss_mask_BS: np.ndarray, block_size: int) -> np.ndarray:
    """[B, S] bool: where an anchor may sit. DFlash (SpecForge's sampler): a generated token with a full block
    inside the sequence (a + K <= S). DSpark (DeepSpec's): a generated token followed by a generated token."""
    lm = np.asarray(loss_mask_BS, bool)
    s = lm.shape[1]
    ok = lm.copy()
    if family == "dflash":
        ok[:, max(s - block_size + 1, 0):] = False
    else:
        ok[:, :-1] &= lm[:, 1:]
        ok[:, -1] = False
    return ok


def sample_anchors(family: str, loss_mask_BS: np.ndarray, block_size: int, num_anchors: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(anchors int32 [B, A] sorted, keep bool [B, A]): A distinct random candidates per row; rows with fewer
    candidates keep them all and pad with anchor 0, keep False (masked out of the loss)."""
    ok_BS = anchor_candidates(family, loss_mask_BS, block_size)
    b = ok_BS.shape[0]
    anchors_BA = np.zeros((b, num_anchors), np.int32)
    keep_BA = np.zeros((b, num_anchors), bool)
    for i in range(b):
        cand = np.flatnonzero(ok_BS[i])
        pick = np.sort(rng.permutation(cand)[:num_anchors])
        anchors_BA[i, : len(pick)] = pick
        keep_BA[i, : len(pick)] = True
    return anchors_BA, keep_BA


def block_batch(family: str, tokens_BS: np.ndarray, label_mask_BT: np.ndarray, *, block_size: int,
                num_anchors: int, seed: int, step: int) -> dict[str, np.ndarray]:
    """A training batch from `data.continuations` output: tokens [B, S], loss_mask [B, S], anchors / keep [B, A]
    drawn from (seed, step), so a resumed run sees the same anchors."""
    loss_mask_BS = token_loss_mask(label_mask_BT)
    anchors_BA, keep_BA = sample_anchors(family, loss_mask_BS, block_size, num_anchors,
                                         np.random.default_rng([seed, step, 17]))
    return {"tokens": np.asarray(tokens_BS, np.int32), "loss_mask": loss_mask_BS.astype(np.float32),
            "anchors": anchors_BA, "keep": keep_BA.astype(np.float32)}


# ---- the training-time forward -----------------------------------------------------------------------------


def target_taps_and_logits(target_params: dict, target_cfg: ModelConfig, tokens_BS: jax.Array,
                           feature_layers: Sequence[int]) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """The target's serving forward over whole sequences: (taps [B, S, H] each, next-token logits [B, S, V] fp32).

    A fresh cache of length S, positions 0..S-1, causal: what prefill computes.
    """
    _, taps, logits_BSV = sequence_forward(target_params, target_cfg, tokens_BS, tuple(feature_layers))
    return taps, logits_BSV


def anchor_layout(anchors_BA: jax.Array, block_size: int, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """(positions [B, N], mask [B, N, S + N]) of A blocks, N = A*K: block i's rows sit at a_i .. a_i + K - 1 and
    see the context rows p < a_i and their own block's K rows (keys: the S context rows, then every block)."""
    b, a = anchors_BA.shape
    n = a * block_size
    positions_BN = (anchors_BA[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)).reshape(b, n)
    ctx_BAS = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :] < anchors_BA[:, :, None]
    ctx_BNS = jnp.repeat(ctx_BAS, block_size, axis=1)
    block_id_N = jnp.arange(n) // block_size
    own_BNN = jnp.broadcast_to(block_id_N[:, None] == block_id_N[None, :], (b, n, n))
    return positions_BN, jnp.concatenate([ctx_BNS, own_BNN], axis=-1)


def masked_attention(q_BNHD: jax.Array, k_BTGD: jax.Array, v_BTGD: jax.Array, mask_BNT: jax.Array) -> jax.Array:
    """GQA attention of N queries over T keys under a boolean mask [B, N, T]; fp32 softmax, K/V never repeated."""
    b, n, h, d = q_BNHD.shape
    g = k_BTGD.shape[2]
    q_BNGRD = q_BNHD.reshape(b, n, g, h // g, d)
    logits_BGRNT = jnp.einsum("bngrd,btgd->bgrnt", q_BNGRD, k_BTGD,
                              preferred_element_type=jnp.float32) / math.sqrt(d)
    logits_BGRNT = jnp.where(mask_BNT[:, None, None], logits_BGRNT, NEG_INF)
    probs_BGRNT = jax.nn.softmax(logits_BGRNT, axis=-1).astype(v_BTGD.dtype)
    return jnp.einsum("bgrnt,btgd->bngrd", probs_BGRNT, v_BTGD).reshape(b, n, h, d)


def block_forward(backbone: BlockBackbone, ctx_BSH: jax.Array, emb_BNH: jax.Array, positions_BN: jax.Array,
                  mask_BNT: jax.Array) -> jax.Array:
    """Final-normed hidden states [B, N, H] of N block rows over S context rows (see the module docstring).

    Per layer: the context's K/V by `project_qkv` at positions 0..S-1 (no input norm, as write_context),
    the block's q/K/V by `qkv` at positions_BN, attention under mask_BNT, then `attn_out_and_mlp`.
    """
    b, s, _ = ctx_BSH.shape
    lc = backbone.cfg.layers
    inv_freq = rope_inv_freq(lc.rope, lc.head_dim)
    ctx_positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))

    def layer_fn(layer, i, idx, h_BNH, k_cache, v_cache, extra):
        _, k_ctx_BSGD, v_ctx_BSGD = layer.project_qkv(ctx_BSH, ctx_positions_BS, inv_freq)
        q_BNHD, k_BNGD, v_BNGD = layer.qkv(h_BNH, positions_BN, inv_freq)
        o_BNHD = masked_attention(q_BNHD, jnp.concatenate([k_ctx_BSGD, k_BNGD], axis=1),
                                  jnp.concatenate([v_ctx_BSGD, v_BNGD], axis=1), mask_BNT)
        return layer.attn_out_and_mlp(h_BNH, o_BNHD), k_cache, v_cache, extra

    no_cache = KVCache(None, None, None)  # the K/V live in this pass only: nothing to carry between layers
    h_BNH, _, _ = run_layers(backbone.layers, emb_BNH.astype(backbone.fc[...].dtype), no_cache, layer_fn)
    return rms_norm(h_BNH, backbone.final_norm[...], lc.rms_norm_eps)


def anchor_hidden(backbone: BlockBackbone, tables: Tables, taps: Sequence[jax.Array], tokens_BS: jax.Array,
                  anchors_BA: jax.Array) -> jax.Array:
    """[B, A, K, H]: every anchor's block [t_a, MASK x (K - 1)] run over the sequence's context, in one pass.

    tables: the serving tables (the target's embed); taps: the target's tap features [B, S, H] at every position.
    """
    cfg = backbone.cfg
    b, s = tokens_BS.shape
    a, k = anchors_BA.shape[1], cfg.block_size
    ids_BAK = jnp.full((b, a, k), cfg.mask_token_id, jnp.int32)
    ids_BAK = ids_BAK.at[:, :, 0].set(jnp.take_along_axis(tokens_BS, anchors_BA, axis=1))
    positions_BN, mask_BNT = anchor_layout(anchors_BA, k, s)
    h_BNH = block_forward(backbone, backbone.context(taps), tables.embed[...][ids_BAK.reshape(b, a * k)],
                          positions_BN, mask_BNT)
    return h_BNH.reshape(b, a, k, -1)


def gather_rows(x_BS: jax.Array, idx_BAK: jax.Array) -> jax.Array:
    """x[b, idx[b, a, k]] for x [B, S, ...]: [B, A, K, ...] (indices clipped into the sequence)."""
    b, a, k = idx_BAK.shape
    idx = jnp.clip(idx_BAK, 0, x_BS.shape[1] - 1).reshape(b, a * k)
    rows = jnp.take_along_axis(x_BS, idx.reshape(b, a * k, *([1] * (x_BS.ndim - 2))), axis=1)
    return rows.reshape(b, a, k, *x_BS.shape[2:])


def dspark_logits(net: dspark.DSparkNetworks, h_BAKH: jax.Array, prev_BAK: jax.Array) -> jax.Array:
    """Teacher-forced DSpark logits [B, A, K, V] (fp32): lm_head(h_k) + W2 W1[x_{k-1}] (serving's modules)."""
    b, a, k, h = h_BAKH.shape
    u_NV = net.tables.logits(h_BAKH.reshape(1, b * a * k, h))[0]
    return net.markov(u_NV, prev_BAK.reshape(-1)).reshape(b, a, k, -1)


def prev_tokens(tokens_BS: jax.Array, anchors_BA: jax.Array, block_size: int) -> jax.Array:
    """[B, A, K]: the token before each DSpark row's label, teacher-forced: t_a, t_{a+1}, ..., t_{a+K-1}."""
    return gather_rows(tokens_BS, anchors_BA[:, :, None] + jnp.arange(block_size))


# ---- losses ------------------------------------------------------------------------------------------------


def dflash_weights(block_size: int, gamma: float) -> np.ndarray:
    """DFlash's row weights [K]: 0 for the anchor row, exp(-(j - 1) / gamma) for row j >= 1."""
    j = np.arange(block_size, dtype=np.float64)
    return np.where(j >= 1, np.exp(-(j - 1) / gamma), 0.0).astype(np.float32)


def dspark_weights(block_size: int, decay: float = DSPARK_DECAY) -> np.ndarray:
    """DSpark's row weights [K]: exp(-k / decay), k = 0..K-1 (every row is a draft)."""
    return np.exp(-np.arange(block_size, dtype=np.float64) / decay).astype(np.float32)


def default_gamma(block_size: int) -> float:
    """The DFlash paper's gamma for a block size (7 / 5 / 4 for 16 / 10 / 8); others must be given."""
    if block_size not in DFLASH_GAMMA:
        raise ValueError(f"no published DFlash loss-decay gamma for block_size {block_size} (the paper gives "
                         f"{DFLASH_GAMMA}); pass gamma explicitly")
    return DFLASH_GAMMA[block_size]


@functools.lru_cache(maxsize=None)
def dflash_loss(cfg: BlockConfig, target_cfg: ModelConfig, gamma: float | None = None,
                objective: str = "soft") -> LossFn:
    """DFlash's loss hook: `loss_fn(head_params, batch, frozen) -> (weighted CE, metrics)`.

    batch: block_batch output; frozen: frozen_params(target). Row j >= 1 of anchor a is scored against
    t_{a+j} (hard) or the target's distribution of it (soft), weight exp(-(j-1)/gamma) x supervised.
    Metrics: acc_j (draft top-1 == t_{a+j}, the target's greedy token) per row, ce, tokens (rows counted).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    k = cfg.block_size
    w_K = jnp.asarray(dflash_weights(k, default_gamma(k) if gamma is None else gamma))

    def loss_fn(params: dict, batch: dict, frozen: dict):
        """Weighted CE of every anchor's rows 1..K-1 (see dflash_loss)."""
        tokens_BS, anchors_BA = batch["tokens"], batch["anchors"]
        taps, target_BSV = jax.lax.stop_gradient(
            target_taps_and_logits(frozen["target"], target_cfg, tokens_BS, cfg.feature_layers))
        full = serving_params(cfg, params, frozen)
        vocab = dflash.tables(cfg, full)
        h_BAKH = anchor_hidden(dflash.backbone(cfg, full), vocab, taps, tokens_BS, anchors_BA)
        b, a = anchors_BA.shape
        logits_BAKV = vocab.logits(h_BAKH.reshape(b, a * k, -1)).reshape(b, a, k, -1)
        label_idx_BAK = anchors_BA[:, :, None] + jnp.arange(k)
        inside_BAK = label_idx_BAK < tokens_BS.shape[1]
        supervised_BAK = (batch["keep"][:, :, None] * inside_BAK * gather_rows(batch["loss_mask"], label_idx_BAK)
                          * (jnp.arange(k) >= 1))
        labels_BAK = gather_rows(tokens_BS, label_idx_BAK)
        logq_BAKV = jax.nn.log_softmax(logits_BAKV, axis=-1)
        if objective == "soft":
            p_BAKV = jax.nn.softmax(gather_rows(target_BSV, label_idx_BAK - 1), axis=-1)
            ce_BAK = -jnp.sum(p_BAKV * logq_BAKV, axis=-1)
        else:
            ce_BAK = -jnp.take_along_axis(logq_BAKV, labels_BAK[..., None], axis=-1)[..., 0]
        weight_BAK = supervised_BAK * w_K
        loss = jnp.sum(ce_BAK * weight_BAK) / jnp.maximum(jnp.sum(weight_BAK), 1e-6)
        hit_BAK = (jnp.argmax(logits_BAKV, -1) == labels_BAK) * supervised_BAK
        per_row_K = jnp.maximum(jnp.sum(supervised_BAK, axis=(0, 1)), 1.0)
        metrics = {f"acc_{j}": jnp.sum(hit_BAK[:, :, j]) / per_row_K[j] for j in range(1, k)}
        metrics["ce"] = jnp.sum(ce_BAK * supervised_BAK) / jnp.maximum(jnp.sum(supervised_BAK), 1.0)
        metrics["tokens"] = jnp.sum(supervised_BAK)
        return loss, metrics

    return loss_fn


@functools.lru_cache(maxsize=None)
def dspark_loss(cfg: dspark.DSparkConfig, target_cfg: ModelConfig, decay: float = DSPARK_DECAY,
                alphas: tuple[float, float, float] = DSPARK_ALPHAS) -> LossFn:
    """DSpark's loss hook (DeepSpec's): alpha_ce CE + alpha_l1 L1-to-target + alpha_conf confidence BCE, row weights
    exp(-k / decay) over the supervised rows (see the module docstring).

    Metrics: ce, l1, conf (the three means), accept_k (mean 1 - 0.5 L1 = the sampled acceptance rate at row k),
    acc_k (draft top-1 == the target's top-1, teacher-forced), tau_prob (1 + sum_k prod_{i<=k} accept_i per
    block, DeepSpec's tau_probabilistic), tokens (rows counted).
    """
    block = cfg.block
    k = block.block_size
    w_K = jnp.asarray(dspark_weights(k, decay))
    ce_alpha, l1_alpha, conf_alpha = alphas

    def loss_fn(params: dict, batch: dict, frozen: dict):
        """DeepSpec's three weighted terms over every anchor's rows 0..K-1 (see dspark_loss)."""
        tokens_BS, anchors_BA = batch["tokens"], batch["anchors"]
        taps, target_BSV = jax.lax.stop_gradient(
            target_taps_and_logits(frozen["target"], target_cfg, tokens_BS, block.feature_layers))
        net = dspark.networks(cfg, serving_params(cfg, params, frozen))
        h_BAKH = anchor_hidden(net.backbone, net.tables, taps, tokens_BS, anchors_BA)
        prev_BAK = prev_tokens(tokens_BS, anchors_BA, k)
        logits_BAKV = dspark_logits(net, h_BAKH, prev_BAK)
        label_idx_BAK = anchors_BA[:, :, None] + 1 + jnp.arange(k)
        inside_BAK = label_idx_BAK < tokens_BS.shape[1]
        ok_BAK = batch["keep"][:, :, None] * inside_BAK * gather_rows(batch["loss_mask"], label_idx_BAK)
        supervised_BAK = jnp.cumprod(ok_BAK, axis=-1)  # DeepSpec's eval_mask: a contiguous prefix of the block
        labels_BAK = gather_rows(tokens_BS, label_idx_BAK)
        logq_BAKV = jax.nn.log_softmax(logits_BAKV, axis=-1)
        ce_BAK = -jnp.take_along_axis(logq_BAKV, labels_BAK[..., None], axis=-1)[..., 0]
        target_BAKV = gather_rows(target_BSV, label_idx_BAK - 1)
        l1_BAK = jnp.sum(jnp.abs(jnp.exp(logq_BAKV) - jax.nn.softmax(target_BAKV, axis=-1)), axis=-1)
        accept_BAK = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_BAK, 0.0, 1.0))
        b, a = anchors_BA.shape
        conf_logit_BAK = net.confidence_logits(h_BAKH.reshape(b, a * k, -1), prev_BAK.reshape(b, a * k)
                                               ).reshape(b, a, k)
        bce_BAK = optax.sigmoid_binary_cross_entropy(conf_logit_BAK, accept_BAK)
        weight_BAK = supervised_BAK * w_K
        den = jnp.maximum(jnp.sum(weight_BAK), 1e-6)
        ce, l1, conf = (jnp.sum(x * weight_BAK) / den for x in (ce_BAK, l1_BAK, bce_BAK))
        loss = ce_alpha * ce + l1_alpha * l1 + conf_alpha * conf
        per_row_K = jnp.maximum(jnp.sum(supervised_BAK, axis=(0, 1)), 1.0)
        hit_BAK = (jnp.argmax(logits_BAKV, -1) == jnp.argmax(target_BAKV, -1)) * supervised_BAK
        metrics = {"ce": ce, "l1": l1, "conf": conf}
        for j in range(k):
            metrics[f"accept_{j}"] = jnp.sum(accept_BAK[:, :, j] * supervised_BAK[:, :, j]) / per_row_K[j]
            metrics[f"acc_{j}"] = jnp.sum(hit_BAK[:, :, j]) / per_row_K[j]
        blocks_BA = supervised_BAK[:, :, 0]
        tau_BA = 1.0 + jnp.sum(jnp.cumprod(accept_BAK * supervised_BAK, axis=-1), axis=-1)
        metrics["tau_prob"] = jnp.sum(tau_BA * blocks_BA) / jnp.maximum(jnp.sum(blocks_BA), 1.0)
        metrics["tokens"] = jnp.sum(supervised_BAK)
        return loss, metrics

    return loss_fn


def block_loss(cfg: BlockConfig | dspark.DSparkConfig, target_cfg: ModelConfig, **kw) -> LossFn:
    """The family's loss hook: dflash_loss for a BlockConfig, dspark_loss for a DSparkConfig."""
    if isinstance(cfg, dspark.DSparkConfig):
        return dspark_loss(cfg, target_cfg, **kw)
    return dflash_loss(cfg, target_cfg, **kw)
