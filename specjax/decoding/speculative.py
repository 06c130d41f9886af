"""The speculative loop: one jit around a `lax.while_loop` over rounds.

Each round: the drafter proposes a fixed-shape tree rooted at the last chosen token;
the target runs all N nodes in one forward pass (tree positions, ancestor mask); the
verifier picks the accepted path and a bonus token; the row emits them (cut at EOS or
its token budget, exactly where plain decoding would stop), the cache keeps the path,
and the drafter updates its state. Shapes never depend on acceptance.

With a prefix scheduler (`Scheduler`, specjax/decoding/scheduler.py) each round first decides from
the drafter's confidences how many drafts of each row to verify, then runs the verify pass at
the smallest compiled width that holds them (`lax.switch` over widths 1, 2, 4, ..., N, each
branch its own fixed shape), so the target's compute follows what was admitted.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.config import SamplingConfig
from specjax.decoding.decode import Logprobs, LoopConfig, RowSettings, finished_one, first_token, is_stop, prefill
from specjax.decoding.drafter import Drafter, PrefillContext, Settings, accepted_tokens
from specjax.decoding.penalties import TokenCounts, forbid_stops, penalise_tree
from specjax.decoding.request import GenerateOutput, LoopResult, Options, finish, prepare, run_loop, timing_context
from specjax.decoding.sampling import row_keys, split_rows
from specjax.decoding.scheduler import cost_table, prefix_schedule, verify_widths, width_for, width_schedule
from specjax.decoding.stats import SpecStats, emitted_only, record_round, record_width, summarize
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, ancestor_mask, depths
from specjax.decoding.verify import Draft, Verdict, verify
from specjax.models.decoder import POST_NORM, Decoder
from specjax.models.model import merge
from specjax.models.target import Target
from specjax.multihost import agreed, to_host

SCHEDULERS = ("confidence", "prefix")


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Static configuration of the prefix scheduler (part of the compiled loop's key).

    mode "confidence": `width_schedule`, the best compiled width for expected tokens per second
    actually paid (the default); "prefix": `prefix_schedule`, DSpark's Algorithm 1 verbatim, then the
    smallest width holding its prefixes. widths: the compiled verify widths, root included.
    """

    mode: str
    widths: tuple[int, ...]


def verify_pass(model: Decoder, lc: LoopConfig, draft: Draft, mask_BNN: jax.Array, depth_BN: jax.Array, cache,
                features: tuple[int, ...], keys_B: jax.Array, rows: RowSettings | None = None,
                counts: TokenCounts | None = None, count_B: jax.Array | None = None):
    """The target's forward over every node of `draft` (its ancestor mask and depths given) and the verdict:
    (Verdict, node features, cache, the raw logits along the accepted path [B, N, V] or None without logprobs).

    With penalties each node's logits are penalised with the counts its own path adds (penalties.penalise_tree)
    and min_tokens applies at the node's output position (count_B + its depth)."""
    positions_BN = cache.lengths[:, None] + depth_BN
    h_BND, node_features, cache = model.forward(draft.tokens, cache, positions_BT=positions_BN, mask_BTT=mask_BNN,
                                                capture=features, attn_impl=lc.attn_impl, provisional=True)
    raw_BNV = model.logits(h_BND)
    logits_BNV = raw_BNV
    if lc.penalties:
        logits_BNV = forbid_stops(penalise_tree(raw_BNV, counts, rows.penalties, draft.tokens, mask_BNN),
                                  count_B[:, None] + depth_BN, rows.stop_ids_BS, rows.penalties.min_tokens)
    verdict = verify(draft, mask_BNN, logits_BNV, lc.sampling(rows), keys_B)
    path_raw_BNV = jnp.take_along_axis(raw_BNV, verdict.path[:, :, None], axis=1) if lc.logprobs >= 0 else None
    return verdict, node_features, cache, path_raw_BNV


def narrow_pass(width: int, model: Decoder, lc: LoopConfig, features: tuple[int, ...], draft: Draft,
                mask_BNN: jax.Array, depth_BN: jax.Array, cache, keys_B: jax.Array, rows, counts, count_B):
    """`verify_pass` over the first `width` nodes of a chain (one lax.switch branch), padded back to N nodes."""
    n = draft.tokens.shape[1]
    narrow = jax.tree.map(lambda x: x[:, :width], draft)
    verdict, node_features, cache, path_raw = verify_pass(model, lc, narrow, mask_BNN[:, :width, :width],
                                                          depth_BN[:, :width], cache, features, keys_B, rows, counts,
                                                          count_B)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n - width)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return (Verdict(pad(verdict.path), verdict.num_accepted, verdict.bonus), tuple(map(pad, node_features)),
            cache.padded_nodes(n), None if path_raw is None else pad(path_raw))


def admit(draft: Draft, active_B: jax.Array, left_B: jax.Array, seconds_T: jax.Array,
          sched: Scheduler) -> tuple[Draft, jax.Array]:
    """The scheduler's admission: (the draft with nodes past each row's admitted prefix invalid, width index).

    Confidence is zeroed where a draft cannot count: invalid nodes, and drafts past the row's remaining
    token budget (left_B tokens can hold at most left_B - 1 drafts and the bonus). Admission reads only
    confidences, activity and budgets, never this round's target outputs, so it keeps verification lossless.
    """
    if draft.confidence is None:
        raise ValueError(f"scheduler={sched.mode!r} needs a drafter that reports confidences (Draft.confidence, e.g. "
                         f"DSpark, or replay_drafter(..., confidence=True)); this drafter does not: drop scheduler=")
    n = draft.tokens.shape[1]
    j_K = jnp.arange(1, n)
    usable_BK = draft.valid[:, 1:] & (j_K[None, :] < left_B[:, None])
    conf_BK = jnp.where(usable_BK, draft.confidence[:, 1:], 0.0)
    if sched.mode == "prefix":
        len_B = prefix_schedule(conf_BK, active_B, seconds_T)
        choice = width_for(len_B, sched.widths)
    else:
        choice, len_B = width_schedule(conf_BK, active_B, seconds_T, sched.widths)
    # Never past the last draft with a nonzero chance (a = 0 adds nothing; past the budget or the draft's end).
    useful_B = jnp.sum(jnp.cumprod(conf_BK > 0, axis=1), axis=1, dtype=jnp.int32)
    len_B = jnp.minimum(len_B, useful_B)
    valid_BN = draft.valid & (jnp.arange(n)[None, :] <= len_B[:, None])
    return dataclasses.replace(draft, valid=valid_BN), choice


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """The speculative loop between rounds: what a chunked run hands back and resumes from."""

    step: jax.Array
    cache: Any
    root_B: jax.Array
    out_BO: jax.Array
    round_BO: jax.Array  # the round that emitted each token (0 = prefill)
    depth_BO: jax.Array  # an emitted draft's depth in its round's tree; 0 for a bonus (or the prefill's) token
    count_B: jax.Array
    done_B: jax.Array
    dstate: Any
    keys_B: jax.Array
    stats: SpecStats
    counts: TokenCounts | None
    logprobs: Logprobs | None


def start_rows(model: Decoder, lc: LoopConfig, rows: RowSettings, drafter: Drafter | None, draft_params, prompt_BT,
               prompt_len_B, max_new_B, seeds_B, fold_B):
    """What every speculative start does (the loop's, the engine's prefill): per-row keys, the prefilled cache, the
    first token (FirstToken) and the drafter's init over the prompt (None without a drafter)."""
    cache = model.init_cache(prompt_BT.shape[0], lc.cache_len)
    capture = () if drafter is None else drafter.feature_layers
    logits_BV, prompt_features, cache = prefill(model, lc, cache, prompt_BT, prompt_len_B, capture=capture)
    keys_B, first, dstate = first_and_init(lc, rows, drafter, draft_params, logits_BV, prompt_features, prompt_BT,
                                           prompt_len_B, max_new_B, seeds_B, fold_B)
    return keys_B, cache, first, dstate


def first_and_init(lc: LoopConfig, rows: RowSettings, drafter: Drafter | None, draft_params, logits_BV,
                   prompt_features, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B):
    """After a prefill (whole, or the last piece of a chunked one): per-row keys, the first token and the drafter's
    init over the whole prompt and its features."""
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    first = first_token(lc, rows, sub_B, logits_BV, prompt_BT, prompt_len_B, max_new_B)
    dstate = None if drafter is None else drafter.init(draft_params, PrefillContext(prompt_BT, prompt_len_B,
                                                                                    first.tok_B, prompt_features))
    return keys_B, first, dstate


def spec_start(model: Decoder, lc: LoopConfig, rows: RowSettings, drafter: Drafter, draft_params, prompt_BT,
               prompt_len_B, max_new_B, seeds_B, fold_B) -> SpecState:
    """Prefill (capturing the drafter's features), the first token and the drafter's init."""
    tree = drafter.settings.tree
    keys_B, cache, first, dstate = start_rows(model, lc, rows, drafter, draft_params, prompt_BT, prompt_len_B,
                                              max_new_B, seeds_B, fold_B)
    zeros_BO = jnp.zeros_like(first.out_BO)
    return SpecState(jnp.int32(0), cache, first.tok_B, first.out_BO, zeros_BO, zeros_BO, first.count_B, first.done_B,
                     dstate, keys_B, SpecStats.zeros(prompt_BT.shape[0], tree.max_depth, tree.num_nodes),
                     first.counts, first.logprobs)


def spec_advance(model: Decoder, lc: LoopConfig, rows: RowSettings, drafter: Drafter, draft_params, max_new_B,
                 seconds_T, sched: Scheduler | None, state: SpecState, until: jax.Array,
                 exit_on_finish: jax.Array | None = None) -> SpecState:
    """Rounds until round `until` or every row is done; with exit_on_finish (a traced bool) true, also as soon as a
    row finishes (the engine's chunk, when a request waits for its slot)."""
    b, n = state.root_B.shape[0], drafter.settings.tree.num_nodes
    features = drafter.feature_layers
    rows_B1, i_N = jnp.arange(b)[:, None], jnp.arange(n)

    def cond(s: SpecState):
        return (s.step < until) & ~jnp.all(s.done_B) & ~finished_one(exit_on_finish, state.done_B, s.done_B)

    def body(s: SpecState):
        keys_B, k_draft_B, k_verify_B = split_rows(s.keys_B, 3)
        draft, dstate = drafter.propose(draft_params, s.dstate, s.root_B, k_draft_B, lc.sampling(rows))
        active_B = ~s.done_B
        mask_BNN = ancestor_mask(draft.parents)
        depth_BN = depths(mask_BNN)
        stats = s.stats
        judged = (k_verify_B, rows, s.counts, s.count_B)
        if sched is None:
            verdict, node_features, cache, path_raw = verify_pass(model, lc, draft, mask_BNN, depth_BN, s.cache,
                                                                  features, *judged)
        else:
            draft, choice = admit(draft, active_B, max_new_B - s.count_B, seconds_T, sched)
            branches = [partial(narrow_pass, w, model, lc, features) for w in sched.widths]
            verdict, node_features, cache, path_raw = lax.switch(choice, branches, draft, mask_BNN, depth_BN,
                                                                 s.cache, *judged)
            stats = record_width(stats, jnp.asarray(sched.widths, jnp.int32)[choice])
        verdict = Verdict(verdict.path, jnp.where(active_B, verdict.num_accepted, 0), verdict.bonus)

        # Emit accepted drafts + bonus, cut after the first stop token and at the row's budget.
        new_BN = accepted_tokens(draft, verdict)
        stop_BN = is_stop(new_BN, rows.stop_ids_BS) & (i_N[None, :] < verdict.num_accepted[:, None])
        has_stop_B = jnp.any(stop_BN, axis=-1)
        emit_B = jnp.where(has_stop_B, jnp.argmax(stop_BN, axis=-1) + 1, verdict.num_accepted)
        emit_B = jnp.minimum(emit_B, max_new_B - s.count_B)
        emitted_BN = i_N[None, :] < emit_B[:, None]
        dst_BN = jnp.where(emitted_BN, s.count_B[:, None] + i_N[None, :], lc.out_len)
        out_BO = s.out_BO.at[rows_B1, dst_BN].set(new_BN, mode="drop")
        round_BO = s.round_BO.at[rows_B1, dst_BN].set(s.step + 1, mode="drop")
        draft_depth_BN = jnp.where(i_N[None, :] < verdict.num_accepted[:, None] - 1, i_N[None, :] + 1, 0)
        depth_BO = s.depth_BO.at[rows_B1, dst_BN].set(draft_depth_BN, mode="drop")
        counts = None if s.counts is None else s.counts.add(new_BN, emitted_BN)
        logprobs = None if s.logprobs is None else s.logprobs.write(dst_BN, path_raw, new_BN)
        count_B = s.count_B + emit_B
        done_B = s.done_B | has_stop_B | (count_B >= max_new_B)
        stats = record_round(stats, draft, depth_BN, verdict, active_B, emit_B)

        cache = cache.commit(verdict.path, verdict.num_accepted)
        root_B = jnp.where(active_B, verdict.bonus, s.root_B)
        dstate = drafter.update(draft_params, dstate, draft, verdict, node_features)
        return SpecState(s.step + 1, cache, root_B, out_BO, round_BO, depth_BO, count_B, done_B, dstate, keys_B,
                         stats, counts, logprobs)

    return lax.while_loop(cond, body, state)


def spec_outputs(state: SpecState) -> tuple:
    """What the host reads: tokens, rounds and depths [B, O], counts [B], SpecStats, Logprobs or None."""
    return state.out_BO, state.round_BO, state.depth_BO, state.count_B, state.stats, state.logprobs


@partial(jax.jit, static_argnames=("lc", "drafter", "sched"))
def spec_generate(params: dict, draft_params, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                  seeds_B: jax.Array, fold_B: jax.Array, rows: RowSettings, seconds_T: jax.Array | None = None, *,
                  lc: LoopConfig, drafter: Drafter, sched: Scheduler | None = None):
    """Speculative decoding of up to max_new_B[b] tokens per row, whole, in one jit (see spec_outputs).

    Row b draws from its own key stream (seeds_B[b], fold_B[b]), for drafting and verifying alike.
    With `sched`, seconds_T [B x N + 1] is the verify cost curve the scheduler optimises (seconds of a
    pass with t tokens).
    """
    model = merge(lc.model, params)  # the target's Decoder over its weights dict (Target.params)
    state = spec_start(model, lc, rows, drafter, draft_params, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B)
    return spec_outputs(spec_advance(model, lc, rows, drafter, draft_params, max_new_B, seconds_T, sched, state,
                                     jnp.int32(lc.out_len)))


@partial(jax.jit, static_argnames=("lc", "drafter", "sched"))
def spec_start_jit(params, draft_params, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, rows: RowSettings,
                   seconds_T: jax.Array | None = None, *, lc: LoopConfig, drafter: Drafter,
                   sched: Scheduler | None = None) -> SpecState:
    """The chunked loop's first call (spec_start); the state, caches included, comes back. It takes spec_generate's
    arguments (the scheduler's are used by spec_advance_jit only)."""
    del seconds_T, sched
    return spec_start(merge(lc.model, params), lc, rows, drafter, draft_params, prompt_BT, prompt_len_B, max_new_B,
                      seeds_B, fold_B)


@partial(jax.jit, static_argnames=("lc", "drafter", "sched"), donate_argnames=("state",))
def spec_advance_jit(params, draft_params, max_new_B, rows: RowSettings, seconds_T, state: SpecState,
                     until: jax.Array, *, lc: LoopConfig, drafter: Drafter, sched: Scheduler | None = None
                     ) -> SpecState:
    """Resume the chunked loop until round `until`; the state is donated, so the caches are updated in place."""
    return spec_advance(merge(lc.model, params), lc, rows, drafter, draft_params, max_new_B, seconds_T, sched, state,
                        until)


def speculative_generate(target: Target, prompts: Sequence, drafter: Drafter, *, max_new_tokens: int,
                         sampling: SamplingConfig, seed, spec: TreeSpec | DynamicTreeSpec, eos_token_id,
                         max_len: int | None, scheduler: str | None = None,
                         scheduler_cost: Callable | None = None, token_bucket: int = 0,
                         options: Options | None = None) -> GenerateOutput:
    """`specjax.generate` with a drafter: same arguments, same outputs, plus acceptance statistics.

    scheduler: see `generate`; None runs every draft node every round. scheduler_cost(batch, widths,
    context) gives the verify cost model it optimises (`generate` resolves scheduler_profile= into it,
    specjax/planning/scheduler_cost.py); None there means the roofline of this device. token_bucket: see prepare.
    """
    check_drafter_fits(drafter, target)
    if scheduler is not None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS} or None, got {scheduler!r}")
        if not isinstance(spec, TreeSpec) or not spec.is_chain:
            raise ValueError(f"scheduler={scheduler!r} verifies prefixes of a chain: pass num_draft_tokens=K, "
                             f"not a tree")
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, seed,
                  draft_nodes=spec.cache_slots, token_bucket=token_bucket, options=options)
    runner = spec_runner(target, req, drafter, spec, scheduler, scheduler_cost)
    outputs, compile_s, run_s, run = runner.run()
    return runner.finish(outputs, compile_s, run_s, run)


@dataclasses.dataclass
class SpecRunner:
    """One speculative call made ready to run: the configured drafter, the loop's arguments and key."""

    target: Target
    req: Any
    drafter: Drafter  # configured
    spec: TreeSpec | DynamicTreeSpec
    key: tuple
    arrays: Any  # request.LoopArrays
    seconds_T: jax.Array | None  # the scheduler's cost curve, or None
    static: dict
    sched_info: dict

    def run(self, texts=None):
        """Whole, or a ChunkedRun to iterate (stop strings, streaming): see request.run_loop."""
        params, draft_params, a = self.target.params, self.drafter.params, self.arrays
        args = (params, draft_params, *a) + (() if self.seconds_T is None else (self.seconds_T,))
        return run_loop(self.target, self.req, self.key, spec_generate, spec_start_jit, spec_advance_jit, args,
                        lambda state, until: (params, draft_params, a.max_new_B, a.rows, self.seconds_T, state, until),
                        self.static, first_step=0, texts=texts)

    def finish(self, outputs, compile_s: float, run_s: float, run=None) -> GenerateOutput:
        if not isinstance(outputs, tuple):
            outputs = spec_outputs(outputs)
        out_BO, round_BO, depth_BO, count_B, stats, logprobs = to_host(outputs)
        n_rows = len(self.req.ids)
        if run is not None and np.any(run.kept < count_B[:n_rows]):
            stats = emitted_only(stats, round_BO, depth_BO, run.kept)
        summary = summarize(stats, n_rows, self.drafter.calls_per_round())
        extra = {"scheduler": self.sched_info} if self.sched_info else {}
        return finish(self.target, self.req, LoopResult(out_BO, count_B, logprobs, round_BO, stats), compile_s, run_s,
                      {**summary, "tree_nodes": self.spec.num_nodes, **extra}, None if run is None else run.rows)


def spec_runner(target: Target, req, drafter: Drafter, spec, scheduler: str | None,
                scheduler_cost: Callable | None) -> SpecRunner:
    """Configure the drafter for `req` and, with a scheduler, price its verify widths."""
    configured = drafter.configure(Settings(spec, req.lc.drafting, req.lc.cache_len, req.lc.out_len))
    key, seconds_T, static, sched_info = ("spec", req.lc, configured, req.prompt_BT.shape), None, {}, {}
    if scheduler is not None:
        sched = Scheduler(scheduler, verify_widths(spec.num_nodes))
        batch = req.prompt_BT.shape[0]
        if scheduler_cost is None:
            raise ValueError("scheduler= needs its verify cost model: pass scheduler_cost=")
        cost = scheduler_cost(batch, sched.widths, timing_context(req.ids, req.max_new_B.max()))
        # The drafter drafts all K every round whatever is admitted: its time is a fixed part of the round.
        overhead = cost.draft_s(batch, spec.num_nodes - 1)
        # timed on each process: one table for all of them (specjax/multihost.py agreed)
        seconds_T = jnp.asarray(agreed(np.asarray(cost_table(cost.verify_s, batch, spec.num_nodes, overhead))))
        static, key = {"sched": sched}, (*key, sched)
        sched_info = {"mode": scheduler, "widths": list(sched.widths), "cost": cost.source,
                      "round_overhead_s": overhead}
    return SpecRunner(target, req, configured, spec, key, req.arrays(), seconds_T,
                      {"lc": req.lc, "drafter": configured, **static}, sched_info)


def check_drafter_fits(drafter: Drafter, target: Target) -> None:
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != target.cfg.vocab_size:
        raise ValueError(f"drafter '{drafter.name}' has a vocabulary of {vocab} tokens but the target has "
                         f"{target.cfg.vocab_size}; a drafter must share the target's tokenizer")
    bad = [i for i in drafter.feature_layers if not (0 <= i <= target.cfg.num_layers or i == POST_NORM)]
    if bad:
        raise ValueError(f"drafter '{drafter.name}' asks for target hidden states {bad}, but the target has "
                         f"{target.cfg.num_layers} layers (valid: 0..{target.cfg.num_layers}, or {POST_NORM}: after the final norm)")

