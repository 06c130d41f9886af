"""The plain autoregressive loop: prefill, then one token per row per step, all in one jit.

Shapes are fixed by buckets (batch, prompt length, output length, cache length); rows
finish independently on a stop token or their own token budget and are masked afterwards.
This loop is the baseline every speculative speedup is measured against.

Per-row settings (sampling values, penalties, stop ids) are data, `RowSettings`; what is
compiled in is only whether any row samples, whether penalties are on and how many logprobs
are kept (`LoopConfig`). The loop runs whole (`ar_generate`, the cache never leaves the jit) or
in resumable chunks of steps (`ar_start` + `ar_advance`, the state donated back each time) for
streaming and stop strings.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.penalties import RowPenalties, TokenCounts, forbid_stops, penalise
from specjax.decoding.sampling import RowSampling, choose_token, row_keys, split_rows
from specjax.models.cache import KVCache
from specjax.models.decoder import Decoder
from specjax.models.model import merge

GREEDY = SamplingConfig()  # what the loops pass to choose / verify when no row samples (the argmax path)
# A drafter's Settings.sampling in a loop where rows sample: it only says "not greedy" (drafting then draws from
# each row's own settings, passed to propose as data); a new temperature must not configure a new drafter.
SAMPLED = SamplingConfig(temperature=1.0)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Everything static about one compiled decode loop (values that vary per request are RowSettings)."""

    model: ModelConfig
    sampled: bool  # some row samples: the sampling path (a greedy row in it takes its argmax); else argmax only
    out_len: int  # output buffer length (bucket of max_new_tokens)
    cache_len: int  # KV cache length
    attn_impl: str = "auto"
    penalties: bool = False  # token counts carried, penalties and min_tokens applied
    logprobs: int = -1  # -1: none; 0: each emitted token's log-probability; n > 0: also the n most likely

    @property
    def drafting(self) -> SamplingConfig:
        """A drafter's Settings.sampling for this loop: GREEDY or SAMPLED (the mode; values come per row)."""
        return SAMPLED if self.sampled else GREEDY

    def sampling(self, rows: "RowSettings"):
        """What choose_token / verify get: the rows' values when sampling, else the static greedy setting."""
        return rows.sampling if self.sampled else GREEDY


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row request settings, arrays with a leading batch axis (data: new values reuse the compiled loop)."""

    sampling: RowSampling
    penalties: RowPenalties
    stop_ids_BS: jax.Array  # int32 [B, S]: EOS and stop_token_ids of each row, -1 = padding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Raw log-probabilities of the emitted tokens (log-softmax of the target's logits, before penalties and
    temperature: vLLM's default raw_logprobs), per output position, and the n most likely alternatives."""

    token_BO: jax.Array  # float32 [B, O]
    top_ids_BOK: jax.Array  # int32 [B, O, n]
    top_BOK: jax.Array  # float32 [B, O, n]

    @classmethod
    def zeros(cls, batch: int, out_len: int, n: int) -> "Logprobs":
        return cls(jnp.zeros((batch, out_len), jnp.float32), jnp.zeros((batch, out_len, n), jnp.int32),
                   jnp.zeros((batch, out_len, n), jnp.float32))

    def write(self, dst_BN: jax.Array, raw_BNV: jax.Array, tok_BN: jax.Array) -> "Logprobs":
        """Record tokens tok_BN drawn after logits raw_BNV at output positions dst_BN (out of range: dropped)."""
        logp_BNV = jax.nn.log_softmax(raw_BNV.astype(jnp.float32), axis=-1)
        tok_lp_BN = jnp.take_along_axis(logp_BNV, tok_BN[..., None], axis=-1)[..., 0]
        rows_B1 = jnp.arange(dst_BN.shape[0])[:, None]
        n = self.top_BOK.shape[-1]
        out = dataclasses.replace(self, token_BO=self.token_BO.at[rows_B1, dst_BN].set(tok_lp_BN, mode="drop"))
        if n == 0:
            return out
        top_BNK, ids_BNK = lax.top_k(logp_BNV, n)
        return dataclasses.replace(out, top_ids_BOK=self.top_ids_BOK.at[rows_B1, dst_BN].set(ids_BNK, mode="drop"),
                                   top_BOK=self.top_BOK.at[rows_B1, dst_BN].set(top_BNK, mode="drop"))


def is_stop(tok_X: jax.Array, stop_ids_BS: jax.Array) -> jax.Array:
    """bool X (X = [B] or [B, N]): the token is one of its row's stop ids."""
    ids = stop_ids_BS.reshape(stop_ids_BS.shape[:1] + (1,) * (tok_X.ndim - 1) + stop_ids_BS.shape[1:])
    return jnp.any((tok_X[..., None] == ids) & (ids >= 0), axis=-1)


def choose_next(lc: LoopConfig, rows: RowSettings, keys_B: jax.Array, logits_BV: jax.Array, counts,
                produced_B: jax.Array) -> jax.Array:
    """The next token of every row after logits [B, V]: penalties and min_tokens (when on), then the row's sampling
    (argmax when no row samples). produced_B: tokens each row has output so far."""
    if lc.penalties:
        logits_BV = forbid_stops(penalise(logits_BV, counts, rows.penalties), produced_B, rows.stop_ids_BS,
                                 rows.penalties.min_tokens)
    return choose_token(keys_B, logits_BV, lc.sampling(rows))


def prefill(model: Decoder, lc: LoopConfig, cache: KVCache, prompt_BT: jax.Array, prompt_len_B: jax.Array,
            capture: tuple[int, ...] = ()):
    """Run right-padded prompts into an empty cache; return last-position logits [B, V], captures, cache."""
    h_BTD, captured, cache = model.forward(prompt_BT, cache, capture=capture, attn_impl=lc.attn_impl,
                                           num_valid_B=prompt_len_B)
    last_B1D = jnp.take_along_axis(h_BTD, (prompt_len_B - 1)[:, None, None], axis=1)
    logits_BV = model.logits(last_B1D)[:, 0]
    return logits_BV, captured, cache.with_lengths(prompt_len_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstToken:
    """After prefill: each row's first token, the output buffer holding it, its count and which rows are done."""

    tok_B: jax.Array
    out_BO: jax.Array
    count_B: jax.Array
    done_B: jax.Array
    counts: TokenCounts | None  # with penalties: prompt tokens and the first token counted
    logprobs: Logprobs | None


def first_token(lc: LoopConfig, rows: RowSettings, keys_B: jax.Array, logits_BV: jax.Array, prompt_BT: jax.Array,
                prompt_len_B: jax.Array, max_new_B: jax.Array) -> FirstToken:
    """Choose every row's first token from the prefill's logits and set up the output buffers."""
    b = prompt_BT.shape[0]
    counts = TokenCounts.of_prompts(prompt_BT, prompt_len_B, logits_BV.shape[-1]) if lc.penalties else None
    tok_B = choose_next(lc, rows, keys_B, logits_BV, counts, jnp.zeros((b,), jnp.int32))
    out_BO = jnp.zeros((b, lc.out_len), jnp.int32).at[:, 0].set(tok_B)
    count_B = jnp.minimum(max_new_B, 1)
    if counts is not None:
        counts = counts.add(tok_B[:, None], (count_B > 0)[:, None])
    logprobs = None
    if lc.logprobs >= 0:
        dst_B1 = jnp.where(count_B > 0, 0, lc.out_len)[:, None]
        logprobs = Logprobs.zeros(b, lc.out_len, lc.logprobs).write(dst_B1, logits_BV[:, None], tok_B[:, None])
    done_B = (count_B >= max_new_B) | is_stop(tok_B, rows.stop_ids_BS)
    return FirstToken(tok_B, out_BO, count_B, done_B, counts, logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainState:
    """The plain loop between steps: what a chunked run hands back and resumes from."""

    step: jax.Array
    cache: KVCache
    tok_B: jax.Array
    out_BO: jax.Array
    count_B: jax.Array
    done_B: jax.Array
    keys_B: jax.Array
    counts: TokenCounts | None
    logprobs: Logprobs | None


def plain_start(model: Decoder, lc: LoopConfig, rows: RowSettings, prompt_BT, prompt_len_B, max_new_B, seeds_B,
                fold_B) -> PlainState:
    """Prefill and the first token. Row b samples with its own key stream from (seeds_B[b], fold_B[b])."""
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    cache = model.init_cache(prompt_BT.shape[0], lc.cache_len)
    logits_BV, _, cache = prefill(model, lc, cache, prompt_BT, prompt_len_B)
    first = first_token(lc, rows, sub_B, logits_BV, prompt_BT, prompt_len_B, max_new_B)
    return PlainState(jnp.int32(1), cache, first.tok_B, first.out_BO, first.count_B, first.done_B, keys_B,
                      first.counts, first.logprobs)


def finished_one(exit_on_finish: jax.Array | None, done_at_entry_B: jax.Array, done_B: jax.Array) -> jax.Array:
    """A loop's early exit: exit_on_finish (traced bool, or None: never) and some row finished since the loop began."""
    if exit_on_finish is None:
        return jnp.bool_(False)
    return exit_on_finish & jnp.any(done_B & ~done_at_entry_B)


def plain_advance(model: Decoder, lc: LoopConfig, rows: RowSettings, max_new_B, state: PlainState,
                  until: jax.Array, exit_on_finish: jax.Array | None = None) -> PlainState:
    """Steps until step `until` or every row is done; with exit_on_finish true, also once a row finishes."""
    b = state.tok_B.shape[0]

    def cond(s: PlainState):
        return (s.step < until) & ~jnp.all(s.done_B) & ~finished_one(exit_on_finish, state.done_B, s.done_B)

    def body(s: PlainState):
        keys_B, sub_B = split_rows(s.keys_B, 2)
        h_B1D, _, cache = model.forward(s.tok_B[:, None], s.cache, attn_impl=lc.attn_impl)
        # Finished rows keep computing (fixed shapes) but stop advancing; a hybrid's done rows keep their state.
        active_B = ~s.done_B
        cache = cache.with_lengths(cache.lengths + active_B.astype(jnp.int32)).hold_rows(s.cache, s.done_B)
        logits_BV = model.logits(h_B1D)[:, 0]
        new_B = choose_next(lc, rows, sub_B, logits_BV, s.counts, s.count_B)
        new_B = jnp.where(s.done_B, s.tok_B, new_B)
        dst_B = jnp.where(s.done_B, lc.out_len, s.count_B)
        out_BO = s.out_BO.at[jnp.arange(b), dst_B].set(new_B, mode="drop")
        counts = None if s.counts is None else s.counts.add(new_B[:, None], active_B[:, None])
        logprobs = None if s.logprobs is None else s.logprobs.write(dst_B[:, None], logits_BV[:, None],
                                                                      new_B[:, None])
        count_B = s.count_B + active_B.astype(jnp.int32)
        done_B = s.done_B | (count_B >= max_new_B) | is_stop(new_B, rows.stop_ids_BS)
        return PlainState(s.step + 1, cache, new_B, out_BO, count_B, done_B, keys_B, counts, logprobs)

    return lax.while_loop(cond, body, state)


def outputs(state) -> tuple:
    """What a finished (or paused) loop hands the host: tokens [B, O], counts [B], steps, logprobs or None."""
    return state.out_BO, state.count_B, state.step, state.logprobs


@partial(jax.jit, static_argnames=("lc",))
def ar_generate(params: dict, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                seeds_B: jax.Array, fold_B: jax.Array, rows: RowSettings, *, lc: LoopConfig):
    """Generate up to max_new_B[b] tokens per row: (tokens [B, out_len], counts [B], steps, Logprobs or None).

    The cache is allocated inside the jit and carried through the loop, so it never
    crosses the jit boundary: XLA updates it in place with nothing to copy or donate.
    params: the target's weights as a dict (Target.params), merged into its Decoder module here.
    """
    model = merge(lc.model, params)
    state = plain_start(model, lc, rows, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B)
    return outputs(plain_advance(model, lc, rows, max_new_B, state, jnp.int32(lc.out_len)))


@partial(jax.jit, static_argnames=("lc",))
def ar_start(params: dict, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, rows: RowSettings, *,
             lc: LoopConfig) -> PlainState:
    """The chunked loop's first call: prefill and the first token (the state, cache included, comes back)."""
    return plain_start(merge(lc.model, params), lc, rows, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B)


@partial(jax.jit, static_argnames=("lc",), donate_argnames=("state",))
def ar_advance(params: dict, max_new_B, rows: RowSettings, state: PlainState, until: jax.Array, *,
               lc: LoopConfig) -> PlainState:
    """Resume the chunked loop until step `until`; the state is donated, so the cache is updated in place."""
    return plain_advance(merge(lc.model, params), lc, rows, max_new_B, state, until)
