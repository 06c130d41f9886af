"""The engine's device state, one row per decode slot, and the jitted operations on it.

`Slots` holds what the speculative loop carries between rounds (specjax/decoding/speculative.py `SpecState`:
caches, roots, output buffers, per-row keys, token counts, logprobs, the drafter's state) for `max_slots` rows,
plus `EngineStats`, acceptance counts that do not depend on the draft shape (a `SpecStats` is shaped by its tree,
so each chunk starts a fresh one and adds it here). Every operation is generic over the target and the drafter:
the batch axis of each leaf is found once by tracing the prefill at two batch sizes (`batch_axes`), so a stacked
cache ([L, B, S, H, D]), a hybrid's recurrent state or any drafter's state are moved the same way.

Live slots are kept at the lowest indices (the engine moves the last live row into a freed slot), so a chunk runs
on the first `nb` rows only (`nb` the occupancy bucket, a power of two): compute follows the live load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from specjax.decoding.decode import Logprobs, LoopConfig, PlainState, RowSettings, plain_advance
from specjax.decoding.decode import prefill as target_prefill
from specjax.decoding.drafter import Drafter, PrefillContext
from specjax.decoding.request import round_cache_length
from specjax.decoding.penalties import TokenCounts
from specjax.decoding.speculative import Scheduler, SpecState, first_and_init, spec_advance, start_rows
from specjax.decoding.stats import SpecStats
from specjax.models.model import merge


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Acceptance counts across draft shapes: per row since its request was inserted; per depth, per (depth, sibling
    rank) and in row-rounds since the start (the load policy's acceptance, learned from every chunk's increment)."""

    rounds_B: jax.Array  # int32 [B]: speculative rounds the row was active in
    emitted_B: jax.Array  # int32 [B]: tokens emitted in those rounds
    accepted_B: jax.Array  # int32 [B]: emitted tokens that were drafts
    offered_D: jax.Array  # int32 [D]: draft nodes offered at depth d + 1
    accepted_D: jax.Array  # int32 [D]: drafts accepted and emitted at depth d + 1
    verified_rank_DR: jax.Array  # int32 [D, R]: drafts at depth d + 1, rank r among siblings, the target accepted
    row_rounds: jax.Array  # int32 []: active row-rounds (each row's rounds, summed)

    @classmethod
    def zeros(cls, batch: int, depth: int, ranks: int) -> "EngineStats":
        z = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        return cls(z(batch), z(batch), z(batch), z(depth), z(depth), z(depth, ranks), z())

    def add(self, s: SpecStats) -> "EngineStats":
        pad = lambda x: jnp.pad(x, (0, self.offered_D.shape[0] - x.shape[0]))  # noqa: E731
        d, r = self.verified_rank_DR.shape
        verified_DR = s.verified_rank_DR[:d, :r]
        verified_DR = jnp.pad(verified_DR, ((0, d - verified_DR.shape[0]), (0, r - verified_DR.shape[1])))
        return EngineStats(self.rounds_B + s.rounds_B, self.emitted_B + s.emitted_B, self.accepted_B + s.accepted_B,
                           self.offered_D + pad(s.offered_D), self.accepted_D + pad(s.accepted_D),
                           self.verified_rank_DR + verified_DR, self.row_rounds + jnp.sum(s.rounds_B))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Every slot's loop state (SpecState's fields without its shape-bound SpecStats) and EngineStats."""

    step: jax.Array
    cache: Any
    root_B: jax.Array
    out_BO: jax.Array
    round_BO: jax.Array
    depth_BO: jax.Array
    count_B: jax.Array
    done_B: jax.Array
    dstate: Any
    keys_B: jax.Array
    counts: TokenCounts | None
    logprobs: Logprobs | None
    stats: EngineStats


def slots_of(state: SpecState, stats: EngineStats) -> Slots:
    return Slots(state.step, state.cache, state.root_B, state.out_BO, state.round_BO, state.depth_BO, state.count_B,
                 state.done_B, state.dstate, state.keys_B, state.counts, state.logprobs, stats)


def prefill(params, draft_params, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, rows: RowSettings, *,
            lc: LoopConfig, drafter: Drafter | None, depth: int, ranks: int) -> Slots:
    """Prefill new requests (their first token, the drafter's init): rows ready to insert into the slots."""
    keys_B, cache, first, dstate = start_rows(merge(lc.model, params), lc, rows, drafter, draft_params, prompt_BT,
                                              prompt_len_B, max_new_B, seeds_B, fold_B)
    zeros_BO = jnp.zeros_like(first.out_BO)
    return Slots(jnp.int32(0), cache, first.tok_B, first.out_BO, zeros_BO, zeros_BO, first.count_B, first.done_B,
                 dstate, keys_B, first.counts, first.logprobs, EngineStats.zeros(prompt_BT.shape[0], depth, ranks))


def batch_axes(shapes_small, shapes_large) -> tuple[int | None, ...]:
    """Each leaf's batch axis (the one axis whose size differs between two traces at different batch sizes), or
    None for a leaf shared by all rows (the round counter)."""
    axes = []
    for a, b in zip(jax.tree.leaves(shapes_small), jax.tree.leaves(shapes_large)):
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(differ) > 1:
            raise ValueError(f"a loop-state leaf of shapes {a.shape} and {b.shape} grows with the batch along "
                             f"several axes; the engine moves rows along one")
        axes.append(differ[0] if differ else None)
    return tuple(axes)


def _leafwise(fn, axes: tuple, *trees):
    """Apply fn(axis, *leaves) to every leaf of `trees` (one structure), rebuilding the first tree's structure."""
    flat = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    return jax.tree.unflatten(treedef, [fn(a, *leaves) for a, *leaves in zip(axes, *flat)])


def _index(axis: int, idx) -> tuple:
    return (slice(None),) * axis + (idx,)


def first_rows(slots, nb: int, axes: tuple):
    """The first nb rows of every batched leaf (nb static)."""
    return _leafwise(lambda a, x: x if a is None else lax.slice_in_dim(x, 0, nb, axis=a), axes, slots)


def put_first_rows(slots, rows, axes: tuple):
    """`slots` with its first rows replaced by `rows` (leaves shared by all rows taken from `rows`)."""
    return _leafwise(lambda a, x, r: r if a is None else lax.dynamic_update_slice_in_dim(x, r, 0, axis=a), axes,
                     slots, rows)


def insert(slots, new, dst_P: jax.Array, axes: tuple):
    """Scatter the P rows of `new` into `slots` at rows dst_P (an index past the slots drops that row); shared
    leaves keep the slots' value."""
    return _leafwise(lambda a, x, n: x if a is None else x.at[_index(a, dst_P)].set(n, mode="drop"), axes, slots, new)


def insert_target(slots: Slots, new: Slots, dst_P: jax.Array, axes: tuple) -> Slots:
    """insert() of rows prefilled without the drafter (`new.dstate` None; `axes` those of such rows): every field
    but the drafter state, whose rows at dst_P stay stale until a catch-up replaces them."""
    merged = insert(dataclasses.replace(slots, dstate=None), new, dst_P, axes)
    return dataclasses.replace(merged, dstate=slots.dstate)


def move(slots: Slots, src: jax.Array, dst: jax.Array, axes: tuple) -> Slots:
    """Row src copied to row dst (the engine's compaction); row src is then marked done (free)."""
    moved = _leafwise(lambda a, x: x if a is None else x.at[_index(a, dst)].set(x[_index(a, src)]), axes, slots)
    return dataclasses.replace(moved, done_B=moved.done_B.at[src].set(True))


def mark_done(slots: Slots, done_B: jax.Array) -> Slots:
    return dataclasses.replace(slots, done_B=slots.done_B | done_B)


def spec_chunk(params, draft_params, max_new_B, rows: RowSettings, slots: Slots, rounds, exit_on_finish,
               seconds_T=None, *, lc: LoopConfig, drafter: Drafter, nb: int, axes: tuple,
               sched: Scheduler | None = None) -> Slots:
    """Up to `rounds` speculative rounds over the first nb slots (max_new_B and rows are theirs), ending early when
    exit_on_finish and a row finishes. A fresh SpecStats for this chunk's shape is added to EngineStats. With
    `sched` (and its cost curve seconds_T), the prefix scheduler admits each round's drafts across all these slots
    from the drafter's confidences (DSpark's Algorithm 1 or the width rule: specjax/decoding/scheduler.py)."""
    sub = first_rows(slots, nb, axes)
    tree = drafter.settings.tree
    state = SpecState(sub.step, sub.cache, sub.root_B, sub.out_BO, sub.round_BO, sub.depth_BO, sub.count_B,
                      sub.done_B, sub.dstate, sub.keys_B, SpecStats.zeros(nb, tree.max_depth, tree.num_nodes),
                      sub.counts, sub.logprobs)
    state = spec_advance(merge(lc.model, params), lc, rows, drafter, draft_params, max_new_B, seconds_T, sched, state,
                         state.step + rounds, exit_on_finish)
    return put_first_rows(slots, slots_of(state, sub.stats.add(state.stats)), axes)


def plain_chunk(params, max_new_B, rows: RowSettings, slots: Slots, rounds, exit_on_finish, *, lc: LoopConfig,
                nb: int, axes: tuple) -> Slots:
    """Up to `rounds` plain steps over the first nb slots: speculation off, no drafter pass (its state goes stale
    and is caught up when speculation resumes)."""
    sub = first_rows(slots, nb, axes)
    state = PlainState(sub.step, sub.cache, sub.root_B, sub.out_BO, sub.count_B, sub.done_B, sub.keys_B, sub.counts,
                       sub.logprobs)
    state = plain_advance(merge(lc.model, params), lc, rows, max_new_B, state, state.step + rounds, exit_on_finish)
    sub = dataclasses.replace(sub, step=state.step, cache=state.cache, root_B=state.tok_B, out_BO=state.out_BO,
                              count_B=state.count_B, done_B=state.done_B, keys_B=state.keys_B, counts=state.counts,
                              logprobs=state.logprobs)
    return put_first_rows(slots, sub, axes)


def snapshot(slots: Slots) -> tuple:
    """What the host reads after a chunk, as copies (the slots are donated to the next operation)."""
    return (slots.out_BO, slots.count_B, slots.done_B, slots.step, slots.stats, slots.logprobs)


def catch_up(params, draft_params, seq_BT, seq_len_B, slot_root_B, dst_P, *, lc: LoopConfig, drafter: Drafter):
    """A drafter state for rows that decoded with speculation off: the drafter's init over each row's whole
    sequence so far (prompt and output before the root), with the target's features over it from a forward into a
    scratch cache (dropped: the slots' own cache is never rewritten). This is what resuming speculation costs.
    Each row's root is its slot's (`slot_root_B` at dst_P; a row admitted while off may not have been read yet, its
    first token known only here; a padding row's dst past the slots reads 0)."""
    root_B = slot_root_B.at[dst_P].get(mode="fill", fill_value=0)
    features = ()
    if drafter.feature_layers:
        model = merge(lc.model, params)
        scratch = model.init_cache(seq_BT.shape[0], round_cache_length(seq_BT.shape[1]))
        _, features, _ = target_prefill(model, lc, scratch, seq_BT, seq_len_B, capture=drafter.feature_layers)
    return drafter.init(draft_params, PrefillContext(seq_BT, seq_len_B, root_B, features))


# ---- chunked prefill: a long prompt enters its slot piece by piece, between chunks ----------------------------


def _row(cache, slot, cache_axes: tuple):
    """Row `slot` of every batched cache leaf (a batch of one)."""
    return _leafwise(lambda a, x: x if a is None else lax.dynamic_slice_in_dim(x, slot, 1, axis=a), cache_axes, cache)


def _put_row(cache, row, slot, cache_axes: tuple):
    return _leafwise(lambda a, x, r: r if a is None else lax.dynamic_update_slice_in_dim(x, r, slot, axis=a),
                     cache_axes, cache, row)


def _piece(model, lc: LoopConfig, row, piece_1T, piece_len_1, capture: tuple[int, ...]):
    """Run one piece of a prompt after what the row's cache holds; the cache's length advances by the piece."""
    h_1TD, captured, row = model.forward(piece_1T, row, capture=capture, attn_impl=lc.attn_impl,
                                         num_valid_B=piece_len_1)
    return h_1TD, captured, row.with_lengths(row.lengths + piece_len_1)


def extend(params, slots: Slots, slot, piece_1C, offset, features, *, lc: LoopConfig, cache_axes: tuple,
           capture: tuple[int, ...], first: bool, prompt_bucket: int):
    """A full piece (C tokens) of a long prompt into row `slot` (its row starts empty when `first`), the drafter's
    features over it kept in `features` ([1, prompt_bucket, D] per feature layer, allocated by the first piece) at
    `offset`. The row stays done: chunks over the slots skip it until `finish_prefill`."""
    model = merge(lc.model, params)
    row = model.init_cache(1, lc.cache_len) if first else _row(slots.cache, slot, cache_axes)
    c = piece_1C.shape[1]
    _, captured, row = _piece(model, lc, row, piece_1C, jnp.full((1,), c, jnp.int32), capture)
    if first:
        features = tuple(jnp.zeros((1, prompt_bucket, f.shape[-1]), f.dtype) for f in captured)
    features = tuple(lax.dynamic_update_slice_in_dim(f, x, offset, axis=1) for f, x in zip(features, captured))
    return dataclasses.replace(slots, cache=_put_row(slots.cache, row, slot, cache_axes)), features


def finish_prefill(params, draft_params, slots: Slots, slot, piece_1T, piece_len_1, offset, features, prompt_1P,
                   prompt_len_1, max_new_1, seeds_1, fold_1, rows: RowSettings, *, lc: LoopConfig,
                   drafter: Drafter | None, depth: int, ranks: int, axes: tuple, cache_axes: tuple):
    """The last piece of a long prompt: then, as a whole prefill would, the first token (penalty counts over the
    whole prompt) and the drafter's init over the whole prompt and its features; the row is inserted, decoding."""
    model = merge(lc.model, params)
    capture = () if drafter is None else drafter.feature_layers
    h_1TD, captured, row = _piece(model, lc, _row(slots.cache, slot, cache_axes), piece_1T, piece_len_1, capture)
    last_11D = jnp.take_along_axis(h_1TD, (piece_len_1 - 1)[:, None, None], axis=1)
    logits_1V = model.logits(last_11D)[:, 0]
    features = tuple(lax.dynamic_update_slice_in_dim(f, x, offset, axis=1) for f, x in zip(features, captured))
    keys_1, first, dstate = first_and_init(lc, rows, drafter, draft_params, logits_1V, features, prompt_1P,
                                           prompt_len_1, max_new_1, seeds_1, fold_1)
    zeros_1O = jnp.zeros_like(first.out_BO)
    new = Slots(jnp.int32(0), row, first.tok_B, first.out_BO, zeros_1O, zeros_1O, first.count_B, first.done_B, dstate,
                keys_1, first.counts, first.logprobs, EngineStats.zeros(1, depth, ranks))
    return insert(slots, new, slot[None], axes)
