"""The requests a load run sends: random token ids, a ShareGPT-style or JSONL file, or the embedded held-out prompts.

Each is a `Sample`: the prompt (text; token ids only for /v1/completions when no tokenizer is at hand), its length
in tokens as the client counts it, and the output length asked for (max_tokens). The reported token counts come
from the server's usage chunks where it sends them (client.py); these lengths are the fallback.

As vLLM's `vllm bench serve` makes them (vllm/benchmarks/datasets): random prompts draw their input and output
lengths uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)], and their ids uniformly from the
vocabulary less its special tokens, decoded to text; a ShareGPT file's conversations give their first user turn as
the prompt and the reply's length as the output length (pairs with a prompt or reply under 4 tokens, a prompt over
1024 or both over 2048 are skipped, as vLLM's `is_valid_sequence` does), shuffled by the seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

EMBEDDED_OUTPUT_LEN = 64  # the embedded prompts' default max_tokens
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's is_valid_sequence bounds
USER_ROLES, REPLY_ROLES = ("human", "user"), ("gpt", "assistant", "chatgpt", "bard", "model")


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str | list[int]
    prompt_len: int  # tokens by the client's tokenizer (0 when it has none: the server's usage count is used)
    output_len: int  # max_tokens


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """A `tokenizers` tokenizer from a tokenizer.json, or a directory holding one (a specjax or Hugging Face
    checkpoint); None for None."""
    if path is None:
        return None
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there; pass the checkpoint's directory or its "
                                f"tokenizer.json")
    return Tokenizer.from_file(str(file))


def random_samples(tokenizer: Tokenizer | None, n: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[Sample]:
    """n prompts of random ids at input_len tokens (+-range_ratio), decoded to text; each asks output_len
    (+-range_ratio) tokens."""
    if tokenizer is None:
        raise ValueError("--dataset-name random draws ids from the server's vocabulary: pass --tokenizer (the served "
                         "checkpoint's directory or its tokenizer.json)")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    for name, value in (("--random-input-len", input_len), ("--random-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    allowed = np.asarray([i for i in range(tokenizer.get_vocab_size()) if tokenizer.id_to_token(i) not in special])
    samples = []
    for _ in range(n):
        length = int(rng.integers(_low(input_len, range_ratio), _high(input_len, range_ratio) + 1))
        ids = rng.choice(allowed, size=length).tolist()
        text = tokenizer.decode(ids)
        out = int(rng.integers(_low(output_len, range_ratio), _high(output_len, range_ratio) + 1))
        samples.append(Sample(text, len(tokenizer.encode(text).ids), out))
    return samples


def file_samples(path: str | Path, tokenizer: Tokenizer | None, n: int, output_len: int | None,
                 seed: int) -> list[Sample]:
    """n samples from a .json list or a .jsonl file of ShareGPT conversations ({"conversations": [{"from", "value"},
    ...]}, OpenAI-style {"role", "content"} turns too) or of bare prompts ({"prompt": text}), shuffled by seed.
    output_len (--sharegpt-output-len / --output-len) overrides each reply's length; without it the reply is counted
    with the tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path} does not exist")
    text = path.read_text()
    items = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line]
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of conversations or prompts, got {type(items).__name__}")
    order = np.random.default_rng(seed).permutation(len(items))
    samples = []
    for i in order:
        prompt, reply = _prompt_and_reply(items[i], path, int(i))
        if prompt is None:
            continue
        prompt_len = len(tokenizer.encode(prompt).ids) if tokenizer is not None else 0
        if output_len is not None:
            samples.append(Sample(prompt, prompt_len, output_len))
        elif tokenizer is None or reply is None:
            raise ValueError(f"{path} item {i}: no output length; pass --sharegpt-output-len N (or --output-len N), "
                             f"or --tokenizer so each reply's length can be counted")
        else:
            reply_len = len(tokenizer.encode(reply, add_special_tokens=False).ids)
            if (prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT
                    or prompt_len + reply_len > SHAREGPT_MAX_TOTAL):
                continue
            samples.append(Sample(prompt, prompt_len, reply_len))
        if len(samples) == n:
            return samples
    raise ValueError(f"{path} gives {len(samples)} usable prompts, fewer than --num-prompts {n}")


def _prompt_and_reply(item: Any, path: Path, i: int) -> tuple[str | None, str | None]:
    """(first user turn, the reply after it) of a conversation, or (prompt, None); (None, None) for a conversation
    without a user turn."""
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"], None
    turns = item.get("conversations", item.get("conversation")) if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise ValueError(f"{path} item {i}: expected {{\"conversations\": [...]}} or {{\"prompt\": text}}, got "
                         f"{str(item)[:80]}")
    roles = [str(t.get("from", t.get("role", ""))).lower() for t in turns]
    texts = [t.get("value", t.get("content")) for t in turns]
    for j, role in enumerate(roles):
        if role in USER_ROLES and isinstance(texts[j], str):
            reply = texts[j + 1] if j + 1 < len(turns) and roles[j + 1] in REPLY_ROLES else None
            return texts[j], reply
    return None, None


def embedded_samples(manifest: str | Path, tokenizer: Tokenizer | None, n: int, output_len: int | None) -> list[Sample]:
    """The embedded tiny models' held-out prompts (their manifest.json), repeated in order to n."""
    prompts = [p["text"] for p in json.loads(Path(manifest).read_text()).get("held_out_prompts") or []]
    if not prompts:
        raise ValueError(f"{manifest} lists no held_out_prompts")
    out = output_len or EMBEDDED_OUTPUT_LEN
    return [Sample(p, len(tokenizer.encode(p).ids) if tokenizer is not None else 0, out)
            for p in (prompts[i % len(prompts)] for i in range(n))]


def _low(length: int, ratio: float) -> int:
    return max(1, math.floor(length * (1 - ratio)))


def _high(length: int, ratio: float) -> int:
    return math.ceil(length * (1 + ratio))
