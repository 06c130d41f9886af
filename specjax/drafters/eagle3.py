"""EAGLE-3 head: a drafter that reads target features from several depths (three, or DeepSpec's five).

Inference math (the SafeAILab/EAGLE `cnets.Model` forward, written in specjax's terms):

    first step:   h = fc(concat(g_1, ..., g_n))                n x target hidden -> H, no bias
                  [EAGLE-3.1: fc(concat(norm_1(g_1), ..., norm_n(g_n))) under fc_norm, or
                  fc(norm(concat(g_1, ..., g_n))) under the older norm_before_fc]
    every step:   x = concat(input_layernorm(embed(tok)), hidden_norm(h))     embedding first, 2H
                  q, k, v = x @ Wq, Wk, Wv; [q/k RMSNorm per head]; RoPE (the config's head_dim, else H / heads;
                  the head's own base)
                  h' = r + o_proj(attention over the head's own KV cache)    r = h, or hidden_norm(h) when
                                                                             norm_before_residual
                  h' = h' + mlp(post_attention_layernorm(h'))
                  [layers 1 .. L-1: plain pre-norm decoder layers over H (vLLM / speculators multi-layer heads)]
                  logits = lm_head(norm(h'))                                  over the draft vocab
    later steps feed h' (the last layer's pre-norm output) back as h (no fc), so the head drafts a chain from
    its own output; an EAGLE-3.1 head with norm_output feeds back norm(h') instead, and its logits are
    lm_head(norm(h')) with the norm applied once.

The producers differ only in what the brackets say and where the weights live (convert/eagle3.py and
convert/eagle3_layouts.py read each one's layout): DeepSpec's and speculators' Qwen3 heads add q/k norms,
speculators' heads may set norm_before_residual, vLLM / speculators / ModelOpt heads may have several layers,
ModelOpt heads may have no lm_head of their own (then the target's scores them, `lm_head="target"`), EAGLE-3.1
heads (vLLM's llama_eagle3.py, speculators' models/eagle3/core.py, SpecForge's llama3_eagle.py) add fc_norm,
norm_before_fc or norm_output.

Pairing: feature row p (the target's hidden states at token t_p) goes with the embedding
of t_{p+1}; the row of the newest token goes with the token just chosen. A draft id maps
to a target id as `draft_id + d2t[draft_id]`.

The network is `Eagle3Head` (an NNX module); its plain-dict form (`to_params`, what the
checkpoint reader produces and the drafter carries), [in, out] matrices as everywhere in specjax:
    fc [n*Ht, H]; fc_norm [n, Ht] (fc_norm only); input_norm [n*Ht] (norm_before_fc only);
    layer {embed_norm [H] (input_layernorm), hidden_norm [H], wq [2H, Hq*D],
    wk/wv [2H, Hkv*D], (q_norm, k_norm [D]), wo [Hq*D, H], mlp_norm [H] (post_attention_layernorm),
    w_gate/w_up [H, F], w_down [F, H]}; extra_layers {0: ..., L-2: a DecoderLayer's params} (L > 1 only);
    final_norm [H]; lm_head [H, Vd] (the target's [H, V] when lm_head="target", absent when "target_embed");
    d2t int32 [Vd]; embed [V, H] (the target's table unless the checkpoint carries its own).
The layers are the decoder's `DecoderLayer` (the first over the 2H input, with no attn_norm: the two input
norms replace it), so projections, q/k norms, attention output and MLP are the target's code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from specjax.config import ModelConfig, RopeConfig
from specjax.decoding.drafter import PrefillContext, Settings, accepted_tokens, chain_nodes, drafting_values
from specjax.decoding.dynamic_tree import build_tree
from specjax.decoding.sampling import sample_rows, sampling_probs, split_rows
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, child_ranks, spec_arrays
from specjax.decoding.verify import Draft, Verdict
from specjax.models.cache import KVCache, init_cache
from specjax.models.decoder import DecoderLayer
from specjax.models.layers import cached_attention, causal_mask, normal, param, rms_norm, rope_inv_freq
from specjax.models.sharding import constrain_cache
from specjax.models.state import merged, shapes_of, to_params

LM_HEADS = ("own", "target", "target_embed")  # the head's own [H, Vd]; the target's lm_head; the target's tied table


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shape and numerics of one EAGLE-3 head, and the target features it reads.

    feature_layers: target hidden states in Hugging Face numbering (i = the residual stream
    entering layer i), in the order they are concatenated for fc (three, or DeepSpec's five).
    num_layers: decoder layers; layer 0 reads the 2H concat, layers 1.. are plain layers over H.
    qk_norm: per-head RMSNorm of q and k before RoPE (DeepSpec's and speculators' Qwen3 heads).
    norm_before_residual: the first layer's residual is hidden_norm(h) instead of h (speculators' flag).
    fc_norm: an RMSNorm per tap before fc (EAGLE-3.1); norm_before_fc: one RMSNorm over the concatenated taps
    before fc (the older variant; exclusive with fc_norm, as speculators' config validator says).
    norm_output: the final norm's output is fed back as the next step's hidden input (EAGLE-3.1).
    lm_head: "own" (a [H, Vd] matrix of the head), "target" (the target's lm_head, shared: a ModelOpt export
    without one) or "target_embed" (the same for a target with tied embeddings: its embedding table).
    layout: the producer's checkpoint layout it was read from and is exported back to (convert/eagle3_layouts.py).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (t2d length)
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    dtype: str = "float32"
    config_head_dim: int | None = None  # config.json head_dim when given (SpecForge's Qwen3 heads: 128)
    num_layers: int = 1
    qk_norm: bool = False
    norm_before_residual: bool = False
    lm_head: str = "own"
    layout: str = "safeailab"
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("Eagle3Config.fc_norm and norm_before_fc are exclusive (one norm per tap, or one over "
                             "their concatenation), as speculators' Eagle3SpeculatorConfig validates")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"Eagle3Config.lm_head is {self.lm_head!r}; one of {LM_HEADS}")
        if self.lm_head != "own" and self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"an EAGLE-3 head scored by the target's lm_head drafts over the whole vocabulary "
                             f"({self.vocab_size}), not a draft vocabulary of {self.draft_vocab_size}")

    @property
    def head_dim(self) -> int:
        """The config's head_dim, else hidden / heads: SpecForge's and SGLang's llama_eagle3.py size q/k/v/o and RoPE by
        `getattr(config, "head_dim", hidden_size // num_attention_heads)`."""
        return self.config_head_dim or self.hidden_size // self.num_heads

    @property
    def num_taps(self) -> int:
        return len(self.feature_layers)

    @property
    def layer_cfg(self) -> ModelConfig:
        """The head's decoder layers as a ModelConfig, for the shared decoder and cache helpers."""
        return ModelConfig(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope=self.rope, qk_norm=self.qk_norm, dtype=self.dtype)


class VocabMap(nnx.Variable):
    """d2t, int32 [Vd]: target id = draft id + d2t[draft id]. A table, not a weight: never trained."""


class Eagle3Layer(DecoderLayer):
    """The head's first decoder layer: the decoder's layer over x = concat(embed_norm(e), hidden_norm(h)), width 2H.

    embed_norm is the original's input_layernorm; the layer has no attn_norm of its own.
    """

    def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs, scale: float):
        super().__init__(cfg.layer_cfg, rngs=rngs, in_features=2 * cfg.hidden_size, input_norm=False, scale=scale)
        self.norm_before_residual = cfg.norm_before_residual
        ones = jnp.ones((cfg.hidden_size,), jnp.dtype(cfg.dtype))
        self.embed_norm, self.hidden_norm = param(ones, "embed"), param(ones, "embed")

    def fused_qkv(self, emb_BTD: jax.Array, h_BTD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array):
        """q, k, v (RoPE applied) from the embeddings of the paired tokens and the hidden input."""
        eps = self.cfg.rms_norm_eps
        x_BT2D = jnp.concatenate([rms_norm(emb_BTD, self.embed_norm[...], eps),
                                  rms_norm(h_BTD, self.hidden_norm[...], eps)], axis=-1)
        return self.project_qkv(x_BT2D, positions_BT, inv_freq)

    def residual(self, h_BTD: jax.Array) -> jax.Array:
        """What the attention output is added to: h, or hidden_norm(h) under norm_before_residual (speculators'
        Eagle3FirstLayerMixin and vLLM's llama_eagle3.py `_norm_before_residual`)."""
        if self.norm_before_residual:
            return rms_norm(h_BTD, self.hidden_norm[...], self.cfg.rms_norm_eps)
        return h_BTD

    def output(self, h_BTD: jax.Array, o_BTHD: jax.Array) -> jax.Array:
        """The layer's output from its hidden input and its attention output: residual, o_proj, MLP."""
        return self.attn_out_and_mlp(self.residual(h_BTD), o_BTHD)


class Eagle3Head(nnx.Module):
    """The EAGLE-3 network: fc over the taps, its layers, final norm, lm_head, d2t, embed.

    Initialised with normal(0, scale) matrices and unit norms (training's init); `embed` / `d2t` default to
    a random table and the identity map when not given (the drafter passes the target's table). With
    lm_head "target" the lm_head is a [H, V] placeholder the drafter fills with the target's; with
    "target_embed" there is none (the embedding table scores).
    """

    def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs, scale: float = 0.02, embed: jax.Array | None = None,
                 d2t: jax.Array | None = None):
        self.cfg = cfg
        h, dtype = cfg.hidden_size, jnp.dtype(cfg.dtype)
        self.fc = param(normal(rngs, (cfg.num_taps * cfg.target_hidden_size, h), dtype, scale), None, "embed")
        self.fc_norm = param(jnp.ones((cfg.num_taps, cfg.target_hidden_size), dtype), None, None) \
            if cfg.fc_norm else None
        self.input_norm = param(jnp.ones((cfg.num_taps * cfg.target_hidden_size,), dtype), None) \
            if cfg.norm_before_fc else None
        self.layer = Eagle3Layer(cfg, rngs=rngs, scale=scale)
        self.extra_layers = nnx.List([DecoderLayer(cfg.layer_cfg, rngs=rngs, scale=scale)
                                      for _ in range(cfg.num_layers - 1)]) if cfg.num_layers > 1 else None
        self.final_norm = param(jnp.ones((h,), dtype), "embed")
        self.lm_head = None if cfg.lm_head == "target_embed" else \
            param(normal(rngs, (h, cfg.draft_vocab_size), dtype, scale), "embed", "vocab")
        self.d2t = VocabMap(jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None
                            else jnp.asarray(d2t, jnp.int32))
        self.embed = param(normal(rngs, (cfg.vocab_size, h), dtype, scale) if embed is None else embed,
                           "vocab", "embed")

    def fuse(self, features_BTF: jax.Array) -> jax.Array:
        """fc: target features [B, T, n*Ht] -> the head's hidden input [B, T, H]. First step only.

        EAGLE-3.1's fc_norm normalises each tap alone, norm_before_fc their concatenation (vLLM's llama_eagle3.py
        `combine_hidden_states`, speculators' core.py `forward`, SpecForge's `project_hidden_states`)."""
        fc = self.fc[...]
        x_BTF = features_BTF.astype(fc.dtype)
        eps = self.cfg.rms_norm_eps
        if self.input_norm is not None:
            x_BTF = rms_norm(x_BTF, self.input_norm[...], eps)
        if self.fc_norm is not None:
            taps_BTNH = x_BTF.reshape(*x_BTF.shape[:-1], self.cfg.num_taps, self.cfg.target_hidden_size)
            x_BTF = rms_norm(taps_BTNH, self.fc_norm[...], eps).reshape(x_BTF.shape)
        return x_BTF @ fc

    def carry(self, h_BTD: jax.Array) -> jax.Array:
        """What the head feeds itself from its last layer's output: h, or the final norm's output under
        norm_output (vLLM's llama_eagle3.py `aux_output`, speculators' core.py)."""
        if self.cfg.norm_output:
            return rms_norm(h_BTD, self.final_norm[...], self.cfg.rms_norm_eps)
        return h_BTD

    def inv_freq(self) -> jax.Array:
        return rope_inv_freq(self.cfg.rope, self.cfg.head_dim)

    def qkv(self, ids_BT: jax.Array, h_BTD: jax.Array, positions_BT: jax.Array):
        """The first layer up to attention: q, k, v (RoPE applied) from concat(norm(embed(ids)), norm(h)).

        Shared by serving (`midlayer`, over the KV cache) and training (specjax.train.eagle3, over the
        training-time-test attention), so both run the same input fusion and projections.
        """
        emb_BTD = self.embed[...][ids_BT].astype(h_BTD.dtype)
        return self.layer.fused_qkv(emb_BTD, h_BTD, positions_BT, self.inv_freq())

    def midlayer(self, ids_BT: jax.Array, h_BTD: jax.Array, cache: KVCache, *, positions_BT: jax.Array | None = None,
                 mask_BTR: jax.Array | None = None, slot=0, attn_impl: str = "auto") -> tuple[jax.Array, KVCache]:
        """The head's decoder layers over T new rows per row after each row's cached prefix.

        ids_BT are target token ids (embedded with `embed`); h_BTD the hidden input (fc of the
        features, or the head's own previous output). K/V are written at `lengths + slot + t` in every
        layer's buffer; lengths stay unchanged (the caller advances or commits, as for the target's forward).
        positions default to `lengths + t`, mask_BTR to causal among the new rows. A tree level passes
        its window: slot and a mask over the R slots after the prefix (see `layers.cached_attention`).
        Returns the last layer's pre-norm hidden states [B, T, H] (post-norm under norm_output: `carry`) and the
        cache.
        """
        b, t = ids_BT.shape
        lengths_B = cache.lengths
        if positions_BT is None:
            positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask_BTR is None:
            mask_BTR = jnp.broadcast_to(causal_mask(t), (b, t, t))
        q_BTHD, k_BTKD, v_BTKD = self.qkv(ids_BT, h_BTD, positions_BT)
        k_bufs, v_bufs = list(cache.k), list(cache.v)
        o_BTHD, k_bufs[0], v_bufs[0] = cached_attention(q_BTHD, k_BTKD, v_BTKD, k_bufs[0], v_bufs[0], None, lengths_B,
                                                        mask_BTR, attn_impl, slot)
        h_BTD = self.layer.output(h_BTD, o_BTHD)
        for i, layer in enumerate(self.extra_layers or ()):
            h_BTD, k_bufs[i + 1], v_bufs[i + 1] = layer(h_BTD, k_bufs[i + 1], v_bufs[i + 1], None, lengths_B,
                                                        positions_BT, mask_BTR, self.inv_freq(), attn_impl, slot)
        return self.carry(h_BTD), KVCache(tuple(k_bufs), tuple(v_bufs), lengths_B)

    def draft_logits(self, h_BTD: jax.Array) -> jax.Array:
        """fp32 logits over the draft vocabulary [B, T, Vd] from `midlayer`'s output (normed here unless
        norm_output already normed it)."""
        x_BTD = h_BTD if self.cfg.norm_output else rms_norm(h_BTD, self.final_norm[...], self.cfg.rms_norm_eps)
        if self.lm_head is None:  # the target's tied table, [V, H] as stored
            return jnp.einsum("btd,vd->btv", x_BTD, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", x_BTD, self.lm_head[...], preferred_element_type=jnp.float32)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Target token ids of draft-vocabulary ids: draft_id + d2t[draft_id]."""
        return (draft_ids + self.d2t[...][draft_ids]).astype(jnp.int32)

    def target_logits(self, draft_logits_XV: jax.Array) -> jax.Array:
        """Draft-vocabulary logits scattered into the target vocabulary [..., V]; tokens outside it get -inf.

        For samplers and verifiers that work in target ids (q over the target vocabulary).
        """
        ids_V = self.to_target_ids(jnp.arange(self.cfg.draft_vocab_size))
        full = jnp.full((*draft_logits_XV.shape[:-1], self.cfg.vocab_size), -jnp.inf, draft_logits_XV.dtype)
        return full.at[..., ids_V].set(draft_logits_XV)


def head_of(cfg: Eagle3Config, params: dict) -> Eagle3Head:
    """The Eagle3Head holding `params` (the same arrays, nothing copied): how traced code runs a params dict."""
    return merged(Eagle3Head, cfg, params)


def param_shapes(cfg: Eagle3Config) -> dict:
    """Every parameter's shape the checkpoint holds: not `embed` (usually the target's), nor a target's lm_head."""
    shapes = shapes_of(lambda: Eagle3Head(cfg, rngs=nnx.Rngs(0)))
    skip = ("embed",) if cfg.lm_head == "own" else ("embed", "lm_head")
    return {k: v for k, v in shapes.items() if k not in skip}


def init_params(cfg: Eagle3Config, key: jax.Array, embed: jax.Array) -> dict:
    """A random head around the given embedding table (for tests): normal(0, 1/sqrt(H)) matrices, a sharp lm_head
    (normal(0, 1)), norms 1 + 0.1 N(0, 1) so each one matters, and a random sorted draft vocabulary."""
    rngs = nnx.Rngs(params=key)
    dtype = jnp.dtype(cfg.dtype)
    used = jnp.sort(jax.random.permutation(rngs.params(), cfg.vocab_size)[: cfg.draft_vocab_size])
    head = Eagle3Head(cfg, rngs=rngs, scale=cfg.hidden_size ** -0.5, embed=embed,
                      d2t=used - jnp.arange(cfg.draft_vocab_size))
    if head.lm_head is not None:
        head.lm_head.set_value(normal(rngs, head.lm_head.shape, dtype, 1.0))
    layers = [head.layer, *(head.extra_layers or ())]
    norms = [head.final_norm, head.layer.embed_norm, head.layer.hidden_norm]
    norms += [n for n in (head.fc_norm, head.input_norm) if n is not None]
    norms += [n for layer in layers for n in (layer.mlp_norm, layer.attn_norm, layer.q_norm, layer.k_norm)
              if n is not None]
    for norm in norms:
        norm.set_value(1.0 + normal(rngs, norm.shape, dtype, 0.1))
    return to_params(head)


def concat_features(features: Sequence[jax.Array]) -> jax.Array:
    """[B, T, n*Ht] from the n taps [B, T, Ht], in feature_layers order (the fc input)."""
    return jnp.concatenate(list(features), axis=-1)


def init_head_cache(cfg: Eagle3Config, batch: int, max_len: int) -> KVCache:
    """The head's own KV cache: a [B, S, Hkv, D] buffer per layer, lengths 0; under a mesh the batch is split over
    "data" and the heads replicated, as the head's weights are (models/sharding.py)."""
    return constrain_cache(init_cache(cfg.layer_cfg, batch, max_len, per_layer=True), split_heads=False)


# ---- the drafter: chains and trees -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """EAGLE-3 chains, static trees and EAGLE-2 dynamic trees behind the Drafter protocol.

    State: the head's KV cache, whose `lengths` equal the target's (head row p holds the true
    features of target position p paired with the token at p + 1), and `last_h_BD`, the head's
    pre-norm output at the newest committed row: the one paired with the current root, so its
    logits are the first draft.

    init    runs the head over the prompt: rows g_0..g_{P-1} (fc of the three taps) with tokens
            t_1..t_{P-1}, root; positions 0..P-1.
    propose chain: turns last_h into draft 1, then feeds its own hidden back with each draft token
            (K - 1 head passes at positions P, P + 1, ...; their K/V are provisional); sampled
            with q when sampling.
            static tree (TreeSpec): node i takes its parent's rank_i-th best draft-vocabulary token;
            one head pass per depth level d < max depth runs that level's nodes at position
            P + d - 1, each fed its parent's own pre-norm output (the root's is last_h), with
            tree attention over the committed prefix and the node's already-run ancestors.
            dynamic tree (DynamicTreeSpec): EAGLE-2's selection (`dynamic_tree.build_tree`),
            cumulative log-softmax over the draft vocabulary, the frontier run the same way.
            Trees are drafted greedily (deterministic top-k, q None) under any sampling.
            Provisional K/V of tree nodes sit after the committed prefix (window slot j at P + j),
            and a node reads only the prefix and slots written earlier in the same round.
    update  recomputes the accepted path from the target's true features at the verified nodes,
            paired with the next accepted token (the bonus for the last), writing rows P .. P+N-1
            (over every provisional slot, chain or tree) before lengths advance by the number
            accepted; rows past the new length are never read.
    params: Eagle3Head's plain-dict form (module docstring), merged back into the head (`head_of`) at the top
    of init / propose / update; `embed` must be present (the target's table, see `eagle3_drafter`), and so must
    `lm_head` when cfg.lm_head is "target" (the target's matrix).
    """

    cfg: Eagle3Config
    params: Any = dataclasses.field(compare=False, repr=False)
    settings: Settings | None = None
    attn_impl: str = "auto"
    name: str = "eagle3"

    @property
    def model(self) -> Eagle3Head:
        """The head as a Flax NNX module over the same arrays as `params` (for notebooks: nnx.display)."""
        return head_of(self.cfg, self.params)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def configure(self, settings: Settings) -> "Eagle3Drafter":
        tree = settings.tree
        if isinstance(tree, TreeSpec) and not tree.is_chain and max(child_ranks(tree)) + 1 > self.cfg.draft_vocab_size:
            raise ValueError(f"tree {tree.parents} gives a node {max(child_ranks(tree)) + 1} children, more than "
                             f"the {self.name} head's draft vocabulary ({self.cfg.draft_vocab_size} tokens)")
        if isinstance(tree, DynamicTreeSpec) and tree.top_k > self.cfg.draft_vocab_size:
            raise ValueError(f"dynamic tree top_k={tree.top_k} is larger than the {self.name} head's draft "
                             f"vocabulary ({self.cfg.draft_vocab_size} tokens)")
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        # Chain: K - 1 drafting passes; static tree: one per level below the deepest; dynamic: one per
        # expansion step. Each plus the update pass: the tree's max depth in every case.
        return self.settings.tree.max_depth

    def _rows(self, head: Eagle3Head, ids_BT, features, cache):
        """Head pass from target features: fc, then the layer; cache lengths unchanged."""
        return head.midlayer(ids_BT, head.fuse(concat_features(features)), cache, attn_impl=self.attn_impl)

    def init(self, params, ctx: PrefillContext):
        head = head_of(self.cfg, params)
        b, t = ctx.prompt.shape
        cache = init_head_cache(self.cfg, b, self.settings.cache_len)
        rows_BT = jnp.arange(t)[None, :]
        last_B1 = (ctx.prompt_len - 1)[:, None]
        next_BT = jnp.concatenate([ctx.prompt[:, 1:], ctx.prompt[:, :1]], axis=1)  # row p -> t_{p+1}
        next_BT = jnp.where(rows_BT == last_B1, ctx.root[:, None], next_BT)
        h_BTD, cache = self._rows(head, next_BT, ctx.features, cache)
        last_h_BD = jnp.take_along_axis(h_BTD, last_B1[:, :, None], axis=1)[:, 0]
        return KVCache(cache.k, cache.v, ctx.prompt_len), last_h_BD

    def _choose(self, head: Eagle3Head, keys_B, h_BD, sampling):
        """Next draft (a target id) from the head's hidden; q over the target vocabulary when sampling; and,
        when recording (inspect_draft), the target-vocabulary logits it was chosen from."""
        logits_BV = head.draft_logits(h_BD[:, None])[:, 0]
        record = head.target_logits(logits_BV) if self.settings.record_logits else None
        if self.settings.sampling.greedy:
            return head.to_target_ids(jnp.argmax(logits_BV, axis=-1)), None, record
        q_BV = sampling_probs(head.target_logits(logits_BV), sampling)
        return sample_rows(keys_B, q_BV), q_BV, record

    def propose(self, params, state, root_B, keys_B, sampling=None):
        head, tree = head_of(self.cfg, params), self.settings.tree
        if isinstance(tree, DynamicTreeSpec):
            return self._propose_dynamic(head, state, root_B)
        if not tree.is_chain:
            return self._propose_tree(head, state, root_B)
        return self._propose_chain(head, state, root_B, keys_B, drafting_values(self.settings, sampling))

    def _propose_chain(self, head: Eagle3Head, state, root_B, keys_B, sampling):
        cache, last_h_BD = state
        length_B = cache.lengths
        k = self.settings.tree.num_nodes - 1
        keys = split_rows(keys_B, k)
        tok_B, q_BV, logits_BV = self._choose(head, keys[0], last_h_BD, sampling)

        def step(carry, xs):
            kc, vc, tok_B, h_BD = carry
            i, step_keys_B = xs
            h_B1D, c = head.midlayer(tok_B[:, None], h_BD[:, None], KVCache(kc, vc, length_B + i),
                                     attn_impl=self.attn_impl)
            nxt_B, q_BV, logits_BV = self._choose(head, step_keys_B, h_B1D[:, 0], sampling)
            return (c.k, c.v, nxt_B, h_B1D[:, 0]), (nxt_B, q_BV, logits_BV)

        (kc, vc, _, _), (rest_KB, rest_q, rest_logits) = lax.scan(
            step, (cache.k, cache.v, tok_B, last_h_BD), (jnp.arange(k - 1, dtype=jnp.int32), keys[1:]))
        tokens_BN = jnp.concatenate([root_B[:, None], tok_B[:, None], rest_KB.T], axis=1)
        b = root_B.shape[0]
        draft = Draft(tokens_BN, spec_arrays(self.settings.tree, b), jnp.ones(tokens_BN.shape, jnp.bool_),
                      chain_nodes(q_BV, rest_q), logits=chain_nodes(logits_BV, rest_logits))
        return draft, (KVCache(kc, vc, length_B), last_h_BD)

    def _propose_tree(self, head: Eagle3Head, state, root_B):
        """Static tree, greedy: level by level, each level's nodes run once (see the class docstring).

        Window slots: the nodes of levels 1 .. max_depth - 1 (the ones that are run) in level order,
        so each level is a contiguous run of slots; the deepest level is never run.
        """
        cache, last_h_BD = state
        tree = self.settings.tree
        b, n, dmax = root_B.shape[0], tree.num_nodes, tree.max_depth
        parents, depth, ranks = tree.parents, tree.depths, child_ranks(tree)
        width = max(ranks) + 1
        levels = [[i for i in range(n) if depth[i] == d] for d in range(dmax + 1)]
        at = {i: j for level in levels for j, i in enumerate(level)}  # a node's index within its level
        run = [i for d in range(1, dmax) for i in levels[d]]
        slot = {i: j for j, i in enumerate(run)}
        anc_RR = np.zeros((max(len(run), 1),) * 2, bool)  # slot i sees slot j: j is i or an ancestor of i
        for i in run:
            j = i
            while j > 0:
                anc_RR[slot[i], slot[j]] = True
                j = parents[j]
        record = self.settings.record_logits
        length_B = cache.lengths
        h_BKD = last_h_BD[:, None]  # the previous level's pre-norm outputs (level 0: the root's)
        logits_BKV = head.draft_logits(h_BKD)
        tokens = {0: root_B.astype(jnp.int32)}
        node_logits = {}
        for d in range(1, dmax + 1):
            par = np.asarray([at[parents[i]] for i in levels[d]])
            rk = np.asarray([ranks[i] for i in levels[d]])
            top_BKW = lax.top_k(logits_BKV, width)[1]
            tok_BM = head.to_target_ids(top_BKW[:, par, rk])
            for j, i in enumerate(levels[d]):
                tokens[i] = tok_BM[:, j]
                if record:
                    node_logits[i] = logits_BKV[:, par[j]]
            if d == dmax:
                break
            m = len(levels[d])
            positions_BM = jnp.broadcast_to((length_B + d - 1)[:, None], (b, m))
            mask_BMR = jnp.broadcast_to(jnp.asarray(anc_RR[[slot[i] for i in levels[d]]]), (b, m, anc_RR.shape[1]))
            h_BKD, cache = head.midlayer(tok_BM, h_BKD[:, par], cache, positions_BT=positions_BM, mask_BTR=mask_BMR,
                                         slot=slot[levels[d][0]], attn_impl=self.attn_impl)
            logits_BKV = head.draft_logits(h_BKD)
        tokens_BN = jnp.stack([tokens[i] for i in range(n)], axis=1)
        logits = None
        if record:
            zeros_BV = jnp.zeros_like(node_logits[1])
            logits = head.target_logits(jnp.stack([zeros_BV] + [node_logits[i] for i in range(1, n)], 1))
        draft = Draft(tokens_BN, spec_arrays(tree, b), jnp.ones((b, n), jnp.bool_), logits=logits)
        return draft, (KVCache(cache.k, cache.v, length_B), last_h_BD)

    def _propose_dynamic(self, head: Eagle3Head, state, root_B):
        """EAGLE-2 dynamic tree, greedy (q None). Expansion step s runs its top_k frontier nodes at
        position P + s, window slots s*top_k + f (`Frontier.slot`), each fed its parent's pre-norm
        output (step 0: last_h) and attending to the prefix and `Frontier.ancestors`."""
        cache, last_h_BD = state
        spec = self.settings.tree
        b, k = root_B.shape[0], spec.top_k
        length_B = cache.lengths
        record = self.settings.record_logits
        root_logits_BV = head.draft_logits(last_h_BD[:, None])[:, 0]
        rec = jnp.zeros((b, spec.num_expanded, self.cfg.draft_vocab_size), jnp.float32) if record else None

        def step(frontier, carry):
            kc, vc, h_prev_BKD, rec = carry
            h_in_BKD = jnp.take_along_axis(h_prev_BKD, frontier.parent[:, :, None], axis=1)
            positions_BK = jnp.broadcast_to((length_B + frontier.step)[:, None], (b, k))
            h_BKD, c = head.midlayer(frontier.tokens, h_in_BKD, KVCache(kc, vc, length_B), positions_BT=positions_BK,
                                     mask_BTR=frontier.ancestors, slot=frontier.slot, attn_impl=self.attn_impl)
            logits_BKV = head.draft_logits(h_BKD)
            if record:
                rec = lax.dynamic_update_slice(rec, logits_BKV, (0, frontier.slot, 0))
            return jax.nn.log_softmax(logits_BKV, axis=-1), (c.k, c.v, h_BKD, rec)

        h0_BKD = jnp.broadcast_to(last_h_BD[:, None], (b, k, last_h_BD.shape[-1]))
        tree, (kc, vc, _, rec) = build_tree(spec, root_B, jax.nn.log_softmax(root_logits_BV, axis=-1), step,
                                            (cache.k, cache.v, h0_BKD, rec),
                                            to_token=head.to_target_ids)
        logits = None
        if record:  # each node's logits are its parent's: the root's, or those of the slot the parent ran in
            pslot_BN = jnp.take_along_axis(tree.expanded_slot, jnp.maximum(tree.parents, 0), axis=1)
            from_slot_BNV = jnp.take_along_axis(rec, jnp.maximum(pslot_BN, 0)[:, :, None], axis=1)
            node_BNV = jnp.where((pslot_BN < 0)[:, :, None], root_logits_BV[:, None], from_slot_BNV)
            node_BNV = node_BNV.at[:, 0].set(0.0)
            logits = head.target_logits(node_BNV)
        draft = Draft(tree.tokens, tree.parents, jnp.ones(tree.tokens.shape, jnp.bool_), logits=logits)
        return draft, (KVCache(kc, vc, length_B), last_h_BD)

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        cache, last_h_BD = state
        path_BN = verdict.path
        feats = tuple(jnp.take_along_axis(f, path_BN[:, :, None], axis=1) for f in features)
        next_BN = accepted_tokens(draft, verdict)  # row i (node path[i]) pairs with the token after it
        h_BND, cache = self._rows(head_of(self.cfg, params), next_BN, feats, cache)
        last_B11 = jnp.maximum(verdict.num_accepted - 1, 0)[:, None, None]
        new_h_BD = jnp.take_along_axis(h_BND, last_B11, axis=1)[:, 0]
        last_h_BD = jnp.where((verdict.num_accepted > 0)[:, None], new_h_BD, last_h_BD)
        return KVCache(cache.k, cache.v, cache.lengths + verdict.num_accepted), last_h_BD
