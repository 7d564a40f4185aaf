"""vramlab.grading.memory.check_inplace_mlp: lab 1's in-place MLP sublayer. The lab's solution passes,
and so does an answer that saves and allocates no more than it; an answer that runs an allowed op out
of place fails naming the op and the bytes it would free, one that makes autograd refuse its backward
fails naming the tensor overwritten and who saved it, one that dodges autograd's check fails on the
gradients."""

from __future__ import annotations

import pytest
import torch

from vramlab.grading.memory import _inplace_build, _inplace_counted, check_inplace_mlp, inplace_cases, op_log

from .conftest import answer, edited, solution

torch.set_num_threads(1)

SOLUTION = solution("lab01_where_memory_goes", "inplace-solution")
DROP1 = 'h = h * drop1 if act == "relu" else h.mul_(drop1)'

OUT_OF_PLACE = '''
def mlp_forward(x, w1, b1, w2, b2, *, act, drop1=None, drop2=None):
    h = getattr(F, act)(F.linear(x, w1, b1))
    if drop1 is not None:
        h = h * drop1
    h = F.linear(h, w2, b2)
    if drop2 is not None:
        h = h * drop2
    return h + x
'''


@pytest.mark.slow
def test_the_labs_solution_passes_the_visible_and_a_hidden_draw():
    check_inplace_mlp(answer(SOLUTION, "mlp_forward"), seed=0)
    # seed 1: every activation, relu without dropout, a dropout off, float32 and bfloat16
    check_inplace_mlp(answer(SOLUTION, "mlp_forward"), seed=1, n=6)


RELU_AFTER_MASK = '''
def mlp_forward(x, w1, b1, w2, b2, *, act, drop1=None, drop2=None):
    h = F.linear(x, w1, b1)
    if act == "relu":  # relu(z) * m == relu(z * m) for a mask m >= 0: both in place
        if drop1 is not None:
            h.mul_(drop1)
        h = F.relu(h, inplace=True)
    else:
        h = F.gelu(h) if act == "gelu" else F.silu(h, inplace=True)
        if drop1 is not None:
            h.mul_(drop1)
    h = F.linear(h, w2, b2)
    if drop2 is not None:
        h.mul_(drop2)
    return h.add_(x)
'''


@pytest.mark.slow
@pytest.mark.parametrize("src", [
    # SiLU in place gains nothing (autograd copies its input first): out of place is as good
    edited(SOLUTION, "getattr(F, act)(h, inplace=True)", "getattr(F, act)(h, inplace=act == 'relu')"),
    # fewer bytes than the check's own forward: passes
    RELU_AFTER_MASK,
], ids=["silu-out-of-place", "relu-after-the-mask"])
def test_an_answer_no_larger_than_the_checks_passes(src):
    check_inplace_mlp(answer(src, "mlp_forward"), seed=0)


WRONG = [
    (OUT_OF_PLACE,
     r"act='relu'.*the activation could run in place \(F\.relu\(h, inplace=True\).*it would free 5\.44 KiB"),
    (edited(SOLUTION, "getattr(F, act)(h, inplace=True)", "getattr(F, act)(h, inplace=act == 'silu')"),
     r"the activation could run in place"),
    (edited(SOLUTION, DROP1, "h = h * drop1"),
     r"act='silu'.*the first dropout could run in place \(h\.mul_\(drop1\): silu saved its input"),
    (edited(SOLUTION, "h.mul_(drop2)", "h = h * drop2"), r"the second dropout could run in place \(h\.mul_\(drop2\)"),
    (edited(SOLUTION, "return h.add_(x)", "return h + x"), r"the residual add could run in place \(h\.add_\(x\)"),
    (edited(SOLUTION, "return h.add_(x)", "return x.add_(h)"),
     r"autograd refuses the backward \(one of the variables .* modified by an inplace operation.*\): the residual sum "
     r"was written into the block's input x .* which fc1 \(F\.linear\) saved"),
    (edited(SOLUTION, DROP1, "h = h.mul_(drop1)"),
     r"autograd refuses the backward .*: an in-place op \(the dropout's h\.mul_\(drop1\)\) overwrote relu's output, "
     r"which relu saved"),
    (edited(SOLUTION, DROP1, "h.data.mul_(drop1)"), r"the output is right but the gradient of \w+ is wrong .*\.data"),
    # a write under torch.no_grad() still bumps the tensor's version: autograd still refuses
    (edited(SOLUTION, DROP1, "with torch.no_grad():\n            h.mul_(drop1)"),
     r"autograd refuses the backward .* overwrote relu's output"),
    (edited(SOLUTION, "h = F.gelu(h)", "h = F.gelu(h, inplace=True)"),
     r"act='gelu'.*TypeError: .*inplace.*\(torch has no in-place GELU"),
    (edited(SOLUTION, "h = F.linear(x, w1, b1)", "h = x @ w1.T + b1"), r"compute fc1 and fc2 with F\.linear"),
    (edited(SOLUTION, "return h.add_(x)", "return h"), r"the output differs from x \+ drop2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("src,match", WRONG, ids=["out-of-place", "relu-out-of-place", "dropout1-out-of-place", "dropout2-out-of-place",
                                                 "residual-out-of-place", "residual-into-x", "dropout-over-relu",
                                                 "data-trick", "no-grad-write", "gelu-inplace", "matmul", "no-residual"])
def test_a_wrong_answer_fails_with_one_line_naming_the_mistake(src, match):
    with pytest.raises(AssertionError, match=match) as e:
        check_inplace_mlp(answer(src, "mlp_forward"), seed=0)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.slow
def test_the_stub_says_it_is_not_implemented():
    stub = "def mlp_forward(x, w1, b1, w2, b2, *, act, drop1=None, drop2=None):\n    raise NotImplementedError()\n"
    with pytest.raises(NotImplementedError):
        check_inplace_mlp(answer(stub, "mlp_forward"), seed=0)


def test_the_reference_draws_what_the_harness_draws():
    """The check computes its reference from the seed in its own process; the harness (copied beside the
    answer, never imported by the check) must build the very same tensors."""
    from vramlab.grading.programs import inplace

    for case in inplace_cases(7, 6):
        ours, theirs = _inplace_build(case), inplace.build(case)
        flat = lambda b: [b[0], *b[1], *b[2], b[3]]  # noqa: E731
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(flat(ours), flat(theirs)))


def test_the_answers_process_counts_as_the_check_counts():
    """The check counts with COUNTING (a copy, as source, of measure.inplace's LiveBytes and saved_bytes:
    the grading package never imports vramlab.measure) and sends it, with its per-kernel log, to the
    answer's process: the three count the check's own forward alike."""
    import inspect

    from vramlab.grading.memory import COUNTING, counting
    from vramlab.grading.programs import inplace
    from vramlab.measure import inplace as measure

    theirs = inplace.counting(COUNTING + "\n\n" + inspect.getsource(op_log))
    assert theirs[0].__mro__[1].__name__ == "LiveBytes"
    live, saved = counting()
    for case in inplace_cases(3, 6):
        ours = _inplace_counted(case, (op_log(live), saved))
        assert _inplace_counted(case, theirs) == ours
        assert _inplace_counted(case, (op_log(measure.LiveBytes), measure.saved_bytes)) == ours


def test_the_count_sees_what_in_place_saves():
    """The check's bound, counted: ReLU in place and the in-place residual take away fc1-sized and
    x-sized outputs, and nothing autograd saves."""
    from vramlab.grading.memory import counting

    case = dict(act="relu", p1=0.0, p2=0.0, tokens=8, hidden=16, inner=64, dtype="float32", seed=5)
    live, saved = counting()
    ours = _inplace_counted(case, (op_log(live), saved))
    kernels = [k for k, _ in ours["ops"]]
    assert "relu_" in kernels and "add_" in kernels and "relu" not in kernels
    t, h, i = 8, 16, 64
    assert sum(n for _, n in ours["ops"]) == 4 * (t * i + t * h)  # fc1's output and fc2's, nothing else
    assert ours["saved"] == 4 * (t * h + t * i)  # x (by fc1) and relu's output (by relu_ and fc2)
