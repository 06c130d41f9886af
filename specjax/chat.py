"""Chat templates: a conversation (a list of {"role", "content"} messages) -> the prompt ids an Instruct model expects.

The template is the checkpoint's own, found where transformers looks (tokenization_utils_base.py, `_from_pretrained`
and `get_chat_template`): `chat_template.jinja` and `additional_chat_templates/*.jinja`, which take priority, else
tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"}); of several, "tool_use" when
tools are given and the template has one, else "default". It is rendered by jinja2 as transformers' apply_chat_template
renders it (utils/chat_template_utils.py, `_cached_compile_jinja_template` and `render_jinja_template`): a sandboxed,
immutable environment with trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` block, a `tojson`
that does not escape HTML, `raise_exception`, `strftime_now`, and the variables messages, tools, documents,
add_generation_prompt, the tokenizer's special tokens (bos_token, eos_token, ...) and the caller's keywords. The text
is tokenised without adding special tokens (the template writes its own BOS), as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from specjax.models.target import Target

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one message's reasoning, by any of its names


# ---- prompts as generate takes them ---------------------------------------------------------------------------


def is_chat(prompt: Any) -> bool:
    """A prompt that is a conversation: a list holding message dicts (not a string, not token ids)."""
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes))
            and any(isinstance(m, Mapping) for m in prompt))


def render_prompt(target: Target, prompt: Any, chat_template_kwargs: dict | None = None) -> str | list[int]:
    """One prompt as the loops take it: a conversation rendered to ids (add_generation_prompt on), anything else
    (a string, token ids) returned as it is."""
    if not is_chat(prompt):
        return prompt
    return apply_chat_template(target, prompt, **(chat_template_kwargs or {}))


def render_prompts(target: Target, prompts: Sequence, chat_template_kwargs: dict | None = None) -> list:
    """`render_prompt` of every prompt; chat_template_kwargs without any conversation among them is refused (it would
    change nothing). What is not a list of prompts (a string, one bare conversation) comes back as it is, for
    request.prompt_ids to say what to pass."""
    if is_chat(prompts) or isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        return prompts
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a dict of template variables, like "
                             f"{{'enable_thinking': False}}; got {type(chat_template_kwargs).__name__}")
        if not any(is_chat(p) for p in prompts):
            raise ValueError("chat_template_kwargs applies to conversations, and no prompt is one: pass each chat as "
                             "a list of {'role', 'content'} messages")
    return [render_prompt(target, p, chat_template_kwargs) for p in prompts]


# ---- rendering ------------------------------------------------------------------------------------------------


def apply_chat_template(target: Target, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                        tokenize: bool = True, **template_kwargs) -> list[int] | str:
    """The prompt ids of a conversation: the checkpoint's chat template rendered, tokenised without special tokens.

    Equal to transformers' `AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, add_generation_prompt=
    True, tokenize=tokenize)`.

    Args:
        target: a `Target` loaded from a directory with a chat template and tokenizer.json.
        messages: a non-empty list of {"role": ..., "content": ...} dicts.
        add_generation_prompt: end with the template's assistant header, so the model answers.
        tokenize: False gives the rendered text instead, as `chat_text` does.
        **template_kwargs: template variables (Qwen3's enable_thinking=False, Llama 3.1's date_string,
            tools=[JSON schemas], documents=[...]).

    Returns:
        The prompt's token ids (tokenize=True) or its text.

    Raises:
        ValueError: no chat template or tokenizer, a malformed conversation, or the template's own error
            (`raise_exception`'s message).
        TypeError: a target that is not a `Target`, or a tokenize that is not a bool.

    Example:
        ```python
        ids = specjax.apply_chat_template(target, [{"role": "user", "content": "What is XLA?"}], enable_thinking=False)
        ```
    """
    if not isinstance(tokenize, bool):
        raise TypeError(f"tokenize must be True (prompt ids) or False (the rendered text), got {tokenize!r}")
    text = chat_text(target, messages, add_generation_prompt, **template_kwargs)
    return target.tokenizer.encode(text, add_special_tokens=False).ids if tokenize else text


def chat_text(target: Target, messages: Sequence[Mapping], add_generation_prompt: bool = True,
              **template_kwargs) -> str:
    """The rendered conversation as text (transformers' apply_chat_template with tokenize=False).

    Args:
        target: as `apply_chat_template`'s.
        messages: as `apply_chat_template`'s.
        add_generation_prompt: as `apply_chat_template`'s.
        **template_kwargs: template variables, as `apply_chat_template`'s.

    Returns:
        The text the template renders.

    Raises:
        ValueError: as `apply_chat_template`.
        TypeError: a target that is not a `Target`.
    """
    directory = _template_directory(target)
    messages = checked_messages(messages)
    tools, documents = template_kwargs.pop("tools", None), template_kwargs.pop("documents", None)
    _check_dicts("tools", tools, "a JSON schema dict like {'type': 'function', 'function': {...}}")
    _check_dicts("documents", documents, "a dict like {'title': ..., 'text': ...}")
    source = chat_template(directory, tools is not None)
    variables = {**template_tokens(directory), **template_kwargs}  # the caller's keywords win, as in transformers
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template of {directory} does not parse (line {err.lineno}: {err.message})") from None
    try:
        return template.render(messages=_plain(messages), tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **_plain(variables))
    except jinja2.TemplateError as err:  # raise_exception's message, or an undefined name the template needed
        raise ValueError(f"the chat template of {directory} raised an error on these messages: {err}") from None


def _template_directory(target: Target) -> Path:
    """The checkpoint directory whose template and special tokens a conversation is rendered with."""
    if not isinstance(target, Target):
        hint = " (load it first: target = specjax.load(path))" if isinstance(target, (str, PathLike)) else ""
        raise TypeError(f"a chat template is rendered for a specjax Target, got {type(target).__name__}{hint}")
    if target.tokenizer is None:
        raise ValueError(f"{target.path or 'this target'} has no tokenizer.json: a conversation is rendered to text "
                         "and tokenised with the checkpoint's tokenizer; pass token ids instead")
    if target.path is None:
        raise ValueError("this target was built in code, without a checkpoint directory to read a chat template "
                         "from: load it with specjax.load(path), or pass token ids")
    return Path(target.path)


def checked_messages(messages: Any) -> list[dict]:
    """The conversation as transformers passes it to a template: dicts without their None values, reasoning under
    each of its names; anything that is not a non-empty list of {"role", "content"} dicts is refused."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise ValueError(f"a conversation is a non-empty list of {{'role': ..., 'content': ...}} dicts, like "
                         f"[{{'role': 'user', 'content': 'Hi'}}]; got {_describe(messages)}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not (
                "content" in message or "tool_calls" in message):
            raise ValueError(f"message {i} of the conversation must be a dict with a 'role' string and a 'content' "
                             f"(or 'tool_calls'), like {{'role': 'user', 'content': 'Hi'}}; got {_describe(message)}")
        out.append(_with_reasoning_aliases({k: v for k, v in message.items() if v is not None}))
    return out


def _with_reasoning_aliases(message: dict) -> dict:
    """A message's reasoning also as `reasoning_content` (what templates read) and `thinking` (gpt-oss's)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _check_dicts(name: str, value: Any, expected: str) -> None:
    """tools / documents: None or a list of dicts (a tool given as a Python function is not converted here)."""
    if value is None:
        return
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not all(
            isinstance(v, Mapping) for v in value):
        raise ValueError(f"{name} must be a list, each entry {expected}; got {_describe(value)}")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _plain(value: Any) -> Any:
    """Plain JSON-like data only (transformers' _plain_template_data): a template from the Hub is untrusted code, so
    it never sees the methods of the caller's objects; any other object becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # a subclass (an enum, a numpy string): its plain value only
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


# ---- the checkpoint's template and special tokens ---------------------------------------------------------------


def chat_template(directory: Path, with_tools: bool = False) -> str:
    """The template transformers would use for this directory (see the module docstring); refused when it has none."""
    templates = template_sources(directory)
    if templates is None:
        raise ValueError(f"{directory} has no chat template (no {TEMPLATE_FILE}, no 'chat_template' in "
                         f"{TOKENIZER_CONFIG}): it is probably a base model; pass a string prompt or token ids")
    if isinstance(templates, str):
        return templates
    if with_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" not in templates:
        raise ValueError(f"{directory} has several chat templates and none named 'default': {sorted(templates)}")
    return templates["default"]


def template_sources(directory: Path) -> str | dict[str, str] | None:
    """The directory's chat template, or its named templates; the .jinja files take priority over
    tokenizer_config.json's `chat_template`."""
    files = {p.stem: p for p in sorted((directory / TEMPLATE_DIR).glob("*.jinja"))}
    if (directory / TEMPLATE_FILE).is_file():
        files["default"] = directory / TEMPLATE_FILE
    if files:
        named = {name: path.read_text(encoding="utf-8") for name, path in files.items()}
        return named["default"] if list(named) == ["default"] else named
    template = _read_json(directory / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


def template_tokens(directory: Path) -> dict[str, str]:
    """The special tokens transformers passes to a template (its tokenizer's special_tokens_map): the named ones and
    any other `*_token` string of tokenizer_config.json, its `extra_special_tokens` when a dict, and
    special_tokens_map.json's entries when the config has no `added_tokens_decoder` (transformers' legacy path)."""
    config = _read_json(directory / TOKENIZER_CONFIG)
    if "added_tokens_decoder" not in config:
        config = {**config, **_read_json(directory / SPECIAL_TOKENS_MAP)}
    entries = {**{k: v for k, v in config.items() if k.endswith("_token")}, **_extra_tokens(config)}
    tokens = {k: _token_text(v) for k, v in entries.items()}
    return {k: v for k, v in tokens.items() if v is not None}


def _extra_tokens(config: dict) -> dict:
    extra = config.get("extra_special_tokens")
    return extra if isinstance(extra, dict) else {}


def _token_text(value: Any) -> str | None:
    """A token as tokenizer_config.json stores it: a string, or an AddedToken dict {"content": ...}; else None."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err}); re-download it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}; re-download it")
    return data


# ---- the jinja environment transformers renders in --------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it for training masks;
    rendering a prompt keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(Namespace):
    """jinja2's `namespace()` refusing underscore names, as transformers' sandbox does (no route to internals)."""

    def __init__(*args, **kwargs):  # jinja2's own signature, so that namespace(self=...) stays a plain attribute
        _refuse_private(dict(*args[1:], **kwargs))
        Namespace.__init__(*args, **kwargs)

    def __setitem__(self, name, value):
        _refuse_private([name])
        super().__setitem__(name, value)


def _refuse_private(names) -> None:
    for name in names:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the underscore name {name!r} on a "
                                                  "namespace")


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """json.dumps with transformers' defaults (jinja2's own tojson escapes HTML characters and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """A template compiled once per source text, in transformers' environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(),
                       namespace=_Namespace)
    return env.from_string(source)
