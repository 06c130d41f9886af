"""An independent small language model sharing the target's tokenizer, with its own KV cache.

The draft cache mirrors the target's layout: draft node i sits at `lengths + i`, and after
verification it is committed along the same accepted path. Each round re-feeds the last
committed token together with the root ([prev, root] at positions L-1, L), so a draft
token the drafter produced but never ran (the last of a fully accepted chain, a tree
leaf) gets its K/V written before it is needed. Chains draft one token per step;
static trees take each node's top-k children, one full-tree pass per depth; dynamic
(EAGLE-2) trees run [prev, root] and then, per expansion step, only the top_k frontier
nodes, each attending to the prefix and its own ancestors among the nodes already run
(dynamic_tree.py chooses the nodes; `forward_frontier` runs them).

A hybrid draft model (Qwen3.5: Gated DeltaNet + attention layers) cannot write its recurrent state
provisionally the way it writes K/V: a rejected guess must not stay in it. Its state holds the prefix
before `prev` (cache lengths L-1, the DeltaNet state and conv window before prev), so the [prev, root]
re-feed runs prev exactly once. Every drafting pass is the target's verify pass (`provisional=True`):
the state is left as it was and each node's DeltaNet results are kept. A chain runs [prev, root]
and then one token per step, each step committed at once (`HybridCache.commit`, the state after it)
so the next step reads it; the steps' node results, joined, are the chain's results from the
round's first state. A static tree runs [prev, tree] per depth from the round's first state; a
dynamic tree runs the whole window [prev, root, expanded slots] per expansion step, each slot under
its ancestors. `update` commits [prev, accepted path minus its last node] with the target's commit:
the state then holds the prefix before the new prev, at the accepted length of each row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import ModelConfig
from specjax.decoding.drafter import PrefillContext, Settings, chain_nodes, drafting_values
from specjax.decoding.dynamic_tree import build_tree
from specjax.decoding.sampling import sample_rows, sampling_probs, split_rows
from specjax.decoding.tree import DynamicTreeSpec, ancestor_mask, child_ranks, depths, spec_arrays
from specjax.decoding.verify import Draft, Verdict
from specjax.models.cache import HybridCache, KVCache, NodeResults, commit
from specjax.models.decoder import Decoder
from specjax.models.model import merge
from specjax.models.target import model_summary


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    cfg: ModelConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    settings: Settings | None = None
    attn_impl: str = "auto"
    name: str = "draft_model"
    feature_layers: tuple[int, ...] = ()

    @property
    def model(self) -> Decoder:
        """The draft model as a Flax NNX module over the same arrays as `params` (for notebooks)."""
        return merge(self.cfg, self.params)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def __repr__(self) -> str:
        """One line of facts, not the weights."""
        return f"DraftModelDrafter({model_summary(self.cfg, self.attn_impl)})"

    def configure(self, settings: Settings) -> "DraftModelDrafter":
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        tree = self.settings.tree
        return tree.num_nodes - 1 if tree.is_chain else tree.max_depth

    def init(self, params, ctx: PrefillContext):
        model = merge(self.cfg, params)
        b = ctx.prompt.shape[0]
        cache = model.init_cache(b, self.settings.cache_len)
        prev_B = jnp.take_along_axis(ctx.prompt, (ctx.prompt_len - 1)[:, None], axis=1)[:, 0]
        if self.cfg.is_hybrid:  # the state before prev: prev runs in the first round's [prev, root]
            before_B = ctx.prompt_len - 1
            _, _, cache = model.forward(ctx.prompt, cache, attn_impl=self.attn_impl, num_valid_B=before_B)
            cache = cache.with_lengths(before_B)
        else:
            _, _, cache = model.forward(ctx.prompt, cache, attn_impl=self.attn_impl)
            cache = KVCache(cache.k, cache.v, ctx.prompt_len)
        if self._dynamic:  # + each node's cache offset from lengths in the last draft (see _propose_dynamic)
            return cache, prev_B, jnp.zeros((b, self.settings.tree.num_nodes), jnp.int32)
        return cache, prev_B

    @property
    def _dynamic(self) -> bool:
        return isinstance(self.settings.tree, DynamicTreeSpec)

    def _choose(self, keys_B, logits_BV, sampling):
        """Next draft token and, when sampling, the distribution it was drawn from (row b with keys_B[b])."""
        if self.settings.sampling.greedy:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
        q_BV = sampling_probs(logits_BV, sampling)
        return sample_rows(keys_B, q_BV), q_BV

    def propose(self, params, state, root_B, keys_B, sampling=None):
        model = merge(self.cfg, params)
        if self.settings.tree.is_chain:
            chain = self._propose_chain_hybrid if self.cfg.is_hybrid else self._propose_chain
            return chain(model, state, root_B, keys_B, drafting_values(self.settings, sampling))
        if self._dynamic:
            dynamic = self._propose_dynamic_hybrid if self.cfg.is_hybrid else self._propose_dynamic
            return dynamic(model, state, root_B)
        return self._propose_tree(model, state, root_B)

    def _propose_chain(self, model: Decoder, state, root_B, keys_B, sampling):
        cache, prev_B = state
        length_B = cache.lengths
        k = self.settings.tree.num_nodes - 1
        keys = split_rows(keys_B, k)  # [K, B]
        step_cache = KVCache(cache.k, cache.v, length_B - 1)
        h_B2D, _, step_cache = model.forward(jnp.stack([prev_B, root_B], axis=1), step_cache,
                                       attn_impl=self.attn_impl)
        logits_BV = model.logits(h_B2D[:, 1:])[:, 0]
        tok_B, q_BV = self._choose(keys[0], logits_BV, sampling)
        record = self.settings.record_logits

        def step(carry, xs):
            kc, vc, tok_B = carry
            i, step_keys_B = xs
            h_B1D, _, c = model.forward(tok_B[:, None], KVCache(kc, vc, length_B + i),
                                  attn_impl=self.attn_impl)
            step_logits_BV = model.logits(h_B1D)[:, 0]
            nxt_B, q_BV = self._choose(step_keys_B, step_logits_BV, sampling)
            return (c.k, c.v, nxt_B), (nxt_B, q_BV, step_logits_BV if record else None)

        (kc, vc, _), (rest_KB, rest_q, rest_logits) = lax.scan(
            step, (step_cache.k, step_cache.v, tok_B), (jnp.arange(1, k, dtype=jnp.int32), keys[1:]))
        draft = self._chain_draft(root_B, tok_B, rest_KB, q_BV, rest_q, logits_BV, rest_logits)
        return draft, (KVCache(kc, vc, length_B), prev_B)

    def _propose_chain_hybrid(self, model: Decoder, state, root_B, keys_B, sampling):
        """A chain from a hybrid draft model: [prev, root], then one token per step, each pass committed so the
        next reads its state. Returns the round's first state with the K+1 passes' node results joined
        (prev, root, drafts 1..K-1: the last draft is never run), which `update` commits along."""
        cache, prev_B = state
        k = self.settings.tree.num_nodes - 1
        keys = split_rows(keys_B, k)  # [K, B]
        h_B2D, _, c = model.forward(jnp.stack([prev_B, root_B], axis=1), cache, provisional=True,
                                    attn_impl=self.attn_impl)
        first_nodes = c.nodes
        c = c.commit(jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (root_B.shape[0], 2)),
                     jnp.full(root_B.shape, 2, jnp.int32))
        logits_BV = model.logits(h_B2D[:, 1:])[:, 0]
        tok_B, q_BV = self._choose(keys[0], logits_BV, sampling)
        record = self.settings.record_logits
        node0_B1 = jnp.zeros((root_B.shape[0], 1), jnp.int32)  # a one-node pass's path

        def step(carry, step_keys_B):
            c, tok_B = carry
            h_B1D, _, c = model.forward(tok_B[:, None], c, provisional=True, attn_impl=self.attn_impl)
            nodes = c.nodes
            c = c.commit(node0_B1, node0_B1[:, 0] + 1)
            step_logits_BV = model.logits(h_B1D)[:, 0]
            nxt_B, q_BV = self._choose(step_keys_B, step_logits_BV, sampling)
            return (c, nxt_B), (nodes, nxt_B, q_BV, step_logits_BV if record else None)

        (c, _), (step_nodes, rest_KB, rest_q, rest_logits) = lax.scan(step, (c, tok_B), keys[1:])
        draft = self._chain_draft(root_B, tok_B, rest_KB, q_BV, rest_q, logits_BV, rest_logits)
        nodes = tuple(map(_join_chain_nodes, first_nodes, step_nodes))
        return draft, (HybridCache(c.kv.with_lengths(cache.lengths), cache.conv, cache.state, nodes), prev_B)

    def _chain_draft(self, root_B, tok_B, rest_KB, q_BV, rest_q, logits_BV, rest_logits) -> Draft:
        """The Draft of a chain [root, draft 1, drafts 2..K] and, when drawn or recorded, its per-node q / logits."""
        tokens_BN = jnp.concatenate([root_B[:, None], tok_B[:, None], rest_KB.T], axis=1)
        return Draft(tokens_BN, spec_arrays(self.settings.tree, root_B.shape[0]), jnp.ones(tokens_BN.shape, jnp.bool_),
                     chain_nodes(q_BV, rest_q),
                     logits=chain_nodes(logits_BV, rest_logits) if self.settings.record_logits else None)

    def _propose_tree(self, model: Decoder, state, root_B):
        """Deterministic top-k tree: node i takes the rank_i-th best token after its parent.

        A hybrid draft model's passes are provisional from the round's first state (its cache's lengths are
        already L-1, before prev); the last pass's node results stay in the returned cache for `update`."""
        cache, prev_B = state
        hybrid = self.cfg.is_hybrid
        tree = self.settings.tree
        b, n = root_B.shape[0], tree.num_nodes
        # Run [prev, tree nodes]: prev (position L-1) is every node's ancestor, node i lands at L + i.
        # The root's parent -1 shifts to 0, which is prev.
        ext_parents_BT = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), spec_arrays(tree, b) + 1], axis=1)
        mask_BTT = ancestor_mask(ext_parents_BT)
        start_B = cache.lengths if hybrid else cache.lengths - 1  # prev's position
        positions_BT = start_B[:, None] + depths(mask_BTT)
        parent_idx = jnp.asarray([max(p, 0) + 1 for p in tree.parents], jnp.int32)  # parent's row in [prev, nodes]
        ranks = jnp.asarray(child_ranks(tree), jnp.int32)
        width = max(child_ranks(tree)) + 1
        node_depth = tree.depths
        tokens_BN = jnp.broadcast_to(root_B[:, None], (b, n))
        for d in range(1, tree.max_depth + 1):
            step_cache = cache if hybrid else KVCache(cache.k, cache.v, start_B)
            ext_BT = jnp.concatenate([prev_B[:, None], tokens_BN], axis=1)
            h_BTD, _, step_cache = model.forward(ext_BT, step_cache, positions_BT=positions_BT, mask_BTT=mask_BTT,
                                                 provisional=hybrid, attn_impl=self.attn_impl)
            top_BTW = lax.top_k(model.logits(h_BTD), width)[1].astype(jnp.int32)
            cand_BN = top_BTW[:, parent_idx, ranks]
            at_depth = jnp.asarray([x == d for x in node_depth])
            tokens_BN = jnp.where(at_depth[None, :], cand_BN, tokens_BN)
            cache = step_cache if hybrid else KVCache(step_cache.k, step_cache.v, cache.lengths)
        draft = Draft(tokens_BN, spec_arrays(tree, b), jnp.ones((b, n), jnp.bool_))
        return draft, (cache, prev_B)

    def _propose_dynamic(self, model: Decoder, state, root_B):
        """EAGLE-2 dynamic tree, deterministic (q = None: verification treats each node as one-hot).

        Cache layout during drafting, from the row's length L: prev at L-1, root at L, expanded
        slot r (frontier node f of step s, r = s*top_k + f) at L+1+r. Every non-leaf node of the
        tree was expanded, so an accepted path's K/V are in the cache except perhaps its last
        node's, which next round's [prev, root] re-feed writes anyway.
        """
        cache, prev_B, _ = state
        spec = self.settings.tree
        length_B = cache.lengths
        h_B2D, _, c = model.forward(jnp.stack([prev_B, root_B], axis=1),
                              KVCache(cache.k, cache.v, length_B - 1), attn_impl=self.attn_impl)
        root_logprobs_BV = jax.nn.log_softmax(model.logits(h_B2D[:, 1:])[:, 0], axis=-1)

        def step(frontier, kv):
            positions_BK = jnp.broadcast_to((length_B + 1 + frontier.step)[:, None], frontier.tokens.shape)
            h_BKD, _, c = model.forward(frontier.tokens, KVCache(*kv, length_B + 1), positions_BT=positions_BK,
                                        mask_BTT=frontier.ancestors, slot=frontier.slot, attn_impl=self.attn_impl)
            return jax.nn.log_softmax(model.logits(h_BKD), axis=-1), (c.k, c.v)

        tree, (k, v) = build_tree(spec, root_B, root_logprobs_BV, step, (c.k, c.v))
        # Each node's cache offset from L: root 0, expanded slot r at 1 + r; unexpanded leaves have no
        # K/V (0 is a placeholder: a leaf can only end an accepted path, and that entry is rewritten).
        offset_BN = jnp.where(tree.expanded_slot >= 0, tree.expanded_slot + 1, 0)
        draft = Draft(tree.tokens, tree.parents, jnp.ones(tree.tokens.shape, jnp.bool_))
        return draft, (KVCache(k, v, length_B), prev_B, offset_BN)

    def _propose_dynamic_hybrid(self, model: Decoder, state, root_B):
        """EAGLE-2 dynamic tree from a hybrid draft model, deterministic as the dense one's.

        Every pass runs the whole window [prev, root, expanded slots 0..D*K-1] provisionally from the round's
        first state, each slot under its ancestors (prev and root see only what precedes them; a slot not expanded
        yet sees prev, root and itself, and nothing sees it), so every frontier node's DeltaNet output follows its
        own path: one pass for the root's distribution, then one per expansion step. The last pass holds every
        expanded node's results, which `update` commits along (node -> window index: root 1, slot r at 2 + r;
        an unexpanded leaf only ends a path, and the path's last node is never committed).
        """
        cache, prev_B, _ = state
        spec = self.settings.tree
        b, k, r = root_B.shape[0], spec.top_k, spec.depth * spec.top_k
        offsets_W = jnp.asarray([0, 1] + [2 + j // k for j in range(r)], jnp.int32)  # prev, root, depth + 1
        positions_BW = cache.lengths[:, None] + offsets_W[None, :]
        sees_WW = jnp.eye(2 + r, dtype=jnp.bool_).at[1:, 0].set(True).at[2:, 1].set(True)  # all see prev; slots, root
        mask_BWW = jnp.broadcast_to(sees_WW, (b, 2 + r, 2 + r))
        tokens_BW = jnp.concatenate([prev_B[:, None], jnp.broadcast_to(root_B[:, None], (b, 1 + r))], axis=1)

        def window_pass(tokens_BW, mask_BWW):
            return model.forward(tokens_BW, cache, positions_BT=positions_BW, mask_BTT=mask_BWW, provisional=True,
                                 attn_impl=self.attn_impl)

        h_BWD, _, c = window_pass(tokens_BW, mask_BWW)
        root_logprobs_BV = jax.nn.log_softmax(model.logits(h_BWD[:, 1:2])[:, 0], axis=-1)

        def step(frontier, carry):
            tokens_BW, mask_BWW, _ = carry
            at_K = 2 + frontier.slot + jnp.arange(k)
            tokens_BW = tokens_BW.at[:, at_K].set(frontier.tokens)
            seen_BKW = jnp.concatenate([jnp.ones((b, k, 2), jnp.bool_), frontier.ancestors], axis=-1)
            mask_BWW = mask_BWW.at[:, at_K, :].set(seen_BKW)
            h_BWD, _, c = window_pass(tokens_BW, mask_BWW)
            return jax.nn.log_softmax(model.logits(jnp.take(h_BWD, at_K, axis=1)), axis=-1), (tokens_BW, mask_BWW, c)

        tree, (_, _, c) = build_tree(spec, root_B, root_logprobs_BV, step, (tokens_BW, mask_BWW, c))
        ran_at_BN = jnp.where(tree.expanded_slot >= 0, tree.expanded_slot + 2, 1)
        draft = Draft(tree.tokens, tree.parents, jnp.ones(tree.tokens.shape, jnp.bool_))
        return draft, (c, prev_B, ran_at_BN)

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        cache, prev_B = state[:2]
        last_node_B = jnp.take_along_axis(verdict.path, jnp.maximum(verdict.num_accepted - 1, 0)[:, None], axis=1)
        last_tok_B = jnp.take_along_axis(draft.tokens, last_node_B, axis=1)[:, 0]
        prev_B = jnp.where(verdict.num_accepted > 0, last_tok_B, prev_B)
        if self.cfg.is_hybrid:  # [prev, accepted path less its last node], each node where the drafting passes ran it
            if self._dynamic:
                ran_at_BN = jnp.take_along_axis(state[2], verdict.path, axis=1)
            else:
                ran_at_BN = verdict.path + 1  # prev ran first, then the nodes in order
            ext_path_BN = jnp.concatenate([jnp.zeros_like(ran_at_BN[:, :1]), ran_at_BN[:, :-1]], axis=1)
            return (cache.commit(ext_path_BN, verdict.num_accepted), prev_B) + tuple(state[2:])
        if self._dynamic:  # the accepted nodes' K/V sit at their expanded slots, not at their node indices
            offset_BN = state[2]
            return commit(cache, jnp.take_along_axis(offset_BN, verdict.path, axis=1), verdict.num_accepted), \
                prev_B, offset_BN
        return commit(cache, verdict.path, verdict.num_accepted), prev_B


def _join_chain_nodes(first: NodeResults, steps: NodeResults) -> NodeResults:
    """One DeltaNet layer's node results of a chain's passes as one pass's from the round's first state.

    first: the [prev, root] pass's (T = 2); steps: the one-token passes', stacked by the scan (a leading [K-1]
    axis), each from the state its predecessor committed: their cumulative decays restart at each step, so they
    are summed on from first's last. Conv inputs, keys and corrected values do not depend on where a pass began.
    """
    def joined(a, s_S, t_axis):  # s_S [S, ..., 1 at t_axis, ...] appended to a along t_axis
        return jnp.concatenate([a, jnp.moveaxis(jnp.squeeze(s_S, t_axis + 1), 0, t_axis)], axis=t_axis)

    step_cum_BHS = jnp.moveaxis(steps.cum[..., 0], 0, 2)
    cum_BHS = first.cum[..., -1:] + jnp.cumsum(step_cum_BHS, axis=-1)
    return NodeResults(joined(first.x, steps.x, 1), joined(first.k, steps.k, 2), joined(first.v_new, steps.v_new, 2),
                       jnp.concatenate([first.cum, cum_BHS], axis=-1))
