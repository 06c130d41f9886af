"""vLLM's penalties and min_tokens inside the jitted loops, per row as data, for one step and for a draft tree.

Semantics of vllm/model_executor/layers/utils.py `apply_penalties` (repetition first, over tokens seen in the
prompt or the output: a positive logit divided by the penalty, any other multiplied; then frequency x count and
presence x [count > 0] subtracted, counting the output only) and of vllm/v1/sample/logits_processors
MinTokensLogitsProcessor (EOS and stop tokens at -inf while the output is shorter than min_tokens). These act on
the target's logits before temperature and the filters (vllm/v1/sample/sampler.py).

In verification each draft node sees the counts of the prompt, the output so far (the root included: it was
emitted by the previous round) and the drafts on its own root-to-node path, so greedy speculative output equals
plain decoding with the same penalties and sampled output keeps the penalised distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import PenaltyConfig, row_column


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowPenalties:
    """Per-row penalty settings, arrays [B] (data: new values reuse the compiled loop)."""

    repetition: jax.Array  # float32; 1 = off
    presence: jax.Array  # float32; 0 = off
    frequency: jax.Array  # float32; 0 = off
    min_tokens: jax.Array  # int32; 0 = off

    @classmethod
    def of(cls, penalties: PenaltyConfig, n_rows: int, batch: int) -> "RowPenalties":
        """Host arrays for `batch` rows whose first n_rows are prompts (padding rows unpenalised)."""
        def column(name, dtype, pad):
            return row_column(penalties, name, n_rows, batch, dtype, pad)

        return cls(column("repetition_penalty", np.float32, 1.0), column("presence_penalty", np.float32, 0.0),
                   column("frequency_penalty", np.float32, 0.0), column("min_tokens", np.int32, 0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """What the penalties read, carried through the loop: prompt tokens and output token counts per row."""

    in_prompt_BV: jax.Array  # bool: the token occurs in the row's prompt
    output_BV: jax.Array  # int32: times the token occurs in the row's output so far

    @classmethod
    def of_prompts(cls, prompt_BT: jax.Array, prompt_len_B: jax.Array, vocab: int) -> "TokenCounts":
        b, t = prompt_BT.shape
        valid_BT = jnp.arange(t)[None, :] < prompt_len_B[:, None]
        ids_BT = jnp.where(valid_BT, prompt_BT, vocab)  # padding dropped by the scatter
        in_prompt_BV = jnp.zeros((b, vocab), jnp.bool_).at[jnp.arange(b)[:, None], ids_BT].set(True, mode="drop")
        return cls(in_prompt_BV, jnp.zeros((b, vocab), jnp.int32))

    def add(self, tokens_BN: jax.Array, keep_BN: jax.Array) -> "TokenCounts":
        """Count the tokens of each row where keep_BN (emitted this step or round)."""
        b = tokens_BN.shape[0]
        output_BV = self.output_BV.at[jnp.arange(b)[:, None], tokens_BN].add(keep_BN.astype(jnp.int32))
        return TokenCounts(self.in_prompt_BV, output_BV)


def _penalised(x, count, in_prompt, pen: RowPenalties, row_shape):
    """The penalised logit of one token from its raw logit x and its output count (vLLM's formula)."""
    rep, pres, freq = (v.reshape(row_shape) for v in (pen.repetition, pen.presence, pen.frequency))
    seen = in_prompt | (count > 0)
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0)


def penalise(logits_BV: jax.Array, counts: TokenCounts, pen: RowPenalties) -> jax.Array:
    """One step's logits [B, V] with each row's penalties applied."""
    return _penalised(logits_BV.astype(jnp.float32), counts.output_BV, counts.in_prompt_BV, pen, (-1, 1))


def penalise_tree(logits_BNV: jax.Array, counts: TokenCounts, pen: RowPenalties, tokens_BN: jax.Array,
                  mask_BNN: jax.Array) -> jax.Array:
    """Verify-pass logits [B, N, V], node j penalised with the drafts on its own path counted as output.

    Every entry first gets the row's counts; then, for each token on node j's path (its non-root ancestors and
    itself), the entry is recomputed with the count the path adds: a scatter of at most N entries per node, so
    no [B, N, V] count tensor is built.
    """
    b, n, _ = logits_BNV.shape
    logits_BNV = logits_BNV.astype(jnp.float32)
    out_BNV = _penalised(logits_BNV, counts.output_BV[:, None], counts.in_prompt_BV[:, None], pen, (-1, 1, 1))
    on_path_BNA = mask_BNN & (jnp.arange(n) != 0)[None, None, :]  # [b, j, a]: draft a counts for node j
    same_BAA = tokens_BN[:, :, None] == tokens_BN[:, None, :]
    path_count_BNA = jnp.einsum("bjc,bca->bja", on_path_BNA.astype(jnp.int32), same_BAA.astype(jnp.int32))
    tok_BNA = jnp.broadcast_to(tokens_BN[:, None, :], (b, n, n))
    raw_BNA = jnp.take_along_axis(logits_BNV, tok_BNA, axis=-1)
    base_BNA = jnp.take_along_axis(counts.output_BV, tokens_BN, axis=-1)[:, None, :]
    prompt_BNA = jnp.take_along_axis(counts.in_prompt_BV, tokens_BN, axis=-1)[:, None, :]
    fixed_BNA = _penalised(raw_BNA, base_BNA + path_count_BNA, prompt_BNA, pen, (-1, 1, 1))
    vocab = logits_BNV.shape[-1]
    where_BNA = jnp.where(on_path_BNA, tok_BNA, vocab)  # off-path entries dropped
    rows_B11, nodes_1N1 = jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None]
    return out_BNV.at[rows_B11, nodes_1N1, where_BNA].set(fixed_BNA, mode="drop")


def forbid_stops(logits_XV: jax.Array, produced_X: jax.Array, stop_ids_BS: jax.Array,
                 min_tokens_B: jax.Array) -> jax.Array:
    """min_tokens: the stop ids (-1 = padding) at -inf where the output so far (produced_X tokens, X = [B] or
    [B, N]) is shorter than the row's min_tokens."""
    b, vocab = stop_ids_BS.shape[0], logits_XV.shape[-1]
    row_shape = (b,) + (1,) * (produced_X.ndim - 1)
    early_X = produced_X < min_tokens_B.reshape(row_shape)
    ids_BS = jnp.where(stop_ids_BS < 0, vocab, stop_ids_BS)  # padding dropped by the scatter
    is_stop_BV = jnp.zeros((b, vocab), jnp.bool_).at[jnp.arange(b)[:, None], ids_BS].set(True, mode="drop")
    return jnp.where(early_X[..., None] & is_stop_BV.reshape(row_shape + (vocab,)), -jnp.inf, logits_XV)
