"""The speculative loop: one jit around a `lax.while_loop` over rounds.

Each round: the drafter proposes a fixed-shape tree rooted at the last chosen token;
the target runs all N nodes in one forward pass (tree positions, ancestor mask); the
verifier picks the accepted path and a bonus token; the row emits them (cut at EOS or
its token budget, exactly where plain decoding would stop), the cache keeps the path,
and the drafter updates its state. Shapes never depend on acceptance.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .cache import commit, init_cache
from .config import SamplingConfig
from .decode import LoopConfig, first_token_state, is_eos, prefill
from .drafters.base import Drafter, PrefillContext, Settings, accepted_tokens
from .models.decoder import forward, has_layer_list, lm_head
from .request import GenerateOutput, finish, prepare, run_compiled
from .sampling import choose_token, row_keys, split_rows
from .stats import SpecStats, record_round, summarize
from .target import Target
from .tree import DynamicTreeSpec, TreeSpec, ancestor_mask, depths
from .verify import Verdict, verify


@partial(jax.jit, static_argnames=("lc", "drafter"))
def spec_generate(params: dict, draft_params, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                  seeds_B: jax.Array, fold_B: jax.Array, *, lc: LoopConfig, drafter: Drafter):
    """Speculative decoding of up to max_new_B[b] tokens per row.

    Row b draws from its own key stream (seeds_B[b], fold_B[b]), for drafting and verifying alike.
    Returns (tokens [B, out_len], the round that emitted each token [B, out_len] (0 = prefill),
    counts [B], SpecStats).
    """
    b = prompt_BT.shape[0]
    tree = drafter.settings.tree
    n = tree.num_nodes
    features = drafter.feature_layers
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    cache = init_cache(lc.model, b, lc.cache_len, per_layer=has_layer_list(params))
    logits_BV, prompt_features, cache = prefill(params, lc, cache, prompt_BT, prompt_len_B, capture=features)
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
        mask_BNN = ancestor_mask(draft.parents)
        depth_BN = depths(mask_BNN)
        positions_BN = cache.lengths[:, None] + depth_BN
        h_BND, node_features, cache = forward(params, lc.model, draft.tokens, cache, positions_BT=positions_BN,
                                              mask_BTT=mask_BNN, capture=features, attn_impl=lc.attn_impl)
        verdict = verify(draft, mask_BNN, lm_head(params, lc.model, h_BND), lc.sampling, k_verify_B)
        active_B = ~done_B
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

        cache = commit(cache, verdict.path, verdict.num_accepted)
        root_B = jnp.where(active_B, verdict.bonus, root_B)
        dstate = drafter.update(draft_params, dstate, draft, verdict, node_features)
        return step + 1, cache, root_B, out_BO, round_BO, count_B, done_B, dstate, keys_B, stats

    state = (jnp.int32(0), cache, root_B, out_BO, round_BO, count_B, done_B, dstate, keys_B, stats)
    _, _, _, out_BO, round_BO, count_B, _, _, _, stats = lax.while_loop(cond, body, state)
    return out_BO, round_BO, count_B, stats


def speculative_generate(target: Target, prompts: Sequence, drafter: Drafter, *, max_new_tokens: int,
                         sampling: SamplingConfig, seed, spec: TreeSpec | DynamicTreeSpec, eos_token_id,
                         max_len: int | None) -> GenerateOutput:
    """`specjax.generate` with a drafter: same arguments, same outputs, plus acceptance statistics."""
    check_drafter_fits(drafter, target)
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, seed,
                  draft_nodes=spec.cache_slots)
    configured = drafter.configure(Settings(spec, sampling, req.lc.cache_len, req.lc.out_len))
    result, compile_s, run_s = run_compiled(
        target, ("spec", req.lc, configured, req.prompt_BT.shape), spec_generate,
        (target.params, configured.params, *req.arrays()), {"lc": req.lc, "drafter": configured})
    out_BO, round_BO, count_B, stats = jax.tree.map(np.asarray, result)
    summary = summarize(stats, len(req.ids), configured.calls_per_round())
    return finish(target, req, out_BO, count_B, compile_s, run_s, {**summary, "tree_nodes": spec.num_nodes},
                  round_BO, stats)


def check_drafter_fits(drafter: Drafter, target: Target) -> None:
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != target.cfg.vocab_size:
        raise ValueError(f"drafter '{drafter.name}' has a vocabulary of {vocab} tokens but the target has "
                         f"{target.cfg.vocab_size}; a drafter must share the target's tokenizer")
    bad = [i for i in drafter.feature_layers if not 0 <= i <= target.cfg.num_layers]
    if bad:
        raise ValueError(f"drafter '{drafter.name}' asks for target hidden states {bad}, but the target has "
                         f"{target.cfg.num_layers} layers (valid: 0..{target.cfg.num_layers})")

