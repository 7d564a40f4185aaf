"""vramlab.grading.memory: lab 1's checks. An integer answer equal to the count passes; anything else
fails with what was expected, and a wrong GPT-2 count is diagnosed from the size of its error."""

from __future__ import annotations

import pytest

from vramlab.grading.memory import check_int, diagnose_param_count

from .conftest import _function, solution

COUNT = _function(solution("lab01_where_memory_goes", "ex1-solution"), "gpt2_param_count")
SMALL = dict(n_layer=2, n_embd=64, vocab_size=1000, n_positions=128, n_inner=None)


def test_a_right_count_passes_and_a_wrong_one_names_both_numbers():
    check_int(COUNT(**SMALL), COUNT(**SMALL), what="GPT-2")
    with pytest.raises(AssertionError, match=r"GPT-2: got 12, expected 13 \(off by -1\)"):
        check_int(12, 13, what="GPT-2")
    for bad in (13.0, True, "13"):
        with pytest.raises(AssertionError, match="return an int"):
            check_int(bad, 13, what="GPT-2")


def test_a_wrong_gpt2_count_is_diagnosed_by_its_error():
    right = COUNT(**SMALL)
    untied = lambda **c: COUNT(**c) + c["vocab_size"] * c["n_embd"]  # noqa: E731 - an LM head counted twice
    no_positions = lambda **c: COUNT(**c) - c["n_positions"] * c["n_embd"]  # noqa: E731
    assert "ties it to the token embedding" in diagnose_param_count(untied, SMALL, right)
    assert "position embedding" in diagnose_param_count(no_positions, SMALL, right)
