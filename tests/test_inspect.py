"""`specjax.inspect_draft`: the first round's draft, with the logits each token was chosen from."""

from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.drafters import DraftModelDrafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = build_hf_model("llama", seed=0, tie_word_embeddings=False)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("inspect")))


PROMPT = [5, 17, 101, 44, 9]


def test_self_drafted_chain_is_the_greedy_continuation(target):
    plain = specjax.generate(target, [PROMPT], max_new_tokens=5, eos_token_id=[]).tokens[0]
    out = specjax.inspect_draft(target, DraftModelDrafter(target.cfg, target.params), PROMPT, num_draft_tokens=4)
    assert out.root == plain[0] and out.tokens.tolist() == plain[1:]
    assert out.logits.shape == (4, target.cfg.vocab_size)
    np.testing.assert_array_equal(out.logits.argmax(-1), out.tokens)
    assert out.confidence is None
    assert out.tree_tokens.tolist() == plain and out.tree_parents.tolist() == [-1, 0, 1, 2, 3]


def test_logits_are_the_drafters_own(target, tmp_path):
    """The logits come from the draft model (not the target): its greedy choices, step by step."""
    other = specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1), tmp_path))
    out = specjax.inspect_draft(target, DraftModelDrafter(other.cfg, other.params), PROMPT, num_draft_tokens=3)
    seq = PROMPT + [out.root]
    for i in range(3):
        want = specjax.generate(other, [seq], max_new_tokens=1, eos_token_id=[]).tokens[0][0]
        assert out.tokens[i] == want == int(out.logits[i].argmax())
        seq = seq + [want]


def test_tree_and_model_free_drafters(target):
    out = specjax.inspect_draft(target, DraftModelDrafter(target.cfg, target.params), PROMPT, tree="kary:2,1")
    assert out.tree_parents.tolist() == [-1, 0, 0, 1, 2] and len(out.tree_tokens) == 5
    ngram = specjax.inspect_draft(target, specjax.NgramDrafter(), PROMPT * 3, num_draft_tokens=3)
    assert ngram.logits is None and len(ngram.tokens) == 3
    with pytest.raises(ValueError, match="not both"):
        specjax.inspect_draft(target, specjax.NgramDrafter(), PROMPT, num_draft_tokens=3, tree="chain:3")


def test_feature_heads_record_target_vocabulary_logits(tmp_path):
    """EAGLE-3 (reduced draft vocabulary: -inf outside it) and MTP give the logits their drafts came from."""
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures"
    target = specjax.load(save_hf_model(build_hf_model("llama", seed=2, num_hidden_layers=7,
                                                       tie_word_embeddings=False), tmp_path / "t7"))
    eagle = specjax.load_drafter(fixtures / "eagle3" / "rope_theta", target)
    out = specjax.inspect_draft(target, eagle, PROMPT, num_draft_tokens=3)
    assert out.logits.shape == (3, target.cfg.vocab_size)
    np.testing.assert_array_equal(out.logits.argmax(-1), out.tokens)
    in_draft_vocab = np.isfinite(out.logits[0])
    assert in_draft_vocab.sum() == eagle.cfg.draft_vocab_size
