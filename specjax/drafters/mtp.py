"""Multi-token-prediction (MTP) heads: prediction layers shipped inside the target, as a drafter.

An MTP layer reads the target's last hidden state h_p at position p and the embedding of the
token after it, t_{p+1}, and predicts t_{p+2}:

    x  = fc(concat(embed_norm(embed(t_{p+1})), hidden_norm(h_p)))     2H -> H, no bias
    h' = block(x)                    a decoder layer of the target's family, with its own KV cache
    logits = lm_head(final_norm(h'))

Three checkpoint layouts (see convert/mtp.py for the tensor names), each run as its producer's
serving code runs it:
  * DeepSeek-V3 ("deepseek"): every MTP layer has its own enorm / hnorm / eh_proj /
    shared_head.norm (and optionally its own shared_head.head and embed_tokens); embedding first.
    As vLLM and SGLang compute it, the embedding at position 0 is zeroed (`mask_position0`).
  * Qwen3-Next / Qwen3.5 ("qwen3_next"): one pre_fc_norm_embedding / pre_fc_norm_hidden / fc /
    norm shared by all `mtp.layers`; embedding first; those norms are zero-centred (scale 1 + w,
    `zero_centered`); logits use the target's lm_head. On a Qwen3.5 target the block is its gated
    full-attention layer.
  * MiMo ("mimo", XiaomiMiMo/MiMo-7B: model.mtp_layers.{i}): per-layer token_layernorm /
    hidden_layernorm / input_proj / final_layernorm, the hidden FIRST in the concat, the
    embedding zeroed at position 0, plain RMSNorms (vllm/model_executor/models/mimo_mtp.py).

Every layout feeds the next draft step final_norm(h'), the normed output its logits come from:
vLLM's Qwen3NextMultiTokenPredictor, Qwen3_5MultiTokenPredictor and MiMoMultiTokenPredictorLayer
return it, and vLLM's DeepSeekMultiTokenPredictorLayer returns (h', shared_head(h')) and recycles the
second ("matches SGLang's deepseek_nextn"; vllm/model_executor/models/deepseek_mtp.py, 0.33; vLLM
0.11 recycled h').

Which target hidden state h_p is (`reads_post_norm`): DeepSeek-V3, Qwen3-Next and Qwen3.5 read
the state after the target's final norm (the lm_head's input): vLLM's target models return
`self.norm(hidden_states, residual)` from forward (vllm/model_executor/models/deepseek_v2.py,
qwen3_next.py, qwen3_5.py) and the MTP proposer passes that output on; SGLang and Megatron-LM
agree. MiMo reads the state before it: vLLM's MiMoModel.forward returns `hidden_states + residual`
and applies `model.norm` only in compute_logits (vllm/model_executor/models/mimo.py).
The block is a full-attention layer of the target (the decoder's `DecoderLayer`); on an MoE target
(Qwen3.5-MoE, Qwen3-Next) its MLP is the target's mixture of experts with the shared expert when the
checkpoint's block has a router (`sparse_blocks`). MLA blocks (DeepSeek-V3's own) are out of scope.

Drafting (chains): draft 1 comes from MTP layer 0 at the newest committed row (the target's
hidden paired with the root). Draft s + 1 (s >= 1) comes from layer s mod n at position
P - 1 + s, fed the previous step's hidden and draft s; when K exceeds the number of layers
they are reused in turn (vLLM's `spec_step_idx % num_mtp_layers`).

KV caches: one per MTP layer. Committed rows 0 .. P-1 of every layer hold that layer run on
the true pairs (h_p, t_{p+1}) — what the original module computes when called on a prefill
with that layer's step index. During drafting a layer writes its provisional rows after its
committed ones in the order it runs (row P + m for its m-th use this round, RoPE at the
step's own position), so a layer used every n-th step sees its committed prefix and its own
earlier guesses, never an unwritten row. `update` recomputes every layer's rows for the
accepted path from the target's true hidden states, as Eagle3Drafter does.

The network is `MtpHead` (an NNX module): `MtpLayer`s (the fuse norms and fc, a `DecoderLayer`
block, the final norm) and the target's tables they borrow. Its plain-dict form (what `MtpDrafter`
carries; [in, out] matrices):
    layers: {0: {embed_norm [H], hidden_norm [H], fc [2H, H], final_norm [H], block {the decoder's
            layer keys}, optionally embed [V, H] and lm_head [H, V]}, 1: ...}
            (the Qwen3-Next layout's shared modules appear in each entry, the same arrays);
    embed [V, H] and, for an untied target, lm_head [H, V]: the target's own arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.decoding.drafter import (
    PrefillContext,
    Settings,
    accepted_tokens,
    chain_nodes,
    drafting_values,
    require_chain,
)
from specjax.decoding.sampling import sample_rows, sampling_probs, split_rows
from specjax.decoding.tree import spec_arrays
from specjax.decoding.verify import Draft, Verdict
from specjax.models.cache import KVCache, init_cache
from specjax.models.decoder import POST_NORM, DecoderLayer
from specjax.models.layers import causal_mask, normal, param, rms_norm, rope_inv_freq
from specjax.models.sharding import constrain_cache
from specjax.models.state import merged, shapes_of

LAYOUTS = ("deepseek", "qwen3_next", "mimo")


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """Shape and numerics of a target's MTP layers (hashable: part of the compiled loop's key).

    own_embed / own_lm_head: the MTP layers that carry their own table (DeepSeek-V3 layout); the
    others use the target's.
    """

    layout: str  # one of LAYOUTS
    num_layers: int  # MTP layers
    target: ModelConfig  # the target's config: the block is one of its layers
    own_embed: tuple[int, ...] = ()
    own_lm_head: tuple[int, ...] = ()
    sparse_blocks: tuple[int, ...] = ()  # the MTP layers whose block's MLP is the target's MoE

    @property
    def block(self) -> ModelConfig:
        """One full-attention decoder layer of the target's family (shapes, RoPE, norms, biases, output gate,
        the target's experts for a sparse block)."""
        return dataclasses.replace(self.target, num_layers=1, layer_types=(), linear=None)

    @property
    def zero_centered(self) -> bool:
        """Qwen3-Next / Qwen3.5's own norms scale by (1 + w) (vLLM: Qwen3NextRMSNorm and Qwen3_5RMSNorm are
        GemmaRMSNorm)."""
        return self.layout == "qwen3_next"

    @property
    def mask_position0(self) -> bool:
        """DeepSeek and MiMo MTP zero the embedding at position 0 (vLLM / SGLang deepseek_mtp.py, vLLM mimo_mtp.py)."""
        return self.layout in ("deepseek", "mimo")

    @property
    def hidden_first(self) -> bool:
        """MiMo concatenates [hidden, embedding]; the others [embedding, hidden]."""
        return self.layout == "mimo"

    @property
    def reads_post_norm(self) -> bool:
        """Whether h_p is the target's final-normed state (module docstring) or its pre-norm one (MiMo)."""
        return self.layout != "mimo"


# ---- the network, shared by serving, parity tests and training ---------------------------------------------


class MtpLayer(nnx.Module):
    """One MTP layer: embed_norm, hidden_norm, fc [2H, H] (the fuse), a decoder layer of the target's family
    (block), final_norm; optionally its own embed [V, H] / lm_head [H, V].

    Initialised as the decoder initialises a layer: normal(0, scale) matrices, identity norms (ones; zeros
    for the zero-centred Qwen3-Next norms).
    """

    def __init__(self, cfg: MtpConfig, *, rngs: nnx.Rngs, scale: float = 0.02, own_embed: bool = False,
                 own_lm_head: bool = False, sparse: bool = False):
        self.cfg = cfg
        t = cfg.target
        h, dtype = t.hidden_size, jnp.dtype(t.dtype)
        identity = (jnp.zeros if cfg.zero_centered else jnp.ones)((h,), dtype)
        self.embed_norm, self.hidden_norm = param(identity, "embed"), param(identity, "embed")
        self.fc = param(normal(rngs, (2 * h, h), dtype, scale), None, "embed")
        self.block = DecoderLayer(cfg.block, rngs=rngs, scale=scale, sparse=sparse)
        self.final_norm = param(identity, "embed")
        self.embed = param(normal(rngs, (t.vocab_size, h), dtype, scale), "vocab", "embed") if own_embed else None
        self.lm_head = param(normal(rngs, (h, t.vocab_size), dtype, scale), "embed", "vocab") if own_lm_head else None

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """The MTP module's own RMSNorms (not the block's): scale w, or 1 + w for the Qwen3-Next layout."""
        return rms_norm(x, weight[...], self.cfg.target.rms_norm_eps, offset=self.cfg.zero_centered)

    def fuse(self, emb_BTD: jax.Array, h_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """fc(concat(embed_norm(emb), hidden_norm(h))) (hidden first for MiMo): the block's input [B, T, H]."""
        emb_BTD = emb_BTD.astype(h_BTD.dtype)
        if self.cfg.mask_position0:
            emb_BTD = jnp.where((positions_BT == 0)[..., None], jnp.zeros_like(emb_BTD), emb_BTD)
        parts = [self.norm(emb_BTD, self.embed_norm), self.norm(h_BTD, self.hidden_norm)]
        x_BT2D = jnp.concatenate(parts[::-1] if self.cfg.hidden_first else parts, axis=-1)
        return x_BT2D @ self.fc[...]

    def final_normed(self, out_BTD: jax.Array) -> jax.Array:
        return self.norm(out_BTD, self.final_norm)

    def feedback(self, out_BTD: jax.Array) -> jax.Array:
        """The hidden the next draft step reads: the layer's output after its final norm (module docstring)."""
        return self.final_normed(out_BTD)


class MtpHead(nnx.Module):
    """A target's MTP layers (an nnx.List of `MtpLayer`) and the target's tables: embed and, untied, lm_head."""

    def __init__(self, cfg: MtpConfig, *, rngs: nnx.Rngs, scale: float = 0.02):
        self.cfg = cfg
        t = cfg.target
        self.layers = nnx.List([MtpLayer(cfg, rngs=rngs, scale=scale, own_embed=j in cfg.own_embed,
                                         own_lm_head=j in cfg.own_lm_head, sparse=j in cfg.sparse_blocks)
                                for j in range(cfg.num_layers)])
        dtype = jnp.dtype(t.dtype)
        self.embed = param(normal(rngs, (t.vocab_size, t.hidden_size), dtype, scale), "vocab", "embed")
        self.lm_head = None if t.tie_word_embeddings else \
            param(normal(rngs, (t.hidden_size, t.vocab_size), dtype, scale), "embed", "vocab")

    def fused(self, j: int, ids_BT: jax.Array, h_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """Layer j's block input from the paired tokens (embedded with its own table when it has one)."""
        layer = self.layers[j]
        table = (layer.embed if layer.embed is not None else self.embed)[...]
        return layer.fuse(table[ids_BT], h_BTD, positions_BT)

    def step(self, j: int, ids_BT: jax.Array, h_BTD: jax.Array, k_buf: jax.Array, v_buf: jax.Array,
             lengths_B: jax.Array, *, positions_BT: jax.Array | None = None, mask_BTT: jax.Array | None = None,
             attn_impl: str = "auto"):
        """MTP layer j over T new rows per row of the batch, after each row's `lengths_B` cached rows.

        ids_BT: the tokens paired with h_BTD (t_{p+1} with h_p). K/V are written at lengths + t;
        positions default to lengths + t, the mask among new rows to causal.
        Returns (the block's output before the final norm [B, T, H], k_buf, v_buf).
        """
        b, t = ids_BT.shape
        if positions_BT is None:
            positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask_BTT is None:
            mask_BTT = jnp.broadcast_to(causal_mask(t), (b, t, t))
        block_cfg = self.cfg.block
        x_BTD = self.fused(j, ids_BT, h_BTD, positions_BT)
        return self.layers[j].block(x_BTD, k_buf, v_buf, None, lengths_B, positions_BT, mask_BTT,
                                    rope_inv_freq(block_cfg.rope, block_cfg.rotary_dim), attn_impl)

    def feedback(self, j: int, out_BTD: jax.Array) -> jax.Array:
        return self.layers[j].feedback(out_BTD)

    def logits(self, j: int, out_BTD: jax.Array) -> jax.Array:
        """fp32 logits over the target vocabulary [..., V] from layer j's output before its final norm."""
        layer = self.layers[j]
        x = layer.final_normed(out_BTD)
        if layer.lm_head is not None:
            return jnp.einsum("...d,dv->...v", x, layer.lm_head[...], preferred_element_type=jnp.float32)
        if self.lm_head is None:  # tied: the [V, H] table as stored
            return jnp.einsum("...d,vd->...v", x, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, self.lm_head[...], preferred_element_type=jnp.float32)


def head_of(cfg: MtpConfig, params: dict) -> MtpHead:
    """The MtpHead holding `params` (the same arrays, nothing copied): how traced code runs a params dict."""
    return merged(MtpHead, cfg, params)


def layer_shapes(target: ModelConfig, sparse: bool = False) -> dict:
    """The shape of every parameter of one MTP layer on `target` (no own tables; an MoE block when `sparse`): what
    conversion checks against."""
    return shapes_of(lambda: MtpLayer(MtpConfig("deepseek", 1, target), rngs=nnx.Rngs(0), sparse=sparse))


def init_head_cache(cfg: MtpConfig, batch: int, max_len: int) -> KVCache:
    """One [B, S, Hkv, D] buffer per MTP layer, lengths 0; split like the target's under a mesh (the blocks are
    target layers, sharded by the same rules)."""
    return constrain_cache(init_cache(dataclasses.replace(cfg.block, num_layers=cfg.num_layers), batch, max_len,
                                      per_layer=True))


# ---- params: the stored (converted) form -> what the drafter runs ------------------------------------------


def stored_layout(stored: dict, target_cfg: ModelConfig) -> str:
    """'qwen3_next' when the fuse modules are shared (top-level `fc`); else 'mimo' on a MiMo target, 'deepseek'."""
    if "fc" in stored:
        return "qwen3_next"
    return "mimo" if target_cfg.family == "mimo" else "deepseek"


def stored_num_layers(stored: dict) -> int:
    return len(stored["layers"])


def drafter_params(stored: dict, target_params: dict, target_cfg: ModelConfig) -> dict:
    """The drafter's params from `Target.mtp` (see convert/mtp.py) and the target's embed / lm_head."""
    shared = {k: v for k, v in stored.items() if k != "layers"}
    layers = {j: {**shared, **stored["layers"][str(j)]} for j in range(stored_num_layers(stored))}
    params = {"layers": layers, "embed": target_params["embed"]}
    if not target_cfg.tie_word_embeddings:
        params["lm_head"] = target_params["lm_head"]
    return params


# ---- the drafter: chains ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MtpDrafter:
    """A target's own MTP layers behind the Drafter protocol (chains; greedy or sampled with q).

    State: (per-layer KV caches whose `lengths` equal the target's, `last_out_BD`): layer 0's
    output (before its final norm) at the newest committed row, the row paired with the current root, whose
    logits are the first draft. params: MtpHead's plain-dict form (module docstring), merged back into
    the head (`head_of`) at the top of init / propose / update.
    """

    cfg: MtpConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    settings: Settings | None = None
    attn_impl: str = "auto"
    name: str = "mtp"

    @property
    def model(self) -> MtpHead:
        """The head as a Flax NNX module over the same arrays as `params` (for notebooks: nnx.display)."""
        return head_of(self.cfg, self.params)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return feature_layers(self.cfg)

    @property
    def vocab_size(self) -> int:
        return self.cfg.target.vocab_size

    def configure(self, settings: Settings) -> "MtpDrafter":
        require_chain(self.name, settings)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return self.settings.tree.num_nodes - 1 + self.cfg.num_layers - 1  # K - 1 drafting passes + n update passes

    def _true_rows(self, head: MtpHead, cache: KVCache, ids_BT, h_BTD):
        """Every MTP layer over rows paired with true target hidden states; returns layer 0's outputs."""
        ks, vs, outs = list(cache.k), list(cache.v), []
        for j in range(self.cfg.num_layers):
            out, ks[j], vs[j] = head.step(j, ids_BT, h_BTD, ks[j], vs[j], cache.lengths, attn_impl=self.attn_impl)
            outs.append(out)
        return outs[0], KVCache(tuple(ks), tuple(vs), cache.lengths)

    def init(self, params, ctx: PrefillContext):
        b, t = ctx.prompt.shape
        cache = init_head_cache(self.cfg, b, self.settings.cache_len)
        rows_BT = jnp.arange(t)[None, :]
        last_B1 = (ctx.prompt_len - 1)[:, None]
        next_BT = jnp.concatenate([ctx.prompt[:, 1:], ctx.prompt[:, :1]], axis=1)  # row p -> t_{p+1}
        next_BT = jnp.where(rows_BT == last_B1, ctx.root[:, None], next_BT)
        out_BTD, cache = self._true_rows(head_of(self.cfg, params), cache, next_BT, ctx.features[0])
        last_out_BD = jnp.take_along_axis(out_BTD, last_B1[:, :, None], axis=1)[:, 0]
        return KVCache(cache.k, cache.v, ctx.prompt_len), last_out_BD

    def _choose(self, head: MtpHead, j, keys_B, out_BD, sampling):
        """Next draft from layer j's output, q over the vocabulary when sampling, and the logits it came from."""
        logits_BV = head.logits(j, out_BD)
        if self.settings.sampling.greedy:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None, logits_BV
        q_BV = sampling_probs(logits_BV, sampling)
        return sample_rows(keys_B, q_BV), q_BV, logits_BV

    def propose(self, params, state, root_B, keys_B, sampling=None):
        sampling = drafting_values(self.settings, sampling)
        head, (cache, last_out_BD) = head_of(self.cfg, params), state
        n, length_B = self.cfg.num_layers, cache.lengths
        k = self.settings.tree.num_nodes - 1
        keys = split_rows(keys_B, k)
        tok_B, q_BV, logits_BV = self._choose(head, 0, keys[0], last_out_BD, sampling)
        h_BD = head.feedback(0, last_out_BD)
        ks, vs, uses = list(cache.k), list(cache.v), [0] * n
        tokens, qs, logits = [tok_B], [q_BV], [logits_BV]
        for s in range(1, k):
            j = s % n
            pos_B1 = (length_B - 1 + s)[:, None]
            out_B1D, ks[j], vs[j] = head.step(j, tok_B[:, None], h_BD[:, None], ks[j], vs[j], length_B + uses[j],
                                              positions_BT=pos_B1, attn_impl=self.attn_impl)
            uses[j] += 1
            tok_B, q_BV, logits_BV = self._choose(head, j, keys[s], out_B1D[:, 0], sampling)
            h_BD = head.feedback(j, out_B1D[:, 0])
            tokens.append(tok_B)
            qs.append(q_BV)
            logits.append(logits_BV)
        tokens_BN = jnp.stack([root_B, *tokens], axis=1).astype(jnp.int32)
        b = root_B.shape[0]
        recorded = chain_nodes(logits[0], logits[1:]) if self.settings.record_logits else None
        draft = Draft(tokens_BN, spec_arrays(self.settings.tree, b), jnp.ones(tokens_BN.shape, jnp.bool_),
                      chain_nodes(qs[0], qs[1:]), logits=recorded)
        return draft, (KVCache(tuple(ks), tuple(vs), length_B), last_out_BD)

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        cache, last_out_BD = state
        h_BND = jnp.take_along_axis(features[0], verdict.path[:, :, None], axis=1)
        next_BN = accepted_tokens(draft, verdict)  # row i (node path[i]) pairs with the token after it
        out_BND, cache = self._true_rows(head_of(self.cfg, params), cache, next_BN, h_BND)
        last_B11 = jnp.maximum(verdict.num_accepted - 1, 0)[:, None, None]
        new_out_BD = jnp.take_along_axis(out_BND, last_B11, axis=1)[:, 0]
        last_out_BD = jnp.where((verdict.num_accepted > 0)[:, None], new_out_BD, last_out_BD)
        return KVCache(cache.k, cache.v, cache.lengths + verdict.num_accepted), last_out_BD


def feature_layers(cfg: MtpConfig) -> tuple[int, ...]:
    """The target hidden state the layout's MTP reads: after the final norm, or (MiMo) before it."""
    return (POST_NORM,) if cfg.reads_post_norm else (cfg.target.num_layers,)


def mtp_config(target_cfg: ModelConfig, stored: dict) -> MtpConfig:
    """The MtpConfig of stored MTP layers (convert/mtp.py) on the target they belong to."""
    layers = [stored["layers"][str(j)] for j in range(stored_num_layers(stored))]
    return MtpConfig(layout=stored_layout(stored, target_cfg), num_layers=len(layers), target=target_cfg,
                     own_embed=tuple(j for j, layer in enumerate(layers) if "embed" in layer),
                     own_lm_head=tuple(j for j, layer in enumerate(layers) if "lm_head" in layer),
                     sparse_blocks=tuple(j for j, layer in enumerate(layers) if "moe" in layer["block"]))
