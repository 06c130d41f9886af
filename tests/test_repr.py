"""Notebook manners: `print(target)` and `print(drafter)` show one short line of facts, never weight arrays."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.drafters import DraftModelDrafter, NgramDrafter, replay_drafter
from specjax.models.target import format_count

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
ARRAY_DUMPS = ("Array(", "array(", "Tokenizer", "dtype=float32)", "[[", "...")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(build_hf_model("llama", **SMALL), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def target(hf_dir):
    return specjax.load(hf_dir, attn_impl="xla")


def assert_one_short_line(text: str, *facts: str) -> None:
    assert "\n" not in text, text
    assert len(text) < 200, text
    for dump in ARRAY_DUMPS:
        assert dump not in text, text
    for fact in facts:
        assert fact in text, text


def test_target_repr(target, hf_dir, capsys):
    params = format_count(target.cfg.num_params())
    print(target)
    shown = capsys.readouterr().out.strip()
    assert shown == repr(target)
    assert_one_short_line(shown, "Target(", "family=llama", f"params={params}", "dtype=float32", "vocab=128",
                          "layers=2", "attn_impl=xla", f"path='{hf_dir}'")


def test_target_repr_without_path(target):
    bare = specjax.Target(target.params, target.cfg, target.hf_config)
    assert_one_short_line(repr(bare), "family=llama", "layers=2")
    assert "path" not in repr(bare)


def test_bf16_target_repr_says_bf16(hf_dir):
    assert "dtype=bfloat16" in repr(specjax.load(hf_dir, dtype="bfloat16"))


def test_embedded_target_repr_counts_params():
    from specjax.demo import EMBEDDED

    if not (EMBEDDED / "target" / "config.json").is_file():
        pytest.skip("no embedded checkpoint in this checkout")
    assert "params=3.95M" in repr(specjax.load(EMBEDDED / "target"))


def test_draft_model_repr(target, tmp_path):
    draft_dir = save_hf_model(build_hf_model("llama", **{**SMALL, "num_hidden_layers": 1}), tmp_path / "draft")
    drafter = specjax.load_drafter(draft_dir, target)
    assert isinstance(drafter, DraftModelDrafter)
    assert_one_short_line(repr(drafter), "DraftModelDrafter(", "family=llama",
                          f"params={format_count(drafter.cfg.num_params())}", "dtype=float32", "vocab=128",
                          "layers=1", "attn_impl=xla")


def test_ngram_repr():
    assert repr(NgramDrafter()) == "NgramDrafter(min_n=1, max_n=3)"
    assert_one_short_line(repr(NgramDrafter(min_n=2, max_n=5)), "min_n=2", "max_n=5")


def test_replay_repr():
    drafter = replay_drafter([[5, 6, 7, 8], [9, 10]], vocab_size=128, corrupt_prob=0.25)
    rows, width = drafter.params["reference"].shape
    assert_one_short_line(repr(drafter), "ReplayDrafter(", "vocab=128", f"rows={rows}", f"width={width}",
                          "corrupt_prob=0.25")


@pytest.mark.parametrize("n, text", [(0, "0"), (999, "999"), (1_000, "1K"), (999_600, "1M"), (3_949_056, "3.95M"),
                                     (12_345_678, "12.3M"), (7_615_616_512, "7.62B")])
def test_format_count(n, text):
    assert format_count(n) == text
