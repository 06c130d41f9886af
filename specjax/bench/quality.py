"""Is a continuation plausible text or a loop? Two cheap measures the demo is held to, on held-out prompts.

distinct_ngram_ratio: distinct token 4-grams over all 4-grams (1.0 never repeats; a loop drives it toward 0).
longest_line_run: the most times one non-blank line repeats in a row (`import sys` on twelve lines is 12).
"""

from __future__ import annotations

import itertools


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams of one sequence: 1.0 never repeats, a loop drives it toward 0."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_line_run(text: str) -> int:
    """The longest run of identical consecutive non-blank lines (surrounding whitespace ignored); 0 without any."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return max((len(list(group)) for _, group in itertools.groupby(lines)), default=0)
