"""Eagle3Drafter trees: static (TreeSpec) and EAGLE-2 dynamic (DynamicTreeSpec).

- Parity: the first-round dynamic tree on each fixture case's prompt is the tree the original
  SafeAILab/EAGLE `topK_genrate` built (tests/fixtures/eagle3/*/io.npz, tree_*).
- A chain oracle: every node of a tree (static or dynamic, ragged batch, paths past the depth the
  fixtures reach, and after a round's update over stale provisional slots) is what the head drafts
  when the node's root-to-parent path is fed to it as a chain, one step at a time.
- In the speculative loop on a 7-layer random target: greedy output equals plain greedy decoding
  (EOS and budgets mid-round), sampled trees run and are seeded, statistics add up, no recompile.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from test_dynamic_tree import reference_tree

import specjax
from specjax.config import ModelConfig, SamplingConfig
from specjax.convert.eagle3 import load_eagle3
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, child_ranks, from_choices, kary, parse_tree
from specjax.decoding.verify import Verdict
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, head_of, init_params
from specjax.loading.drafter import eagle3_drafter
from specjax.models.cache import KVCache

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
CASES = ("rope_theta", "rope_default")
STATIC = "kary:2,2,1"
DYNAMIC = "dynamic:top_k=3,depth=3,total_tokens=10"
CACHE = 64


def fixture_drafter(case: str, spec, record: bool = False) -> tuple[Eagle3Drafter, dict]:
    """The fixture head (read by specjax's reader) with the fixture's embedding, configured for `spec`."""
    io = dict(np.load(FIXTURES / case / "io.npz"))
    tcfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    cfg, host = load_eagle3(FIXTURES / case, tcfg)
    params = jax.tree.map(jnp.asarray, dict(host))
    params["embed"] = jnp.asarray(io["target_embed"])
    drafter = Eagle3Drafter(cfg, params, attn_impl="xla")
    return drafter.configure(Settings(spec, SamplingConfig(), CACHE, 16, record_logits=record)), io


def first_round(drafter: Eagle3Drafter, prompt_BT, prompt_len_B, root_B, feats):
    """init + propose under jit: (Draft, state after propose)."""

    @jax.jit
    def run(params, prompt_BT, prompt_len_B, root_B, feats):
        state = drafter.init(params, PrefillContext(prompt_BT, prompt_len_B, root_B, feats))
        return drafter.propose(params, state, root_B, jax.random.split(jax.random.key(0), root_B.shape[0]))

    return run(drafter.params, prompt_BT, prompt_len_B, root_B, feats)


# ---- parity with the original's topK_genrate -----------------------------------------------------------------


def node_paths(tokens, parents) -> list[tuple[int, ...]]:
    """Each node's root-to-node token path, in node order."""
    paths = []
    for i in range(len(tokens)):
        paths.append((int(tokens[i]),) if parents[i] < 0 else paths[parents[i]] + (int(tokens[i]),))
    return paths


def retrieve_paths(tokens, retrieve) -> set[tuple[int, ...]]:
    """The original's retrieve_indices (one row per leaf: node indices root first, -1 padded) as the set of
    every root-to-node token path (each leaf path and its prefixes)."""
    out = set()
    for row in retrieve:
        nodes = [int(x) for x in row if x >= 0]
        for m in range(1, len(nodes) + 1):
            out.add(tuple(int(tokens[j]) for j in nodes[:m]))
    return out


@pytest.mark.parametrize("case", CASES)
def test_first_round_dynamic_tree_is_the_originals(case):
    """topK_genrate got tree_ids = (t_0, ids_BT[0]) with feature row p paired with tree_ids[p + 1]: the prompt
    is tree_ids[:-1], the root tree_ids[-1], the features row 0's (make_eagle3_fixtures.py)."""
    io = dict(np.load(FIXTURES / case / "io.npz"))
    spec = DynamicTreeSpec(int(io["tree_top_k"]), int(io["tree_depth"]), int(io["tree_total_tokens"]))
    drafter, io = fixture_drafter(case, spec)
    ids = jnp.asarray(io["tree_ids"])
    t = ids.shape[1] - 1
    feats = tuple(jnp.split(jnp.asarray(io["features_BTF"][:1]), 3, axis=-1))
    draft, _ = first_round(drafter, ids[:, :-1], jnp.asarray([t], jnp.int32), ids[:, -1], feats)
    tokens, parents = np.asarray(draft.tokens[0]), np.asarray(draft.parents[0])
    want_tokens, want_parents = io["tree_tokens"][0], io["tree_parents"]
    assert len(tokens) == len(want_tokens) == spec.total_tokens
    # As sets of root-to-node paths (the original's retrieve indices), then node for node: the order is the same.
    assert set(node_paths(tokens, parents)) == retrieve_paths(want_tokens, io["tree_retrieve"])
    assert len(set(node_paths(tokens, parents))) == len(tokens)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(parents, want_parents)
    assert draft.q is None and bool(jnp.all(draft.valid))


# ---- a chain oracle ------------------------------------------------------------------------------------------


def chain_oracle(drafter: Eagle3Drafter, prompt, root: int, feats_T):
    """logprobs_of(path) for one row: the head's draft log-probabilities after path = (root, t1, ..., tm), from
    init over the prompt and then t1..tm fed one at a time with the head's own hidden (chain drafting)."""
    cfg, params = drafter.cfg, drafter.params
    p = len(prompt)
    max_path = 8

    @jax.jit
    def run(path_L):
        ctx = PrefillContext(jnp.asarray([prompt], jnp.int32), jnp.asarray([p], jnp.int32), jnp.asarray([root]),
                             tuple(f[None] for f in feats_T))
        head = head_of(cfg, params)
        cache, h_D = drafter.init(params, ctx)
        out = [head.draft_logits(h_D[:, None])[0, 0]]
        h_11D = h_D[:, None]
        for i in range(max_path):
            h_11D, c = head.midlayer(path_L[i][None, None], h_11D, KVCache(cache.k, cache.v, cache.lengths + i),
                                     attn_impl="xla")
            cache = KVCache(c.k, c.v, cache.lengths)
            out.append(head.draft_logits(h_11D)[0, 0])
        return jax.nn.log_softmax(jnp.stack(out), axis=-1)

    memo = {}

    def logprobs_of(path):
        path = tuple(int(x) for x in path)
        assert path[0] == root and len(path) <= max_path + 1
        tail = path[1:]
        if tail not in memo:
            memo[tail] = np.asarray(run(jnp.asarray(list(tail) + [0] * (max_path - len(tail)), jnp.int32)))
        return memo[tail][len(tail)]

    return logprobs_of


def to_target(drafter):
    d2t = np.asarray(drafter.params["d2t"])
    return lambda i: np.asarray(i) + d2t[np.asarray(i)]


def static_reference(spec: TreeSpec, root: int, logprobs_of, to_token):
    """Node i = the rank_i-th best draft token after its parent's path."""
    tokens, paths = [root], [(root,)]
    for i, (par, rank) in enumerate(zip(spec.parents, child_ranks(spec))):
        if i == 0:
            continue
        order = np.argsort(-logprobs_of(paths[par]), kind="stable")
        tokens.append(int(to_token(order[rank])))
        paths.append(paths[par] + (tokens[-1],))
    return np.asarray(tokens)


def ragged_inputs(drafter, lens=(9, 4), seed=0):
    rng = np.random.default_rng(seed)
    b, t = len(lens), max(lens)
    prompt = np.zeros((b, t), np.int32)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in lens]
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    width = drafter.cfg.target_hidden_size
    feats = [rng.standard_normal((b, t, width)).astype(np.float32) for _ in range(3)]
    roots = rng.integers(0, 256, size=b).astype(np.int32)
    return prompts, prompt, feats, roots


def check_against_oracle(drafter, draft, prompts, feats, roots, lens):
    spec = drafter.settings.tree
    for row, p in enumerate(prompts):
        oracle = chain_oracle(drafter, p, int(roots[row]), [f[row, :lens[row]] for f in feats])
        if isinstance(spec, DynamicTreeSpec):
            tokens, parents, _ = reference_tree(int(roots[row]), oracle, spec.top_k, spec.depth, spec.total_tokens,
                                                to_token=to_target(drafter))
            np.testing.assert_array_equal(np.asarray(draft.parents[row]), parents)
        else:
            tokens = static_reference(spec, int(roots[row]), oracle, to_target(drafter))
            np.testing.assert_array_equal(np.asarray(draft.parents[row]), spec.parents)
        np.testing.assert_array_equal(np.asarray(draft.tokens[row]), tokens)


TREES = [STATIC, DYNAMIC, "dynamic:top_k=3,depth=3,total_tokens=30", "dynamic:top_k=2,depth=4,total_tokens=19",
         [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [2, 0, 0], [2, 0, 0, 0]],
         TreeSpec((-1, 0, 1, 0, 2, 3, 1, 4))]  # levels interleaved in node order


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_every_node_is_what_chain_drafting_its_path_gives(tree):
    """Ragged batch; total_tokens - 1 = all candidates (30 of 30, 18 of 18) keeps every level, so paths of depth
    D+1 are checked;
    the choice tree has irregular levels (ranks 0..2 under the root, a depth-4 branch off a rank-2 node)."""
    spec = parse_tree(tree, None)
    drafter, _ = fixture_drafter("rope_theta", spec)
    lens = (9, 4)
    prompts, prompt, feats, roots = ragged_inputs(drafter, lens)
    draft, (cache, _) = first_round(drafter, jnp.asarray(prompt), jnp.asarray(lens, jnp.int32), jnp.asarray(roots),
                                    tuple(jnp.asarray(f) for f in feats))
    np.testing.assert_array_equal(cache.lengths, lens)  # drafting leaves the committed length alone
    check_against_oracle(drafter, draft, prompts, feats, roots, lens)
    assert draft.q is None


def test_update_after_a_tree_round_then_the_next_tree_reads_no_stale_slot():
    """Round 1 drafts a dynamic tree whose expanded slots (top_k*depth = 12) reach past the N = 6 rows update
    rewrites; a synthetic verdict accepts a depth-2 path in row 0 and only the root in row 1. Then the head's
    committed K/V and last hidden equal init over the accepted sequence, and round 2's tree is the oracle's
    for that sequence: no committed row or tree node reads a provisional slot of round 1."""
    spec = DynamicTreeSpec(3, 4, 6)
    drafter, _ = fixture_drafter("rope_default", spec)
    params, lens = drafter.params, (7, 3)
    n = spec.num_nodes
    prompts, prompt, feats, roots = ragged_inputs(drafter, lens, seed=3)
    b, width = len(lens), drafter.cfg.target_hidden_size
    draft, state = first_round(drafter, jnp.asarray(prompt), jnp.asarray(lens, jnp.int32), jnp.asarray(roots),
                               tuple(jnp.asarray(f) for f in feats))
    tokens, parents = np.asarray(draft.tokens), np.asarray(draft.parents)
    deep = [i for i in range(n) if parents[0, i] > 0][0]  # a depth-2 node of row 0
    path = np.zeros((b, n), np.int32)
    path[0, :3] = [0, parents[0, deep], deep]
    accepted = np.asarray([3, 1], np.int32)
    bonus = np.asarray([11, 200], np.int32)
    rng = np.random.default_rng(9)
    node_feats = [rng.standard_normal((b, n, width)).astype(np.float32) for _ in range(3)]
    verdict = Verdict(jnp.asarray(path), jnp.asarray(accepted), jnp.asarray(bonus))
    state = jax.jit(drafter.update)(params, state, draft, verdict, tuple(jnp.asarray(f) for f in node_feats))
    cache, last_h = state
    np.testing.assert_array_equal(cache.lengths, np.asarray(lens) + accepted)

    # The accepted sequence: prompt, root, accepted drafts; features: the prompt's, then the verified nodes'.
    seqs, seq_feats, new_lens = [], [], []
    for row in range(b):
        acc_nodes = path[row, :accepted[row]]
        seqs.append(prompts[row] + [int(tokens[row, j]) for j in acc_nodes])
        seq_feats.append([np.concatenate([f[row, :lens[row]], nf[row, acc_nodes]]) for f, nf in zip(feats, node_feats)])
        new_lens.append(lens[row] + int(accepted[row]))
    for row in range(b):
        m = new_lens[row]
        ctx = PrefillContext(jnp.asarray([seqs[row]]), jnp.asarray([m], jnp.int32), jnp.asarray(bonus[row:row + 1]),
                             tuple(jnp.asarray(f[None]) for f in seq_feats[row]))
        ref_cache, ref_h = drafter.init(params, ctx)
        np.testing.assert_allclose(last_h[row], ref_h[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(cache.k[0][row, :m], ref_cache.k[0][0, :m], atol=1e-5, rtol=0)
        np.testing.assert_allclose(cache.v[0][row, :m], ref_cache.v[0][0, :m], atol=1e-5, rtol=0)

    draft2, _ = jax.jit(drafter.propose)(params, state, jnp.asarray(bonus), jax.random.split(jax.random.key(1), b))
    t2 = max(new_lens)
    feats2 = [np.zeros((b, t2, width), np.float32) for _ in range(3)]
    for row in range(b):
        for f2, f in zip(feats2, seq_feats[row]):
            f2[row, :new_lens[row]] = f
    check_against_oracle(drafter, draft2, seqs, feats2, bonus, new_lens)


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
def test_the_pallas_kernel_drafts_the_same_trees(tree):
    """The GPU attention path (the kernel, interpret mode on CPU) over the head's window drafts what XLA does."""
    spec = parse_tree(tree, None)
    drafter, _ = fixture_drafter("rope_default", spec)
    lens = (9, 4)
    _, prompt, feats, roots = ragged_inputs(drafter, lens, seed=5)
    args = (jnp.asarray(prompt), jnp.asarray(lens, jnp.int32), jnp.asarray(roots), tuple(jnp.asarray(f) for f in feats))
    want, _ = first_round(drafter, *args)
    got, _ = first_round(dataclasses.replace(drafter, attn_impl="pallas"), *args)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
def test_recorded_logits_are_the_parents(tree):
    """inspect_draft's logits for trees: node i's are its parent's (target vocabulary), so its token is among
    their top ranks (rank 0 for a first child)."""
    spec = parse_tree(tree, None)
    drafter, _ = fixture_drafter("rope_theta", spec, record=True)
    lens = (6, 2)
    _, prompt, feats, roots = ragged_inputs(drafter, lens, seed=4)
    draft, _ = first_round(drafter, jnp.asarray(prompt), jnp.asarray(lens, jnp.int32), jnp.asarray(roots),
                           tuple(jnp.asarray(f) for f in feats))
    logits = np.asarray(draft.logits)
    assert logits.shape == (2, spec.num_nodes, 256)
    tokens, parents = np.asarray(draft.tokens), np.asarray(draft.parents)
    for row in range(2):
        for i in range(1, spec.num_nodes):
            assert np.isfinite(logits[row, i]).sum() == drafter.cfg.draft_vocab_size
            siblings = [j for j in range(1, i + 1) if parents[row, j] == parents[row, i]]
            rank = int(np.sum(logits[row, i] > logits[row, i, tokens[row, i]]))
            assert rank == len(siblings) - 1 if not isinstance(spec, DynamicTreeSpec) else rank < spec.top_k
            if siblings[0] == i:
                assert rank == 0


def test_trees_wider_than_the_draft_vocabulary_are_refused():
    drafter, _ = fixture_drafter("rope_theta", kary([2]))
    with pytest.raises(ValueError, match="draft vocabulary"):
        drafter.configure(Settings(kary([129]), SamplingConfig(), CACHE, 16))
    with pytest.raises(ValueError, match="draft vocabulary"):
        drafter.configure(Settings(DynamicTreeSpec(129, 1, 10), SamplingConfig(), CACHE, 16))


# ---- in the speculative loop ---------------------------------------------------------------------------------

MAX_NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = build_hf_model("llama", seed=0, num_hidden_layers=7, tie_word_embeddings=False)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def copy_head(target, draft_vocab: int = 200, scale: float = 0.02) -> Eagle3Drafter:
    """A head that mostly drafts the root again and again, so tree drafts are accepted at every depth
    in the target's repetitive runs (the fixture heads, random, almost never are).

    Its taps end with the target's last-layer output (HF numbering L), which fc passes through alone; the
    layer's o_proj and MLP down-projection are small (attention and MLP still run, barely moving the
    hidden), and its final norm and lm_head are the target's over a reduced draft vocabulary. Feature row
    p (the target at t_p) predicts t_{p+1}, the token it is paired with: the root's row predicts the root.
    """
    tc = target.cfg
    cfg = Eagle3Config(hidden_size=tc.hidden_size, num_heads=4, num_kv_heads=2, intermediate_size=96,
                       vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab, target_hidden_size=tc.hidden_size,
                       feature_layers=(2, 4, tc.num_layers), rms_norm_eps=tc.rms_norm_eps)
    params = init_params(cfg, jax.random.key(5), target.params["embed"])
    used = np.sort(np.random.default_rng(1).permutation(tc.vocab_size)[:draft_vocab])
    h = tc.hidden_size
    params["fc"] = jnp.concatenate([jnp.zeros((2 * h, h)), jnp.eye(h)]).astype(params["fc"].dtype)
    params["layer"] = {**params["layer"], "wo": scale * params["layer"]["wo"],
                       "w_down": scale * params["layer"]["w_down"]}
    params["final_norm"] = target.params["final_norm"]
    params["lm_head"] = jnp.asarray(target.params["lm_head"])[:, used]
    params["d2t"] = jnp.asarray(used - np.arange(draft_vocab), jnp.int32)
    return Eagle3Drafter(cfg, params)


@pytest.fixture(scope="module")
def heads(target):
    return {case: eagle3_drafter(FIXTURES / case, target) for case in CASES} | {"copy": copy_head(target)}


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
@pytest.mark.parametrize("head", [*CASES, "copy"])
def test_greedy_speculative_equals_plain(target, prompts, plain, heads, tree, head):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=heads[head], tree=tree)
    assert out.tokens == plain.tokens
    assert out.stats["tree_nodes"] == parse_tree(tree, None).num_nodes
    if head == "copy":  # drafts accepted down to the tree's deepest level
        assert out.stats["accepted_at_depth"][-1] > 0 and out.stats["acceptance_length"] > 1.4


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
def test_greedy_equals_plain_with_eos_and_budgets_mid_round(target, prompts, plain, heads, tree):
    """Ragged prompts; with budget 8 row 1 stops at an EOS (its 6th token) and rows 0 and 2 at the budget;
    with budget 5 every row stops at the budget, row 0 inside a run of accepted drafts (copy head)."""
    eos = plain.tokens[1][5]
    for head in ("rope_theta", "copy"):
        for max_new in (5, 8):  # one output bucket: one compile
            ref = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos)
            out = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos, drafter=heads[head],
                                   tree=tree)
            assert out.tokens == ref.tokens
    assert ref.tokens[1][-1] == eos and [len(t) for t in ref.tokens] == [8, 6, 8]


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
def test_statistics_are_consistent(target, prompts, heads, tree):
    spec = parse_tree(tree, None)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=heads["copy"], tree=tree)
    s = out.stats
    row_rounds = sum(s["row_rounds"])
    offered, accepted = np.asarray(s["offered_at_depth"]), np.asarray(s["accepted_at_depth"])
    assert len(offered) == spec.max_depth
    assert offered.sum() == (spec.num_nodes - 1) * row_rounds
    if isinstance(spec, TreeSpec):  # a static tree offers the same nodes at each depth every round
        per_depth = np.bincount(spec.depths, minlength=spec.max_depth + 1)[1:]
        assert offered.tolist() == (per_depth * row_rounds).tolist()
    assert np.all(accepted <= offered) and np.all(np.diff(accepted) <= 0) and accepted[-1] > 0
    assert accepted.sum() == s["accepted_drafts"]
    assert np.asarray(s["accepted_child_rank"]).sum(axis=1).tolist() == accepted.tolist()
    emitted = 3 * (MAX_NEW - 1)  # no EOS: every row emits its whole budget after prefill's token
    assert s["acceptance_length"] == pytest.approx(emitted / row_rounds)
    assert 0 <= s["accepted_drafts"] + row_rounds - emitted <= 3  # only a row's last round may lose its bonus
    assert s["per_position_acceptance"] == pytest.approx((accepted / row_rounds).tolist())
    assert s["verified_tokens_per_round"] * s["rounds"] == pytest.approx(spec.num_nodes * row_rounds)
    assert s["drafter_calls"] == s["rounds"] * spec.max_depth  # max_depth - 1 drafting passes + the update


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC])
def test_sampled_trees_run_and_are_seeded(target, prompts, heads, tree):
    """Sampled verification of deterministic top-k trees (q None: one-hot per node)."""
    run = lambda seed: specjax.generate(target, prompts, max_new_tokens=12, temperature=0.8, seed=seed,  # noqa: E731
                                        eos_token_id=[], drafter=heads["copy"], tree=tree)
    a = run(3)
    assert [len(t) for t in a.tokens] == [12] * 3 and all(0 <= x < 256 for t in a.tokens for x in t)
    assert a.tokens == run(3).tokens and a.tokens != run(4).tokens
    assert a.stats["acceptance_length"] >= 1.0


def test_second_call_does_not_recompile(target, prompts):
    drafter = eagle3_drafter(FIXTURES / "rope_theta", target)
    for tree in (STATIC, DYNAMIC):
        specjax.generate(target, prompts, max_new_tokens=MAX_NEW, drafter=drafter, tree=tree)
        before = len(target.compiled)
        out = specjax.generate(target, [p[::-1] for p in prompts], max_new_tokens=MAX_NEW - 3,
                               drafter=eagle3_drafter(FIXTURES / "rope_theta", target), tree=tree)
        assert out.stats["compile_s"] == 0.0 and len(target.compiled) == before


def test_inspect_draft_gives_the_whole_tree(target):
    drafter = eagle3_drafter(FIXTURES / "rope_theta", target)
    out = specjax.inspect_draft(target, drafter, [5, 6, 7, 8], tree=DYNAMIC)
    assert out.tree_tokens.shape == out.tree_parents.shape == (10,) and out.tree_parents[0] == -1
    assert out.logits.shape == (9, 256)
    first = [i for i in range(1, 10) if out.tree_parents[i] == 0][0]
    assert out.logits[first - 1].argmax() == out.tree_tokens[first]


def test_from_choices_template_runs_in_the_loop(target, prompts, plain):
    tree = from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=eagle3_drafter(FIXTURES / "rope_default", target), tree=tree)
    assert out.tokens == plain.tokens
