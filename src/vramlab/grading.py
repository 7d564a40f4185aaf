"""Checks called by the labs' test cells. A failing check raises AssertionError with a message
that says what is wrong and why, so that the autograder's feedback teaches."""

from __future__ import annotations

from typing import Any, Callable

from .units import fmt_bytes


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


# What runs the student's ring: its own processes (spawned from this script), where the answer's
# packages cannot be imported and the ready-made collectives raise. Each rank logs what it sends
# through dist.send/isend and writes its result and that log to a file; the process that called
# check_ring_all_reduce (the grader, or the student's kernel when they check themselves) computes the
# expected sum itself and checks the result and the traffic: 2(n-1) messages to one neighbour, each
# the partial sum a ring would hold at that step.
# the packages whose functions answer the exercises: graded answers cannot import them (the ranks
# below, and labs/sandbox.py's answer process)
ANSWER_PACKAGES: tuple[str, ...] = ("vramlab", "transformers", "peft", "deepspeed", "accelerate")

_RING_HARNESS = r"""
import json, os, sys
for _m in {blocked!r}:
    sys.modules[_m] = None
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_LOG = []


def _logged(fn):
    def send(tensor, dst=None, *args, **kwargs):
        _LOG.append([int(dst) if dst is not None else -1, tensor.detach().flatten().tolist()])
        return fn(tensor, dst, *args, **kwargs)
    return send


def _missing(name):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{{name}} is not available here: build the all-reduce from dist.send/isend and dist.recv/irecv")
    return collective


dist.send, dist.isend = _logged(dist.send), _logged(dist.isend)
for _name in ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object",
              "broadcast_object_list", "gather_object", "scatter_object_list", "all_reduce_coalesced"):
    setattr(dist, _name, _missing(_name))

{source}


def _case(numel, rank, world):
    got = torch.arange(numel, dtype=torch.float64) * (rank + 1) + rank
    ret = {name}(got, rank, world)
    if ret is not None and isinstance(ret, torch.Tensor):
        got = ret
    return got.detach().flatten().tolist()
"""

# What every harness ends with (appended unformatted): each rank runs the harness's _case(case, rank,
# world) on a gloo group and writes its result, or the error it raised, and the traffic _LOG holds.
# Arguments: ranks, the case as JSON, port, output prefix.
_HARNESS_RANKS = r"""

def _rank(rank, world, case, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = {"rank": rank}
    try:
        report["result"] = _case(case, rank, world)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["log"] = _LOG
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, case, port, out = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(_rank, args=(world, case, port, out), nprocs=world, join=True)
"""

# set by the grader (labs/sandbox.py): the command prefix that runs the ranks inside its sandbox
SANDBOX_PREFIX: list[str] = []


def _ring_problem(report: Any, rank: int, world: int, numel: int) -> str | None:
    """What is wrong with one rank's result and traffic, or None. Expected values computed here:
    x_r[i] = i (r + 1) + r, so the sum over ranks is i W(W+1)/2 + W(W-1)/2, and a partial sum over a
    set S of ranks is i sum(r+1) + sum(r) on some contiguous stretch of indices."""
    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    got = report.get("result")
    expected = [i * world * (world + 1) // 2 + world * (world - 1) // 2 for i in range(numel)]
    if not isinstance(got, list) or len(got) != numel:
        return f"returned {len(got) if isinstance(got, list) else 'no'} elements, expected {numel}"
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if bad:
        return (f"wrong result at positions {bad[:5]}: got {got[:6]}..., expected {expected[:6]}...")
    sent = report.get("log")
    steps = 2 * (world - 1)
    if not isinstance(sent, list) or len(sent) != steps:
        return (f"sent {len(sent) if isinstance(sent, list) else 0} messages with dist.send/isend; a ring sends "
                f"2(n-1) = {steps}, one chunk per step")
    peers = {m[0] for m in sent if isinstance(m, list) and len(m) == 2}
    if len(peers) != 1 or next(iter(peers)) not in ((rank + 1) % world, (rank - 1) % world):
        return f"sent to ranks {sorted(peers, key=str)}: a ring sends every message to one neighbour"
    direction = 1 if next(iter(peers)) == (rank + 1) % world else -1
    biggest = -(-numel // world)
    for step, (_, values) in enumerate(sent):
        if not isinstance(values, list) or len(values) > biggest:
            return f"message {step + 1} holds {len(values) if isinstance(values, list) else '?'} elements: a ring sends chunks of at most ceil(N/n) = {biggest}"
        ranks = {(rank - direction * j) % world for j in range(min(step, world - 1) + 1)} if step < world - 1 else set(range(world))
        a, b = sum(r + 1 for r in ranks), sum(ranks)
        if values and not (all(isinstance(v, (int, float)) for v in values) and (values[0] - b) % a == 0
                           and 0 <= (values[0] - b) // a <= numel - len(values)
                           and all(v == ((values[0] - b) // a + i) * a + b for i, v in enumerate(values))):
            phase = "reduce-scatter" if step < world - 1 else "all-gather"
            return (f"message {step + 1} ({phase}) is not the partial sum of ranks {sorted(ranks)} that a ring "
                    "holds at that step")
    return None


def _answer_source(fn: Callable) -> tuple[str, str]:
    """The answer's source (the grader hands over the cell's) and its function name."""
    import inspect
    import textwrap

    source = getattr(fn, "__vramlab_source__", None)
    if not isinstance(source, str):
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            raise AssertionError("cannot read the function's source: define it in a notebook cell or a file") from None
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise AssertionError("pass the function itself")
    return source, name


def _run_ranks(script: str, argv: list[str], *, cwd: str, timeout: float, on_timeout: str) -> str:
    """Run a harness script (which spawns its ranks) in the sandbox, in a process group of its own that
    is killed afterwards whatever happened: nothing is left holding a port for the next check.
    Returns its stderr."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([*SANDBOX_PREFIX, sys.executable, "-I", script, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=cwd)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(on_timeout) from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    return err or ""


def _rank_report(path: str, err: str) -> Any:
    import json

    try:
        with open(path) as f:
            return json.loads(f.read(16 << 20))
    except (OSError, ValueError):
        lines = err.strip().splitlines()
        return None if not lines else {"error": lines[-1][:300]}


def check_ring_all_reduce(fn: Callable, *, cases=((2, 8), (3, 10)), timeout: float = 60.0, port: int | None = None) -> None:
    """Run the student's `fn(tensor, rank, world_size)` on real gloo process groups (spawned
    processes on this machine), with the ready-made collectives unavailable, and check each rank's
    result against the sum computed here and its traffic against a ring's. `cases` are (ranks,
    elements); element counts that the rank count does not divide are the usual bug."""
    import tempfile

    from .commbench import free_port

    source, name = _answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ring_check.py"
        with open(path, "w") as f:
            f.write(_RING_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES) + _HARNESS_RANKS)
        for i, (world, numel) in enumerate(cases):
            out = f"{tmp}/case{i}"
            err = _run_ranks(path, [str(world), str(numel), str(port + i if port else free_port()), out], cwd=tmp,
                             timeout=timeout, on_timeout=(
                                 f"{world} ranks, {numel} elements: no answer within {timeout:.0f} s — a deadlock? A "
                                 "blocking send waits for its matching recv: post the receive with dist.irecv (or "
                                 "alternate the order by rank parity) before waiting on the send."))
            problems = []
            for rank in range(world):
                why = _ring_problem(_rank_report(f"{out}.{rank}", err), rank, world, numel)
                if why:
                    problems.append(f"rank {rank}: {why}")
            if problems:
                hint = (" Hint: when the rank count does not divide the length, split with torch.tensor_split"
                        " (chunks of unequal size) and send each chunk's own size." if numel % world else
                        " Hint: n-1 reduce-scatter steps (send chunk (rank - step), add what arrives), then n-1"
                        " all-gather steps (forward the completed chunk), each to rank + 1, from rank - 1.")
                raise AssertionError(f"ring all-reduce on {world} ranks, {numel} elements: {problems[0]}.{hint}")


# The tensor-parallel MLP: each rank gets the whole input and the whole weights (seeded here and in
# the harness alike), must use its column slice of w1 and row slice of w2 (torch.tensor_split, the
# rank's piece), and may call dist.all_reduce once; everything else collective raises. The rank logs
# what it all-reduces; the caller recomputes every rank's partial product and the full layer itself.
_TP_HARNESS = r"""
import json, os, sys
for _m in {blocked!r}:
    sys.modules[_m] = None
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_LOG = []
_real_all_reduce = dist.all_reduce


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _LOG.append([list(tensor.shape), tensor.detach().flatten().tolist(), str(op)])
    return _real_all_reduce(tensor, op=op, group=group, async_op=async_op)


def _missing(name):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{{name}} is not available here: the column- then row-parallel MLP needs one all-reduce")
    return collective


dist.all_reduce = _all_reduce
for _name in ("reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
              "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list",
              "gather_object", "scatter_object_list", "all_reduce_coalesced", "send", "recv", "isend", "irecv",
              "batch_isend_irecv"):
    setattr(dist, _name, _missing(_name))

{source}


def _inputs(b, h, f):
    g = torch.Generator().manual_seed(1234 + b + h + f)
    return (torch.randn(b, h, generator=g, dtype=torch.float64), torch.randn(h, f, generator=g, dtype=torch.float64),
            torch.randn(f, h, generator=g, dtype=torch.float64))


def _case(case, rank, world):
    x, w1, w2 = _inputs(*case)
    y = {name}(x, w1, w2, rank, world)
    return y.detach().tolist() if isinstance(y, torch.Tensor) else repr(y)[:200]
"""


def _tp_expected(b: int, h: int, f: int, world: int):
    """The inputs the harness draws, the unsplit layer and each rank's partial product (float64)."""
    import torch

    g = torch.Generator().manual_seed(1234 + b + h + f)
    x = torch.randn(b, h, generator=g, dtype=torch.float64)
    w1 = torch.randn(h, f, generator=g, dtype=torch.float64)
    w2 = torch.randn(f, h, generator=g, dtype=torch.float64)
    full = torch.nn.functional.gelu(x @ w1) @ w2
    cols, rows = torch.tensor_split(w1, world, dim=1), torch.tensor_split(w2, world, dim=0)
    partial = [torch.nn.functional.gelu(x @ c) @ r for c, r in zip(cols, rows)]
    return full, partial


def _tp_problem(report: Any, rank: int, full, partial) -> str | None:
    import torch

    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    sent = report.get("log")
    if not isinstance(sent, list) or len(sent) != 1:
        n = len(sent) if isinstance(sent, list) else 0
        return (f"called dist.all_reduce {n} times; the column- then row-parallel MLP needs exactly one, on the "
                "row-parallel layer's partial output")
    shape, values, op = sent[0]
    mine = partial[rank]
    if shape != list(mine.shape) or "SUM" not in str(op).upper():
        return f"all-reduced a {shape} tensor ({op}); expected the {list(mine.shape)} partial output, summed"
    got = torch.tensor(values, dtype=torch.float64).reshape(mine.shape)
    if not torch.allclose(got, mine, rtol=1e-9, atol=1e-9):
        return ("all-reduced something other than this rank's partial product gelu(x @ w1[:, my columns]) @ "
                "w2[my rows, :] (columns and rows from torch.tensor_split of the hidden dimension, this rank's piece)")
    result = report.get("result")
    try:
        y = torch.tensor(result, dtype=torch.float64)
    except (TypeError, ValueError):
        return f"returned {str(result)[:100]}, not a tensor"
    if y.shape != full.shape or not torch.allclose(y, full, rtol=1e-9, atol=1e-9):
        return "returned a tensor that differs from the unsplit layer gelu(x @ w1) @ w2"
    return None


def check_tp_mlp(fn: Callable, *, cases=((2, 3, 8, 16),), timeout: float = 60.0) -> None:
    """Run the student's `fn(x, w1, w2, rank, world_size)` on real gloo process groups and check, on
    every rank, the result against the unsplit layer gelu(x @ w1) @ w2 and the one all-reduce against
    that rank's partial product (computed here). `cases` are (ranks, batch, hidden, MLP width)."""
    import json
    import tempfile

    from .commbench import free_port

    source, name = _answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tp_check.py"
        with open(path, "w") as fh:
            fh.write(_TP_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES) + _HARNESS_RANKS)
        for i, (world, b, h, f) in enumerate(cases):
            out = f"{tmp}/case{i}"
            err = _run_ranks(path, [str(world), json.dumps([b, h, f]), str(free_port()), out], cwd=tmp,
                             timeout=timeout, on_timeout=f"{world} ranks: no answer within {timeout:.0f} s (a rank "
                             "waits for a collective another never calls?)")
            full, partial = _tp_expected(b, h, f, world)
            for rank in range(world):
                why = _tp_problem(_rank_report(f"{out}.{rank}", err), rank, full, partial)
                if why:
                    raise AssertionError(f"tensor-parallel MLP on {world} ranks (hidden {h}, width {f}): rank {rank} "
                                         f"{why}.")


# ZeRO-1: every rank holds the whole flat parameter vector and computes its own gradients (drawn here
# and in the grader alike, different on every rank and step); the student's step must average the
# gradients, update only this rank's shard with AdamW (its states the shard's size), and all-gather
# the updated shards into the parameters. Point-to-point and object collectives raise; the rank logs
# every collective it calls. The caller runs torch.optim.AdamW on one process with the averaged
# gradients and compares every rank's parameters after each step.
_ZERO1_HARNESS = r"""
import json, os, sys
for _m in {blocked!r}:
    sys.modules[_m] = None
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_LOG = []


def _logged(name, fn):
    def collective(*args, **kwargs):
        _LOG.append(name)
        return fn(*args, **kwargs)
    return collective


def _missing(name):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{{name}} is not available here: use reduce_scatter_tensor (or all_reduce) for the "
                           "gradients and all_gather_into_tensor for the parameters")
    return collective


for _name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter", "all_gather"):
    setattr(dist, _name, _logged(_name, getattr(dist, _name)))
for _name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "all_gather_object",
              "broadcast_object_list", "gather_object", "scatter_object_list", "gather", "scatter", "all_to_all",
              "all_to_all_single", "reduce"):
    setattr(dist, _name, _missing(_name))

{source}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _case(case, rank, world):
    numel, steps = case
    params = torch.randn(numel, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    state, history = {{}}, []
    for k in range(steps):
        grads = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + k), dtype=torch.float64)
        {name}(params, grads, state, rank, world)
        history.append(params.tolist())
    return {{"history": history, "state_numel": sum(t.numel() for t in _tensors(state))}}
"""

ZERO1_HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _zero1_expected(numel: int, steps: int, world: int) -> list:
    """torch.optim.AdamW on one process, fed the ranks' averaged gradients: the parameters after each step."""
    import torch

    params = torch.randn(numel, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    p = torch.nn.Parameter(params.clone())
    opt = torch.optim.AdamW([p], **ZERO1_HYPER, foreach=False)
    out = []
    for k in range(steps):
        grads = [torch.randn(numel, generator=torch.Generator().manual_seed(1000 * r + k), dtype=torch.float64)
                 for r in range(world)]
        p.grad = torch.stack(grads).mean(0)
        opt.step()
        out.append(p.detach().clone())
    return out


def _zero1_problem(report: Any, numel: int, world: int, expected: list) -> str | None:
    import torch

    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    result = report.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("history"), list):
        return "returned nothing usable"
    calls = report.get("log") or []
    if "all_gather_into_tensor" not in calls and "all_gather" not in calls:
        return "never all-gathered: each rank must update only its shard and gather the others' updated shards"
    shard = -(-numel // world)
    if result.get("state_numel", 0) > 2 * shard + 16:
        return (f"keeps {result['state_numel']} optimizer-state values; ZeRO-1 keeps only its shard's m and v "
                f"(2 x {shard})")
    for k, (got, want) in enumerate(zip(result["history"], expected)):
        got = torch.tensor(got, dtype=torch.float64)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            return (f"after step {k + 1} the parameters differ from one process's AdamW on the averaged gradients "
                    f"(lr={ZERO1_HYPER['lr']}, betas={ZERO1_HYPER['betas']}, eps={ZERO1_HYPER['eps']}, "
                    f"weight_decay={ZERO1_HYPER['weight_decay']}; bias-corrected, decoupled weight decay)")
    if len(result["history"]) != len(expected):
        return "did not run every step"
    return None


def check_zero1(fn: Callable, *, cases=((2, 64, 3),), timeout: float = 60.0) -> None:
    """Run the student's `fn(params, grads, state, rank, world_size)` (one ZeRO-1 step, in place on
    `params`) for several steps on real gloo process groups and check every rank's parameters after each
    step against torch.optim.AdamW on one process with the averaged gradients, and that the optimizer
    state it keeps is its shard's. `cases` are (ranks, elements, steps)."""
    import json
    import tempfile

    from .commbench import free_port

    source, name = _answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/zero1_check.py"
        with open(path, "w") as fh:
            fh.write(_ZERO1_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES) + _HARNESS_RANKS)
        for i, (world, numel, steps) in enumerate(cases):
            out = f"{tmp}/case{i}"
            err = _run_ranks(path, [str(world), json.dumps([numel, steps]), str(free_port()), out], cwd=tmp,
                             timeout=timeout, on_timeout=f"{world} ranks: no answer within {timeout:.0f} s (a rank "
                             "waits for a collective another never calls?)")
            expected = _zero1_expected(numel, steps, world)
            for rank in range(world):
                why = _zero1_problem(_rank_report(f"{out}.{rank}", err), numel, world, expected)
                if why:
                    raise AssertionError(f"ZeRO-1 step on {world} ranks, {numel} parameters: rank {rank} {why}.")


# ----------------------------------------------------------------------------- lab 7
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


# ----------------------------------------------------------------------------- lab 6
def stream_cases(seed: int, n: int = 8) -> list[tuple[list[int], list[float], float, int]]:
    """Random stacks of uneven layers (bytes, compute seconds), a link and a buffer count, where the
    copies are sometimes hidden and sometimes not: (layer_bytes, layer_seconds, link_GBps, buffers)."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        layers = rng.randint(2, 8)
        sizes = [rng.choice((1, 2, 3, 4, 6, 8)) * 10**8 for _ in range(layers)]
        secs = [round(rng.uniform(0.5, 8.0), 3) * 1e-3 for _ in range(layers)]
        cases.append((sizes, secs, rng.choice((12.0, 25.0, 50.0)), rng.choice((1, 2, 3))))
    return cases


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-12) + 1e-15


def check_stream_pass(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(layer_bytes, layer_seconds, streamed, link_GBps, buffers)` must return (seconds of the
    third pass, device bytes) as `vramlab.offload.stream_layers` computes them, for every case of
    `stream_cases` and several choices of streamed layers (uneven layers, one to three buffers)."""
    import random

    from .offload import stream_layers

    rng = random.Random(seed + 1)
    for sizes, secs, link, buffers in stream_cases(seed, n):
        choices = [(), tuple(range(len(sizes)))] + [tuple(sorted(rng.sample(range(len(sizes)), rng.randint(1, len(sizes)))))
                                                     for _ in range(2)]
        for streamed in choices:
            want = stream_layers(sizes, secs, streamed=streamed, link_GBps=link, buffers=buffers, passes=3)
            where = f"layer_bytes={sizes}, layer_seconds={secs}, streamed={list(streamed)}, link {link} GB/s, {buffers} buffers"
            got = fn(list(sizes), list(secs), list(streamed), link, buffers)
            try:
                seconds, nbytes = got
                seconds = float(seconds)
            except (TypeError, ValueError):
                raise AssertionError(f"return (seconds, device_bytes), got {got!r}") from None
            if not _close(seconds, want.seconds):
                hint = (" (that is the first pass: the copies of the next pass may start while this one still runs)"
                        if _close(seconds, stream_layers(sizes, secs, streamed=streamed, link_GBps=link, buffers=buffers,
                                                         passes=1).seconds) else "")
                raise AssertionError(f"the third pass takes {want.seconds * 1e3:.4f} ms, you said {seconds * 1e3:.4f} ms "
                                     f"({where}){hint}")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes != want.gpu_bytes:
                raise AssertionError(f"device memory is {want.gpu_bytes:,} bytes, you said {nbytes!r} ({where}): the "
                                     "resident layers plus min(buffers, streamed) buffers as large as the largest "
                                     "streamed layer")


def check_fewest_resident(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(layer_bytes, layer_seconds, link_GBps, buffers)` must return the fewest resident layers
    whose streamed layers' copies hide behind compute (`vramlab.offload.smallest_resident`, which
    tries every choice of streamed layers)."""
    from .offload import smallest_resident

    for sizes, secs, link, buffers in stream_cases(seed, n):
        want = len(sizes) - len(smallest_resident(sizes, secs, link_GBps=link, buffers=buffers).streamed)
        got = fn(list(sizes), list(secs), link, buffers)
        where = f"layer_bytes={sizes}, layer_seconds={secs}, link {link} GB/s, {buffers} buffers"
        if isinstance(got, bool) or not isinstance(got, int):
            raise AssertionError(f"return a count of layers (an int), got {got!r}")
        if got != want:
            raise AssertionError(f"{want} resident layers hide the copies, you said {got} ({where})"
                                 + (": try every choice of streamed layers, not only evenly spaced ones"
                                    if got > want else ": with that few, some copy makes a layer wait"))


# ----------------------------------------------------------------------------- lab 8: compression
def _int8_cases(seed: int, n: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(n):
        rows, cols = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        w = torch.randn(rows, cols, generator=g) * float(torch.rand(1, generator=g)) * 0.1
        if rows > 2:
            w[int(torch.randint(0, rows, (1,), generator=g))] *= 50  # an outlier row
            w[int(torch.randint(0, rows, (1,), generator=g))] = 0  # an all-zero row
        cases.append(w)
    return cases


def check_row_int8(quantize_rows: Callable, dequantize_rows: Callable, row_int8_bytes: Callable, *, seed: int = 0,
                   n: int = 8) -> None:
    """Per-row absmax INT8 on plain lists: integer codes in [-127, 127] with 127 reached in every
    non-zero row, one scale a row, every weight back within half a step of its row's scale, and
    the storage (int8 codes and fp32 scales) exact to the byte."""
    for w in _int8_cases(seed, n):
        rows, cols = w.shape
        wl = w.tolist()
        out = quantize_rows(wl)
        assert isinstance(out, (list, tuple)) and len(out) == 2, "quantize_rows must return (q, scales)"
        q, s = out
        assert isinstance(q, (list, tuple)) and len(q) == rows and all(len(r) == cols for r in q), \
            f"q must have the shape of w ({rows} rows of {cols})"
        assert all(isinstance(v, int) and not isinstance(v, bool) for r in q for v in r), "q must hold Python ints"
        assert isinstance(s, (list, tuple)) and len(s) == rows, f"scales: one a row ({rows}), got {len(s) if isinstance(s, (list, tuple)) else s!r}"
        assert max(abs(v) for r in q for v in r) <= 127, "codes must lie in [-127, 127] (symmetric: -128 is never used)"
        for r, row in zip(q, wl):
            if any(row):
                assert max(abs(v) for v in r) == 127, "each non-zero row's largest weight must map to +-127 (absmax)"
        back = dequantize_rows(q, s)
        assert isinstance(back, (list, tuple)) and len(back) == rows, "dequantize_rows must return rows like w"
        for i, (row, b) in enumerate(zip(wl, back)):
            worst = max(abs(x - y) for x, y in zip(row, b)) - abs(s[i]) / 2
            assert worst <= 1e-6 * max(abs(x) for x in row) + 1e-12, \
                f"row {i} of a {rows} x {cols} matrix comes back {worst:.3g} further than half its step: round, do not truncate"
        check_int(row_int8_bytes(rows, cols), rows * cols + 4 * rows, what=f"bytes of a {rows} x {cols} matrix in per-row INT8",
                  hint="one byte a weight and one fp32 scale a row", unit="bytes")


def _llama_meta(cfg: dict):
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return LlamaForCausalLM(LlamaConfig(vocab_size=1000, **cfg))


def check_lora_count(fn: Callable, cases) -> None:
    """`fn(config, r, targets)` against peft's trainable-parameter count for a Llama model built from
    `config` on the meta device, LoRA of rank r on `targets`."""
    import warnings

    from peft import LoraConfig, get_peft_model

    for cfg, r, targets in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(_llama_meta(cfg), LoraConfig(r=r, target_modules=list(targets)))
        expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
        check_int(fn(dict(cfg), r, list(targets)), expected, what=f"LoRA r={r} on {', '.join(targets)} of {cfg}",
                  hint="each adapted matrix adds A (r x d_in) and B (d_out x r); k and v are num_key_value_heads x head_dim wide")
