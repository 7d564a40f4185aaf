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


# ----------------------------------------------------------------------------- chunked cross-entropy

CHUNKED = solution("lab07_checkpointing", "chunk-solution")

FUNCTION = '''class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, c):
        n = hidden.shape[0]
        gh, gw, loss = torch.zeros_like(hidden), torch.zeros_like(weight), hidden.new_zeros(())
        for s in range(0, n, c):
            h, t = hidden[s:s + c], targets[s:s + c]
            logits = h @ weight.T
            loss += (torch.logsumexp(logits, -1) - logits.gather(1, t[:, None])[:, 0]).sum()
            p = torch.softmax(logits, -1)
            del logits
            p[torch.arange(len(t)), t] -= 1
            gh[s:s + c] = p @ weight
            gw += p.T @ h
        ctx.save_for_backward(gh / n, gw / n)
        return loss / n

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return g * gh, g * gw, None, None


def chunked_cross_entropy(hidden, weight, targets, chunk_size):
    return _ChunkedCE.apply(hidden, weight, targets, chunk_size)
'''

NAIVE = '''def chunked_cross_entropy(hidden, weight, targets, chunk_size):
    total = 0
    for s in range(0, hidden.shape[0], chunk_size):  # autograd keeps every chunk's log-probabilities
        total = total + F.cross_entropy(hidden[s:s + chunk_size] @ weight.T, targets[s:s + chunk_size], reduction="sum")
    return total / hidden.shape[0]
'''

WHOLE = '''def chunked_cross_entropy(hidden, weight, targets, chunk_size):
    return F.cross_entropy(hidden @ weight.T, targets)
'''


def _ce(source):
    from .conftest import answer

    return answer(source, "chunked_cross_entropy")


def test_the_two_draws_of_a_case_agree():
    """The check computes its reference from chunk_inputs; the answer's process from the program's build."""
    import torch

    from vramlab.grading.checkpointing import _chunk_case, chunk_inputs
    from vramlab.grading.programs import chunk_ce

    case = _chunk_case(12345, 20, 3)
    assert case["v"] > case["n"] * case["h"]
    for seed in range(8):  # no chunk of logits is shaped like the head's transpose (h x V), which is not counted
        for n, c in ((48, 6), (60, 4), (50, 7), (20, 32), (9, 9), (5, 3), (4, 4)):
            h = _chunk_case(seed, n, c)["h"]
            assert h not in (min(n, c), n % c, n) and 3 <= h <= 6
    assert all(torch.equal(a, b) for a, b in zip(chunk_inputs(case), chunk_ce.build(case)))


@pytest.mark.slow
def test_the_labs_chunked_loss_passes_every_case_and_holds_three_chunks():
    """Measured (the program's dispatch mode): the checkpointed chunks hold three chunk x V tensors at
    once in the backward, the count vramlab.checkpointing.loss_bytes makes (3 c V)."""
    from vramlab.grading.checkpointing import CHUNK_CASES, CHUNK_REMAINDER, check_chunked_ce

    for m in check_chunked_ce(_ce(CHUNKED), cases=CHUNK_CASES + CHUNK_REMAINDER):
        assert m["peak"] == 3 * min(m["chunk_size"], m["n"]) * m["v"] and m["peak_phase"] == "backward", m


@pytest.mark.slow
def test_an_autograd_function_that_computes_the_gradients_chunk_by_chunk_passes():
    from vramlab.grading.checkpointing import CHUNK_REMAINDER, check_chunked_ce

    check_chunked_ce(_ce(FUNCTION), cases=((48, 6),) + CHUNK_REMAINDER)


@pytest.mark.slow
def test_the_whole_loss_and_its_measured_peak():
    """The tracker, on F.cross_entropy of all the logits: 3 N V elements at once (log-probabilities,
    their gradient, the logits' gradient), as loss_bytes counts; one N x V tensor the largest."""
    from vramlab.checkpointing import loss_bytes
    from vramlab.grading.checkpointing import _chunk_case
    from vramlab.grading.programs import chunk_ce
    import torch.nn.functional as F

    for n, c in ((30, 4), (17, 5)):
        case = _chunk_case(7 + n, n, c)
        _, _, _, tracker = chunk_ce.measure(lambda hd, w, t, k: F.cross_entropy(hd @ w.T, t), case)
        n, h, v = case["n"], case["h"], case["v"]
        assert tracker.peak == 3 * n * v == loss_bytes(tokens=n, hidden_size=h, vocab_size=v, dtype_bytes=1)["peak"] - v * h
        assert tracker.largest[0] == n * v and tracker.peak_phase == "backward"


@pytest.mark.slow
@pytest.mark.parametrize("source, cases, match", [
    (WHOLE, ((48, 6),), r"made a tensor of shape \(48, \d+\) \(aten.mm.default\).*8 tokens' worth"),
    (NAIVE, ((48, 6),), r"alive at once in the backward \(10.0 chunks' worth; at most 4"),
    (NAIVE, ((50, 7),), r"alive at once in the backward"),
    (CHUNKED.replace("return total / hidden.shape[0]", "return total"), ((48, 6),), "sum over the tokens"),
    (CHUNKED.replace('reduction="sum"', 'reduction="mean"').replace("return total / hidden.shape[0]",
                                                                   "return total / -(-hidden.shape[0] // chunk_size)"),
     ((50, 7),), "last chunk has only 1 of the 50 tokens"),
    (CHUNKED.replace("total = total + checkpoint(", "total = total + 0 * checkpoint(").replace(
        "return total / hidden.shape[0]", "return total + F.cross_entropy(hidden @ weight.T, targets)"), ((12, 12),),
     None),  # a chunk the size of the batch: the whole loss is allowed
])
def test_wrong_chunked_losses_are_explained(source, cases, match):
    from vramlab.grading.checkpointing import check_chunked_ce

    if match is None:
        check_chunked_ce(_ce(source), cases=cases)
        return
    with pytest.raises(AssertionError, match=match):
        check_chunked_ce(_ce(source), cases=cases)


@pytest.mark.slow
def test_a_detached_or_wrongly_typed_loss_is_explained():
    from vramlab.grading.checkpointing import check_chunked_ce

    detached = CHUNKED.replace("return total / hidden.shape[0]", "return (total / hidden.shape[0]).detach()")
    with pytest.raises(AssertionError, match="does not require grad"):
        check_chunked_ce(_ce(detached), cases=((12, 4),))
    number = CHUNKED.replace("return total / hidden.shape[0]", "return float(total / hidden.shape[0])")
    with pytest.raises(AssertionError, match="as a tensor of one element, got float"):
        check_chunked_ce(_ce(number), cases=((12, 4),))


@pytest.mark.slow
def test_the_stub_is_let_through_as_not_implemented():
    from vramlab.grading.checkpointing import check_chunked_ce

    stub = "def chunked_cross_entropy(hidden, weight, targets, chunk_size):\n    raise NotImplementedError()\n"
    with pytest.raises(NotImplementedError):
        check_chunked_ce(_ce(stub), cases=((12, 4),))
