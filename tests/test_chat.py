"""Chat templates (specjax/chat.py): prompt ids equal to transformers' apply_chat_template, on tiny checkpoints that
carry the published Llama 3.1/3.3, Llama 3.2 and Qwen3 templates (tests/fixtures/chat, sources in its README).

The tiny tokenizer is a byte-level BPE trained here on a few sentences, with every control token the templates write
(Llama's headers and <|eot_id|>, Qwen's <|im_start|> / <|im_end|> as special tokens, <think> and the tool tags as
plain added tokens, as Qwen3 ships them); the Llama one adds BOS in its post-processor, as Llama 3's tokenizer.json
does, so a doubled BOS would show.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import pytest
from hf_tiny import build_hf_model, save_hf_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import specjax
from specjax import chat
from specjax.cli import main
from specjax.convert.export import export
from specjax.decoding.request import prompt_ids

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
CORPUS = ["Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n", "You are a helpful assistant.",
          "Hello, how are you? What is the weather in Paris today?", "Let me think about it. The answer is 42."]
VOCAB = 512  # the tiny model's; the tokenizer holds about 400

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds en français."}
USER = {"role": "user", "content": "Hello, how are you?"}
ASSISTANT = {"role": "assistant", "content": "I am fine. "}
USER2 = {"role": "user", "content": "What is the weather in Paris today?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <now> & \"then\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tiny_tokenizer(bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=LLAMA_SPECIAL + QWEN_SPECIAL, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    assert tok.get_vocab_size() <= VOCAB
    return tok


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    model = build_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    return save_hf_model(model, tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def make_dir(weights, tmp_path_factory):
    """A tiny model directory with the given tokenizer files (what a checkpoint on the Hub holds)."""
    def make(name: str, tokenizer_config: dict, *, bos: str | None = None, files: dict[str, str] | None = None,
             eos_ids: list[str] | None = None) -> Path:
        path = tmp_path_factory.mktemp(name)
        for file in ("config.json", "model.safetensors"):
            shutil.copyfile(weights / file, path / file)
        tok = tiny_tokenizer(bos)
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False))
        for rel, text in (files or {}).items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        if eos_ids is not None:
            (path / "generation_config.json").write_text(json.dumps(
                {"eos_token_id": [tok.token_to_id(t) for t in eos_ids]}))
        return path
    return make


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture(scope="module")
def llama31(make_dir) -> specjax.Target:
    """Llama-3.1-8B-Instruct's tokenizer files, shrunk: template in tokenizer_config.json, end-of-turn ids in
    generation_config.json ([128001, 128008, 128009] there: <|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
    path = make_dir("llama31", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                                "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
                                "chat_template": fixture("llama-3.1-instruct.jinja")},
                    bos="<|begin_of_text|>", eos_ids=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
    return specjax.load(path)


@pytest.fixture(scope="module")
def llama32(make_dir) -> specjax.Target:
    path = make_dir("llama32", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                                "eos_token": "<|eot_id|>", "chat_template": fixture("llama-3.2-instruct.jinja")},
                    bos="<|begin_of_text|>")
    return specjax.load(path)


@pytest.fixture(scope="module")
def qwen3(make_dir) -> specjax.Target:
    """Qwen3's tokenizer files, shrunk: no BOS, the template as chat_template.jinja (transformers 5's layout),
    end-of-turn ids [151645, 151643] there: <|im_end|>, <|endoftext|>. The class is PreTrainedTokenizerFast, not
    Qwen2Tokenizer: transformers 5 rebuilds a Qwen2Tokenizer's pre-tokenizer (Qwen2's split pattern, which the real
    tokenizer.json holds and this tiny one does not) instead of reading tokenizer.json's."""
    path = make_dir("qwen3", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                              "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace"},
                    files={"chat_template.jinja": fixture("qwen3.jinja")}, eos_ids=["<|im_end|>", "<|endoftext|>"])
    return specjax.load(path)


@lru_cache(maxsize=None)
def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def transformers_ids(path: Path, messages, add_generation_prompt: bool = True, **kwargs) -> tuple[list[int], str]:
    """transformers' own apply_chat_template of the directory: (ids, text)."""
    tok = hf_tokenizer(path)
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    ids = out if isinstance(out, list) else out["input_ids"]  # transformers 5 returns a BatchEncoding
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    return list(ids), text


def assert_as_transformers(target, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
    want_ids, want_text = transformers_ids(target.path, messages, add_generation_prompt, **kwargs)
    assert chat.chat_text(target, messages, add_generation_prompt, **kwargs) == want_text
    ids = specjax.apply_chat_template(target, messages, add_generation_prompt, **kwargs)
    assert ids == want_ids
    return ids


LLAMA_CASES = {
    "user": ([USER], {}),
    "system": ([SYSTEM, USER], {}),
    "multi_turn": ([SYSTEM, USER, ASSISTANT, USER2], {}),
    "no_generation_prompt": ([USER, ASSISTANT], {"add_generation_prompt": False}),
    "date_string": ([USER], {"date_string": "01 Jan 2025"}),
    "tools_in_user_message": ([SYSTEM, USER2], {"tools": TOOLS}),
    "tools_in_system": ([USER2], {"tools": TOOLS, "tools_in_user_message": False}),
    "tool_call_and_result": ([USER2, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": {"temp": 21}}], {"tools": TOOLS}),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama31_template_ids_equal_transformers(llama31, case):
    messages, kwargs = LLAMA_CASES[case]
    ids = assert_as_transformers(llama31, messages, **kwargs)
    bos = llama31.tokenizer.token_to_id("<|begin_of_text|>")
    assert ids.count(bos) == 1 and ids[0] == bos  # the template's BOS, not doubled by the tokenizer's post-processor


QWEN_CASES = {
    "user": ([USER], {}),
    "no_thinking": ([USER], {"enable_thinking": False}),
    "thinking_on": ([USER], {"enable_thinking": True}),
    "system": ([SYSTEM, USER], {"enable_thinking": False}),
    "multi_turn_think_in_content": ([USER, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFine."}, USER2],
                                    {}),
    "reasoning_content": ([USER, {"role": "assistant", "content": "Fine.", "reasoning_content": "hmm"}], {}),
    "reasoning_alias": ([USER, {"role": "assistant", "content": "Fine.", "reasoning": "hmm"}],
                        {"add_generation_prompt": False}),
    "no_generation_prompt": ([USER, ASSISTANT], {"add_generation_prompt": False}),
    "tools": ([SYSTEM, USER2], {"tools": TOOLS}),
    "tool_result": ([USER2, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C"}], {"tools": TOOLS}),
}


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
def test_qwen3_template_ids_equal_transformers(qwen3, case):
    messages, kwargs = QWEN_CASES[case]
    assert_as_transformers(qwen3, messages, **kwargs)


def test_qwen3_enable_thinking_false_closes_an_empty_think_block(qwen3):
    text = chat.chat_text(qwen3, [USER], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.chat_text(qwen3, [USER]).endswith("<|im_start|>assistant\n")
    assert '"description": "Météo <now> & \\"then\\""' in chat.chat_text(qwen3, [USER], tools=TOOLS)  # tojson as is


def test_tokenize_false_returns_the_text_as_transformers(qwen3):
    """Issue 44: specjax.apply_chat_template(target, chat, tokenize=False) is transformers' rendered text (it was passed
    to the template as a variable, and ids came back); specjax.chat_text is the same function."""
    ids, text = transformers_ids(qwen3.path, [USER], enable_thinking=False)
    assert specjax.apply_chat_template(qwen3, [USER], tokenize=False, enable_thinking=False) == text
    assert specjax.chat_text(qwen3, [USER], enable_thinking=False) == text
    assert specjax.apply_chat_template(qwen3, [USER], tokenize=True, enable_thinking=False) == ids
    with pytest.raises(TypeError, match="tokenize must be True"):
        specjax.apply_chat_template(qwen3, [USER], tokenize="no")


def test_llama_dates(llama31, llama32):
    """Llama 3.1's date is date_string, "26 Jul 2024" by default; Llama 3.2's is today's through strftime_now."""
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" in chat.chat_text(llama31, [USER])
    assert "Today Date: 01 Jan 2025\n" in chat.chat_text(llama31, [USER], date_string="01 Jan 2025")
    today = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}\n" in chat.chat_text(llama32, [USER])
    assert_as_transformers(llama32, [SYSTEM, USER])
    assert_as_transformers(llama32, [USER], date_string="01 Jan 2025")


# A template exercising the environment itself: special tokens (named, a custom *_token, extra_special_tokens),
# tojson's options, dict(), namespace(), loop controls, the generation block, trim_blocks / lstrip_blocks.
ENVIRONMENT_TEMPLATE = """{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}|{{ think_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if loop.index > 2 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}
{% endfor %}
{{ ns.n }} {{ dict(a=1, b=[2, "é"]) | tojson }} {{ {"z": 1, "a": "<&>"} | tojson(indent=2, sort_keys=true) }}
{{ messages | tojson(separators=(",", ":")) }} {{ tools | tojson }} {{ documents | tojson }} {{ extra }}
{%- if add_generation_prompt %}<go>{% endif %}"""


def test_template_environment_matches_transformers(make_dir):
    path = make_dir("environment", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False},
        "pad_token": "<|end_of_text|>", "image_token": "<|python_tag|>", "add_bos_token": True,
        "extra_special_tokens": {"think_token": "<think>"}, "chat_template": ENVIRONMENT_TEMPLATE})
    target = specjax.load(path)
    messages = [SYSTEM, USER, {"role": "assistant", "content": "x", "weight": None}]
    documents = [{"title": "t", "text": "a < b"}]
    assert_as_transformers(target, messages, extra=3, documents=documents)
    assert_as_transformers(target, messages, add_generation_prompt=False)
    text = chat.chat_text(target, messages, extra=3)
    assert text.startswith("<|begin_of_text|>|<|eot_id|>|<|end_of_text|>|<|python_tag|>|<think>\n")


def test_template_sources_follow_transformers(make_dir):
    """chat_template.jinja wins over tokenizer_config.json; of named templates, 'tool_use' with tools, else 'default';
    additional_chat_templates/*.jinja are named templates."""
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eot_id|>"}
    both = make_dir("both", {**base, "chat_template": "config {{ messages[0].content }}"},
                    files={"chat_template.jinja": "file {{ messages[0].content }}"})
    assert chat.chat_text(specjax.load(both), [USER]) == "file Hello, how are you?"
    assert_as_transformers(specjax.load(both), [USER])

    named = make_dir("named", {**base, "chat_template": [
        {"name": "default", "template": "default {{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools {{ tools[0].function.name }}"}]})
    target = specjax.load(named)
    assert chat.chat_text(target, [USER]) == "default Hello, how are you?"
    assert chat.chat_text(target, [USER], tools=TOOLS) == "tools get_weather"
    assert_as_transformers(target, [USER], tools=TOOLS)

    files = make_dir("files", base, files={"chat_template.jinja": "default", "additional_chat_templates/tool_use.jinja":
                                           "tools {{ tools | length }}"})
    assert chat.chat_text(specjax.load(files), [USER], tools=TOOLS) == "tools 1"
    assert_as_transformers(specjax.load(files), [USER], tools=TOOLS)


def test_chat_prompts_in_prompt_ids_and_generate(llama31, qwen3):
    messages = [SYSTEM, USER]
    rendered = specjax.apply_chat_template(qwen3, messages, enable_thinking=False)
    got = prompt_ids(qwen3, [messages, "plain text", [5, 6, 7]], chat_template_kwargs={"enable_thinking": False})
    assert got == [rendered, qwen3.encode("plain text"), [5, 6, 7]]
    assert prompt_ids(qwen3, [messages]) == [specjax.apply_chat_template(qwen3, messages)]
    assert chat.render_prompt(qwen3, "text") == "text" and chat.render_prompt(qwen3, [1, 2]) == [1, 2]
    assert chat.is_chat(messages) and not chat.is_chat("hi") and not chat.is_chat([1, 2]) and not chat.is_chat([])

    out = specjax.generate(llama31, [messages], max_new_tokens=3)
    same = specjax.generate(llama31, [specjax.apply_chat_template(llama31, messages)], max_new_tokens=3)
    assert out.tokens == same.tokens and len(out.tokens[0]) >= 1
    thinking_off = specjax.generate(qwen3, [messages], max_new_tokens=3, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.tokens == specjax.generate(qwen3, [rendered], max_new_tokens=3).tokens
    streamed = list(specjax.stream(qwen3, [messages], max_new_tokens=3, chat_template_kwargs={"enable_thinking": False}))
    assert sum((c.token_ids for c in streamed), []) == thinking_off.tokens[0]


def test_instruct_targets_stop_at_their_end_of_turn_ids(llama31, qwen3):
    """generation_config.json's eos_token_id list is what generation stops at (loading/target.py)."""
    ids = llama31.tokenizer.token_to_id
    assert llama31.cfg.eos_token_ids == (ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>"))
    assert qwen3.cfg.eos_token_ids == (ids("<|im_end|>"), ids("<|endoftext|>"))


def test_cli_generate_chat(llama31, capsys):
    args = ["generate", str(llama31.path), "--chat", "--system", SYSTEM["content"], "--prompt", USER["content"],
            "--max-new-tokens", "3", "--chat-template-kwargs", '{"date_string": "01 Jan 2025"}']
    assert main(args) == 0
    printed = capsys.readouterr().out
    ids = specjax.apply_chat_template(llama31, [SYSTEM, USER], date_string="01 Jan 2025")
    want = specjax.generate(llama31, [ids], max_new_tokens=3)
    assert f"--- 0: {want.texts[0]}\n" in printed

    assert main(["generate", str(llama31.path), "--system", "x", "--prompt", "Hi"]) == 2
    assert "--system only apply to a chat: add --chat" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", str(llama31.path), "--chat", "--prompt", "Hi", "--chat-template-kwargs", "[1]"])


def test_refusals(llama31, qwen3, make_dir, tmp_path):
    base = make_dir("base", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"})
    with pytest.raises(ValueError, match="has no chat template .* base model; pass a string prompt"):
        specjax.apply_chat_template(specjax.load(base), [USER])

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(qwen3.path, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json: a conversation"):
        specjax.apply_chat_template(specjax.load(no_tokenizer), [USER])

    for bad in ([], "Hi", USER, [{"content": "Hi"}], [{"role": "user"}], [USER, "Hi"]):
        with pytest.raises(ValueError, match="conversation"):
            specjax.apply_chat_template(qwen3, bad)
    with pytest.raises(ValueError, match="tools must be a list"):
        specjax.apply_chat_template(qwen3, [USER], tools=[print])

    # raise_exception's message surfaces: Llama 3.1 puts tools in the first user message, and there is none.
    with pytest.raises(ValueError, match="Cannot put tools in the first user message when there's no first user"):
        specjax.apply_chat_template(llama31, [SYSTEM], tools=TOOLS)
    broken = make_dir("broken", {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{% if %}"})
    with pytest.raises(ValueError, match="does not parse"):
        specjax.apply_chat_template(specjax.load(broken), [USER])

    with pytest.raises(ValueError, match="chat_template_kwargs applies to conversations"):
        prompt_ids(qwen3, ["text"], chat_template_kwargs={"enable_thinking": False})
    for bare in ([SYSTEM, USER], "text"):  # not a list of prompts: render_prompts leaves it to prompt_ids to say so
        assert chat.render_prompts(qwen3, bare, {"enable_thinking": False}) is bare
    with pytest.raises(ValueError, match=r"one conversation as \[messages\]"):
        prompt_ids(qwen3, [SYSTEM, USER], chat_template_kwargs={"enable_thinking": False})


def test_convert_and_export_carry_the_chat_template(llama31, qwen3, make_dir, tmp_path):
    """specjax convert copies chat_template.jinja, additional_chat_templates/ and tokenizer_config.json's
    chat_template; specjax export writes them back, and transformers renders the export as it rendered the source."""
    source = make_dir("with_named", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"},
                      files={"chat_template.jinja": fixture("qwen3.jinja"),
                             "additional_chat_templates/tool_use.jinja": "tools {{ tools | length }}"})
    for src in (llama31.path, source):
        ckpt = specjax.convert(src, tmp_path / f"{src.name}-ckpt")
        hf = export(ckpt, tmp_path / f"{src.name}-hf")
        for rel in ("tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja"):
            assert (ckpt / rel).is_file() == (src / rel).is_file() == (hf / rel).is_file(), rel
            if (src / rel).is_file():
                assert (hf / rel).read_bytes() == (src / rel).read_bytes()
        messages = [SYSTEM, USER, ASSISTANT, USER2]
        want = specjax.apply_chat_template(specjax.load(src), messages)
        assert specjax.apply_chat_template(specjax.load(ckpt), messages) == want
        assert transformers_ids(hf, messages)[0] == want
    assert chat.chat_text(specjax.load(tmp_path / f"{source.name}-ckpt"), [USER], tools=TOOLS) == "tools 1"
