"""Lab 1's checks (where memory goes): an integer answer against the expected count, why a GPT-2
parameter count is off, and a gradient-accumulation loop against one full-batch backward."""

from __future__ import annotations

from typing import Any, Callable

from ..units import fmt_bytes


def check_int(actual: Any, expected: int, *, what: str, hint: str = "", unit: str = "") -> None:
    """`actual` must be an int equal to `expected`."""
    if isinstance(actual, bool) or not isinstance(actual, int):
        kind = getattr(actual, "__vramlab_type__", None) or type(actual).__name__  # the grader's view of an answer's object
        raise AssertionError(f"{what}: return an int (a count of {unit or 'items'}), got {kind} {actual!r}")
    if actual != expected:
        off = actual - expected
        shown = (lambda n: fmt_bytes(n)) if unit == "bytes" else (lambda n: f"{n:,}")
        msg = f"{what}: got {shown(actual)}, expected {shown(expected)} (off by {off:+,})."
        raise AssertionError(msg + (f" Hint: {hint}" if hint else ""))


def diagnose_param_count(fn: Callable[..., int], cfg: dict[str, Any], expected: int) -> str:
    """Why a GPT-2 parameter count is off, from the size of the error."""
    got = fn(**cfg)
    if not isinstance(got, int):
        return ""
    h, V, L = cfg["n_embd"], cfg["vocab_size"], cfg["n_layer"]
    off = got - expected
    inner = cfg.get("n_inner") or 4 * h
    if off == V * h:
        return "you counted the LM head separately, but GPT-2 ties it to the token embedding (one tensor)."
    if off == -cfg["n_positions"] * h:
        return "you forgot the learned position embedding (n_positions x n_embd)."
    if off == -L * 4 * h or off == -(L * 4 + 2) * h:
        return "layer norms have a weight and a bias each: 2 per block (4h) plus the final one (2h)."
    if off % L == 0 and abs(off // L) in (3 * h + h + inner + h, h + inner):
        return "every Conv1D/Linear in GPT-2 has a bias vector too."
    if off % L == 0 and abs(off // L) == 2 * h * (inner - 4 * h):
        return "use n_inner for the MLP width when it is given (4 * n_embd only when it is None)."
    return "count block by block: 2 layer norms, c_attn (h x 3h + 3h), c_proj (h x h + h), c_fc and c_proj of the MLP."



# ----------------------------------------------------------------------------- gradient accumulation

def _accum_case(seed: int, n: int, m: int) -> dict:
    return {"seed": seed, "d": 6, "h": 10, "c": 4, "n": n, "micro_batch_size": m}


ACCUM_CASES = ((12, 4), (16, 2))  # divisible: every micro-batch the same size
ACCUM_REMAINDER = ((10, 4), (7, 3), (5, 5), (3, 8))  # a smaller last micro-batch; k = 1; a micro-batch above the batch


def _flat(grads) -> list[float]:
    return [v for g in grads for v in g]


def check_accumulate(fn: Callable, *, cases=ACCUM_CASES, timeout: float = 120.0) -> None:
    """`fn(model, loss_fn, inputs, targets, micro_batch_size)` runs the batch in micro-batches of at most
    `micro_batch_size` rows and leaves in every `.grad` what one backward of `loss_fn` (a mean over rows)
    on the whole batch leaves, starting from no gradient; it returns the number of micro-batches. Run on
    a small MLP in a process of its own (`programs/accum.py`); the reference is computed here, from the
    same seed, by one full-batch backward."""
    import torch

    from .programs import accum
    from .run import fresh_generator, run_program

    seed = int(torch.randint(0, 2**31 - 2, (1,), generator=fresh_generator()))
    specs = [_accum_case(seed + i, n, m) for i, (n, m) in enumerate(cases)]
    reports = run_program("accum", fn, specs, what="accumulation run", timeout=timeout,
                          on_timeout=f"the accumulation run gave no answer within {timeout:.0f} s")
    for case, rep in zip(specs, reports):
        n, m = case["n"], case["micro_batch_size"]
        k = -(-n // m)
        what = f"a batch of {n} rows in micro-batches of {m}"
        if rep.get("error"):
            if rep["error"].startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{what}: {rep['error']}")
            raise AssertionError(f"{what}: {rep['error']}")
        rows = rep["rows"]
        if rows == [n] and k > 1:
            raise AssertionError(f"{what}: the model ran once, on all {n} rows: split the batch (inputs[i:i + {m}]) and "
                                 "run each micro-batch's forward and backward in turn")
        if any(r > m for r in rows) or sum(rows) != n or len(rows) != k:
            raise AssertionError(f"{what}: the model's forward calls saw {rows} rows; expected {k} calls of at most {m} "
                                 f"rows covering the {n} rows once")
        if rep["returned"] != k:
            raise AssertionError(f"{what}: returned {rep['returned']}, expected the number of micro-batches, {k}")
        model, inputs, targets = accum.build(case)
        accum.loss_fn(model(inputs), targets).backward()
        ref = [p.grad.reshape(-1) for p in model.parameters()]
        if any(g is None for g in rep["grads"]):
            raise AssertionError(f"{what}: a parameter has no gradient (.grad is None): run backward() on every "
                                 "micro-batch's loss")
        got = [torch.tensor(g, dtype=torch.float64) for g in rep["grads"]]
        if all(torch.allclose(a, b, rtol=1e-7, atol=1e-10) for a, b in zip(got, ref)):
            continue
        hint = _accum_hint(case, got, ref)
        raise AssertionError(f"{what}: the gradients differ from one backward on the whole batch (largest difference "
                             f"{max(float((a - b).abs().max()) for a, b in zip(got, ref)):.3g}). {hint}")


def _accum_hint(case: dict, got, ref) -> str:
    """Why the accumulated gradients are off, from the wrong answers they equal."""
    import torch

    from .programs import accum

    n, m = case["n"], case["micro_batch_size"]
    k = -(-n // m)

    def close(other) -> bool:
        return all(torch.allclose(a, b, rtol=1e-7, atol=1e-10) for a, b in zip(got, other))

    g = torch.Generator().manual_seed(case["seed"] + 1)
    model, inputs, targets = accum.build(case)
    noise = [torch.randn(p.shape, generator=g, dtype=torch.float64).reshape(-1) for p in model.parameters()]
    if close([a + b for a, b in zip(ref, noise)]):
        return ("The gradients already in .grad were kept: clear them first (p.grad = None, or "
                "model.zero_grad(set_to_none=True)); backward adds into whatever is there.")
    if close([a * k for a in ref]):
        return (f"They are {k}x too large: each micro-batch's loss is a mean over its rows, so scale it by its share "
                "of the batch (1/k when the micro-batches are equal) before backward.")

    def weighted(scale) -> list:
        model, inputs, targets = accum.build(case)
        for i in range(0, n, m):
            x, y = inputs[i:i + m], targets[i:i + m]
            (accum.loss_fn(model(x), y) * scale(x.shape[0])).backward()
        return [p.grad.reshape(-1) for p in model.parameters()]

    if n % m and close(weighted(lambda rows: 1 / k)):
        return (f"The last micro-batch has only {n - (k - 1) * m} rows: scaling every loss by 1/k over-weights its "
                "rows. Scale each micro-batch's mean loss by its rows / the batch's rows.")
    return "Each micro-batch: forward, its mean loss times (its rows / all rows), backward; autograd adds the gradients."
