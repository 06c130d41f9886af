"""EAGLE-3 head training: the training-time test (TTT) of SafeAILab/EAGLE `traineagle3`, in specjax's terms.

One training example is a token sequence t_0..t_{S-1} the target generated itself (a prompt and
its greedy continuation). The frozen target gives, at every position q, the three feature taps
g_q (`models.decoder.forward(..., capture=feature_layers)`, the serving forward) and its
next-token logits z_q. The head then runs `steps` (7) unrolled steps over all rows at once:

    step 0:  h = fc(g_p)                     row p, token t_{p+1}, RoPE position p
    step j:  h = the head's own pre-norm output of step j-1 at row p,
             token t_{p+1+j}, RoPE position p + j
    loss_j = soft cross-entropy of the head's draft-vocabulary logits at row p against
             softmax(z_{p+1+j} restricted to the draft vocabulary)   (the target's next token
             after t_{p+1+j}, renormalised over the tokens the head can say)
    total  = sum_j 0.8^j loss_j

Row p at step j is exactly the head's j-th chain step when drafting after the prefix t_0..t_p
whose drafts so far were t_{p+1}.. t_{p+j} (teacher forcing along the target's own continuation).
The attention reproduces that (the original's `LlamaAttention` with `cache_hidden`): the
query of step j at row p sees the step-0 keys of rows 0..p (the head's cache of true
features, causal) and the keys of steps 1..j at row p only (its own earlier drafts on that
path). tests/test_train_eagle3.py checks step 0 against serving's prefill and step j
against chain drafting with the serving functions.

As in the original: rows whose target top-1 token lies outside the draft vocabulary are left
out (t2d of the target's argmax), and rows past the end of the sequence at step j
(p + 1 + j > S - 1) are left out. Only rows whose target distribution predicts a generated
token count (`mask_BS`; the original masks out the user's turns the same way). The original
divides each step's summed loss by B x S; here by the number of counted rows of that step,
so the reported numbers are nats per token (a constant rescale for AdamW).

The loss trains `drafters.eagle3.Eagle3Head`: merged from the trainable params and the frozen
tables, it runs the methods serving runs (`fuse`, `qkv`, its layer's `output`,
`draft_logits`); only attention differs (the TTT attention here, the KV cache there).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig, RopeConfig
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Head, concat_features, head_of
from specjax.models.model import sequence_forward
from specjax.models.state import to_params
from specjax.train.losses import LossFn
from specjax.train.model import NEG_INF

TTT_STEPS = 7  # the original's `self.length`
STEP_DECAY = 0.8  # loss weight of step j: 0.8 ** j (traineagle3/main.py)
FROZEN_KEYS = ("embed", "d2t")  # head params that are not trained: the target's table, the vocabulary map


def head_config(target: ModelConfig, feature_layers: Sequence[int], *, draft_vocab_size: int,
                intermediate_size: int, num_heads: int | None = None, num_kv_heads: int | None = None,
                rope_theta: float = 10000.0, dtype: str = "float32") -> Eagle3Config:
    """An Eagle3Config for a new head on `target`: the target's width (so it reads the target's embedding),
    its head counts unless given, and the original's default RoPE base (10000)."""
    if len(set(feature_layers)) != 3 or not all(1 <= i <= target.num_layers - 1 for i in feature_layers):
        raise ValueError(f"feature_layers {list(feature_layers)} must be three distinct hidden_states indices in "
                         f"1..{target.num_layers - 1} (the residual stream entering one of the target's layers)")
    return Eagle3Config(
        hidden_size=target.hidden_size, num_heads=num_heads or target.num_heads,
        num_kv_heads=num_kv_heads or target.num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size, target_hidden_size=target.hidden_size,
        feature_layers=tuple(feature_layers), rms_norm_eps=target.rms_norm_eps, rope=RopeConfig(theta=rope_theta),
        dtype=dtype)


def draft_vocab_from_counts(counts_V: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int32 [Vd], t2d bool [V]) of the draft_vocab_size most frequent tokens, as the original builds them.

    The kept ids are sorted, so draft id i is the i-th kept target id and d2t[i] = kept[i] - i.
    Ties in count go to the lower id (a stable order, so the same counts give the same vocabulary).
    """
    counts_V = np.asarray(counts_V)
    if not 0 < draft_vocab_size <= len(counts_V):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must lie in 1..{len(counts_V)} (the target's vocabulary)")
    kept = np.sort(np.argsort(-counts_V, kind="stable")[:draft_vocab_size])
    t2d = np.zeros(len(counts_V), bool)
    t2d[kept] = True
    return (kept - np.arange(draft_vocab_size)).astype(np.int32), t2d


def init_head(cfg: Eagle3Config, key: jax.Array, scale: float = 0.02) -> dict:
    """Trainable head params (an Eagle3Head's, without `embed` and `d2t`): normal(0, scale) matrices, unit norms."""
    params = to_params(Eagle3Head(cfg, rngs=nnx.Rngs(params=key), scale=scale))
    return {k: v for k, v in params.items() if k not in FROZEN_KEYS}


def full_params(trainable: dict, frozen: dict) -> dict:
    """The serving head's params: the trained weights plus the frozen `embed` and `d2t`."""
    return {**trainable, **{k: frozen[k] for k in FROZEN_KEYS}}


def target_features(target_params: dict, target_cfg: ModelConfig, tokens_BS: jax.Array,
                    feature_layers: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """The target's serving forward over whole sequences: (fc input [B, S, 3*Ht], next-token logits [B, S, V] fp32).

    A fresh cache of length S, positions 0..S-1, causal: what prefill computes.
    """
    _, taps, logits_BSV = sequence_forward(target_params, target_cfg, tokens_BS, tuple(feature_layers))
    return concat_features(taps), logits_BSV


def shift_left(x_BS: jax.Array, j: int) -> jax.Array:
    """x[:, j:] padded with zeros to the same length (the original's `padding(..., left=False)` applied j times)."""
    if j == 0:
        return x_BS
    pad = jnp.zeros((x_BS.shape[0], j, *x_BS.shape[2:]), x_BS.dtype)
    return jnp.concatenate([x_BS[:, j:], pad], axis=1)


def ttt_attention(q_BTHD: jax.Array, k_steps: Sequence[jax.Array], v_steps: Sequence[jax.Array]) -> jax.Array:
    """Attention of the current step's queries over the keys of every step so far (GQA, fp32 softmax).

    k_steps[0] / v_steps[0] [B, T, Hkv, D] are step 0's: row p sees rows 0..p. k_steps[i] for
    i >= 1 are step i's: row p sees only its own row p. One softmax over all of them.
    """
    b, t, h, d = q_BTHD.shape
    kv = k_steps[0].shape[2]
    q_BTKGD = q_BTHD.reshape(b, t, kv, h // kv, d)
    scale = 1.0 / math.sqrt(d)
    causal_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_steps[0], preferred_element_type=jnp.float32) * scale
    causal_BKGTS = jnp.where(jnp.tril(jnp.ones((t, t), jnp.bool_)), causal_BKGTS, NEG_INF)
    diag_BKGTI = jnp.stack([jnp.einsum("btkgd,btkd->bkgt", q_BTKGD, k, preferred_element_type=jnp.float32) * scale
                            for k in k_steps[1:]], axis=-1) if len(k_steps) > 1 else None
    logits = causal_BKGTS if diag_BKGTI is None else jnp.concatenate([causal_BKGTS, diag_BKGTI], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_steps[0].dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v_steps[0])
    for i, v in enumerate(v_steps[1:]):
        out_BTKGD = out_BTKGD + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + i], v)
    return out_BTKGD.reshape(b, t, h, d)


def unroll(head: Eagle3Head, features_BTF: jax.Array, next_ids_BT: jax.Array, steps: int = TTT_STEPS
           ) -> list[jax.Array]:
    """The head's draft-vocabulary logits [B, T, Vd] at every row for steps 0..steps-1.

    head: the full head (`head_of(cfg, full_params(...))`); next_ids_BT[p] = t_{p+1}, the token paired
    with feature row p. Step j reads t_{p+1+j} (zeros past the end) at RoPE position p + j and the
    head's own pre-norm output of step j - 1.
    """
    b, t = next_ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    h_BTD = head.fuse(features_BTF)
    k_steps, v_steps, logits = [], [], []
    for j in range(steps):
        q_BTHD, k_BTKD, v_BTKD = head.qkv(shift_left(next_ids_BT, j), h_BTD, positions_BT + j)
        k_steps.append(k_BTKD)
        v_steps.append(v_BTKD)
        h_BTD = head.carry(head.layer.output(h_BTD, ttt_attention(q_BTHD, k_steps, v_steps)))
        logits.append(head.draft_logits(h_BTD))
    return logits


def draft_targets(target_logits_BSV: jax.Array, d2t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(target probabilities over the draft vocabulary [B, S, Vd], whether the target's top-1 is in it [B, S]).

    The target's logits restricted to the draft vocabulary's target ids, then softmaxed: the
    original's `softmax(target[..., t2d])` (the kept ids are sorted, so draft order = target order).
    """
    ids_Vd = jnp.arange(d2t.shape[0]) + d2t
    in_vocab = jnp.zeros(target_logits_BSV.shape[-1], jnp.bool_).at[ids_Vd].set(True)
    probs_BSVd = jax.nn.softmax(target_logits_BSV[..., ids_Vd].astype(jnp.float32), axis=-1)
    return probs_BSVd, in_vocab[jnp.argmax(target_logits_BSV, axis=-1)]


@functools.lru_cache(maxsize=None)
def eagle3_loss(cfg: Eagle3Config, target_cfg: ModelConfig, steps: int = TTT_STEPS,
                decay: float = STEP_DECAY) -> LossFn:
    """The TTT loss hook: `loss_fn(head_params, batch, frozen) -> (sum_j decay^j loss_j, metrics)`.

    head_params: trainable head weights (see init_head); frozen: {"target": the target's params,
    "embed": the head's embedding (the target's table), "d2t": int32 [Vd]}; batch: tokens [B, S]
    int32 and mask [B, S] (1 where the target's distribution at that position is learned).
    Metrics: loss_j and acc_j (head top-1 == target top-1 over the draft vocabulary) per step,
    and tokens (rows counted at step 0).
    """

    if cfg.num_layers != 1 or cfg.lm_head != "own":
        raise ValueError(f"the training-time test trains one-layer heads with their own lm_head; this head has "
                         f"{cfg.num_layers} layers and lm_head={cfg.lm_head!r}")

    def loss_fn(params: dict, batch: dict, frozen: dict):
        tokens_BS = batch["tokens"]
        mask_BS = batch["mask"].astype(jnp.float32)
        features_BSF, target_BSV = target_features(frozen["target"], target_cfg, tokens_BS, cfg.feature_layers)
        features_BSF, target_BSV = jax.lax.stop_gradient(features_BSF), jax.lax.stop_gradient(target_BSV)
        probs_BSVd, in_vocab_BS = draft_targets(target_BSV, frozen["d2t"])
        counted_BS = mask_BS * in_vocab_BS
        logits = unroll(head_of(cfg, full_params(params, frozen)), features_BSF, shift_left(tokens_BS, 1), steps)
        total, metrics = 0.0, {}
        for j, logits_BSVd in enumerate(logits):
            # row p at step j is scored against position p + 1 + j
            w_BS = shift_left(counted_BS, 1 + j)
            p_BSVd = shift_left(probs_BSVd, 1 + j)
            ce_BS = -jnp.sum(p_BSVd * jax.nn.log_softmax(logits_BSVd, axis=-1), axis=-1)
            n = jnp.maximum(jnp.sum(w_BS), 1.0)
            loss_j = jnp.sum(ce_BS * w_BS) / n
            hit_BS = jnp.argmax(logits_BSVd, -1) == jnp.argmax(p_BSVd, -1)
            metrics[f"loss_{j}"] = loss_j
            metrics[f"acc_{j}"] = jnp.sum(hit_BS * w_BS) / n
            total = total + decay ** j * loss_j
        metrics["tokens"] = jnp.sum(shift_left(counted_BS, 1))
        return total, metrics

    return loss_fn


def sequence_batch(tokens_BS: np.ndarray, label_mask_BT: np.ndarray) -> dict[str, np.ndarray]:
    """A TTT batch from `data.continuations` output: tokens [B, S] and mask [B, S].

    label_mask[q] (q < S - 1) says tokens[q + 1] is a generated token, i.e. the target's
    distribution at position q is learned; the last position predicts past the sequence and
    counts when the one before it does.
    """
    mask_BS = np.concatenate([label_mask_BT, label_mask_BT[:, -1:]], axis=1)
    return {"tokens": np.asarray(tokens_BS, np.int32), "mask": mask_BS.astype(np.float32)}
