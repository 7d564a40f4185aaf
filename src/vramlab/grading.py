"""Checks called by the labs' test cells. A failing check raises AssertionError with a message
that says what is wrong and why, so that the autograder's feedback teaches."""

from __future__ import annotations

from typing import Any, Callable

from .units import fmt_bytes


def check_int(actual: Any, expected: int, *, what: str, hint: str = "", unit: str = "") -> None:
    """`actual` must be an int equal to `expected`."""
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise AssertionError(f"{what}: return an int (a count of {unit or 'items'}), got {type(actual).__name__} {actual!r}")
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


_RING_HARNESS = r'''
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

{source}


def _rank(rank, world, numel, port, q):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.arange(numel, dtype=torch.float64) * (rank + 1) + rank
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone()
        ret = {name}(got, rank, world)
        if ret is not None and isinstance(ret, torch.Tensor):
            got = ret
        if got.shape != expected.shape or not torch.allclose(got, expected):
            bad = (got != expected).nonzero().flatten().tolist()[:5] if got.shape == expected.shape else "shape"
            q.put(f"rank {{rank}} of {{world}}, {{numel}} elements: wrong result at positions {{bad}}: "
                  f"got {{got[:6].tolist()}}..., expected {{expected[:6].tolist()}}...")
    except Exception as e:
        q.put(f"rank {{rank}} of {{world}}, {{numel}} elements raised {{type(e).__name__}}: {{e}}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, numel, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, numel, port, q), nprocs=world, join=True)
    errors = []
    while not q.empty():
        errors.append(q.get())
    print("\n".join(errors) if errors else "OK")
    sys.exit(1 if errors else 0)
'''


def check_ring_all_reduce(fn: Callable, *, cases=((2, 8), (3, 10)), timeout: float = 60.0, port: int | None = None) -> None:
    """Run the student's `fn(tensor, rank, world_size)` on real gloo process groups (spawned
    processes on this machine) and compare with `dist.all_reduce`. `cases` are (ranks, elements);
    element counts that the rank count does not divide are the usual bug."""
    import inspect
    import subprocess
    import sys
    import tempfile
    import textwrap

    from .commbench import free_port

    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise AssertionError("cannot read the function's source: define it in a notebook cell or a file") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ring_check.py"
        with open(path, "w") as f:
            f.write(_RING_HARNESS.format(source=source, name=fn.__name__))
        for i, (world, numel) in enumerate(cases):
            # a free port each time (port=None, the default), and the ranks in a process group of their
            # own that is killed on a deadlock: nothing is left holding a port for the next grading
            proc = subprocess.Popen([sys.executable, path, str(world), str(numel), str(port + i if port else free_port())],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
                r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise AssertionError(
                    f"{world} ranks, {numel} elements: no answer within {timeout:.0f} s — a deadlock? A blocking "
                    "send waits for its matching recv: post the receive with dist.irecv (or alternate the order "
                    "by rank parity) before waiting on the send.") from None
            if r.returncode != 0:
                err_lines = r.stderr.strip().splitlines()
                detail = r.stdout.strip() or (err_lines[-1] if err_lines else "failed")
                hint = (" Hint: when the rank count does not divide the length, split with torch.tensor_split"
                        " (chunks of unequal size) and send each chunk's own size." if numel % world else
                        " Hint: n-1 reduce-scatter steps (send chunk (rank - step), add what arrives), then n-1"
                        " all-gather steps (forward the completed chunk), each to rank + 1, from rank - 1.")
                raise AssertionError(f"ring all-reduce on {world} ranks, {numel} elements: {detail}.{hint}")
