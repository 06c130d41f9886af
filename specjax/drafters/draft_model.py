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
from specjax.models.cache import KVCache, commit
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
        if self.cfg.is_hybrid:  # its guesses would advance a recurrent state that a rejected draft cannot undo
            raise ValueError(f"a hybrid draft model ({self.cfg.family}: Gated DeltaNet layers) is not supported: its "
                             "drafting passes would need the per-node state handling the target's verification has; "
                             "use a dense draft model (Llama, Qwen2/3, Mistral) or the target's MTP layers")
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        tree = self.settings.tree
        return tree.num_nodes - 1 if tree.is_chain else tree.max_depth

    def init(self, params, ctx: PrefillContext):
        model = merge(self.cfg, params)
        b = ctx.prompt.shape[0]
        cache = model.init_cache(b, self.settings.cache_len)
        _, _, cache = model.forward(ctx.prompt, cache, attn_impl=self.attn_impl)
        prev_B = jnp.take_along_axis(ctx.prompt, (ctx.prompt_len - 1)[:, None], axis=1)[:, 0]
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
            return self._propose_chain(model, state, root_B, keys_B, drafting_values(self.settings, sampling))
        if self._dynamic:
            return self._propose_dynamic(model, state, root_B)
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
        tokens_BN = jnp.concatenate([root_B[:, None], tok_B[:, None], rest_KB.T], axis=1)
        b = root_B.shape[0]
        draft = Draft(tokens_BN, spec_arrays(self.settings.tree, b), jnp.ones(tokens_BN.shape, jnp.bool_),
                      chain_nodes(q_BV, rest_q), logits=chain_nodes(logits_BV, rest_logits) if record else None)
        return draft, (KVCache(kc, vc, length_B), prev_B)

    def _propose_tree(self, model: Decoder, state, root_B):
        """Deterministic top-k tree: node i takes the rank_i-th best token after its parent."""
        cache, prev_B = state
        tree = self.settings.tree
        b, n = root_B.shape[0], tree.num_nodes
        # Run [prev, tree nodes]: prev (position L-1) is every node's ancestor, node i lands at L + i.
        # The root's parent -1 shifts to 0, which is prev.
        ext_parents_BT = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), spec_arrays(tree, b) + 1], axis=1)
        mask_BTT = ancestor_mask(ext_parents_BT)
        positions_BT = (cache.lengths - 1)[:, None] + depths(mask_BTT)
        parent_idx = jnp.asarray([max(p, 0) + 1 for p in tree.parents], jnp.int32)  # parent's row in [prev, nodes]
        ranks = jnp.asarray(child_ranks(tree), jnp.int32)
        width = max(child_ranks(tree)) + 1
        node_depth = tree.depths
        tokens_BN = jnp.broadcast_to(root_B[:, None], (b, n))
        for d in range(1, tree.max_depth + 1):
            step_cache = KVCache(cache.k, cache.v, cache.lengths - 1)
            ext_BT = jnp.concatenate([prev_B[:, None], tokens_BN], axis=1)
            h_BTD, _, step_cache = model.forward(ext_BT, step_cache, positions_BT=positions_BT,
                                           mask_BTT=mask_BTT, attn_impl=self.attn_impl)
            top_BTW = lax.top_k(model.logits(h_BTD), width)[1].astype(jnp.int32)
            cand_BN = top_BTW[:, parent_idx, ranks]
            at_depth = jnp.asarray([x == d for x in node_depth])
            tokens_BN = jnp.where(at_depth[None, :], cand_BN, tokens_BN)
            cache = KVCache(step_cache.k, step_cache.v, cache.lengths)
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

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        cache, prev_B = state[:2]
        last_node_B = jnp.take_along_axis(verdict.path, jnp.maximum(verdict.num_accepted - 1, 0)[:, None], axis=1)
        last_tok_B = jnp.take_along_axis(draft.tokens, last_node_B, axis=1)[:, 0]
        prev_B = jnp.where(verdict.num_accepted > 0, last_tok_B, prev_B)
        if self._dynamic:  # the accepted nodes' K/V sit at their expanded slots, not at their node indices
            offset_BN = state[2]
            return commit(cache, jnp.take_along_axis(offset_BN, verdict.path, axis=1), verdict.num_accepted), \
                prev_B, offset_BN
        return commit(cache, verdict.path, verdict.num_accepted), prev_B

