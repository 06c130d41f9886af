"""What a new user hit (issue 23), each call as they made it: documented features that crashed, Python's errors
where ours belong, and the CLI's rough edges. Most checks fail before anything compiles; the ones that decode use
the embedded pair at a few tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specjax
from specjax.cli import main as cli_main
from specjax.decoding.request import GenerateOutput
from specjax.loading.embedded import EMBEDDED_DIR, EMBEDDED_NAMES
from specjax.planning.profile import cost_model

if not (EMBEDDED_DIR / "target" / "config.json").is_file():
    pytest.skip("no embedded checkpoints in this checkout", allow_module_level=True)

PROMPTS = ["def f(x):", "import os\n"]


@pytest.fixture(scope="module")
def target():
    return specjax.load(specjax.embedded("target"))


@pytest.fixture(scope="module")
def draft(target):
    return specjax.load_drafter(specjax.embedded("draft"), target)


@pytest.fixture(scope="module")
def plain(target):
    return specjax.generate(target, PROMPTS, max_new_tokens=6)


# ---------------------------------------------------------------- defect 1: "off"


@pytest.mark.parametrize("kwargs", [{"num_draft_tokens": "off"}, {"tree": "off"},
                                    {"num_draft_tokens": "off", "tree": "off"}])
def test_off_runs_the_plain_loop(target, draft, plain, kwargs):
    out = specjax.generate(target, PROMPTS, max_new_tokens=6, drafter=draft, **kwargs)
    assert out.tokens == plain.tokens
    assert out.stats["plan"]["shape"] == "off" and out.stats["drafter_calls"] == 0


def test_off_with_a_shape_is_refused(target, draft):
    with pytest.raises(ValueError, match="'off' runs the plain loop"):
        specjax.generate(target, PROMPTS, drafter=draft, num_draft_tokens="off", tree="kary:2,1")
    with pytest.raises(ValueError, match="'off' drafts nothing"):  # not silently ignored
        specjax.generate(target, PROMPTS, drafter=draft, num_draft_tokens="off", scheduler="confidence")


# ---------------------------------------------------------------- defect 2: plan's roofline for every family


@pytest.mark.parametrize("name", ["eagle3", "mtp", "dflash", "dspark", "draft"])
def test_roofline_prices_every_family(target, name):
    drafter = specjax.load_drafter(specjax.embedded(name), target)
    for device in ("h100", "cpu"):
        cm = cost_model(device, target.cfg, drafter, 512, None)
        depth1, depth4 = cm.draft_s(1, 1), cm.draft_s(1, 4)
        assert depth1 > 0 and cm.verify_s(8, 4) > 0
        if name in ("dflash", "dspark"):  # one pass over the whole block, whatever the depth
            assert depth4 == depth1 and "one pass per block" in cm.source
        else:
            assert depth4 == pytest.approx(4 * depth1)
    # A head reads far fewer bytes than the target: drafting one level costs less than a target step.
    assert cm.draft_s(1, 1) < cm.verify_s(1, 1)


def test_plan_cli_with_a_head_on_the_roofline(capsys):
    code = cli_main(["plan", "--target", str(specjax.embedded("target")), "--drafter", str(specjax.embedded("eagle3")),
                     "--concurrency", "1", "--device", "h100", "--calibrate-prompts", "1",
                     "--calibrate-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "eagle3 head" in out and "roofline" in out


# ---------------------------------------------------------------- defect 4: self-drafting


def test_the_targets_own_dir_is_not_a_draft_model(target):
    with pytest.raises(ValueError, match="draft with the target itself.*checkpoints/tiny/mtp"):
        specjax.load_drafter(specjax.embedded("target"), target)
    assert type(specjax.load_drafter(specjax.embedded("mtp"), target)).__name__ == "MtpDrafter"


def test_docs_document_every_shipped_model():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text() + (root / "docs" / "loading.md").read_text()  # "The embedded models"
    for name in EMBEDDED_NAMES:
        assert f"checkpoints/tiny/{name}" in readme or f'"{name}"' in readme, name


# ---------------------------------------------------------------- rough edges: wrong types


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 10.0}, "max_new_tokens must be an int, got 10.0"),
    ({"max_new_tokens": "10"}, "max_new_tokens must be an int, got '10'"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int"),
    ({"max_len": 256.0}, "max_len must be an int"),
    ({"drafter": "DRAFT", "num_draft_tokens": 4.0}, "num_draft_tokens must be an int K"),
    ({"drafter": "checkpoints/tiny/draft"}, r"pass specjax.load_drafter\(path, target\)"),
    ({"drafter": "TARGET"}, "got a Target"),
    ({"drafter": object()}, "Drafter protocol"),
])
def test_wrong_types_say_what_to_pass(target, draft, kwargs, match):
    kwargs = {k: {"TARGET": target, "DRAFT": draft}.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(TypeError, match=match):
        specjax.generate(target, PROMPTS, **kwargs)


def test_a_path_as_the_target_says_load_it_first():
    with pytest.raises(TypeError, match=r"load the target first"):
        specjax.generate(str(specjax.embedded("target")), PROMPTS)


def test_prompts_that_are_not_a_list_of_prompts(target):
    with pytest.raises(ValueError, match="wrap one prompt of token ids as"):
        specjax.generate(target, [7, 30, 12])


def test_inspect_draft_takes_one_prompt(target, draft):
    with pytest.raises(TypeError, match=r"call it once per prompt"):
        specjax.inspect_draft(target, draft, PROMPTS)
    with pytest.raises(TypeError, match="load_drafter"):
        specjax.inspect_draft(target, "checkpoints/tiny/draft", PROMPTS[0])


def test_confidence_scheduler_without_confidences_names_itself(target, draft):
    with pytest.raises(ValueError, match="scheduler='confidence' needs a drafter that reports confidences"):
        specjax.generate(target, PROMPTS, max_new_tokens=4, drafter=draft, num_draft_tokens=2,
                         scheduler="confidence", scheduler_profile="roofline")


# ---------------------------------------------------------------- rough edges: the CLI


def test_cli_generate_passes_every_option(monkeypatch, capsys):
    seen = {}

    def fake_generate(target, prompts, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return GenerateOutput([[1]] * len(prompts), {"tokens_per_s": 1.0}, ["x"] * len(prompts),
                              finish_reasons=["length"] * len(prompts))

    monkeypatch.setattr(specjax, "generate", fake_generate)
    args = ["generate", str(specjax.embedded("target")), "--prompt", "a", "--prompt", "b", "--drafter", "ngram",
            "--num-draft-tokens", "auto", "--eos", "0,5", "--max-len", "256", "--max-new-tokens", "3"]
    assert cli_main(args) == 0
    assert seen["prompts"] == ["a", "b"] and type(seen["drafter"]).__name__ == "NgramDrafter"
    assert seen["num_draft_tokens"] == "auto" and seen["eos_token_id"] == [0, 5] and seen["max_len"] == 256
    assert cli_main(args[:8] + ["--tree", "auto", "--scheduler", "confidence"]) == 0
    assert seen["tree"] == "auto" and seen["scheduler"] == "confidence"
    assert cli_main(args[:8] + ["--num-draft-tokens", "off", "--eos", ""]) == 0
    assert seen["num_draft_tokens"] == "off" and seen["eos_token_id"] == []
    assert cli_main(args[:4] + ["--stop", "\n\n", "--stop", "END", "--stop-token-ids", "7", "--temperature", "0.7",
                                "--min-p", "0.05", "--repetition-penalty", "1.1", "--min-tokens", "2"]) == 0
    assert seen["stop"] == ["\n\n", "END"] and seen["stop_token_ids"] == [7] and seen["temperature"] == 0.7
    assert seen["min_p"] == 0.05 and seen["repetition_penalty"] == 1.1 and seen["min_tokens"] == 2
    assert seen["top_k"] is None  # unset: the checkpoint's generation_config.json decides
    with pytest.raises(SystemExit):
        cli_main(args[:4] + ["--num-draft-tokens", "four"])
    assert "expected a chain length K, 'auto' or 'off'" in capsys.readouterr().err


def test_cli_generate_with_ngram_runs(capsys):
    assert cli_main(["generate", str(specjax.embedded("target")), "--prompt", "def f(x):", "--drafter", "ngram",
                     "--max-new-tokens", "4"]) == 0
    assert "--- 0:" in capsys.readouterr().out


def test_cli_text_prompt_without_a_tokenizer(tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(specjax.embedded("target"), bare)
    (bare / "tokenizer.json").unlink()
    assert cli_main(["generate", str(bare), "--prompt", "def f(x):"]) == 2
    assert "space-separated token ids" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_fails_first(monkeypatch, capsys):
    from specjax.planning import advisor

    monkeypatch.setattr(advisor, "find_spec", lambda name: None)
    monkeypatch.setattr(advisor, "load_pair", lambda *a: pytest.fail("loaded models before checking --plot"))
    assert cli_main(["plan", "--drafter", "ngram", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_cli_bench_ar_without_torch_says_no_hf(monkeypatch, capsys):
    from specjax.bench import ar

    monkeypatch.setattr(ar, "find_spec", lambda name: None)
    monkeypatch.setattr(ar, "run_ar", lambda *a, **k: pytest.fail("started the benchmark"))
    assert cli_main(["bench", "ar", "--preset", "tiny20m"]) == 2
    assert "--no-hf" in capsys.readouterr().err


def test_cli_convert_messages(tmp_path, capsys):
    assert cli_main(["convert", str(specjax.embedded("target")), str(tmp_path / "x")]) == 2
    assert "already a specjax checkpoint" in capsys.readouterr().err
    from hf_tiny import build_hf_model, save_hf_model

    src = save_hf_model(build_hf_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64),
                        tmp_path / "hf")
    (tmp_path / "exists").mkdir()
    assert cli_main(["convert", str(src), str(tmp_path / "exists")]) == 2
    assert "--overwrite" in capsys.readouterr().err


# ---------------------------------------------------------------- rough edges: notebook manners


def test_generate_output_repr_is_a_short_summary():
    out = GenerateOutput([list(range(500))] * 40, {"generated_tokens": 20000, "tokens_per_s": 1234.5678,
                                                   "compile_s": 3.21, "acceptance_length": 2.5,
                                                   "per_position_acceptance": [0.5] * 500,
                                                   "plan": {"shape": "chain:3", "p_rank": [0.1] * 50}},
                         ["x" * 1000] * 40)
    text = repr(out)
    assert text == "GenerateOutput(rows=40, tokens=20000, tau=2.5, tokens_per_s=1.23e+03, compile_s=3.21, plan=chain:3)"
    page = out._repr_html_()
    assert page.count("<tr>") == 1 + 16 + 1 and "24 more rows" in page and len(page) < 5000


def test_version_and_embedded():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert specjax.__version__ == pyproject["project"]["version"]
    for name in EMBEDDED_NAMES:
        assert json.loads((specjax.embedded(name) / "config.json").read_text())
    with pytest.raises(ValueError, match="the shipped ones are"):
        specjax.embedded("llama")
