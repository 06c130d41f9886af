"""EAGLE-2 dynamic draft trees: the selection algorithm against a numpy transcription of the original
(SafeAILab/EAGLE cnets.py topK_genrate), the spec's parsing, and the draft-model drafter building them
inside the speculative loop (greedy equality, exact self-drafting acceptance, statistics, compile reuse)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from jax import lax

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.dynamic_tree import build_tree
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, kary, parse_tree, spec_arrays
from specjax.drafters import DraftModelDrafter
from specjax.models.cache import init_cache
from specjax.models.decoder import has_layer_list
from specjax.models.model import forward, lm_head

# ---------------------------------------------------------------------------------------------------------------
# The reference: the original's algorithm for one row, written out in numpy from cnets.py.


def top(x: np.ndarray, n: int):
    """The n largest, lower index first on ties (torch.topk leaves ties unspecified; lax.top_k documents this)."""
    order = np.argsort(-x, kind="stable")[:n]
    return x[order], order


def reference_tree(root: int, logprobs_of, k: int, depth: int, total: int, to_token=lambda i: i):
    """tokens, parents, scores of one row's tree. logprobs_of(path) -> float32 [V], path = (root, t1, ..., td)."""
    s, idx = top(logprobs_of((root,)).astype(np.float32), k)
    scores_list, tokens_list, parents_list = [s], [to_token(idx)], [np.zeros(1, np.int64)]
    paths = [(root, int(to_token(t))) for t in idx]
    frontier_scores, frontier_index = s, np.arange(k)  # frontier_index: topk_cs_index
    for i in range(depth):
        bias = 1 + k * k * max(0, i - 1) + (k if i > 0 else 0)
        parents_list.append(frontier_index + bias)  # 1-based candidate index of each frontier node
        cu = np.empty((k, k), np.float32)
        toks = np.empty((k, k), np.int64)
        for f in range(k):
            cs, ci = top(logprobs_of(paths[f]).astype(np.float32), k)
            cu[f] = cs + frontier_scores[f]
            toks[f] = to_token(ci)
        flat = cu.reshape(-1)
        frontier_scores, frontier_index = top(flat, k)
        paths = [paths[c // k] + (int(toks.reshape(-1)[c]),) for c in frontier_index]
        scores_list.append(flat)
        tokens_list.append(toks.reshape(-1))
    scores, tokens = np.concatenate(scores_list), np.concatenate(tokens_list)
    _, chosen = top(scores, total - 1)
    chosen = np.sort(chosen)
    draft_parents = np.concatenate(parents_list)[chosen // k]
    mask_index = np.searchsorted(chosen, draft_parents - 1)
    mask_index[draft_parents == 0] = -1
    return (np.concatenate([[root], tokens[chosen]]), np.concatenate([[-1], mask_index + 1]),
            np.concatenate([[0.0], scores[chosen]]))


# ---------------------------------------------------------------------------------------------------------------
# Synthetic drafts: a random log-probability table row per path, keyed by a hash of the path's tokens.

TABLE_ROWS, VOCAB = 4096, 40
TABLE = np.asarray(jax.nn.log_softmax(2.5 * np.random.default_rng(0).standard_normal((TABLE_ROWS, VOCAB)), axis=-1),
                   np.float32)


def mix(h, t):
    return (h * 1000003 + t + 1) % 2**32


def path_hash(path) -> int:
    h = 7
    for t in path:
        h = mix(h, int(t))
    return h


def mix_j(h_u32, t):
    return h_u32 * jnp.uint32(1000003) + t.astype(jnp.uint32) + jnp.uint32(1)


def synthetic_tree(spec: DynamicTreeSpec, roots, offset: int = 0):
    """build_tree under jit, each frontier node's distribution looked up by the hash of its path.

    The path is rebuilt from `ancestors` and the tokens the drafter ran at each slot, and again
    from `parent` and the previous frontier's hashes; `ok` says every step they agreed.
    """
    k, d = spec.top_k, spec.depth
    table = jnp.asarray(TABLE)
    to_token = (lambda i: i + offset) if offset else None

    def step(fr, state):
        run_BR, root_hash_B, prev_hash_BK, ok = state
        run_BR = lax.dynamic_update_slice(run_BR, fr.tokens, (0, fr.slot))
        h_BK = jnp.broadcast_to(root_hash_B[:, None], fr.tokens.shape)
        for level in range(d):  # slots of step `level` hold depth level + 1
            blk = slice(level * k, (level + 1) * k)
            tok_BK = jnp.sum(jnp.where(fr.ancestors[:, :, blk], run_BR[:, None, blk], 0), axis=-1)
            h_BK = jnp.where(level <= fr.step, mix_j(h_BK, tok_BK), h_BK)
        via_parent_BK = mix_j(jnp.take_along_axis(prev_hash_BK, fr.parent, axis=1), fr.tokens)
        ok = ok & jnp.all(h_BK == via_parent_BK) & jnp.all(jnp.sum(fr.ancestors, -1) == fr.step + 1)
        return table[(h_BK % TABLE_ROWS).astype(jnp.int32)], (run_BR, root_hash_B, h_BK, ok)

    @jax.jit
    def run(roots_B):
        b = roots_B.shape[0]
        root_hash_B = mix_j(jnp.full((b,), 7, jnp.uint32), roots_B)
        root_lp = table[(root_hash_B % TABLE_ROWS).astype(jnp.int32)]
        state = (jnp.zeros((b, d * k), jnp.int32), root_hash_B, jnp.broadcast_to(root_hash_B[:, None], (b, k)),
                 jnp.bool_(True))
        return build_tree(spec, roots_B, root_lp, step, state, to_token=to_token)

    tree, (run_BR, _, _, ok) = run(jnp.asarray(roots, jnp.int32))
    return jax.tree.map(np.asarray, tree), np.asarray(run_BR), bool(ok)


def check_structure(tree, spec: DynamicTreeSpec):
    """T nodes, root first, parents earlier (topological, so ancestor-closed), depths consistent and <= D+1,
    scores falling along edges, distinct candidates, every parent expanded."""
    b, t = tree.tokens.shape
    assert t == spec.num_nodes
    for row in range(b):
        p, dep = tree.parents[row], tree.depths[row]
        assert p[0] == -1 and dep[0] == 0
        for i in range(1, t):
            assert 0 <= p[i] < i
            assert dep[i] == dep[p[i]] + 1 <= spec.max_depth
            assert tree.scores[row, i] <= tree.scores[row, p[i]]
            assert tree.expanded_slot[row, p[i]] >= 0 or p[i] == 0
        assert len(set(tree.candidate[row, 1:].tolist())) == t - 1


CONFIGS = [(3, 3, 12), (2, 4, 16), (4, 2, 7), (3, 2, 22), (1, 3, 5), (3, 1, 2), (5, 3, 40)]


@pytest.mark.parametrize("k, d, t", CONFIGS)
def test_build_tree_matches_the_original_algorithm(k, d, t):
    spec = DynamicTreeSpec(k, d, t)
    roots = [3, 11, 25, 3, 38]
    tree, run_BR, ok = synthetic_tree(spec, roots)
    assert ok, "frontier ancestors / parent indices do not describe the frontier's paths"
    check_structure(tree, spec)
    for row, root in enumerate(roots):
        tokens, parents, scores = reference_tree(root, lambda path: TABLE[path_hash(path) % TABLE_ROWS], k, d, t)
        np.testing.assert_array_equal(tree.tokens[row], tokens)
        np.testing.assert_array_equal(tree.parents[row], parents)
        np.testing.assert_allclose(tree.scores[row], scores, rtol=1e-6)
        # An expanded node's token is the one the drafter ran at its slot.
        expanded = tree.expanded_slot[row] >= 0
        np.testing.assert_array_equal(run_BR[row][tree.expanded_slot[row][expanded]], tree.tokens[row][expanded])
    # Rows differ (the same root gives the same tree).
    assert not np.array_equal(tree.parents[0], tree.parents[1]) or not np.array_equal(tree.tokens[0], tree.tokens[1])
    np.testing.assert_array_equal(tree.tokens[0], tree.tokens[3])


def test_rows_have_different_shapes():
    tree, _, _ = synthetic_tree(DynamicTreeSpec(3, 3, 12), list(range(3, 35)))
    assert len({tuple(p) for p in tree.parents.tolist()}) > 3
    assert len({tuple(d) for d in tree.depths.tolist()}) > 3


def test_to_token_maps_draft_ids():
    spec = DynamicTreeSpec(3, 2, 10)
    tree, _, ok = synthetic_tree(spec, [5, 9], offset=1000)
    assert ok
    for row, root in enumerate([5, 9]):
        tokens, parents, _ = reference_tree(root, lambda path: TABLE[path_hash(path) % TABLE_ROWS], 3, 2, 10,
                                            to_token=lambda i: i + 1000)
        np.testing.assert_array_equal(tree.tokens[row], tokens)
        np.testing.assert_array_equal(tree.parents[row], parents)


def test_ties_keep_the_selection_ancestor_closed():
    """All-equal distributions: every score ties with its parent's path; the parent still comes first."""
    spec = DynamicTreeSpec(3, 3, 30)

    @jax.jit
    def run(roots_B):
        flat = jnp.zeros((roots_B.shape[0], 8))
        return build_tree(spec, roots_B, flat, lambda fr, s: (jnp.zeros((*fr.tokens.shape, 8)), s), ())[0]

    tree = jax.tree.map(np.asarray, run(jnp.asarray([1, 2], jnp.int32)))
    check_structure(tree, spec)


# ---------------------------------------------------------------------------------------------------------------
# The spec.


def test_parse_dynamic_spec():
    spec = parse_tree("dynamic:top_k=3,depth=4,total_tokens=12", None)
    assert spec == DynamicTreeSpec(3, 4, 12) == parse_tree("dynamic: total_tokens=12, depth=4, top_k=3", None)
    assert hash(spec) == hash(DynamicTreeSpec(3, 4, 12))
    assert (spec.num_nodes, spec.max_depth, spec.is_chain, spec.num_candidates) == (12, 5, False, 3 + 4 * 9)
    assert spec.cache_slots == 1 + 4 * 3 and DynamicTreeSpec(2, 1, 7).cache_slots == 7
    assert str(spec) == "dynamic:top_k=3,depth=4,total_tokens=12"
    assert parse_tree(spec, None) is spec
    assert parse_tree("dynamic:top_k=8,depth=5,total_tokens=60", None).num_candidates == 328
    # Static trees are untouched.
    assert parse_tree("kary:3,2,1", None) == kary([3, 2, 1]) and kary([3, 2, 1]).cache_slots == 16


@pytest.mark.parametrize("bad, match", [
    ("dynamic:top_k=3,depth=2", "lacks total_tokens"),
    ("dynamic:top_k=3,depth=2,total_tokens=8,width=2", "at 'width=2'"),
    ("dynamic:top_k=3,top_k=2,depth=2,total_tokens=8", "twice"),
    ("dynamic:top_k=-1,depth=2,total_tokens=8", "at 'top_k=-1'"),
    ("dynamic:top_k=0,depth=2,total_tokens=8", "top_k must be a positive integer"),
    ("dynamic:top_k=2,depth=0,total_tokens=3", "depth must be a positive integer"),
    ("dynamic:top_k=2,depth=1,total_tokens=1", ">= 2"),
    ("dynamic:top_k=2,depth=2,total_tokens=12", "only yields top_k \\+ depth\\*top_k\\^2 = 10 candidates"),
    ("dynamic", "unknown tree spec"),
])
def test_bad_dynamic_specs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_tree(bad, None)


def test_largest_dynamic_tree_is_accepted():
    assert DynamicTreeSpec(2, 2, 11).num_nodes == 11  # 2 + 2*4 = 10 candidates + the root


def test_static_template_of_a_dynamic_tree_is_refused():
    with pytest.raises(ValueError, match="dynamic tree"):
        spec_arrays(DynamicTreeSpec(2, 2, 5), 1)
    assert isinstance(parse_tree(None, 3), TreeSpec)


# ---------------------------------------------------------------------------------------------------------------
# The draft-model drafter in the speculative loop.

DYNAMIC = "dynamic:top_k=3,depth=3,total_tokens=12"
MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # Untied: random tied embeddings make greedy decoding repeat one token.
    model = build_hf_model("llama", seed=0, tie_word_embeddings=False)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1),
                                      tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def full_logprobs_fn(model):
    """logprobs_of(tokens) -> the model's next-token log-probabilities after the whole sequence (no cache reuse)."""
    s = 128

    @jax.jit
    def run(params, tokens_1S, n):
        cache = init_cache(model.cfg, 1, s, per_layer=has_layer_list(params))
        h, _, _ = forward(params, model.cfg, tokens_1S, cache)
        return jax.nn.log_softmax(lm_head(params, model.cfg, lax.dynamic_slice_in_dim(h, n - 1, 1, axis=1))[0, 0])

    def logprobs_of(tokens):
        padded = np.zeros((1, s), np.int32)
        padded[0, : len(tokens)] = tokens
        return np.asarray(run(model.params, jnp.asarray(padded), len(tokens)))

    return logprobs_of


def test_draft_model_builds_the_reference_tree(target, other_model, prompts):
    """One propose of the drafter (cache, positions, tree masks over its own cache) gives the tree the
    original's algorithm builds from the draft model's full-sequence distributions."""
    spec = parse_tree(DYNAMIC, None)
    for model in (other_model, target):
        drafter = DraftModelDrafter(model.cfg, model.params).configure(
            Settings(spec, SamplingConfig(), cache_len=128, max_new_tokens=16))
        prompt_BT = np.zeros((3, 32), np.int32)
        for i, p in enumerate(prompts):
            prompt_BT[i, : len(p)] = p
        roots = np.asarray([17, 200, 5], np.int32)

        @jax.jit
        def propose(params, prompt_BT, prompt_len_B, root_B):
            state = drafter.init(params, PrefillContext(prompt_BT, prompt_len_B, root_B, ()))
            return drafter.propose(params, state, root_B, None)[0]

        draft = propose(model.params, jnp.asarray(prompt_BT), jnp.asarray([len(p) for p in prompts], jnp.int32),
                        jnp.asarray(roots))
        logprobs_of = full_logprobs_fn(model)
        for row, p in enumerate(prompts):
            tokens, parents, _ = reference_tree(int(roots[row]), lambda path: logprobs_of(p + list(path)), 3, 3, 12)
            np.testing.assert_array_equal(np.asarray(draft.tokens[row]), tokens)
            np.testing.assert_array_equal(np.asarray(draft.parents[row]), parents)
        assert draft.q is None and bool(jnp.all(draft.valid))


def test_greedy_speculative_equals_plain(target, other_model, prompts, plain):
    for model in (other_model, target):
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                               drafter=DraftModelDrafter(model.cfg, model.params), tree=DYNAMIC)
        assert out.tokens == plain.tokens
        assert out.stats["tree_nodes"] == 12


def test_greedy_equals_plain_with_eos_and_budgets_mid_round(target, other_model, prompts, plain):
    """Ragged prompts; an EOS inside a self-drafted run; budgets that cut a round; a per-layer drafter (the target
    runs the suite's stacked layout)."""
    eos = plain.tokens[1][6]
    per_layer = specjax.load(target.path, layout="per_layer")
    drafters = [DraftModelDrafter(target.cfg, target.params), DraftModelDrafter(other_model.cfg, other_model.params),
                DraftModelDrafter(per_layer.cfg, per_layer.params)]
    for max_new in (5, 8):  # one output bucket: one compile per drafter
        ref = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos)
        for drafter in drafters:
            out = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos, drafter=drafter,
                                   tree=DYNAMIC)
            assert out.tokens == ref.tokens
    assert ref.tokens[1][-1] == eos and len(ref.tokens[1]) <= 7 and len(ref.tokens[0]) == 8


def emulate_self_drafting(target, prompts, plain_tokens, new, k, d, t):
    """Rounds and emitted tokens per row, and accepted drafts per depth, of greedy self-drafting with a
    dynamic tree, from the reference algorithm on the target's own distributions: each round emits the
    greedy path as deep as the tree holds it, plus the bonus, cut at the budget."""
    logprobs_of = full_logprobs_fn(target)
    rounds, emitted, accepted_at_depth = [], [], np.zeros(d + 1, int)
    for p, out in zip(prompts, plain_tokens):
        count, r = 1, 0
        while count < new:
            context = p + out[:count - 1]  # the root out[count - 1] starts every path
            tokens, parents, _ = reference_tree(out[count - 1], lambda path: logprobs_of(context + list(path)), k, d, t)
            node, depth = 0, 0
            while True:  # follow the greedy continuation down the tree
                child = [i for i in range(len(tokens)) if parents[i] == node and tokens[i] == out[count + depth]]
                if not child:
                    break
                node, depth = child[0], depth + 1
            emit = min(depth + 1, new - count)
            accepted_at_depth[: min(depth, emit)] += 1
            count, r = count + emit, r + 1
        rounds.append(r)
        emitted.append(count - 1)
    return rounds, emitted, accepted_at_depth.tolist()


@pytest.mark.parametrize("tree", [DYNAMIC, "dynamic:top_k=1,depth=3,total_tokens=5"])
def test_self_drafting_acceptance_is_exactly_the_reference(target, prompts, plain, tree):
    """Drafter = target. Each round accepts the greedy path as deep as the tree holds it, so
    tau = mean(1 + that depth). The tree holds the greedy path to depth D+1 (tau = D+2) only when
    the greedy node stays among the top_k of every level and the total_tokens - 1 best overall: a
    dynamic tree, unlike a static one, can drop the rank-0 path for a more confident branch. With
    top_k = 1 the tree is the greedy chain and tau = D+2 exactly when the budget divides evenly."""
    spec = parse_tree(tree, None)
    new = 1 + 5 * (spec.depth + 2)  # 25 tokens after prefill's: 5 rounds of D + 2 = 5 when every draft is accepted
    out = specjax.generate(target, prompts, max_new_tokens=new, eos_token_id=[],
                           drafter=DraftModelDrafter(target.cfg, target.params), tree=tree)
    assert out.tokens == [row[:new] for row in plain.tokens]
    rounds, emitted, accepted = emulate_self_drafting(target, prompts, plain.tokens, new, spec.top_k, spec.depth,
                                                      spec.total_tokens)
    assert out.stats["row_rounds"] == rounds
    assert out.stats["acceptance_length"] == pytest.approx(sum(emitted) / sum(rounds))
    assert out.stats["accepted_at_depth"] == accepted
    if spec.top_k == 1:
        assert out.stats["acceptance_length"] == spec.depth + 2 and rounds == [5, 5, 5]


def test_statistics_are_consistent(target, other_model, prompts):
    spec = parse_tree(DYNAMIC, None)
    for model in (target, other_model):
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                               drafter=DraftModelDrafter(model.cfg, model.params), tree=DYNAMIC)
        s = out.stats
        row_rounds = sum(s["row_rounds"])
        offered, accepted = np.asarray(s["offered_at_depth"]), np.asarray(s["accepted_at_depth"])
        assert len(offered) == spec.max_depth == 4
        assert offered.sum() == (spec.num_nodes - 1) * row_rounds  # every active row offers T-1 drafts
        assert np.all(accepted <= offered) and np.all(np.diff(accepted) <= 0)
        assert accepted.sum() == s["accepted_drafts"]
        assert np.asarray(s["accepted_child_rank"]).sum(axis=1).tolist() == accepted.tolist()
        emitted = 3 * (MAX_NEW - 1)  # no EOS: every row emits its whole budget after prefill's token
        assert s["acceptance_length"] == pytest.approx(emitted / row_rounds)
        assert 0 <= s["accepted_drafts"] + row_rounds - emitted <= 3  # only a row's last round may lose its bonus
        assert s["per_position_acceptance"] == pytest.approx((accepted / row_rounds).tolist())
        assert s["verified_tokens_per_round"] * s["rounds"] == spec.num_nodes * row_rounds
        assert s["padded_tokens_per_round"] == 4 * spec.num_nodes
        assert s["drafter_calls"] == s["rounds"] * (spec.depth + 1)


def test_second_call_does_not_recompile(target, other_model, prompts):
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    specjax.generate(target, prompts, max_new_tokens=MAX_NEW, drafter=drafter, tree=DYNAMIC)
    before = len(target.compiled)
    out = specjax.generate(target, [p[::-1] for p in prompts], max_new_tokens=MAX_NEW - 3, drafter=drafter,
                           tree="dynamic:total_tokens=12,depth=3,top_k=3")
    assert out.stats["compile_s"] == 0.0 and len(target.compiled) == before


def test_sampled_dynamic_tree_runs_and_is_seeded(target, other_model, prompts):
    """Sampled verification of a deterministic top-k tree (q one-hot per node, parents differing per row)."""
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    run = lambda seed: specjax.generate(target, prompts, max_new_tokens=20, temperature=1.0, seed=seed,  # noqa: E731
                                        eos_token_id=[], drafter=drafter, tree=DYNAMIC)
    a = run(3)
    assert [len(t) for t in a.tokens] == [20] * 3 and all(0 <= x < 256 for t in a.tokens for x in t)
    assert a.tokens == run(3).tokens and a.tokens != run(4).tokens
    assert 1.0 <= a.stats["acceptance_length"]


def test_chain_only_drafters_refuse_dynamic_trees(target):
    with pytest.raises(ValueError, match="chains only"):
        specjax.generate(target, [[5, 6]], max_new_tokens=4, drafter=specjax.NgramDrafter(), tree=DYNAMIC)


def test_stacked_pallas_drafter_equals_the_per_layer_xla_drafter(target, prompts, plain):
    """The GPU graph (stacked layers under scan, one stacked cache, the kernel in interpret mode) drafts the
    same dynamic trees: self-drafting output and acceptance equal the CPU layout's."""
    gpu_like = specjax.load(target.path, attn_impl="pallas", layout="stacked")
    kwargs = dict(max_new_tokens=12, eos_token_id=[], tree=DYNAMIC)
    want = specjax.generate(target, prompts, drafter=DraftModelDrafter(target.cfg, target.params), **kwargs)
    out = specjax.generate(gpu_like, prompts, drafter=DraftModelDrafter(gpu_like.cfg, gpu_like.params,
                                                                        attn_impl="pallas"), **kwargs)
    assert out.tokens == want.tokens == [t[:12] for t in plain.tokens]
    assert out.stats["accepted_at_depth"] == want.stats["accepted_at_depth"]


def test_speculative_loop_with_a_dynamic_tree_lowers_for_cuda(monkeypatch):
    import dataclasses

    from test_gpu_path import TRITON_CALL, abstract_params, abstract_request, llama3_8b_shaped

    import specjax.kernels
    from specjax.decoding.decode import LoopConfig
    from specjax.decoding.speculative import spec_generate

    monkeypatch.setattr(specjax.kernels, "on_gpu", lambda: True)
    cfg = llama3_8b_shaped(layers=2, dtype="bfloat16")
    draft_cfg = dataclasses.replace(cfg, hidden_size=2048, intermediate_size=8192, num_layers=1, head_dim=64)
    lc = LoopConfig(cfg, True, out_len=32, cache_len=256, attn_impl="auto")
    drafter = DraftModelDrafter(draft_cfg, None, attn_impl="auto").configure(
        Settings(DynamicTreeSpec(8, 5, 60), lc.drafting, 256, lc.out_len))
    text = spec_generate.trace(abstract_params(cfg), abstract_params(draft_cfg), *abstract_request(8, 64), lc=lc,
                               drafter=drafter).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON_CALL) >= 3  # prefill / verify, the drafter's [prev, root] pass, its frontier steps
