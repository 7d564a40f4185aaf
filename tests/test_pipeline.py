"""vramlab.pipeline: the schedules simulated against the closed-form bubble (GPipe and Narayanan et al.
2021) and the micro-batches each device holds in flight. The schedules' arguments and fast paths are
tests/test_args_parallel.py's; a layout's stages in flight tests/test_parallel.py's."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vramlab import pipeline as PIPE


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 9)])
def test_simulated_bubble_matches_the_formula(schedule, v, p, m):
    if schedule == "interleaved" and m % p:
        pytest.skip("interleaving needs m divisible by p")
    run = PIPE.simulate(p, m, schedule, chunks=v)
    assert run.bubble == PIPE.bubble_fraction(p, m, schedule, chunks=v) == Fraction(p - 1, v * m + p - 1)
    assert PIPE.bubble_fraction(p, m, schedule, chunks=v, of="ideal") == Fraction(p - 1, v * m)
    assert len(run.ops) == 2 * p * m * v  # every forward and backward of every micro-batch and chunk, once


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (4, 2)])
def test_micro_batches_in_flight(p, m):
    """GPipe holds every micro-batch on every stage; 1F1B holds p - s on stage s (Narayanan+21)."""
    assert PIPE.simulate(p, m, "gpipe").in_flight == (m,) * p
    assert PIPE.simulate(p, m, "1f1b").in_flight == tuple(min(p - s, m) for s in range(p))


def test_interleaving_holds_more_on_the_first_device():
    """Megatron (Narayanan+21, section 2.2): the interleaved schedule's first device holds
    1 + (p-1)/(pv) times the activations of 1F1B's (in units of one stage's worth)."""
    p, v, m = 4, 2, 8
    run = PIPE.simulate(p, m, "interleaved", chunks=v)
    assert Fraction(run.in_flight[0], v) == p * (1 + Fraction(p - 1, p * v))
