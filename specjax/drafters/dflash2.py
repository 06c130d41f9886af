"""DFlash2 (z-lab's `DFlash2DraftModel`): DFlash plus dynamic causal convolutions and a candidate selector.

Followed from z-lab's own serving code, z-lab/vllm-fork `vllm/model_executor/models/qwen3_dflash2.py` (the model)
and `vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py` (how a draft is chosen); the attention layers and the
context K/V are DFlash's (drafters/dflash.py). What DFlash2 adds, in specjax's terms:

Dynamic causal convolution (`DFlashGroupedConv`, taps T = conv_kernel_size, groups of G = conv_group_size channels).
Each layer has two, around attention and around the MLP. For block rows x [K, H]:
    prepare: coef = x @ kernel_projection  reshaped [K, 2, T, H/G];  y = conv(x, coef[:, 0], base[0])
    finish:  z = conv(f(y), coef[:, 1], base[1])     (f: attention incl. o_proj, or the SwiGLU MLP)
    conv(x, d, b)[j] = sum_{t < T, t <= j} (b[t] + d[j, t, group]) * x[j - t]     (causal along the block's rows)
so the layer is  h += conv1(attn(conv0(norm(h))));  h += conv1'(mlp(conv0'(norm'(h)))). The block rows are the
anchor and the MASK rows (a block is its own sequence: row 0 has no earlier row). The context's K/V are DFlash's
(hidden_norm(fc(taps)), each layer's wk / wv, no convolution).

Attention per layer (vLLM's `_resolve_layer_attention`): `sliding_attention` layers attend to the context rows
within `sliding_window` of each block row's position (key r visible to the row at position p when p - r < window);
causality is the config's `is_causal`, else `dflash_config.causal`, else "sliding layers are causal". The block
embedding is scaled by `dflash_config.input_embedding_scale` (1 when absent).

Candidates and selector. Block rows 1..K-1 (final-normed hidden h_l) give, with the target's lm_head:
    unary, ids = top_k(h_l @ lm_head, selector_top_k);  unary = softcap(unary * output_multiplier)
    (softcap(x) = c tanh(x / c) with c = final_logit_softcapping, when set), and the selector's edge scores
    S[l, p, c] = unary[l, c] + sum_r P[pred_l[p], r] (h_l W)[r] Q[ids[l, c], r]
with the codebooks P (predecessor), Q (successor) [V, rank], W = hidden_projection [H, rank], and pred_0 the
anchor, pred_l = ids[l - 1]. The selector is part of drafting, not only training: the speculator walks it.

The walk (`_selector_walk_kernel`): prev = 0; for step l: i = argmax_c S[l, prev, c] (NaN read as -inf);
draft_l = ids[l, i]; prev = i. Greedy, specjax drafts exactly that chain (deterministic given the drafter's outputs,
q None). At a temperature z-lab's speculator draws i from softmax(S[l, prev] / T) (Gumbel noise) and its rejection
sampler reads those scores as the draft distribution; specjax draws the same way (`sampled_walk`, the rows' sampling
applied to the row's scores at their token ids) and hands the standard verifier that distribution as q, so the
output keeps the target's distribution. Trees from the same pass (deterministic, q None): a node at depth d
chosen as candidate i has the children top_w of S[d, i, :] (log-softmax over the K candidates as its score): the
dynamic (JetSpec-style) and static templates DFlash builds, each child conditioned on its own parent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax.decoding.block_tree import ChildrenFn
from specjax.decoding.drafter import drafting_values
from specjax.decoding.sampling import sample_rows, sampling_probs, split_rows
from specjax.decoding.tree import spec_arrays
from specjax.decoding.verify import Draft
from specjax.drafters.dflash import BlockBackbone, BlockConfig, DFlashDrafter, backbone, one_pass_draft, \
    require_block_shape, tables, tree_width
from specjax.models.cache import KVCache, write_layer
from specjax.models.layers import rms_norm, rope_inv_freq, swiglu


@dataclasses.dataclass(frozen=True)
class DFlash2Head:
    """What DFlash2 adds to a DFlash block (hashable; read from `dflash_config` by convert/dflash2.py).

    conv_kernel_size: taps of each causal convolution; conv_group_size: channels sharing one dynamic coefficient.
    selector_rank / selector_top_k: the selector's codebook rank and the candidates per block row.
    final_logit_softcapping: c of c tanh(x / c) on the candidates' logits, or None; output_multiplier scales them first.
    input_embedding_scale: the block embedding's scale. sliding_windows: per layer, the window or None (full).
    """

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    sliding_windows: tuple[int | None, ...]
    final_logit_softcapping: float | None = None
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0


# ---- the block forward ------------------------------------------------------------------------------------------


def grouped_conv(x_BKH: jax.Array, delta_BKTG: jax.Array, base_TH: jax.Array, group_size: int) -> jax.Array:
    """out[j] = sum_t (base[t] + delta[j, t, group]) * x[j - t] over the block's rows (t <= j): `_grouped_conv`."""
    b, k, h = x_BKH.shape
    taps, g = delta_BKTG.shape[2], h // group_size
    x_BKGS = x_BKH.reshape(b, k, g, group_size)
    coef_BKTGS = base_TH.reshape(taps, g, group_size)[None, None] + delta_BKTG[..., None]
    out_BKGS = coef_BKTGS[:, :, 0] * x_BKGS
    for tap in range(1, min(taps, k)):
        shifted_BKGS = jnp.pad(x_BKGS[:, :-tap], ((0, 0), (tap, 0), (0, 0), (0, 0)))
        out_BKGS = out_BKGS + coef_BKTGS[:, :, tap] * shifted_BKGS
    return out_BKGS.reshape(b, k, h)


def conv_prepare(x_BKH: jax.Array, base_2TH: jax.Array, proj_HC: jax.Array, group_size: int):
    """(conv of x with side 0's coefficients, side 1's coefficients [B, K, T, G]): both from x (`prepare`)."""
    b, k, h = x_BKH.shape
    taps = base_2TH.shape[1]
    coef_BK2TG = (x_BKH @ proj_HC).reshape(b, k, 2, taps, h // group_size)
    return grouped_conv(x_BKH, coef_BK2TG[:, :, 0], base_2TH[0], group_size), coef_BK2TG[:, :, 1]


def windowed_block_attention(q_BKHD, k_BSGD, v_BSGD, start_B, positions_BK, window: int | None, causal: bool):
    """Block rows' attention over the cached context rows [0, start) (within `window` of each row when set) and the
    block's own rows [start, start + K) (rows 0..i when causal). XLA, fp32 softmax; [B, K, Hq, D]."""
    b, k, hq, d = q_BKHD.shape
    s, g = k_BSGD.shape[1], k_BSGD.shape[2]
    rows_S = jnp.arange(s, dtype=jnp.int32)
    ctx_BKS = (rows_S[None, None, :] < start_B[:, None, None])
    if window is not None:
        ctx_BKS = ctx_BKS & (positions_BK[:, :, None] - rows_S[None, None, :] < window)
    j_BS = rows_S[None, :] - start_B[:, None]  # the block row a cache row holds
    blk_BKS = (j_BS[:, None, :] >= 0) & (j_BS[:, None, :] < k)
    if causal:
        blk_BKS = blk_BKS & (j_BS[:, None, :] <= jnp.arange(k, dtype=jnp.int32)[None, :, None])
    visible_BKS = ctx_BKS | blk_BKS
    q_BKGRD = q_BKHD.reshape(b, k, g, hq // g, d).astype(jnp.float32)
    scores_BGRKS = jnp.einsum("bkgrd,bsgd->bgrks", q_BKGRD, k_BSGD.astype(jnp.float32)) * d ** -0.5
    scores_BGRKS = jnp.where(visible_BKS[:, None, None], scores_BGRKS, -jnp.inf)
    o_BKGRD = jnp.einsum("bgrks,bsgd->bkgrd", jax.nn.softmax(scores_BGRKS, axis=-1), v_BSGD.astype(jnp.float32))
    return o_BKGRD.reshape(b, k, hq, d).astype(q_BKHD.dtype)


def block_hidden(bb: BlockBackbone, head: DFlash2Head, params: dict, emb_BKH: jax.Array, cache: KVCache):
    """The block's final-normed hidden states [B, K, H] and the cache with its K/V written (per-layer layout)."""
    lc = bb.cfg.layers
    b, k_rows, _ = emb_BKH.shape
    start_B = cache.lengths
    positions_BK = start_B[:, None] + jnp.arange(k_rows, dtype=jnp.int32)[None, :]
    inv_freq = rope_inv_freq(lc.rope, lc.head_dim)
    gs = head.conv_group_size
    ks, vs = list(cache.k), list(cache.v)
    h_BKH = emb_BKH.astype(bb.fc[...].dtype) * head.input_embedding_scale
    for i, layer in enumerate(bb.layers):
        x_BKH, coef = conv_prepare(layer.norm(h_BKH, layer.attn_norm), params["attn_conv_base"][i],
                                   params["attn_conv_proj"][i], gs)
        q_BKHD, k_BKGD, v_BKGD = layer.project_qkv(x_BKH, positions_BK, inv_freq)
        ks[i], vs[i] = write_layer(ks[i], None, k_BKGD, start_B), write_layer(vs[i], None, v_BKGD, start_B)
        o_BKHD = windowed_block_attention(q_BKHD, ks[i], vs[i], start_B, positions_BK, head.sliding_windows[i],
                                          bb.cfg.causal)
        o_BKH = grouped_conv(o_BKHD.reshape(b, k_rows, -1) @ layer.wo[...], coef, params["attn_conv_base"][i][1], gs)
        h_BKH = h_BKH + o_BKH
        x_BKH, coef = conv_prepare(layer.norm(h_BKH, layer.mlp_norm), params["mlp_conv_base"][i],
                                   params["mlp_conv_proj"][i], gs)
        m_BKH = swiglu(x_BKH, layer.w_gate[...], layer.w_up[...], layer.w_down[...])
        h_BKH = h_BKH + grouped_conv(m_BKH, coef, params["mlp_conv_base"][i][1], gs)
    return rms_norm(h_BKH, bb.final_norm[...], lc.rms_norm_eps), KVCache(tuple(ks), tuple(vs), cache.lengths)


# ---- candidates, the selector, the walk ---------------------------------------------------------------------------


def candidates(head: DFlash2Head, logits_BLV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ids int32 [B, L, C], unary fp32 [B, L, C]): the top selector_top_k of each row's logits, scaled and capped."""
    unary_BLC, ids_BLC = lax.top_k(logits_BLV.astype(jnp.float32), head.selector_top_k)
    unary_BLC = unary_BLC * head.output_multiplier
    if head.final_logit_softcapping is not None:
        cap = head.final_logit_softcapping
        unary_BLC = jnp.tanh(unary_BLC / cap) * cap
    return ids_BLC.astype(jnp.int32), unary_BLC


def predecessors(ids_BLC: jax.Array, anchor_B: jax.Array) -> jax.Array:
    """[B, L, C]: each row's predecessor candidates, the anchor (repeated) for row 0, row l - 1's candidates after."""
    b, _, c = ids_BLC.shape
    first_B1C = jnp.broadcast_to(anchor_B.astype(jnp.int32)[:, None, None], (b, 1, c))
    return jnp.concatenate([first_B1C, ids_BLC[:, :-1]], axis=1)


def edge_scores(params: dict, ids_BLC, unary_BLC, h_BLH, anchor_B) -> jax.Array:
    """S [B, L, P, C] = unary[l, c] + <P[pred_l[p]] * (h_l W), Q[ids[l, c]]>: z-lab's `_score_edges`."""
    hid_BLR = h_BLH @ params["selector_proj"][...]
    succ_BLCR = params["selector_successor"][...][ids_BLC]
    pred_BLPR = params["selector_predecessor"][...][predecessors(ids_BLC, anchor_B)]
    pair_BLPC = jnp.einsum("blpr,blcr->blpc", pred_BLPR * hid_BLR[:, :, None], succ_BLCR)
    return unary_BLC[:, :, None] + pair_BLPC.astype(jnp.float32)


def walk(scores_BLPC: jax.Array, ids_BLC: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """The greedy selector walk: (drafts int32 [B, steps], each step's chosen index into the candidates)."""
    b = scores_BLPC.shape[0]
    rows = jnp.arange(b)
    prev_B = jnp.zeros((b,), jnp.int32)
    tokens, picks = [], []
    for step in range(steps):
        row_BC = scores_BLPC[rows, step, prev_B]
        idx_B = jnp.argmax(jnp.where(jnp.isnan(row_BC), -jnp.inf, row_BC), axis=-1).astype(jnp.int32)
        tokens.append(ids_BLC[rows, step, idx_B])
        picks.append(idx_B)
        prev_B = idx_B
    return jnp.stack(tokens, axis=1), jnp.stack(picks, axis=1)


def sampled_walk(scores_BLPC: jax.Array, ids_BLC: jax.Array, steps: int, keys_B: jax.Array, sampling, vocab: int):
    """The selector walk drawn as z-lab's speculator draws it at a temperature: at each step a candidate from the row
    the previous pick selects, the row's scores as logits (the rows' sampling applied; -inf off the candidates).
    Returns (drafts int32 [B, steps], picks [B, steps], q [B, steps, V]: what each draft was drawn from)."""
    b = scores_BLPC.shape[0]
    rows = jnp.arange(b)
    keys = split_rows(keys_B, steps)
    prev_B = jnp.zeros((b,), jnp.int32)
    tokens, picks, qs = [], [], []
    for step in range(steps):
        row_BC = scores_BLPC[rows, step, prev_B]
        q_BV = sampling_probs(on_vocab(row_BC[:, None], ids_BLC[:, step:step + 1], vocab)[:, 0], sampling)
        tok_B = sample_rows(keys[step], q_BV)
        prev_B = jnp.argmax(ids_BLC[:, step] == tok_B[:, None], axis=-1).astype(jnp.int32)
        tokens.append(tok_B.astype(jnp.int32))
        picks.append(prev_B)
        qs.append(q_BV)
    return jnp.stack(tokens, axis=1), jnp.stack(picks, axis=1), jnp.stack(qs, axis=1)


def on_vocab(rows_BkC: jax.Array, ids_BkC: jax.Array, vocab: int) -> jax.Array:
    """[B, k, V]: each row's candidate scores at their token ids, -inf elsewhere (NaN read as -inf)."""
    b, k, _ = rows_BkC.shape
    full_BkV = jnp.full((b, k, vocab), -jnp.inf, jnp.float32)
    rows_BkC = jnp.where(jnp.isnan(rows_BkC), -jnp.inf, rows_BkC)
    return full_BkV.at[jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None], ids_BkC].set(rows_BkC)


def selector_children(scores_BLPC: jax.Array, ids_BLC: jax.Array, anchor_B: jax.Array, width: int) -> ChildrenFn:
    """Tree children through the selector: a parent at depth d (its token among depth d's candidates, the anchor
    at the root) gets the top `width` of S[d, parent's index, :], scored by log-softmax over the candidates."""
    pred_BLC = predecessors(ids_BLC, anchor_B)
    logp_BLPC = jax.nn.log_softmax(jnp.where(jnp.isnan(scores_BLPC), -jnp.inf, scores_BLPC), axis=-1)

    def children(level, parents_BE):
        pred_BC = lax.dynamic_index_in_dim(pred_BLC, level, axis=1, keepdims=False)
        ids_BC = lax.dynamic_index_in_dim(ids_BLC, level, axis=1, keepdims=False)
        logp_BPC = lax.dynamic_index_in_dim(logp_BLPC, level, axis=1, keepdims=False)
        p_BE = jnp.argmax(parents_BE[:, :, None] == pred_BC[:, None, :], axis=-1)
        lp_BEC = jnp.take_along_axis(logp_BPC, p_BE[:, :, None], axis=1)
        lp_BEW, pick_BEW = lax.top_k(lp_BEC, width)
        tok_BEW = jnp.take_along_axis(jnp.broadcast_to(ids_BC[:, None], lp_BEC.shape), pick_BEW, axis=-1)
        return lp_BEW, tok_BEW.astype(jnp.int32)

    return children


# ---- the drafter ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DFlash2Drafter(DFlashDrafter):
    """DFlash2 behind the Drafter protocol: one block pass a round, the selector's walk as the chain (greedy, or drawn
    with q at a temperature, as z-lab's speculator).

    State, `init` and `update` are DFlash's (context K/V only; the drafter's cache is per-layer). `propose` runs the
    block with the convolutions, takes each MASK row's candidates and walks the selector (module docstring);
    `Draft.confidence` holds each pick's softmax probability over its row's candidate scores (root 1.0).
    params: DFlash's block params in the per-layer layout, plus attn_conv_base / attn_conv_proj / mlp_conv_base /
    mlp_conv_proj (stacked on L), selector_predecessor, selector_successor [V, rank], selector_proj [H, rank], and
    the target's embed (and lm_head when untied). attn_impl is not used: the block runs its own XLA attention (the
    sliding window; the Pallas kernel has none). With `record_logits`, a chain's Draft.logits are each pick's selector
    row (-inf off the candidates); a tree's are not recorded.
    """

    head: DFlash2Head | None = None
    name: str = "dflash2"

    def __repr__(self) -> str:
        """One line of facts, not the weights."""
        lc, hd = self.cfg.layers, self.head
        return (f"DFlash2Drafter(layers={lc.num_layers}, block_size={self.cfg.block_size}, "
                f"taps={list(self.cfg.feature_layers)}, conv={hd.conv_kernel_size}x{hd.conv_group_size}, "
                f"selector=top{hd.selector_top_k}/rank{hd.selector_rank}, hidden={lc.hidden_size}, "
                f"vocab={lc.vocab_size}, dtype={lc.dtype})")

    def score(self, params, state: KVCache, root_B) -> tuple[jax.Array, jax.Array, KVCache]:
        """(edge scores [B, K-1, C, C], candidate ids [B, K-1, C], the cache with the block's K/V) of one pass."""
        vocab = tables(self.cfg, params)
        h_BKH, cache = block_hidden(backbone(self.cfg, params), self.head, params, vocab.block_embeddings(root_B),
                                    state)
        h_BLH = h_BKH[:, 1:]
        ids_BLC, unary_BLC = candidates(self.head, vocab.logits(h_BLH))
        return edge_scores(params, ids_BLC, unary_BLC, h_BLH, root_B), ids_BLC, cache

    def propose(self, params, state: KVCache, root_B, keys_B, sampling=None):
        spec = self.settings.tree
        scores_BLPC, ids_BLC, cache = self.score(params, state, root_B)
        if not spec.is_chain:  # deterministic under any sampling (q None)
            width = tree_width(spec)
            if width > self.head.selector_top_k:
                raise ValueError(f"tree {spec} gives a node {width} children; DFlash2 scores selector_top_k="
                                 f"{self.head.selector_top_k} candidates a row; pass top_k <= that")
            return one_pass_draft(spec, root_B, selector_children(scores_BLPC, ids_BLC, root_B, width), None), cache
        k, b = spec.num_nodes - 1, root_B.shape[0]
        q_BNV = None
        if self.settings.sampling.greedy:
            drafts_Bk, picks_Bk = walk(scores_BLPC, ids_BLC, k)
        else:
            drafts_Bk, picks_Bk, q_BkV = sampled_walk(scores_BLPC, ids_BLC, k, keys_B,
                                                      drafting_values(self.settings, sampling), self.vocab_size)
            q_BNV = jnp.concatenate([jnp.zeros_like(q_BkV[:, :1]), q_BkV], axis=1)
        prev_Bk = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), picks_Bk[:, :-1]], axis=1)
        rows_BkC = scores_BLPC[jnp.arange(b)[:, None], jnp.arange(k)[None, :], prev_Bk]  # the row each pick came from
        prob_Bk = jnp.take_along_axis(jax.nn.softmax(rows_BkC, axis=-1), picks_Bk[:, :, None], axis=-1)[..., 0]
        tokens_BN = jnp.concatenate([root_B[:, None].astype(jnp.int32), drafts_Bk], axis=1)
        confidence_BN = jnp.concatenate([jnp.ones((b, 1), jnp.float32), prob_Bk], axis=1)
        logits = None
        if self.settings.record_logits:  # the walk's rows over the vocabulary: -inf off the candidates
            full_BkV = on_vocab(rows_BkC, ids_BLC[:, :k], self.vocab_size)
            logits = jnp.concatenate([jnp.zeros_like(full_BkV[:, :1]), full_BkV], axis=1)
        draft = Draft(tokens_BN, spec_arrays(spec, b), jnp.ones(tokens_BN.shape, jnp.bool_), q=q_BNV,
                      confidence=confidence_BN, logits=logits)
        return draft, cache

    def configure(self, settings) -> "DFlash2Drafter":
        require_block_shape("DFlash2", settings, self.cfg.block_size, self.max_draft_tokens)
        return dataclasses.replace(self, settings=settings)


def head_param_shapes(cfg: BlockConfig, head: DFlash2Head) -> dict[str, tuple[int, ...]]:
    """The DFlash2-only params' shapes ([in, out] matrices; conv params stacked on L)."""
    l, h, v = cfg.layers.num_layers, cfg.hidden_size, cfg.layers.vocab_size
    taps, groups, r = head.conv_kernel_size, h // head.conv_group_size, head.selector_rank
    conv = {"base": (l, 2, taps, h), "proj": (l, h, 2 * taps * groups)}
    return {**{f"{side}_conv_{k}": s for side in ("attn", "mlp") for k, s in conv.items()},
            "selector_predecessor": (v, r), "selector_successor": (v, r), "selector_proj": (h, r)}

