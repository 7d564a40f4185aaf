"""vramlab.grading.checkpointing: lab 7's checkpoint choice is checked against the least recompute
that fits each random case, found by the check itself. The lab's solution passes; one that
checkpoints every block fits but recomputes more than it must, and one that keeps everything does
not fit."""

from __future__ import annotations

import pytest

from vramlab.grading.checkpointing import check_checkpoint_choice, checkpoint_cases, checkpoint_peak

from .conftest import _function, solution

CHOOSE = _function(solution("lab07_checkpointing", "ex3-solution"), "choose_checkpoints")


def test_the_solution_passes():
    check_checkpoint_choice(CHOOSE, seed=5, n=8)


def test_the_peak_of_a_choice_is_its_own_arithmetic():
    full, inputs, _flops, outside, _budget = checkpoint_cases(0, 1)[0]
    keep_all = checkpoint_peak(full, inputs, outside, set())
    every = checkpoint_peak(full, inputs, outside, set(range(len(full))))
    assert every <= keep_all  # checkpointing never raises the peak in this model


@pytest.mark.parametrize("wrong", [
    lambda full, inputs, flops, outside, budget: list(range(len(full))),  # every block: fits, recomputes too much
    lambda full, inputs, flops, outside, budget: [],  # nothing: does not fit
])
def test_wrong_choices_fail(wrong):
    with pytest.raises(AssertionError):
        check_checkpoint_choice(wrong, seed=5, n=8)
