"""How far speculative greedy output agrees with plain greedy decoding, token for token.

In fp32 the two must be identical (a difference is a bug). In bf16/fp16 the verify pass
(N tokens at once) and plain decoding (one token) round differently, so a near-tie between
the top two logits can flip and the outputs then part ways: that is measured and reported,
not raised.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

EXACT_DTYPES = ("float32",)  # dtypes in which any difference is a bug


class Divergence(NamedTuple):
    """The first differing token: row, position in the row's output, and each side's token (None: row ended)."""

    row: int
    position: int
    plain: int | None
    speculative: int | None

    def describe(self) -> str:
        """'row 1, position 12: plain 345, speculative 678' for error messages and tables."""
        return f"row {self.row}, position {self.position}: plain {self.plain}, speculative {self.speculative}"


class Agreement(NamedTuple):
    """match_rate: equal positions / compared positions (a row's longer length); first_divergence or None."""

    match_rate: float
    first_divergence: Divergence | None

    def as_dict(self) -> dict:
        """JSON-able: {"match_rate": float, "first_divergence": {row, position, plain, speculative} or None}."""
        div = self.first_divergence
        return {"match_rate": self.match_rate, "first_divergence": None if div is None else div._asdict()}


def compare_tokens(plain: Sequence[Sequence[int]], speculative: Sequence[Sequence[int]]) -> Agreement:
    """Compare two batches of token rows position by position.

    Positions past the shorter row of a pair count as mismatches, so rows of different
    lengths never reach a match rate of 1. Two empty batches (or empty rows) agree fully.
    """
    if len(plain) != len(speculative):
        raise ValueError(f"cannot compare {len(plain)} plain rows with {len(speculative)} speculative rows; "
                         f"pass the outputs of the same prompts")
    matched = total = 0
    first = None
    for row, (a, b) in enumerate(zip(plain, speculative)):
        same = [x == y for x, y in zip(a, b)]
        matched += sum(same)
        total += max(len(a), len(b))
        if first is None and (not all(same) or len(a) != len(b)):
            pos = same.index(False) if not all(same) else len(same)
            first = Divergence(row, pos, _at(a, pos), _at(b, pos))
    return Agreement(matched / total if total else 1.0, first)


def _at(row: Sequence[int], pos: int) -> int | None:
    return int(row[pos]) if pos < len(row) else None


def check_agreement(plain: Sequence[Sequence[int]], speculative: Sequence[Sequence[int]], dtype: str,
                    what: str) -> Agreement:
    """compare_tokens, raising AssertionError on any difference when `dtype` is exact (fp32).

    In bf16/fp16 the agreement is returned for the caller to report. `what` names the run in the error.
    """
    agreement = compare_tokens(plain, speculative)
    if agreement.first_divergence is not None and str(dtype) in EXACT_DTYPES:
        raise AssertionError(f"{what}: greedy speculative output differs from plain decoding in {dtype} "
                             f"(match rate {agreement.match_rate:.4f}; first at "
                             f"{agreement.first_divergence.describe()})")
    return agreement
