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


# ----------------------------------------------------------------------------- gradient accumulation

def _accum():
    from .conftest import answer, edited

    return answer, edited, solution("lab01_where_memory_goes", "accum-solution")


def test_the_labs_accumulation_passes_every_case():
    from vramlab.grading.memory import ACCUM_CASES, ACCUM_REMAINDER, check_accumulate

    answer, _, acc = _accum()
    check_accumulate(answer(acc, "accumulate"), cases=ACCUM_CASES + ACCUM_REMAINDER)


@pytest.mark.parametrize("old,new,cases,match", [
    ("        p.grad = None  # what an earlier step left does not count\n", "        pass\n", ((12, 4),),
     "already in .grad were kept"),
    ("* (x.shape[0] / n)", "", ((12, 4),), "3x too large"),
    ("* (x.shape[0] / n)", "/ -(-n // micro_batch_size)", ((10, 4),), "last micro-batch has only 2 rows"),
    ("    return steps", "    return n", ((12, 4),), "returned 12, expected the number of micro-batches, 3"),
    ("[start:start + micro_batch_size]", "[start:start + 2 * micro_batch_size]", ((16, 2),),
     "forward calls saw"),
])
def test_wrong_accumulation_is_explained(old, new, cases, match):
    from vramlab.grading.memory import check_accumulate

    answer, edited, acc = _accum()
    with pytest.raises(AssertionError, match=match):
        check_accumulate(answer(edited(acc, old, new), "accumulate"), cases=cases)


def test_full_batch_gradient_with_fake_micro_batches_still_needs_the_right_shapes():
    """An answer that never splits the batch cannot pass by returning the right count."""
    from vramlab.grading.memory import check_accumulate

    answer, _, _ = _accum()
    cheat = ("def accumulate(model, loss_fn, inputs, targets, micro_batch_size):\n"
             "    for p in model.parameters():\n        p.grad = None\n"
             "    loss_fn(model(inputs), targets).backward()\n"
             "    return -(-inputs.shape[0] // micro_batch_size)\n")
    with pytest.raises(AssertionError, match="ran once"):
        check_accumulate(answer(cheat, "accumulate"), cases=((12, 4),))
