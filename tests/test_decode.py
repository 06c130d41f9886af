"""The autoregressive decode loop: compiled once per shape bucket, seeded, batch-invariant, exact budgets.

Recompilation is checked two independent ways: specjax's own bookkeeping
(`stats["compile_s"]`, the Target's compiled-executable dict) and JAX's backend-compile
monitoring events / compile log, which see every XLA compilation in the process.
"""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.decode import LoopConfig, ar_generate
from specjax.decoding.request import prepare
from specjax.models.target import Target

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    """A tiny Qwen2 with wide-spread random weights (clear greedy margins), loaded from an HF directory."""
    path = save_hf_model(build_hf_model("qwen2", **SMALL), tmp_path_factory.mktemp("qwen2"))
    return specjax.load(path)


def fresh(target: Target) -> Target:
    """The same model with an empty compiled-loop cache."""
    return Target(target.params, target.cfg, target.hf_config, target.tokenizer, target.path, target.attn_impl)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, SMALL["vocab_size"], size=n).tolist() for n in lengths]


@contextlib.contextmanager
def backend_compiles():
    """Collect the name of every function XLA compiles inside the block (jax.monitoring events)."""
    names: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ---------------------------------------------------------------- compilation


def test_second_call_with_same_buckets_does_not_recompile(target, caplog):
    t = fresh(target)
    prompts = prompts_of([5, 9], seed=0)

    with backend_compiles() as first_compiles, jax.log_compiles(True), \
            caplog.at_level(logging.WARNING, logger="jax"):
        first = specjax.generate(t, prompts, max_new_tokens=10, eos_token_id=[])
    assert first.stats["compile_s"] > 0
    assert len(t.compiled) == 1
    assert first_compiles.count("jit(ar_generate)") == 1
    # The log check below is not vacuous: a compiling call does show up in it.
    assert any("Compiling jit(ar_generate)" in r.getMessage() for r in caplog.records)
    caplog.clear()

    # Same prompts again: nothing compiles, by specjax's bookkeeping and by JAX's.
    with backend_compiles() as compiles, jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        again = specjax.generate(t, prompts, max_new_tokens=10, eos_token_id=[])
    assert again.stats["compile_s"] == 0
    assert len(t.compiled) == 1
    assert compiles == []
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert again.tokens == first.tokens

    # Different prompts (other lengths inside the same 16-token bucket, other ids), another
    # budget in the same output bucket and another seed: still the same compiled loop.
    caplog.clear()
    other = prompts_of([3, 16], seed=1)
    with backend_compiles() as compiles, jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        out = specjax.generate(t, other, max_new_tokens=13, eos_token_id=[], seed=7)
    assert out.stats["compile_s"] == 0
    assert len(t.compiled) == 1
    assert compiles == []
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert [len(r) for r in out.tokens] == [13, 13]


def test_a_different_bucket_compiles_once(target):
    t = fresh(target)
    specjax.generate(t, prompts_of([5, 9], seed=0), max_new_tokens=10, eos_token_id=[])
    assert len(t.compiled) == 1

    longer = prompts_of([20, 7], seed=2)  # prompt bucket 32 instead of 16
    with backend_compiles() as compiles:
        out = specjax.generate(t, longer, max_new_tokens=10, eos_token_id=[])
    assert out.stats["compile_s"] > 0
    assert len(t.compiled) == 2
    assert compiles.count("jit(ar_generate)") == 1

    with backend_compiles() as compiles:
        again = specjax.generate(t, prompts_of([17, 30], seed=3), max_new_tokens=10, eos_token_id=[])
    assert again.stats["compile_s"] == 0 and len(t.compiled) == 2 and compiles == []


# ---------------------------------------------------------------- sampling determinism


def test_seeded_sampling_is_deterministic(target):
    prompts = prompts_of([4, 11], seed=4)
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_k=50, eos_token_id=[])
    a = specjax.generate(target, prompts, seed=0, **kwargs)
    b = specjax.generate(target, prompts, seed=0, **kwargs)
    c = specjax.generate(target, prompts, seed=1, **kwargs)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert all(a.tokens[i] != c.tokens[i] for i in range(2))
    greedy = specjax.generate(target, prompts, max_new_tokens=16, eos_token_id=[])
    assert a.tokens != greedy.tokens  # temperature 1 really samples


# ---------------------------------------------------------------- batching


def test_greedy_output_is_batch_invariant(target):
    """Each prompt decodes to the same tokens alone (batch 1) as inside a ragged, padded batch."""
    prompts = prompts_of([3, 11, 25], seed=5)
    batched = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    assert batched.stats["batch_bucket"] == 4  # three rows padded to four
    for prompt, row in zip(prompts, batched.tokens):
        alone = specjax.generate(target, [prompt], max_new_tokens=12, eos_token_id=[])
        assert alone.tokens[0] == row


# ---------------------------------------------------------------- token budgets


def test_max_new_tokens_count_is_exact(target):
    prompts = prompts_of([2, 6, 14], seed=6)
    out = specjax.generate(target, prompts, max_new_tokens=13, eos_token_id=[])
    assert [len(r) for r in out.tokens] == [13, 13, 13]
    assert out.stats["generated_tokens"] == 39
    one = specjax.generate(target, prompts, max_new_tokens=1, eos_token_id=[])
    assert [len(r) for r in one.tokens] == [1, 1, 1]
    assert [r[:1] for r in out.tokens] == one.tokens


def test_per_row_budgets_in_the_loop(target):
    """ar_generate takes a budget per row: each row stops at exactly its own count."""
    prompts = prompts_of([4, 9, 2, 7], seed=7)
    prompt_BT = np.zeros((4, 16), np.int32)
    for i, p in enumerate(prompts):
        prompt_BT[i, : len(p)] = p
    prompt_len_B = np.asarray([len(p) for p in prompts], np.int32)
    lc = LoopConfig(target.cfg, False, out_len=16, cache_len=32)
    req = prepare(target, prompts, 16, SamplingConfig(), [], None, 0)  # its RowSettings: greedy, no stop ids
    full = specjax.generate(target, prompts, max_new_tokens=16, eos_token_id=[]).tokens

    budgets = np.asarray([1, 7, 16, 0], np.int32)
    out_BO, count_B, steps, _ = ar_generate(target.params, jnp.asarray(prompt_BT), jnp.asarray(prompt_len_B),
                                            jnp.asarray(budgets), jnp.zeros(4, jnp.uint32),
                                            jnp.arange(4, dtype=jnp.uint32), req.arrays()[-1], lc=lc)
    np.testing.assert_array_equal(np.asarray(count_B), budgets)
    assert int(steps) == 16
    for i, n in enumerate(budgets):
        assert np.asarray(out_BO)[i, :n].tolist() == full[i][:n]


def test_explicit_max_len_that_just_fits(target):
    """max_len = longest prompt + max_new_tokens is enough (even below the padded prompt bucket) and changes nothing;
    the cache is rounded up like every other cache length."""
    prompts = prompts_of([17, 5], seed=8)
    free = specjax.generate(target, prompts, max_new_tokens=6, eos_token_id=[])
    tight = specjax.generate(target, prompts, max_new_tokens=6, eos_token_id=[], max_len=23)
    assert tight.stats["cache_len"] == 128
    assert tight.tokens == free.tokens
