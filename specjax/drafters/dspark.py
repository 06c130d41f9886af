"""DSpark (deepseek-ai/DeepSpec): a DFlash-style block backbone, a Markov step, a confidence head.

Math (DeepSpec's `Qwen3DSparkModel` and its evaluator, written in specjax's terms).

Parallel stage. The backbone is DFlash's (drafters/dflash.py, shared functions): the target's
hidden states at n taps are the context c_p = hidden_norm(fc(concat(taps))), projected into
every drafter layer's K/V (no input_layernorm; k_norm and RoPE at the token's own position).
The block has gamma = block_size rows at positions P .. P + gamma - 1 (P: the first position the
target has not seen): row 0 is the anchor x_0 (the loop's root), rows 1..gamma-1 MASK, embedded
with DSpark's own frozen copy of the target's table. No causal mask: every row sees the whole
context and the whole block. After the final norm, h_k (k = 1..gamma, row k - 1) and

    U_k = lm_head(h_k)        DSpark's own lm_head copy; row k - 1 predicts the token at P + k.

Unlike DFlash, the anchor row is already a guess: one pass gives gamma drafts, not gamma - 1.

Sequential stage (Markov head, `markov_head_type` "vanilla"; rank r > 0):

    logits_k = U_k + W2 W1[x_{k-1}]          W1 [V, r] (an embedding), W2 [V, r] (Linear(r, V))

left to right, x_0 = the anchor, x_k the draft chosen at step k: argmax when greedy; when sampling,
x_k ~ q_k = the sampling distribution (temperature, top-k, top-p) of logits_k, and q_k rides along
in the Draft so the standard verifier stays lossless. Markov rank 0 (DeepSpec's
`dflash_*_block7` checkpoints are this class) has no head: logits_k = U_k.

Confidence head (`enable_confidence_head`): one linear unit on [h_k; W1[x_{k-1}]] (or on h_k alone
when `confidence_head_with_markov` is false),

    c_k = sigmoid((w . [h_k; W1[x_{k-1}]] + b) / T_k)     = P(draft k accepted | drafts < k accepted)

with h_k the final-normed hidden (the same h that gives U_k) and x_{k-1} the previous *drafted*
token (the anchor for k = 1). T_k are the sequential-temperature-scaling temperatures
(drafters/confidence.py; 1 until calibrated). Without a confidence head, `Draft.confidence` holds
each draft's probability under its own (Markov-adjusted) distribution, DFlash's proxy.

Cost: one backbone pass per round (`calls_per_round` = 1); the Markov step is a gamma-step
`lax.scan` of a gather and an [r] x [r, V] product, no attention, so it is not counted as a pass.

Cache protocol: DFlash's (see drafters/dflash.py): committed rows 0..P-1 hold context K/V, block
K/V are written provisionally after them each round, `update` projects only the newly accepted
tokens' features (the root and the accepted drafts, from the verify pass). This is what the
original evaluator does with `DynamicCache.crop(start)` and the verified hidden states.

Networks (Flax NNX modules, [in, out] matrices; the params are one flat dict, the union of their
plain dicts, merged back per module by `networks`):
    BlockBackbone (drafters/dflash.py): fc, hidden_norm, final_norm, layers (stacked or per-layer);
    Tables (drafters/dflash.py): embed [V, H], lm_head [H, V]: DSpark's own frozen copies;
    MarkovHead: markov_w1 [V, r], markov_w2 [V, r] (none at rank 0); vocab_mask [V] (a pruned draft
        vocabulary only: 0 on its tokens, -inf elsewhere; see DSparkConfig.draft_vocab_size);
    ConfidenceHead: confidence_w [H (+ r)], confidence_b [], and confidence_temperature [gamma] (a
        `Calibration` variable: fitted post hoc, never trained).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from specjax.decoding.drafter import PrefillContext, Settings, drafting_values
from specjax.decoding.sampling import sample_rows, sampling_probs, split_rows
from specjax.decoding.block_tree import ChildrenFn, per_depth_children
from specjax.decoding.tree import spec_arrays
from specjax.decoding.verify import Draft, Verdict
from specjax.drafters.dflash import (BlockBackbone, BlockConfig, Tables, backbone, depth_logits, one_pass_draft, part,
                                     require_block_shape, tables, tree_width)
from specjax.drafters.dflash import init_params as init_block_params
from specjax.models.cache import KVCache
from specjax.models.decoder import unstack_layers
from specjax.models.layers import normal, param
from specjax.models.state import shapes_of, to_params

MARKOV_HEAD_TYPES = ("vanilla",)
# How a one-pass tree applies the Markov step: "parent" biases each node's children by the node's own token (the
# head's training condition: the previous token on the path); "chain" biases each depth once, along the greedy chain,
# so every node at a depth shares its children (JetSpec's per-depth tree on DSpark's chain logits).
TREE_MARKOV = ("parent", "chain")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """A DSpark drafter's static shape: its backbone and heads (hashable: part of the compiled loop's key).

    markov_rank: r, 0 for no Markov head (the `dflash_*_block7` class).
    draft_vocab_size: speculators' DSpark drafts over a pruned vocabulary (lm_head [Vd, H], markov_w2 [Vd, r], d2t).
    It is read into the target's vocabulary: those rows scattered to their target ids, the others zero, and the
    Markov step's `vocab_mask` (-inf off the draft vocabulary), so every logit specjax draws from equals the
    producer's at the draft ids and nothing else can be drafted.
    confidence: whether the checkpoint has a confidence head; confidence_with_markov: whether its
    input is [h_k; W1[x_{k-1}]] (else h_k alone).
    """

    block: BlockConfig
    markov_rank: int = 0
    confidence: bool = False
    confidence_with_markov: bool = False
    markov_head_type: str = "vanilla"
    draft_vocab_size: int = 0  # a pruned draft vocabulary's size (speculators' d2t); 0: the target's whole one

    @property
    def block_size(self) -> int:
        return self.block.block_size

    @property
    def confidence_width(self) -> int:
        """The confidence head's input width: H, plus r with the Markov embedding."""
        return self.block.hidden_size + (self.markov_rank if self.confidence_with_markov else 0)


# ---- the heads -----------------------------------------------------------------------------------------------


class Calibration(nnx.Variable):
    """A value fitted post hoc on verified rounds (the confidence temperatures): state, never a trained Param."""


class VocabMask(nnx.Variable):
    """0 on a pruned draft vocabulary's target ids, -inf elsewhere: a table, never trained."""


class MarkovHead(nnx.Module):
    """The Markov step, `markov_head_type` vanilla: logits_k = U_k + W2 W1[x_{k-1}]; rank 0: no weights, U_k alone.
    With a pruned draft vocabulary, + vocab_mask (every logit goes through here).

    Init: normal(0, scale); vocab_mask all 0 (a test init drafts over the whole vocabulary).
    """

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, scale: float = 0.02):
        v, r = cfg.block.layers.vocab_size, cfg.markov_rank
        dtype = jnp.dtype(cfg.block.layers.dtype)
        self.markov_w1 = param(normal(rngs, (v, r), dtype, scale), "vocab", None) if r else None
        self.markov_w2 = param(normal(rngs, (v, r), dtype, scale), "vocab", None) if r else None
        self.vocab_mask = VocabMask(jnp.zeros((v,), jnp.float32)) if cfg.draft_vocab_size else None

    def embed(self, prev: jax.Array) -> jax.Array:
        """W1[x_prev] in fp32: [..., r] for token ids [...]."""
        return self.markov_w1[...][prev].astype(jnp.float32)

    def __call__(self, u_BV: jax.Array, prev_B: jax.Array) -> jax.Array:
        """U + W2 W1[x_prev] (+ vocab_mask): fp32 logits [B, V] given the backbone's [B, V] and the previous tokens."""
        if self.markov_w1 is not None:
            u_BV = u_BV + jnp.einsum("br,vr->bv", self.embed(prev_B), self.markov_w2[...].astype(jnp.float32))
        if self.vocab_mask is not None:
            u_BV = u_BV + self.vocab_mask[...]
        return u_BV


class ConfidenceHead(nnx.Module):
    """c_k = sigmoid((w . [h_k; W1[x_{k-1}]] + b) / T_k): one linear unit, then the calibrated temperatures.

    Init: w normal(0, scale), b zero, temperatures 1 (uncalibrated).
    """

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, scale: float = 0.02):
        dtype = jnp.dtype(cfg.block.layers.dtype)
        self.confidence_w = param(normal(rngs, (cfg.confidence_width,), dtype, scale), None)
        self.confidence_b = param(jnp.zeros((), dtype))
        self.confidence_temperature = Calibration(jnp.ones((cfg.block_size,), jnp.float32))

    def __call__(self, h_BKH: jax.Array, markov_BKR: jax.Array | None = None) -> jax.Array:
        """The logits [B, K] (before temperature) on [h_k; W1[x_{k-1}]] (or h_k alone: markov None), in fp32."""
        x_BKF = h_BKH.astype(jnp.float32)
        if markov_BKR is not None:
            x_BKF = jnp.concatenate([x_BKF, markov_BKR], axis=-1)
        return x_BKF @ self.confidence_w[...].astype(jnp.float32) + self.confidence_b[...].astype(jnp.float32)

    def calibrated(self, logits_BK: jax.Array) -> jax.Array:
        """c_k = sigmoid(logit_k / T_k) with the stored per-position temperatures (1 until calibrated)."""
        k = logits_BK.shape[-1]
        return jax.nn.sigmoid(logits_BK / self.confidence_temperature[...][:k].astype(jnp.float32))


class DSparkNetworks(NamedTuple):
    """DSpark's modules over one flat params dict (`networks`); confidence None without a confidence head."""

    cfg: DSparkConfig
    backbone: BlockBackbone
    tables: Tables
    markov: MarkovHead
    confidence: ConfidenceHead | None

    def confidence_logits(self, h_BKH: jax.Array, prev_BK: jax.Array) -> jax.Array:
        """The confidence head's logits [B, K] on [h_k; W1[x_{k-1}]] (h_k alone unless confidence_with_markov)."""
        markov_BKR = self.markov.embed(prev_BK) if self.cfg.confidence_with_markov else None
        return self.confidence(h_BKH, markov_BKR)


def networks(cfg: DSparkConfig, params: dict) -> DSparkNetworks:
    """The modules holding DSpark params (the same arrays: nothing copied), in the layer layout they are in."""
    return DSparkNetworks(cfg, backbone(cfg.block, params), tables(cfg.block, params), part(MarkovHead, cfg, params),
                          part(ConfidenceHead, cfg, params) if cfg.confidence else None)


def param_shapes(cfg: DSparkConfig) -> dict:
    """Every parameter's shape except the backbone's (drafters/dflash.param_shapes): the tables' and the heads'."""
    makes = [lambda: Tables(cfg.block, rngs=nnx.Rngs(0)), lambda: MarkovHead(cfg, rngs=nnx.Rngs(0))]
    if cfg.confidence:
        makes.append(lambda: ConfidenceHead(cfg, rngs=nnx.Rngs(0)))
    return {name: shape for make in makes for name, shape in shapes_of(make).items()}


def init_params(cfg: DSparkConfig, key: jax.Array, embed: jax.Array | None = None,
                lm_head: jax.Array | None = None) -> dict:
    """Random DSpark params for tests (stacked layers): the backbone's test init, heads ~ N(0, 1/fan_in), temperatures 1.

    embed / lm_head default to random tables; pass the target's to copy them as DeepSpec's training does.
    """
    k_block, k_heads = jax.random.split(key)
    rngs = nnx.Rngs(params=k_heads)
    h, r = cfg.block.hidden_size, max(cfg.markov_rank, 1)
    params = init_block_params(cfg.block, k_block) | to_params(Tables(cfg.block, rngs=rngs, scale=h ** -0.5))
    params |= to_params(MarkovHead(cfg, rngs=rngs, scale=r ** -0.5))
    if cfg.confidence:
        params |= to_params(ConfidenceHead(cfg, rngs=rngs, scale=cfg.confidence_width ** -0.5))
    if embed is not None:
        params["embed"] = embed
    if lm_head is not None:
        params["lm_head"] = lm_head
    return params


def markov_chain(markov: MarkovHead, settings: Settings, u_BKV: jax.Array, anchor_B: jax.Array,
                 keys_KB: jax.Array | None, sampling=None):
    """The sequential stage, left to right: drafts [B, K], q [B, K, V] (None when greedy), logits [B, K, V].

    Step k adds W2 W1[x_{k-1}] to U_k (x_0 = the anchor; nothing without a Markov head) and picks x_k:
    argmax, or a draw from the sampling distribution with row keys keys_KB[k].
    """
    greedy = settings.sampling.greedy

    def step(prev_B, xs):
        """One position: bias by the previous token, choose; carries the choice to the next position."""
        u_BV, key_B = xs
        logits_BV = markov(u_BV, prev_B)
        if greedy:
            tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
            return tok_B, (tok_B, logits_BV, None)
        q_BV = sampling_probs(logits_BV, drafting_values(settings, sampling))
        tok_B = sample_rows(key_B, q_BV)
        return tok_B, (tok_B, logits_BV, q_BV)

    u_KBV = jnp.moveaxis(u_BKV, 1, 0)
    xs = (u_KBV, keys_KB if not greedy else jnp.zeros(u_KBV.shape[:2], jnp.int32))  # greedy: no keys needed
    _, (tok_KB, logits_KBV, q_KBV) = lax.scan(step, anchor_B.astype(jnp.int32), xs)
    q_BKV = None if q_KBV is None else jnp.moveaxis(q_KBV, 0, 1)
    return tok_KB.T, q_BKV, jnp.moveaxis(logits_KBV, 0, 1)


def parent_children(markov: MarkovHead, u_BLV: jax.Array, k: int) -> ChildrenFn:
    """Tree children conditioned on their own parent: the top k of log_softmax(U_{d+1} + W2 W1[parent token])."""

    def children(level, parents_BE):
        b, e = parents_BE.shape
        u_BV = lax.dynamic_index_in_dim(u_BLV, level, axis=1, keepdims=False)
        u_XV = jnp.broadcast_to(u_BV[:, None], (b, e, u_BV.shape[-1])).reshape(b * e, -1)
        logits_XV = markov(u_XV, parents_BE.reshape(b * e))
        lp_XK, tok_XK = lax.top_k(jax.nn.log_softmax(logits_XV, axis=-1), k)
        return lp_XK.reshape(b, e, k), tok_XK.astype(jnp.int32).reshape(b, e, k)

    return children


def drafter_params(block: dict, heads: dict, per_layer: bool) -> dict:
    """What DSparkDrafter runs: the block params (per-layer or stacked) and the DSpark heads and tables."""
    block = unstack_layers(block) if per_layer else block
    return {**block, **heads}


# ---- the drafter: chains -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """DSpark behind the Drafter protocol: one block pass per round, then the Markov chain.

    State: the drafter's KVCache (context K/V at rows 0..P-1, `lengths` equal to the target's).
    `propose` runs the block [root, MASK x (gamma - 1)] (always the full block: its rows see each
    other, so a shorter block would change them), and drafts k = num_draft_tokens <= gamma tokens
    with the Markov step (greedy, or sampled with q); `Draft.confidence` holds 1 for the root and
    c_1..c_k (see the module docstring). `update` projects only the accepted path's features.
    """

    cfg: DSparkConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    settings: Settings | None = None
    attn_impl: str = "auto"
    name: str = "dspark"
    tree_markov: str = "parent"  # one-pass trees: TREE_MARKOV
    one_pass_trees = True  # a whole tree from one block pass: "auto" prices trees as such (planning/block_trees.py)

    def __post_init__(self):
        if self.tree_markov not in TREE_MARKOV:
            raise ValueError(f"tree_markov must be one of {TREE_MARKOV}, got {self.tree_markov!r}")

    @property
    def model(self) -> DSparkNetworks:
        """DSpark's Flax NNX modules (backbone, tables, Markov and confidence heads) over the same arrays as `params`."""
        return networks(self.cfg, self.params)

    def __repr__(self) -> str:
        """One line of facts, not the weights."""
        lc = self.cfg.block.layers
        conf = "none" if not self.cfg.confidence else ("with_markov" if self.cfg.confidence_with_markov else "hidden")
        return (f"DSparkDrafter(layers={lc.num_layers}, block_size={self.cfg.block_size}, "
                f"markov_rank={self.cfg.markov_rank}, confidence={conf}, taps={list(self.cfg.block.feature_layers)}, "
                f"hidden={lc.hidden_size}, vocab={lc.vocab_size}, dtype={lc.dtype}, attn_impl={self.attn_impl})")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.block.feature_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.block.layers.vocab_size

    @property
    def max_draft_tokens(self) -> int:
        """Drafts one block gives: block_size (the anchor row is already a guess)."""
        return self.cfg.block_size

    def configure(self, settings: Settings) -> "DSparkDrafter":
        require_block_shape("DSpark", settings, self.cfg.block_size, self.max_draft_tokens)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        """One backbone pass per round; the Markov step is a cheap scan (no attention) and is not counted."""
        return 1

    def with_temperatures(self, temperatures) -> "DSparkDrafter":
        """The same drafter with per-position confidence temperatures T_1..T_gamma (sequential temperature scaling)."""
        if not self.cfg.confidence:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head false), so there is "
                             "nothing to calibrate")
        t = jnp.asarray(temperatures, jnp.float32).reshape(-1)
        if t.shape != (self.cfg.block_size,):
            raise ValueError(f"expected {self.cfg.block_size} temperatures (one per block position), got {t.shape[0]}")
        if not bool(jnp.all(t > 0)):
            raise ValueError(f"confidence temperatures must be > 0, got {t.tolist()}")
        return dataclasses.replace(self, params={**self.params, "confidence_temperature": t})

    def init(self, params, ctx: PrefillContext) -> KVCache:
        return backbone(self.cfg.block, params).context_after_prefill(ctx, self.settings.cache_len)

    def propose(self, params, state: KVCache, root_B, keys_B, sampling=None):
        net = networks(self.cfg, params)
        h_BGH, cache = net.backbone.block_hidden(net.tables.block_embeddings(root_B), state, attn_impl=self.attn_impl)
        if not self.settings.tree.is_chain:
            return self._propose_tree(net, h_BGH, root_B), cache
        k = self.settings.tree.num_nodes - 1
        b = root_B.shape[0]
        h_BKH = h_BGH[:, :k]  # row k - 1 predicts position P + k: draft k
        u_BKV = net.tables.logits(h_BKH)
        keys_KB = None if self.settings.sampling.greedy else split_rows(keys_B, k)
        drafts_BK, q_BKV, logits_BKV = markov_chain(net.markov, self.settings, u_BKV, root_B, keys_KB,
                                                    drafting_values(self.settings, sampling))
        if net.confidence is not None:
            prev_BK = jnp.concatenate([root_B[:, None].astype(jnp.int32), drafts_BK[:, :-1]], axis=1)
            conf_BK = net.confidence.calibrated(net.confidence_logits(h_BKH, prev_BK))
        else:
            probs_BKV = q_BKV if q_BKV is not None else jax.nn.softmax(logits_BKV, axis=-1)
            conf_BK = jnp.take_along_axis(probs_BKV, drafts_BK[:, :, None], axis=-1)[..., 0]
        tokens_BN = jnp.concatenate([root_B[:, None].astype(jnp.int32), drafts_BK], axis=1)
        confidence_BN = jnp.concatenate([jnp.ones((b, 1), jnp.float32), conf_BK.astype(jnp.float32)], axis=1)
        root_row = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
        draft = Draft(tokens_BN, spec_arrays(self.settings.tree, b), jnp.ones(tokens_BN.shape, jnp.bool_),
                      q=None if q_BKV is None else root_row(q_BKV), confidence=confidence_BN,
                      logits=root_row(logits_BKV) if self.settings.record_logits else None)
        return draft, cache

    def _propose_tree(self, net: DSparkNetworks, h_BGH: jax.Array, root_B: jax.Array) -> Draft:
        """A one-pass tree (dynamic, or a static template), deterministic under any sampling: children from each
        node's own Markov step ("parent") or from the greedy chain's per-depth logits ("chain")."""
        spec, width = self.settings.tree, tree_width(self.settings.tree)
        u_BLV = net.tables.logits(h_BGH[:, :spec.max_depth])  # row d - 1 predicts depth d
        record = self.settings.record_logits
        if self.tree_markov == "chain":
            greedy = dataclasses.replace(self.settings, sampling=dataclasses.replace(self.settings.sampling,
                                                                                      temperature=0.0))
            _, _, logits_BLV = markov_chain(net.markov, greedy, u_BLV, root_B, None)
            children = per_depth_children(jax.nn.log_softmax(logits_BLV, -1), width)
            return one_pass_draft(spec, root_B, children,
                                  (lambda t, p, d: depth_logits(logits_BLV, d)) if record else None)

        def node_logits(tokens_BN, parents_BN, depths_BN):  # U of the node's depth biased by its parent's token
            parent_tok_BN = jnp.take_along_axis(tokens_BN, jnp.maximum(parents_BN, 0), axis=1)
            u_BNV = depth_logits(u_BLV, depths_BN)
            b, n, v = u_BNV.shape
            return net.markov(u_BNV.reshape(b * n, v), parent_tok_BN.reshape(b * n)).reshape(b, n, v)

        return one_pass_draft(spec, root_B, parent_children(net.markov, u_BLV, width), node_logits if record else None)

    def update(self, params, state: KVCache, draft: Draft, verdict: Verdict, features) -> KVCache:
        return backbone(self.cfg.block, params).context_after_round(state, verdict, features)
