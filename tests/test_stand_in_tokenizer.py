"""The stand-in tokenizer of random targets (specjax/bench/stand_in_tokenizer.py): ids -> text -> ids over a whole
vocabulary, and a random preset target served and loaded by `bench serve`'s random dataset, its streamed text the
tokens of plain greedy decoding.

One micro random target (bench/ar.py MICRO_PRESET: 512 ids, two layers 64 wide), one engine, one server."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from specjax import generate  # noqa: E402
from specjax.bench.ar import MICRO_PRESET  # noqa: E402
from specjax.bench.serving import datasets  # noqa: E402
from specjax.bench.serving.main import benchmark  # noqa: E402
from specjax.bench.spec import random_model  # noqa: E402
from specjax.bench.stand_in_tokenizer import stand_in_tokenizer  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.serve.app import Server, build_app  # noqa: E402
from specjax.serve.main import serve_in_thread  # noqa: E402

MAX_LEN, INPUT_LEN, NEW = 64, 12, 8


def test_every_id_round_trips_and_decodes_alone_to_its_own_text():
    tok = stand_in_tokenizer(300, special_ids=[1, 2])
    ids = list(range(300))
    assert tok.get_vocab_size() == 300
    assert tok.encode(tok.decode(ids, skip_special_tokens=False)).ids == ids
    assert tok.encode(tok.decode(ids[::-1], skip_special_tokens=False)).ids == ids[::-1]
    words = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert len(set(words)) == 300 and all(w.strip() and w.isprintable() for w in words)
    # A completion's text appended to its prompt's is the text of all the ids (each word carries its space).
    assert tok.decode([7, 8]) + tok.decode([299, 3]) == tok.decode([7, 8, 299, 3]) == " t7 t8 t299 t3"
    assert tok.decode([5, 2, 6]) == " t5 t6" and tok.decode([5, 2], skip_special_tokens=False) == " t5<|t2|>"
    assert {t.content for t in tok.get_added_tokens_decoder().values() if t.special} == {"<|t1|>", "<|t2|>"}
    assert tok.encode("hello t5").ids == [0, 5]  # text that is not its words: id 0, the unknown word


@pytest.mark.parametrize("vocab, special, match", [(0, (), "vocab_size"), (8.0, (), "vocab_size"),
                                                   (8, (8,), "special_ids"), (8, (-1,), "special_ids")])
def test_bad_arguments(vocab, special, match):
    with pytest.raises(ValueError, match=match):
        stand_in_tokenizer(vocab, special)


@pytest.fixture(scope="module")
def served():
    target = random_model(MICRO_PRESET, "float32", 0, "xla")
    engine = Engine(target, None, max_slots=2, max_len=MAX_LEN, sampling=False, max_prefill_batch=2)
    engine.warmup()
    with serve_in_thread(build_app(Server(engine, target, "micro", max_len=MAX_LEN))) as url:
        yield url, target
    engine.close()


def test_random_dataset_streams_text_of_the_greedy_tokens(served):
    url, target = served
    samples = datasets.random_samples(target.tokenizer, 4, INPUT_LEN, NEW, range_ratio=0.0, seed=3)
    prompts = [target.encode(s.prompt) for s in samples]
    special = {target.cfg.bos_token_id, *target.cfg.eos_token_ids}
    assert all(len(p) == INPUT_LEN == s.prompt_len and not special & set(p) for p, s in zip(prompts, samples))
    assert len({tuple(p) for p in prompts}) == 4
    run = asyncio.run(benchmark(url, "/v1/completions", "micro", samples, max_concurrency=2,
                                sampling={"temperature": 0.0}, progress=False))
    plain = generate(target, prompts, max_new_tokens=NEW, temperature=0.0)
    for r, tokens, text in zip(run["results"], plain.tokens, plain.texts):
        assert r.success and r.error == "" and r.content_times  # TTFT is timed by the first chunk with content
        assert r.text == text and target.encode(r.text) == [t for t in tokens if t not in special]
        assert (r.prompt_len, r.output_tokens) == (INPUT_LEN, len(tokens))  # the server's usage counts
