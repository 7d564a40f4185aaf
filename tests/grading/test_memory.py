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


@pytest.mark.slow
def test_the_labs_accumulation_passes_every_case():
    from vramlab.grading.memory import ACCUM_CASES, ACCUM_REMAINDER, check_accumulate

    answer, _, acc = _accum()
    check_accumulate(answer(acc, "accumulate"), cases=ACCUM_CASES + ACCUM_REMAINDER)


@pytest.mark.slow
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- the caching allocator

def _alloc():
    from .conftest import answer, edited

    return answer, edited, solution("lab01_where_memory_goes", "alloc-solution")


def test_the_two_allocator_models_agree_on_random_programs():
    """simple_reserved (the check's rule-by-rule model, which names mistakes) and vramlab.allocator (the
    model validated against the H100, which gives the expected value) are separate implementations."""
    from vramlab.allocator import replay
    from vramlab.grading.memory import ALLOC_EXAMPLES, ALLOC_TRAPS, allocator_cases, simple_reserved

    programs = [*ALLOC_EXAMPLES, *ALLOC_TRAPS, *(p for seed in range(40) for p in allocator_cases(seed, 3))]
    assert [simple_reserved(p) for p in programs] == [replay(p).peak_reserved for p in programs]
    assert replay(ALLOC_EXAMPLES[0]).peak_reserved == 70 * 2**20  # the chapter's example: 50 MiB in 70 MiB


def test_every_broken_rule_fails_a_trap():
    """Whatever the random draw, the hidden programs catch each broken rule."""
    from vramlab.allocator import replay
    from vramlab.grading.memory import ALLOC_MISTAKES, ALLOC_TRAPS, simple_reserved

    for kw, _ in ALLOC_MISTAKES:
        assert any(simple_reserved(p, **kw) != replay(p).peak_reserved for p in ALLOC_TRAPS), kw


def test_the_labs_allocator_passes_every_program():
    from vramlab.grading.memory import ALLOC_TRAPS, check_reserved_after

    from .conftest import _function

    _, _, sol = _alloc()
    fn = _function(sol, "reserved_after")
    check_reserved_after(fn)
    check_reserved_after(fn, cases=ALLOC_TRAPS, n=12)
    for seed in range(5):
        check_reserved_after(fn, cases=(), n=10, seed=seed)


@pytest.mark.parametrize("old,new,match", [
    ("        for s, seg in enumerate(segments):\n", "        for s, seg in enumerate([]):\n",
     "no reuse: every alloc made a new segment"),
    ("size = 512 * max(1, -(-nbytes // 512))", "size = nbytes", "forgot rounding"),
    ("if (rest >= 512) if small else (rest > MiB):", "if False:", "split rule: a block was never split"),
    ("if (rest >= 512) if small else (rest > MiB):", "if rest > 0:", "split rule: in the large pool"),
    ("            if i + 1 < len(blocks) and blocks[i + 1][2]:  # merge with the free block after it\n"
     "                block[1] += blocks.pop(i + 1)[1]\n"
     "            if i > 0 and blocks[i - 1][2]:  # and with the free block before it\n"
     "                blocks[i - 1][1] += blocks.pop(i)[1]\n", "", "no merging"),
    ("(block[1], s, block[0]) < best[0]", "(s, block[0]) < best[0][1:]", "best fit"),
    ('            if seg["small"] != small:\n                continue\n', "", "pools"),
    ("            elif size < 10 * MiB:\n                new = 20 * MiB\n", "", "segment size"),
])
def test_wrong_allocators_are_explained(old, new, match):
    from vramlab.grading.memory import ALLOC_TRAPS, check_reserved_after

    from .conftest import _function

    _, edited, sol = _alloc()
    fn = _function(edited(sol, old, new), "reserved_after")
    with pytest.raises(AssertionError, match=match):
        check_reserved_after(fn, cases=ALLOC_TRAPS, n=4, seed=0)


def test_an_allocator_answer_must_return_an_int_and_a_stub_says_not_implemented():
    from vramlab.grading.memory import check_reserved_after

    with pytest.raises(AssertionError, match="return an int"):
        check_reserved_after(lambda events: 70.0 * 2**20)
    with pytest.raises(AssertionError, match=r"returned 0 B \(0 B\), expected 70.00 MiB"):
        check_reserved_after(lambda events: 0)

    def stub(events):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check_reserved_after(stub)


def test_accumulation_reference_draws_what_the_harness_draws():
    """The check computes its reference from the seed in its own process; the harness (copied beside the
    answer, never imported by the check) must build the very same model, inputs and targets."""
    import torch

    from vramlab.grading.memory import _accum_build, _accum_case, _accum_loss
    from vramlab.grading.programs import accum

    for i, (n, m) in enumerate(((12, 4), (10, 3))):
        case = _accum_case(1234 + i, n, m)
        (m1, x1, y1), (m2, x2, y2) = _accum_build(case), accum.build(case)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
        assert torch.equal(_accum_loss(m1(x1), y1), accum.loss_fn(m2(x2), y2))
