"""Eagle3Drafter: lossless chains on a tiny random target, and the head's cache bookkeeping (trees: test_eagle3_tree.py).

The target is a 7-layer random Llama (the smallest depth whose default taps 2, L//2, L-3 are
distinct); the heads are the parity fixtures of test_eagle3.py, read with the checkpoint reader.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.decoding.verify import Draft, Verdict
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.loading.drafter import eagle3_drafter

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
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


def test_fixture_heads_fit_the_target_with_its_taps(target):
    assert eagle3_drafter(FIXTURES / "rope_theta", target).feature_layers == (2, 4, 6)
    drafter = eagle3_drafter(FIXTURES / "rope_default", target)
    assert drafter.feature_layers == (2, 3, 4)  # default taps for 7 layers
    assert drafter.params["embed"].shape == (256, 64)


def test_load_drafter_detects_the_family(target, tmp_path):
    for case in ("rope_theta", "rope_default"):
        assert isinstance(specjax.load_drafter(FIXTURES / case, target), Eagle3Drafter)
    draft_dir = save_hf_model(build_hf_model("llama", seed=5, num_hidden_layers=1), tmp_path / "draft")
    assert type(specjax.load_drafter(draft_dir, target)).__name__ == "DraftModelDrafter"


def test_the_target_embedding_is_shared_not_copied(target):
    drafter = eagle3_drafter(FIXTURES / "rope_theta", target)
    assert drafter.params["embed"] is target.params["embed"]


@pytest.mark.parametrize("case, k", [("rope_theta", 3), ("rope_default", 1), ("rope_default", 5)])
def test_greedy_speculative_equals_plain(target, prompts, plain, case, k):
    drafter = eagle3_drafter(FIXTURES / case, target)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=k)
    assert out.tokens == plain.tokens
    assert out.stats["rounds"] > 0


def test_sampled_speculation_runs_and_is_seeded(target, prompts):
    drafter = eagle3_drafter(FIXTURES / "rope_theta", target)
    kw = dict(max_new_tokens=12, eos_token_id=[], drafter=drafter, num_draft_tokens=3, temperature=0.8, seed=3)
    a, b = specjax.generate(target, prompts, **kw), specjax.generate(target, prompts, **kw)
    assert a.tokens == b.tokens and all(len(t) == 12 for t in a.tokens)


def test_update_leaves_the_head_as_a_prefill_of_the_accepted_sequence_would(target):
    """After a round, the head's committed K/V and last hidden equal init over prompt + accepted tokens.

    Features and tokens are synthetic: the round's draft is a fixed sequence and the verdict accepts
    a chosen number of nodes, so the check is about pairing (feature of node i with the token after
    it, the bonus last) and cache positions, independent of what the head would have proposed.
    """
    drafter = eagle3_drafter(FIXTURES / "rope_theta", target)
    cfg = drafter.cfg
    b, p, n, s = 2, 6, 4, 32
    rng = np.random.default_rng(1)
    seq_BL = jnp.asarray(rng.integers(0, 256, size=(b, p + n + 1)), jnp.int32)
    feats = tuple(jnp.asarray(rng.normal(size=(b, p + n, cfg.target_hidden_size)), jnp.float32) for _ in range(3))
    settings = Settings(chain(n - 1), SamplingConfig(), s, 16)
    drafter = drafter.configure(settings)
    params = drafter.params
    lens_B = jnp.full((b,), p, jnp.int32)
    state = drafter.init(params, PrefillContext(seq_BL[:, :p], lens_B, seq_BL[:, p], tuple(f[:, :p] for f in feats)))
    _, state = drafter.propose(params, state, seq_BL[:, p], jax.random.split(jax.random.key(0), b))

    accepted_B = jnp.asarray([3, 1], jnp.int32)  # row 0: root + 2 drafts; row 1: root only
    draft = Draft(seq_BL[:, p:p + n], jnp.broadcast_to(jnp.arange(-1, n - 1), (b, n)), jnp.ones((b, n), bool))
    bonus_B = jnp.take_along_axis(seq_BL, (p + accepted_B)[:, None], axis=1)[:, 0]
    path_BN = jnp.where(jnp.arange(n)[None] < accepted_B[:, None], jnp.arange(n)[None], 0)
    verdict = Verdict(path_BN.astype(jnp.int32), accepted_B, bonus_B)
    cache, last_h = drafter.update(params, state, draft, verdict, tuple(f[:, p:p + n] for f in feats))
    np.testing.assert_array_equal(cache.lengths, p + accepted_B)

    for row in range(b):
        m = p + int(accepted_B[row])
        ctx = PrefillContext(seq_BL[row:row + 1, :m], jnp.asarray([m], jnp.int32), seq_BL[row:row + 1, m],
                             tuple(f[row:row + 1, :m] for f in feats))
        ref_cache, ref_h = drafter.init(params, ctx)
        np.testing.assert_allclose(last_h[row], ref_h[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(cache.k[0][row, :m], ref_cache.k[0][0, :m], atol=1e-5, rtol=0)
        np.testing.assert_allclose(cache.v[0][row, :m], ref_cache.v[0][0, :m], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["rope_theta", "rope_default"])
def test_first_round_drafts_are_the_originals(target, case):
    """init + propose on the fixture's inputs draft what the original head drafts (tokens 1 and 2)."""
    io = np.load(FIXTURES / case / "io.npz")
    drafter = eagle3_drafter(FIXTURES / case, target)  # the target only fixes vocabulary, width and taps here
    drafter = Eagle3Drafter(drafter.cfg, {**drafter.params, "embed": jnp.asarray(io["target_embed"])})
    ids_BT = jnp.asarray(io["ids_BT"])
    b, t = ids_BT.shape
    drafter = drafter.configure(Settings(chain(2), SamplingConfig(), 32, 16))
    feats = tuple(jnp.split(jnp.asarray(io["features_BTF"]), 3, axis=-1))
    # Feature row p pairs with ids_BT[p]: the prompt is any t_0 then ids_BT[:, :-1]; the root is ids_BT[:, -1].
    prompt_BT = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), ids_BT[:, :-1]], axis=1)
    ctx = PrefillContext(prompt_BT, jnp.full((b,), t, jnp.int32), ids_BT[:, -1], feats)
    state = drafter.init(drafter.params, ctx)
    draft, _ = drafter.propose(drafter.params, state, ids_BT[:, -1], jax.random.split(jax.random.key(0), b))
    second_B = np.argmax(io["step2_logits"][:, 0], axis=-1)
    expected_B = second_B + np.asarray(drafter.params["d2t"])[second_B]
    np.testing.assert_array_equal(draft.tokens[:, 1], io["step2_ids"][:, 0])
    np.testing.assert_array_equal(draft.tokens[:, 2], expected_B)
