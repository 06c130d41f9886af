"""Agreement between plain and speculative greedy output: what the demo and benchmarks report in bf16."""

import pytest

from specjax.bench.agreement import Divergence, check_agreement, compare_tokens


def test_identical_outputs_agree_fully():
    agreement = compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert agreement.match_rate == 1.0 and agreement.first_divergence is None
    assert agreement.as_dict() == {"match_rate": 1.0, "first_divergence": None}
    assert compare_tokens([], []).match_rate == 1.0


def test_diverging_rows_report_the_first_difference():
    agreement = compare_tokens([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 0]])
    assert agreement.match_rate == 6 / 8  # position-wise: two of eight differ
    assert agreement.first_divergence == Divergence(row=1, position=1, plain=6, speculative=9)
    assert agreement.as_dict()["first_divergence"] == {"row": 1, "position": 1, "plain": 6, "speculative": 9}


def test_different_lengths_count_as_mismatches():
    agreement = compare_tokens([[1, 2, 3, 4]], [[1, 2]])
    assert agreement.match_rate == 2 / 4
    assert agreement.first_divergence == Divergence(row=0, position=2, plain=3, speculative=None)
    assert compare_tokens([[]], [[7]]).first_divergence == Divergence(0, 0, None, 7)


def test_different_row_counts_are_refused():
    with pytest.raises(ValueError, match="2 plain rows with 1 speculative"):
        compare_tokens([[1], [2]], [[1]])


def test_fp32_differences_raise_and_bf16_differences_are_reported():
    with pytest.raises(AssertionError, match="row 0, position 1: plain 2, speculative 9"):
        check_agreement([[1, 2]], [[1, 9]], "float32", "draft chain:4")
    assert check_agreement([[1, 2]], [[1, 2]], "float32", "draft chain:4").match_rate == 1.0
    for dtype in ("bfloat16", "float16"):
        agreement = check_agreement([[1, 2]], [[1, 9]], dtype, "draft chain:4")
        assert agreement.match_rate == 0.5 and agreement.first_divergence.position == 1
