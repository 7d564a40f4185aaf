"""vramlab.grading.offload: lab 6's checks compute their own references (vramlab.offload's streaming
model) from random cases. The lab's solutions pass; an answer that ignores the copies fails."""

from __future__ import annotations

import pytest

from vramlab.grading.offload import check_fewest_resident, check_stream_pass

from .conftest import _function, solution

LAB = "lab06_offload"
STREAM = _function(solution(LAB, "ex2-solution"), "stream_pass")
FEWEST = _function(solution(LAB, "ex2-solution") + "\n\n" + solution(LAB, "ex3-solution"), "fewest_resident")  # it calls stream_pass


def test_the_solutions_pass():
    check_stream_pass(STREAM, seed=3, n=6)
    check_fewest_resident(FEWEST, seed=3, n=6)


def test_answers_that_ignore_the_link_fail():
    def compute_only(layer_bytes, layer_seconds, streamed, link_GBps, buffers=2, passes=3):
        return sum(layer_seconds)  # as if every copy were free

    with pytest.raises(AssertionError):
        check_stream_pass(compute_only, seed=3, n=6)
    with pytest.raises(AssertionError):
        check_fewest_resident(lambda layer_bytes, layer_seconds, link_GBps, buffers: 0, seed=3, n=6)
