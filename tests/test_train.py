"""Training code on micro models: the training forward equals the serving forward, loss falls,
an interrupted run resumes to the identical state, distillation gradients flow; plus the
corpus split, tokenizer and acceptance helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.models.cache import init_cache
from specjax.models.model import forward, init_params, lm_head
from specjax.train import corpus, data, losses, tiny, trainer
from specjax.train.model import train_forward
from specjax.train.tokenizer import EOT, eot_id, train_tokenizer

MICRO = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, tie_word_embeddings=True, max_position_embeddings=128)
STREAM = ((np.arange(4000) * 7 + np.arange(4000) // 13) % 64).astype(np.int32)  # learnable, not constant
TC = trainer.TrainConfig(steps=6, peak_lr=1e-2, warmup_steps=2, log_every=1, eval_every=3, ckpt_every=2)


def batch_fn(step: int) -> dict:
    return data.random_windows(STREAM, 0, step, 4, 16)


@pytest.mark.parametrize("cfg", [
    MICRO,
    ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=1,
                head_dim=16, qkv_bias=True, qk_norm=True, family="qwen3"),
])
def test_train_forward_matches_decoder_forward(cfg):
    params = init_params(cfg, jax.random.key(1), scale=0.2)
    tokens_BT = jax.random.randint(jax.random.key(2), (2, 24), 0, cfg.vocab_size)
    capture = (0, 1, cfg.num_layers)
    h_ref, cap_ref, _ = jax.jit(lambda p, x: forward(p, cfg, x, init_cache(cfg, 2, 32), capture=capture,
                                                     attn_impl="xla"))(params, tokens_BT)
    h, cap = jax.jit(lambda p, x: train_forward(p, cfg, x, capture=capture))(params, tokens_BT)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), atol=2e-5, rtol=1e-5)
    for got, ref in zip(cap, cap_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lm_head(params, cfg, h)), np.asarray(lm_head(params, cfg, h_ref)),
                               atol=1e-4, rtol=1e-5)


def test_few_steps_lower_the_loss(tmp_path):
    params = init_params(MICRO, jax.random.key(0))
    loss_fn = losses.lm_loss(MICRO)
    held_out = data.batches_of(data.fixed_windows(STREAM, 16, 8), 4)
    before = trainer.evaluate(loss_fn, params, held_out)["loss"]
    state = trainer.train(tmp_path, TC, params, loss_fn, batch_fn, eval_batches=held_out)
    after = trainer.evaluate(loss_fn, state["params"], held_out)["loss"]
    assert int(state["step"]) == TC.steps
    assert after < before - 0.2, (before, after)
    log = trainer.read_log(tmp_path)
    assert [r["step"] for r in log if r["event"] == "validation"] == [3, 6]


def test_resume_equals_uninterrupted(tmp_path):
    params = init_params(MICRO, jax.random.key(0))
    loss_fn = losses.lm_loss(MICRO)
    whole = trainer.host(trainer.train(tmp_path / "whole", TC, params, loss_fn, batch_fn))
    trainer.train(tmp_path / "split", TC, params, loss_fn, batch_fn, until=3)  # "interrupted" after step 3
    resumed = trainer.host(trainer.train(tmp_path / "split", TC, params, loss_fn, batch_fn))
    assert jax.tree.structure(whole) == jax.tree.structure(resumed)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    assert int(resumed["step"]) == TC.steps


def test_distillation_gradients_flow_and_vanish_at_the_teacher():
    student_cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    teacher = init_params(MICRO, jax.random.key(3), scale=0.3)
    student = init_params(student_cfg, jax.random.key(4))
    batch = batch_fn(0)
    loss_fn = losses.distill_loss(student_cfg, MICRO)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(student, batch, teacher)
    assert float(loss) > 0 and 0.0 <= float(metrics["agreement"]) <= 1.0
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    self_loss, self_metrics = jax.jit(losses.distill_loss(MICRO, MICRO))(teacher, batch, teacher)
    assert abs(float(self_loss)) < 1e-5 and float(self_metrics["agreement"]) == 1.0


def test_continuation_batches_mask_only_generated_tokens():
    from specjax.models.target import Target

    target = Target(init_params(MICRO, jax.random.key(5), scale=0.3), MICRO, {}, attn_impl="xla")
    prompts = data.prompt_windows(STREAM, 0, 0, 2, 5)
    batch = data.continuations(target, prompts, 6)
    assert batch["tokens"].shape == (2, 11) and batch["mask"].shape == (2, 10)
    np.testing.assert_array_equal(batch["tokens"][:, :5], np.asarray(prompts))
    assert batch["mask"][:, :4].sum() == 0 and batch["mask"][:, 4:].all()
    loss, metrics = jax.jit(losses.lm_loss(MICRO))(target.params, batch)
    assert float(metrics["tokens"]) == 12 and float(metrics["accuracy"]) == 1.0  # greedy labels = argmax


def test_split_rule_is_stable():
    # Pinned: the split of a path must never change, or held-out files would leak into training.
    assert [corpus.split_of(p) for p in ("os.py", "pprint.py", "json/decoder.py", "asyncio/coroutines.py")] == \
        ["train", "test", "train", "test"]
    assert corpus.is_included("json/decoder.py")
    assert not corpus.is_included("test/test_os.py") and not corpus.is_included("encodings/cp1252.py")
    assert not corpus.is_included("unittest/test/test_case.py") and not corpus.is_included("README.txt")


def test_tokenizer_prepends_bos_and_round_trips():
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 20
    tok = train_tokenizer(texts, vocab_size=300)
    assert eot_id(tok) == 0 and tok.id_to_token(0) == EOT
    ids = tok.encode("def add(x, y):\n    return x\n").ids
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tok.decode(ids) == "def add(x, y):\n    return x\n"


def test_greedy_tau_replay():
    assert tiny.greedy_tau(np.ones(11, bool), 4) == (5.0, 2)
    assert tiny.greedy_tau(np.asarray([1, 0, 0, 0, 0], bool), 4) == (1.0, 4)
    # rounds: t=1 keeps 1,2 (+bonus 3); t=4 keeps 4 (+bonus 5); t=6 bonus only
    assert tiny.greedy_tau(np.asarray([1, 1, 1, 0, 1, 0, 0], bool), 4) == (2.0, 3)


def test_cached_pool_generates_once_then_reads_and_refuses_another_shape(tmp_path, monkeypatch):
    from specjax.train import data

    calls = []

    def fake_pool(target, stream_N, seed, rows, prompt_len, new_tokens):
        calls.append(seed)
        return {"tokens": np.full((rows, prompt_len + new_tokens), seed, np.int32),
                "mask": np.ones((rows, prompt_len + new_tokens), bool)}

    monkeypatch.setattr(data, "continuation_pool", fake_pool)
    path = tmp_path / "pool.npz"
    first = data.cached_pool(path, None, lambda: np.zeros(4), 6, 3, 2, 2, log=lambda m: None)
    again = data.cached_pool(path, None, lambda: pytest.fail("the stream is only built to generate"), 6, 3, 2, 2)
    assert calls == [6] and np.array_equal(first["tokens"], again["tokens"])
    with pytest.raises(ValueError, match=r"holds \(3, 4\) tokens; this run wants \(5, 4\)"):
        data.cached_pool(path, None, lambda: np.zeros(4), 6, 5, 2, 2)
