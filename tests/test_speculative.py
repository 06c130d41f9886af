"""The speculative loop: greedy equality with plain decoding for every drafter, chain and tree;
tau = K + 1 when the drafter is the target; EOS inside an accepted run; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.drafters import DraftModelDrafter

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # Untied: with random tied embeddings a token's own embedding dominates its logits and greedy decoding
    # repeats one token forever, which would make every equality below trivial.
    # Per-layer, what "auto" runs on a CPU (the suite's default elsewhere is the stacked layout: conftest.py).
    model = build_hf_model("llama", seed=0, tie_word_embeddings=False)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("target")), layout="per_layer")


def test_target_output_is_not_degenerate(plain):
    assert all(len(set(t)) > len(t) // 2 for t in plain.tokens)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A different random model with the same vocabulary: a draft model that is often wrong."""
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1),
                                      tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def drafters(target, other_model):
    return {
        "self": DraftModelDrafter(target.cfg, target.params),
        "other": DraftModelDrafter(other_model.cfg, other_model.params),
        "ngram": specjax.NgramDrafter(min_n=1, max_n=3),
    }


@pytest.mark.parametrize("name, tree", [
    ("self", "chain:4"), ("other", "chain:3"), ("other", "kary:3,2"), ("self", "kary:2,2,1"),
    ("ngram", "chain:5"), ("other", [[0], [1], [0, 0], [0, 1], [1, 0]]),
])
def test_greedy_speculative_equals_plain(target, other_model, prompts, plain, name, tree):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=drafters(target, other_model)[name], tree=tree)
    assert out.tokens == plain.tokens
    assert 1.0 <= out.stats["acceptance_length"]


def test_replay_drafter_is_lossless_and_controls_acceptance(target, prompts, plain):
    # 39 tokens after prefill's: 7 rounds of 5 and a last round cut to 4 by the budget.
    for p, tau in [(0.0, 39 / 8), (1.0, 1.0)]:
        drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, corrupt_prob=p)
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                               num_draft_tokens=4)
        assert out.tokens == plain.tokens
        assert out.stats["acceptance_length"] == pytest.approx(tau)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_self_drafting_accepts_everything(target, prompts, plain, k):
    new = 29  # 1 + 28: every round emits exactly k + 1 tokens for k + 1 in (2, 4, 7)
    out = specjax.generate(target, prompts, max_new_tokens=new, eos_token_id=[],
                           drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=k)
    assert out.tokens == [t[:new] for t in plain.tokens]
    assert out.stats["acceptance_length"] == k + 1
    assert out.stats["per_position_acceptance"] == [1.0] * k
    assert out.stats["drafter_calls"] == out.stats["rounds"] * k
    assert out.stats["offered_at_depth"] == out.stats["accepted_at_depth"] == [28 // (k + 1) * 3] * k
    assert out.stats["verified_tokens_per_round"] == 3 * (k + 1)  # three active rows in every round
    assert out.stats["padded_tokens_per_round"] == 4 * (k + 1)  # the batch bucket of 3 is 4


def test_self_drafting_tree_reaches_max_depth_every_round(target, prompts, plain):
    """Drafter = target with kary:2,2,1: the rank-0 path is the target's greedy path, so tau = max depth + 1."""
    new = 1 + 4 * 7
    out = specjax.generate(target, prompts, max_new_tokens=new, eos_token_id=[],
                           drafter=DraftModelDrafter(target.cfg, target.params), tree="kary:2,2,1")
    assert out.tokens == [t[:new] for t in plain.tokens]
    assert out.stats["acceptance_length"] == 4.0
    rounds = 7 * 3
    assert out.stats["offered_at_depth"] == [2 * rounds, 4 * rounds, 4 * rounds]
    assert out.stats["accepted_at_depth"] == [rounds] * 3
    ranks = np.asarray(out.stats["accepted_child_rank"])
    assert ranks[:, 0].tolist() == [rounds] * 3 and ranks[:, 1:].sum() == 0


def test_drafts_cut_by_the_budget_are_not_counted(target, prompts):
    """A row that emits 4 tokens (1 at prefill, 3 in one round of 6 accepted drafts) reports tau 3, not 7."""
    out = specjax.generate(target, prompts[:1], max_new_tokens=4, eos_token_id=[],
                           drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=6)
    assert len(out.tokens[0]) == 4 and out.stats["rounds"] == 1
    assert out.stats["acceptance_length"] == 3.0
    assert out.stats["accepted_drafts"] == 3
    # ... while verification accepted all 6: the planner's acceptance estimator counts those.
    assert np.asarray(out.stats["accepted_child_rank"])[:, 0].tolist() == [1, 1, 1, 0, 0, 0]
    assert np.asarray(out.stats["verified_child_rank"])[:, 0].tolist() == [1] * 6
    assert out.stats["per_position_acceptance"] == [1, 1, 1, 0, 0, 0]


def test_drafts_after_eos_are_not_counted(other_model, prompts):
    """EOS at output index j (1 <= j <= 6) falls inside the first round of a fully accepted chain of 6.
    (other_model: the llama target repeats one token, so no EOS could sit mid-round there.)"""
    plain = specjax.generate(other_model, prompts, max_new_tokens=8, eos_token_id=[])
    i, j = next((i, j) for i, row in enumerate(plain.tokens) for j in range(1, 7) if row[j] not in row[:j])
    row = plain.tokens[i]
    out = specjax.generate(other_model, prompts[i: i + 1], max_new_tokens=MAX_NEW, eos_token_id=row[j],
                           drafter=DraftModelDrafter(other_model.cfg, other_model.params), num_draft_tokens=6)
    assert out.tokens[0] == row[: j + 1]
    assert out.stats["acceptance_length"] == j and out.stats["accepted_drafts"] == j


def test_eos_inside_an_accepted_run_stops_where_plain_decoding_does(target, prompts, plain):
    """With the target as its own drafter every draft is accepted, so the EOS falls mid-run."""
    eos = plain.tokens[1][6]
    ref = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos,
                           drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=4)
    assert out.tokens == ref.tokens
    assert out.tokens[1][-1] == eos and len(out.tokens[1]) <= 7


def test_budget_cuts_mid_run(target, prompts):
    for max_new in (1, 2, 7):
        ref = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=[])
        out = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=[],
                               drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=4)
        assert out.tokens == ref.tokens and all(len(t) == max_new for t in out.tokens)


def test_second_call_does_not_recompile(target, other_model, prompts):
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    specjax.generate(target, prompts, max_new_tokens=MAX_NEW, drafter=drafter, num_draft_tokens=3)
    before = len(target.compiled)
    out = specjax.generate(target, [p[::-1] for p in prompts], max_new_tokens=MAX_NEW - 3, drafter=drafter,
                           num_draft_tokens=3)
    assert out.stats["compile_s"] == 0.0 and len(target.compiled) == before


def test_sampled_speculation_is_seeded(target, other_model, prompts):
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    run = lambda seed: specjax.generate(target, prompts, max_new_tokens=20, temperature=8.0, seed=seed,
                                        drafter=drafter, num_draft_tokens=3).tokens
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_mismatched_vocabulary_is_refused(target, tmp_path):
    small = specjax.load(save_hf_model(build_hf_model("llama", vocab_size=200), tmp_path / "small"))
    with pytest.raises(ValueError, match="vocab"):
        specjax.load_drafter(tmp_path / "small", target)
    with pytest.raises(ValueError, match="vocabulary"):
        specjax.generate(target, [[5, 6]], max_new_tokens=4, drafter=DraftModelDrafter(small.cfg, small.params))


def test_mismatched_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    for name, order in (("t", 1), ("d", -1)):
        save_hf_model(build_hf_model("llama"), tmp_path / name)
        words = [f"w{i}" for i in range(256)][::order]
        Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")).save(
            str(tmp_path / name / "tokenizer.json"))
    with pytest.raises(ValueError, match="different tokenizer"):
        specjax.load_drafter(tmp_path / "d", specjax.load(tmp_path / "t"))


def test_draft_that_cannot_fit_the_cache_is_refused(target):
    with pytest.raises(ValueError, match="draft of 9 nodes"):
        specjax.generate(target, [[5] * 10], max_new_tokens=10, max_len=24,
                         drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=8)


def test_unknown_tree_and_tree_for_chain_only_drafters_are_refused(target):
    with pytest.raises(ValueError, match="unknown tree spec"):
        specjax.generate(target, [[5, 6]], max_new_tokens=4, drafter=specjax.NgramDrafter(), tree="spiral")
    with pytest.raises(ValueError, match="chains only"):
        specjax.generate(target, [[5, 6]], max_new_tokens=4, drafter=specjax.NgramDrafter(), tree="kary:2")


def test_sampled_rows_do_not_depend_on_the_batch(target, other_model, prompts):
    """Per-row random keys: a prompt samples the same tokens alone or inside a ragged batch."""
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    for kwargs in ({}, {"drafter": drafter, "num_draft_tokens": 3}):
        batch = specjax.generate(target, prompts, max_new_tokens=16, temperature=8.0, seed=5, **kwargs).tokens
        alone = specjax.generate(target, prompts[:1], max_new_tokens=16, temperature=8.0, seed=5, **kwargs).tokens
        assert alone[0] == batch[0]


def test_same_prompt_with_the_same_seed_samples_the_same_tokens_at_every_row(target, other_model, prompts):
    """seed=[...]: one seed per prompt, so a prompt's draws do not depend on its row or the batch around it."""
    drafter = DraftModelDrafter(other_model.cfg, other_model.params)
    p = prompts[0]
    for kwargs in ({}, {"drafter": drafter, "num_draft_tokens": 3}):
        run = lambda batch, seeds: specjax.generate(target, batch, max_new_tokens=16, temperature=8.0, seed=seeds,
                                                    eos_token_id=[], **kwargs).tokens
        alone = run([p], [9])[0]
        rows = [prompts[1], p, prompts[2], p, p]
        batch = run(rows, [1, 9, 2, 9, 9])
        assert batch[1] == batch[3] == batch[4] == alone
        one_seed = run(rows, 9)  # one int seed: the same prompt's rows differ (folded by row index)
        assert one_seed[1] != one_seed[3] and one_seed[3] != one_seed[4]


def test_seed_none_draws_fresh_randomness_and_reports_it(target, prompts):
    kwargs = dict(max_new_tokens=16, temperature=8.0, eos_token_id=[])
    a = specjax.generate(target, prompts, seed=None, **kwargs)
    b = specjax.generate(target, prompts, seed=None, **kwargs)
    assert a.tokens != b.tokens and a.stats["seed"] != b.stats["seed"]
    assert len(a.stats["seed"]) == len(prompts)
    assert specjax.generate(target, prompts, seed=a.stats["seed"], **kwargs).tokens == a.tokens


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), ([1, 2], ValueError)])
def test_bad_seeds_are_refused(target, prompts, seed, error):
    with pytest.raises(error, match="seed"):  # a wrong type is a TypeError (SamplingParams' rule), a bad value not
        specjax.generate(target, prompts, max_new_tokens=4, temperature=1.0, seed=seed)


def test_drafters_with_different_param_shapes_compile_separately(target, prompts, plain):
    """The compile key includes the params' structure and shapes: two replay widths in one bucket both run."""
    for width in (MAX_NEW, MAX_NEW - 7):
        drafter = specjax.replay_drafter([t[:width] for t in plain.tokens], target.cfg.vocab_size, 0.0)
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                               num_draft_tokens=4)
        assert out.tokens == plain.tokens


def test_draft_shape_arguments_are_checked(target, prompts):
    drafter = DraftModelDrafter(target.cfg, target.params)
    with pytest.raises(ValueError, match="not both"):
        specjax.generate(target, prompts, max_new_tokens=4, drafter=drafter, num_draft_tokens=3, tree="kary:2,1")
    for kwargs in ({"num_draft_tokens": 3}, {"tree": "kary:2,1"}):
        with pytest.raises(ValueError, match="no drafter"):
            specjax.generate(target, prompts, max_new_tokens=4, **kwargs)
