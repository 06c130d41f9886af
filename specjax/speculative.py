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
from .generate import GenerateOutput, finish, prepare, run_compiled
from .models.decoder import forward, has_layer_list, lm_head
from .sampling import choose_token
from .target import Target
from .tree import ancestor_mask, depths, parse_tree
from .verify import Verdict, verify


@partial(jax.jit, static_argnames=("lc", "drafter"))
def spec_generate(params: dict, draft_params, prompt_BT: jax.Array, prompt_len_B: jax.Array, max_new_B: jax.Array,
                  key: jax.Array, *, lc: LoopConfig, drafter: Drafter):
    """Speculative decoding of up to max_new_B[b] tokens per row.

    Returns (tokens [B, out_len], the round that emitted each token [B, out_len] (0 = prefill),
    counts [B], rounds, active_rounds [B], accepted_drafts [B], accepted_at_depth [max_depth]).
    """
    b = prompt_BT.shape[0]
    n = drafter.settings.tree.num_nodes
    max_depth = drafter.settings.tree.max_depth
    features = drafter.feature_layers
    key, sub = jax.random.split(key)
    cache = init_cache(lc.model, b, lc.cache_len, per_layer=has_layer_list(params))
    logits_BV, prompt_features, cache = prefill(params, lc, cache, prompt_BT, prompt_len_B, capture=features)
    root_B = choose_token(sub, logits_BV, lc.sampling)
    dstate = drafter.init(draft_params, PrefillContext(prompt_BT, prompt_len_B, root_B, prompt_features))
    out_BO, count_B, done_B = first_token_state(root_B, max_new_B, lc)
    round_BO = jnp.zeros_like(out_BO)
    zeros_B = jnp.zeros((b,), jnp.int32)
    stats = (zeros_B, zeros_B, jnp.zeros((max_depth,), jnp.int32))

    def cond(state):
        step, _, _, _, _, _, done_B, _, _, _ = state
        return (step < lc.out_len) & ~jnp.all(done_B)

    def body(state):
        step, cache, root_B, out_BO, round_BO, count_B, done_B, dstate, key, stats = state
        rounds_B, accepted_B, at_depth_D = stats
        key, k_draft, k_verify = jax.random.split(key, 3)
        draft, dstate = drafter.propose(draft_params, dstate, root_B, k_draft)
        mask_BNN = ancestor_mask(draft.parents)
        positions_BN = cache.lengths[:, None] + depths(mask_BNN)
        h_BND, node_features, cache = forward(params, lc.model, draft.tokens, cache, positions_BT=positions_BN,
                                              mask_BTT=mask_BNN, capture=features, attn_impl=lc.attn_impl)
        verdict = verify(draft, mask_BNN, lm_head(params, lc.model, h_BND), lc.sampling, k_verify)
        active_B = ~done_B
        num_kept_B = jnp.where(active_B, verdict.num_accepted, 0)
        verdict = Verdict(verdict.path, num_kept_B, verdict.bonus)

        # Emit accepted drafts + bonus, cut after the first EOS and at the row's budget.
        new_BN = accepted_tokens(draft, verdict)
        i_N = jnp.arange(n)
        eos_BN = is_eos(new_BN, lc.eos_ids) & (i_N[None, :] < num_kept_B[:, None])
        has_eos_B = jnp.any(eos_BN, axis=-1)
        emit_B = jnp.where(has_eos_B, jnp.argmax(eos_BN, axis=-1) + 1, num_kept_B)
        emit_B = jnp.minimum(emit_B, max_new_B - count_B)
        dst_BN = jnp.where(i_N[None, :] < emit_B[:, None], count_B[:, None] + i_N[None, :], lc.out_len)
        out_BO = out_BO.at[jnp.arange(b)[:, None], dst_BN].set(new_BN, mode="drop")
        round_BO = round_BO.at[jnp.arange(b)[:, None], dst_BN].set(step + 1, mode="drop")
        count_B = count_B + emit_B
        done_B = done_B | has_eos_B | (count_B >= max_new_B)

        cache = commit(cache, verdict.path, num_kept_B)
        root_B = jnp.where(active_B, verdict.bonus, root_B)
        dstate = drafter.update(draft_params, dstate, draft, verdict, node_features)
        drafts_B = jnp.maximum(num_kept_B - 1, 0)
        at_depth_D = at_depth_D + jnp.sum(drafts_B[:, None] > jnp.arange(max_depth)[None, :], axis=0)
        stats = (rounds_B + active_B, accepted_B + drafts_B, at_depth_D)
        return step + 1, cache, root_B, out_BO, round_BO, count_B, done_B, dstate, key, stats

    state = (jnp.int32(0), cache, root_B, out_BO, round_BO, count_B, done_B, dstate, key, stats)
    steps, _, _, out_BO, round_BO, count_B, _, _, _, stats = lax.while_loop(cond, body, state)
    return (out_BO, round_BO, count_B, steps, *stats)


def speculative_generate(target: Target, prompts: Sequence, drafter: Drafter, *, max_new_tokens: int,
                         sampling: SamplingConfig, seed: int, num_draft_tokens: int | None, tree, eos_token_id,
                         max_len: int | None) -> GenerateOutput:
    """`specjax.generate` with a drafter: same arguments, same outputs, plus acceptance statistics."""
    spec = parse_tree(tree, num_draft_tokens)
    check_drafter_fits(drafter, target)
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, extra=spec.num_nodes)
    configured = drafter.configure(Settings(spec, sampling, req.lc.cache_len, req.lc.out_len))
    result, compile_s, run_s = run_compiled(
        target, ("spec", req.lc, configured, req.prompt_BT.shape), spec_generate,
        (target.params, configured.params, *req.arrays(seed)), {"lc": req.lc, "drafter": configured})
    out_BO, round_BO, count_B, steps, rounds_B, accepted_B, at_depth_D = (np.asarray(x) for x in result)
    rounds = max(int(rounds_B.sum()), 1)
    return finish(target, req, out_BO, count_B, steps, compile_s, run_s, {
        "acceptance_length": 1.0 + float(accepted_B.sum()) / rounds,
        "per_position_acceptance": (at_depth_D / rounds).tolist(),
        "drafter_calls": int(steps) * configured.calls_per_round(),
        "tree_nodes": spec.num_nodes,
    }, round_BO)


def check_drafter_fits(drafter: Drafter, target: Target) -> None:
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != target.cfg.vocab_size:
        raise ValueError(f"drafter '{drafter.name}' has a vocabulary of {vocab} tokens but the target has "
                         f"{target.cfg.vocab_size}; a drafter must share the target's tokenizer")
    bad = [i for i in drafter.feature_layers if not 0 <= i <= target.cfg.num_layers]
    if bad:
        raise ValueError(f"drafter '{drafter.name}' asks for target hidden states {bad}, but the target has "
                         f"{target.cfg.num_layers} layers (valid: 0..{target.cfg.num_layers})")

