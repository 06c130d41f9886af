"""Stop strings, stop tokens, finish reasons and streaming, with and without a drafter (the embedded models).

Plain decoding without a stop is the reference: with `stop`, every family's greedy output must be plain
decoding's text cut before the first occurrence (vLLM's default; include_stop_str_in_output keeps it), its
tokens up to the one that completed it, and a stream's chunks must concatenate to what generate returns.
"""

from __future__ import annotations

import pytest

import specjax

# Prompts whose greedy continuations vary (the 4M-parameter target loops on many others); the first repeats "#\n".
PROMPTS = ["def parse(line):\n", "class Stack:\n    def push(self, x):", "    if not path:\n        raise ValueError(",
           "def main(argv=None):\n    parser = argparse."]
FAMILIES = ("draft", "eagle3", "mtp", "dflash", "dspark", "ngram")
NEW = 40


@pytest.fixture(scope="module")
def target():
    return specjax.load(specjax.embedded("target"))


@pytest.fixture(scope="module")
def plain(target):
    return specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[])


def drafter(target, name):
    return specjax.NgramDrafter() if name == "ngram" else specjax.load_drafter(specjax.embedded(name), target)


def boundary_stop(target, tokens: list[int], skip: int = 0, after=lambda j: True) -> tuple[str, int, str]:
    """A stop string that spans the boundary after token j (two characters each side) and first occurs there, for
    the first j past `skip` with after(j): (stop, j + 1 = the index of the token completing it, the text before)."""
    text = target.decode(tokens)
    for j in range(skip, len(tokens) - 1):
        c = len(target.decode(tokens[: j + 1]))
        stop = text[c - 2: c + 2]
        if c >= 2 and len(stop) == 4 and text.find(stop) == c - 2 and target.decode(tokens[: j + 2]).endswith(
                text[c: c + 2]) and after(j + 1):
            return stop, j + 1, text[: c - 2]
    raise AssertionError("no boundary found")


def test_a_stop_string_spanning_two_tokens_ends_plain_decoding_there(target, plain):
    stop, last, before = boundary_stop(target, plain.tokens[1], skip=4)
    out = specjax.generate(target, PROMPTS[1:2], max_new_tokens=NEW, eos_token_id=[], stop=[stop])
    assert out.texts == [before]
    assert out.tokens == [plain.tokens[1][: last + 1]]
    assert out.finish_reasons == ["stop"] and out.stop_reasons == [stop]
    kept = specjax.generate(target, PROMPTS[1:2], max_new_tokens=NEW, eos_token_id=[], stop=[stop],
                            include_stop_str_in_output=True)
    assert kept.texts == [before + stop] and kept.tokens == out.tokens


def test_the_first_stop_string_found_wins_and_unmatched_stops_run_to_the_budget(target, plain):
    out = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[], stop=["\u2603 never", "\n"])
    for i, text in enumerate(plain.texts):
        if "\n" in text:
            assert out.texts[i] == text[: text.index("\n")] and out.stop_reasons[i] == "\n"
        else:
            assert out.texts[i] == text and out.finish_reasons[i] == "length"


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_stops_where_plain_decoding_does(target, plain, name):
    """Greedy speculative output with stop strings equals plain decoding's text cut at the first one."""
    d = drafter(target, name)
    stops = ["\n\n", "):"]
    out = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[], stop=stops, drafter=d,
                           num_draft_tokens=3)
    ref = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[], stop=stops)
    assert out.tokens == ref.tokens and out.texts == ref.texts and out.finish_reasons == ref.finish_reasons
    for text, full in zip(out.texts, plain.texts):
        hits = [full.find(s) for s in stops if s in full]
        assert text == (full[: min(hits)] if hits else full)


def test_a_round_that_runs_past_a_stop_is_cut_and_counted_only_to_it(target, plain):
    """The stop is completed by a draft that is not its round's last emitted token: the round is cut there, and the
    acceptance statistics count only what the row kept."""
    d = drafter(target, "draft")
    spec = specjax.generate(target, PROMPTS[2:3], max_new_tokens=NEW, eos_token_id=[], drafter=d, num_draft_tokens=4)
    rounds = spec.token_rounds[0]
    stop, last, before = boundary_stop(target, spec.tokens[0], skip=2,
                                       after=lambda k: k + 1 < len(rounds) and rounds[k + 1] == rounds[k])
    out = specjax.generate(target, PROMPTS[2:3], max_new_tokens=NEW, eos_token_id=[], drafter=d, num_draft_tokens=4,
                           stop=[stop])
    assert out.texts == [before] and out.tokens == [plain.tokens[2][: last + 1]]
    kept_rounds = out.token_rounds[0]
    assert out.stats["row_rounds"] == [len(set(kept_rounds) - {0})]
    assert out.stats["acceptance_length"] == pytest.approx((len(kept_rounds) - 1) / len(set(kept_rounds) - {0}))
    assert out.stats["generated_tokens"] == last + 1
    assert out.stats["accepted_drafts"] <= last - (out.stats["row_rounds"][0] - 1)
    # In a batch (padded to 4 rows) the other rows' figures are the loop's own.
    batch = specjax.generate(target, PROMPTS[1:4], max_new_tokens=NEW, eos_token_id=[], drafter=d,
                             num_draft_tokens=4, stop=[stop])
    whole = specjax.generate(target, PROMPTS[1:4], max_new_tokens=NEW, eos_token_id=[], drafter=d, num_draft_tokens=4)
    assert batch.tokens[1] == out.tokens[0] and batch.stats["row_rounds"][1] == out.stats["row_rounds"][0]
    for i in (0, 2):
        if batch.tokens[i] == whole.tokens[i]:
            assert batch.stats["row_rounds"][i] == whole.stats["row_rounds"][i]


def test_finish_reasons_for_eos_stop_tokens_and_the_budget(target, plain):
    row = plain.tokens[1]
    tok = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
    at = row.index(tok)
    d = drafter(target, "draft")
    for kw in ({}, {"drafter": d, "num_draft_tokens": 3}):
        eos = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[tok], **kw)
        assert eos.tokens[1] == row[: at + 1] and eos.finish_reasons[1] == "stop" and eos.stop_reasons[1] == tok
        extra = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[], stop_token_ids=[tok], **kw)
        assert extra.tokens[1] == row[: at + 1] and extra.finish_reasons[1] == "stop"
        short = specjax.generate(target, PROMPTS, max_new_tokens=at, eos_token_id=[tok], **kw)
        assert short.finish_reasons[1] == "length" and short.stop_reasons[1] is None


def test_min_tokens_holds_back_eos_and_stop_strings(target, plain):
    row = plain.tokens[1]
    tok = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
    at = row.index(tok)
    out = specjax.generate(target, PROMPTS[1:2], max_new_tokens=NEW, eos_token_id=[tok], min_tokens=at + 2)
    assert tok not in out.tokens[0][: at + 2] and len(out.tokens[0]) >= at + 2
    stop = specjax.generate(target, PROMPTS[1:2], max_new_tokens=NEW, eos_token_id=[], stop=["\n"], min_tokens=NEW)
    assert stop.tokens == [plain.tokens[1]] and stop.finish_reasons == ["length"]


def test_texts_skip_special_tokens_unless_asked(target, plain):
    """A row that ends on EOS (a special token): its text leaves it out by default and keeps it with
    skip_special_tokens=False, through both text paths (the whole loop's request.decode_texts, a chunked run's
    stream.RowText); generate hands the flag to both."""
    eos = target.cfg.eos_token_ids[0]
    row = plain.tokens[1]
    for extra in ({}, {"stop": ["\u2603"]}):  # a stop string that never occurs: the chunked path, same output
        out = specjax.generate(target, PROMPTS[1:2], max_new_tokens=8, eos_token_id=[], skip_special_tokens=False,
                               **extra)
        assert out.texts == [target.decode(row[:8], skip_special_tokens=False)]
    from specjax.decoding.request import decode_texts
    from specjax.decoding.stream import RowText

    ids = row[:3] + [eos]
    for skip in (True, False):
        whole = decode_texts(target, [ids], skip)[0]
        text = RowText(target, (), False, skip, 0)
        for t in ids:
            text.push(t)
        assert text.text == whole
        assert (whole == target.decode(row[:3])) == skip  # the EOS text appears only when not skipped


@pytest.mark.parametrize("kind", ["plain", "chain", "tree"])
def test_stream_chunks_concatenate_to_generate(target, kind):
    d = drafter(target, "draft")
    kw = {"plain": {}, "chain": {"drafter": d, "num_draft_tokens": 3}, "tree": {"drafter": d, "tree": "kary:2,2"}}[kind]
    for extra in ({}, {"stop": ["\n\n"]}, {"temperature": 0.8, "top_p": 0.95, "seed": [3, 4, 5, 6]}):
        out = specjax.generate(target, PROMPTS, max_new_tokens=NEW, **kw, **extra)
        chunks = list(specjax.stream(target, PROMPTS, max_new_tokens=NEW, **kw, **extra))
        for i in range(len(PROMPTS)):
            mine = [c for c in chunks if c.index == i]
            assert sum((c.token_ids for c in mine), []) == out.tokens[i]
            assert "".join(c.text for c in mine) == out.texts[i]
            assert [c.finish_reason for c in mine][-1] == out.finish_reasons[i]
            assert all(c.finish_reason is None for c in mine[:-1])
        assert len(chunks) > len(PROMPTS)  # tokens arrived in more than one piece


def test_stream_arguments_are_checked_like_generate(target):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        next(specjax.stream(target, PROMPTS, stop=[""]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        specjax.generate(target, PROMPTS, stop_token_ids=[10**7])


def test_cli_streams_and_stops(target, plain, capsys):
    from specjax.cli import main

    before = plain.texts[1][: plain.texts[1].index("Args")]
    args = ["generate", str(target.path), "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW), "--eos", "",
            "--stop", "Args", "--drafter", str(specjax.embedded("draft"))]
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == before + "\n--- 0: finished (stop)\n"
    assert main(args) == 0
    printed = capsys.readouterr()  # the text on stdout, the statistics on stderr
    assert f"--- 0: {before}\n" in printed.out and '"finish_reasons": [\n  "stop"\n ]' in printed.err


def test_stream_with_the_prefix_scheduler_equals_generate(target):
    """The scheduler's compiled widths and cost curve ride along into the chunked loop."""
    d = drafter(target, "dspark")
    kw = dict(max_new_tokens=NEW, drafter=d, num_draft_tokens=4, scheduler="confidence", stop=["\n\n"])
    out = specjax.generate(target, PROMPTS, **kw)
    chunks = list(specjax.stream(target, PROMPTS, **kw))
    for i in range(len(PROMPTS)):
        assert sum((c.token_ids for c in chunks if c.index == i), []) == out.tokens[i]
    assert out.stats["scheduler"]["mode"] == "confidence"
