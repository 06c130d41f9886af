"""Per-request sampling as data: one batch mixes greedy and sampled rows, new values never recompile, and the
checkpoint's generation_config.json sets the defaults as transformers applies them."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from test_lossless_sampling import NEW, PROMPT, ROWS, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import SamplingConfig
from specjax.drafters import DraftModelDrafter

PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
MIXED = dict(temperature=[0.0, 0.8, 0.0, 1.2], top_k=[0, 20, 0, 0], top_p=[1.0, 0.9, 1.0, 0.95],
             min_p=[0.0, 0.0, 0.0, 0.05], seed=[11, 12, 13, 14])


@pytest.fixture(scope="module")
def target():
    return specjax.load(specjax.embedded("target"))


@pytest.fixture(scope="module")
def draft(target):
    return specjax.load_drafter(specjax.embedded("draft"), target)


def alone(i: int) -> dict:
    return {k: [v[i]] for k, v in MIXED.items()}


@pytest.mark.parametrize("shape", [None, {"num_draft_tokens": 3}, {"tree": "kary:2,2"}])
def test_a_mixed_batch_equals_each_prompt_run_alone(target, draft, shape):
    kw = {} if shape is None else {"drafter": draft, **shape}
    mixed = specjax.generate(target, PROMPTS, max_new_tokens=24, **MIXED, **kw)
    for i, prompt in enumerate(PROMPTS):
        single = specjax.generate(target, [prompt], max_new_tokens=24, **alone(i), **kw)
        assert single.tokens[0] == mixed.tokens[i], i
    greedy = specjax.generate(target, PROMPTS, max_new_tokens=24)
    assert mixed.tokens[0] == greedy.tokens[0] and mixed.tokens[2] == greedy.tokens[2]
    assert mixed.tokens[1] != greedy.tokens[1] or mixed.tokens[3] != greedy.tokens[3]


@pytest.mark.parametrize("shape", [None, {"num_draft_tokens": 3}])
def test_new_values_reuse_the_compiled_loop(target, draft, shape, caplog):
    kw = {} if shape is None else {"drafter": draft, **shape}
    specjax.generate(target, PROMPTS, max_new_tokens=16, **MIXED, **kw)  # compiled here
    other = dict(temperature=[0.3, 0.0, 1.5, 0.7], top_k=[5, 0, 100, 300], top_p=[0.5, 1.0, 0.99, 1.0],
                 min_p=[0.1, 0.0, 0.0, 0.2], seed=[1, 2, 3, 4], repetition_penalty=1.0)
    import jax
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        out = specjax.generate(target, PROMPTS, max_new_tokens=16, **other, **kw)
    assert out.stats["compile_s"] == 0.0
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]


def test_a_sampled_row_in_a_mixed_batch_keeps_the_target_distribution():
    """Even rows greedy, odd rows sampled at temperature 1 with their own seeds: the sampled rows are exact samples
    of the target (chi-square), the greedy ones all the argmax path, with and without a drafter."""
    target, draft = tiny(2, layers=2), tiny(7, layers=1)
    probs = exact_distribution(target, SamplingConfig(1.0))
    temps = [0.0, 1.0] * (ROWS // 2)
    greedy = specjax.generate(target, [PROMPT], max_new_tokens=NEW, eos_token_id=[]).tokens[0]
    for kw in ({}, {"drafter": DraftModelDrafter(draft.cfg, draft.params), "tree": "chain:2"}):
        out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=temps, seed=5,
                               eos_token_id=[], **kw)
        tokens = np.array(out.tokens)
        assert (tokens[0::2] == greedy).all()
        ok, stat, threshold = chi_square_passes(tokens[1::2], probs)
        assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"


def test_per_prompt_values_are_checked(target):
    with pytest.raises(ValueError, match="temperature has 2 values for 4 prompts"):
        specjax.generate(target, PROMPTS, temperature=[0.5, 0.5])
    with pytest.raises(ValueError, match="top_p must be in"):
        specjax.generate(target, PROMPTS, temperature=1.0, top_p=[1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="min_p must be in"):
        specjax.generate(target, PROMPTS, temperature=1.0, min_p=2.0)
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        specjax.generate(target, PROMPTS, repetition_penalty=0.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        specjax.generate(target, PROMPTS, temprature=1.0)


def test_generation_config_sets_the_defaults(tmp_path):
    """do_sample true: its temperature / top_p, and transformers' top_k 50 where it gives none; its
    repetition_penalty; the call's own values win. do_sample absent: greedy."""
    from hf_tiny import build_hf_model, save_hf_model

    path = save_hf_model(build_hf_model("qwen2", seed=4, vocab_size=128, num_hidden_layers=2), tmp_path / "m")
    prompts = [[5, 6, 7], [9, 10]]
    plain = specjax.load(path)
    greedy = specjax.generate(plain, prompts, max_new_tokens=12, eos_token_id=[])
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                "repetition_penalty": 1.1}))
    instruct = specjax.load(path)
    default = specjax.generate(instruct, prompts, max_new_tokens=12, eos_token_id=[], seed=3)
    explicit = specjax.generate(plain, prompts, max_new_tokens=12, eos_token_id=[], seed=3, temperature=0.6,
                                top_k=50, top_p=0.9, repetition_penalty=1.1)
    assert default.tokens == explicit.tokens and default.tokens != greedy.tokens
    overridden = specjax.generate(instruct, prompts, max_new_tokens=12, eos_token_id=[], temperature=0.0,
                                  repetition_penalty=1.0)
    assert overridden.tokens == greedy.tokens
