"""Lab 7's checks (checkpointing): which blocks to checkpoint within a budget (checked against every
choice), a selective-checkpointing policy run on real blocks in a process of its own
(`programs/sac.py`), and a chunked cross-entropy run there too, its vocabulary-sized tensors
measured (`programs/chunk_ce.py`)."""

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




# ----------------------------------------------------------------------------- chunked cross-entropy
# The student's chunked_cross_entropy runs in a process of its own (`programs/chunk_ce.py`), on inputs
# drawn afresh for every grading, forward and backward under a TorchDispatchMode that keeps which
# vocabulary-sized tensors are alive; the loss and the gradients are compared here with F.cross_entropy
# on the whole batch's logits, computed from the same seed.
CHUNK_CASES = ((48, 6), (60, 4))  # 8 and 15 equal chunks
CHUNK_REMAINDER = ((50, 7), (20, 32), (9, 9))  # a last chunk of one token; one chunk larger than the batch; one exactly
CHUNK_ALIVE = 4  # the most chunks' worth (chunk_size x V elements) of vocabulary-sized tensors alive at once


def _chunk_case(seed: int, n: int, chunk_size: int) -> dict:
    """N tokens, a hidden size h of 3 to 6 and a vocabulary V above N x h (so that nothing of the
    hidden states' size, N x h, counts as vocabulary-sized); h is no chunk's number of tokens (a
    chunk's logits would be shaped like the head's transpose, which is not counted)."""
    rows = {min(chunk_size, n), n % chunk_size, n}
    h = next(x for x in (3 + (seed + i) % 4 for i in range(4)) if x not in rows)
    return {"seed": seed, "n": n, "h": h, "v": n * h + 1 + seed % 41, "chunk_size": chunk_size}


def chunk_inputs(case: dict):
    """The case's last hidden states (N x h), LM head (V x h), both float64, and targets (N), from its
    seed: what `programs/chunk_ce.py`'s `build` draws in the answer's process (the checks import no
    program; a test keeps the two the same)."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    n, h, v = case["n"], case["h"], case["v"]
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _chunk_hint(case: dict, got: float, ref) -> str:
    """Why the loss is off, from the wrong answers it equals."""
    import torch.nn.functional as F

    n, c = case["n"], case["chunk_size"]
    hidden, weight, targets = chunk_inputs(case)
    logits = hidden @ weight.T
    means = [F.cross_entropy(logits[i:i + c], targets[i:i + c]) for i in range(0, n, c)]

    def close(x) -> bool:
        return abs(got - float(x)) <= 1e-9 * max(1.0, abs(float(x)))

    if close(ref * n):
        return "It is the sum over the tokens: the loss is their mean (divide the sum by N)."
    if close(sum(means)):
        return "It is the sum of the chunks' means: weight each chunk by its share of the N tokens."
    if n % c and close(sum(means) / len(means)):
        return (f"It is the mean of the chunks' means, but the last chunk has only {n % c} of the {n} tokens: weight each "
                "chunk's mean by its tokens / N (or sum the tokens' losses and divide by N).")
    return "Each token's loss is logsumexp of its logits minus its target's logit; return their mean over the N tokens."


def _chunk_report_ok(rep, hidden_size: int, weight_size: int) -> bool:
    """A report as programs/chunk_ce.py writes it (an error, or the loss, the counts and two gradients
    of the inputs' sizes, or None)."""
    if not isinstance(rep, dict):
        return False
    if "error" in rep:
        return isinstance(rep["error"], str)
    try:
        size, shape, op, phase = rep["largest"]
        return (isinstance(rep["loss"], float) and all(type(rep[k]) is int for k in ("peak", "ops"))
                and isinstance(rep["peak_phase"], str) and type(size) is int and isinstance(shape, list)
                and isinstance(op, str) and isinstance(phase, str)
                and all(g is None or (isinstance(g, list) and len(g) == count and all(isinstance(x, float) for x in g))
                        for g, count in ((rep["hidden_grad"], hidden_size), (rep["weight_grad"], weight_size))))
    except (KeyError, TypeError, ValueError):
        return False


def check_chunked_ce(fn: Callable, *, cases=CHUNK_CASES, timeout: float = 120.0) -> list[dict]:
    """`fn(hidden, weight, targets, chunk_size)` returns the mean cross-entropy of the logits
    hidden @ weight.T (N tokens, vocabulary V) against targets, and `backward()` on it leaves the
    gradients of hidden and weight, while no more than chunk_size tokens' logits exist at once, in
    the forward and the backward. Run in a process of its own (`programs/chunk_ce.py`) on inputs
    drawn afresh, under a TorchDispatchMode that measures the vocabulary-sized tensors alive: none may
    hold more than chunk_size x V elements, and together at most CHUNK_ALIVE times that. The loss and
    the gradients are compared (float64) with F.cross_entropy on the whole batch's logits, computed
    here. Returns, a case, its sizes and the measured peak (elements alive at once, and in which phase)."""
    import torch
    import torch.nn.functional as F

    from .run import fresh_generator, run_program

    seed = int(torch.randint(0, 2**31 - 2, (1,), generator=fresh_generator()))
    specs = [_chunk_case(seed + i, n, c) for i, (n, c) in enumerate(cases)]
    reports = run_program("chunk_ce", fn, specs, what="chunked cross-entropy run", timeout=timeout,
                          on_timeout=f"the chunked cross-entropy run gave no answer within {timeout:.0f} s")
    results = []
    for case, rep in zip(specs, reports):
        n, c, v, h = case["n"], case["chunk_size"], case["v"], case["h"]
        what = f"{n} tokens, vocabulary {v}, chunks of {c}"
        if not _chunk_report_ok(rep, n * h, v * h):
            raise AssertionError(f"{what}: the run's report is not one the harness writes (did the answer change it?)")
        if rep.get("error"):
            if rep["error"].startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{what}: {rep['error']}")
            raise AssertionError(f"{what}: {rep['error']}")
        hidden, weight, targets = chunk_inputs(case)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        ref = F.cross_entropy(hidden @ weight.T, targets)  # the whole batch's logits at once
        ref.backward()
        want = float(ref.detach())
        if not abs(rep["loss"] - want) <= 1e-9 * max(1.0, abs(want)):
            raise AssertionError(f"{what}: the loss is {rep['loss']:.10g}, expected {want:.10g} (F.cross_entropy "
                                 f"on the whole batch). {_chunk_hint(case, rep['loss'], want)}")
        for name, grad, param in (("hidden", rep["hidden_grad"], hidden), ("weight", rep["weight_grad"], weight)):
            if grad is None:
                raise AssertionError(f"{what}: backward() left no gradient in {name}: the loss must be computed from "
                                     f"{name} by torch operations (or return its gradient from your "
                                     "autograd.Function's backward)")
            got, ref_grad = torch.tensor(grad, dtype=torch.float64), param.grad.reshape(-1)
            if not torch.allclose(got, ref_grad, rtol=1e-9, atol=1e-12):
                raise AssertionError(f"{what}: the gradient of {name} differs from the whole loss's (largest difference "
                                     f"{float((got - ref_grad).abs().max()):.3g}): the loss is right, so check what the "
                                     "backward computes (each chunk's softmax minus the one-hot target, divided by N)")
        ce = min(c, n) * v  # a chunk's logits (the batch's, when a chunk holds it all)
        if rep["ops"] == 0:
            raise AssertionError(f"{what}: the check saw no logits computed (no operator made a tensor with a "
                                 "vocabulary dimension): compute them with torch operations, chunk by chunk")
        size, shape, op, phase = rep["largest"]
        if size > ce:
            raise AssertionError(f"{what}: the {phase} made a tensor of shape {tuple(shape)} ({op}): {size:,} elements, "
                                 f"{size / v:g} tokens' worth of logits, more than one chunk's {min(c, n)} x {v}. "
                                 "Compute the logits of one chunk at a time, in the forward and in the backward")
        if rep["peak"] > CHUNK_ALIVE * ce:
            raise AssertionError(f"{what}: {rep['peak']:,} elements of vocabulary-sized tensors were alive at once in the "
                                 f"{rep['peak_phase']} ({rep['peak'] / ce:.1f} chunks' worth; at most {CHUNK_ALIVE} "
                                 f"may be). Each chunk's logits are "
                                 "gone after its forward, but autograd kept what their backward needs (the "
                                 "log-probabilities, chunk x V each) for every chunk: recompute them per chunk in the "
                                 "backward (torch.utils.checkpoint), or compute each chunk's gradients yourself "
                                 "(a torch.autograd.Function)")
        results.append({"n": n, "h": h, "v": v, "chunk_size": c, "peak": rep["peak"], "peak_phase": rep["peak_phase"]})
    return results
