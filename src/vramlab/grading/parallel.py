"""Lab 3's checks (parallelism): the 1F1B schedule (replayed here), and tensor parallelism, bucketed
DDP and ring attention run on ranks that reach each other only through the check's process
(`run.Switchboard`), which logs every collective and message a rank sends; the ranks run
`programs/tp.py`, `programs/ddp.py` and `programs/ring_attn.py`. Every expected value is computed
here, from data drawn here afresh for every grading (each rank is dealt only its own). Lab 4's
ZeRO-2 check (`zero`) runs on the DDP check's MLP (`check_mlp_ranks`). The MoE token dispatch
(`check_dispatch`: top-k routing with a capacity, first choices first, drops) runs the answer in a
process of its own (`programs/dispatch.py`) against `dispatch_reference`."""

from __future__ import annotations

from typing import Any, Callable

from .run import cell_source, fresh_generator, run_linked


def _parse_orders(got: Any, p: int, m: int) -> list[list[tuple[str, int]]]:
    """The answer's per-device orders as [[("F" | "B", micro-batch), ...], ...], or AssertionError."""
    if not isinstance(got, (list, tuple)) or len(got) != p:
        n = len(got) if isinstance(got, (list, tuple)) else None
        raise AssertionError(f"p={p}, m={m}: return one list of operations per device ({p} lists), got "
                             + (f"{n}" if n is not None else repr(got)[:80]))
    orders = []
    for d, order in enumerate(got):
        if not isinstance(order, (list, tuple)):
            raise AssertionError(f"p={p}, m={m}: device {d}'s operations must be a list, got {repr(order)[:80]}")
        ops = []
        for op in order:
            if (not isinstance(op, (list, tuple)) or len(op) != 2 or op[0] not in ("F", "B")
                    or type(op[1]) is not int or not 0 <= op[1] < m):
                raise AssertionError(f"p={p}, m={m}: device {d} has the operation {repr(op)[:80]}; each operation "
                                     f"is a pair (\"F\" or \"B\", micro-batch in 0..{m - 1})")
            ops.append((str(op[0]), int(op[1])))
        for kind in ("F", "B"):
            seen = [i for k, i in ops if k == kind]
            missing = sorted(set(range(m)) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            if missing or twice:
                name = "forward" if kind == "F" else "backward"
                raise AssertionError(f"p={p}, m={m}: device {d} " + (f"never runs the {name} of micro-batch(es) "
                                     f"{missing}" if missing else f"runs the {name} of micro-batch(es) {twice} twice")
                                     + ": every device runs each micro-batch's forward and backward exactly once")
        orders.append(ops)
    return orders


def _pipeline_needs(kind: str, i: int, d: int, p: int) -> tuple[str, int, int] | None:
    """What an operation of device (stage) d waits for: a forward the previous stage's forward of the
    same micro-batch; a backward the next stage's backward or, on the last stage, its own forward."""
    if kind == "F":
        return ("F", i, d - 1) if d > 0 else None
    return ("B", i, d + 1) if d < p - 1 else ("F", i, d)


def pipeline_replay(orders: list[list[tuple[str, int]]], *, tf: int = 1, tb: int = 2) -> dict:
    """Replay per-device orders with a forward taking `tf`, a backward `tb` and free communication:
    each operation starts when its device is free and what it needs is done. Returns {"end": the
    step's makespan, "in_flight": per device the most micro-batches between their forward and their
    backward} or {"stuck": [(device, operation, what it waits for), ...]} for a deadlock."""
    p = len(orders)
    done: dict[tuple[str, int, int], int] = {}
    pos, free = [0] * p, [0] * p
    while any(pos[d] < len(orders[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            if pos[d] < len(orders[d]):
                kind, i = orders[d][pos[d]]
                need = _pipeline_needs(kind, i, d, p)
                if need is None or need in done:
                    end = max(free[d], done[need] if need else 0) + (tf if kind == "F" else tb)
                    done[(kind, i, d)] = free[d] = end
                    pos[d] += 1
                    progressed = True
        if not progressed:
            return {"stuck": [(d, orders[d][pos[d]], _pipeline_needs(*orders[d][pos[d]], d, p))
                              for d in range(p) if pos[d] < len(orders[d])]}
    in_flight = []
    for order in orders:
        held = peak = 0
        for kind, _ in order:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        in_flight.append(peak)
    return {"end": max(free), "in_flight": in_flight}


def check_one_f_one_b(fn: Callable, *, cases=((2, 4), (4, 8))) -> None:
    """`fn(p, m)` must return each pipeline device's order of operations, ("F" | "B", micro-batch),
    that make a 1F1B schedule. Checked by replaying the orders here (forward 1, backward 2, free
    sends): every operation exactly once, no deadlock, the step as short as GPipe's (the optimum,
    (m + p - 1)(tf + tb)), and at most p - d micro-batches in flight on device d (GPipe holds m).
    `cases` are (p, m)."""
    tf, tb = 1, 2
    for p, m in cases:
        orders = _parse_orders(fn(p, m), p, m)
        run = pipeline_replay(orders, tf=tf, tb=tb)
        if "stuck" in run:
            waits = "; ".join(f"device {d}'s next, {k} {i}, waits for {n[0]} {n[1]} on device {n[2]}"
                              for d, (k, i), n in run["stuck"][:4])
            raise AssertionError(f"p={p}, m={m}: the orders deadlock, no device can start its next operation ({waits})."
                                 " A forward needs the previous stage's forward of its micro-batch; a backward "
                                 "the next stage's backward (on the last stage, its own forward).")
        for d, held in enumerate(run["in_flight"]):
            if held > p - d:
                raise AssertionError(
                    f"p={p}, m={m}: device {d} holds the activations of {held} micro-batches at once (forwards run, "
                    f"backwards not yet); 1F1B holds at most p - d = {p - d}: after {p - d - 1} warm-up forwards, "
                    "alternate one forward and one backward" + (" (all forwards then all backwards is GPipe: it holds "
                                                                "all m)" if held == m else ""))
        best = (m + p - 1) * (tf + tb)
        if run["end"] != best:
            raise AssertionError(
                f"p={p}, m={m}: with a forward taking 1 and a backward 2, your step takes {run['end']}; GPipe and 1F1B "
                f"take (m + p - 1)(tf + tb) = {best}. Too few warm-up forwards leave the pipeline empty: device d "
                f"runs min(p - d - 1, m) forwards before its first backward.")


# ----------------------------------------------------------------------------- what a rank reported
def rank_problem(report: Any) -> str | None:
    """Why a rank gave no result (it did not finish, or raised), or None."""
    if not isinstance(report, dict):
        return "did not finish"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    return None


def as_tensor(values: Any, like) -> Any:
    """The answer's values as a tensor shaped like `like`, or None if they do not fit."""
    import torch

    try:
        t = torch.tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return t.reshape(like.shape) if t.numel() == like.numel() and t.dim() in (1, like.dim()) else None


def tclose(got, want) -> bool:
    """`got` (an `as_tensor`, or None) equals `want` to float64's rounding."""
    import torch

    return got is not None and torch.allclose(got, want, rtol=1e-9, atol=1e-12)


# Tensor parallelism (Megatron-LM's MLP, Shoeybi+19 §3): the answer's f (identity forward, all-reduce
# backward) and g (all-reduce forward, identity backward) as autograd Functions, each alone, then the
# column- then row-parallel MLP built with them, on ranks each dealt the whole input x (b, s, h), the
# output gradient dy and its own shards of w1 (h, f; columns) and w2 (f, h; rows), drawn here
# (`programs/tp.py`). Only all_reduce is available, logged with the phase it ran in.
def _tp_reference(b: int, s: int, h: int, f: int, world: int) -> dict:
    """What every rank should see, computed here from data drawn here (afresh for every grading):
    the unsplit MLP and its gradients, each rank's partial output and partial input gradient
    (float64), and what each rank is dealt ("dealt": its weight shards, t and u, x and dy)."""
    import torch

    g = fresh_generator()
    x, w1, w2, dy = (torch.randn(*shape, generator=g, dtype=torch.float64)
                     for shape in ((b, s, h), (h, f), (f, h), (b, s, h)))
    tu = [tuple(torch.randn(b, s, h, generator=g, dtype=torch.float64) for _ in range(2)) for _ in range(world)]
    ranks, dealt = [], []
    for (t, u), c, r in zip(tu, torch.tensor_split(w1, world, dim=1), torch.tensor_split(w2, world, dim=0)):
        dealt.append({"x": x.tolist(), "dy": dy.tolist(), "w1": c.tolist(), "w2": r.tolist(), "t": t.tolist(), "u": u.tolist()})
        xs, c, r = x.clone().requires_grad_(), c.clone().requires_grad_(), r.clone().requires_grad_()
        y = torch.nn.functional.gelu(xs @ c) @ r
        y.backward(dy)
        ranks.append({"partial": y.detach(), "partial_dx": xs.grad, "dw1": c.grad, "dw2": r.grad})
    return {"x": x, "dy": dy, "t": [t for t, _ in tu], "u": [u for _, u in tu], "dealt": dealt,
            "y": sum(r["partial"] for r in ranks), "dx": sum(r["partial_dx"] for r in ranks), "ranks": ranks}


def _tp_calls(log: Any, phase: str) -> list:
    return [c for c in log if isinstance(c, dict) and c.get("phase") == phase] if isinstance(log, list) else []


def _tp_rank_problem(report: Any, rank: int, ref: dict, names: tuple[str, str]) -> str | None:
    """What is wrong on one rank: f and g alone (results and communication), then the MLP."""
    why = rank_problem(report)
    if why:
        return why
    res, log = report.get("result") or {}, report.get("log")
    f, g = names
    shape = list(ref["x"].shape)
    # f: identity forward, all-reduce backward
    if res.get("f_error"):
        return f"{f} raised {res['f_error']}"
    if _tp_calls(log, "f forward"):
        return (f"{f}.forward communicated; f is the identity in the forward (every rank already holds the whole "
                "input) and all-reduces only in the backward")
    if not tclose(as_tensor(res.get("f_forward"), ref["x"]), ref["x"]):
        return f"{f}.forward changed its input; f is the identity in the forward"
    calls = _tp_calls(log, "f backward")
    if len(calls) != 1:
        return (f"{f}.backward called dist.all_reduce {len(calls)} times; it must sum the input's gradient over the "
                "ranks exactly once (each rank's gradient holds only its own columns' contribution)")
    if not tclose(as_tensor(res.get("f_backward"), ref["x"]), sum(ref["u"])):
        return f"{f}.backward must return the gradient summed over the ranks (dist.all_reduce, SUM)"
    # g: all-reduce forward, identity backward
    if res.get("g_error"):
        return f"{g} raised {res['g_error']}"
    calls = _tp_calls(log, "g forward")
    if len(calls) != 1:
        return (f"{g}.forward called dist.all_reduce {len(calls)} times; g sums the ranks' partial outputs with "
                "exactly one all-reduce")
    if not tclose(as_tensor(res.get("g_forward"), ref["x"]), sum(ref["t"])):
        return f"{g}.forward must return the sum of every rank's input (dist.all_reduce of a copy, SUM)"
    if _tp_calls(log, "g backward"):
        return (f"{g}.backward communicated; the output's gradient is already the same on every rank, so g's "
                "backward is the identity (an all-reduce would multiply it by the number of ranks)")
    if not tclose(as_tensor(res.get("g_backward"), ref["x"]), ref["dy"]):
        return f"{g}.backward must return the output's gradient unchanged"
    # the MLP: one all-reduce of the partial output in the forward, one of the input's partial gradient in the backward
    mine = ref["ranks"][rank]
    for phase, want, what, fix in (
            ("mlp forward", mine["partial"], "this rank's partial output gelu(x @ w1_shard) @ w2_shard",
             "apply g to the row-parallel product"),
            ("mlp backward", mine["partial_dx"], "this rank's partial gradient of the input",
             "apply f to the input before the column-parallel matmul")):
        calls = _tp_calls(log, phase)
        if len(calls) != 1:
            return (f"made {len(calls)} all-reduces in the MLP's {phase.split()[1]}; Megatron's MLP makes exactly one, "
                    f"of {what} ({'x'.join(map(str, shape))} values): {fix}")
        got = calls[0]
        if got.get("shape") != shape or "SUM" not in str(got.get("op")).upper():
            return (f"all-reduced a {got.get('shape')} tensor ({got.get('op')}) in the MLP's {phase.split()[1]}; "
                    f"expected {what}, {shape}, summed")
        if not tclose(as_tensor(got.get("values"), want), want):
            return f"all-reduced something other than {what} in the MLP's {phase.split()[1]}"
    for key, want, what in (("y", ref["y"], "the output"), ("dx", ref["dx"], "the input's gradient"),
                            ("dw1", mine["dw1"], "the gradient of this rank's w1 columns"),
                            ("dw2", mine["dw2"], "the gradient of this rank's w2 rows")):
        if not tclose(as_tensor(res.get(key), want), want):
            return f"{what} differs from the unsplit MLP's (computed here on one process)"
    return None


def check_tp_mlp(fn: Callable, f_op: Any, g_op: Any, *, cases=((2, 2, 3, 8, 16),), timeout: float = 120.0) -> None:
    """Run the student's Megatron operators f (`f_op`: identity forward, all-reduce backward) and g
    (`g_op`: all-reduce forward, identity backward), then `fn(x, w1_shard, w2_shard)` (the column- then
    row-parallel MLP built with them) on linked ranks (`run.Switchboard`), and check on every rank: f
    and g alone, the MLP's output, the input's gradient and the rank's weight-shard gradients against
    one process (computed here), and the traffic: exactly one all-reduce in the forward, of the rank's
    partial output, and one in the backward, of its partial input gradient. `cases` are (ranks,
    batch, sequence, hidden, MLP width)."""
    import tempfile

    source = cell_source(fn, f_op, g_op)
    names = (f_op.__name__, g_op.__name__)
    with tempfile.TemporaryDirectory() as tmp:
        for world, b, s, h, f in cases:
            ref = _tp_reference(b, s, h, f, world)
            reports = run_linked("tp", world, [b, s, h, f], source=source, names=[fn.__name__, *names], tmp=tmp,
                                 timeout=timeout, what="the tensor-parallel MLP", dealt=ref["dealt"])
            for rank, report in enumerate(reports):
                why = _tp_rank_problem(report, rank, ref, names)
                if why:
                    raise AssertionError(f"tensor-parallel MLP on {world} ranks (x {b}x{s}x{h}, width {f}): "
                                         f"rank {rank} {why}.")


# Data parallelism with bucketed, overlapped all-reduce (PyTorch DDP, Li+20; CS336's assignment 2):
# a small MLP (float64, the same on every rank: `programs/common.py`'s mlp_model, given these sizes,
# seed and learning rate in the case), each rank its slice of the batch. The harness's own
# post-accumulate-grad hooks, registered before the answer's, log when each gradient is ready; the
# answer's all-reduces are logged with the phase (backward, or after it in finish()). The caller builds
# the buckets itself from the parameter sizes and the cap, and computes each rank's local gradients and
# one process's gradients on the whole batch.
DDP_DIMS = (8, 16, 16, 4)  # Linear(8, 16), Tanh, Linear(16, 16), Tanh, Linear(16, 4)
DDP_BATCH, DDP_LR, DDP_STEPS = 12, 0.1, 2
DDP_SEED = 11  # the MLP's initial weights, the same on every rank and here


def mlp_grads(params: list, x, y) -> list:
    """The gradients of the harness's MLP (Linear, Tanh, ..., Linear: `params` as weight, bias pairs)
    for the mean squared error on (x, y), computed here with plain tensors."""
    import torch

    ps = [p.clone().requires_grad_() for p in params]
    h = x
    for k in range(0, len(ps), 2):
        h = h @ ps[k].T + ps[k + 1]
        if k < len(ps) - 2:
            h = torch.tanh(h)
    ((h - y) ** 2).mean().backward()
    return [p.grad for p in ps]


def mlp_reference(world: int, steps: int, *, update: bool) -> dict:
    """The harness's MLP computed here with plain tensors: per step, one process's gradients on the
    whole batch (the mean loss) and each rank's own gradients on its slice; parameters updated with
    SGD (lr DDP_LR) on one process's gradients if `update`. The batches are drawn here, afresh for
    every grading; "dealt" holds each rank's slices (all a rank is given)."""
    import torch

    g = torch.Generator().manual_seed(DDP_SEED)
    params, names = [], []
    for k, (i, o) in enumerate(zip(DDP_DIMS[:-1], DDP_DIMS[1:])):
        params += [torch.randn(o, i, generator=g, dtype=torch.float64) * 0.4,
                   torch.randn(o, generator=g, dtype=torch.float64) * 0.1]
        names += [f"{2 * k}.weight", f"{2 * k}.bias"]

    out, dealt = [], [{"x": [], "y": []} for _ in range(world)]
    gen = fresh_generator()
    for step in range(steps):
        x = torch.randn(DDP_BATCH, DDP_DIMS[0], generator=gen, dtype=torch.float64)
        y = torch.randn(DDP_BATCH, DDP_DIMS[-1], generator=gen, dtype=torch.float64)
        whole = mlp_grads(params, x, y)
        local = [mlp_grads(params, xs, ys) for xs, ys in zip(x.tensor_split(world), y.tensor_split(world))]
        for d, xs, ys in zip(dealt, x.tensor_split(world), y.tensor_split(world)):
            d["x"].append(xs.tolist())
            d["y"].append(ys.tolist())
        out.append({"whole": whole, "local": local})
        if update:
            params = [p - DDP_LR * gr for p, gr in zip(params, whole)]
    return {"names": names, "sizes": [p.numel() for p in params], "steps": out, "dealt": dealt}


def grad_buckets(numels: list[int], cap_bytes: int, *, bytes_per_value: int = 8) -> list[list[int]]:
    """Parameter indices by bucket: the parameters in reverse order, each added to the current bucket
    unless that would take it past `cap_bytes` (then the bucket closes first); a parameter larger than
    the cap is a bucket of its own."""
    buckets: list[list[int]] = []
    size = 0
    for k in reversed(range(len(numels))):
        nbytes = numels[k] * bytes_per_value
        if buckets and buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        if not buckets:
            buckets.append([])
        buckets[-1].append(k)
        size += nbytes
    return buckets


def split_steps(log: list) -> list[list]:
    """The log's events, step by step (each step opens with {"step": k}); what came before, first."""
    out: list[list] = [[]]
    for event in log if isinstance(log, list) else []:
        if isinstance(event, dict) and "step" in event:
            out.append([])
        else:
            out[-1].append(event)
    return out


def bucket_values(local: list, bucket: list[int], pad_to: int = 0):
    import torch

    flat = torch.cat([local[k].flatten() for k in bucket])
    return torch.cat([flat, flat.new_zeros(pad_to - flat.numel())]) if pad_to > flat.numel() else flat


def launch_problem(events: list, call_at: int, bucket: list[int], names: list[str]) -> str | None:
    """A bucket's collective must come after all its gradients are ready and before any other gradient
    becomes ready: launched from the hook of its last gradient."""
    ready = {e["ready"]: i for i, e in enumerate(events) if isinstance(e, dict) and "ready" in e}
    shown = [names[k] for k in bucket]
    if any(k not in ready or ready[k] > call_at for k in bucket):
        return f"launched the bucket {shown} before all its gradients were ready"
    last = max(ready[k] for k in bucket)
    later = [k for k, i in ready.items() if last < i < call_at]
    if later:
        return (f"launched the bucket {shown} only after the gradient of {names[later[0]]} had become ready too: "
                "launch a bucket from the hook of its last gradient, so that it travels while the backward goes on")
    return None


def _ddp_step_problem(events: list, got: Any, step: dict, rank: int, buckets: list[list[int]], names: list[str],
                      world: int, cap: int) -> str | None:
    """What is wrong with one DDP step of one rank (see `check_mlp_ranks`), or None."""
    import torch

    local, whole = step["local"][rank], step["whole"]

    calls = [(i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("call") == "all_reduce"]
    sizes = sorted(sum(local[k].numel() for k in b) for b in buckets)
    got_sizes = sorted(len(e.get("values") or []) for _, e in calls)
    if got_sizes != sizes:
        return (f"made {len(calls)} all-reduces of {got_sizes} values; with a cap of {cap} bytes the parameters, in "
                f"reverse order of model.parameters() (float64: 8 bytes a value), fill {len(buckets)} buckets of "
                f"{sizes} values: add each parameter to the current bucket, and close the bucket first if it would "
                "go past the cap (a parameter larger than the cap is a bucket of its own); one all-reduce a bucket")
    for bucket in buckets:
        want = bucket_values(local, bucket)
        match = None
        for i, e in calls:
            vals = torch.tensor(e.get("values") or [], dtype=torch.float64)
            if vals.numel() == want.numel() and any(torch.allclose(vals.sort().values, (want * s).sort().values,
                                                                   rtol=1e-9, atol=1e-12) for s in (1, 1 / world)):
                match = (i, e)
                break
        shown = [names[k] for k in bucket]
        if match is None:
            return (f"no all-reduce carried the bucket {shown}: this rank's gradients of those parameters, flattened "
                    "into one tensor")
        i, e = match
        if "SUM" not in str(e.get("op")).upper():
            return f"all-reduced with {e.get('op')}: sum (then divide by the number of ranks)"
        if e.get("phase") != "backward" or not e.get("async"):
            return (f"launched the all-reduce of the bucket {shown} " + ("after loss.backward() returned (in "
                    f"{e.get('phase')})" if e.get("phase") != "backward" else "without async_op=True, so the backward "
                    "waited for it") + ": DDP overlaps communication with the backward; launch each bucket with "
                    "async_op=True from the hook of its last gradient, and let finish() only wait")
        why = launch_problem(events, i, bucket, names)
        if why:
            return why
    if not isinstance(got, list) or len(got) != len(whole):
        return "left no gradients in p.grad after finish()"
    for k, want in enumerate(whole):
        if not tclose(as_tensor(got[k], want), want):
            return (f"after finish() the gradient of {names[k]} differs from one process's on the whole batch: write "
                    "the sum over the ranks divided by their number back into p.grad")
    return None


def check_mlp_ranks(harness: str, cls: Any, cases, *, timeout: float, what: str, update: bool, early: str,
                    step_problem: Callable, step: str) -> None:
    """Run the answer's class `cls(model, bucket_bytes)` on linked ranks with the MLP harness `harness`
    (`programs/ddp.py`, `programs/zero2.py`) for DDP_STEPS steps of every cap of `cases` ((ranks, cap
    in bytes)), the batches drawn here (`mlp_reference`, SGD between steps if `update`), and raise
    AssertionError "<what> on N ranks: rank r <why>." for the first problem: what a rank raised, a
    collective before the first backward (`early`), or what `step_problem(events, got, step, rank,
    buckets, names, world, cap)` finds in a step (its log's events, the rank's report of the step, the
    reference's step), with "(cap C bytes, <step> k)"."""
    import tempfile

    source = cell_source(cls)
    by_world: dict[int, list[int]] = {}
    for world, cap in cases:
        by_world.setdefault(world, []).append(cap)
    with tempfile.TemporaryDirectory() as tmp:
        for world, caps in by_world.items():
            ref = mlp_reference(world, DDP_STEPS, update=update)
            case = {"caps": caps, "dims": list(DDP_DIMS), "seed": DDP_SEED, "lr": DDP_LR, "steps": DDP_STEPS}
            reports = run_linked(harness, world, case, source=source, names=[cls.__name__], tmp=tmp, timeout=timeout,
                                 what=what, dealt=ref["dealt"])
            for rank, report in enumerate(reports):
                why = rank_problem(report)
                per_step = split_steps(report.get("log") if isinstance(report, dict) else None)
                if not why and any(isinstance(e, dict) and "call" in e for e in per_step[0]):
                    why = early
                results = report.get("result") if isinstance(report, dict) else None
                k = 1
                for c, cap in enumerate(caps):
                    if why:
                        break
                    buckets = grad_buckets(ref["sizes"], cap)
                    got = results[c] if isinstance(results, list) and c < len(results) else []
                    for n in range(DDP_STEPS):
                        events = per_step[k] if k < len(per_step) else []
                        k += 1
                        why = step_problem(events, got[n] if isinstance(got, list) and n < len(got) else None,
                                           ref["steps"][n], rank, buckets, ref["names"], world, cap)
                        if why:
                            why += f" (cap {cap} bytes, {step} {n + 1})"
                            break
                if why:
                    raise AssertionError(f"{what} on {world} ranks: rank {rank} {why}.")


def check_bucketed_ddp(cls: Any, *, cases=((2, 1000), (2, 10**6)), timeout: float = 120.0) -> None:
    """Run the student's bucketed DDP, `cls(model, bucket_bytes)` whose `finish()` ends a step, on linked
    ranks (`run.Switchboard`) for two SGD steps of a small float64 MLP, each rank on its slice of the
    batch, and check on every rank: the gradients in p.grad after finish() equal one process's on the
    whole batch; one all-reduce per bucket, the buckets as computed here from the parameter sizes and
    the cap, each carrying the rank's own gradients; every all-reduce launched asynchronously during
    the backward, from the hook of the bucket's last gradient. `cases` are (ranks, cap in bytes)."""
    check_mlp_ranks("ddp", cls, cases, timeout=timeout, what="bucketed DDP", update=True, step_problem=_ddp_step_problem,
                    early="called all_reduce before the first backward (the parameters start equal on every rank)",
                    step="step")


# Context parallelism with ring attention (Liu+23; chapter 3's "Context parallelism"): each rank holds
# a contiguous shard of the sequence, q, k and v (b, heads, s/cp, d), drawn here afresh for every
# grading (each rank is dealt only its own); the answer's forward passes the K/V blocks round the ring
# with point-to-point messages only (`programs/ring_attn.py`), which the switchboard logs. The
# reference is one process's causal attention on the whole sequence; the usual mistakes are computed
# here too, block by block as a ring would merge them, so that a wrong output can be named.
def _ring_attn_inputs(world: int) -> dict:
    """Shapes and q, k, v (b, heads, s, d; s = world x the shard's length) drawn afresh, and each
    rank's contiguous shard ("dealt")."""
    import torch

    g = fresh_generator()
    b, heads, n = (int(torch.randint(lo, hi + 1, (1,), generator=g)) for lo, hi in ((1, 2), (1, 3), (2, 4)))
    d = (4, 8)[int(torch.randint(0, 2, (1,), generator=g))]
    q, k, v = (torch.randn(b, heads, world * n, d, generator=g, dtype=torch.float64) for _ in range(3))
    dealt = [{"q": qs.tolist(), "k": ks.tolist(), "v": vs.tolist()}
             for qs, ks, vs in zip(q.chunk(world, 2), k.chunk(world, 2), v.chunk(world, 2))]
    return {"b": b, "heads": heads, "n": n, "d": d, "q": q, "k": k, "v": v, "dealt": dealt}


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v with the causal mask (query i sees keys 0..i), on one process."""
    import torch

    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def ring_attention_blocks(q, k, v, world: int, *, own_mask: bool = True, mask_earlier: bool = False,
                          use_later: bool = False, merge: str = "lse") -> list:
    """Each rank's output as a ring computes it, block by block in the ring's order (the rank's own
    block, then rank - 1's, rank - 2's, ...), with the variations the usual mistakes make: the own
    block's causal mask left out (`own_mask`), the earlier ranks' blocks masked too (`mask_earlier`),
    the later ranks' blocks used (`use_later`), and the blocks merged by `merge`: "lse" (the running
    maximum and sum: exact), "own-max" (each block's exp(S - its own max) added as it is), "stale-max"
    (the running maximum kept, but what was added before never rescaled), "sum" or "average" (of the
    blocks' own softmax outputs)."""
    import torch

    n, scale = q.shape[-2] // world, q.shape[-1] ** -0.5
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    qs, ks, vs = q.split(n, -2), k.split(n, -2), v.split(n, -2)
    outs = []
    for r in range(world):
        blocks = []
        for j in range(world):
            src = (r - j) % world
            if src > r and not use_later:
                continue
            scores = (qs[r] @ ks[src].transpose(-1, -2)) * scale
            if (src == r and own_mask) or (src < r and mask_earlier):
                scores = scores.masked_fill(~tri, float("-inf"))
            blocks.append((scores, vs[src]))
        if merge == "lse":
            out = torch.softmax(torch.cat([s for s, _ in blocks], -1), -1) @ torch.cat([x for _, x in blocks], -2)
        elif merge in ("sum", "average"):
            out = sum(torch.softmax(s, -1) @ x for s, x in blocks) / (len(blocks) if merge == "average" else 1)
        else:
            o = l = m = None
            for s, x in blocks:
                top = s.amax(-1, keepdim=True)
                if merge == "stale-max":
                    top = top if m is None else torch.maximum(m, top)
                p = torch.exp(s - top)
                o = p @ x if o is None else o + p @ x
                l = p.sum(-1, keepdim=True) if l is None else l + p.sum(-1, keepdim=True)
                m = top
            out = o / l
        outs.append(out)
    return outs


_RING_ATTN_MISTAKES = (
    (dict(own_mask=False), "attends to its own block without the causal mask: within the rank's own block query i "
                           "may see only keys 0..i (mask above the diagonal, keep the diagonal)"),
    (dict(mask_earlier=True), "masks the earlier ranks' blocks too: every key of an earlier rank's block comes before "
                              "every query of this rank, so those blocks take no mask; only the rank's own block is "
                              "triangular"),
    (dict(use_later=True), "uses the blocks of later ranks: every key of a later rank comes after every query of this "
                           "rank, so the causal mask hides those blocks entirely; skip them (but still pass them on)"),
    *((dict(merge=m), "merges the blocks' partial outputs without rescaling by the running maximum: keep each row's "
                      "running maximum m and sum l (or its log-sum-exp); when a block raises m, multiply the output so "
                      "far and l by exp(m_old - m_new) before adding the block's exp(S - m_new) @ V, and divide by l "
                      "at the end") for m in ("own-max", "stale-max", "sum", "average")),
)


def _ring_attn_rank_problem(report: Any, rank: int, world: int, inp: dict, want, outs: dict) -> str | None:
    """What is wrong with one rank's output (its report's "result"), or None: its type, shape and dtype,
    then its values against `want` (this rank's rows of one process's causal attention), naming the
    mistake whose output (`outs`, each mistake's outputs by rank) it matches."""
    res = report.get("result") if isinstance(report, dict) else None
    shape = [inp["b"], inp["heads"], inp["n"], inp["d"]]
    if not isinstance(res, dict) or "shape" not in res:
        return (f"returned {(res or {}).get('type', 'nothing')}: return this rank's output, a tensor of shape "
                f"{tuple(shape)}")
    if res["shape"] != shape:
        return (f"returned a tensor of shape {tuple(res['shape'])}: the output is this rank's queries' rows, "
                f"(b, heads, s/cp, d) = {tuple(shape)}")
    if res.get("dtype") != "float64":
        return f"returned {res.get('dtype')} values: keep the inputs' dtype (float64) throughout"
    got = as_tensor(res.get("out"), want)
    if tclose(got, want):
        return None
    for i, (_, why) in enumerate(_RING_ATTN_MISTAKES):
        if tclose(got, outs[i][rank]):
            return why
    err = float((got - want).abs().max()) if got is not None else float("nan")
    return (f"returned an output that differs from one process's causal attention, softmax(q k^T / sqrt(d)) v with the "
            f"causal mask, by up to {err:.3g} (computed here on the whole sequence)")


def _ring_attn_traffic_problem(sent: Any, rank: int, world: int, inp: dict, *,
                               peers_only: bool = False) -> str | None:
    """What is wrong with one rank's sends (the switchboard's [[peer, values], ...]), or None: all to its
    successor (all `peers_only` checks: a ring turned the wrong way is named before its wrong output),
    world - 1 K/V blocks in all, each a block the ring holds at its step (the rank's own, then those it
    received), in any split and order."""
    import torch

    sent = sent if isinstance(sent, list) else []
    nxt = (rank + 1) % world
    peers = sorted({m[0] for m in sent if isinstance(m, list) and len(m) == 2}, key=str)
    if peers and peers != [nxt]:
        return (f"sent to rank(s) {peers}: a ring sends every block to its successor, rank (rank + 1) % world_size = "
                f"{nxt}, and receives from its predecessor")
    if peers_only:
        return None
    values = [x for m in sent for x in (m[1] if isinstance(m, list) and len(m) == 2 and isinstance(m[1], list) else [])]
    block = inp["b"] * inp["heads"] * inp["n"] * inp["d"]
    want = 2 * (world - 1) * block
    if len(values) != want:
        return (f"sent {len(values)} values in {len(sent)} messages; a ring's rank sends world_size - 1 = {world - 1} "
                f"K/V blocks (its own, then each it receives but the last), K and V each b x heads x s/cp x d = {block} "
                f"values: {want} in all")
    n = inp["n"]
    expected = torch.cat([t[:, :, src * n:(src + 1) * n].flatten() for j in range(world - 1)
                          for src in [(rank - j) % world] for t in (inp["k"], inp["v"])])
    if not torch.allclose(torch.tensor(values, dtype=torch.float64).sort().values, expected.sort().values,
                          rtol=1e-12, atol=0):
        return ("sent values that are not the K/V blocks a ring passes on: at step j a rank sends the block of rank "
                "(rank - j) % world_size, its own first, as it received it")
    return None


def check_ring_attention(fn: Callable, *, worlds=(2, 3), timeout: float = 60.0) -> None:
    """Run the student's `fn(q, k, v, rank, world_size)` (the forward of causal ring attention on one
    rank's contiguous shard of the sequence) on linked ranks (`run.Switchboard`) for each world size of
    `worlds`, with the ready-made collectives unavailable; shapes and q, k, v drawn here afresh, each
    rank dealt only its shard. Checks every rank's output against one process's causal attention
    (float64; the usual mistakes named: the own block unmasked, the earlier blocks masked, the later
    blocks used, a merge without the running maximum's rescaling) and its traffic: world - 1 K/V blocks,
    each one the ring holds at that step, all sent to rank + 1. A deadlock (every rank in a blocking
    send) fails at once with what each rank waits for."""
    import re
    import tempfile

    from .run import run_world

    source = cell_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        for i, world in enumerate(worlds):
            inp = _ring_attn_inputs(world)
            what = (f"ring attention on {world} ranks (b={inp['b']}, heads={inp['heads']}, s={world * inp['n']}, "
                    f"d={inp['d']})")
            reports = run_world("ring_attn", world, None, source=source, names=[fn.__name__], tmp=f"{tmp}/case{i}",
                                dealt=inp["dealt"], log="ring", timeout=timeout, on_timeout=(
                                    f"{what}: no answer within {timeout:.0f} s. A blocking dist.send returns only once "
                                    "its receive is posted: if every rank sends first, none receives. Post the receive "
                                    "with dist.irecv (or send with dist.isend) before waiting, or alternate the order "
                                    "by rank parity."))
            errors = [(r, rank_problem(rep)) for r, rep in enumerate(reports) if rank_problem(rep)]
            if errors:  # a rank's own error before one that only reports a peer's
                peer = r"raised RuntimeError: rank \d+ (finished|ended|raised an error) before"
                r, why = next((e for e in errors if not re.match(peer, e[1])), errors[0])
                err = str((reports[r] or {}).get("error") or "")
                if err.startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                    raise NotImplementedError(f"{what}: {err}")
                raise AssertionError(f"{what}: rank {r} {why}.")
            for rank, report in enumerate(reports):
                why = _ring_attn_traffic_problem(report.get("log"), rank, world, inp, peers_only=True)
                if why:
                    raise AssertionError(f"{what}: rank {rank} {why}.")
            want = causal_attention(inp["q"], inp["k"], inp["v"]).split(inp["n"], -2)
            outs = [ring_attention_blocks(inp["q"], inp["k"], inp["v"], world, **variant)
                    for variant, _ in _RING_ATTN_MISTAKES]
            for rank, report in enumerate(reports):
                why = _ring_attn_rank_problem(report, rank, world, inp, want[rank], outs)
                if why:
                    raise AssertionError(f"{what}: rank {rank} {why}.")
            for rank, report in enumerate(reports):
                why = _ring_attn_traffic_problem(report.get("log"), rank, world, inp)
                if why:
                    raise AssertionError(f"{what}: rank {rank} {why}.")


# ----------------------------------------------------------------------------- MoE token dispatch
# Expert parallelism sends each token to the experts its router picks, into a buffer of `capacity`
# rows per expert (E x C x h, what the all-to-all moves). The answer's dispatch(router_logits, top_k,
# capacity) returns, per token and choice, the expert, its row in that expert's buffer (-1: dropped),
# the combine weight and whether the choice was kept. The rule (GShard, Lepikhin+20 §2.2, top-2 gating;
# DeepSpeed's deepspeed/moe/sharded_moe.py top1gating/top2gating): softmax over the experts, the
# top_k by probability (highest first); rows given in token order, every token's first choice before
# any token's second choice; a choice past its expert's `capacity` rows is dropped; top-1 keeps the
# probability as the weight (Switch), top-k > 1 divides the kept choices' probabilities by their sum
# (DeepSpeed's top2gating renormalises after the capacity mask); a dropped choice weighs 0.

# (tokens, experts, top_k, capacity factor: capacity = vramlab.moe.expert_capacity(...); None = dropless,
# capacity = tokens)
DISPATCH_CASES = ((16, 4, 1, 1.0), (24, 4, 2, 1.0), (12, 3, 2, None))
DISPATCH_HIDDEN = ((40, 8, 2, 1.25), (33, 5, 1, 1.0), (30, 6, 3, 1.0), (64, 8, 2, 2.0), (1, 2, 2, 1.0))

# the usual mistakes, each a variant of `dispatch_reference`, with what the check says when an answer
# matches it (the first that matches: order matters where two coincide)
_DISPATCH_MISTAKES: tuple[tuple[dict, str], ...] = (
    ({"probs": "logits"}, "the weights are the raw logits: turn the logits into probabilities over the experts "
                          "(a softmax along the last dimension) first"),
    ({"probs": "tokens"}, "the probabilities were normalised over the tokens (softmax along dimension 0): each token's "
                          "router probabilities sum to 1 over the experts (the last dimension)"),
    ({"order": "token"}, "the rows were numbered in token order over all choices (token 0's first and second choice, "
                         "then token 1's, ...). GShard's priority: every token's first choice takes its row before any "
                         "token's second choice, so a second choice is dropped before a first choice is"),
    ({"order": "rank-reversed"}, "the second choices were placed before the first choices: the first choices (the "
                                 "higher probabilities) take an expert's first rows, in token order, then the second "
                                 "choices"),
    ({"order": "probability"}, "each expert's rows were given by decreasing probability (Megatron's 'probs' drop "
                               "policy); here the rows go by position: token order, first choices before second choices"),
    ({"order": "reversed"}, "the tokens are out of order: the later tokens took the first rows. Rows go to tokens in "
                            "the order they come (row 0 to the first token that chose the expert)"),
    ({"keep": "le"}, "the capacity is off by one: an expert kept capacity + 1 choices. Rows are numbered from 0, so "
                     "row `capacity` is already past the buffer: keep a choice only if its row is below capacity"),
    ({"keep": "lt-1"}, "the capacity is off by one: an expert kept only capacity - 1 choices, leaving its last row "
                       "empty"),
    ({"keep": "all"}, "no choice was dropped: an expert that more than `capacity` choices pick keeps only the first "
                      "`capacity` of them (slot -1, kept False and weight 0 for the rest)"),
    ({"norm": "none"}, "the weights were not renormalised: with top_k > 1 the kept choices share the token's whole "
                       "weight (divide their probabilities by the sum of the kept choices' probabilities)"),
    ({"norm": "chosen"}, "the weights were renormalised over all top_k choices before the drops: renormalise over the "
                         "kept choices only, so that a token whose second choice was dropped gives its first choice the "
                         "whole weight"),
    ({"norm": "always"}, "top-1 weights were renormalised (every kept weight is 1): with top_k = 1 the weight is the "
                         "router's probability itself, as in the Switch Transformer, which keeps the router's gradient"),
)


def dispatch_case(seed: int, tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> dict:
    """One case as the program receives it: sizes, top_k, the capacity (rows per expert) from the factor
    (`vramlab.moe.expert_capacity`; None: dropless, every token fits) and the router's skew."""
    from ..moe import expert_capacity

    return {"seed": seed, "tokens": tokens, "experts": experts, "top_k": top_k,
            "capacity": expert_capacity(tokens, experts, top_k, capacity_factor),
            "skew": 0.5 if capacity_factor is None else 1.0}


def dispatch_logits(case: dict):
    """The case's router logits, as `programs/dispatch.py`'s `build` draws them in the answer's process
    (the programs are copied beside the answer, never imported; tests hold the two equal)."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    bias = torch.randn(case["experts"], generator=g, dtype=torch.float64) * case["skew"]
    return torch.randn(case["tokens"], case["experts"], generator=g, dtype=torch.float64) + bias


def dispatch_reference(logits, top_k: int, capacity: int, *, probs: str = "softmax", order: str = "rank",
                       keep: str = "lt", norm: str = "rule") -> dict:
    """Top-k routing with a capacity, one token and choice at a time: {"expert", "slot", "weight",
    "kept"}, each a (tokens, top_k) tensor. The defaults are the exercise's rule (the comment above);
    the other values are the usual mistakes: probs "logits" (no softmax) or "tokens" (softmax over
    dimension 0); order "token" (rows in token order over all choices), "rank-reversed" (second choices
    first), "probability" (rows by decreasing probability), "reversed" (last token first); keep "le"
    (capacity + 1 kept), "lt-1" (capacity - 1), "all" (no drop); norm "none" (never renormalise),
    "chosen" (over the top_k chosen, before drops), "always" (top-1 too)."""
    import torch

    p = {"softmax": lambda x: x.softmax(-1), "logits": lambda x: x, "tokens": lambda x: x.softmax(0)}[probs](logits)
    top_p, expert = p.topk(top_k, dim=-1)  # (T, k), highest first
    t_n, k = expert.shape
    visits = [(j, t) for j in range(k) for t in range(t_n)]  # GShard: choice rank, then token
    if order == "token":
        visits = [(j, t) for t in range(t_n) for j in range(k)]
    elif order == "rank-reversed":
        visits = [(j, t) for j in reversed(range(k)) for t in range(t_n)]
    elif order == "reversed":
        visits = [(j, t) for j in range(k) for t in reversed(range(t_n))]
    elif order == "probability":
        visits = sorted(visits, key=lambda jt: -float(top_p[jt[1], jt[0]]))
    limit = {"lt": capacity, "le": capacity + 1, "lt-1": capacity - 1, "all": t_n * k}[keep]
    slot = torch.full((t_n, k), -1, dtype=torch.int64)
    filled = [0] * logits.shape[1]  # rows taken in each expert's buffer
    for j, t in visits:
        e = int(expert[t, j])
        if filled[e] < limit:
            slot[t, j] = filled[e]
        filled[e] += 1
    kept = slot >= 0
    if norm == "chosen" or (norm == "always" and k == 1):
        top_p = top_p / top_p.sum(-1, keepdim=True)
    weight = torch.where(kept, top_p, torch.zeros_like(top_p))
    if (k > 1 and norm == "rule") or norm == "always":  # the kept choices share the token's weight
        weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-300)
    return {"expert": expert, "slot": slot, "weight": weight, "kept": kept}


def _dispatch_applies(variant: dict, top_k: int) -> bool:
    """Whether a usual mistake can show at this top_k: with one choice a token there is nothing to put
    first and nothing to renormalise over (its weight is its probability, which only "always" breaks);
    with more, "always" is the rule itself."""
    if top_k == 1:
        return variant.get("order") not in ("token", "rank-reversed") and variant.get("norm") not in ("none", "chosen")
    return variant.get("norm") != "always"


def _dispatch_separates(case: dict, *, whole: bool = False) -> bool:
    """A case with a capacity below the dropless one drops some choice (with `whole`, every choice of
    some token: its weights have nothing to renormalise over), and every usual mistake that applies to
    its top_k gives another answer than the reference (so each is caught, and named)."""
    import torch

    logits, k, c = dispatch_logits(case), case["top_k"], case["capacity"]
    ref = dispatch_reference(logits, k, c)
    if c >= case["tokens"]:
        return True
    if bool(ref["kept"].all()) or (whole and not bool((~ref["kept"]).all(-1).any())):
        return False
    for variant, _ in _DISPATCH_MISTAKES:
        if not _dispatch_applies(variant, k):
            continue
        other = dispatch_reference(logits, k, c, **variant)
        if all(torch.equal(ref[f], other[f]) for f in ("expert", "slot", "kept")) and torch.allclose(
                ref["weight"], other["weight"], rtol=1e-9, atol=1e-12):
            return False
    return True


def dispatch_cases(seed: int, cases=DISPATCH_CASES) -> list[dict]:
    """The cases drawn from `seed`: for each (tokens, experts, top_k, capacity factor), the first seed from
    seed + 1000 i on whose logits every usual mistake shows (`_dispatch_separates`); at top-2 with a
    factor up to 1.25, where it is common, one on which some token loses both its choices."""
    out = []
    for i, spec in enumerate(cases):
        whole = spec[2] == 2 and spec[3] is not None and spec[3] <= 1.25
        for tries in range(200):
            case = dispatch_case(seed + 1000 * i + tries, *spec)
            if _dispatch_separates(case, whole=whole):
                break
        out.append(case)
    return out


def _dispatch_shape_problem(rep: dict, t_n: int, k: int) -> str | None:
    """What is wrong with the returned tensors' types, shapes and dtypes, or None."""
    kinds = {"expert": ("int", "an integer tensor"), "slot": ("int", "an integer tensor"),
             "weight": ("float", "a floating-point tensor"), "kept": ("bool", "a bool tensor")}
    for name, (kind, words) in kinds.items():
        r = rep.get(name)
        if not isinstance(r, dict) or r.get("type") != "Tensor":
            return f"{name} is {(r or {}).get('type', 'missing')}: return {words} of shape ({t_n}, {k})"
        if r.get("shape") != [t_n, k]:
            return (f"{name} has shape {tuple(r.get('shape') or ())}: one row a token, one column a choice, "
                    f"({t_n}, {k})")
        dtype = str(r.get("dtype"))
        if not (dtype.startswith(kind) or (kind == "int" and dtype.startswith("uint"))):
            return f"{name} is {dtype}: return {words}"
        if not isinstance(r.get("values"), list) or len(r["values"]) != t_n * k:
            return f"{name}'s values could not be read back"
    if rep["weight"]["dtype"] != "float64":
        return f"weight is {rep['weight']['dtype']}: keep the logits' dtype (float64)"
    return None


def _dispatch_problem(case: dict, rep: dict) -> str | None:
    """What is wrong with one case's answer (the program's report), or None: the tensors' form, then the
    experts, the consistency of slot, kept and weight, the slots (naming the mistake whose rows they
    match), then the weights (likewise)."""
    import torch

    t_n, k, c = case["tokens"], case["top_k"], case["capacity"]
    why = _dispatch_shape_problem(rep, t_n, k)
    if why:
        return why
    got = {f: torch.tensor(rep[f]["values"]).reshape(t_n, k) for f in ("expert", "slot", "kept")}
    got["weight"] = torch.tensor(rep["weight"]["values"], dtype=torch.float64).reshape(t_n, k)
    logits = dispatch_logits(case)
    ref = dispatch_reference(logits, k, c)
    variants = [(dispatch_reference(logits, k, c, **v), msg) for v, msg in _DISPATCH_MISTAKES if _dispatch_applies(v, k)]

    def named(fields) -> str | None:
        for other, msg in variants:
            if all(torch.equal(got[f], other[f]) if f != "weight" else
                   torch.allclose(got[f], other[f], rtol=1e-9, atol=1e-12) for f in fields):
                if not all(torch.equal(ref[f], other[f]) if f != "weight" else
                           torch.allclose(ref[f], other[f], rtol=1e-9, atol=1e-12) for f in fields):
                    return msg
        return None

    if not torch.equal(got["expert"], ref["expert"]):
        if torch.equal(got["expert"].sort(-1).values, ref["expert"].sort(-1).values):
            return ("each token chose the right experts, in the wrong order: column 0 is its most probable expert, "
                    "column 1 the next, ...")
        bad = int((got["expert"] != ref["expert"]).any(-1).nonzero()[0, 0])
        return (named(("expert",)) or
                f"token {bad} chose experts {got['expert'][bad].tolist()}; its {k} most probable are "
                f"{ref['expert'][bad].tolist()}, highest first")
    if not torch.equal(got["kept"], got["slot"] >= 0):
        return "kept must be True exactly where slot >= 0 (slot is -1 for a dropped choice)"
    if bool(got["weight"].isnan().any()):
        t = int(got["weight"].isnan().any(-1).nonzero()[0, 0])
        return (f"token {t}'s weights are NaN" + (" (all its choices were dropped: it has nothing to renormalise over, "
                                                 "and its weights are 0)" if not bool(got["kept"][t].any()) else ""))
    if bool((got["weight"][~got["kept"]] != 0).any()):
        return "a dropped choice has a non-zero weight: it is not computed by its expert, so it weighs 0"
    if not torch.equal(got["slot"], ref["slot"]):
        msg = named(("slot",))
        if msg:
            return msg
        bad = (got["slot"] != ref["slot"]).nonzero()[0].tolist()
        t, j = bad
        return (f"token {t}'s choice {j} (expert {int(ref['expert'][t, j])}) got slot {int(got['slot'][t, j])}, "
                f"expected {int(ref['slot'][t, j])}: rows go in token order, every first choice before any second "
                f"choice, and a choice past its expert's {c} rows is dropped (slot -1)")
    if not torch.allclose(got["weight"], ref["weight"], rtol=1e-9, atol=1e-12):
        msg = named(("weight",))
        if msg:
            return msg
        err = float((got["weight"] - ref["weight"]).abs().max())
        return (f"the weights differ from the reference by up to {err:.3g}: "
                + ("top-1 keeps the router's probability" if k == 1 else
                   "the kept choices' probabilities, divided by their sum") + "; 0 where dropped")
    return None


def check_dispatch(fn: Callable, *, cases=DISPATCH_CASES, timeout: float = 60.0) -> list[dict]:
    """`fn(router_logits, top_k, capacity)` routes tokens to experts with a capacity (the rule in the
    comment above this section) and returns Routing(expert, slot, weight, kept), four (tokens, top_k)
    tensors. Run in a process of its own (`programs/dispatch.py`) on router logits drawn afresh from a
    seed drawn here (float64, continuous: no ties), for each (tokens, experts, top_k, capacity factor)
    of `cases`, each draw one on which every usual mistake shows; compared with `dispatch_reference`,
    computed here. A wrong answer's message names the mistake it matches (`_DISPATCH_MISTAKES`).
    Returns, a case, its sizes, capacity and the choices dropped."""
    import torch

    from .run import run_program

    seed = int(torch.randint(0, 2**31 - 2, (1,), generator=fresh_generator()))
    specs = dispatch_cases(seed, cases)
    reports = run_program("dispatch", fn, specs, what="dispatch run", timeout=timeout,
                          on_timeout=f"the dispatch run gave no answer within {timeout:.0f} s (a loop that never ends?)")
    results = []
    for case, rep in zip(specs, reports):
        what = (f"{case['tokens']} tokens, {case['experts']} experts, top_k={case['top_k']}, "
                f"capacity {case['capacity']}")
        if not isinstance(rep, dict):
            raise AssertionError(f"{what}: the run's report is not one the harness writes (did the answer change it?)")
        if rep.get("error"):
            if str(rep["error"]).startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{what}: {rep['error']}")
            raise AssertionError(f"{what}: {str(rep['error'])[:300]}")
        why = _dispatch_problem(case, rep)
        if why:
            raise AssertionError(f"{what}: {why}.")
        dropped = int((torch.tensor(rep["kept"]["values"]) == 0).sum())
        results.append({k: case[k] for k in ("tokens", "experts", "top_k", "capacity")} | {"dropped": dropped})
    return results
