"""DFlash (z-lab/dflash): a block-diffusion drafter that guesses a whole block in one pass.

Math (z-lab/dflash `DFlashDraftModel`, written in specjax's terms). The target's hidden states
at n tap layers are the drafter's context:

    c_p = hidden_norm(fc(concat(g_p^(1), ..., g_p^(n))))          n*H -> H, no bias, per position p

A block of K = block_size rows starts at position P (the first position the target has not
seen): row 0 is the anchor (the last chosen token, the loop's root), rows 1..K-1 the MASK token,
embedded with the target's own table. Each of the drafter's L decoder layers (Qwen3-style:
q/k RMSNorm per head, rotate-half RoPE, SwiGLU MLP) runs the block rows as usual
(input_layernorm, q/k/v), but its keys and values are the context rows 0..P-1 followed by the
block rows, and there is no causal mask: every block row sees the whole context and the whole
block (a `causal_head` drafter, JetSpec's, masks the block causally: row i sees block rows 0..i). The context rows are projected by every layer with that layer's own wk / wv, k_norm and
RoPE at the context token's own position, with no input_layernorm (c_p is already normed), and
the same c_p feeds every layer. After the last layer the final norm, then the target's lm_head:

    block row j (1 <= j <= K-1) at position P + j predicts the token at P + j.

So one pass gives K-1 guesses; specjax drafts the chain of their argmaxes (deterministic, q None:
lossless under any sampling with the standard verifier).

Tap numbering: the original names taps by `target_layer_ids` and reads Hugging Face
`hidden_states[id + 1]` (the output of layer id). specjax's `feature_layers` use HF numbering
directly, so `feature_layers = tuple(id + 1 for id in target_layer_ids)`. HF's last hidden state
is already final-normed while specjax's capture of layer L is pre-norm, so a tap of the target's
last layer (id = L - 1) is refused at load time (convert/dflash.py); the original never uses one.

Cache protocol. The drafter keeps its own per-layer KV cache whose committed rows 0..P-1 hold
the context K/V (never block K/V); its `lengths` equal the target's. Each round:
  propose  writes the block's K/V provisionally at P..P+K-1 (beyond `lengths`, never read
           later), attends, and reads rows 1..k of the block for k drafts;
  update   projects only the newly accepted tokens' features (the root and the accepted drafts,
           taken from the verify pass at the accepted path's nodes) into rows P..P+a-1 and
           advances `lengths` by a. The prefix is never projected again.
This is what the original's `spec_generate` does with `DynamicCache.crop(start)` after each
draft pass and the accepted tokens' hidden states fed as next round's `target_hidden`.
The cache has `block_size` (rounded up to 16) rows more than the target's, so a block near the
end of the target's cache still has every row (the block is non-causal: a dropped row would
change the others).

Networks (Flax NNX modules; [in, out] matrices, as everywhere in specjax):
    BlockBackbone: fc [n*H, H]; hidden_norm [H]; final_norm [H]; layers: `models.decoder.DecoderLayer`s
            (attn_norm, wq, wk, wv, wo, q_norm, k_norm, mlp_norm, w_gate, w_up, w_down), stacked on a
            leading axis L, or an nnx.List of per-layer ones (the CPU layout); the cache follows the layout.
    Tables: embed [V, H] and lm_head [H, V] (absent for a tied target: the embed scores the rows).
A drafter's params are one flat dict, the union of its modules' plain dicts (`models.state.to_params`;
the tree the converters and checkpoints use); `part` merges each module back from its own entries.
The DFlashDrafter's Tables hold the target's arrays (the same arrays, not copies); the backbone never
touches them, so a drafter with its own copies (DSpark) runs it unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.decoding.block_tree import ChildrenFn, build_block_tree, levels, per_depth_children, static_block_tree
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, child_ranks, spec_arrays
from specjax.decoding.verify import Draft, Verdict
from specjax.models.cache import KVCache, init_cache, write_layer
from specjax.models.decoder import DecoderLayer, has_layer_list, run_layers, unstack_layers
from specjax.models.layers import normal, param, rms_norm, rope_inv_freq
from specjax.models.sharding import constrain_cache
from specjax.models.state import module_graph, shapes_of, to_params


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A DFlash backbone: its decoder layers, the target taps it reads, the block it drafts (hashable).

    layers: the drafter's decoder layers as a ModelConfig (num_layers = drafter layers; qk_norm as
        Qwen3; vocab_size the target's, unused by the layers); hidden_size equals the target's.
    target_layer_ids: the original's tap numbering (context uses HF hidden_states[id + 1]);
        see `feature_layers` for specjax's (HF) numbering.
    block_size: rows per block, the anchor included (K - 1 drafts per pass at most).
    mask_token_id: the token whose embedding fills rows 1..K-1.
    causal: `dflash_config.causal_head` (JetSpec's heads): block row i attends to block rows 0..i only (and the
        whole context); False: every block row sees the whole block (z-lab's DFlash, DSpark).
    """

    layers: ModelConfig
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    causal: bool = False

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The taps in specjax's Hugging Face hidden_states numbering: id + 1 (the output of layer id)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)


def block_cache_len(cfg: BlockConfig, target_cache_len: int) -> int:
    """The drafter cache's length: the target's plus a block (rounded up to 16), so no block row is dropped."""
    return target_cache_len + -(-cfg.block_size // 16) * 16


# ---- the networks ------------------------------------------------------------------------------------------


class BlockBackbone(nnx.Module):
    """The block backbone: context c = hidden_norm(fc(taps)), decoder layers over context K/V and the block, final norm.

    per_layer: the layers as an nnx.List of `DecoderLayer`s (unrolled; the CPU layout), else one
    stacked DecoderLayer run under scan. Init: matrices normal(0, scale), norms ones (HF's).
    """

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, per_layer: bool = False, scale: float = 0.02):
        self.cfg = cfg
        lc, h = cfg.layers, cfg.hidden_size
        dtype = jnp.dtype(lc.dtype)
        self.fc = param(normal(rngs, (cfg.num_taps * h, h), dtype, scale), None, "embed")
        self.hidden_norm = param(jnp.ones((h,), dtype), "embed")
        if per_layer:
            self.layers = nnx.List([DecoderLayer(lc, rngs=rngs, scale=scale) for _ in range(lc.num_layers)])
        else:
            self.layers = DecoderLayer(lc, rngs=rngs, stacked=lc.num_layers, scale=scale)
        self.final_norm = param(jnp.ones((h,), dtype), "embed")

    @property
    def per_layer(self) -> bool:
        return isinstance(self.layers, nnx.List)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """The drafter's own KV cache, lengths 0, in this backbone's layer layout (per-layer buffers or stacked); under
        a mesh the batch split over "data", the heads replicated as the backbone's weights are (models/sharding.py)."""
        return constrain_cache(init_cache(self.cfg.layers, batch, max_len, per_layer=self.per_layer),
                               split_heads=False)

    def context(self, features: Sequence[jax.Array]) -> jax.Array:
        """c = hidden_norm(fc(concat(taps))): [B, T, H] from the n taps [B, T, H] each, in target_layer_ids order."""
        fc = self.fc[...]
        feats_BTF = jnp.concatenate([f.astype(fc.dtype) for f in features], axis=-1)
        return rms_norm(feats_BTF @ fc, self.hidden_norm[...], self.cfg.layers.rms_norm_eps)

    def write_context(self, ctx_BTH: jax.Array, cache: KVCache, start_B: jax.Array | None = None, *,
                      positions_BT: jax.Array | None = None) -> KVCache:
        """Every layer's context K/V for T context rows, written at cache rows start_B + t (start defaults to lengths).

        Each layer projects the same c (no input_layernorm) with its own wk / wv (+ biases), k_norm and
        RoPE at positions_BT (default start_B + t: the context tokens' own positions). `lengths` are
        returned unchanged; the caller advances them by the rows it keeps.
        """
        t = ctx_BTH.shape[1]
        if start_B is None:
            start_B = cache.lengths
        if positions_BT is None:
            positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        inv_freq = rope_inv_freq(self.cfg.layers.rope, self.cfg.layers.head_dim)

        def layer_fn(layer, i, idx, c_BTH, k_cache, v_cache, extra):
            _, k_BTKD, v_BTKD = layer.project_qkv(c_BTH, positions_BT, inv_freq)  # q unused: DCE'd under jit
            return c_BTH, write_layer(k_cache, idx, k_BTKD, start_B), write_layer(v_cache, idx, v_BTKD, start_B), extra

        _, (k, v), _ = run_layers(self.layers, ctx_BTH, cache, layer_fn)
        return KVCache(k, v, cache.lengths)

    def block_hidden(self, block_emb_BKH: jax.Array, cache: KVCache, start_B: jax.Array | None = None, *,
                     attn_impl: str = "auto") -> tuple[jax.Array, KVCache]:
        """The block's hidden states after the final norm [B, K, H], and the cache with the block's K/V written.

        The K block rows sit at positions start_B .. start_B + K - 1 (start defaults to `lengths`) and
        attend to the cached context rows [0, start) and to all K block rows (a causal head, `cfg.causal`: to
        block rows 0..i only, as JetSpec's `_build_dflash_causal_attention_mask`).
        The block's K/V land at cache rows start .. start + K - 1, after the context; `lengths` are
        unchanged (block rows are never committed). Row k's logits (lm_head of row k) predict the token
        at start + k (DFlash reads rows 1..K-1; DSpark, whose row 0 is already a guess, reads them all).
        """
        lc = self.cfg.layers
        b, k_rows, _ = block_emb_BKH.shape
        if start_B is None:
            start_B = cache.lengths
        positions_BK = start_B[:, None] + jnp.arange(k_rows, dtype=jnp.int32)[None, :]
        block_mask_KK = jnp.tril(jnp.ones((k_rows, k_rows), jnp.bool_)) if self.cfg.causal else \
            jnp.ones((k_rows, k_rows), jnp.bool_)
        block_mask_BKK = jnp.broadcast_to(block_mask_KK, (b, k_rows, k_rows))
        inv_freq = rope_inv_freq(lc.rope, lc.head_dim)

        def layer_fn(layer, i, idx, h_BKH, k_cache, v_cache, extra):
            h_BKH, k_cache, v_cache = layer(h_BKH, k_cache, v_cache, idx, start_B, positions_BK, block_mask_BKK,
                                            inv_freq, attn_impl)
            return h_BKH, k_cache, v_cache, extra

        h_BKH, (k, v), _ = run_layers(self.layers, block_emb_BKH.astype(self.fc[...].dtype), cache, layer_fn)
        return rms_norm(h_BKH, self.final_norm[...], lc.rms_norm_eps), KVCache(k, v, cache.lengths)

    def context_after_prefill(self, ctx: PrefillContext, target_cache_len: int) -> KVCache:
        """A block drafter's state after the target's prefill: its cache with every prompt position's context K/V,
        `lengths` = the prompt lengths (the root is not context yet: the target has not seen it)."""
        b = ctx.prompt.shape[0]
        cache = self.init_cache(b, block_cache_len(self.cfg, target_cache_len))
        cache = self.write_context(self.context(ctx.features), cache, jnp.zeros((b,), jnp.int32))
        return KVCache(cache.k, cache.v, ctx.prompt_len)

    def context_after_round(self, state: KVCache, verdict: Verdict, features) -> KVCache:
        """The state after a round: context K/V of only the newly accepted tokens (root and accepted drafts, their
        features from the verify pass at the accepted path), written after the committed rows."""
        feats = tuple(jnp.take_along_axis(f, verdict.path[:, :, None], axis=1) for f in features)
        cache = self.write_context(self.context(feats), state)
        return KVCache(cache.k, cache.v, cache.lengths + verdict.num_accepted)


class Tables(nnx.Module):
    """A block drafter's vocabulary tables: embed [V, H] fills the block rows, lm_head [H, V] scores them.

    tied: no lm_head (the embed scores the rows, as a tied target's). Init: normal(0, scale).
    """

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, tied: bool = False, scale: float = 0.02):
        self.cfg = cfg
        v, h = cfg.layers.vocab_size, cfg.hidden_size
        dtype = jnp.dtype(cfg.layers.dtype)
        self.embed = param(normal(rngs, (v, h), dtype, scale), "vocab", "embed")
        self.lm_head = None if tied else param(normal(rngs, (h, v), dtype, scale), "embed", "vocab")

    def block_embeddings(self, anchor_B: jax.Array) -> jax.Array:
        """[B, block_size, H]: the anchor's embedding, then MASK's (embed[mask_token_id]) for the other rows."""
        ids_BK = jnp.full((anchor_B.shape[0], self.cfg.block_size), self.cfg.mask_token_id, jnp.int32)
        return self.embed[...][ids_BK.at[:, 0].set(anchor_B)]

    def logits(self, h_BKH: jax.Array) -> jax.Array:
        """fp32 logits [B, K, V] from final-normed hidden: lm_head [H, V], or the tied embed [V, H]."""
        if self.lm_head is None:
            return jnp.einsum("bkh,vh->bkv", h_BKH, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("bkh,hv->bkv", h_BKH, self.lm_head[...], preferred_element_type=jnp.float32)


# ---- modules <-> a drafter's flat params dict ---------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def graph(cls: type[nnx.Module], cfg, **options) -> tuple[nnx.GraphDef, tuple[str, ...]]:
    """The graph of cls(cfg, **options) (shapes only: no weights made) and its top-level param names."""
    return module_graph(cls, cfg, **options), tuple(shapes_of(lambda: cls(cfg, rngs=nnx.Rngs(0), **options)))


def part(cls: type[nnx.Module], cfg, params: dict, **options) -> nnx.Module:
    """The cls module over its own entries of a drafter's flat params dict (the same arrays: nothing copied)."""
    g, names = graph(cls, cfg, **options)
    return nnx.merge(g, {name: params[name] for name in names})


def backbone(cfg: BlockConfig, params: dict) -> BlockBackbone:
    """The BlockBackbone in params (fc, hidden_norm, layers, final_norm), in the layer layout they are in."""
    return part(BlockBackbone, cfg, params, per_layer=has_layer_list(params))


def tables(cfg: BlockConfig, params: dict) -> Tables:
    """The Tables in params: embed, and lm_head unless there is none (tied)."""
    return part(Tables, cfg, params, tied="lm_head" not in params)


def param_shapes(cfg: BlockConfig) -> dict:
    """Every backbone parameter's shape ([in, out] matrices, layers stacked on L); what conversion checks."""
    return shapes_of(lambda: BlockBackbone(cfg, rngs=nnx.Rngs(0)))


def init_params(cfg: BlockConfig, key: jax.Array) -> dict:
    """Random backbone params (stacked layers) for tests, every weight mattering: norms ~ 1 + 0.1 N(0,1), matrices
    ~ N(0, 1/H) (about 1/fan_in)."""
    rngs = nnx.Rngs(params=key)
    params = to_params(BlockBackbone(cfg, rngs=rngs, scale=cfg.hidden_size ** -0.5))

    def jitter(path, x):
        if "norm" not in str(path[-1]):
            return x
        return (1.0 + 0.1 * jax.random.normal(rngs.params(), x.shape)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(jitter, params)


def drafter_params(block: dict, target_params: dict, tie_word_embeddings: bool, per_layer: bool) -> dict:
    """What DFlashDrafter runs: the block params plus the target's embed (and lm_head when untied), in a layout."""
    block = unstack_layers(block) if per_layer else block
    params = {**block, "embed": target_params["embed"]}
    if not tie_word_embeddings:
        params["lm_head"] = target_params["lm_head"]
    return params


def require_block_shape(family: str, settings: Settings, block_size: int, max_draft_tokens: int) -> None:
    """A block drafter drafts from one block pass: a chain, a static tree or a one-pass dynamic tree
    (decoding/block_tree.py) whose paths fit in the block; refuse a deeper shape, saying what would fit."""
    tree = settings.tree
    if isinstance(tree, DynamicTreeSpec):
        if levels(tree) > max_draft_tokens:
            raise ValueError(f"tree {tree} reaches depth {levels(tree)} (depth + 1), more than one {family} block "
                             f"gives: block_size {block_size} drafts at most {max_draft_tokens} tokens per round; "
                             f"pass depth <= {max_draft_tokens - 1}")
        return
    if tree.max_depth > max_draft_tokens:
        what = f"num_draft_tokens={tree.max_depth}" if tree.is_chain else f"a tree {tree.max_depth} deep"
        raise ValueError(f"{what} is more than one {family} block gives: block_size {block_size} drafts at most "
                         f"{max_draft_tokens} tokens per round; pass num_draft_tokens <= {max_draft_tokens} "
                         f"(or a tree at most that deep)")


def one_pass_draft(spec: TreeSpec | DynamicTreeSpec, root_B: jax.Array, children: ChildrenFn,
                   node_logits: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None) -> Draft:
    """A block drafter's tree from one pass, as a deterministic Draft (q None): JetSpec's dynamic tree
    (`build_block_tree`; confidence = exp(cumulative log-probability), the drafter's P(path accepted) proxy) or a
    static template (`static_block_tree`). node_logits(tokens, parents, depths) -> [B, N, V], the logits each node
    was chosen from (inspect_draft), or None."""
    if isinstance(spec, DynamicTreeSpec):
        tree = build_block_tree(spec, root_B, children)
        tokens_BN, parents_BN, depths_BN, confidence_BN = tree.tokens, tree.parents, tree.depths, jnp.exp(tree.scores)
    else:
        tokens_BN = static_block_tree(spec, root_B, children)
        parents_BN = spec_arrays(spec, root_B.shape[0])
        depths_BN = jnp.broadcast_to(jnp.asarray(spec.depths, jnp.int32), tokens_BN.shape)
        confidence_BN = None
    logits_BNV = None
    if node_logits is not None:
        logits_BNV = jnp.where((depths_BN == 0)[:, :, None], 0.0, node_logits(tokens_BN, parents_BN, depths_BN))
    return Draft(tokens_BN, parents_BN, jnp.ones(tokens_BN.shape, jnp.bool_), confidence=confidence_BN,
                 logits=logits_BNV)


def tree_width(spec: TreeSpec | DynamicTreeSpec) -> int:
    """Children a node may get: top_k, or a static template's most."""
    return spec.top_k if isinstance(spec, DynamicTreeSpec) else max(child_ranks(spec)) + 1


def depth_logits(logits_BLV: jax.Array, depths_BN: jax.Array) -> jax.Array:
    """[B, N, V]: each node's depth's logits (row d - 1 of logits_BLV for depth d; the root's row is depth 1's)."""
    return jnp.take_along_axis(logits_BLV, jnp.maximum(depths_BN - 1, 0)[:, :, None], axis=1)


# ---- the drafter: chains -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """DFlash behind the Drafter protocol: one block pass per round, a chain of argmax drafts.

    State: the drafter's KVCache (see the module docstring): context K/V at rows 0..P-1, `lengths`
    equal to the target's. `propose` runs the block [root, MASK x (block_size - 1)] once and takes
    rows 1..k (k = num_draft_tokens <= block_size - 1; k = block_size - 1, what the original drafts,
    is the recommended setting: the loop's default chain of 4 uses only part of a 16-row block; the
    whole block is computed either way, as its rows see each other); drafts are deterministic (q None) under any
    sampling, and `Draft.confidence` holds each draft's softmax probability under the drafter (root
    1.0): not a calibrated acceptance rate, but the usual proxy for one. `update` projects only the
    accepted path's features.
    params: the block params (stacked or per-layer; the cache follows) plus `embed` and, for an
    untied target, `lm_head` (the target's arrays; see `dflash_drafter`).
    """

    cfg: BlockConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    settings: Settings | None = None
    attn_impl: str = "auto"
    name: str = "dflash"
    one_pass_trees = True  # a whole tree from one block pass: "auto" prices trees as such (planning/block_trees.py)

    @property
    def model(self) -> BlockBackbone:
        """The block backbone (a Flax NNX module) over the same arrays as `params`; its tables are the target's."""
        return backbone(self.cfg, self.params)

    def __repr__(self) -> str:
        """One line of facts, not the weights."""
        lc = self.cfg.layers
        return (f"DFlashDrafter(layers={lc.num_layers}, block_size={self.cfg.block_size}, "
                f"taps={list(self.cfg.feature_layers)}, hidden={lc.hidden_size}, vocab={lc.vocab_size}, "
                f"dtype={lc.dtype}, attn_impl={self.attn_impl})")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.layers.vocab_size

    @property
    def max_draft_tokens(self) -> int:
        """Drafts one block gives: block_size - 1 (the recommended num_draft_tokens)."""
        return self.cfg.block_size - 1

    def configure(self, settings: Settings) -> "DFlashDrafter":
        require_block_shape("DFlash", settings, self.cfg.block_size, self.max_draft_tokens)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return 1  # one block pass (update only projects the accepted rows' K/V)

    def init(self, params, ctx: PrefillContext) -> KVCache:
        return backbone(self.cfg, params).context_after_prefill(ctx, self.settings.cache_len)

    def propose(self, params, state: KVCache, root_B, keys_B, sampling=None):
        del keys_B, sampling  # argmax drafts (or top-k trees) under any sampling
        spec = self.settings.tree
        b = root_B.shape[0]
        vocab = tables(self.cfg, params)
        h_BKH, cache = backbone(self.cfg, params).block_hidden(vocab.block_embeddings(root_B), state,
                                                               attn_impl=self.attn_impl)
        if not spec.is_chain:  # a tree from the per-depth distributions of the same pass (JetSpec's, or a template)
            logits_BLV = vocab.logits(h_BKH[:, 1:spec.max_depth + 1])  # row d predicts depth d
            children = per_depth_children(jax.nn.log_softmax(logits_BLV, -1), tree_width(spec))
            record = (lambda t, p, d: depth_logits(logits_BLV, d)) if self.settings.record_logits else None
            return one_pass_draft(spec, root_B, children, record), cache
        k = spec.num_nodes - 1
        logits_BkV = vocab.logits(h_BKH[:, 1:k + 1])  # row j predicts position P + j: draft j
        drafts_Bk = jnp.argmax(logits_BkV, axis=-1).astype(jnp.int32)
        prob_Bk = jnp.take_along_axis(jax.nn.softmax(logits_BkV, axis=-1), drafts_Bk[:, :, None], axis=-1)[..., 0]
        tokens_BN = jnp.concatenate([root_B[:, None].astype(jnp.int32), drafts_Bk], axis=1)
        confidence_BN = jnp.concatenate([jnp.ones((b, 1), jnp.float32), prob_Bk], axis=1)
        logits = None
        if self.settings.record_logits:
            logits = jnp.concatenate([jnp.zeros_like(logits_BkV[:, :1]), logits_BkV], axis=1)
        draft = Draft(tokens_BN, spec_arrays(spec, b), jnp.ones(tokens_BN.shape, jnp.bool_),
                      confidence=confidence_BN, logits=logits)
        return draft, cache

    def update(self, params, state: KVCache, draft: Draft, verdict: Verdict, features) -> KVCache:
        return backbone(self.cfg, params).context_after_round(state, verdict, features)
