"""Lab 7's checks (checkpointing): which blocks to checkpoint within a budget (checked against every
choice), and a selective-checkpointing policy run on real blocks in a process of its own
(`programs/sac.py`)."""

from __future__ import annotations

from typing import Callable

from .run import run_program


def checkpoint_peak(full: list[int], inputs: list[int], outside: int, chosen) -> int:
    """Lab 7's peak model: block i keeps inputs[i] if checkpointed, else full[i]. The forward ends
    holding all that is kept (plus `outside`); block i's backward holds what the blocks before it
    keep and all of block i (recomputed, if checkpointed). The step's peak is the largest."""
    kept = [inputs[i] if i in chosen else full[i] for i in range(len(full))]
    peak = sum(kept)
    for i in range(len(full)):
        peak = max(peak, sum(kept[:i]) + full[i])
    return peak + outside


def _least_recompute(full, inputs, flops, outside, budget):
    import itertools

    best = None
    for k in range(len(full) + 1):
        for chosen in itertools.combinations(range(len(full)), k):
            if checkpoint_peak(full, inputs, outside, set(chosen)) <= budget:
                cost = sum(flops[i] for i in chosen)
                if best is None or cost < best:
                    best = cost
    return best


def checkpoint_cases(seed: int, n: int = 6) -> list[tuple[list[int], list[int], list[int], int, int]]:
    """Random small models (blocks of unequal sizes and costs) with budgets from nothing-fits to
    everything-fits: (full, inputs, flops, outside, budget)."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        L = rng.randint(2, 7)
        inputs = [rng.randint(1, 4) for _ in range(L)]
        full = [x + rng.randint(4, 30) for x in inputs]
        flops = [rng.randint(1, 9) for _ in range(L)]
        outside = rng.randint(0, 10)
        lo, hi = checkpoint_peak(full, inputs, outside, set(range(L))), checkpoint_peak(full, inputs, outside, set())
        cases.append((full, inputs, flops, outside, rng.randint(lo - 3, hi + 2)))
    return cases


def check_checkpoint_choice(fn: Callable, *, seed: int = 0, n: int = 6) -> None:
    """`fn(full, inputs, flops, outside, budget)` must return the blocks to checkpoint (a collection
    of indices) whose peak (`checkpoint_peak`) fits in `budget` with the least recompute FLOPs, or
    None when no choice fits. Checked against all 2^L choices."""
    for full, inputs, flops, outside, budget in checkpoint_cases(seed, n):
        got = fn(list(full), list(inputs), list(flops), outside, budget)
        best = _least_recompute(full, inputs, flops, outside, budget)
        where = f"full={full}, inputs={inputs}, flops={flops}, outside={outside}, budget={budget}"
        if best is None:
            if got is not None:
                raise AssertionError(f"nothing fits ({where}): even checkpointing every block peaks at "
                                     f"{checkpoint_peak(full, inputs, outside, set(range(len(full))))}; return None")
            continue
        if got is None:
            raise AssertionError(f"some choice fits ({where}) but you returned None")
        try:
            chosen = [int(i) for i in got]
        except (TypeError, ValueError):
            raise AssertionError(f"return a collection of block indices (or None), got {got!r}") from None
        if len(set(chosen)) != len(chosen) or any(not 0 <= i < len(full) for i in chosen):
            raise AssertionError(f"block indices must be distinct and in 0..{len(full) - 1}, got {sorted(chosen)}")
        peak = checkpoint_peak(full, inputs, outside, set(chosen))
        if peak > budget:
            raise AssertionError(f"checkpointing {sorted(chosen)} peaks at {peak} > budget {budget} ({where})")
        cost = sum(flops[i] for i in chosen)
        if cost != best:
            raise AssertionError(f"checkpointing {sorted(chosen)} fits but recomputes {cost} FLOPs; a choice that "
                                 f"fits recomputes only {best} ({where})")


# ----------------------------------------------------------------------------- a selective-checkpointing policy
# The student's make_policy() runs in a process of its own (sandboxed, the answer packages blocked):
# a Transformer block (or an MLP with biases) under torch.utils.checkpoint with
# create_selective_checkpoint_contexts(make_policy()), every forward decision logged with the op and
# its matmul shape, the backward's FLOPs counted (FlopCounterMode) against the block without
# checkpointing and with full recompute, and the gradients compared with the plain block's.
SAC_CASES = ({"b": 2, "s": 16, "h": 32, "heads": 4, "f": 64, "attention": True, "seed": 0},
             {"b": 1, "s": 8, "h": 24, "heads": 2, "f": 40, "attention": False, "seed": 1},
             {"b": 3, "s": 5, "h": 16, "heads": 2, "f": 48, "attention": True, "seed": 2})


_POLICIES = ("MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE")
_MATMULS = ("aten.mm.", "aten.addmm.")


def sac_expected(decisions: list) -> list[bool]:
    """Which ops the policy must save, from the forward's op sequence: attention (any
    `_scaled_dot_product_*` op) and the 1st, 3rd, 5th ... matrix multiply (aten.mm or aten.addmm);
    everything else recomputed."""
    count, want = 0, []
    for op, _, _ in decisions:
        if op.startswith(_MATMULS):
            count += 1
            want.append(count % 2 == 1)
        else:
            want.append("scaled_dot_product" in op)
    return want


def _sac_reports(make_policy: Callable, cases, timeout: float) -> list:
    """`programs/sac.py` on `cases` with the answer's `make_policy`, in one process of its own: one
    report per case (a dict, or {"error": ...})."""
    return run_program("sac", make_policy, list(cases), what="selective-checkpointing run", timeout=timeout,
                       on_timeout=f"the selective-checkpointing run gave no answer within {timeout:.0f} s")


def check_sac_policy(make_policy: Callable, *, cases=SAC_CASES, timeout: float = 120.0) -> None:
    """`make_policy()` returns a policy for torch.utils.checkpoint.create_selective_checkpoint_contexts
    (a fresh one per checkpointed call) that saves attention's output and every second matrix
    multiply's (the 1st, 3rd, ...) and recomputes the rest. Run on real blocks in a process of its own:
    its decisions, its gradients, and the backward's FLOPs measured (the recompute it costs)."""
    for case, rep in zip(cases, _sac_reports(make_policy, cases, timeout)):
        what = ("a Transformer block" if case["attention"] else "an MLP block with biases") + \
               f" (batch {case['b']}, {case['s']} tokens, hidden {case['h']}, MLP {case['f']})"
        if rep.get("error"):
            raise AssertionError(f"{what}: {rep['error']}")
        decisions = rep["decisions"]
        bad = next((d for d in decisions if d[1] not in _POLICIES), None)
        if bad:
            raise AssertionError(f"{what}: for {bad[0]} the policy returned {bad[1]}; return a CheckpointPolicy "
                                 "(torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE, PREFER_RECOMPUTE, ...)")
        saves = [d[1].endswith("_SAVE") for d in decisions]
        want = sac_expected(decisions)
        for (op, _, _), keep, save in zip(decisions, want, saves):
            if keep != save:
                if op.startswith(_MATMULS) and not any(s for (o, _, _), s in zip(decisions, saves) if o.startswith(_MATMULS)):
                    hint = (" (no matrix multiply was saved: `op` is an overload such as torch.ops.aten.mm.default, "
                            "not the packet torch.ops.aten.mm; compare with the overload or with op.overloadpacket)")
                elif "scaled_dot_product" in op:
                    hint = " (attention: on this machine the op is " + op + "; match every _scaled_dot_product_ op)"
                elif op.startswith("aten.addmm."):
                    hint = " (a linear layer with a bias runs aten.addmm: a matrix multiply too)"
                else:
                    hint = ""
                raise AssertionError(f"{what}: the policy {'recomputes' if keep else 'saves'} {op} where it should "
                                     f"{'save' if keep else 'recompute'} it{hint}")
        if not rep["grads_match"]:
            raise AssertionError(f"{what}: the gradients differ from the block without checkpointing")
        recomputed = rep["sac"] - rep["plain"]
        want_flops = sum(2 * m[0][0] * m[0][1] * m[1][1] for (op, _, m), keep in zip(decisions, want)
                         if op.startswith(_MATMULS) and not keep and len(m) == 2)
        # the recomputation stops after the last tensor the backward needs (non-reentrant
        # checkpoint's early stop): at most the recomputed matmuls' FLOPs, less than full recompute's
        if recomputed > want_flops or (want_flops < rep["full"] - rep["plain"] and recomputed >= rep["full"] - rep["plain"]):
            raise AssertionError(f"{what}: the backward recomputed {recomputed:,} FLOPs (measured); the matrix "
                                 f"multiplies the policy recomputes cost at most {want_flops:,}")


def sac_measure(make_policy: Callable, case: dict | None = None, timeout: float = 120.0) -> dict:
    """The student's policy run once on a block: the backward's FLOPs without checkpointing, with
    full recompute and with the policy (measured by FlopCounterMode), and what it saved."""
    return _sac_reports(make_policy, [dict(case or SAC_CASES[0])], timeout)[0]


