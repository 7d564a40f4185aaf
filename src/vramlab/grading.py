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


# What runs the student's ring: one process a rank (this script), where the answer's packages cannot
# be imported and the ready-made collectives raise. dist.send/isend/recv/irecv go through the link to
# the process that called check_ring_all_reduce (the grader, or the student's kernel when they check
# themselves: _Switchboard), which delivers them and logs what each rank sent; it computes the
# expected sum itself and checks the result and the traffic: 2(n-1) messages to one neighbour, each
# the partial sum a ring would hold at that step.
# the packages whose functions answer the exercises: graded answers cannot import them (the ranks
# below, and labs/sandbox.py's answer process)
ANSWER_PACKAGES: tuple[str, ...] = ("vramlab", "transformers", "peft", "deepspeed", "accelerate", "bitsandbytes")

_RING_HARNESS = r"""
import json, os, sys
for _m in {blocked!r}:
    sys.modules[_m] = None
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# what the answer may call (the link below implements them); every other collective raises
_ALLOWED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_HINT = "build the all-reduce from dist.send/isend and dist.recv/irecv"

_SOURCE = {source!r}


def _case(numel, rank, world):
    got = torch.tensor(_SECRET, dtype=torch.float64)  # this rank's own numbers, dealt by the grader
    ret = {name}(got, rank, world)
    if ret is not None and isinstance(ret, torch.Tensor):
        got = ret
    return got.detach().flatten().tolist()
"""

# What every rank harness ends with (appended unformatted): torch.distributed's collectives replaced
# by the link to the check's process (those the harness's _ALLOWED names; every other raises, with
# _HINT), then the rank runs the harness's _case(case, rank, world) and sends its result, or the
# error it raised, over the link. Arguments: rank, ranks, the case as JSON, the link's descriptor.
_HARNESS_RANKS = r"""

# --- the link: this rank's only way to the others (labs 2-4) ---
# Every collective and message goes through the check's own process over one socket: that process
# delivers it, computes the collectives' results and keeps the log of who sent what. Nothing here is
# trusted: the answer runs in this process and could rewrite any of it; it cannot rewrite the log.
import socket as _socket
import struct as _struct

_SECRET = None
_LINK = {}


def _private():
    # this process's memory cannot be read through /proc/<pid>/mem or ptrace by the other ranks
    # (same uid): what a rank was dealt stays its own
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _link_post(msg):
    data = json.dumps(msg).encode()
    _LINK["sock"].sendall(_struct.pack(">Q", len(data)) + data)


def _link_read():
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = _LINK["sock"].recv(n - len(buf))
            if not chunk:
                raise RuntimeError("the check's process closed the link (it stopped this run)")
            buf += chunk
        return buf

    return json.loads(exactly(_struct.unpack(">Q", exactly(8))[0]))


def _link_wait(rid, what=None):
    done = _LINK["done"]
    if what and rid not in done:
        _link_post({"t": "wait", "id": rid, "what": what})  # so that the check can tell a deadlock at once
    while rid not in done:
        msg = _link_read()
        done[msg.get("id")] = msg
    msg = done.pop(rid)
    if msg.get("error"):
        raise RuntimeError(msg["error"])
    return msg


class _Work:
    def __init__(self, rid, fill=None, what=""):
        self._rid, self._fill, self._done, self._what = rid, fill, False, what

    def wait(self, timeout=None):
        if not self._done:
            self._complete(_link_wait(self._rid, self._what))
        return True

    def _complete(self, msg):
        self._done = True
        if self._fill is not None:
            self._fill(msg)

    def is_completed(self):
        return self._done

    def result(self):
        self.wait()
        return []


def _op_name(op):
    name = getattr(op, "name", None) or str(op)
    return str(name).rsplit(".", 1)[-1].upper()


def _values(t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    return t.detach().flatten().tolist()


def _copy_into(tensors, values):
    flat = torch.tensor(values, dtype=torch.float64)
    at = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[at:at + n].view(t.shape).to(t.dtype))
        at += n


def _issue(call, async_op, fill, **fields):
    _LINK["next"] += 1
    rid = _LINK["next"]
    phase = globals().get("_PHASE")
    _link_post({"t": "call", "id": rid, "call": call, "async": bool(async_op),
                "phase": phase[0] if isinstance(phase, list) and phase else None, **fields})
    peer = fields.get("peer")
    work = _Work(rid, fill, f"the wait of its {call}" + (f" (peer {peer})" if peer is not None else ""))
    if async_op:
        return work
    work._complete(_link_wait(rid))  # (no "wait" note: the check knows a blocking call waits)
    return None


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _issue("send", False, None, peer=int(dst), tag=int(tag), values=_values(tensor), shape=list(tensor.shape))


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _issue("isend", True, None, peer=int(dst), tag=int(tag), values=_values(tensor), shape=list(tensor.shape))


def _recv_fill(tensor, box):
    def fill(msg):
        _copy_into([tensor], msg.get("values") or [])
        box.append(msg.get("src"))
    return fill


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    box = []
    _issue("recv", False, _recv_fill(tensor, box), peer=None if src is None else int(src), tag=int(tag),
           numel=tensor.numel(), shape=list(tensor.shape))
    return box[0] if box else -1


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _issue("irecv", True, _recv_fill(tensor, []), peer=None if src is None else int(src), tag=int(tag),
                  numel=tensor.numel(), shape=list(tensor.shape))


def _all_reduce(tensor, op=None, group=None, async_op=False):
    return _issue("all_reduce", async_op, lambda m: _copy_into([tensor], m["values"]), op=_op_name(op or "SUM"),
                  values=_values(tensor), shape=list(tensor.shape))


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    return _issue("reduce_scatter", async_op, lambda m: _copy_into([output], m["values"]), op=_op_name(op or "SUM"),
                  values=_values(input), shape=list(input.shape), out_numel=output.numel())


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    values = [v for t in input_list for v in _values(t)]
    return _issue("reduce_scatter", async_op, lambda m: _copy_into([output], m["values"]), op=_op_name(op or "SUM"),
                  values=values, shape=[len(values)], out_numel=output.numel(), name="reduce_scatter")


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    return _issue("all_gather", async_op, lambda m: _copy_into([output], m["values"]), values=_values(input),
                  shape=list(input.shape), out_numel=output.numel(), name="all_gather_into_tensor")


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    return _issue("all_gather", async_op, lambda m: _copy_into(list(tensor_list), m["values"]), values=_values(tensor),
                  shape=list(tensor.shape), out_numel=sum(t.numel() for t in tensor_list), name="all_gather")


def _barrier(group=None, async_op=False, device_ids=None):
    return _issue("barrier", async_op, None)


def _batch_isend_irecv(p2p_op_list):
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in p2p_op_list]


def _mark(entry):
    # a note of the harness's for the log (which gradient became ready, where a step begins), kept in order
    _link_post({"t": "mark", "entry": entry})


def _missing(name):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is not available here: " + _HINT)
    return collective


_IMPLEMENTED = {"send": _send, "isend": _isend, "recv": _recv, "irecv": _irecv, "all_reduce": _all_reduce,
                "reduce_scatter_tensor": _reduce_scatter_tensor, "reduce_scatter_single": _reduce_scatter_tensor,
                "reduce_scatter": _reduce_scatter, "all_gather_into_tensor": _all_gather_into_tensor,
                "all_gather": _all_gather, "batch_isend_irecv": _batch_isend_irecv}
_EVERY = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
          "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
          "all_reduce_coalesced", "all_gather_coalesced", "send", "recv", "isend", "irecv", "batch_isend_irecv",
          "send_object_list", "recv_object_list", "monitored_barrier", "new_group", "new_subgroups",
          "init_process_group", "init_device_mesh")


def _install_link(rank, world, fd):
    import torch.distributed.distributed_c10d as c10d

    _LINK.update(sock=_socket.socket(fileno=fd), next=0, done={}, rank=rank, world=world)
    for module in (dist, c10d):
        for name in _EVERY:
            setattr(module, name, _IMPLEMENTED[name] if name in _ALLOWED and name in _IMPLEMENTED else _missing(name))
        module.get_rank = lambda group=None: rank
        module.get_world_size = lambda group=None: world
        module.is_initialized = lambda: True
        module.get_backend = lambda group=None: "gloo"
        module.barrier = _barrier
        module.destroy_process_group = lambda group=None: None


def _main():
    global _SECRET
    _private()
    rank, world, case, fd = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    _install_link(rank, world, fd)
    # the data the grader dealt this rank alone (where the check deals any), in its own folder: read and
    # deleted by every rank before any of the answer's code runs (it runs only after this barrier)
    try:
        with open("secret.json") as fh:
            _SECRET = json.load(fh)
        os.unlink("secret.json")
    except FileNotFoundError:
        pass
    _link_post({"t": "ready"})
    _link_wait(0)
    report = {"rank": rank}
    try:
        exec(compile(_SOURCE, "<answer>", "exec"), globals())
        report["result"] = _case(case, rank, world)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    _link_post({"t": "report", "report": report})


if __name__ == "__main__":
    _main()
"""

# set by the grader (labs/sandbox.py): the command prefix that runs the ranks inside its sandbox
SANDBOX_PREFIX: list[str] = []
# set by the grader too: the answer worker's limits, which the ranks get as well ("memory_bytes" of
# data a process, "timeout" seconds for a check's ranks where the check's own limit is shorter)
RANK_LIMITS: dict[str, float] = {}


def _fresh_generator():
    """A torch generator seeded from the OS afresh for every grading: what it draws for the ranks,
    no answer can know or reproduce."""
    import secrets

    import torch

    return torch.Generator().manual_seed(secrets.randbits(62))


def _ring_inputs(world: int, numel: int) -> list[list[float]]:
    """Each rank's numbers: random integers (exact in float64 whatever the order of the additions),
    drawn afresh for every grading, so that no rank can know another's without receiving it."""
    import torch

    return torch.randint(-2**20, 2**20 + 1, (world, numel), generator=_fresh_generator()).double().tolist()


def _ring_problem(report: Any, rank: int, world: int, numel: int, inputs: list[list[float]]) -> str | None:
    """What is wrong with one rank's result and traffic, or None. Expected values computed here from
    the numbers dealt to the ranks: the sum over ranks, and each message a partial sum over the set of
    ranks a ring has added at that step, on some contiguous stretch of indices."""
    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    got = report.get("result")
    expected = [sum(col) for col in zip(*inputs)]
    if not isinstance(got, list) or len(got) != numel:
        return f"returned {len(got) if isinstance(got, list) else 'no'} elements, expected {numel}"
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if bad:
        return (f"wrong result at positions {bad[:5]}: got {got[:6]}..., expected {expected[:6]}... (the sum of "
                "every rank's tensor)")
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
        partial = [sum(inputs[r][i] for r in ranks) for i in range(numel)]
        if values and not any(values == partial[k:k + len(values)] for k in range(numel - len(values) + 1)):
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


# A process's parent where there is no sandbox: it runs the command (passing on the listed file
# descriptors), then ends as it ended (its exit code, or the signal that killed it). An answer that
# signals its parent (os.kill(os.getppid(), ...)) ends this go-between, not the grader.
_GO_BETWEEN = (
    "import os, signal, subprocess, sys\n"
    "fds = tuple(int(a) for a in sys.argv[1].split(',') if a)\n"
    "rc = subprocess.call(sys.argv[2:], pass_fds=fds)\n"
    "if rc < 0:\n"
    "    signal.signal(-rc, signal.SIG_DFL)\n"
    "    os.kill(os.getpid(), -rc)\n"
    "sys.exit(rc)\n")


def go_between(fds: tuple[int, ...] = ()) -> list[str]:
    """The command prefix that puts a go-between process between the grader and what it starts."""
    import sys

    return [sys.executable, "-I", "-c", _GO_BETWEEN, ",".join(str(f) for f in fds)]


def _rank_limits() -> None:
    """In the harness's process (before exec, inherited by its ranks): the answer worker's limits."""
    import resource

    mem = int(RANK_LIMITS.get("memory_bytes") or 0)
    for limit, value in ((resource.RLIMIT_FSIZE, 64 << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_DATA, mem if mem > 0 else None)):
        if value is not None:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass


def _read_regular(path: str, limit: int) -> bytes:
    """A file an answer's process could have touched, read without trusting it: not through a
    symbolic link (a rank could point its report at a file only the grader may read), not from a
    FIFO or a device (a read that never ends), not more than `limit` bytes. OSError or ValueError
    otherwise."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path} holds more than {limit} bytes")
        return os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)


def sandbox_env(scratch: str) -> dict[str, str]:
    """The environment of what runs an answer in the sandbox (the answer's process, the ranks): a
    search path, home and temporary files in its scratch directory, and nothing of the grader's."""
    import os

    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch, "OMP_NUM_THREADS": "1"}


def tail(fd: int, limit: int) -> str:
    """The last `limit` bytes of the file open on `fd`, as text: what an answer's process wrote, read
    through the grader's own descriptor (not its name, which the answer could have replaced)."""
    import os

    size = os.fstat(fd).st_size
    start = max(0, size - limit)
    return os.pread(fd, size - start, start).decode(errors="replace")


def _rank_env(cwd: str) -> dict[str, str] | None:
    """The ranks' environment: `sandbox_env` in the sandbox; without one (a student checking their
    own answer), the caller's."""
    return sandbox_env(cwd) if SANDBOX_PREFIX else None


def _run_ranks(script: str, argv: list[str], *, cwd: str, timeout: float, on_timeout: str) -> str:
    """Run a harness script (which spawns its ranks) in the sandbox, in a process group of its own that
    is killed afterwards whatever happened: nothing is left holding a port for the next check. The
    ranks get the answer worker's limits (RANK_LIMITS, set by the grader: data, file size, no core
    files) and the grader's --timeout where it is longer than the check's own; their output goes to
    files of which only the last 64 KiB are read. Returns the tail of its stderr."""
    import os
    import re
    import signal
    import subprocess
    import sys

    timeout = max(timeout, float(RANK_LIMITS.get("timeout") or 0))
    with open(os.path.join(cwd, "ranks.out"), "wb") as out, open(os.path.join(cwd, "ranks.err"), "wb+") as err_file:
        proc = subprocess.Popen([*(SANDBOX_PREFIX or go_between()), os.path.abspath(sys.executable), "-I", script, *argv],
                                stdout=out, stderr=err_file, start_new_session=True, cwd=cwd, env=_rank_env(cwd),
                                preexec_fn=_rank_limits)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(re.sub(r"within \d+ s", f"within {timeout:.0f} s", on_timeout)) from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
        return tail(err_file.fileno(), 64 << 10)


def _rank_report(path: str, err: str) -> Any:
    import json

    try:
        return json.loads(_read_regular(path, 16 << 20))
    except (OSError, ValueError):
        lines = err.strip().splitlines()
        return None if not lines else {"error": lines[-1][:300]}



_LINK_FRAME = 64 << 20  # the largest message a rank may send the check's process (bytes)


class _Switchboard:
    """The ranks' only connection to each other (labs 2-4): each rank has one socket to this, the
    check's own process, which delivers point-to-point messages (a send completes when its receive is
    posted, as gloo's does), computes every collective's result from the ranks' contributions, and
    logs, per rank, each call with the values that rank really sent. The log is this process's: an
    answer, running in a rank, can rewrite anything there but not what it sent here."""

    def __init__(self, socks: list, deadline: float):
        self.socks, self.deadline, self.world = socks, deadline, len(socks)
        self.buf = [b""] * self.world
        self.open = [True] * self.world
        self.reports: list = [None] * self.world
        self.logs: list[list] = [[] for _ in range(self.world)]
        self.ready: set[int] = set()
        self.sends: list = []  # [src, dst, tag, id, values] waiting for their receive, in arrival order
        self.recvs: list = []  # [dst, src or None, tag, id, numel] waiting for their send, in arrival order
        self.colls: dict[int, dict[int, dict]] = {}  # k-th collective call -> rank -> call
        self.count = [0] * self.world
        self.finished: dict[int, str] = {}  # rank -> how it finished (reported, ended)
        self.waiting: dict[int, tuple[int, str]] = {}  # rank -> (id, what) it is blocked on
        self.answered: list[set] = [set() for _ in range(self.world)]  # ids whose answer went out (maybe unread)

    # --- transport ---
    def _post(self, rank: int, msg: dict) -> None:
        import json
        import time

        self.answered[rank].add(msg.get("id"))
        if self.waiting.get(rank, (None,))[0] == msg.get("id"):
            del self.waiting[rank]
        if not self.open[rank]:
            return
        data = json.dumps(msg).encode()
        try:
            self.socks[rank].settimeout(max(0.01, self.deadline - time.monotonic()))
            self.socks[rank].sendall(len(data).to_bytes(8, "big") + data)
        except OSError:
            self._close(rank)

    def _close(self, rank: int) -> None:
        self.open[rank] = False
        try:
            self.socks[rank].close()
        except OSError:
            pass
        self._finish(rank, "ended")

    def _finish(self, rank: int, how: str) -> None:
        """A rank that reported or ended takes part in nothing more: what waits for it fails at once
        (as gloo's peers fail when a rank's connection closes), not at the deadline."""
        if rank in self.finished:
            return
        self.finished[rank] = how
        why = f"rank {rank} {how} before taking part in this"
        if len(self.ready) < self.world:
            for r in self.ready - {rank}:
                self._post(r, {"id": 0, "error": f"rank {rank} {how} before the ranks started"})
        for k in list(self.colls):
            for r, c in self.colls.pop(k).items():
                self._post(r, {"id": c["id"], "error": why})
        for send in [s for s in self.sends if s[1] == rank]:
            self.sends.remove(send)
            self._post(send[0], {"id": send[3], "error": why})
        for recv in [r for r in self.recvs if r[1] == rank or r[0] == rank]:
            self.recvs.remove(recv)
            self._post(recv[0], {"id": recv[3], "error": why})

    def _frames(self, rank: int):
        import json

        while len(self.buf[rank]) >= 8:
            n = int.from_bytes(self.buf[rank][:8], "big")
            if n > _LINK_FRAME:
                self._fail(rank, f"sent a message of {n} bytes (at most {_LINK_FRAME >> 20} MiB)")
                return
            if len(self.buf[rank]) < 8 + n:
                return
            raw, self.buf[rank] = self.buf[rank][8:8 + n], self.buf[rank][8 + n:]
            try:
                msg = json.loads(raw)
            except (ValueError, RecursionError):
                msg = None
            if not isinstance(msg, dict):
                self._fail(rank, "sent its link something that is not a message")
                return
            yield msg

    def _fail(self, rank: int, why: str) -> None:
        if self.reports[rank] is None:
            self.reports[rank] = {"error": why}
        self._close(rank)

    # --- the traffic ---
    def _numbers(self, rank: int, msg: dict, key: str = "values") -> list | None:
        vals = msg.get(key)
        if not isinstance(vals, list) or not all(type(v) in (int, float) for v in vals):
            self._fail(rank, "sent its link values that are not numbers")
            return None
        return vals

    def _handle(self, rank: int, msg: dict) -> None:
        kind = msg.get("t")
        if kind == "ready":
            if self.finished:
                r, how = next(iter(self.finished.items()))
                self._post(rank, {"id": 0, "error": f"rank {r} {how} before the ranks started"})
                return
            self.ready.add(rank)
            if len(self.ready) == self.world:
                for r in range(self.world):
                    self._post(r, {"id": 0, "t": "go"})
        elif kind == "report":
            self.reports[rank] = msg.get("report") if isinstance(msg.get("report"), dict) else {"error": "no report"}
            self._finish(rank, "finished" if not self.reports[rank].get("error") else "raised an error")
        elif rank in self.finished:
            pass  # nothing counts after its report
        elif kind == "wait" and isinstance(msg.get("id"), int):
            if msg["id"] not in self.answered[rank]:  # (an answer already on its way does not block it)
                self.waiting[rank] = (msg["id"], str(msg.get("what"))[:100])
        elif kind == "mark":  # the harness's notes: which gradient became ready (and what was held), a step's start
            entry = msg.get("entry")
            if not isinstance(entry, dict) or not entry or not set(entry) <= {"ready", "held", "step", "cap"}:
                self._fail(rank, "sent its link a note the harness does not write")
                return
            self.logs[rank].append(entry)
        elif kind == "call" and isinstance(msg.get("id"), int) and isinstance(msg.get("call"), str):
            self._call(rank, msg)
        else:
            self._fail(rank, "sent its link something that is not a message")

    def _call(self, rank: int, msg: dict) -> None:
        call = msg["call"]
        vals = self._numbers(rank, msg) if "values" in msg else []
        if vals is None:
            return
        entry = {"call": call, "name": msg.get("name") or call, "phase": msg.get("phase"), "async": bool(msg.get("async")),
                 "op": msg.get("op"), "shape": msg.get("shape"), "values": vals, "peer": msg.get("peer")}
        if "out_numel" in msg:
            entry["out_numel"] = msg.get("out_numel")
        self.logs[rank].append(entry)
        if not entry["async"]:
            self.waiting[rank] = (msg["id"], call + (f" (peer {msg.get('peer')})" if call in ("send", "recv") else ""))
        peer = msg.get("peer")
        if call in ("send", "isend", "recv", "irecv"):
            if not (peer is None and call in ("recv", "irecv")) and (type(peer) is not int or not 0 <= peer < self.world
                                                                   or peer == rank):
                self._post(rank, {"id": msg["id"], "error": f"invalid peer rank {peer!r} (ranks 0..{self.world - 1}, "
                                                            "not this rank's own)"})
                return
            if peer in self.finished and not (call in ("recv", "irecv") and any(
                    s[0] == peer and s[1] == rank for s in self.sends)):
                self._post(rank, {"id": msg["id"], "error": f"rank {peer} {self.finished[peer]} before this message"})
                return
            if call in ("send", "isend"):
                self.sends.append([rank, peer, msg.get("tag"), msg["id"], vals])
            else:
                self.recvs.append([rank, peer, msg.get("tag"), msg["id"], msg.get("numel")])
            self._match()
            return
        if self.finished:
            r, how = next(iter(self.finished.items()))
            self._post(rank, {"id": msg["id"], "error": f"rank {r} {how} before taking part in this {call}"})
            return
        k = self.count[rank]
        self.count[rank] += 1
        self.colls.setdefault(k, {})[rank] = entry | {"id": msg["id"]}
        if len(self.colls[k]) == self.world:
            self._collective(self.colls.pop(k))

    def _match(self) -> None:
        for recv in list(self.recvs):
            dst, src, tag, rid, numel = recv
            send = next((s for s in self.sends if s[1] == dst and (src is None or s[0] == src) and s[2] == tag), None)
            if send is None:
                continue
            self.sends.remove(send)
            self.recvs.remove(recv)
            sender, _, _, sid, values = send
            if numel != len(values):
                why = (f"rank {sender} sent {len(values)} values to rank {dst}, which posted a receive of {numel}: "
                       "sizes must match")
                self._post(dst, {"id": rid, "error": why})
                self._post(sender, {"id": sid, "error": why})
                continue
            self._post(dst, {"id": rid, "values": values, "src": sender})
            self._post(sender, {"id": sid})

    def _collective(self, calls: dict[int, dict]) -> None:
        import math

        first = calls[0]
        kinds = {(c["call"], c.get("op")) for c in calls.values()}
        sizes = {len(c["values"]) for c in calls.values()}
        why = None
        if len(kinds) > 1:
            why = "the ranks called different collectives at the same point: " + ", ".join(
                f"rank {r} {c['name']}" + (f" ({c['op']})" if c.get("op") else "") for r, c in sorted(calls.items()))
        elif len(sizes) > 1:
            why = "the ranks' tensors differ in size: " + ", ".join(f"rank {r} {len(c['values'])}" for r, c in sorted(calls.items()))
        elif first.get("op") == "AVG":
            why = "ReduceOp.AVG is not supported by gloo: sum, then divide by the number of ranks"
        elif first.get("op") not in (None, "SUM", "MAX", "MIN", "PRODUCT"):
            why = f"unsupported reduction {first.get('op')!r}"
        n = sizes.pop() if len(sizes) == 1 else 0
        if why is None and first["call"] == "reduce_scatter" and any(c.get("out_numel") * self.world != n for c in calls.values()):
            why = f"reduce-scatter of {n} values into outputs of {first.get('out_numel')}: the input holds world size x the output"
        if why is None and first["call"] == "all_gather" and any(c.get("out_numel") != n * self.world for c in calls.values()):
            why = f"all-gather of {n} values into outputs of {first.get('out_numel')}: the output holds world size x the input"
        if why:
            for r, c in calls.items():
                self._post(r, {"id": c["id"], "error": why})
            return
        columns = list(zip(*(calls[r]["values"] for r in range(self.world))))
        reduce = {"SUM": math.fsum, "MAX": max, "MIN": min, "PRODUCT": math.prod}.get(first.get("op") or "SUM")
        if first["call"] == "all_gather":
            gathered = [v for r in range(self.world) for v in calls[r]["values"]]
        for r, c in calls.items():
            if first["call"] == "all_reduce":
                out = [reduce(col) for col in columns]
            elif first["call"] == "reduce_scatter":
                m = c["out_numel"]
                out = [reduce(col) for col in columns[r * m:(r + 1) * m]]
            elif first["call"] == "all_gather":
                out = gathered
            else:
                out = []
            self._post(r, {"id": c["id"], "values": out})

    def run(self) -> None:
        """Relay until every rank has reported or ended (or the deadline: TimeoutError)."""
        import select
        import time

        while any(self.open):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([s for r, s in enumerate(self.socks) if self.open[r]], [], [], min(left, 1.0))
            for sock in ready:
                rank = self.socks.index(sock)
                try:
                    chunk = sock.recv(1 << 20)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._close(rank)
                    continue
                self.buf[rank] += chunk
                if len(self.buf[rank]) > _LINK_FRAME + 8:
                    self._fail(rank, "sent more than a message's worth at once")
                    continue
                for msg in self._frames(rank):
                    self._handle(rank, msg)
                    if not self.open[rank]:
                        break
            if all(rep is not None or not self.open[r] for r, rep in enumerate(self.reports)):
                break
            live = [r for r in range(self.world) if r not in self.finished]
            if live and all(r in self.waiting for r in live):
                raise TimeoutError("every rank waits, none can go on (a deadlock): " + "; ".join(
                    f"rank {r} in {self.waiting[r][1]}" for r in live))


def _run_world(script: str, world: int, case: Any, *, tmp: str, timeout: float, on_timeout: str,
               dealt: list | None = None, log: str = "calls") -> list:
    """Run a rank harness on `world` processes, each in its own folder and sandbox (where the grader
    has one), each dealt its own `dealt[rank]` (if given), connected only through a `_Switchboard`
    in this process. Each rank's report (or None), its "log" this process's record of the rank's
    calls: "ring" [[peer, values] per send], "names" [name per collective], "calls" [call dicts and
    the harness's marks]."""
    import json
    import os
    import re
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import time

    timeout = max(timeout, float(RANK_LIMITS.get("timeout") or 0))
    procs, socks, errs = [], [], []
    try:
        for rank in range(world):
            here = os.path.join(tmp, f"rank{rank}")
            os.makedirs(here, exist_ok=True)
            shutil.copy(script, os.path.join(here, "harness.py"))
            if dealt is not None:
                with open(os.path.join(here, "secret.json"), "w") as fh:
                    json.dump(dealt[rank], fh)
            ours, theirs = socket.socketpair()
            socks.append(ours)
            errs.append(open(os.path.join(here, "rank.err"), "wb+"))
            fd = theirs.fileno()
            with open(os.path.join(here, "rank.out"), "wb") as out:
                procs.append(subprocess.Popen(
                    [*(SANDBOX_PREFIX or go_between((fd,))), os.path.abspath(sys.executable), "-I", "harness.py",
                     str(rank), str(world), json.dumps(case), str(fd)],
                    stdout=out, stderr=errs[-1], stdin=subprocess.DEVNULL, pass_fds=(fd,), start_new_session=True,
                    cwd=here, env=_rank_env(here), preexec_fn=_rank_limits))
            theirs.close()
        board = _Switchboard(socks, time.monotonic() + timeout)
        try:
            board.run()
        except TimeoutError as e:  # the deadline, or a deadlock the switchboard saw (every rank blocked)
            raise AssertionError(re.sub(r"no answer within \d+ s", str(e), on_timeout) if str(e) else
                                 re.sub(r"within \d+ s", f"within {timeout:.0f} s", on_timeout)) from None
        reports = []
        for rank, rep in enumerate(board.reports):
            if rep is None:
                lines = tail(errs[rank].fileno(), 64 << 10).strip().splitlines()
                rep = {"error": lines[-1][:300]} if lines else None
            elif isinstance(rep, dict):
                calls = board.logs[rank]
                rep = dict(rep, log=[[e["peer"], e["values"]] for e in calls if isinstance(e, dict) and
                                     e.get("call") in ("send", "isend")] if log == "ring" else
                           [e["name"] for e in calls if isinstance(e, dict) and "call" in e] if log == "names" else calls)
            reports.append(rep)
        return reports
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            p.wait()
        for s in [*socks, *errs]:
            s.close()


def check_ring_all_reduce(fn: Callable, *, cases=((2, 8), (3, 10)), timeout: float = 60.0) -> None:
    """Run the student's `fn(tensor, rank, world_size)` on 2 and 3 ranks (processes of this machine,
    linked through this one: `_Switchboard`), with the ready-made collectives unavailable, and check each rank's
    result against the sum computed here and its traffic against a ring's. `cases` are (ranks,
    elements); element counts that the rank count does not divide are the usual bug."""
    import tempfile

    source, name = _answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ring_check.py"
        with open(path, "w") as f:
            f.write(_RING_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES) + _HARNESS_RANKS)
        for i, (world, numel) in enumerate(cases):
            inputs = _ring_inputs(world, numel)
            reports = _run_world(path, world, numel, tmp=f"{tmp}/case{i}", dealt=inputs, log="ring", timeout=timeout,
                                 on_timeout=(
                                     f"{world} ranks, {numel} elements: no answer within {timeout:.0f} s. A blocking "
                                     "send waits for its matching recv: post the receive with dist.irecv (or alternate "
                                     "the order by rank parity) before waiting on the send."))
            problems = []
            for rank in range(world):
                why = _ring_problem(reports[rank], rank, world, numel, inputs)
                if why:
                    problems.append(f"rank {rank}: {why}")
            if problems:
                hint = (" Hint: when the rank count does not divide the length, split with torch.tensor_split"
                        " (chunks of unequal size) and send each chunk's own size." if numel % world else
                        " Hint: n-1 reduce-scatter steps (send chunk (rank - step), add what arrives), then n-1"
                        " all-gather steps (forward the completed chunk), each to rank + 1, from rank - 1.")
                raise AssertionError(f"ring all-reduce on {world} ranks, {numel} elements: {problems[0]}.{hint}")


# ----------------------------------------------------------------------------- lab 3
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
                                     + f": every device runs each micro-batch's forward and backward exactly once")
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


# Shared by the rank checks below (tensor parallelism, bucketed DDP, ZeRO-2): each rank runs the
# answer's source with the answer packages unimportable, the allowed collectives logged at the call
# (which one, in which phase of the step the harness was, async or not, the input's shape and values)
# and every other collective raising. The caller recomputes every expected value itself.
_DIST_PRELUDE = r'''
import gc, json, os, sys
for _m in %BLOCKED%:
    sys.modules[_m] = None
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PHASE = ["setup"]
# what the answer may call (the link implements them: _HARNESS_RANKS); every other collective raises
_ALLOWED = %ALLOWED%
_HINT = %HINT%


def _flat(t):
    return t.detach().flatten().tolist()


def _tolist(x):
    return x.detach().tolist() if isinstance(x, torch.Tensor) else None


def _answer(call):
    """Run one call of the answer; what it raised, as text, for the report."""
    try:
        return call(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]
'''


def _harness(body: str, *, allowed: tuple[str, ...], hint: str, source: str) -> str:
    prelude = (_DIST_PRELUDE.replace("%BLOCKED%", repr(ANSWER_PACKAGES))
               .replace("%ALLOWED%", repr(allowed)).replace("%HINT%", repr(hint)))
    return prelude + "\n_SOURCE = " + repr(source) + "\n\n" + body + _HARNESS_RANKS


def _cell_source(*objs: Any) -> str:
    """The source to run on the ranks: the answer cell the grader hands over (`__vramlab_source__`);
    in the student's own kernel (or labs/kernelless.py's), the whole cell that defined each function or
    class (its helpers and imports with it), else the object's own source."""
    import inspect
    import linecache
    import textwrap

    parts: list[str] = []
    for obj in objs:
        name = getattr(obj, "__name__", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise AssertionError("pass the function or class itself")
        source = getattr(obj, "__vramlab_source__", None)
        if not isinstance(source, str):
            funcs = [obj] if not isinstance(obj, type) else [getattr(v, "__func__", v) for v in vars(obj).values()]
            code = next((f.__code__ for f in funcs if hasattr(f, "__code__")), None)
            cell = code.co_filename if code else ""
            # a notebook cell, or a cell labs/kernelless.py compiled as "<lab cell N>": all of it
            if "ipykernel_" in cell or (cell.startswith("<") and linecache.getlines(cell)):
                source = "".join(linecache.getlines(cell))
            else:
                try:
                    source = textwrap.dedent(inspect.getsource(obj))
                except (OSError, TypeError):
                    source = ""
            if not source:
                raise AssertionError(f"cannot read the source of {name}: define it in a notebook cell or a file")
        if source not in parts:
            parts.append(source)
    return "\n\n".join(parts)


def _run_cases(script: str, world: int, case: Any, *, tmp: str, timeout: float, what: str,
               dealt: list | None = None) -> list:
    """Run a harness on `world` linked ranks (each dealt its own `dealt[rank]`, if given); each rank's
    report (or None, or {"error": ...}), with the switchboard's log of its calls."""
    import json
    import os

    here = os.path.join(tmp, f"case-{world}-{abs(hash(json.dumps(case))) % 10**8}")
    return _run_world(script, world, case, tmp=here, dealt=dealt, log="calls", timeout=timeout,
                      on_timeout=f"{what} on {world} ranks: no answer within {timeout:.0f} s (a rank waits for a "
                                 "collective another never calls, or for a handle it never waits on?)")


def _rank_problem(report: Any) -> str | None:
    if not isinstance(report, dict):
        return "did not finish"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    return None


def _tensor(values: Any, like) -> Any:
    """The answer's values as a tensor shaped like `like`, or None if they do not fit."""
    import torch

    try:
        t = torch.tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return t.reshape(like.shape) if t.numel() == like.numel() and t.dim() in (1, like.dim()) else None


def _tclose(got, want) -> bool:
    import torch

    return got is not None and torch.allclose(got, want, rtol=1e-9, atol=1e-12)


# Tensor parallelism (Megatron-LM's MLP, Shoeybi+19 §3): the answer's f (identity forward, all-reduce
# backward) and g (all-reduce forward, identity backward) as autograd Functions, each alone, then the
# column- then row-parallel MLP built with them: each rank gets the whole input x (b, s, h) and its own
# shards of w1 (h, f; columns) and w2 (f, h; rows), seeded here and in the harness alike; the harness
# back-propagates a fixed gradient dy. Only all_reduce is available, logged with the phase it ran in.
_TP_BODY = r'''
def _draw(b, s, h, f, rank):
    # what the grader dealt this rank: the shared input and output gradient, this rank's weight
    # shards (the others' are known to no rank), its own t and u
    d = {k: torch.tensor(v, dtype=torch.float64) for k, v in _SECRET.items()}
    return d["x"], d["w1"], d["w2"], d["dy"], d["t"], d["u"]


def _case(case, rank, world):
    b, s, h, f = case
    x, w1, w2, dy, t, u = _draw(b, s, h, f, rank)
    out = {}
    # f alone: the input is the same on every rank, the gradient arriving from above differs (u)
    _PHASE[0] = "f forward"
    a = x.clone().requires_grad_()
    y, out["f_error"] = _answer(lambda: %F%.apply(a))
    out["f_forward"] = _tolist(y)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        _PHASE[0] = "f backward"
        _, out["f_error"] = _answer(lambda: y.backward(u.clone()))
    out["f_backward"] = _tolist(a.grad)
    # g alone: each rank's partial sum t, summed; the gradient from above is the same on every rank (dy)
    _PHASE[0] = "g forward"
    c = t.clone().requires_grad_()
    y, out["g_error"] = _answer(lambda: %G%.apply(c))
    out["g_forward"] = _tolist(y)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        _PHASE[0] = "g backward"
        _, out["g_error"] = _answer(lambda: y.backward(dy.clone()))
    out["g_backward"] = _tolist(c.grad)
    # the MLP
    _PHASE[0] = "mlp forward"
    xs = x.clone().requires_grad_()
    w1s = w1.clone().requires_grad_()  # this rank's columns of w1
    w2s = w2.clone().requires_grad_()  # this rank's rows of w2
    y = %NAME%(xs, w1s, w2s)
    out["y"] = _tolist(y)
    _PHASE[0] = "mlp backward"
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.backward(dy)
    _PHASE[0] = "done"
    out.update(dx=_tolist(xs.grad), dw1=_tolist(w1s.grad), dw2=_tolist(w2s.grad))
    return out
'''


def _tp_reference(b: int, s: int, h: int, f: int, world: int) -> dict:
    """What every rank should see, computed here from data drawn here (afresh for every grading):
    the unsplit MLP and its gradients, each rank's partial output and partial input gradient
    (float64), and what each rank is dealt ("dealt": its weight shards, t and u, x and dy)."""
    import torch

    g = _fresh_generator()
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
    why = _rank_problem(report)
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
    if not _tclose(_tensor(res.get("f_forward"), ref["x"]), ref["x"]):
        return f"{f}.forward changed its input; f is the identity in the forward"
    calls = _tp_calls(log, "f backward")
    if len(calls) != 1:
        return (f"{f}.backward called dist.all_reduce {len(calls)} times; it must sum the input's gradient over the "
                "ranks exactly once (each rank's gradient holds only its own columns' contribution)")
    if not _tclose(_tensor(res.get("f_backward"), ref["x"]), sum(ref["u"])):
        return f"{f}.backward must return the gradient summed over the ranks (dist.all_reduce, SUM)"
    # g: all-reduce forward, identity backward
    if res.get("g_error"):
        return f"{g} raised {res['g_error']}"
    calls = _tp_calls(log, "g forward")
    if len(calls) != 1:
        return (f"{g}.forward called dist.all_reduce {len(calls)} times; g sums the ranks' partial outputs with "
                "exactly one all-reduce")
    if not _tclose(_tensor(res.get("g_forward"), ref["x"]), sum(ref["t"])):
        return f"{g}.forward must return the sum of every rank's input (dist.all_reduce of a copy, SUM)"
    if _tp_calls(log, "g backward"):
        return (f"{g}.backward communicated; the output's gradient is already the same on every rank, so g's "
                "backward is the identity (an all-reduce would multiply it by the number of ranks)")
    if not _tclose(_tensor(res.get("g_backward"), ref["x"]), ref["dy"]):
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
        if not _tclose(_tensor(got.get("values"), want), want):
            return f"all-reduced something other than {what} in the MLP's {phase.split()[1]}"
    for key, want, what in (("y", ref["y"], "the output"), ("dx", ref["dx"], "the input's gradient"),
                            ("dw1", mine["dw1"], "the gradient of this rank's w1 columns"),
                            ("dw2", mine["dw2"], "the gradient of this rank's w2 rows")):
        if not _tclose(_tensor(res.get(key), want), want):
            return f"{what} differs from the unsplit MLP's (computed here on one process)"
    return None


def check_tp_mlp(fn: Callable, f_op: Any, g_op: Any, *, cases=((2, 2, 3, 8, 16),), timeout: float = 120.0) -> None:
    """Run the student's Megatron operators f (`f_op`: identity forward, all-reduce backward) and g
    (`g_op`: all-reduce forward, identity backward), then `fn(x, w1_shard, w2_shard)` (the column- then
    row-parallel MLP built with them) on linked ranks (`_Switchboard`), and check on every rank: f and g
    alone, the MLP's output, the input's gradient and the rank's weight-shard gradients against one
    process (computed here), and the traffic: exactly one all-reduce in the forward, of the rank's
    partial output, and one in the backward, of its partial input gradient. `cases` are (ranks,
    batch, sequence, hidden, MLP width)."""
    import tempfile

    source = _cell_source(fn, f_op, g_op)
    names = (f_op.__name__, g_op.__name__)
    body = _TP_BODY.replace("%F%", names[0]).replace("%G%", names[1]).replace("%NAME%", fn.__name__)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tp_check.py"
        with open(path, "w") as fh:
            fh.write(_harness(body, allowed=("all_reduce",), source=source,
                              hint="Megatron's f and g need only dist.all_reduce"))
        for world, b, s, h, f in cases:
            ref = _tp_reference(b, s, h, f, world)
            reports = _run_cases(path, world, [b, s, h, f], tmp=tmp, timeout=timeout, what="the tensor-parallel MLP",
                                 dealt=ref["dealt"])
            for rank, report in enumerate(reports):
                why = _tp_rank_problem(report, rank, ref, names)
                if why:
                    raise AssertionError(f"tensor-parallel MLP on {world} ranks (x {b}x{s}x{h}, width {f}): "
                                         f"rank {rank} {why}.")


# Data parallelism with bucketed, overlapped all-reduce (PyTorch DDP, Li+20; CS336's assignment 2):
# a small MLP (float64, the same on every rank), each rank its slice of the batch. The harness's own
# post-accumulate-grad hooks, registered before the answer's, log when each gradient is ready; the
# answer's all-reduces are logged with the phase (backward, or after it in finish()). The caller builds
# the buckets itself from the parameter sizes and the cap, and computes each rank's local gradients and
# one process's gradients on the whole batch.
DDP_DIMS = (8, 16, 16, 4)  # Linear(8, 16), Tanh, Linear(16, 16), Tanh, Linear(16, 4)
DDP_BATCH, DDP_LR, DDP_STEPS = 12, 0.1, 2

_MLP_SETUP = r'''
DIMS, BATCH, LR, STEPS = %DIMS%, %BATCH%, %LR%, %STEPS%


def _model():
    layers = []
    g = torch.Generator().manual_seed(11)
    for k, (i, o) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        lin = torch.nn.Linear(i, o, dtype=torch.float64, device="meta").to_empty(device="cpu")
        with torch.no_grad():
            lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64) * 0.4)
            lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64) * 0.1)
        layers += [lin, torch.nn.Tanh()] if k < len(DIMS) - 2 else [lin]
    return torch.nn.Sequential(*layers)


def _batch(step):
    # this rank's slice of the step's batch, dealt by the grader: the others' are known to no rank
    return (torch.tensor(_SECRET["x"][step], dtype=torch.float64), torch.tensor(_SECRET["y"][step], dtype=torch.float64))


def _held(params, but=None):
    return [j for j, q in enumerate(params) if j != but and q.grad is not None]
'''

_DDP_BODY = r'''
def _one(cap, rank, world):
    model = _model()
    params = list(model.parameters())
    for k, p in enumerate(params):  # before the answer's hooks: runs first, when p's gradient is ready
        p.register_post_accumulate_grad_hook(lambda p, k=k: _mark({"ready": k}))
    _PHASE[0] = "init"
    ddp = %NAME%(model, cap)
    steps = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        _mark({"step": step, "cap": cap})
        x, y = _batch(step)
        _PHASE[0] = "forward"
        loss = ((model(x) - y) ** 2).mean()
        _PHASE[0] = "backward"
        loss.backward()
        _PHASE[0] = "finish"
        ddp.finish()
        _PHASE[0] = "optimizer"
        steps.append([_tolist(p.grad) for p in params])
        if any(p.grad is None for p in params):
            break
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return steps


def _case(caps, rank, world):
    return [_one(cap, rank, world) for cap in caps]
'''


def _mlp_body(body: str, name: str) -> str:
    """The MLP harness's setup, then `body` calling the answer's class `name`."""
    return (_MLP_SETUP.replace("%DIMS%", repr(DDP_DIMS)).replace("%BATCH%", str(DDP_BATCH))
            .replace("%LR%", repr(DDP_LR)).replace("%STEPS%", str(DDP_STEPS)) + body.replace("%NAME%", name))


def _mlp_reference(world: int, steps: int, *, update: bool) -> dict:
    """The harness's MLP computed here with plain tensors: per step, one process's gradients on the
    whole batch (the mean loss) and each rank's own gradients on its slice; parameters updated with
    SGD (lr DDP_LR) on one process's gradients if `update`. The batches are drawn here, afresh for
    every grading; "dealt" holds each rank's slices (all a rank is given)."""
    import torch

    g = torch.Generator().manual_seed(11)
    params, names = [], []
    for k, (i, o) in enumerate(zip(DDP_DIMS[:-1], DDP_DIMS[1:])):
        params += [torch.randn(o, i, generator=g, dtype=torch.float64) * 0.4,
                   torch.randn(o, generator=g, dtype=torch.float64) * 0.1]
        names += [f"{2 * k}.weight", f"{2 * k}.bias"]

    def grads(ps, x, y):
        ps = [p.clone().requires_grad_() for p in ps]
        h = x
        for k in range(0, len(ps), 2):
            h = h @ ps[k].T + ps[k + 1]
            if k < len(ps) - 2:
                h = torch.tanh(h)
        ((h - y) ** 2).mean().backward()
        return [p.grad for p in ps]

    out, dealt = [], [{"x": [], "y": []} for _ in range(world)]
    gen = _fresh_generator()
    for step in range(steps):
        x = torch.randn(DDP_BATCH, DDP_DIMS[0], generator=gen, dtype=torch.float64)
        y = torch.randn(DDP_BATCH, DDP_DIMS[-1], generator=gen, dtype=torch.float64)
        whole = grads(params, x, y)
        local = [grads(params, xs, ys) for xs, ys in zip(x.tensor_split(world), y.tensor_split(world))]
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


def _split_steps(log: list) -> list[list]:
    """The log's events, step by step (each step opens with {"step": k}); what came before, first."""
    out: list[list] = [[]]
    for event in log if isinstance(log, list) else []:
        if isinstance(event, dict) and "step" in event:
            out.append([])
        else:
            out[-1].append(event)
    return out


def _bucket_values(local: list, bucket: list[int], pad_to: int = 0):
    import torch

    flat = torch.cat([local[k].flatten() for k in bucket])
    return torch.cat([flat, flat.new_zeros(pad_to - flat.numel())]) if pad_to > flat.numel() else flat


def _launch_problem(events: list, call_at: int, bucket: list[int], names: list[str]) -> str | None:
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


def _ddp_step_problem(events: list, local: list, whole: list, got: Any, buckets: list[list[int]], names: list[str],
                      world: int, cap: int) -> str | None:
    import torch

    calls = [(i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("call") == "all_reduce"]
    sizes = sorted(sum(local[k].numel() for k in b) for b in buckets)
    got_sizes = sorted(len(e.get("values") or []) for _, e in calls)
    if got_sizes != sizes:
        return (f"made {len(calls)} all-reduces of {got_sizes} values; with a cap of {cap} bytes the parameters, in "
                f"reverse order of model.parameters() (float64: 8 bytes a value), fill {len(buckets)} buckets of "
                f"{sizes} values: add each parameter to the current bucket, and close the bucket first if it would "
                "go past the cap (a parameter larger than the cap is a bucket of its own); one all-reduce a bucket")
    for bucket in buckets:
        want = _bucket_values(local, bucket)
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
        why = _launch_problem(events, i, bucket, names)
        if why:
            return why
    if not isinstance(got, list) or len(got) != len(whole):
        return "left no gradients in p.grad after finish()"
    for k, want in enumerate(whole):
        if not _tclose(_tensor(got[k], want), want):
            return (f"after finish() the gradient of {names[k]} differs from one process's on the whole batch: write "
                    "the sum over the ranks divided by their number back into p.grad")
    return None


def check_bucketed_ddp(cls: Any, *, cases=((2, 1000), (2, 10**6)), timeout: float = 120.0) -> None:
    """Run the student's bucketed DDP, `cls(model, bucket_bytes)` whose `finish()` ends a step, on linked
    ranks (`_Switchboard`) for two SGD steps of a small float64 MLP, each rank on its slice of the batch,
    and check on every rank: the gradients in p.grad after finish() equal one process's on the whole
    batch; one all-reduce per bucket, the buckets as computed here from the parameter sizes and the
    cap, each carrying the rank's own gradients; every all-reduce launched asynchronously during the
    backward, from the hook of the bucket's last gradient. `cases` are (ranks, cap in bytes)."""
    import tempfile

    source = _cell_source(cls)
    body = _mlp_body(_DDP_BODY, cls.__name__)
    by_world: dict[int, list[int]] = {}
    for world, cap in cases:
        by_world.setdefault(world, []).append(cap)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ddp_check.py"
        with open(path, "w") as fh:
            fh.write(_harness(body, allowed=("all_reduce",), source=source,
                              hint="DDP all-reduces each bucket with dist.all_reduce(flat, async_op=True)"))
        for world, caps in by_world.items():
            ref = _mlp_reference(world, DDP_STEPS, update=True)
            reports = _run_cases(path, world, caps, tmp=tmp, timeout=timeout, what="bucketed DDP", dealt=ref["dealt"])
            for rank, report in enumerate(reports):
                why = _rank_problem(report)
                per_step = _split_steps(report.get("log") if isinstance(report, dict) else None)
                early = [e for e in per_step[0] if isinstance(e, dict) and "call" in e]
                if not why and early:
                    why = "called all_reduce before the first backward (the parameters start equal on every rank)"
                results = report.get("result") if isinstance(report, dict) else None
                k = 1
                for c, cap in enumerate(caps):
                    if why:
                        break
                    buckets = grad_buckets(ref["sizes"], cap)
                    got = results[c] if isinstance(results, list) and c < len(results) else []
                    for step in range(DDP_STEPS):
                        where = f" (cap {cap} bytes, step {step + 1})"
                        events = per_step[k] if k < len(per_step) else []
                        k += 1
                        s = ref["steps"][step]
                        why = _ddp_step_problem(events, s["local"][rank], s["whole"],
                                                got[step] if isinstance(got, list) and step < len(got) else None,
                                                buckets, ref["names"], world, cap)
                        if why:
                            why += where
                            break
                if why:
                    raise AssertionError(f"bucketed DDP on {world} ranks: rank {rank} {why}.")


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

# what the answer may call (the link implements them: _HARNESS_RANKS); every other collective raises
_ALLOWED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter",
            "all_gather")
_HINT = ("use reduce_scatter_tensor (or all_reduce) for the gradients and all_gather_into_tensor for the "
         "parameters")


def _values_held(skip=()):
    # Numbers this process holds, however held: every live tensor's storage (counted once, in
    # elements), every list, tuple, set, dict or deque of at least 8 floats, and every array.array,
    # numpy array and bytearray any object refers to (bytearrays in 8-byte values). Objects in `skip`
    # (by identity, and tensors by storage) are not counted. gc finds them wherever they are kept: a
    # dict, an optimizer object, a closure, a module global, an attribute.
    import array
    import collections
    import gc

    gc.collect()
    skip_ids = {{id(o) for o in skip}}
    storages = {{t.untyped_storage().data_ptr() for t in skip if isinstance(t, torch.Tensor)}}
    seen, n = set(), 0
    objs = gc.get_objects()
    for o in objs:
        if id(o) in skip_ids:
            continue
        if isinstance(o, torch.Tensor):
            try:
                st = o.untyped_storage()
                ptr, size = st.data_ptr(), st.nbytes() // max(1, o.element_size())
            except Exception:
                continue
            if ptr not in storages and (ptr, size) not in seen:
                seen.add((ptr, size))
                n += size
        elif type(o) in (list, tuple, set, frozenset, dict, collections.deque):
            vals = o.values() if type(o) is dict else o
            if len(vals) >= 8 and all(type(v) is float for v in vals):
                n += len(vals)
    for o in gc.get_referents(*objs):
        if id(o) in skip_ids or id(o) in seen:
            continue
        kind = type(o).__name__
        if isinstance(o, array.array) or kind == "ndarray":
            seen.add(id(o))
            n += len(o) if isinstance(o, array.array) else int(o.size)
        elif isinstance(o, bytearray):
            seen.add(id(o))
            n += len(o) // 8
    return n


_BEFORE_ANSWER = _values_held()  # what the harness and torch hold before the answer's code runs
_SOURCE = {source!r}


def _case(case, rank, world):
    numel, steps = case
    params = torch.randn(numel, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    state, history = {{}}, []
    for k in range(steps):
        grads = torch.tensor(_SECRET[k], dtype=torch.float64)  # this rank's gradients, dealt by the grader
        {name}(params, grads, state, rank, world)
        history.append(params.tolist())
    del grads
    held = _values_held([params, state, history, *history, _SECRET, *_SECRET]) - _BEFORE_ANSWER
    return {{"history": history, "state_numel": held}}
"""

ZERO1_HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _zero1_grads(numel: int, steps: int, world: int) -> list:
    """Every rank's gradients at every step ([rank][step] -> numel floats), drawn afresh for every
    grading: each rank is dealt only its own, so the average needs the others'."""
    import torch

    g = _fresh_generator()
    return [[torch.randn(numel, generator=g, dtype=torch.float64).tolist() for _ in range(steps)] for _ in range(world)]


def _zero1_expected(numel: int, steps: int, world: int, grads: list) -> list:
    """torch.optim.AdamW on one process, fed the ranks' averaged gradients: the parameters after each step."""
    import torch

    params = torch.randn(numel, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    p = torch.nn.Parameter(params.clone())
    opt = torch.optim.AdamW([p], **ZERO1_HYPER, foreach=False)
    out = []
    for k in range(steps):
        p.grad = torch.tensor([grads[r][k] for r in range(world)], dtype=torch.float64).mean(0)
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
        return (f"keeps {result['state_numel']} optimizer-state values (counted over everything the rank holds "
                f"after its steps: tensors, lists of floats, arrays, however kept); ZeRO-1 keeps only its shard's m "
                f"and v (2 x {shard})")
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
    `params`) for several steps on linked ranks (`_Switchboard`) and check every rank's parameters after each
    step against torch.optim.AdamW on one process with the averaged gradients, and that the optimizer
    state it keeps is its shard's. `cases` are (ranks, elements, steps)."""
    import json
    import tempfile

    source, name = _answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/zero1_check.py"
        with open(path, "w") as fh:
            fh.write(_ZERO1_HARNESS.format(source=source, name=name, blocked=ANSWER_PACKAGES) + _HARNESS_RANKS)
        for i, (world, numel, steps) in enumerate(cases):
            grads = _zero1_grads(numel, steps, world)
            reports = _run_world(path, world, [numel, steps], tmp=f"{tmp}/case{i}", dealt=grads, log="names",
                                 timeout=timeout, on_timeout=f"{world} ranks: no answer within {timeout:.0f} s (a rank "
                                 "waits for a collective another never calls?)")
            expected = _zero1_expected(numel, steps, world, grads)
            for rank in range(world):
                why = _zero1_problem(reports[rank], numel, world, expected)
                if why:
                    raise AssertionError(f"ZeRO-1 step on {world} ranks, {numel} parameters: rank {rank} {why}.")


# ZeRO-2's backward (Rajbhandari+20 §5.2): the same MLP as the bucketed DDP check; the harness's own
# hooks log, when each gradient is ready, which other parameters still hold a gradient; after the
# backward and after finish() it logs them again and counts the bytes of every live tensor that is
# neither a parameter, the batch, nor a shard finish() returned. Only reduce_scatter_tensor (named
# reduce_scatter_single from torch 2.13) is available, logged like the all-reduces above.
_ZERO2_BODY = r'''
def _extra_bytes(keep):
    """Bytes of the live tensors' storages other than those of `keep` (gc finds every tensor object)."""
    gc.collect()
    known = {t.untyped_storage().data_ptr() for t in keep}
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            try:
                st = o.untyped_storage()
            except Exception:
                continue
            ptr = st.data_ptr()
            if ptr and ptr not in known and ptr not in seen:
                seen.add(ptr)
                total += st.nbytes()
    return total


def _one(cap, rank, world):
    model = _model()
    params = list(model.parameters())
    for k, p in enumerate(params):  # before the answer's hooks: runs first, when p's gradient is ready
        p.register_post_accumulate_grad_hook(lambda p, k=k: _mark({"ready": k, "held": _held(params, k)}))
    base = _extra_bytes(params)  # what earlier cases left alive (hooks make cycles gc cannot see)
    _PHASE[0] = "init"
    zero = %NAME%(model, cap)
    steps = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        _mark({"step": step, "cap": cap})
        x, y = _batch(step)
        _PHASE[0] = "forward"
        loss = ((model(x) - y) ** 2).mean()
        _PHASE[0] = "backward"
        loss.backward()
        _PHASE[0] = "finish"
        after_backward = _held(params)
        shards = zero.finish()
        _PHASE[0] = "after"
        shards = list(shards) if isinstance(shards, (list, tuple)) else shards
        mine = [t for t in shards if isinstance(t, torch.Tensor)] if isinstance(shards, list) else []
        steps.append({"shards": [_tolist(t) for t in shards] if isinstance(shards, list) else repr(shards)[:100],
                      "after_backward": after_backward, "after_finish": _held(params),
                      "extra_bytes": _extra_bytes([*params, x, y, loss, *mine]) - base})
        del loss, shards, mine
    return steps


def _case(caps, rank, world):
    return [_one(cap, rank, world) for cap in caps]
'''


def _zero2_step_problem(events: list, got: Any, local: list, whole: list, buckets: list[list[int]], names: list[str],
                        world: int, cap: int, rank: int) -> str | None:
    import torch

    calls = [(i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("call") == "reduce_scatter"]
    numels = [sum(local[k].numel() for k in b) for b in buckets]
    chunk = [-(-n // world) for n in numels]
    if len(calls) != len(buckets):
        return (f"made {len(calls)} reduce-scatters; with a cap of {cap} bytes the parameters, in reverse order of "
                f"model.parameters() (float64: 8 bytes a value), fill {len(buckets)} buckets of {numels} values: "
                "one reduce-scatter a bucket")
    for b, (bucket, (i, e)) in enumerate(zip(buckets, calls)):
        shown = [names[k] for k in bucket]
        want = _bucket_values(local, bucket, pad_to=world * chunk[b])
        vals = torch.tensor(e.get("values") or [], dtype=torch.float64)
        if e.get("out_numel") != chunk[b] or vals.numel() != want.numel():
            return (f"reduce-scattered {vals.numel()} values into {e.get('out_numel')} for bucket {b + 1} ({shown}, "
                    f"{numels[b]} values); pad the bucket's flat gradient with zeros to a multiple of {world} "
                    f"({world * chunk[b]}) and keep ceil(n / N) = {chunk[b]}")
        if not any(torch.allclose(vals, want * s, rtol=1e-9, atol=1e-12) for s in (1, 1 / world)):
            return (f"reduce-scattered something other than this rank's gradients of bucket {b + 1} ({shown}), "
                    "concatenated in the order the bucket was filled (reverse order of model.parameters()), "
                    "zero-padded at the end")
        if "SUM" not in str(e.get("op")).upper():
            return f"reduce-scattered with {e.get('op')}: sum (then divide by the number of ranks)"
        if e.get("phase") != "backward" or not e.get("async"):
            return (f"launched the reduce-scatter of bucket {b + 1} " + ("after loss.backward() returned (in "
                    f"{e.get('phase')})" if e.get("phase") != "backward" else "without async_op=True, so the backward "
                    "waited for it") + ": launch each bucket with async_op=True from the hook of its last gradient, "
                    "so that it travels while the backward goes on and its gradients can be freed at once")
        why = _launch_problem(events, i, bucket, names)
        if why:
            return why
    bucket_of = {k: b for b, bucket in enumerate(buckets) for k in bucket}
    ready_so_far: set[int] = set()
    for e in events:
        if isinstance(e, dict) and "ready" in e:
            done = {b for b, bucket in enumerate(buckets) if set(bucket) <= ready_so_far}
            stale = [j for j in e.get("held") or [] if isinstance(j, int) and bucket_of.get(j) in done]
            if stale:
                return (f"still held the gradient of {names[stale[0]]} when {names[e['ready']]}'s became ready, though "
                        "its bucket had been launched: free a bucket's gradients (p.grad = None) as soon as its "
                        "reduce-scatter is launched, so that no rank ever holds all the gradients")
            ready_so_far.add(e["ready"])
    if not isinstance(got, dict):
        return "did not finish the step"
    for when in ("after_backward", "after_finish"):
        if got.get(when):
            return (f"still holds the gradients of {[names[j] for j in got[when] if isinstance(j, int)][:4]} in p.grad "
                    f"{when.replace('_', ' ')}(): ZeRO-2 frees every gradient once its bucket is launched and keeps "
                    "only its shard of the averaged gradient")
    shards = got.get("shards")
    if not isinstance(shards, list) or len(shards) != len(buckets):
        return (f"finish() returned {str(shards)[:60]}; return this rank's shards, one 1-D tensor a bucket "
                f"({len(buckets)}), in the order the buckets were filled")
    for b, bucket in enumerate(buckets):
        want = _bucket_values(whole, bucket, pad_to=world * chunk[b])[rank * chunk[b]:(rank + 1) * chunk[b]]
        if not _tclose(_tensor(shards[b], want), want):
            return (f"returned a shard of bucket {b + 1} ({[names[k] for k in bucket]}) that differs from elements "
                    f"[{rank * chunk[b]}, {(rank + 1) * chunk[b]}) of the averaged gradient (one process on the whole "
                    "batch, computed here): the reduce-scatter's sum divided by the number of ranks")
    full = 8 * sum(numels)
    allowed = 8 * sum(chunk)
    extra = got.get("extra_bytes")
    if not isinstance(extra, int) or extra > allowed:
        return (f"keeps {extra} bytes of other tensors alive after finish() (all the gradients are {full} bytes, its "
                f"shards {allowed}): drop the flattened buckets once their reduce-scatter has completed")
    return None


def check_zero2(cls: Any, *, cases=((2, 1000),), timeout: float = 120.0) -> None:
    """Run the student's ZeRO-2 gradient partitioning, `cls(model, bucket_bytes)` whose `finish()`
    returns this rank's shards, on linked ranks (`_Switchboard`) for two backward passes of a small float64
    MLP, each rank on its slice of the batch, and check on every rank: one reduce-scatter per bucket
    (buckets computed here from the sizes and the cap), each of the rank's own zero-padded bucket,
    launched asynchronously during the backward from the hook of the bucket's last gradient; a
    bucket's gradients freed once it is launched (p.grad is None; nothing gradient-sized kept after
    finish()); the returned shards equal the averaged gradient's (one process on the whole batch).
    `cases` are (ranks, cap in bytes)."""
    import tempfile

    source = _cell_source(cls)
    body = _mlp_body(_ZERO2_BODY, cls.__name__)
    by_world: dict[int, list[int]] = {}
    for world, cap in cases:
        by_world.setdefault(world, []).append(cap)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/zero2_check.py"
        with open(path, "w") as fh:
            fh.write(_harness(body, allowed=("reduce_scatter_tensor", "reduce_scatter_single"), source=source,
                              hint="ZeRO-2 reduce-scatters each bucket: dist.reduce_scatter_tensor(shard, flat, "
                                   "async_op=True)"))
        for world, caps in by_world.items():
            ref = _mlp_reference(world, DDP_STEPS, update=False)
            reports = _run_cases(path, world, caps, tmp=tmp, timeout=timeout, what="ZeRO-2", dealt=ref["dealt"])
            for rank, report in enumerate(reports):
                why = _rank_problem(report)
                per_step = _split_steps(report.get("log") if isinstance(report, dict) else None)
                if not why and any(isinstance(e, dict) and "call" in e for e in per_step[0]):
                    why = "called a collective before the first backward"
                results = report.get("result") if isinstance(report, dict) else None
                k = 1
                for c, cap in enumerate(caps):
                    if why:
                        break
                    buckets = grad_buckets(ref["sizes"], cap)
                    got = results[c] if isinstance(results, list) and c < len(results) else []
                    for step in range(DDP_STEPS):
                        events = per_step[k] if k < len(per_step) else []
                        k += 1
                        s = ref["steps"][step]
                        why = _zero2_step_problem(events, got[step] if isinstance(got, list) and step < len(got) else None,
                                                  s["local"][rank], s["whole"], buckets, ref["names"], world, cap, rank)
                        if why:
                            why += f" (cap {cap} bytes, backward {step + 1})"
                            break
                if why:
                    raise AssertionError(f"ZeRO-2 on {world} ranks: rank {rank} {why}.")


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
        scales = _vector_answer(s, rows, "scales")
        assert max(abs(v) for r in q for v in r) <= 127, "codes must lie in [-127, 127] (symmetric: -128 is never used)"
        for i, (r, row) in enumerate(zip(q, wl)):
            top = max(abs(v) for v in row)
            if not top:  # an all-zero row: any finite scale, every code 0
                assert not any(r), f"row {i} is all zeros: its codes must be 0"
                continue
            # the reference, from the weights themselves (never from the answer's scales)
            ref = top / 127
            assert abs(scales[i] - ref) <= 1e-6 * ref, \
                f"row {i}'s scale is {scales[i]:.6g}; absmax gives its largest |weight| / 127 = {ref:.6g}"
            assert max(abs(v) for v in r) == 127, "each non-zero row's largest weight must map to +-127 (absmax)"
            assert all(abs(v - x / ref) <= 0.5 + 1e-6 for v, x in zip(r, row)), \
                f"row {i}'s codes are not its weights / scale, rounded to the nearest integer"
        back = _matrix_answer(dequantize_rows(q, s), rows, cols, "dequantize_rows")
        for i, (row, b) in enumerate(zip(wl, back)):
            step = max(abs(v) for v in row) / 127  # the reference step, not the answer's
            worst = max(abs(x - y) for x, y in zip(row, b)) - step / 2
            assert worst <= 1e-6 * max(abs(x) for x in row) + 1e-12, \
                f"row {i} of a {rows} x {cols} matrix comes back {worst:.3g} further than half its step: round, do not truncate"
        check_int(row_int8_bytes(rows, cols), rows * cols + 4 * rows, what=f"bytes of a {rows} x {cols} matrix in per-row INT8",
                  hint="one byte a weight and one fp32 scale a row", unit="bytes")


def _matrix_answer(got: Any, rows: int, cols: int, what: str) -> list[list[float]]:
    """An answer's matrix (a list of rows of numbers) as floats, or AssertionError saying what is wrong."""
    if not isinstance(got, (list, tuple)) or len(got) != rows:
        raise AssertionError(f"{what}: return a list of {rows} rows, got {type(got).__name__}"
                             + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))
    if any(not isinstance(row, (list, tuple)) or len(row) != cols for row in got):
        raise AssertionError(f"{what}: every row must hold {cols} numbers")
    return [_vector_answer(row, cols, what) for row in got]


def _vector_answer(got: Any, n: int, what: str) -> list[float]:
    """An answer's list of n finite numbers as floats, or AssertionError saying what is wrong."""
    import math

    if not isinstance(got, (list, tuple)) or len(got) != n:
        raise AssertionError(f"{what}: return a list of {n} numbers")
    try:
        vals = [float(v) for v in got]
    except (TypeError, ValueError):
        raise AssertionError(f"{what}: must hold numbers (plain floats; call .tolist() on a tensor)") from None
    if not all(math.isfinite(v) for v in vals):
        raise AssertionError(f"{what}: a value is inf or nan")
    return vals


def _far(a: list[list[float]], b: list[list[float]], tol: float) -> float:
    """The largest |a - b| over the largest |b| (0 when both are zero)."""
    top = max((abs(v) for r in b for v in r), default=0.0) or 1.0
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0) / top - tol


def _lora_peft(W, bias, A, B, alpha: float):
    """The reference: peft's LoRA layer wrapped around a torch Linear holding W (and bias), its adapter
    set to A and B (fp64 throughout, dropout 0)."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model

    d_out, d_in, r = len(W), len(W[0]), len(A)

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(d_in, d_out, bias=bias is not None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(One(), LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=0.0))
    model = model.double()
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor(W, dtype=torch.float64))
        if bias is not None:
            layer.base_layer.bias.copy_(torch.tensor(bias, dtype=torch.float64))
        layer.lora_A["default"].weight.copy_(torch.tensor(A, dtype=torch.float64))
        layer.lora_B["default"].weight.copy_(torch.tensor(B, dtype=torch.float64))
    return layer


def lora_cases(seed: int, n: int):
    """(W, bias or None, A, B, alpha, x): small layers of every shape, ranks 1 to 16, B not zero."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(n):
        d_in, d_out = (int(v) for v in torch.randint(2, 40, (2,), generator=g))
        r = [1, 2, 4, 8, 16][k % 5]
        alpha = [16.0, 8.0, 2.0 * r, 32.0, float(r)][(k + seed) % 5]
        w = (torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5).tolist()
        bias = None if k % 3 == 2 else torch.randn(d_out, generator=g, dtype=torch.float64).tolist()
        a = (torch.randn(r, d_in, generator=g, dtype=torch.float64) * 0.3).tolist()
        b = (torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.3).tolist()
        x = torch.randn(int(torch.randint(1, 6, (1,), generator=g)), d_in, generator=g, dtype=torch.float64).tolist()
        cases.append((w, bias, a, b, alpha, x))
    return cases


def check_lora_layer(lora_init: Callable, lora_forward: Callable, lora_merge: Callable, *, seed: int = 0,
                     n: int = 6) -> None:
    """A LoRA linear layer in plain lists, against peft's (`peft.tuners.lora.Linear`, fp64): its
    initialisation (A as torch.nn.Linear draws a weight, B zero: the layer starts as the frozen one),
    its forward x W^T + b + (alpha / r) x A^T B^T for given W, A, B, and its merged weight."""
    import math
    import statistics

    import torch

    # initialisation: shapes, B zero, A within nn.Linear's bound and spread like it, different seeds differ
    for d_in, d_out, r in ((256, 64, 16), (96, 200, 8), (7, 3, 2)):
        got = lora_init(d_in, d_out, r, 1)
        if not isinstance(got, (list, tuple)) or len(got) != 2:
            raise AssertionError("lora_init must return (A, B)")
        A = _matrix_answer(got[0], r, d_in, f"lora_init({d_in}, {d_out}, {r}): A (r x d_in)")
        B = _matrix_answer(got[1], d_out, r, f"lora_init({d_in}, {d_out}, {r}): B (d_out x r)")
        if any(v != 0 for row in B for v in row):
            raise AssertionError("B must start at zero: then B A = 0 and the adapted layer starts as exactly the "
                                 "frozen one (LoRA, section 4.1; peft's default)")
        bound = 1 / math.sqrt(d_in)
        vals = [v for row in A for v in row]
        if max(abs(v) for v in vals) > bound * (1 + 1e-6):
            raise AssertionError(f"A (d_in = {d_in}) has a value of {max(abs(v) for v in vals):.4g}, outside the bound "
                                 f"torch.nn.Linear draws its weight within for that fan-in")
        if len(vals) >= 1000:
            std, want = statistics.pstdev(vals), bound / math.sqrt(3)
            if not 0.9 * want <= std <= 1.1 * want:
                raise AssertionError(f"A's values spread with standard deviation {std:.4g}; torch.nn.Linear's initial "
                                     f"weights of fan-in {d_in} spread with {want:.4g} (uniform within the bound)")
        again = lora_init(d_in, d_out, r, 2)
        if isinstance(again, (list, tuple)) and len(again) == 2 and _matrix_answer(again[0], r, d_in, "A") == A and d_in * r > 4:
            raise AssertionError("lora_init with another seed gave the same A: draw it at random (from the seed)")
    for w, bias, a, b, alpha, x in lora_cases(seed, n):
        layer = _lora_peft(w, bias, a, b, alpha)
        r, d_out, d_in = len(a), len(w), len(w[0])
        where = f"d_in {d_in}, d_out {d_out}, r {r}, alpha {alpha:g}, {'a bias' if bias else 'no bias'}"
        with torch.no_grad():
            want = layer(torch.tensor(x, dtype=torch.float64)).tolist()
        got = _matrix_answer(lora_forward(x, w, bias, a, b, alpha), len(x), d_out, f"lora_forward ({where})")
        if _far(got, want, 1e-5) > 0:
            unscaled = (torch.tensor(x) @ torch.tensor(w).T + (torch.tensor(bias) if bias else 0)
                        + torch.tensor(x) @ torch.tensor(a).T @ torch.tensor(b).T).tolist()
            hint = (" — the adapter's output must be scaled by alpha / r" if alpha != r and _far(got, unscaled, 1e-5) <= 0
                    else "")
            raise AssertionError(f"lora_forward differs from peft's LoRA layer ({where}){hint}")
        with torch.no_grad():
            layer.merge()
            merged = layer.base_layer.weight.tolist()
        got = _matrix_answer(lora_merge(w, a, b, alpha), d_out, d_in, f"lora_merge ({where})")
        if _far(got, merged, 1e-5) > 0:
            raise AssertionError(f"lora_merge's weight differs from peft's merged weight ({where}): the merged layer "
                                 "must compute what the adapted one did, with no adapter")


def _log_softmax(row: list[float]) -> list[float]:
    import math

    top = max(row)
    z = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - z for v in row]


def _distill_reference(s, t, labels, T, alpha):
    import math

    soft = hard = 0.0
    for srow, trow, y in zip(s, t, labels):
        ls, lt = _log_softmax([v / T for v in srow]), _log_softmax([v / T for v in trow])
        soft += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt))
        hard -= _log_softmax(srow)[y]
    n = len(s)
    return {"loss": alpha * T * T * soft / n + (1 - alpha) * hard / n, "soft": soft / n, "hard": hard / n}


def distill_cases(seed: int, n: int):
    """(student logits, teacher logits, labels, T, alpha): tokens x vocabulary, one case with logits
    in the hundreds (a softmax computed naively overflows)."""
    import random

    rng = random.Random(seed)
    cases = []
    for k in range(n):
        tokens, vocab = rng.randint(1, 6), rng.randint(2, 30)
        scale = 300.0 if k == 1 else rng.choice((1.0, 3.0))
        s = [[rng.gauss(0, scale) for _ in range(vocab)] for _ in range(tokens)]
        t = [[rng.gauss(0, scale) for _ in range(vocab)] for _ in range(tokens)]
        cases.append((s, t, [rng.randrange(vocab) for _ in range(tokens)], [1.0, 2.0, 4.0, 0.5, 8.0][k % 5],
                      [0.5, 0.9, 1.0, 0.0, 0.3][(k + seed) % 5]))
    return cases


def check_distill_loss(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(student_logits, teacher_logits, labels, T, alpha)`: Hinton et al.'s loss, the mean over
    tokens of alpha T^2 KL(teacher_T || student_T) + (1 - alpha) cross-entropy(student, label),
    computed here in plain Python (log-softmax with the maximum subtracted)."""
    import math

    for s, t, labels, T, alpha in distill_cases(seed, n):
        ref = _distill_reference(s, t, labels, T, alpha)
        where = f"{len(s)} tokens, {len(s[0])}-word vocabulary, T = {T:g}, alpha = {alpha:g}"
        got = fn([list(r) for r in s], [list(r) for r in t], list(labels), T, alpha)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"return the loss, a float ({where}); got {got!r}") from None
        if not math.isfinite(got):
            raise AssertionError(f"the loss is {got} ({where}, logits up to {max(abs(v) for r in s for v in r):.0f}): "
                                 "subtract each row's maximum before exponentiating")
        if abs(got - ref["loss"]) <= 1e-7 * max(1.0, abs(ref["loss"])):
            continue
        hint = ""
        if alpha and T != 1 and abs(got - (alpha * ref["soft"] + (1 - alpha) * ref["hard"])) <= 1e-7 * max(1.0, abs(got)):
            hint = ": the softened term is scaled by T^2, so that its gradients keep their size whichever T is chosen"
        else:
            rev = sum(sum(math.exp(a) * (a - b) for a, b in zip(_log_softmax([v / T for v in sr]), _log_softmax([v / T for v in tr])))
                      for sr, tr in zip(s, t)) / len(s)
            if alpha and abs(got - (alpha * T * T * rev + (1 - alpha) * ref["hard"])) <= 1e-7 * max(1.0, abs(got)):
                hint = ": the KL divergence is the teacher's distribution against the student's, KL(p_teacher || p_student)"
        raise AssertionError(f"loss {got:.6g}, expected {ref['loss']:.6g} ({where}){hint}")


def mask24_cases(seed: int, n: int):
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        rows, cols = rng.randint(1, 5), 4 * rng.randint(1, 6)
        cases.append([[rng.gauss(0, 1) * (30 if rng.random() < 0.05 else 1) for _ in range(cols)] for _ in range(rows)])
    return cases


def check_mask_2_4(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(w)` returns a mask (1 keep, 0 prune) of w's shape with exactly two of every four consecutive
    weights of a row kept: the two of largest magnitude."""
    for w in mask24_cases(seed, n):
        rows, cols = len(w), len(w[0])
        got = fn([list(r) for r in w])
        mask = _matrix_answer(got, rows, cols, f"the mask of a {rows} x {cols} matrix")
        if any(v not in (0.0, 1.0) for r in mask for v in r):
            raise AssertionError("the mask holds 1 (keep) and 0 (prune) only")
        for i, (wr, mr) in enumerate(zip(w, mask)):
            for g in range(0, cols, 4):
                kept = [j for j in range(g, g + 4) if mr[j]]
                if len(kept) != 2:
                    raise AssertionError(f"row {i}, weights {g}..{g + 3}: {len(kept)} kept; 2:4 keeps exactly two of "
                                         "every four (the sparse tensor cores' format)")
                dropped = [j for j in range(g, g + 4) if j not in kept]
                if min(abs(wr[j]) for j in kept) < max(abs(wr[j]) for j in dropped):
                    hint = (" (by magnitude: a large negative weight matters as much as a large positive one)"
                            if min(wr[j] for j in kept) >= max(wr[j] for j in dropped) else "")
                    raise AssertionError(f"row {i}, weights {g}..{g + 3} = {[round(wr[j], 3) for j in range(g, g + 4)]}: "
                                         f"you keep {[round(wr[j], 3) for j in kept]}, not the two largest{hint}")


def llm_int8_cases(seed: int, n: int):
    """(x, w, threshold): activations with a few outlier feature columns (as LLM.int8() found in
    every large model's hidden states), weights without; some cases with none over the threshold."""
    import random

    rng = random.Random(seed)
    cases = []
    for k in range(n):
        tokens, d_in, d_out = rng.randint(1, 6), rng.randint(4, 40), rng.randint(1, 12)
        x = [[rng.gauss(0, 1) for _ in range(d_in)] for _ in range(tokens)]
        if k % 4 != 3:
            for j in rng.sample(range(d_in), rng.randint(1, min(3, d_in - 1))):
                for row in x:
                    if rng.random() < 0.7:
                        row[j] = rng.choice((-1, 1)) * rng.uniform(15, 60)
        w = [[rng.gauss(0, 0.05) for _ in range(d_in)] for _ in range(d_out)]
        cases.append((x, w, 6.0))
    return cases


def check_int8_decomposition(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(x, w, threshold)` returns y = x w^T as LLM.int8() computes it: the input features (columns
    of x) with any |x| > threshold multiplied in full precision, the rest in INT8 with vector-wise
    absmax scales (one per row of x, one per row of w), integer products rescaled. Checked against
    the same computed here (`compression.llm_int8`), and told apart from all-INT8 and from no INT8."""
    from .compression import llm_int8

    for x, w, threshold in llm_int8_cases(seed, n):
        where = f"x {len(x)} x {len(x[0])}, w {len(w)} x {len(w[0])}, threshold {threshold:g}"
        ref = llm_int8(x, w, threshold=threshold)
        got = _matrix_answer(fn([list(r) for r in x], [list(r) for r in w], threshold), len(x), len(w), f"y ({where})")
        if _far(got, ref["y"], 1e-5) <= 0:
            continue
        exact = [[sum(a * b for a, b in zip(xr, wr)) for wr in w] for xr in x]
        plain = llm_int8(x, w, threshold=float("inf"))["y"]
        outl = ref["outlier_columns"]
        if outl and _far(got, plain, 1e-5) <= 0:
            hint = (f"you quantized every column; columns {outl} hold |x| > {threshold:g} and must be multiplied in full "
                    "precision (their scale would crush every other value of the token to a few levels)")
        elif _far(got, exact, 1e-9) <= 0:
            hint = "that is the exact product: the columns under the threshold must go through INT8"
        else:
            hint = ("one absmax scale per row of x over the non-outlier columns, one per row of w over the same "
                    "columns, codes rounded to the nearest integer in [-127, 127]")
        raise AssertionError(f"y differs from LLM.int8()'s ({where}; outlier columns {outl}): {hint}")


def qlora_reference(linear_shapes, other_params: int, r: int) -> int:
    from .compression import nf4_bytes

    return sum(nf4_bytes(o * i) + 16 * r * (o + i) for o, i in linear_shapes) + 2 * other_params


def check_qlora_bytes(fn: Callable, cases) -> None:
    """`fn(linear_shapes, other_params, r)`: QLoRA's resident bytes: every linear layer in bitsandbytes'
    NF4 with double quantization (as Params4bit stores it), the rest in bf16, and LoRA on every linear
    layer with fp32 adapters, their gradients and Adam's two moments."""
    from .compression import nf4_bytes

    for shapes, other, r, what in cases:
        want = qlora_reference(shapes, other, r)
        got = fn([tuple(s) for s in shapes], other, r)
        lin = [o * i for o, i in shapes]
        hint = ""
        if isinstance(got, int) and not isinstance(got, bool) and got != want:
            off = got - want
            plain = sum(nf4_bytes(k, double_quant=False) - nf4_bytes(k) for k in lin)
            if off == plain:
                hint = "double quantization: the block absmaxes are themselves stored in 8 bits"
            elif off == -sum(1024 + 64 + 4 for _ in lin):
                hint = ("every quantized tensor also keeps its lookup tables (the 16 NF4 levels and the 256-entry map "
                        "of the 8-bit absmaxes, fp32) and the absmaxes' fp32 mean")
            elif off % len(shapes) == 0 and abs(off) < 4096 * len(shapes):
                hint = "count whole blocks: a tensor whose size is not a multiple of 64 still fills its last block"
            elif abs(off) == 8 * r * sum(o + i for o, i in shapes) or abs(off) == 4 * r * sum(o + i for o, i in shapes):
                hint = "each adapter value trains: fp32 weight, fp32 gradient and Adam's two fp32 moments"
        check_int(got, want, what=f"QLoRA r={r}, {what}", hint=hint, unit="bytes")


# ----------------------------------------------------------------------------- lab 7: a selective-checkpointing policy
# What the single-process harnesses below end with (appended unformatted): run `_run(case)` for every
# case of the JSON list in argv[1] and write the reports (or the error each raised) to argv[2].
_HARNESS_CASES = r"""

if __name__ == "__main__":
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    reports = []
    for case in cases:
        try:
            reports.append(_run(case))
        except Exception as e:
            reports.append({"error": f"{type(e).__name__}: {e}"[:500]})
    with open(out, "w") as fh:
        json.dump(reports, fh)
"""

# The student's make_policy() runs here, in a process of its own (sandboxed, the answer packages
# blocked): a Transformer block (or an MLP with biases) under torch.utils.checkpoint with
# create_selective_checkpoint_contexts(make_policy()), every forward decision logged with the op and
# its matmul shape, the backward's FLOPs counted (FlopCounterMode) against the block without
# checkpointing and with full recompute, and the gradients compared with the plain block's.
_SAC_HARNESS = r"""
import json, sys
for _m in %BLOCKED%:
    sys.modules[_m] = None
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

%SOURCE%


def _block(p, attn):
    b, s, h, heads = p["b"], p["s"], p["h"], p["heads"]
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    def fn(x):
        if attn:
            n = norm(x)
            q, k, v = (F.linear(n, p[c]).view(b, s, heads, h // heads).transpose(1, 2) for c in "qkv")
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
            x = x + F.linear(a, p["o"])
            n = norm(x)
            return x + F.linear(F.silu(F.linear(n, p["g"])) * F.linear(n, p["u"]), p["d"])
        return x + F.linear(F.gelu(F.linear(norm(x), p["g"], p["gb"])), p["d"], p["db"])
    return fn


def _run(case):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(case["seed"])
    b, s, h, f = case["b"], case["s"], case["h"], case["f"]
    shapes = dict(q=(h, h), k=(h, h), v=(h, h), o=(h, h), g=(f, h), u=(f, h), d=(h, f), gb=(f,), db=(h,))
    p = {k: (torch.randn(*v, dtype=torch.float64) * 0.1).requires_grad_() for k, v in shapes.items()}
    p.update(b=b, s=s, h=h, heads=case["heads"])
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    fn = _block(p, case["attention"])
    leaves = [x] + [p[k] for k in shapes]
    decisions = []

    def logged(policy):
        def wrapped(ctx, op, *args, **kwargs):
            d = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                mm = [list(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 2][-2:] \
                    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) else []
                decisions.append([str(op), getattr(d, "name", repr(d)), mm])
            return d
        return wrapped

    def step(run):
        for t in leaves:
            t.grad = None
        y = run(x)
        with FlopCounterMode(display=False) as fc:
            y.square().sum().backward()
        return fc.get_total_flops(), [None if t.grad is None else t.grad.clone() for t in leaves]

    plain, g0 = step(fn)
    full, _ = step(lambda x: checkpoint(fn, x, use_reentrant=False))
    sac, g1 = step(lambda x: checkpoint(fn, x, use_reentrant=False,
                                        context_fn=lambda: create_selective_checkpoint_contexts(logged(%NAME%()))))
    same = all((a is None and c is None) or (a is not None and c is not None and torch.allclose(a, c, rtol=1e-9, atol=1e-12))
               for a, c in zip(g0, g1))
    return {"decisions": decisions, "plain": plain, "full": full, "sac": sac, "grads_match": same}

"""

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
    """Run `_SAC_HARNESS` on `cases` with the answer's `make_policy`, in one process of its own:
    one report per case (a dict, or {"error": ...})."""
    import json
    import tempfile

    script = (_SAC_HARNESS.replace("%BLOCKED%", repr(ANSWER_PACKAGES)).replace("%SOURCE%", _cell_source(make_policy))
              .replace("%NAME%", make_policy.__name__)) + _HARNESS_CASES
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/sac_check.py", "w") as fh:
            fh.write(script)
        err = _run_ranks(f"{tmp}/sac_check.py", [json.dumps(list(cases)), f"{tmp}/out"], cwd=tmp, timeout=timeout,
                         on_timeout=f"the selective-checkpointing run gave no answer within {timeout:.0f} s")
        reports = _rank_report(f"{tmp}/out", err)
    if not isinstance(reports, list):
        raise AssertionError("the selective-checkpointing run did not finish"
                             + (f": {reports['error']}" if isinstance(reports, dict) else ""))
    return reports


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


# What the copy-engine harnesses below begin with (the answer's source in a process whose answer
# packages cannot be imported; a misuse raised where it happens), and how one is run on its cases.
_HARNESS_HEAD = r"""
import json, math, statistics, sys
for _m in %BLOCKED%:
    sys.modules[_m] = None
import torch

%SOURCE%


class _Misuse(Exception):
    pass

"""


def _harness_reports(harness: str, fn: Callable, cases: list, *, what: str, timeout: float, on_timeout: str) -> list:
    """`harness` (after `_HARNESS_HEAD`, with the answer `fn`) run on `cases` in one process of its own:
    one report per case (a dict, or {"error": ...}); AssertionError naming `what` if it did not finish."""
    import json
    import tempfile

    script = ((_HARNESS_HEAD + harness).replace("%BLOCKED%", repr(ANSWER_PACKAGES)).replace("%SOURCE%", _cell_source(fn))
              .replace("%NAME%", fn.__name__)) + _HARNESS_CASES
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/check.py", "w") as fh:
            fh.write(script)
        err = _run_ranks(f"{tmp}/check.py", [json.dumps(cases), f"{tmp}/out"], cwd=tmp, timeout=timeout,
                         on_timeout=on_timeout)
        reports = _rank_report(f"{tmp}/out", err)
    if not isinstance(reports, list):
        raise AssertionError(f"the {what} did not finish" + (f": {reports['error']}" if isinstance(reports, dict) else ""))
    return reports


# ----------------------------------------------------------------------------- lab 6: the streaming loop
# The student's stream_forward runs here, in a process of its own, against a copy engine on a
# virtual clock: a copy issued when the compute has reached time t starts at max(t, the end of the
# copy before it) and lasts its bytes over the link's rate; link.wait(ticket) moves the compute to
# the copy's end; run_layer(i, ...) moves it by layer i's seconds. Every misuse a real copy engine
# would turn into wrong numbers or a stall is caught where it happens: a layer run on weights whose
# copy it never waited for, a buffer refilled before its layer ran, a buffer that is not the link's.
# The report: each pass's start and end on the virtual clock, the buffers made, the output.
_STREAM_HARNESS = r"""
class _Link:
    def __init__(self, weights, rate):
        self.weights, self.rate, self.clock, self.engine = weights, rate, 0.0, 0.0
        self.buffers, self.ends, self.waited, self.holds = [], [], set(), {}

    def buffer(self, numel, dtype):
        b = torch.zeros(int(numel), dtype=dtype)
        self.buffers.append(b)
        return b

    def _which(self, t):
        p = t.data_ptr()
        for k, b in enumerate(self.buffers):
            if b.data_ptr() <= p < b.data_ptr() + b.numel() * b.element_size():
                return k
        return None

    def copy(self, dst, src):
        k = self._which(dst)
        if k is None:
            raise _Misuse("link.copy's destination must be (a view of) a buffer from link.buffer")
        layer = next((i for i, w in enumerate(self.weights) if w.data_ptr() == src.data_ptr()), None)
        if layer is None:
            raise _Misuse("link.copy's source must be one of the weights")
        if k in self.holds:
            raise _Misuse(f"the copy of layer {layer} overwrites buffer {k} while it holds layer "
                          f"{self.holds[k][0]}'s weights, which have not run yet")
        start = max(self.clock, self.engine)
        self.engine = start + src.numel() * 1e6 / self.rate
        dst.copy_(src)
        self.ends.append(self.engine)
        self.holds[k] = (layer, len(self.ends) - 1)
        return len(self.ends) - 1

    def wait(self, ticket):
        self.clock = max(self.clock, self.ends[ticket])
        self.waited.add(ticket)


def _run(case):
    sizes, secs, streamed, link_GBps, buffers, passes = (case[k] for k in ("sizes", "secs", "streamed", "link", "buffers", "passes"))
    weights = [torch.arange(s // 10**6, dtype=torch.float32) * 1e-3 + i for i, s in enumerate(sizes)]
    link = _Link(weights, link_GBps * 1e9)
    marks, calls = [], [0]

    def run_layer(i, x, w):
        if not isinstance(w, torch.Tensor) or w.numel() != weights[i].numel():
            raise _Misuse(f"layer {i} ran on a weight of {getattr(w, 'numel', lambda: '?')()} values; it has {weights[i].numel()}")
        if i in streamed:
            k = link._which(w)
            if k is None:
                raise _Misuse(f"streamed layer {i} ran on its host weights, not on a device buffer")
            held = link.holds.get(k)
            if held is None or held[0] != i:
                raise _Misuse(f"layer {i} ran on buffer {k}, which holds " + ("nothing" if held is None else f"layer {held[0]}'s weights"))
            if held[1] not in link.waited:
                raise _Misuse(f"layer {i} ran before waiting for its copy (link.wait(ticket))")
            del link.holds[k]
        elif w.data_ptr() != weights[i].data_ptr():
            raise _Misuse(f"resident layer {i} must run on its own weights")
        calls[0] += 1
        link.clock += secs[i]
        if calls[0] % len(weights) == 0:  # the end of a pass
            marks.append(link.clock)
        return x * 0.5 + float(w.double().sum()) * (i + 1)

    x = torch.ones(3, dtype=torch.float64)
    try:
        out = %NAME%(x, weights, list(streamed), link, run_layer=run_layer, buffers=buffers, passes=passes)
    except _Misuse as e:
        return {"misuse": str(e)}
    want = x
    for _ in range(passes):
        for i, w in enumerate(weights):
            want = want * 0.5 + float(w.double().sum()) * (i + 1)
    return {"marks": marks, "calls": calls[0], "buffers": [b.numel() for b in link.buffers],
            "matches": isinstance(out, torch.Tensor) and out.shape == want.shape and bool(torch.equal(out, want))}

"""


def check_stream_forward(fn: Callable, *, seed: int = 0, n: int = 6, timeout: float = 120.0) -> None:
    """`fn(x, weights, streamed, link, *, run_layer, buffers, passes)` (lab 6's streaming loop) run on
    stacks of `stream_cases` against a copy engine on a virtual clock (a process of its own): the
    output of every pass, the buffers it makes (min(buffers, streamed) as large as the largest
    streamed layer), no layer run on a copy it did not wait for or on a buffer being refilled, and
    the overlap measured: the third pass's time on the virtual clock equals exercise 2's schedule
    (`vramlab.offload.stream_layers`), so the copies of the next layers run while this one computes."""
    import random

    from .offload import stream_layers

    rng = random.Random(seed + 2)
    cases = []
    for sizes, secs, link, buffers in stream_cases(seed, n):
        for streamed in ([], list(range(len(sizes))), sorted(rng.sample(range(len(sizes)), rng.randint(1, len(sizes))))):
            cases.append({"sizes": sizes, "secs": secs, "streamed": streamed, "link": link, "buffers": buffers, "passes": 3})
    reports = _harness_reports(_STREAM_HARNESS, fn, cases, what="streaming run", timeout=timeout,
                               on_timeout=f"no answer within {timeout:.0f} s: does the loop end?")
    for case, rep in zip(cases, reports):
        where = (f"{len(case['sizes'])} layers of {[s // 10**8 for s in case['sizes']]} x 100 MB, streamed {case['streamed']}, "
                 f"{case['buffers']} buffer{'s' if case['buffers'] > 1 else ''}, {case['link']:g} GB/s")
        if rep.get("error"):
            raise AssertionError(f"{where}: {rep['error']}")
        if rep.get("misuse"):
            raise AssertionError(f"{where}: {rep['misuse']}")
        if rep["calls"] != 3 * len(case["sizes"]) or not rep["matches"]:
            raise AssertionError(f"{where}: three passes must run every layer in order and return x after the last "
                                 f"({rep['calls']} layer runs, output {'right' if rep['matches'] else 'wrong'})")
        want_buffers = min(case["buffers"], len(case["streamed"]))
        largest = max((case["sizes"][i] // 10**6 for i in case["streamed"]), default=0)
        if len(rep["buffers"]) != want_buffers or any(b != largest for b in rep["buffers"]):
            raise AssertionError(f"{where}: made buffers of {rep['buffers']} values; the schedule holds {want_buffers} "
                                 f"of {largest} (the largest streamed layer)")
        want = stream_layers(case["sizes"], case["secs"], streamed=case["streamed"], link_GBps=case["link"],
                             buffers=case["buffers"], passes=3).seconds
        got = rep["marks"][2] - rep["marks"][1]
        if not _close(got, want):
            hint = (" — slower: start the next copy as soon as a buffer is free (right after the layer that used it "
                    "runs), including the next pass's, and the first ones before the first layer" if got > want else "")
            raise AssertionError(f"{where}: the third pass took {got * 1e3:.3f} ms on the copy engine's clock; the "
                                 f"schedule's overlap gives {want * 1e3:.3f} ms{hint}")


# ----------------------------------------------------------------------------- lab 6: measuring the link
# The student's link_GBps(link, host) runs here, in a process of its own, against a copy engine on a
# virtual clock: link.copy(buffer, host) queues a copy that lasts its bytes over the link's rate (the
# first one also pays a one-time setup, as a driver's first copy does, and one later copy is slowed
# threefold, as by other traffic); link.wait(ticket) moves the compute's clock to the copy's end;
# link.clock() reads that clock. A clock read before waiting has not moved.
_LINK_HARNESS = r"""
class _Link:
    def __init__(self, host, rate, setup, slow):
        self.host, self.rate, self.setup, self.slow = host, rate, setup, slow
        self.now, self.engine, self.ends, self.buffers, self.waits = 0.0, 0.0, [], [], 0

    def buffer(self, numel, dtype):
        b = torch.empty(int(numel), dtype=dtype)
        self.buffers.append(b)
        return b

    def copy(self, dst, src):
        if not any(b.data_ptr() <= dst.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in self.buffers):
            raise _Misuse("link.copy's destination must be (a view of) a buffer from link.buffer")
        if src.data_ptr() != self.host.data_ptr() or src.numel() != self.host.numel():
            raise _Misuse("copy the whole host tensor: link.copy(buffer, host)")
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise _Misuse(f"the buffer holds {dst.numel()} {dst.dtype} values, the host tensor {src.numel()} {src.dtype}")
        k = len(self.ends)
        seconds = src.numel() * src.element_size() / self.rate
        if k == 0:
            seconds += self.setup
        if k == self.slow:
            seconds *= 3
        self.engine = max(self.now, self.engine) + seconds
        self.ends.append(self.engine)
        dst.copy_(src)
        return k

    def wait(self, ticket):
        self.now = max(self.now, self.ends[ticket])
        self.waits += 1

    def clock(self):
        return self.now


def _run(case):
    host = torch.arange(case["numel"], dtype=getattr(torch, case["dtype"]))
    link = _Link(host, case["GBps"] * 1e9, case["setup"], case["slow"])
    try:
        got = %NAME%(link, host)
    except _Misuse as e:
        return {"misuse": str(e)}
    except ZeroDivisionError:
        return {"zero": True, "copies": len(link.ends), "waits": link.waits}
    return {"got": float(got), "copies": len(link.ends), "waits": link.waits}

"""


def link_cases(seed: int, n: int = 6) -> list[dict]:
    """Host tensors (elements, dtype) and links (GB/s, the first copy's setup, which copy is slowed)."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        numel = rng.choice((1, 2, 3, 5, 8)) * 10 ** rng.randint(5, 6)
        dtype = rng.choice(("float32", "bfloat16"))
        rate = rng.choice((6.0, 12.0, 25.0, 50.0, 55.0))
        one = numel * (4 if dtype == "float32" else 2) / (rate * 1e9)
        cases.append({"numel": numel, "dtype": dtype, "GBps": rate, "setup": round(rng.uniform(3, 10), 2) * one,
                      "slow": rng.choice((2, 3))})
    return cases


def check_link_GBps(fn: Callable, *, seed: int = 0, n: int = 6, timeout: float = 120.0) -> None:
    """`fn(link, host)` (lab 6's link measurement) run against copy engines on a virtual clock (a
    process of its own): it must return the link's rate in GB/s (bytes a second / 1e9) to within one
    part in a million, although the first copy pays a one-time setup and one later copy is slowed:
    copies waited for before the clock is read, a warm-up, several timed copies and their median."""
    cases = link_cases(seed, n)
    reports = _harness_reports(_LINK_HARNESS, fn, cases, what="measurement", timeout=timeout,
                               on_timeout=f"no answer within {timeout:.0f} s: does the measurement end?")
    for case, rep in zip(cases, reports):
        size = case["numel"] * (4 if case["dtype"] == "float32" else 2)
        where = f"a {case['GBps']:g} GB/s link, {case['numel']:,} {case['dtype']} values ({size / 1e6:g} MB)"
        if rep.get("error"):
            raise AssertionError(f"{where}: {rep['error']}")
        if rep.get("misuse"):
            raise AssertionError(f"{where}: {rep['misuse']}")
        if rep.get("zero") or (rep.get("waits") == 0 and rep.get("copies")):
            raise AssertionError(f"{where}: the clock did not move: a copy runs on the copy engine while the compute "
                                 "goes on; read link.clock() after link.wait(ticket)")
        got, want = rep["got"], case["GBps"]
        if abs(got - want) <= 1e-6 * want:
            continue
        if abs(got - want * 1e9) <= 1e-6 * want * 1e9:
            hint = ": in GB/s, bytes a second / 1e9"
        elif any(abs(got * f - want) <= 1e-6 * want for f in (2, 4)):
            hint = ": count bytes (numel x element_size()), not values"
        elif rep["copies"] < 3:
            hint = f" from {rep['copies']} cop{'y' if rep['copies'] == 1 else 'ies'}: time several"
        elif got < want:
            hint = (": slower than the link: the first copy pays a one-time setup and another copy was slowed; "
                    "time several copies after a warm-up and take the median")
        else:
            hint = ""
        raise AssertionError(f"{where}: measured {got:.6g} GB/s, the link runs at {want:g} GB/s{hint}")
