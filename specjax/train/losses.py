"""Loss hooks for the train step: `loss_fn(params, batch, frozen) -> (loss, metrics)`.

`params` are the trained weights; `frozen` is any pytree the loss reads but does not train
(a teacher's or target's params); `batch` is a dict with `tokens` [B, T+1] and optional
`mask` [B, T]. Every loss reports `tokens` (labels counted) so evaluation can weight batches.
Drafter families with other heads (EAGLE-3, MTP, DFlash, DSpark) add their own hooks here.
The factories are cached, so equal configs give the same function and jit reuses its compile.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from specjax.config import ModelConfig
from specjax.train.model import train_logits

LossFn = Callable[[dict, dict, object], tuple[jax.Array, dict]]


def _inputs_labels_mask(batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    tokens_BS = batch["tokens"]
    inputs_BT, labels_BT = tokens_BS[:, :-1], tokens_BS[:, 1:]
    mask_BT = batch.get("mask")
    mask_BT = jnp.ones(labels_BT.shape, jnp.float32) if mask_BT is None else mask_BT.astype(jnp.float32)
    return inputs_BT, labels_BT, mask_BT


def masked_mean(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    return jnp.sum(x_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)


@functools.lru_cache(maxsize=None)
def lm_loss(cfg: ModelConfig) -> LossFn:
    """Next-token cross-entropy (nats per token) of a decoder with config cfg; `frozen` is unused."""

    def loss_fn(params: dict, batch: dict, frozen=None):
        del frozen
        inputs_BT, labels_BT, mask_BT = _inputs_labels_mask(batch)
        logits_BTV = train_logits(params, cfg, inputs_BT)
        ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT), mask_BT)
        accuracy = masked_mean((jnp.argmax(logits_BTV, -1) == labels_BT).astype(jnp.float32), mask_BT)
        return ce, {"ce": ce, "accuracy": accuracy, "tokens": jnp.sum(mask_BT)}

    return loss_fn


@functools.lru_cache(maxsize=None)
def distill_loss(student_cfg: ModelConfig, teacher_cfg: ModelConfig, ce_weight: float = 0.0) -> LossFn:
    """KL(teacher || student) per token, plus ce_weight x cross-entropy on the labels.

    `frozen` is the teacher's params. Reports `agreement`: how often the student's top-1 equals
    the teacher's, which is what greedy speculative acceptance rewards.
    """
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        raise ValueError(f"student vocab {student_cfg.vocab_size} != teacher vocab {teacher_cfg.vocab_size}: "
                         "distillation needs a shared tokenizer")

    def loss_fn(params: dict, batch: dict, frozen: dict):
        inputs_BT, labels_BT, mask_BT = _inputs_labels_mask(batch)
        teacher_BTV = jax.lax.stop_gradient(train_logits(frozen, teacher_cfg, inputs_BT))
        student_BTV = train_logits(params, student_cfg, inputs_BT)
        teacher_logp = jax.nn.log_softmax(teacher_BTV, axis=-1)
        student_logp = jax.nn.log_softmax(student_BTV, axis=-1)
        kl = masked_mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1), mask_BT)
        ce = masked_mean(-jnp.take_along_axis(student_logp, labels_BT[..., None], axis=-1)[..., 0], mask_BT)
        agree = masked_mean((jnp.argmax(student_BTV, -1) == jnp.argmax(teacher_BTV, -1)).astype(jnp.float32),
                            mask_BT)
        return kl + ce_weight * ce, {"kl": kl, "ce": ce, "agreement": agree, "tokens": jnp.sum(mask_BT)}

    return loss_fn
