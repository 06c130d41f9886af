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
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.config import SamplingConfig
from specjax.decoding.decode import LoopConfig, first_token_state, is_eos, prefill
from specjax.decoding.drafter import Drafter, PrefillContext, Settings, accepted_tokens
from specjax.decoding.request import GenerateOutput, finish, prepare, run_compiled, timing_context
from specjax.decoding.sampling import choose_token, row_keys, split_rows
from specjax.decoding.scheduler import cost_table, prefix_schedule, verify_widths, width_for, width_schedule
from specjax.decoding.stats import SpecStats, record_round, record_width, summarize
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, ancestor_mask, depths
from specjax.decoding.verify import Draft, Verdict, verify
from specjax.models.decoder import POST_NORM, Decoder
from specjax.models.model import merge
from specjax.models.target import Target

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
                features: tuple[int, ...], keys_B: jax.Array):
    """The target's forward over every node of `draft` (its ancestor mask and depths given) and the verdict:
    (Verdict, node features, cache)."""
    positions_BN = cache.lengths[:, None] + depth_BN
    h_BND, node_features, cache = model.forward(draft.tokens, cache, positions_BT=positions_BN, mask_BTT=mask_BNN,
                                                capture=features, attn_impl=lc.attn_impl, provisional=True)
    verdict = verify(draft, mask_BNN, model.logits(h_BND), lc.sampling, keys_B)
    return verdict, node_features, cache


def narrow_pass(width: int, model: Decoder, lc: LoopConfig, features: tuple[int, ...], draft: Draft,
                mask_BNN: jax.Array, depth_BN: jax.Array, cache, keys_B: jax.Array):
    """`verify_pass` over the first `width` nodes of a chain (one lax.switch branch), padded back to N nodes."""
    n = draft.tokens.shape[1]
    narrow = jax.tree.map(lambda x: x[:, :width], draft)
    verdict, node_features, cache = verify_pass(model, lc, narrow, mask_BNN[:, :width, :width],
                                                depth_BN[:, :width], cache, features, keys_B)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n - width)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return (Verdict(pad(verdict.path), verdict.num_accepted, verdict.bonus), tuple(map(pad, node_features)),
            cache.padded_nodes(n))


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


@partial(jax.jit, static_argnames=("lc", "drafter", "sched"))
def spec_generate(params: dict, draft_params, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                  seeds_B: jax.Array, fold_B: jax.Array, seconds_T: jax.Array | None = None, *, lc: LoopConfig,
                  drafter: Drafter, sched: Scheduler | None = None):
    """Speculative decoding of up to max_new_B[b] tokens per row.

    Row b draws from its own key stream (seeds_B[b], fold_B[b]), for drafting and verifying alike.
    With `sched`, seconds_T [B x N + 1] is the verify cost curve the scheduler optimises (seconds of a
    pass with t tokens). Returns (tokens [B, out_len], the round that emitted each token [B, out_len]
    (0 = prefill), counts [B], SpecStats).
    """
    model = merge(lc.model, params)  # the target's Decoder over its weights dict (Target.params)
    b = prompt_BT.shape[0]
    tree = drafter.settings.tree
    n = tree.num_nodes
    features = drafter.feature_layers
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    cache = model.init_cache(b, lc.cache_len)
    logits_BV, prompt_features, cache = prefill(model, lc, cache, prompt_BT, prompt_len_B, capture=features)
    root_B = choose_token(sub_B, logits_BV, lc.sampling)
    dstate = drafter.init(draft_params, PrefillContext(prompt_BT, prompt_len_B, root_B, prompt_features))
    out_BO, count_B, done_B = first_token_state(root_B, max_new_B, lc)
    round_BO = jnp.zeros_like(out_BO)
    stats = SpecStats.zeros(b, tree.max_depth, n)

    def cond(state):
        step, _, _, _, _, _, done_B, _, _, _ = state
        return (step < lc.out_len) & ~jnp.all(done_B)

    def body(state):
        step, cache, root_B, out_BO, round_BO, count_B, done_B, dstate, keys_B, stats = state
        keys_B, k_draft_B, k_verify_B = split_rows(keys_B, 3)
        draft, dstate = drafter.propose(draft_params, dstate, root_B, k_draft_B)
        active_B = ~done_B
        mask_BNN = ancestor_mask(draft.parents)
        depth_BN = depths(mask_BNN)
        if sched is None:
            verdict, node_features, cache = verify_pass(model, lc, draft, mask_BNN, depth_BN, cache, features,
                                                        k_verify_B)
        else:
            draft, choice = admit(draft, active_B, max_new_B - count_B, seconds_T, sched)
            branches = [partial(narrow_pass, w, model, lc, features) for w in sched.widths]
            verdict, node_features, cache = lax.switch(choice, branches, draft, mask_BNN, depth_BN, cache, k_verify_B)
            stats = record_width(stats, jnp.asarray(sched.widths, jnp.int32)[choice])
        verdict = Verdict(verdict.path, jnp.where(active_B, verdict.num_accepted, 0), verdict.bonus)

        # Emit accepted drafts + bonus, cut after the first EOS and at the row's budget.
        new_BN = accepted_tokens(draft, verdict)
        i_N = jnp.arange(n)
        eos_BN = is_eos(new_BN, lc.eos_ids) & (i_N[None, :] < verdict.num_accepted[:, None])
        has_eos_B = jnp.any(eos_BN, axis=-1)
        emit_B = jnp.where(has_eos_B, jnp.argmax(eos_BN, axis=-1) + 1, verdict.num_accepted)
        emit_B = jnp.minimum(emit_B, max_new_B - count_B)
        dst_BN = jnp.where(i_N[None, :] < emit_B[:, None], count_B[:, None] + i_N[None, :], lc.out_len)
        out_BO = out_BO.at[jnp.arange(b)[:, None], dst_BN].set(new_BN, mode="drop")
        round_BO = round_BO.at[jnp.arange(b)[:, None], dst_BN].set(step + 1, mode="drop")
        count_B = count_B + emit_B
        done_B = done_B | has_eos_B | (count_B >= max_new_B)
        stats = record_round(stats, draft, depth_BN, verdict, active_B, emit_B)

        cache = cache.commit(verdict.path, verdict.num_accepted)
        root_B = jnp.where(active_B, verdict.bonus, root_B)
        dstate = drafter.update(draft_params, dstate, draft, verdict, node_features)
        return step + 1, cache, root_B, out_BO, round_BO, count_B, done_B, dstate, keys_B, stats

    state = (jnp.int32(0), cache, root_B, out_BO, round_BO, count_B, done_B, dstate, keys_B, stats)
    _, _, _, out_BO, round_BO, count_B, _, _, _, stats = lax.while_loop(cond, body, state)
    return out_BO, round_BO, count_B, stats


def speculative_generate(target: Target, prompts: Sequence, drafter: Drafter, *, max_new_tokens: int,
                         sampling: SamplingConfig, seed, spec: TreeSpec | DynamicTreeSpec, eos_token_id,
                         max_len: int | None, scheduler: str | None = None,
                         scheduler_cost: Callable | None = None, token_bucket: int = 0) -> GenerateOutput:
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
                  draft_nodes=spec.cache_slots, token_bucket=token_bucket)
    configured = drafter.configure(Settings(spec, sampling, req.lc.cache_len, req.lc.out_len))
    key, args, static, sched_info = ("spec", req.lc, configured, req.prompt_BT.shape), (), {}, {}
    if scheduler is not None:
        sched = Scheduler(scheduler, verify_widths(spec.num_nodes))
        batch = req.prompt_BT.shape[0]
        if scheduler_cost is None:
            raise ValueError("scheduler= needs its verify cost model: pass scheduler_cost=")
        cost = scheduler_cost(batch, sched.widths, timing_context(req.ids, max_new_tokens))
        # The drafter drafts all K every round whatever is admitted: its time is a fixed part of the round.
        overhead = cost.draft_s(batch, spec.num_nodes - 1)
        args, static, key = (jnp.asarray(cost_table(cost.verify_s, batch, spec.num_nodes, overhead)),), \
            {"sched": sched}, (*key, sched)
        sched_info = {"mode": scheduler, "widths": list(sched.widths), "cost": cost.source,
                      "round_overhead_s": overhead}
    result, compile_s, run_s = run_compiled(
        target, key, spec_generate, (target.params, configured.params, *req.arrays(), *args),
        {"lc": req.lc, "drafter": configured, **static})
    out_BO, round_BO, count_B, stats = jax.tree.map(np.asarray, result)
    summary = summarize(stats, len(req.ids), configured.calls_per_round())
    extra = {"scheduler": sched_info} if sched_info else {}
    return finish(target, req, out_BO, count_B, compile_s, run_s, {**summary, "tree_nodes": spec.num_nodes, **extra},
                  round_BO, stats)


def check_drafter_fits(drafter: Drafter, target: Target) -> None:
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != target.cfg.vocab_size:
        raise ValueError(f"drafter '{drafter.name}' has a vocabulary of {vocab} tokens but the target has "
                         f"{target.cfg.vocab_size}; a drafter must share the target's tokenizer")
    bad = [i for i in drafter.feature_layers if not (0 <= i <= target.cfg.num_layers or i == POST_NORM)]
    if bad:
        raise ValueError(f"drafter '{drafter.name}' asks for target hidden states {bad}, but the target has "
                         f"{target.cfg.num_layers} layers (valid: 0..{target.cfg.num_layers}, or {POST_NORM}: after the final norm)")

