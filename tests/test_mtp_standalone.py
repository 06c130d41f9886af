"""Standalone MTP repositories (`model_type: qwen3_5_mtp`, `mtp.` stripped, norms stored as 1 + w, {"format": "mlx"}).

tests/fixtures/mtp_standalone/qwen3_5 was written by mlx-vlm's own splitter (scripts/make_mtp_standalone_fixtures.py;
commit in meta.json) from tests/fixtures/mtp/qwen3_5, the tiny Qwen3.5 hybrid target whose in-checkpoint MTP layer
test_mtp.py checks against vLLM. Loaded on that target, the repository must give the same MTP layers and decode
losslessly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specjax
from specjax.drafters import MtpDrafter

FIXTURES = Path(__file__).parent / "fixtures"
SPLIT = FIXTURES / "mtp_standalone" / "qwen3_5"


@pytest.fixture(scope="module")
def target():
    return specjax.load(FIXTURES / "mtp" / "qwen3_5")


def test_the_split_repository_is_the_targets_own_mtp(target):
    drafter = specjax.load_drafter(SPLIT, target)
    assert isinstance(drafter, MtpDrafter)
    own = specjax.load_drafter(FIXTURES / "mtp" / "qwen3_5", target)  # the mtp.* tensors inside the target
    # norms went through 1 + w in fp32 and back: equal to an ulp of 1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-7),
                 drafter.params, own.params)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, target.cfg.vocab_size, size=n).tolist() for n in (4, 11)]
    plain = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    out = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[], drafter=drafter, num_draft_tokens=2)
    assert out.tokens == plain.tokens and out.stats["rounds"] > 0


def test_without_the_mlx_marker_or_for_another_target_it_is_refused(target, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(SPLIT, head)
    tensors = load_file(head / "model.safetensors")
    save_file(tensors, str(head / "model.safetensors"))  # no metadata
    with pytest.raises(ValueError, match=r"lack the metadata \{'format': 'mlx'\}.*refuses to guess"):
        specjax.load_drafter(head, target)
    config = json.loads((SPLIT / "config.json").read_text())
    config["text_config"]["hidden_size"] = 2 * config["text_config"]["hidden_size"]
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"split from another target: hidden_size"):
        specjax.load_drafter(head, target)
