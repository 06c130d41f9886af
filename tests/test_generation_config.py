"""generation_config.json's EOS ids: Instruct models list their end-of-turn ids there, not in config.json.

transformers' `generate` stops at the generation config's `eos_token_id` (loaded from
generation_config.json, replacing config.json's), so specjax must stop at the same tokens,
whether it loads the Hugging Face directory or a checkpoint converted from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, save_hf_model

import specjax

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
CONFIG_EOS = 2  # hf_tiny's config.json eos_token_id
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("qwen2", **SMALL)  # varied greedy continuations (tiny tied llama repeats one token)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, SMALL["vocab_size"], size=n).tolist() for n in (4, 9, 6)]


@pytest.fixture(scope="module")
def end_of_turn(hf_model, prompts, tmp_path_factory) -> int:
    """A token the first prompt's greedy continuation first reaches at step 4 or later: this test's end-of-turn id."""
    plain = specjax.load(save_hf_model(hf_model, tmp_path_factory.mktemp("plain")))
    row = specjax.generate(plain, prompts, max_new_tokens=MAX_NEW, eos_token_id=[]).tokens[0]
    assert CONFIG_EOS not in row
    return next(tok for i, tok in enumerate(row) if i >= 3 and tok not in row[:i])


def with_generation_config(hf_model, path: Path, **fields) -> Path:
    """Save the model, then set fields of its generation_config.json (as an Instruct release ships it)."""
    save_hf_model(hf_model, path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))
    return path


def transformers_tokens(path: Path, prompt: list[int]) -> list[int]:
    """Greedy continuation by transformers' own generate, with its own reading of the directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_generation_config_eos_stops_where_transformers_stops(hf_model, prompts, end_of_turn, tmp_path):
    path = with_generation_config(hf_model, tmp_path / "hf", eos_token_id=[CONFIG_EOS, end_of_turn])
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == CONFIG_EOS
    target = specjax.load(path)
    assert target.cfg.eos_token_ids == (CONFIG_EOS, end_of_turn)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW)
    for prompt, got in zip(prompts, out.tokens):
        assert got == transformers_tokens(path, prompt)
    assert out.tokens[0][-1] == end_of_turn and len(out.tokens[0]) < MAX_NEW

    # A converted checkpoint carries generation_config.json and stops at the same place.
    converted = specjax.load(specjax.convert(path, tmp_path / "ckpt"))
    assert converted.cfg.eos_token_ids == (CONFIG_EOS, end_of_turn)
    assert specjax.generate(converted, prompts, max_new_tokens=MAX_NEW).tokens == out.tokens


def test_a_single_int_replaces_config_eos(hf_model, end_of_turn, tmp_path):
    path = with_generation_config(hf_model, tmp_path / "hf", eos_token_id=end_of_turn)
    assert specjax.load(path).cfg.eos_token_ids == (end_of_turn,)


def test_without_eos_in_generation_config_config_eos_stays(hf_model, tmp_path):
    path = with_generation_config(hf_model, tmp_path / "hf")
    assert "eos_token_id" not in json.loads((path / "generation_config.json").read_text())
    assert specjax.load(path).cfg.eos_token_ids == (CONFIG_EOS,)
    (path / "generation_config.json").unlink()
    assert specjax.load(path).cfg.eos_token_ids == (CONFIG_EOS,)


def test_explicit_eos_argument_still_wins(hf_model, prompts, end_of_turn, tmp_path):
    target = specjax.load(with_generation_config(hf_model, tmp_path / "hf", eos_token_id=[end_of_turn]))
    out = specjax.generate(target, prompts[:1], max_new_tokens=MAX_NEW, eos_token_id=[])
    assert len(out.tokens[0]) == MAX_NEW


@pytest.mark.parametrize("contents", ['{"eos_token_id": [2, ', '[2, 3]', '{"eos_token_id": "2"}',
                                      '{"eos_token_id": [2, -1]}'])
def test_bad_generation_config_names_the_file(hf_model, tmp_path, contents):
    path = save_hf_model(hf_model, tmp_path / "hf")
    (path / "generation_config.json").write_text(contents)
    with pytest.raises(ValueError, match=r"generation_config\.json: "):
        specjax.load(path)
