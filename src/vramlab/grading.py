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


def _rank(rank, world, numel, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = {{"rank": rank}}
    try:
        got = torch.arange(numel, dtype=torch.float64) * (rank + 1) + rank
        ret = {name}(got, rank, world)
        if ret is not None and isinstance(ret, torch.Tensor):
            got = ret
        report["result"] = got.detach().flatten().tolist()
    except Exception as e:
        report["error"] = f"{{type(e).__name__}}: {{e}}"
    report["sent"] = _LOG
    with open(f"{{out}}.{{rank}}", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, numel, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(_rank, args=(world, numel, port, out), nprocs=world, join=True)
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
    sent = report.get("sent")
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


def check_ring_all_reduce(fn: Callable, *, cases=((2, 8), (3, 10)), timeout: float = 60.0, port: int | None = None) -> None:
    """Run the student's `fn(tensor, rank, world_size)` on real gloo process groups (spawned
    processes on this machine), with the ready-made collectives unavailable, and check each rank's
    result against the sum computed here and its traffic against a ring's. `cases` are (ranks,
    elements); element counts that the rank count does not divide are the usual bug."""
    import inspect
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import textwrap

    from .commbench import free_port

    source = getattr(fn, "__vramlab_source__", None)  # the grader hands over the answer cell's source
    if not isinstance(source, str):
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            raise AssertionError("cannot read the function's source: define it in a notebook cell or a file") from None
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise AssertionError("pass the ring all-reduce function itself")
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ring_check.py"
        with open(path, "w") as f:
            f.write(_RING_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES))
        for i, (world, numel) in enumerate(cases):
            out = f"{tmp}/case{i}"
            # a free port each time (port=None, the default), and the ranks in a process group of their
            # own that is killed on a deadlock: nothing is left holding a port for the next grading
            proc = subprocess.Popen([*SANDBOX_PREFIX, sys.executable, "-I", path, str(world), str(numel),
                                     str(port + i if port else free_port()), out],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                    cwd=tmp)
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise AssertionError(
                    f"{world} ranks, {numel} elements: no answer within {timeout:.0f} s — a deadlock? A blocking "
                    "send waits for its matching recv: post the receive with dist.irecv (or alternate the order "
                    "by rank parity) before waiting on the send.") from None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError, OSError):
                    pass
            problems = []
            for rank in range(world):
                try:
                    with open(f"{out}.{rank}") as f:
                        report = json.loads(f.read(16 << 20))
                except (OSError, ValueError):
                    lines = (err or "").strip().splitlines()
                    report = None if not lines else {"error": lines[-1][:300]}
                why = _ring_problem(report, rank, world, numel)
                if why:
                    problems.append(f"rank {rank}: {why}")
            if problems:
                hint = (" Hint: when the rank count does not divide the length, split with torch.tensor_split"
                        " (chunks of unequal size) and send each chunk's own size." if numel % world else
                        " Hint: n-1 reduce-scatter steps (send chunk (rank - step), add what arrives), then n-1"
                        " all-gather steps (forward the completed chunk), each to rank + 1, from rank - 1.")
                raise AssertionError(f"ring all-reduce on {world} ranks, {numel} elements: {problems[0]}.{hint}")
