"""A hybrid draft model (Qwen3.5: Gated DeltaNet + attention layers) drafting for a hybrid or a dense target.

Its recurrent state and conv window must follow its drafting: after a round that accepts a prefix of the draft,
the drafter's state equals a fresh prefill over the sequence so far (chains, static and dynamic trees, rows
accepting different lengths), and so does its next draft; a dynamic tree is the one EAGLE-2's algorithm builds
from the draft model's full-sequence distributions. Greedy output equals plain decoding (a noisy copy of the
hybrid target accepts partly; a random hybrid draft for a dense target); sampled chains keep the target's
distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, build_qwen35, save_hf_model
from jax import lax
from test_dynamic_tree import reference_tree
from test_hybrid_speculative import tiny_hybrid
from test_lossless_sampling import NEW, PROMPT, ROWS, chi_square_passes, exact_distribution

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain, kary, parse_tree
from specjax.decoding.verify import Verdict
from specjax.drafters import DraftModelDrafter
from specjax.models.model import merge
from specjax.models.target import Target
from specjax.planning.memory import checkpoint_draft

MAX_NEW = 40
HYBRID_DRAFT = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A random 3-layer hybrid (two DeltaNet layers around an attention layer) with the tiny targets' vocabulary."""
    return save_hf_model(build_qwen35("causal_lm", seed=3, **HYBRID_DRAFT), tmp_path_factory.mktemp("hybrid_draft"))


@pytest.fixture(scope="module")
def draft(draft_dir):
    return specjax.load(draft_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


def noisy_copy(model, scale: float, seed: int = 0) -> DraftModelDrafter:
    """The model with every weight scaled by (1 + scale N(0, 1)): agrees with it often, not always."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x * (1 + scale * jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]
    return DraftModelDrafter(model.cfg, jax.tree.unflatten(treedef, noisy))


# ---- the state follows drafting: after update it is a fresh prefill's -------------------------------------------


def padded(rows: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    width = max(map(len, rows))
    return (jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32),
            jnp.asarray([len(r) for r in rows], jnp.int32))


def visible(cache, lengths):
    """Each row's cached prefix: K/V up to its length, the conv windows and states."""
    kv = [np.asarray(x)[b, :n] for x in (*cache.kv.k, *cache.kv.v) for b, n in enumerate(lengths)]
    return kv + [np.asarray(x) for x in (*cache.conv, *cache.state)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def paths_in(parents_BN: np.ndarray) -> list[list[int]]:
    """Row 0 accepts nothing, row 1 its node 1, row 2 the path to its last deepest node."""
    paths = [path_to(list(parents_BN[2]), i) for i in range(parents_BN.shape[1])]
    deepest = max(range(len(paths)), key=lambda i: (len(paths[i]), i))
    return [[0], path_to(list(parents_BN[1]), 1), paths[deepest]]


def assert_reference_trees(model, prompts, root_B, draft, spec):
    """Each row's tree is the one EAGLE-2's algorithm builds from the draft model's full-sequence distributions
    (test_dynamic_tree.reference_tree): every frontier pass followed its nodes' paths."""
    width = 64

    @jax.jit
    def logprobs(params, ids_1S, n):
        logits_1SV = merge(model.cfg, params)(ids_1S, attn_impl="xla")
        return jax.nn.log_softmax(lax.dynamic_slice_in_dim(logits_1SV, n - 1, 1, axis=1)[0, 0])

    for row, prompt in enumerate(prompts):
        def logprobs_of(path, prompt=prompt):
            ids = prompt + list(path)
            return np.asarray(logprobs(model.params, jnp.asarray([ids + [0] * (width - len(ids))]), len(ids)))

        tokens, parents, _ = reference_tree(int(root_B[row]), logprobs_of, spec.top_k, spec.depth, spec.total_tokens)
        np.testing.assert_array_equal(np.asarray(draft.tokens[row]), tokens)
        np.testing.assert_array_equal(np.asarray(draft.parents[row]), parents)


# Row b accepts the path's first num_accepted[b] nodes (root included): nothing, a prefix, the whole draft.
ROUNDS = {"chain:3": (chain(3), [[0], [0, 1, 2], [0, 1, 2, 3]]),
          "kary:2,2": (kary([2, 2]), [[0], [0, 2], [0, 2, 5]]),
          "dynamic": (parse_tree("dynamic:top_k=2,depth=3,total_tokens=6", None), None)}


@pytest.mark.parametrize("name", list(ROUNDS))
def test_state_after_a_round_is_the_prefill_of_the_accepted_sequence(draft, prompts, name):
    tree, paths = ROUNDS[name]
    drafter = DraftModelDrafter(draft.cfg, draft.params).configure(
        Settings(tree, SamplingConfig(), cache_len=64, max_new_tokens=16, record_logits=tree.is_chain))
    init, propose, update = jax.jit(drafter.init), jax.jit(drafter.propose), jax.jit(drafter.update)
    params, b = drafter.params, len(prompts)
    keys_B = jax.random.split(jax.random.key(0), b)
    prompt_BT, prompt_len_B = padded(prompts)
    root_B = jnp.asarray([7, 8, 9], jnp.int32)
    draft1, state1 = propose(params, init(params, PrefillContext(prompt_BT, prompt_len_B, root_B, ())), root_B,
                             keys_B)

    tokens = np.asarray(draft1.tokens)
    if paths is None:  # a dynamic tree: each row's own
        assert_reference_trees(draft, prompts, np.asarray(root_B), draft1, tree)
        paths = paths_in(np.asarray(draft1.parents))
        assert len(paths[2]) > 2
    num_accepted = [len(p) for p in paths]
    path_BN = jnp.asarray([p + [0] * (tokens.shape[1] - len(p)) for p in paths], jnp.int32)
    bonus_B = jnp.asarray([11, 12, 13], jnp.int32)
    state2 = update(params, state1, draft1, Verdict(path_BN, jnp.asarray(num_accepted, jnp.int32), bonus_B), ())

    seq_BT, seq_len_B = padded([p + tokens[i, path].tolist() for i, (p, path) in enumerate(zip(prompts, paths))])
    fresh = init(params, PrefillContext(seq_BT, seq_len_B, bonus_B, ()))
    lengths = np.asarray(fresh[0].lengths)
    np.testing.assert_array_equal(np.asarray(state2[0].lengths), lengths)
    np.testing.assert_array_equal(np.asarray(state2[1]), np.asarray(fresh[1]))  # prev: the last accepted token
    for got, want in zip(visible(state2[0], lengths), visible(fresh[0], lengths)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)

    draft2, _ = propose(params, state2, bonus_B, keys_B)
    ref2, _ = propose(params, fresh, bonus_B, keys_B)
    np.testing.assert_array_equal(np.asarray(draft2.tokens), np.asarray(ref2.tokens))
    if tree.is_chain:
        np.testing.assert_allclose(np.asarray(draft2.logits), np.asarray(ref2.logits), atol=1e-4, rtol=1e-4)


# ---- greedy output equals plain decoding -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    return specjax.load(save_hf_model(build_qwen35("causal_lm"), tmp_path_factory.mktemp("qwen35")))


@pytest.fixture(scope="module")
def dense_target(tmp_path_factory):
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=2), tmp_path_factory.mktemp("qwen3")))


@pytest.mark.parametrize("kind, tree", [("hybrid", "chain:3"), ("hybrid", "kary:2,2"),
                                        ("hybrid", "dynamic:top_k=2,depth=3,total_tokens=6"),
                                        ("dense", "chain:3"), ("dense", "kary:2,2")])
def test_greedy_equals_plain(kind, tree, hybrid_target, dense_target, draft_dir, prompts):
    """A hybrid target with its noisy copy as the draft (rounds accept 0..K drafts), or a dense target with a
    random hybrid draft (loaded as a user would)."""
    target = hybrid_target if kind == "hybrid" else dense_target
    drafter = noisy_copy(target, 0.1) if kind == "hybrid" else specjax.load_drafter(draft_dir, target)
    plain = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens
    if kind == "hybrid":  # partly right: the rollback to a prefix runs, and the state it leaves drafts well again
        accepted = out.stats["per_position_acceptance"]
        assert 0.0 < accepted[-1] < accepted[0] < 1.0 and out.stats["acceptance_length"] > 1.8


def test_memory_plan_counts_the_state_of_a_hybrid_draft(draft_dir, draft):
    """`specjax plan --memory --drafter`: K/V of the attention layer only, plus each DeltaNet layer's state and
    conv window per row (fp32 checkpoint)."""
    cfg, lin = draft.cfg, draft.cfg.linear
    priced = checkpoint_draft(draft_dir)
    assert priced.kv_bytes_per_token == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert priced.state_bytes_per_row == 2 * 4 * (lin.num_value_heads * lin.key_head_dim * lin.value_head_dim +
                                                  (lin.conv_kernel - 1) * lin.conv_dim)


# ---- sampling keeps the target's distribution ---------------------------------------------------------------------


def test_sampled_chain_has_the_target_distribution():
    """A noisy copy of the tiny hybrid as its draft: drafts are accepted often (about 0.77 at depth 1, 0.5 at 2),
    yet its own distribution is far from the target's (the test's power)."""
    target = tiny_hybrid(5)
    drafter = noisy_copy(target, 0.05)
    sampling = SamplingConfig(1.0)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=11, tree="chain:2",
                           eos_token_id=[], drafter=drafter)
    samples = np.array(out.tokens)
    ok, stat, threshold = chi_square_passes(samples, exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    own = exact_distribution(Target(drafter.params, drafter.cfg, hf_config={}), sampling)
    ok_draft, stat_draft, _ = chi_square_passes(samples, own)
    assert not ok_draft and stat_draft > 3 * threshold  # the test has power
    assert out.stats["acceptance_length"] > 1.4
