"""vramlab.grading.compression: lab 8's checks compute their references from the inputs they draw.
The lab's solutions pass; plausible mistakes fail (one scale for the whole matrix; a 2:4 mask that
keeps the smallest values)."""

from __future__ import annotations

import pytest

from vramlab.grading.compression import check_mask_2_4, check_row_int8

from .conftest import _function, solution

LAB = "lab08_compression"
INT8 = solution(LAB, "ex1-solution")
MASK = _function(solution(LAB, "ex5-solution"), "mask_2_4")


def _int8(source):
    return [_function(source, n) for n in ("quantize_rows", "dequantize_rows", "row_int8_bytes")]


def test_the_solutions_pass():
    check_row_int8(*_int8(INT8), seed=2, n=6)
    check_mask_2_4(MASK, seed=2, n=6)


def test_a_mask_that_keeps_the_smallest_values_fails():
    def smallest(w):
        out = []
        for row in w:
            mask = []
            for i in range(0, len(row), 4):
                group = row[i:i + 4]
                keep = sorted(range(len(group)), key=lambda j: abs(group[j]))[:2]
                mask += [1 if j in keep else 0 for j in range(len(group))]
            out.append(mask)
        return out

    with pytest.raises(AssertionError):
        check_mask_2_4(smallest, seed=2, n=6)


def test_int8_bytes_without_the_scales_fail():
    q, dq, nbytes = _int8(INT8)
    with pytest.raises(AssertionError):
        check_row_int8(q, dq, lambda rows, cols: rows * cols, seed=2, n=6)
