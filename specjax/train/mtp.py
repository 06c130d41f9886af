"""MTP head training: one multi-token-prediction layer (DeepSeek-V3 layout) on a frozen target.

One training example is a token sequence t_0..t_{S-1} the target generated itself (a prompt and
its greedy continuation). The frozen target's serving forward
(`models.model.forward`, what prefill computes) gives at every position p its final-normed
hidden h_p (the lm_head's input: what vLLM feeds DeepSeek-V3's MTP, see drafters/mtp.py) and its
next-token logits z_p. The MTP layer reads
(h_p, t_{p+1}) at row p and predicts t_{p+2}:

    step 0:  x = fc(concat(enorm(embed(t_{p+1})), hnorm(h_p)))       RoPE position p
             h'_p = block(x), causal over rows 0..p                 (the MTP layer's own K/V)
             logits = lm_head(shared_head.norm(h'_p))                the target's (tied) head
    loss_0 = soft cross-entropy against softmax(z_{p+1})           the target's distribution of t_{p+2}

The embedding and lm_head are the target's, frozen (for the embedded target they are the same
tied table); only the MTP layer (enorm, hnorm, eh_proj, shared_head.norm, block) trains.

Optionally (`steps` > 1) the layer is also trained as serving reuses it in a chain: step j
reads its own step j-1 output (fed back as the drafter does, `MtpLayer.feedback`) and
t_{p+1+j} at position p + j, attends to the step-0 K/V of rows 0..p and its own steps 1..j at
row p (as the drafter's cache holds its committed rows and then its own guesses), and is scored
against z_{p+1+j}; loss = sum_j decay^j loss_j. Default: one step, as DeepSeek-V3 trains its MTP.

Why soft targets. The data are the target's own greedy continuations, so a hard label t_{p+2}
is just argmax z_{p+1}: cross-entropy on it teaches the head the target's top-1 and nothing
else. The soft cross-entropy (= KL(target || head) + the target's entropy, a constant) teaches
the whole ranking from the same forward pass: more signal per position for a small head on
little data, and the head's probabilities track the target's, which is what sampled
verification accepts (acceptance = 1 - TV(p, q), bounded through KL by Pinsker) and what
confidence-driven trees rank by. Greedy acceptance only needs the top-1 to agree; `acc_j`
reports that. `objective="hard"` trains on the labels instead, for comparison. Measured on the
embedded target (scripts/train_mtp.py --steps 300 --unroll 1, same data, 128 validation rows):
hard labels reach a slightly higher teacher-forced top-1 at t+2 (acc_0 0.825 vs 0.804) and the
same chain-of-1 tau (1.76 vs 1.76), but the soft head is far closer to the target's distribution
(KL 0.14 vs 1.83 nats), generalises better to the reused step (acc_1 0.77 vs 0.73) and gives a
higher chain-of-3 tau (2.61 vs 2.45). Training the reused step too (steps=2) raised chain-of-3
tau to 2.71 with chain-of-1 unchanged, so scripts/train_mtp.py trains 2 steps.

Training and serving run the same module, `drafters.mtp.MtpHead` merged from the trained layer
and the frozen tables: the fused input is `MtpHead.fused`, the block its layer's `DecoderLayer`
(`qkv` / `attn_out_and_mlp`), the logits `MtpHead.logits` and the fed-back hidden `feedback`;
only attention differs (over whole sequences here, a KV cache there). tests/test_train_mtp.py
checks that step 0's logits at every position equal the serving MtpDrafter's first draft logits
after a teacher-forced prefill, at 1e-5.

Only rows whose target distribution predicts a generated token count (batch `mask`, as in
specjax.train.eagle3), so the head learns on the target's own output, where it drafts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.convert.export import NP_DTYPES, write_hf_dir
from specjax.convert.mtp import mtp_hf_tensors, mtp_only_config
from specjax.drafters import mtp
from specjax.models.layers import rope_inv_freq
from specjax.models.model import sequence_forward
from specjax.models.state import to_params
from specjax.train.eagle3 import sequence_batch, shift_left, ttt_attention
from specjax.train.losses import LossFn

OBJECTIVES = ("soft", "hard")

__all__ = ["OBJECTIVES", "head_config", "init_layer", "mtp_loss", "sequence_batch", "serving_params", "stored",
           "target_hidden", "unroll"]


def head_config(target: ModelConfig, layout: str = "deepseek") -> mtp.MtpConfig:
    """The MtpConfig of one MTP layer on `target` (its block is one of the target's layers): the DeepSeek-V3
    layout, or "qwen3_next" (the layout Qwen3.5 ships, zero-centred fuse norms)."""
    return mtp.MtpConfig(layout=layout, num_layers=1, target=target)


def init_layer(target: ModelConfig, key: jax.Array, scale: float = 0.02, layout: str = "deepseek") -> dict:
    """Trainable params of one MTP layer (an MtpLayer's): {embed_norm, hidden_norm, fc [2H, H], final_norm, block}.

    Matrices normal(0, scale), norms at identity (the block is initialised as the decoder initialises a layer).
    """
    return to_params(mtp.MtpLayer(head_config(target, layout), rngs=nnx.Rngs(params=key), scale=scale))


def serving_params(layer: dict, frozen: dict) -> dict:
    """What `MtpDrafter` runs: the trained layer plus the target's embedding (and lm_head when untied)."""
    params = {"layers": {0: layer}, "embed": frozen["embed"]}
    if "lm_head" in frozen:
        params["lm_head"] = frozen["lm_head"]
    return params


def frozen_params(target_params: dict, target_cfg: ModelConfig) -> dict:
    """The loss's `frozen` pytree: the target's params and the tables the head borrows from it."""
    frozen = {"target": target_params, "embed": target_params["embed"]}
    if not target_cfg.tie_word_embeddings:
        frozen["lm_head"] = target_params["lm_head"]
    return frozen


def stored(layer: dict, layout: str = "deepseek") -> dict:
    """The stored (converted) form of a trained layer: what `Target.mtp` / `convert.mtp.read_mtp` hold
    (the Qwen3-Next / Qwen3.5 layout keeps the fuse modules at the top, shared by its layers)."""
    if layout == "qwen3_next":
        return {**{k: v for k, v in layer.items() if k != "block"}, "layers": {"0": {"block": layer["block"]}}}
    return {"layers": {"0": layer}}


def target_hidden(target_params: dict, target_cfg: ModelConfig, tokens_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The target's serving forward over whole sequences: (final-normed hidden [B, S, H], logits [B, S, V] fp32).

    A fresh cache of length S, positions 0..S-1, causal: what prefill computes.
    """
    out_BSD, _, logits_BSV = sequence_forward(target_params, target_cfg, tokens_BS)
    return out_BSD, logits_BSV


def unroll(head: mtp.MtpHead, h_BSD: jax.Array, next_ids_BS: jax.Array, steps: int = 1) -> list[jax.Array]:
    """The MTP layer's logits [B, S, V] (fp32) at every row for chain steps 0..steps-1.

    head: the serving head (`mtp.head_of(cfg, serving_params(...))`); h_BSD[p] = the target's final-normed
    last hidden at p, next_ids_BS[p] = t_{p+1}. Step j reads t_{p+1+j} (zeros past the end) at position
    p + j and the fed-back output of step j - 1; step 0 is what the drafter computes for its committed rows.
    """
    cfg = head.cfg
    if cfg.num_layers != 1:
        raise ValueError(f"training covers one MTP layer (reused along the chain); got {cfg.num_layers}")
    b, s = next_ids_BS.shape
    positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    layer = head.layers[0]
    inv_freq = rope_inv_freq(cfg.block.rope, cfg.block.head_dim)
    k_steps, v_steps, logits = [], [], []
    for j in range(steps):
        x_BSD = head.fused(0, shift_left(next_ids_BS, j), h_BSD, positions_BS + j)
        q_BSHD, k_BSKD, v_BSKD = layer.block.qkv(x_BSD, positions_BS + j, inv_freq)
        k_steps.append(k_BSKD)
        v_steps.append(v_BSKD)
        out_BSD = layer.block.attn_out_and_mlp(x_BSD, ttt_attention(q_BSHD, k_steps, v_steps))
        logits.append(head.logits(0, out_BSD))
        h_BSD = layer.feedback(out_BSD)
    return logits


@functools.lru_cache(maxsize=None)
def mtp_loss(cfg: mtp.MtpConfig, steps: int = 1, decay: float = 0.8, objective: str = "soft") -> LossFn:
    """The loss hook: `loss_fn(layer_params, batch, frozen) -> (sum_j decay^j loss_j, metrics)`.

    layer_params: the trainable MTP layer (init_layer); frozen: frozen_params(target); batch:
    tokens [B, S] int32 and mask [B, S] (1 where the target's distribution at that position is
    learned, see sequence_batch). Row p at step j is scored against the target at p + 1 + j.
    Metrics per step: loss_j (the objective), kl_j (KL(target || head), nats), acc_j (head top-1 ==
    target top-1: a greedy acceptance); tokens (rows counted at step 0).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")

    def loss_fn(params: dict, batch: dict, frozen: dict):
        tokens_BS = batch["tokens"]
        mask_BS = batch["mask"].astype(jnp.float32)
        h_BSD, target_BSV = jax.lax.stop_gradient(target_hidden(frozen["target"], cfg.target, tokens_BS))
        target_logp_BSV = jax.nn.log_softmax(target_BSV, axis=-1)
        logits = unroll(mtp.head_of(cfg, serving_params(params, frozen)), h_BSD, shift_left(tokens_BS, 1), steps)
        total, metrics = 0.0, {}
        for j, logits_BSV in enumerate(logits):
            w_BS = shift_left(mask_BS, 1 + j)
            tlogp_BSV = shift_left(target_logp_BSV, 1 + j)
            logq_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
            p_BSV = jnp.exp(tlogp_BSV)
            kl_BS = jnp.sum(p_BSV * (tlogp_BSV - logq_BSV), axis=-1)
            top_BS = jnp.argmax(tlogp_BSV, axis=-1)
            if objective == "soft":
                loss_BS = -jnp.sum(p_BSV * logq_BSV, axis=-1)
            else:
                loss_BS = -jnp.take_along_axis(logq_BSV, top_BS[..., None], axis=-1)[..., 0]
            n = jnp.maximum(jnp.sum(w_BS), 1.0)
            loss_j = jnp.sum(loss_BS * w_BS) / n
            metrics[f"loss_{j}"] = loss_j
            metrics[f"kl_{j}"] = jnp.sum(kl_BS * w_BS) / n
            metrics[f"acc_{j}"] = jnp.sum((jnp.argmax(logits_BSV, -1) == top_BS) * w_BS) / n
            total = total + decay ** j * loss_j
        metrics["tokens"] = jnp.sum(shift_left(mask_BS, 1))
        return total, metrics

    return loss_fn


def num_params(layer: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(layer)))


def write_head(dst, target_hf: dict, layer: dict, *, target_ref: str, dtype: str = "bfloat16",
               overwrite: bool = True):
    """An MTP-only directory at dst (convert/mtp.py): config.json (the target's, plus the MTP layer count
    and `specjax_mtp_only` naming target_ref) and model.safetensors with the layer under the DeepSeek-V3
    names it would have inside the target's checkpoint (model.layers.{L}.*). Written atomically.

    `specjax.load_drafter(dst, target)` loads it as an MtpDrafter.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    host = stored(jax.tree.map(np.asarray, layer))
    tensors = {k: v.astype(NP_DTYPES[dtype]) for k, v in mtp_hf_tensors(host, ModelConfig.from_hf(target_hf)).items()}
    return write_hf_dir(dst, mtp_only_config(target_hf, host, target_ref, dtype), tensors, overwrite=overwrite)
