"""What a new user hit the second time (issue 44), each call as the issue quotes it: a silent NaN, streams without
logprobs, raw errors, array-likes, checks that disagreed, and the CLI's and notebook's rough edges. Most checks fail
before anything compiles; those that decode use the embedded target at a few tokens (one executable shape)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cli import main as cli_main
from specjax.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from specjax.loading.embedded import EMBEDDED_DIR

if not (EMBEDDED_DIR / "target" / "config.json").is_file():
    pytest.skip("no embedded checkpoints in this checkout", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
P = ["def f(x):", "import os\n"]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def t():
    return specjax.load(specjax.embedded("target"))


@pytest.fixture(scope="module")
def draft(t):
    return specjax.load_drafter(specjax.embedded("draft"), t)


@pytest.fixture(scope="module")
def with_logprobs(t):
    return specjax.generate(t, P, max_new_tokens=8, logprobs=True, top_logprobs=2)


# ---------------------------------------------------------------- 1. non-finite settings


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": NAN}, "temperature"), ({"temperature": [0.0, NAN]}, "temperature"),
    ({"temperature": INF}, "temperature"), ({"temperature": 1.0, "top_p": NAN}, "top_p"),
    ({"temperature": 1.0, "min_p": NAN}, "min_p"), ({"temperature": 1.0, "top_k": INF}, "top_k"),
    ({"repetition_penalty": NAN}, "repetition_penalty"), ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"), ({"frequency_penalty": -INF}, "frequency_penalty"),
])
def test_non_finite_settings_are_refused_by_name(t, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        specjax.generate(t, P, max_new_tokens=4, **kwargs)


# ---------------------------------------------------------------- 2. stream carries logprobs and stop_reason


def joined(chunks, i, field):
    return [x for c in chunks if c.index == i for x in getattr(c, field)]


def test_stream_carries_logprobs_as_generate_returns_them(t, with_logprobs):
    chunks = list(specjax.stream(t, P, max_new_tokens=8, logprobs=True, top_logprobs=2))
    for i in range(len(P)):
        assert joined(chunks, i, "token_ids") == with_logprobs.tokens[i]
        np.testing.assert_allclose(joined(chunks, i, "logprobs"), with_logprobs.logprobs[i], rtol=1e-6)
        assert joined(chunks, i, "top_logprobs") == with_logprobs.top_logprobs[i]
        assert all(len(top) == 2 for top in joined(chunks, i, "top_logprobs"))
    without = list(specjax.stream(t, P, max_new_tokens=8))
    assert all(c.logprobs is None and c.top_logprobs is None for c in without)


def test_stream_gives_the_stop_reason_on_the_last_chunk(t, draft):
    out = specjax.generate(t, P, max_new_tokens=8, stop=["\n"], logprobs=True)
    assert "\n" in out.stop_reasons  # the stop string ended a row
    for kw in ({}, {"drafter": draft, "num_draft_tokens": 2}):
        chunks = list(specjax.stream(t, P, max_new_tokens=8, stop=["\n"], logprobs=True, **kw))
        for i in range(len(P)):
            mine = [c for c in chunks if c.index == i]
            assert [c.stop_reason for c in mine] == [None] * (len(mine) - 1) + [out.stop_reasons[i]]
            assert mine[-1].finish_reason == out.finish_reasons[i]
            np.testing.assert_allclose(joined(chunks, i, "logprobs"), out.logprobs[i], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- 3. top_logprobs' cap


def test_top_logprobs_is_capped_by_name(t):
    with pytest.raises(ValueError, match=f"top_logprobs must be at most {MAX_TOP_LOGPROBS}"):
        specjax.generate(t, P, max_new_tokens=4, top_logprobs=10000)
    with pytest.raises(ValueError, match="top_logprobs must be at most"):
        specjax.stream(t, P, max_new_tokens=4, top_logprobs=21)


# ---------------------------------------------------------------- 5. wrong types name their argument


@pytest.mark.parametrize("kwargs, match", [
    ({"stop": 123}, "stop must be a string, a list of strings"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [2.5]}, "stop_token_ids must be a list of token ids"),
    ({"logprobs": "yes"}, "logprobs must be True or False"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False"),
    ({"eos_token_id": "2"}, "eos_token_id must be a token id"),
    ({"seed": "1"}, "seed must be an int"),
])
def test_wrong_types_name_the_argument(t, kwargs, match):
    with pytest.raises(TypeError, match=match):
        specjax.generate(t, P, max_new_tokens=4, **kwargs)


def test_load_drafter_without_a_target_says_what_to_pass():
    with pytest.raises(TypeError, match=r"second argument is the target.*specjax.load\(path\)"):
        specjax.load_drafter(specjax.embedded("eagle3"), None)


def test_apply_chat_template_on_a_path_says_load_it_first():
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TypeError, match=r"specjax Target, got str \(load it first"):
        specjax.apply_chat_template("dir", msgs)
    with pytest.raises(TypeError, match=r"load the target first"):
        specjax.generate("dir", P)


# ---------------------------------------------------------------- 6. array-likes


@pytest.mark.parametrize("prompts", [[[1.5, 2.7]], [[True, 2]], [np.array([1.5, 2.0])]])
def test_non_integer_token_ids_are_refused(t, prompts):
    with pytest.raises(TypeError, match="prompt 0 has token ids that are not integers"):
        specjax.generate(t, prompts, max_new_tokens=4)


def test_integer_arrays_are_accepted_wherever_lists_are(t):
    ids = [[5, 6, 7], [8, 9, 10]]
    want = specjax.generate(t, ids, max_new_tokens=4, temperature=(0.5, 0.6), seed=[1, 2])
    for prompts in ([np.array([5, 6, 7]), np.array([8, 9, 10])], np.array(ids), jnp.array(ids)):
        for temperature in (np.array([0.5, 0.6]), jnp.array([0.5, 0.6])):
            out = specjax.generate(t, prompts, max_new_tokens=4, temperature=temperature, seed=np.array([1, 2]))
            assert out.tokens == want.tokens
    assert specjax.generate(t, [np.array([1, 2, 3])], max_new_tokens=4).tokens == \
        specjax.generate(t, [[1, 2, 3]], max_new_tokens=4).tokens
    assert specjax.generate(t, [[1, 2, 3]], max_new_tokens=4, stop_token_ids=np.array([0, 1]),
                            eos_token_id=np.int64(2)).finish_reasons


# ---------------------------------------------------------------- 7. checks that agree with each other and with vLLM


def test_eos_outside_the_vocabulary_is_refused_like_a_stop_token(t):
    with pytest.raises(ValueError, match=r"eos_token_id \[99999\] are not token ids of this vocabulary"):
        specjax.generate(t, P, max_new_tokens=4, eos_token_id=99999)
    with pytest.raises(ValueError, match=r"stop_token_ids \[99999\] are not token ids"):
        specjax.generate(t, P, max_new_tokens=4, stop_token_ids=[99999])


def test_min_tokens_above_max_new_tokens_is_refused(t):
    with pytest.raises(ValueError, match="min_tokens=10 is more than max_new_tokens=4"):
        specjax.generate(t, P, min_tokens=10, max_new_tokens=4)


def test_max_len_says_the_rule(t):
    with pytest.raises(ValueError, match=r"max_len must be a positive int \(a limit on prompt \+ output"):
        specjax.generate(t, P, max_new_tokens=4, max_len=-1)


def test_per_prompt_stop_lists(t):
    out = specjax.generate(t, P, max_new_tokens=8, stop=[["\n"], ["x"]])
    first = specjax.generate(t, P, max_new_tokens=8, stop=["\n"])
    second = specjax.generate(t, P, max_new_tokens=8, stop=["x"])
    assert out.texts == [first.texts[0], second.texts[1]]
    assert out.stop_reasons == [first.stop_reasons[0], second.stop_reasons[1]]
    assert out.stop_reasons[0] == "\n"
    with pytest.raises(ValueError, match="stop has 3 values for 2 prompts"):
        specjax.generate(t, P, max_new_tokens=8, stop=[["\n"], ["x"], ["y"]])


# ---------------------------------------------------------------- 8. stream checks at the call


def test_stream_checks_its_arguments_at_the_call(t):
    with pytest.raises(ValueError, match="temperature must be"):
        specjax.stream(t, P, max_new_tokens=4, temperature=NAN)  # no next(): refused here
    with pytest.raises(TypeError, match="not integers"):
        specjax.stream(t, [[1.5]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompts is empty"):
        specjax.stream(t, [], max_new_tokens=4)


# ---------------------------------------------------------------- SamplingParams


def test_sampling_params_with_vllms_names(t):
    want = specjax.generate(t, P, max_new_tokens=4, temperature=0.7, seed=3, logprobs=True)
    params = specjax.SamplingParams(max_tokens=4, temperature=0.7, seed=3, logprobs=True)
    got = specjax.generate(t, P, sampling_params=params)
    assert got.tokens == want.tokens and got.logprobs == want.logprobs
    streamed = list(specjax.stream(t, P, sampling_params=params))
    assert [joined(streamed, i, "token_ids") for i in range(2)] == want.tokens
    # beside the keywords: a keyword adds to the params; the same setting given twice differently is refused
    assert specjax.generate(t, P, sampling_params=SamplingParams(temperature=0.7, seed=3),
                            max_new_tokens=4).tokens == want.tokens
    with pytest.raises(ValueError, match="temperature is given both as a keyword"):
        specjax.generate(t, P, sampling_params=params, temperature=0.5)
    with pytest.raises(TypeError, match="sampling_params must be a specjax.SamplingParams"):
        specjax.generate(t, P, sampling_params={"temperature": 0.5})


def test_sampling_params_validate_one_request_alone():
    ok = SamplingParams(temperature=np.float32(0.5), stop="\n", stop_token_ids=np.array([3]), max_tokens=16).validate(
        vocab_size=100)
    assert ok.temperature == 0.5 and type(ok.temperature) is float and ok.stop == ("\n",)
    assert ok.stop_token_ids == (3,) and ok.max_new_tokens == 16
    assert ok.as_kwargs()["max_new_tokens"] == 16 and "max_tokens" not in ok.as_kwargs()
    for bad, match in [({"temperature": NAN}, "temperature"), ({"top_logprobs": 50}, "top_logprobs"),
                       ({"stop_token_ids": [100]}, "stop_token_ids"), ({"min_tokens": 200}, "min_tokens"),
                       ({"max_tokens": 8, "max_new_tokens": 16}, "max_tokens"), ({"max_new_tokens": 0}, "max_new")]:
        with pytest.raises((TypeError, ValueError), match=match):
            SamplingParams(**bad).validate(vocab_size=100)
    with pytest.raises(ValueError, match="temperature has 3 values for 2 prompts"):
        SamplingParams(temperature=[0.1, 0.2, 0.3]).validate(n_prompts=2)


def test_generates_options_are_in_its_signature():
    """help() and IDE completion show every documented option (no **options)."""
    for fn in (specjax.generate, specjax.stream):
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name in ("min_p", "stop", "stop_token_ids", "logprobs", "top_logprobs", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "min_tokens", "include_stop_str_in_output",
                     "skip_special_tokens", "chat_template_kwargs", "sampling_params"):
            assert name in params, (fn.__name__, name)
    fields = {f for f in SamplingParams.__dataclass_fields__}
    assert fields - {"max_tokens"} <= set(inspect.signature(specjax.generate).parameters)


# ---------------------------------------------------------------- README


def test_docs_say_what_identical_means():
    readme = " ".join(((ROOT / "README.md").read_text() + (ROOT / "docs" / "generate.md").read_text()).split())
    assert "identical with and without a drafter" not in readme
    assert "token for token for greedy rows" in readme


# ---------------------------------------------------------------- specjax plan: quick by default


def test_plan_measures_quickly_by_default(t, draft, monkeypatch, capsys):
    """`specjax plan` (no --device) measures with a bounded budget: chains QUICK_CHAINS timed QUICK_REPEATS rounds,
    never timed again (a gain inside the noise is reported as undecided); --full is generate(..., "auto")'s."""
    from specjax.cli import build_parser
    from specjax.planning import advisor, auto

    monkeypatch.setattr(auto, "_retimed", lambda *a, **k: pytest.fail("a quick measurement is never timed again"))
    monkeypatch.setenv("SPECJAX_PROFILE", "roofline")  # pass costs by roofline: the loops' timing is what is tested
    args = build_parser().parse_args(["plan", "--drafter", "d", "--concurrency", "1", "--tokens", "8"])
    assert not args.full
    report = {}
    assert advisor.plan_measured(args, t, draft, [1], report) == 0
    assert "quickly" in capsys.readouterr().out
    row = report["choices"][0]
    assert row["quick"] and isinstance(row["undecided"], bool) and row["measure_s"] > 0
    measured = next(m for (d, b, *_), m in auto._AUTO_PLANS[t].items() if d is draft and b == 1)
    assert [k for _, k, _ in measured.times.spec_rounds] == list(auto.QUICK_CHAINS)
    assert len(measured.times.samples) == auto.QUICK_REPEATS
    assert build_parser().parse_args(["plan", "--drafter", "d", "--full"]).full


# ---------------------------------------------------------------- CLI


def test_cli_draft_flags_without_a_drafter_speak_cli(capsys):
    code = cli_main(["generate", str(specjax.embedded("target")), "--prompt", "x", "--num-draft-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "--num-draft-tokens" in err and "add --drafter DIR" in err and "drafter=" not in err


def test_cli_generate_json_logprobs_dtype(t, capsys):
    args = ["generate", str(specjax.embedded("target")), "--prompt", P[0], "--max-new-tokens", "4", "--logprobs",
            "--top-logprobs", "2", "--dtype", "fp32"]
    assert cli_main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = specjax.generate(t, P[:1], max_new_tokens=4, logprobs=True, top_logprobs=2)
    row = out["outputs"][0]
    assert row["token_ids"] == want.tokens[0] and row["text"] == want.texts[0]
    np.testing.assert_allclose(row["logprobs"], want.logprobs[0], rtol=1e-5)
    assert len(row["top_logprobs"][0]) == 2 and out["stats"]["generated_tokens"] == 4
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert "logprobs:" in captured.out and "tokens_per_s" not in captured.out  # stats on stderr
    assert "tokens_per_s" in captured.err


def test_cli_plan_memory_names_the_directory_of_a_config_json(capsys):
    config = specjax.embedded("target") / "config.json"
    assert cli_main(["plan", "--memory", "--target", str(config), "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "target" in out and "config.json" not in out


def test_bench_ar_warns_that_short_runs_exaggerate(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert cli_main(["bench", "ar", "--max-new-tokens", "4", "--dry-run"]) == 0
    assert "short run" in capsys.readouterr().err
    assert cli_main(["bench", "ar", "--max-new-tokens", "128", "--dry-run"]) == 0
    assert "short run" not in capsys.readouterr().err


# ---------------------------------------------------------------- notebook


def test_import_in_a_kernel_without_ipywidgets_prints_no_tqdm_warning():
    """A Jupyter kernel without ipywidgets: tqdm.auto would warn "IProgress not found" at import."""
    code = """
import sys, types, warnings
import flax.nnx, jax  # imported before the kernel is faked (treescope looks for a real IPython)
class ZMQInteractiveShell:
    config = {"IPKernelApp": {}}
ipython = types.ModuleType("IPython")
ipython.get_ipython = lambda: ZMQInteractiveShell()
sys.modules.update({"IPython": ipython, "ipykernel.zmqshell": types.ModuleType("ipykernel.zmqshell"),
                    "ipywidgets": None})  # what tqdm.autonotebook takes for a Jupyter kernel, without ipywidgets
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import specjax, specjax.train.trainer
print([str(w.message)[:60] for w in seen if "IProgress" in str(w.message)])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_draft_inspection_has_a_short_repr():
    ins = specjax.DraftInspection(root=7, tokens=np.arange(1, 5), logits=np.zeros((4, 4096), np.float32),
                                  confidence=np.full(4, 0.5, np.float32), tree_tokens=np.arange(5),
                                  tree_parents=np.arange(-1, 4))
    text = repr(ins)
    assert text == ("DraftInspection(root=7, tokens=[1, 2, 3, 4], confidence=[0.50, 0.50, 0.50, 0.50], "
                    "logits=<float32 [4, 4096]>)")
    page = ins._repr_html_()
    assert page.count("<tr>") == 5 and "0.500" in page


def test_top_level_namespace_holds_no_helpers():
    assert not hasattr(specjax, "PackageNotFoundError") and not hasattr(specjax, "version")
    assert specjax.__version__ and callable(specjax.chat_text)


# ---------------------------------------------------------------- warnings


def test_eagle3_init_params_raises_no_deprecation(t):
    """Flax's `var.value` is deprecated; pyproject makes a deprecation raised from specjax fail its test."""
    from specjax.drafters.eagle3 import init_params

    cfg = specjax.load_drafter(specjax.embedded("eagle3"), t).cfg
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        params = init_params(cfg, jax.random.key(0), t.params["embed"])
    assert all(math.isfinite(float(jnp.sum(x))) for x in jax.tree.leaves(params))
