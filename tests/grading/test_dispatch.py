"""Lab 3's exercise 5, the MoE token dispatch with a capacity (`grading.parallel.check_dispatch`,
`programs/dispatch.py`): the reference against an independent routing written as DeepSpeed's
sharded_moe.py writes it (one-hot masks and cumulative sums), the lab's solution passing every case,
each usual mistake failing with its own message, and a crash, a loop or the stub giving one line."""

from __future__ import annotations

import re
import types

import pytest
import torch
import torch.nn.functional as F

from vramlab.grading import parallel as P
from vramlab.grading.programs import dispatch as program

from .conftest import answer, edited, solution

SOLUTION = solution("lab03_parallelism", "ex5-solution")
LOOPS = ("    for j in range(top_k):  # GShard's priority: every first choice, then every second choice, ...\n"
         "        for t in range(tokens):  # ... each in token order\n")


def onehot_routing(logits, k: int, capacity: int) -> dict:
    """Top-k routing with a capacity in the form of DeepSpeed's top2gating (deepspeed/moe/sharded_moe.py),
    generalised to k choices: one-hot masks per choice rank, rows from a cumulative sum over the tokens
    offset by the choices of the earlier ranks, the mask cut at the capacity, kept probabilities
    renormalised for k > 1. Written here, apart from the reference, to hold it to."""
    gates = logits.softmax(-1)  # (T, E)
    top_p, idx = gates.topk(k, dim=-1)
    offset = torch.zeros(gates.shape[1], dtype=torch.int64)  # rows the earlier ranks took, per expert
    slots, keeps = [], []
    for j in range(k):
        mask = F.one_hot(idx[:, j], gates.shape[1])  # (T, E)
        loc = torch.cumsum(mask, 0) - 1 + offset
        offset = offset + mask.sum(0)
        keep = mask * (loc < capacity)
        kept = keep.sum(1).bool()
        slots.append(torch.where(kept, (loc * keep).sum(1), torch.full_like(kept, -1, dtype=torch.int64)))
        keeps.append(kept)
    slot, kept = torch.stack(slots, 1), torch.stack(keeps, 1)
    weight = top_p * kept
    if k > 1:
        weight = weight / weight.sum(1, keepdim=True).clamp_min(torch.finfo(weight.dtype).eps)
    return {"expert": idx, "slot": slot, "weight": weight, "kept": kept}


def _module(source: str) -> types.ModuleType:
    module = types.ModuleType("answer")
    module.__dict__.update(torch=torch)
    exec(compile(source, "<answer>", "exec"), module.__dict__)  # noqa: S102 - the lab's own cells, edited
    return module


CASES = P.dispatch_cases(5, P.DISPATCH_CASES + P.DISPATCH_HIDDEN)  # drawn once: the visible and hidden cases


def problem(source: str, cases=CASES) -> str | None:
    """The check's verdict on `source` without its process: the harness's `run` here, then the check's
    reading of each report (the first problem, or None)."""
    module = _module(source)
    for case in cases:
        rep = program.run(case, module, ["dispatch"])
        why = rep.get("error") or P._dispatch_problem(case, rep)
        if why:
            return why
    return None


def test_the_labs_solution_passes_every_case():
    assert problem(SOLUTION) is None


def test_the_two_draws_of_a_case_agree():
    """The check computes its reference from dispatch_logits; the answer's process from the program's build."""
    for case in P.dispatch_cases(11, P.DISPATCH_CASES):
        assert torch.equal(P.dispatch_logits(case), program.build(case))


@pytest.mark.parametrize("tokens, experts, k, factor", [
    (16, 4, 1, 1.0), (24, 4, 2, 1.0), (50, 8, 2, 1.25), (37, 6, 3, 1.0), (64, 8, 2, 2.0), (20, 5, 2, 0.5),
    (12, 3, 2, None), (1, 2, 2, 1.0),
])
def test_the_reference_is_deepspeeds_routing(tokens, experts, k, factor):
    """On configurations other than the lab's, with and without drops: the reference's experts, rows,
    drops and weights equal the one-hot form's; drops happen exactly where an expert received more
    choices than its capacity."""
    for seed in range(5):
        case = P.dispatch_case(100 * seed + tokens, tokens, experts, k, factor)
        logits, c = P.dispatch_logits(case), case["capacity"]
        ref, other = P.dispatch_reference(logits, k, c), onehot_routing(logits, k, c)
        for f in ("expert", "slot", "kept"):
            assert torch.equal(ref[f], other[f]), (case, f)
        assert torch.allclose(ref["weight"], other["weight"], rtol=1e-12, atol=1e-15)
        received = torch.bincount(ref["expert"].flatten(), minlength=experts)
        assert int((~ref["kept"]).sum()) == int((received - c).clamp_min(0).sum())
        assert all(sorted(ref["slot"][ref["kept"] & (ref["expert"] == e)].tolist()) == list(range(min(c, int(n))))
                   for e, n in enumerate(received))


def test_every_drawn_case_drops_and_shows_every_mistake():
    """A case with a capacity below the dropless one is drawn until it drops and every usual mistake
    differs from the reference there: each mistake loses its points on the visible cases already."""
    specs = P.DISPATCH_CASES + P.DISPATCH_HIDDEN
    for seed in (0, 1):
        for (_, _, k, factor), case in zip(specs, P.dispatch_cases(seed, specs)):
            assert P._dispatch_separates(case), case
            ref = P.dispatch_reference(P.dispatch_logits(case), case["top_k"], case["capacity"])
            assert bool(ref["kept"].all()) == (case["capacity"] >= case["tokens"]), case
            if k == 2 and factor is not None and factor <= 1.25 and case["capacity"] < case["tokens"]:
                assert bool((~ref["kept"]).all(-1).any()), case  # a token lost both choices: nothing to renormalise


@pytest.mark.slow
def test_the_labs_solution_passes_through_the_runner():
    """The real runner (a process of its own, the program copied beside the answer): every visible and
    hidden case, with drops where the capacity is below the dropless one."""
    results = P.check_dispatch(answer(SOLUTION, "dispatch"), cases=P.DISPATCH_CASES + P.DISPATCH_HIDDEN)
    assert [r["dropped"] > 0 for r in results] == [r["capacity"] < r["tokens"] for r in results]


PROB_ORDER = ("    for j, t in sorted([(j, t) for j in range(top_k) for t in range(tokens)],\n"
              "                       key=lambda jt: -float(top_p[jt[1], jt[0]])):\n"
              "        if True:\n")


@pytest.mark.parametrize("old, new, match", [
    (LOOPS, "    for t in range(tokens):\n        for j in range(top_k):\n", "numbered in token order over all choices"),
    ("for j in range(top_k):", "for j in reversed(range(top_k)):", "second choices were placed before the first"),
    (LOOPS, PROB_ORDER, "decreasing probability"),
    ("for t in range(tokens):", "for t in reversed(range(tokens)):", "tokens are out of order"),
    ("if filled[e] < capacity:", "if filled[e] <= capacity:", "off by one: an expert kept capacity \\+ 1"),
    ("if filled[e] < capacity:", "if filled[e] < capacity - 1:", "off by one: an expert kept only capacity - 1"),
    ("if filled[e] < capacity:", "if True:", "no choice was dropped"),
    ("if top_k > 1:", "if False:", "not renormalised"),
    ("if top_k > 1:", "if True:", "top-1 weights were renormalised"),
    ("probs = torch.softmax(router_logits, dim=-1)", "probs = router_logits", "raw logits"),
    ("probs = torch.softmax(router_logits, dim=-1)", "probs = torch.softmax(router_logits, dim=0)",
     "normalised over the tokens"),
    ("slot[t, j] = filled[e]", "slot[t, j] = capacity - 1 - filled[e]", r"token \d+'s choice \d \(expert \d+\) got slot"),
    ("top_p, expert = probs.topk(top_k, dim=-1)", "top_p, expert = probs.topk(top_k, dim=-1)\n"
     "    top_p, expert = top_p.flip(-1), expert.flip(-1)", "right experts, in the wrong order"),
    ("probs.topk(top_k, dim=-1)", "(-probs).topk(top_k, dim=-1)", r"token \d+ chose experts"),
    ("kept = slot >= 0", "kept = slot >= -1", "kept must be True exactly where slot >= 0"),
    ("weight = torch.where(kept, top_p, torch.zeros_like(top_p))", "weight = top_p.clone()", "non-zero weight"),
    (".clamp_min(torch.finfo(weight.dtype).tiny)", "", "NaN \\(all its choices were dropped"),
    ("return Routing(expert, slot, weight, kept)", "return Routing(expert, slot, weight.float(), kept)",
     "weight is float32: keep the logits' dtype"),
    ("return Routing(expert, slot, weight, kept)", "return Routing(expert, slot.double(), weight, kept)",
     "slot is float64: return an integer tensor"),
    ("return Routing(expert, slot, weight, kept)", "return Routing(expert, slot[:, :1], weight, kept)",
     r"slot has shape \(\d+, 1\)"),
    ("return Routing(expert, slot, weight, kept)", "return expert, slot, weight",
     "four tensors, got tuple of 3"),
])
def test_each_usual_mistake_is_named(old, new, match):
    why = problem(edited(SOLUTION, old, new))
    assert why is not None and re.search(match, why), why


def test_renormalising_before_the_drops_is_named():
    """Mixtral's rule (the top-k probabilities renormalised before any drop) differs from the kept-only
    rule exactly where a token lost a choice."""
    wrong = edited(edited(SOLUTION, "weight = torch.where(kept, top_p, torch.zeros_like(top_p))",
                          "weight = torch.where(kept, top_p / top_p.sum(-1, keepdim=True), torch.zeros_like(top_p))"),
                   "if top_k > 1:", "if False:")
    why = problem(wrong, [c for c in CASES if c["top_k"] > 1])
    assert why is not None and "before the drops" in why, why


@pytest.mark.slow
def test_a_mistake_reaches_the_student_through_the_runner_in_one_line():
    wrong = edited(SOLUTION, "for j in range(top_k):", "for j in reversed(range(top_k)):")
    with pytest.raises(AssertionError, match=r"^24 tokens, 4 experts, top_k=2, capacity 12: the second choices") as e:
        P.check_dispatch(answer(wrong, "dispatch"), cases=((24, 4, 2, 1.0),))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("body, error, match, timeout", [
    ("    raise ValueError('no experts today')\n", AssertionError, r"capacity 4: ValueError: no experts today$", 60),
    ("    while True:\n        pass\n", AssertionError, r"gave no answer within 8 s \(a loop that never ends\?\)$", 8),
    ("    raise NotImplementedError()\n", NotImplementedError, "NotImplementedError", 60),
    ("    return (\n", AssertionError, "the dispatch run did not finish: SyntaxError", 60),
])
def test_crashes_loops_and_the_stub_give_one_line(body, error, match, timeout):
    source = "def dispatch(router_logits, top_k, capacity):\n" + body
    with pytest.raises(error, match=match) as e:
        P.check_dispatch(answer(source, "dispatch"), cases=((16, 4, 1, 1.0),), timeout=timeout)
    assert "\n" not in str(e.value)
