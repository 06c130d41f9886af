"""The shipped tiny pair (checkpoints/tiny/): loads, generates code, reproduces its recorded loss
and acceptance. Needs no stdlib files: the eval slice and held-out prompts live beside the models."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax
from specjax.models.cache import init_cache
from specjax.models.model import forward, lm_head

TINY = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"
MANIFEST = json.loads((TINY / "manifest.json").read_text())
# fp32 on CPU; the recomputation uses the serving forward (KV cache), training used a cache-free one.
LOSS_ATOL = 2e-3


@pytest.fixture(scope="module")
def target():
    return specjax.load(TINY / "target")


@pytest.fixture(scope="module")
def draft():
    return specjax.load(TINY / "draft")


def serving_loss(model, tokens_WS: np.ndarray) -> float:
    """Mean next-token cross-entropy through specjax's serving forward (prefill into a KV cache)."""
    cfg = model.cfg

    @jax.jit
    def ce(params, tokens_WS):
        inputs, labels = tokens_WS[:, :-1], tokens_WS[:, 1:]
        h, _, _ = forward(params, cfg, inputs, init_cache(cfg, *inputs.shape), attn_impl="xla")
        return optax.softmax_cross_entropy_with_integer_labels(lm_head(params, cfg, h), labels).mean()

    return float(ce(model.params, jnp.asarray(tokens_WS, jnp.int32)))


def test_checkpoints_are_small_and_clean():
    files = [p for p in TINY.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 40e6  # the brief's limit (32 MB with the embedded hybrid)
    assert not [p for p in TINY.iterdir() if p.name.startswith(".")], "stray temporary directories"
    heads = set(MANIFEST.get("heads", {}))  # trained drafter heads, each with its manifest entry
    assert {p.name for p in TINY.iterdir()} == {"manifest.json", "eval_slice.json"} | set(MANIFEST["models"]) | heads


def test_models_load_with_shared_tokenizer(target, draft):
    for model, name in ((target, "target"), (draft, "draft")):
        assert model.hf_config["architectures"] == ["LlamaForCausalLM"]
        assert model.cfg.num_params() == MANIFEST["models"][name]["params"]
        assert sum(x.size for x in jax.tree.leaves(model.params)) == model.cfg.num_params()
    assert target.cfg.vocab_size == draft.cfg.vocab_size == target.tokenizer.get_vocab_size()
    assert (TINY / "target" / "tokenizer.json").read_bytes() == (TINY / "draft" / "tokenizer.json").read_bytes()
    assert draft.cfg.num_params() * 3 < target.cfg.num_params()
    assert target.encode("def f():")[0] == target.cfg.bos_token_id


def test_recorded_loss_matches_recomputation(target, draft):
    tokens_WS = np.asarray(json.loads((TINY / "eval_slice.json").read_text())["tokens"])
    for model, name in ((target, "target"), (draft, "draft")):
        assert serving_loss(model, tokens_WS) == pytest.approx(MANIFEST["eval_slice_loss"][name], abs=LOSS_ATOL)
    # The target has learned something: far below the unigram entropy of the corpus.
    assert MANIFEST["models"]["target"]["validation_loss"] < MANIFEST["unigram_cross_entropy"] - 1.0


def test_tokenizer_round_trips_code(target):
    texts = [p["text"] for p in MANIFEST["held_out_prompts"]] + ["x = {'a': [1, 2.5e-3]}\n\tif x:  # é\n"]
    for text in texts:
        ids = target.encode(text)
        assert ids[0] == target.cfg.bos_token_id and target.decode(ids) == text


def test_target_is_clearly_stronger_than_the_draft():
    models = MANIFEST["models"]
    assert models["target"]["validation_loss"] <= models["draft"]["validation_loss"] - 0.3


def test_greedy_continuations_do_not_loop(target):
    """The target's greedy continuations of held-out prompts are not a repeated phrase: distinct 4-grams."""
    from specjax.bench.quality import distinct_ngram_ratio

    prompts = [p["text"] for p in MANIFEST["held_out_prompts"]]
    out = specjax.generate(target, prompts, max_new_tokens=MANIFEST["acceptance"]["max_new_tokens"], eos_token_id=[])
    ratio = float(np.mean([distinct_ngram_ratio(t) for t in out.tokens]))
    assert ratio >= 0.6, ratio
    assert ratio == pytest.approx(MANIFEST["target_continuation_distinct_4gram_ratio"], abs=0.05)


def test_recorded_target_continuations_reproduce(target):
    """Greedy decoding of the held-out prompts gives the recorded continuations (a few float ties allowed)."""
    prompts = [p["text"] for p in MANIFEST["held_out_prompts"]]
    out = specjax.generate(target, prompts, max_new_tokens=MANIFEST["acceptance"]["max_new_tokens"],
                           eos_token_id=[])
    same = [got == want for got, want in zip(out.texts, MANIFEST["target_greedy_continuations"])]
    assert sum(same) >= len(same) - 1, same


def test_speculative_acceptance_matches_record(target):
    if not hasattr(specjax, "load_drafter"):
        pytest.skip("specjax.load_drafter does not exist yet (speculative loop not merged)")
    acceptance = MANIFEST["acceptance"]
    if "measured_greedy_tau" not in acceptance:
        pytest.skip("manifest has no measured tau yet; rerun scripts/train_tiny.py --stop-after export")
    drafter = specjax.load_drafter(TINY / "draft", target)
    prompts = [p["text"] for p in MANIFEST["held_out_prompts"]]
    out = specjax.generate(target, prompts, max_new_tokens=acceptance["max_new_tokens"], drafter=drafter,
                           num_draft_tokens=acceptance["num_draft_tokens"])
    tau = out.stats["acceptance_length"]
    assert tau >= 0.9 * acceptance["measured_greedy_tau"], (tau, acceptance["measured_greedy_tau"])


@pytest.mark.parametrize("head", sorted(MANIFEST.get("heads", {})))
def test_shipped_heads_reproduce_their_recorded_acceptance(target, head):
    """Each trained drafter head loads for the embedded target, equals plain greedy decoding and keeps its tau."""
    from specjax.train.tiny import head_acceptance

    record = MANIFEST["heads"][head]["acceptance"]
    prompts = [p["text"] for p in MANIFEST["held_out_prompts"]]
    k = record["num_draft_tokens"]  # head_acceptance raises unless the output equals plain greedy decoding
    measured = head_acceptance(target, TINY / head, prompts, [k], record["max_new_tokens"], log=lambda m: None)
    assert measured[f"chain_{k}"]["measured_greedy_tau"] >= 0.9 * record["measured_greedy_tau"]
