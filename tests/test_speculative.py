"""The speculative loop: greedy equality with plain decoding for every drafter, chain and tree;
tau = K + 1 when the drafter is the target; EOS inside an accepted run; clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.drafters import DraftModelDrafter

from hf_tiny import build_hf_model, save_hf_model

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return specjax.load(save_hf_model(build_hf_model("llama", seed=0), tmp_path_factory.mktemp("target")))


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
    for p, lo, hi in [(0.0, 4.9, 5.01), (1.0, 1.0, 1.0)]:
        drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, corrupt_prob=p)
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                               num_draft_tokens=4)
        assert out.tokens == plain.tokens
        assert lo <= out.stats["acceptance_length"] <= hi


@pytest.mark.parametrize("k", [1, 3, 6])
def test_self_drafting_accepts_everything(target, prompts, plain, k):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=DraftModelDrafter(target.cfg, target.params), num_draft_tokens=k)
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] == k + 1
    assert out.stats["per_position_acceptance"] == [1.0] * k
    assert out.stats["drafter_calls"] == out.stats["rounds"] * k


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
    with pytest.raises(ValueError, match="draft slots"):
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
