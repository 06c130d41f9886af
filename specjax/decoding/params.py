"""`specjax.SamplingParams`: one request's sampling and output settings (vLLM's names), checked in one place.

generate, stream and the engine take the same settings; `validate` checks them before anything is built (types,
finite values, ranges, per-prompt counts, token ids inside the vocabulary), each error naming its argument and
saying what would be right, so that one bad request is refused alone. Arrays (NumPy, JAX) are accepted wherever a
list is: a 1-d array is one value per prompt. `as_kwargs` gives generate's keyword arguments.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence

import numpy as np

from specjax.config import PenaltyConfig, SamplingConfig, per_row

# The most alternatives top_logprobs may ask for per token: vLLM's default max_logprobs. Each costs a top-k over the
# vocabulary per emitted token, and the output holds them all.
MAX_TOP_LOGPROBS = 20
# Settings that take one value for all prompts or one per prompt.
PER_PROMPT = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "min_tokens")
FLAGS = ("include_stop_str_in_output", "skip_special_tokens", "logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to continue a prompt, with vLLM's names and meanings; pass it as `generate(..., sampling_params=...)`.

    None means the checkpoint's generation_config.json as transformers applies it (see `specjax.generate`). Each
    per-prompt setting (PER_PROMPT) is one value for all prompts or a list (or 1-d array) of one per prompt; so is
    `stop` (a list of stop-string lists). Checked by `validate`, which names the first bad setting.

    Attributes:
        max_new_tokens: the output budget of every row.
        temperature: 0 is greedy.
        top_k: 0 is off.
        top_p: 1 is off.
        min_p: 0 is off.
        seed: an int, one per prompt, or None (fresh, reported back in the output's stats).
        stop: stop strings, matched on the decoded text.
        stop_token_ids: stop tokens beyond EOS.
        eos_token_id: overrides the checkpoint's EOS ids; [] disables them.
        include_stop_str_in_output: keep the stop string that ended a row in its text.
        skip_special_tokens: leave special tokens out of the text.
        logprobs: report each emitted token's raw log-probability.
        top_logprobs: also the n most likely (id, logprob) at each position, n <= MAX_TOP_LOGPROBS.
        repetition_penalty: 1 is off (over prompt and output).
        presence_penalty: 0 is off (over the output).
        frequency_penalty: 0 is off (over the output).
        min_tokens: EOS and stop tokens are held back until a row has this many.
        max_tokens: vLLM's name for max_new_tokens: give either.

    Example:
        ```python
        params = specjax.SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"])
        out = specjax.generate(target, prompts, sampling_params=params)
        ```
    """

    max_new_tokens: int = 128
    temperature: Any = None  # 0: greedy
    top_k: Any = None  # 0: off
    top_p: Any = None  # 1: off
    min_p: Any = None  # 0: off
    seed: Any = 0  # an int, one per prompt, or None (fresh)
    stop: Any = None  # stop strings, matched on the decoded text
    stop_token_ids: Any = None  # stop tokens beyond EOS
    eos_token_id: Any = None  # overrides the checkpoint's EOS ids; [] disables them
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False  # each emitted token's raw log-probability
    top_logprobs: int = 0  # also the n most likely (id, logprob) at each position, n <= MAX_TOP_LOGPROBS
    repetition_penalty: Any = None  # 1: off
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    min_tokens: Any = 0  # EOS and stop tokens held back until a row has this many
    max_tokens: int | None = None  # vLLM's name for max_new_tokens: give either

    def validate(self, vocab_size: int | None = None, n_prompts: int | None = None) -> "SamplingParams":
        """These settings checked and made plain (arrays and NumPy scalars as Python values, lists as tuples,
        max_tokens folded into max_new_tokens).

        Args:
            vocab_size: the target's vocabulary size, to check token ids (stop_token_ids, eos_token_id) against;
                None skips that check.
            n_prompts: the number of prompts, to check the per-prompt lists' lengths against; None skips it.

        Returns:
            A new SamplingParams holding the checked, plain values.

        Raises:
            TypeError: a setting of the wrong type (named, with what it takes).
            ValueError: a setting out of its range, a per-prompt list of the wrong length, or max_tokens and
                max_new_tokens both given differently; the first bad one is named.
        """
        v = {f.name: _plain(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        if v["max_tokens"] is not None:
            if v["max_new_tokens"] not in (128, v["max_tokens"]):
                raise ValueError(f"max_tokens={v['max_tokens']!r} and max_new_tokens={v['max_new_tokens']!r} are the "
                                 "same setting (vLLM's and transformers' names): give one")
            v["max_new_tokens"], v["max_tokens"] = v["max_tokens"], None
        if not _is_int(v["max_new_tokens"]):
            raise TypeError(f"max_new_tokens must be an int, got {v['max_new_tokens']!r} "
                            f"({type(v['max_new_tokens']).__name__})")
        if v["max_new_tokens"] <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {v['max_new_tokens']} (the tokens to generate "
                             "per prompt)")
        for name in FLAGS:
            if not isinstance(v[name], bool):
                raise TypeError(f"{name} must be True or False, got {v[name]!r}"
                                + (" (top_logprobs=n asks for the n most likely too)" if name == "logprobs" else ""))
        top = v["top_logprobs"]
        if not _is_int(top):
            raise TypeError(f"top_logprobs must be an int from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        cap = MAX_TOP_LOGPROBS if vocab_size is None else min(MAX_TOP_LOGPROBS, vocab_size)
        if not 0 <= top <= cap:
            raise ValueError(f"top_logprobs must be at most {cap} (and >= 0), got {top}: the n most likely tokens "
                             f"per position, capped at {MAX_TOP_LOGPROBS} as vLLM caps them")
        # ranges: the configs' own checks, on the values given (None: the checkpoint's, checked when resolved)
        SamplingConfig(**{k: v[k] for k in ("temperature", "top_k", "top_p", "min_p") if v[k] is not None}).validate()
        PenaltyConfig(**{k: v[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty",
                                           "min_tokens") if v[k] is not None}).validate()
        longest_min = max(v["min_tokens"] if isinstance(v["min_tokens"], tuple) else (v["min_tokens"],))
        if longest_min > v["max_new_tokens"]:
            raise ValueError(f"min_tokens={longest_min} is more than max_new_tokens={v['max_new_tokens']}: a row "
                             "cannot stop after more tokens than it may generate; lower min_tokens or raise "
                             "max_new_tokens")
        v["stop"] = _stops(v["stop"])
        v["stop_token_ids"] = _token_ids("stop_token_ids", v["stop_token_ids"], vocab_size, single=False)
        v["eos_token_id"] = _token_ids("eos_token_id", v["eos_token_id"], vocab_size, single=True)
        _check_seed(v["seed"])
        if n_prompts is not None:
            for name in (*PER_PROMPT, "seed"):
                if isinstance(v[name], tuple):
                    per_row(v[name], n_prompts, name)
            if v["stop"] and not isinstance(v["stop"][0], str):
                per_row(v["stop"], n_prompts, "stop")
        return SamplingParams(**v)

    def as_kwargs(self) -> dict[str, Any]:
        """generate's keyword arguments for these settings.

        Returns:
            A dict of every setting by name, max_tokens given as max_new_tokens: `generate(t, p, **sp.as_kwargs())`.
        """
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "max_tokens"}
        if self.max_tokens is not None:
            kw["max_new_tokens"] = self.max_tokens
        return kw


def merged(params: SamplingParams | None, keywords: dict[str, Any]) -> SamplingParams:
    """A call's settings: `params`, with the keywords given beside it that differ from their defaults; a setting
    given both ways (differently) is refused."""
    if params is None:
        return SamplingParams(**keywords)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a specjax.SamplingParams, got {type(params).__name__}")
    defaults = SamplingParams()
    given = {k: x for k, x in keywords.items() if not _same(x, getattr(defaults, k))}
    both = [k for k, x in given.items() if not _same(getattr(params, k), getattr(defaults, k))
            and not _same(getattr(params, k), x)]
    if both:
        raise ValueError(f"{both[0]} is given both as a keyword ({given[both[0]]!r}) and in sampling_params "
                         f"({getattr(params, both[0])!r}): give it once")
    return dataclasses.replace(params, **given)


def _same(a, b) -> bool:
    """a and b the same setting: the same object, or equal scalars of one type (arrays and lists never match)."""
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str)) and a == b)


def _plain(name: str, value: Any) -> Any:
    """Arrays (NumPy, JAX) and NumPy scalars as Python values (a 0-d array a scalar, a 1-d one a tuple), lists and
    tuples as tuples of plain values (nested once, for per-prompt stop lists)."""
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, np.generic) or (hasattr(value, "__array__") and not isinstance(value, Sequence)):
        a = np.asarray(value)
        if a.ndim > 1:
            raise TypeError(f"{name} must be one value or a 1-d list of one per prompt, got an array of shape "
                            f"{a.shape}")
        return a.item() if a.ndim == 0 else tuple(a.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(name, x) for x in value)
    return value


def _stops(stop) -> tuple:
    """stop as a tuple of strings (one list for all prompts) or of tuples of strings (one list per prompt)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    what = ("stop must be a string, a list of strings, or one list of strings per prompt (like [['\\n'], ['x']]); "
            "got ")
    if not isinstance(stop, tuple):
        raise TypeError(f"{what}{type(stop).__name__} {stop!r}")
    if all(isinstance(s, tuple) for s in stop) and stop:
        return tuple(_stops(s) for s in stop)
    bad = [s for s in stop if not isinstance(s, str)]
    if bad:
        raise TypeError(f"{what}an entry of type {type(bad[0]).__name__}: {bad[0]!r}")
    if any(not s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings (or one such list per prompt), got {list(stop)!r}")
    return stop


def _token_ids(name: str, ids, vocab_size: int | None, single: bool) -> Any:
    """Token ids as a tuple (an int too, when `single`), each an int inside the vocabulary."""
    if ids is None:
        return None
    if single and not isinstance(ids, tuple):
        ids, one = (ids,), True
    else:
        one = False
    example = "2 or [2, 13]" if single else "[2, 13]"
    if not isinstance(ids, tuple) or not all(_is_int(t) for t in ids):
        raise TypeError(f"{name} must be {'a token id or ' if single else ''}a list of token ids like {example}, got "
                        f"{ids[0] if one else ids!r}")
    out = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if out:
        raise ValueError(f"{name} {out} are not token ids of this vocabulary [0, {vocab_size})")
    return ids[0] if one else ids


def _check_seed(seed) -> None:
    if seed is None or _is_int(seed) or (isinstance(seed, tuple) and all(_is_int(s) for s in seed)):
        return
    raise TypeError(f"seed must be an int, a list of one int per prompt, or None; got {seed!r}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
