"""Sampled speculative decoding keeps the target's exact distribution.

A tiny vocabulary (6 tokens) lets us enumerate the exact target distribution of the
first three generated tokens (216 outcomes). Thousands of rows of one generate call are
i.i.d. samples; a chi-square test at the 0.1% level must pass against the target and
must fail against the draft model's own distribution (so the test has power).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.sampling import sampling_probs
from specjax.drafters import DraftModelDrafter
from specjax.models.model import forward, init_params, lm_head, merge
from specjax.models.target import Target

VOCAB, PROMPT, NEW, ROWS = 6, [1, 2, 3], 3, 8192


def tiny(seed: int, layers: int) -> Target:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=128)
    return Target(init_params(cfg, jax.random.key(seed), scale=0.4), cfg, hf_config={})


def exact_distribution(model: Target, sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2, x3 | prompt) for all 216 continuations, as a [6, 6, 6] array."""
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(VOCAB), repeat=NEW - 1)], np.int32)
    cache = merge(model.cfg, model.params).init_cache(len(seqs), 8)  # a KV cache, or a hybrid's
    h, _, _ = forward(model.params, model.cfg, jnp.asarray(seqs), cache, attn_impl="xla")
    p = np.asarray(sampling_probs(lm_head(model.params, model.cfg, h), sampling))  # [36, T, V]
    t = len(PROMPT) - 1
    probs = np.zeros((VOCAB,) * NEW)
    for row, (x1, x2) in zip(p, itertools.product(range(VOCAB), repeat=2)):
        for x3 in range(VOCAB):
            probs[x1, x2, x3] = row[t, x1] * row[t + 1, x2] * row[t + 2, x3]
    return probs


def chi_square_passes(samples: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Chi-square goodness of fit at the 0.1% level (cells with expected count < 5 pooled)."""
    counts = np.zeros(probs.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, probs.shape), 1)
    expected = probs.ravel() * len(samples)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    k = int(keep.sum()) - 1
    threshold = k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3  # Wilson-Hilferty, z(0.999)
    return stat < threshold, stat, threshold


@pytest.fixture(scope="module")
def pair():
    # A target whose first token keeps three candidates under top-k 4 / top-p 0.9, overlapping the draft model's
    # (0.55 of the mass): every case then rejects some drafts and accepts others.
    return tiny(2, layers=2), tiny(7, layers=1)


CASES = [
    ("plain", None, SamplingConfig(1.0)),
    ("chain3", "chain:3", SamplingConfig(1.0)),
    ("tree", "kary:2,2", SamplingConfig(1.0)),
    ("chain2-topk-topp", "chain:2", SamplingConfig(0.8, top_k=4, top_p=0.9)),
]


@pytest.mark.parametrize("name, tree, sampling", CASES, ids=[c[0] for c in CASES])
def test_sampled_output_has_the_target_distribution(pair, name, tree, sampling):
    target, draft = pair
    drafter = None if tree is None else DraftModelDrafter(draft.cfg, draft.params)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p, seed=11, drafter=drafter, tree=tree,
                           eos_token_id=[])
    samples = np.array(out.tokens)
    ok, stat, threshold = chi_square_passes(samples, exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    # Power: the same samples are clearly not from the draft model's distribution.
    ok_draft, stat_draft, _ = chi_square_passes(samples, exact_distribution(draft, sampling))
    assert not ok_draft and stat_draft > 3 * threshold
    if drafter is not None:  # the draft really was different and really was used
        assert out.stats["acceptance_length"] > 1.0


@pytest.fixture(scope="module")
def eagle3_head(pair):
    """A random EAGLE-3 head on the 2-layer target: taps 0, 1, 2 and a reduced draft vocabulary of 5 of the 6 ids."""
    from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from specjax.drafters.eagle3 import init_params as eagle_init

    target, _ = pair
    cfg = Eagle3Config(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=VOCAB,
                       draft_vocab_size=VOCAB - 1, target_hidden_size=32, feature_layers=(0, 1, 2))
    return Eagle3Drafter(cfg, eagle_init(cfg, jax.random.key(3), target.params["embed"]), attn_impl="xla")


@pytest.mark.parametrize("tree", ["chain:3", "kary:2,2", "dynamic:top_k=2,depth=1,total_tokens=4"])
def test_sampled_eagle3_output_has_the_target_distribution(pair, eagle3_head, tree):
    """EAGLE-3 chains are sampled with q over the target vocabulary (0 outside the draft vocabulary); trees are
    deterministic top-k drafts (q one-hot). Either way the output must be the target's distribution."""
    target, _ = pair
    sampling = SamplingConfig(1.0)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=13,
                           drafter=eagle3_head, tree=tree, eos_token_id=[])
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    assert out.stats["acceptance_length"] > 1.0
