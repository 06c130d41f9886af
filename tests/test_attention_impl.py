"""The model's attention is switchable: the Pallas kernel (interpret mode on CPU) and the XLA
reference give identical greedy tokens through the plain and the speculative loop."""

import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.drafters import DraftModelDrafter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(build_hf_model("qwen3", seed=3, num_hidden_layers=2), tmp_path_factory.mktemp("m"))


def test_pallas_and_xla_give_identical_greedy_tokens(model_dir):
    prompts = [np.random.default_rng(0).integers(3, 256, size=n).tolist() for n in (3, 11)]
    runs = {}
    for impl in ("xla", "pallas"):
        target = specjax.load(model_dir, attn_impl=impl)
        drafter = DraftModelDrafter(target.cfg, target.params, attn_impl=impl)
        runs[impl] = (
            specjax.generate(target, prompts, max_new_tokens=10, eos_token_id=[]).tokens,
            specjax.generate(target, prompts, max_new_tokens=10, eos_token_id=[], drafter=drafter,
                             tree="kary:2,1").tokens,
        )
    assert runs["pallas"] == runs["xla"]
    assert runs["xla"][0] == runs["xla"][1]


def test_unknown_attention_impl_is_refused(model_dir):
    with pytest.raises(ValueError, match="attn_impl"):
        specjax.load(model_dir, attn_impl="flash")


def test_pallas_equals_xla_when_prompts_and_drafts_reach_the_end_of_the_cache(model_dir):
    """The issue's case (40-token prompt, 6 new tokens, max_len 48: the padded prompt bucket of 64 used to
    overrun a 48-slot cache), and a long row whose last drafts land on the cache's last slots."""
    rng = np.random.default_rng(1)
    cases = [([rng.integers(3, 256, size=40).tolist()], 6, 48, None),
             ([rng.integers(3, 256, size=n).tolist() for n in (100, 37)], 22, 128, 4)]
    for prompts, new, max_len, k in cases:
        outs = {}
        for impl in ("xla", "pallas"):
            target = specjax.load(model_dir, attn_impl=impl)
            kwargs = dict(max_new_tokens=new, eos_token_id=[], max_len=max_len)
            if k:
                kwargs |= dict(drafter=DraftModelDrafter(target.cfg, target.params, attn_impl=impl),
                               num_draft_tokens=k)
            out = specjax.generate(target, prompts, **kwargs)
            assert out.stats["cache_len"] == 128
            outs[impl] = out.tokens
        assert outs["pallas"] == outs["xla"]
