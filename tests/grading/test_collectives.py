"""vramlab.grading.collectives: lab 2's ring all-reduce check runs the answer on linked ranks. The
lab's solution passes; an answer that calls a ready-made collective, or sums in the wrong place,
fails with what it did wrong."""

from __future__ import annotations

import pytest

from vramlab.grading.collectives import check_ring_all_reduce

from .conftest import answer, edited, solution

RING = solution("lab02_collectives", "ex3-solution")


@pytest.mark.slow
def test_the_solution_passes_with_unequal_chunks():
    check_ring_all_reduce(answer(RING, "ring_all_reduce"), cases=((3, 10),))


@pytest.mark.slow
def test_a_ready_made_all_reduce_is_refused():
    cheat = RING + "\n\ndef ring_all_reduce(tensor, rank, world_size):\n    dist.all_reduce(tensor)\n    return tensor\n"
    with pytest.raises(AssertionError, match="not available"):
        check_ring_all_reduce(answer(cheat, "ring_all_reduce"), cases=((2, 8),))


@pytest.mark.slow
def test_an_answer_that_only_returns_its_own_numbers_fails():
    lazy = edited(RING, "def ring_all_reduce(tensor, rank, world_size):",
                  "def ring_all_reduce(tensor, rank, world_size):\n    return tensor\n\n\ndef _unused(tensor, rank, world_size):")
    with pytest.raises(AssertionError, match="wrong result"):
        check_ring_all_reduce(answer(lazy, "ring_all_reduce"), cases=((2, 8),))
