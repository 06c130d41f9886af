"""Logprobs and penalties against transformers and against plain decoding, with and without a drafter.

Logprobs are the target's raw distribution (log-softmax of its logits, vLLM's raw_logprobs) at every emitted
token: equal to transformers' own forward over prompt + output, and the same whether a drafter is used. Penalties
follow vLLM; in verification each draft node sees the counts of its own path, so greedy speculative output equals
plain decoding with the same penalties, repetition_penalty equals transformers' generate, and sampled output keeps
the penalised distribution (chi-square on a 6-token model, exact distribution enumerated).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, hf_logits, save_hf_model
from test_lossless_sampling import NEW, PROMPT, ROWS, VOCAB, chi_square_passes, tiny

import specjax
from specjax.config import PenaltyConfig
from specjax.decoding.penalties import RowPenalties, TokenCounts, penalise, penalise_tree
from specjax.drafters import DraftModelDrafter
from specjax.models.model import forward, lm_head


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("qwen2", seed=3, vocab_size=128, num_hidden_layers=2)


@pytest.fixture(scope="module")
def target(hf_model, tmp_path_factory):
    return specjax.load(save_hf_model(hf_model, tmp_path_factory.mktemp("lp")), dtype="float32")


@pytest.fixture(scope="module")
def other(target, tmp_path_factory):
    """A draft model that disagrees with the target often (random weights of another seed)."""
    path = save_hf_model(build_hf_model("qwen2", seed=9, vocab_size=128, num_hidden_layers=1),
                         tmp_path_factory.mktemp("other"))
    return specjax.load_drafter(path, target)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 128, size=n).tolist() for n in (5, 11, 3)]


def hf_token_logprobs(hf_model, prompt: list[int], output: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' log-softmax at each output token's position: (its logprob [T], the full rows [T, V])."""
    logits = hf_logits(hf_model, np.asarray([prompt + output]))[0]
    logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), dim=-1).numpy()
    rows = logp[len(prompt) - 1: len(prompt) - 1 + len(output)]
    return rows[np.arange(len(output)), output], rows


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_transformers_forward(hf_model, target, prompts, sampled):
    kw = {"temperature": 0.9, "top_k": 20, "seed": [1, 2, 3]} if sampled else {}
    out = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[], logprobs=True, top_logprobs=3, **kw)
    for i, p in enumerate(prompts):
        want, rows = hf_token_logprobs(hf_model, p, out.tokens[i])
        np.testing.assert_allclose(out.logprobs[i], want, atol=1e-4)
        for j, top in enumerate(out.top_logprobs[i]):
            ids, values = zip(*top)
            np.testing.assert_allclose(values, np.sort(rows[j])[::-1][:3], atol=1e-4)
            np.testing.assert_allclose(rows[j][list(ids)], values, atol=1e-4)


@pytest.mark.parametrize("shape", [{"num_draft_tokens": 3}, {"tree": "kary:2,2"}])
def test_speculative_logprobs_equal_plain(target, other, prompts, shape):
    """They come from the target's verify pass, never from the drafter."""
    plain = specjax.generate(target, prompts, max_new_tokens=16, eos_token_id=[], logprobs=True, top_logprobs=2)
    spec = specjax.generate(target, prompts, max_new_tokens=16, eos_token_id=[], logprobs=True, top_logprobs=2,
                            drafter=other, **shape)
    assert spec.tokens == plain.tokens
    for a, b in zip(spec.logprobs, plain.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert [[[i for i, _ in t] for t in row] for row in spec.top_logprobs] == \
        [[[i for i, _ in t] for t in row] for row in plain.top_logprobs]
    assert plain.top_logprobs[0][0][0][1] >= plain.top_logprobs[0][0][1][1]  # most likely first


def test_repetition_penalty_equals_transformers_generate(hf_model, target, prompts):
    for p in prompts:
        want = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, repetition_penalty=1.4, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist()
        got = specjax.generate(target, [p], max_new_tokens=20, eos_token_id=[], repetition_penalty=1.4).tokens[0]
        assert got == want


PENALTIES = [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 0.7},
             {"repetition_penalty": [1.0, 1.3, 2.0], "frequency_penalty": [0.5, 0.0, 1.0]}]


@pytest.mark.parametrize("penalty", PENALTIES, ids=["repetition", "presence", "frequency", "per-row"])
def test_greedy_speculative_equals_plain_with_penalties(target, other, prompts, penalty):
    plain = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[], **penalty)
    unpenalised = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[])
    assert plain.tokens != unpenalised.tokens  # the penalty changes the output
    # The target drafting for itself proposes its unpenalised greedy tokens: drafts the penalty rejects.
    for d in (other, DraftModelDrafter(target.cfg, target.params)):
        for shape in ({"num_draft_tokens": 4}, {"tree": "kary:2,2,1"}):
            out = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[], drafter=d, **shape, **penalty)
            assert out.tokens == plain.tokens, (d.name, shape)


def test_min_tokens_speculative_equals_plain(target, prompts):
    plain = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[])
    eos = plain.tokens[0][2]
    ref = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[eos], min_tokens=[8, 0, 5])
    assert eos not in ref.tokens[0][:8]
    out = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[eos], min_tokens=[8, 0, 5],
                           drafter=specjax.NgramDrafter(), num_draft_tokens=4)
    assert out.tokens == ref.tokens
    out = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=[eos], min_tokens=[8, 0, 5],
                           drafter=DraftModelDrafter(target.cfg, target.params), tree="kary:2,2")
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons


def test_penalise_tree_counts_each_nodes_own_path():
    """Against a node-by-node reference: node j's logits penalised with the output counts plus its path's drafts."""
    rng = np.random.default_rng(0)
    b, n, v = 2, 6, 12
    parents = np.array([[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 2, 3, 4]])
    tokens = rng.integers(0, 4, size=(b, n)).astype(np.int32)  # few ids: repeats along paths
    logits = rng.standard_normal((b, n, v)).astype(np.float32)
    prompt = rng.integers(0, v, size=(b, 5)).astype(np.int32)
    output = rng.integers(0, 3, size=(b, v)).astype(np.int32)
    pen = RowPenalties.of(PenaltyConfig((1.3, 0.8), (0.5, 0.0), (0.25, 1.0)), 2, 2)
    counts = TokenCounts(TokenCounts.of_prompts(jnp.asarray(prompt), jnp.asarray([5, 3]), v).in_prompt_BV,
                         jnp.asarray(output))
    mask = np.zeros((b, n, n), bool)
    for r in range(b):
        for j in range(n):
            a = j
            while a >= 0:
                mask[r, j, a] = True
                a = parents[r, a]
    got = np.asarray(penalise_tree(jnp.asarray(logits), counts, jax.tree.map(jnp.asarray, pen), jnp.asarray(tokens),
                                   jnp.asarray(mask)))
    for r in range(b):
        for j in range(n):
            node_counts = output[r].copy()
            for a in range(1, n):
                if mask[r, j, a]:
                    node_counts[tokens[r, a]] += 1
            row = TokenCounts(counts.in_prompt_BV[r: r + 1], jnp.asarray(node_counts[None]))
            want = penalise(jnp.asarray(logits[r: r + 1, j]), row, jax.tree.map(lambda x: jnp.asarray(x[r: r + 1]), pen))
            np.testing.assert_allclose(got[r, j], np.asarray(want)[0], rtol=1e-6)


def penalised_distribution(model, repetition: float, presence: float, frequency: float) -> np.ndarray:
    """P(x1, x2, x3 | prompt) at temperature 1 under vLLM's penalties, enumerated exactly (numpy, float64)."""
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(VOCAB), repeat=NEW - 1)], np.int32)
    cache = model.model.init_cache(len(seqs), 8)
    h, _, _ = forward(model.params, model.cfg, jnp.asarray(seqs), cache, attn_impl="xla")
    logits = np.asarray(lm_head(model.params, model.cfg, h), np.float64)  # [36, T, V]
    t = len(PROMPT) - 1

    def step(z, output):  # the distribution of the next token after `output` (the prompt is PROMPT)
        counts = np.bincount(np.asarray(output, int), minlength=VOCAB)
        seen = np.isin(np.arange(VOCAB), PROMPT) | (counts > 0)
        z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z) - frequency * counts \
            - presence * (counts > 0)
        p = np.exp(z - z.max())
        return p / p.sum()

    probs = np.zeros((VOCAB,) * NEW)
    for row, (x1, x2) in zip(logits, itertools.product(range(VOCAB), repeat=2)):
        probs[x1, x2] = step(row[t], [])[x1] * step(row[t + 1], [x1])[x2] * step(row[t + 2], [x1, x2])
    return probs


@pytest.mark.parametrize("tree", [None, "chain:2", "kary:2,2"])
def test_sampled_output_keeps_the_penalised_distribution(tree):
    target, draft = tiny(2, layers=2), tiny(7, layers=1)
    pen = dict(repetition_penalty=1.8, presence_penalty=0.6, frequency_penalty=0.4)
    probs = penalised_distribution(target, 1.8, 0.6, 0.4)
    assert np.isclose(probs.sum(), 1.0)
    kw = {} if tree is None else {"drafter": DraftModelDrafter(draft.cfg, draft.params), "tree": tree}
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=11, eos_token_id=[],
                           **pen, **kw)
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), probs)
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"
    unpenalised = penalised_distribution(target, 1.0, 0.0, 0.0)
    assert not chi_square_passes(np.array(out.tokens), unpenalised)[0]  # the test can tell them apart
