"""The plain autoregressive loop: prefill, then one token per row per step, all in one jit.

Shapes are fixed by buckets (batch, prompt length, output length, cache length); rows
finish independently on EOS or their own token budget and are masked afterwards.
This loop is the baseline every speculative speedup is measured against.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.sampling import choose_token, row_keys, split_rows
from specjax.models.cache import KVCache
from specjax.models.decoder import Decoder
from specjax.models.model import merge


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Everything static about one compiled decode loop."""

    model: ModelConfig
    sampling: SamplingConfig
    eos_ids: tuple[int, ...]
    out_len: int  # output buffer length (bucket of max_new_tokens)
    cache_len: int  # KV cache length
    attn_impl: str = "auto"


def is_eos(tok_B: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok_B.shape, jnp.bool_)
    return jnp.isin(tok_B, jnp.asarray(eos_ids, jnp.int32))


def prefill(model: Decoder, lc: LoopConfig, cache: KVCache, prompt_BT: jax.Array, prompt_len_B: jax.Array,
            capture: tuple[int, ...] = ()):
    """Run right-padded prompts into an empty cache; return last-position logits [B, V], captures, cache."""
    h_BTD, captured, cache = model.forward(prompt_BT, cache, capture=capture, attn_impl=lc.attn_impl,
                                           num_valid_B=prompt_len_B)
    last_B1D = jnp.take_along_axis(h_BTD, (prompt_len_B - 1)[:, None, None], axis=1)
    logits_BV = model.logits(last_B1D)[:, 0]
    return logits_BV, captured, cache.with_lengths(prompt_len_B)


def first_token_state(tok_B: jax.Array, max_new_B: jax.Array, lc: LoopConfig):
    """After prefill: the output buffer holding each row's first token, its count, and which rows are done."""
    out_BO = jnp.zeros((tok_B.shape[0], lc.out_len), jnp.int32).at[:, 0].set(tok_B)
    count_B = jnp.minimum(max_new_B, 1)
    return out_BO, count_B, (count_B >= max_new_B) | is_eos(tok_B, lc.eos_ids)


@partial(jax.jit, static_argnames=("lc",))
def ar_generate(params: dict, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                seeds_B: jax.Array, fold_B: jax.Array, *, lc: LoopConfig):
    """Generate up to max_new_B[b] tokens per row. Returns (tokens [B, out_len], counts [B], steps).

    Row b samples with its own key stream from (seeds_B[b], fold_B[b]) (see request.row_seeds).
    The cache is allocated inside the jit and carried through the loop, so it never
    crosses the jit boundary: XLA updates it in place with nothing to copy or donate.
    params: the target's weights as a dict (Target.params), merged into its Decoder module here.
    """
    model = merge(lc.model, params)
    b = prompt_BT.shape[0]
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    cache = model.init_cache(b, lc.cache_len)
    logits_BV, _, cache = prefill(model, lc, cache, prompt_BT, prompt_len_B)
    tok_B = choose_token(sub_B, logits_BV, lc.sampling)
    out_BO, count_B, done_B = first_token_state(tok_B, max_new_B, lc)

    def cond(state):
        step, _, _, _, _, done_B, _ = state
        return (step < lc.out_len) & ~jnp.all(done_B)

    def body(state):
        step, cache, tok_B, out_BO, count_B, done_B, keys_B = state
        keys_B, sub_B = split_rows(keys_B, 2)
        h_B1D, _, cache = model.forward(tok_B[:, None], cache, attn_impl=lc.attn_impl)
        # Finished rows keep computing (fixed shapes) but stop advancing.
        cache = cache.with_lengths(cache.lengths + (~done_B).astype(jnp.int32))
        new_B = choose_token(sub_B, model.logits(h_B1D)[:, 0], lc.sampling)
        new_B = jnp.where(done_B, tok_B, new_B)
        out_BO = out_BO.at[jnp.arange(b), jnp.where(done_B, lc.out_len, count_B)].set(new_B, mode="drop")
        count_B = count_B + (~done_B).astype(jnp.int32)
        done_B = done_B | (count_B >= max_new_B) | is_eos(new_B, lc.eos_ids)
        return step + 1, cache, new_B, out_BO, count_B, done_B, keys_B

    state = (jnp.int32(1), cache, tok_B, out_BO, count_B, done_B, keys_B)
    steps, _, _, out_BO, count_B, _, _ = lax.while_loop(cond, body, state)
    return out_BO, count_B, steps
