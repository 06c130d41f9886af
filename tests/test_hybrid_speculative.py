"""Speculative decoding on a hybrid target (Qwen3.5: Gated DeltaNet + attention): greedy output equals plain
decoding for every family, chains, static and dynamic trees, with EOS and budgets mid-round and a drafter
that is wrong at a chosen depth every round (a wrong rollback of the recurrent state would change the output);
sampled chains and trees keep the target's distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, build_qwen35, save_hf_model
from test_lossless_sampling import NEW, PROMPT, ROWS, VOCAB, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import LinearAttnConfig, ModelConfig, SamplingConfig
from specjax.drafters import DFlashDrafter, DraftModelDrafter, DSparkDrafter, dspark
from specjax.drafters.dflash import BlockConfig, drafter_params
from specjax.drafters.dflash import init_params as dflash_init
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specjax.drafters.eagle3 import init_params as eagle_init
from specjax.drafters.replay import ReplayDrafter, reference_table, tree_replay
from specjax.models.model import init_params
from specjax.models.target import Target

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return specjax.load(save_hf_model(build_qwen35("causal_lm"), tmp_path_factory.mktemp("qwen35")))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A dense random draft model with the same vocabulary: often wrong."""
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1),
                                      tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    assert all(len(set(t)) > MAX_NEW // 2 for t in out.tokens)
    return out


def wrong_at(plain, vocab: int, depth: int, k: int) -> ReplayDrafter:
    """The target's own continuation, with the draft at `depth` (1-based) wrong in every round."""
    rate = np.zeros((1, k), np.float32)
    rate[0, depth - 1] = 1.0
    params = {"reference": jnp.asarray(reference_table(plain.tokens)), "corrupt_prob": jnp.asarray(rate)}
    return ReplayDrafter(vocab, params=params)


def eagle3_head(target):
    """A random EAGLE-3 head whose three taps are DeltaNet layers' inputs and the last layer's output."""
    cfg = Eagle3Config(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256,
                       draft_vocab_size=256, target_hidden_size=64, feature_layers=(1, 2, 4))
    return Eagle3Drafter(cfg, eagle_init(cfg, jax.random.key(3), target.params["embed"]), attn_impl="xla")


def block_cfg(target, taps):
    layers = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, qk_norm=True, family="qwen3")
    return BlockConfig(layers=layers, target_layer_ids=taps, block_size=4, mask_token_id=255)


def dflash_head(target):
    cfg = block_cfg(target, (1, 3))  # a DeltaNet layer's and the attention layer's inputs
    return DFlashDrafter(cfg, drafter_params(dflash_init(cfg, jax.random.key(5)), target.params, False,
                                             per_layer=True), attn_impl="xla")


def dspark_head(target):
    dcfg = dspark.DSparkConfig(block=block_cfg(target, (0, 2)), markov_rank=8, confidence=True)
    return DSparkDrafter(dcfg, dspark.drafter_params(dspark.init_params(dcfg, jax.random.key(1)), {}, per_layer=True),
                         attn_impl="xla")


CASES = [
    ("replay-0.3", "chain:4"), ("wrong-at-2", "chain:4"), ("wrong-at-4", "chain:4"), ("exact", "chain:6"),
    ("ngram", "chain:5"), ("draft-model", "chain:3"), ("draft-model", "kary:3,2"),
    ("draft-model", [[0], [1], [0, 0], [0, 1], [1, 0]]), ("draft-model", "dynamic:top_k=2,depth=3,total_tokens=6"),
    ("tree-replay", "kary:2,2,1"), ("eagle3", "chain:3"), ("eagle3", "kary:2,2"),
    ("eagle3", "dynamic:top_k=2,depth=2,total_tokens=5"), ("dflash", "chain:3"), ("dspark", "chain:4"),
]


def make(name, target, other, plain):
    if name == "replay-0.3":
        return specjax.replay_drafter(plain.tokens, 256, corrupt_prob=0.3)
    if name.startswith("wrong-at-"):
        return wrong_at(plain, 256, int(name.rsplit("-", 1)[1]), 4)
    if name == "exact":
        return specjax.replay_drafter(plain.tokens, 256, corrupt_prob=0.0)
    if name == "ngram":
        return specjax.NgramDrafter(min_n=1, max_n=3)
    if name == "draft-model":
        return DraftModelDrafter(other.cfg, other.params)
    if name == "tree-replay":
        return tree_replay(plain.tokens, 256, alpha=0.6)
    return {"eagle3": eagle3_head, "dflash": dflash_head, "dspark": dspark_head}[name](target)


@pytest.mark.parametrize("name, tree", CASES, ids=[f"{n}-{t if isinstance(t, str) else 'list'}" for n, t in CASES])
def test_greedy_speculative_equals_plain(target, other, prompts, plain, name, tree):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=make(name, target, other, plain), tree=tree)
    assert out.tokens == plain.tokens
    if name == "exact":
        assert out.stats["acceptance_length"] == pytest.approx(39 / 6)  # rounds of 7, the last cut by the budget
    if name.startswith("wrong-at-"):  # every round accepts exactly the drafts before the wrong one
        depth = int(name.rsplit("-", 1)[1])
        assert out.stats["per_position_acceptance"][depth - 1] == 0.0
        assert out.stats["per_position_acceptance"][:depth - 1] == [1.0] * (depth - 1)


def test_eos_and_budgets_mid_round(target, prompts, plain):
    """EOS inside a fully accepted run, and budgets that cut a round: where plain decoding stops."""
    eos = plain.tokens[1][6]
    ref = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos, num_draft_tokens=5,
                           drafter=specjax.replay_drafter(plain.tokens, 256, corrupt_prob=0.0))
    assert out.tokens == ref.tokens and out.tokens[1][-1] == eos
    for max_new in (2, 9):
        ref = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=[])
        out = specjax.generate(target, prompts, max_new_tokens=max_new, eos_token_id=[], tree="kary:2,2",
                               drafter=tree_replay(plain.tokens, 256, alpha=0.7))
        assert out.tokens == ref.tokens


def test_prefix_scheduler_on_a_hybrid_target(target, prompts, plain):
    """The scheduler's narrow widths pad the per-node DeltaNet results back to the full draft."""
    drafter = specjax.replay_drafter(plain.tokens, 256, corrupt_prob=0.4, confidence=True, confidence_noise=0.2)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=6, scheduler="confidence")
    assert out.tokens == plain.tokens
    assert sum(out.stats["verified_width_rounds"].values()) == out.stats["rounds"]


def test_inspect_draft_on_a_hybrid_target(target, other, prompts):
    ins = specjax.inspect_draft(target, DraftModelDrafter(other.cfg, other.params), prompts[1], num_draft_tokens=3)
    assert ins.tokens.shape == (3,) and ins.root == specjax.generate(target, prompts[1:2], max_new_tokens=1).tokens[0][0]


# ---- losslessness of sampling ------------------------------------------------------------------------------------


def tiny_hybrid(seed: int) -> Target:
    """A 6-token hybrid target: a DeltaNet layer then an attention layer."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, qk_norm=True, family="qwen3_5",
                      layer_types=("linear_attention", "full_attention"),
                      linear=LinearAttnConfig(1, 2, 8, 8), partial_rotary_factor=0.5, attn_output_gate=True,
                      norm_offset=True)
    return Target(init_params(cfg, jax.random.key(seed), scale=0.4), cfg, hf_config={})


# A tree at temperature 1 and a chain through top-k and top-p (a node with one child verifies as a chain does).
@pytest.mark.parametrize("tree, sampling", [("kary:2,2", SamplingConfig(1.0)),
                                            ("chain:2", SamplingConfig(0.8, top_k=4, top_p=0.9))])
def test_sampled_output_has_the_target_distribution(tree, sampling):
    target, draft = tiny_hybrid(5), tiny(7, layers=1)  # seed 5: 0.71 of the top-k/top-p mass shared
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p, seed=11, tree=tree, eos_token_id=[],
                           drafter=DraftModelDrafter(draft.cfg, draft.params))
    samples = np.array(out.tokens)
    ok, stat, threshold = chi_square_passes(samples, exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    ok_draft, stat_draft, _ = chi_square_passes(samples, exact_distribution(draft, sampling))
    assert not ok_draft and stat_draft > 3 * threshold  # the test has power
    assert out.stats["acceptance_length"] > 1.0


def test_tiny_hybrid_is_not_degenerate():
    """The sampled test's target spreads its mass (else any sampler would pass)."""
    probs = exact_distribution(tiny_hybrid(5), SamplingConfig(1.0))
    assert probs.max() < 0.2 and np.isclose(probs.sum(), 1.0)
