"""Where a graded answer's code runs: never in the process that checks it, but in processes of its
own (inside the grader's sandbox where it set one, `SANDBOX_PREFIX`, under the answer worker's
limits, `RANK_LIMITS`; labs/sandbox.py and labs/tools.py set both here), each started in a scratch
folder that holds a copy of `programs/` and the answer (`answer.json`). Labs 1, 6 and 7's checks run one
such process on all their cases (`run_program`; forked from the grading's process starter, `STARTER`,
where the grader has one); labs 2-4's run one a rank (`run_world`, each rank in a sandbox of its own), connected
only through a `Switchboard` in the check's own process, which delivers their messages, computes
their collectives and keeps the log of what each rank sent."""

from __future__ import annotations

import os
from typing import Any, Callable

from .starter import apply_limits  # (standard library only: imported before any fork that uses it)

# the packages whose functions answer the exercises: graded answers cannot import them (the programs'
# processes, and labs/sandbox.py's answer process)
ANSWER_PACKAGES: tuple[str, ...] = ("vramlab", "transformers", "peft", "deepspeed", "accelerate", "bitsandbytes")

# set by the grader (labs/sandbox.py): the command prefix that runs the ranks inside its sandbox
SANDBOX_PREFIX: list[str] = []
# set by the grader too, where its sandbox has one: the grading's process starter (a `starter.Starter`
# that imported torch once), from which `run_program` forks its process inside that sandbox
STARTER: list = []
# set by the grader too: the answer worker's limits, which the ranks get as well ("memory_bytes" of
# data a process, "timeout" seconds for a check's ranks where the check's own limit is shorter)
RANK_LIMITS: dict[str, float] = {}

# what every program's process runs: the programs/ package of its folder, imported from there (-I puts
# no folder on sys.path, and the sandbox shows no vramlab), then that folder off the path again
PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
_LAUNCH = ("import os, sys\n"
           "sys.path.insert(0, os.getcwd())\n"
           "import programs\n"
           "del sys.path[0]\n"
           "from programs.{program} import main\n"
           "main()\n")


def launch(program: str) -> list[str]:
    """The interpreter's arguments that run `programs/<program>.py`'s main() from the current folder."""
    return ["-I", "-c", _LAUNCH.format(program=program)]


def fresh_generator():
    """A torch generator seeded from the OS afresh for every grading: what it draws for the ranks,
    no answer can know or reproduce."""
    import secrets

    import torch

    return torch.Generator().manual_seed(secrets.randbits(62))


def answer_source(fn: Callable) -> tuple[str, str]:
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


def cell_source(*objs: Any) -> str:
    """The source to run in the answer's processes: the answer cell the grader hands over
    (`__vramlab_source__`); in the student's own kernel (or labs/kernelless.py's), the whole cell that
    defined each function or class (its helpers and imports with it), else the object's own source."""
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
    """In a program's process (before exec, inherited by what it starts): the answer worker's limits."""
    apply_limits(_limits())


def read_regular(path: str, limit: int) -> bytes:
    """A file an answer's process could have touched, read without trusting it: not through a
    symbolic link (a rank could point its report at a file only the grader may read), not from a
    FIFO or a device (a read that never ends), not more than `limit` bytes. OSError or ValueError
    otherwise."""
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
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch, "OMP_NUM_THREADS": "1"}


def tail(fd: int, limit: int) -> str:
    """The last `limit` bytes of the file open on `fd`, as text: what an answer's process wrote, read
    through the grader's own descriptor (not its name, which the answer could have replaced)."""
    size = os.fstat(fd).st_size
    start = max(0, size - limit)
    return os.pread(fd, size - start, start).decode(errors="replace")


def _rank_env(cwd: str) -> dict[str, str] | None:
    """The programs' environment: `sandbox_env` in the sandbox; without one (a student checking their
    own answer), the caller's."""
    return sandbox_env(cwd) if SANDBOX_PREFIX else None


def _stage(folder: str, source: str, names: list[str]) -> None:
    """A program's folder: a copy of programs/ and the answer (its source, the names the harness calls,
    the packages it may not import)."""
    import json
    import shutil

    os.makedirs(folder, exist_ok=True)
    shutil.copytree(PROGRAMS, os.path.join(folder, "programs"), ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    with open(os.path.join(folder, "answer.json"), "w") as fh:
        json.dump({"source": source, "names": list(names), "blocked": list(ANSWER_PACKAGES)}, fh)


def run_program(harness: str, fn: Callable, cases: list, *, what: str, timeout: float, on_timeout: str) -> list:
    """The harness `programs/<harness>.py` run by `programs/cases.py` on `cases` with the answer `fn`
    (its whole cell), in one process of its own: one report per case (a dict, or {"error": ...});
    AssertionError naming `what` if it did not finish. The process runs in the sandbox, in a process
    group of its own that is killed afterwards whatever happened, under the answer worker's limits
    (RANK_LIMITS, set by the grader: data, file size, no core files) and the grader's --timeout where
    it is longer than the check's own; its output goes to files of which only the last 64 KiB are
    read. It is forked from a starter where there is one (the grading's, in its sandbox, `STARTER`;
    without a sandbox, this process's own), in a folder of the starter's scratch."""
    import json
    import re
    import subprocess
    import sys
    import tempfile

    source = cell_source(fn)
    timeout = max(timeout, float(RANK_LIMITS.get("timeout") or 0))
    starter = STARTER[0] if STARTER else None if SANDBOX_PREFIX else _own_starter()
    args = [harness, json.dumps(cases)]
    with tempfile.TemporaryDirectory(prefix="program-", dir=starter.scratch if starter else None) as tmp:
        if starter is not None:
            starter.own(tmp)
        _stage(tmp, source, [fn.__name__])
        with open(os.path.join(tmp, "ranks.out"), "wb") as out, open(os.path.join(tmp, "ranks.err"), "wb+") as err_file:
            if starter is not None:
                try:
                    proc = starter.spawn(cwd=tmp, argv=["-c", *args, f"{tmp}/out"], code=_LAUNCH.format(program="cases"),
                                         env=sandbox_env(tmp) if starter.sandboxed else None,
                                         fds={1: out.fileno(), 2: err_file.fileno()}, limits=_limits())
                except RuntimeError as e:
                    raise AssertionError(f"the {what} could not be started: {e}") from None
            else:
                proc = subprocess.Popen([*(SANDBOX_PREFIX or go_between()), os.path.abspath(sys.executable),
                                         *launch("cases"), *args, f"{tmp}/out"],
                                        stdout=out, stderr=err_file, start_new_session=True, cwd=tmp,
                                        env=_rank_env(tmp), preexec_fn=_rank_limits)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(re.sub(r"within \d+ s", f"within {timeout:.0f} s", on_timeout)) from None
            except RuntimeError:  # the starter ended (the program killed its parent): its report says the rest
                pass
            finally:
                _stop(proc)
            err = tail(err_file.fileno(), 64 << 10)
        reports = _report(f"{tmp}/out", err)
    if not isinstance(reports, list):
        raise AssertionError(f"the {what} did not finish" + (f": {reports['error']}" if isinstance(reports, dict) else ""))
    return reports


def _limits() -> dict[str, int]:
    """The answer worker's limits as a program's or a rank's process gets them ({resource name: value})."""
    mem = int(RANK_LIMITS.get("memory_bytes") or 0)
    return {"RLIMIT_FSIZE": 64 << 20, "RLIMIT_CORE": 0, **({"RLIMIT_DATA": mem} if mem > 0 else {})}


def _stop(proc: Any) -> None:
    """A program's or a rank's process group killed and the process reaped, whatever happened: a process
    started here (`subprocess.Popen`) or forked by a starter (`starter.Forked`; its pid is this namespace's
    unless the starter is sandboxed, so its group is killed here too, even when the starter is gone)."""
    import signal
    import subprocess

    if not getattr(getattr(proc, "starter", None), "sandboxed", False):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait() if isinstance(proc, subprocess.Popen) else proc.kill()
    except RuntimeError:  # (the starter ended: a process killed its parent; its group was killed above)
        pass


def _report(path: str, err: str) -> Any:
    import json

    try:
        return json.loads(read_regular(path, 16 << 20))
    except (OSError, ValueError):
        lines = err.strip().splitlines()
        return None if not lines else {"error": lines[-1][:300]}


LINK_FRAME = 64 << 20  # the largest message a rank may send the check's process (bytes)


class Switchboard:
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
            if n > LINK_FRAME:
                self._fail(rank, f"sent a message of {n} bytes (at most {LINK_FRAME >> 20} MiB)")
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
                if len(self.buf[rank]) > LINK_FRAME + 8:
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


def run_world(harness: str, world: int, case: Any, *, source: str, names: list[str], tmp: str, timeout: float,
              on_timeout: str, dealt: list | None = None, log: str = "calls") -> list:
    """Run `world` ranks of `programs/ranks.py` with the harness `programs/<harness>.py` on the answer
    (`source`, the `names` the harness calls), each rank in its own folder and sandbox (where the
    grader has one), each dealt its own `dealt[rank]` (if given), connected only through a
    `Switchboard` in this process. Each rank's report (or None), its "log" this process's record of
    the rank's calls: "ring" [[peer, values] per send], "names" [name per collective], "calls" [call
    dicts and the harness's marks]."""
    import json
    import re
    import socket
    import subprocess
    import sys
    import time

    timeout = max(timeout, float(RANK_LIMITS.get("timeout") or 0))
    starter = None if SANDBOX_PREFIX else _own_starter()  # (in a sandbox each rank has one of its own)
    procs, socks, errs = [], [], []
    try:
        for rank in range(world):
            here = os.path.join(tmp, f"rank{rank}")
            _stage(here, source, names)
            if dealt is not None:
                with open(os.path.join(here, "secret.json"), "w") as fh:
                    json.dump(dealt[rank], fh)
            ours, theirs = socket.socketpair()
            socks.append(ours)
            errs.append(open(os.path.join(here, "rank.err"), "wb+"))
            fd = theirs.fileno()
            with open(os.path.join(here, "rank.out"), "wb") as out:
                args = [harness, str(rank), str(world), json.dumps(case)]
                proc = None
                if starter is not None:
                    try:  # forked from this process's starter, which imported torch once
                        proc = starter.spawn(cwd=here, argv=["-c", *args, "3"], code=_LAUNCH.format(program="ranks"),
                                             fds={1: out.fileno(), 2: errs[-1].fileno(), 3: fd}, limits=_limits())
                    except RuntimeError:
                        starter = None
                if proc is None:
                    proc = subprocess.Popen(
                        [*(SANDBOX_PREFIX or go_between((fd,))), os.path.abspath(sys.executable), *launch("ranks"),
                         *args, str(fd)],
                        stdout=out, stderr=errs[-1], stdin=subprocess.DEVNULL, pass_fds=(fd,), start_new_session=True,
                        cwd=here, env=_rank_env(here), preexec_fn=_rank_limits)
                procs.append(proc)
            theirs.close()
        board = Switchboard(socks, time.monotonic() + timeout)
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
            _stop(p)
        for s in [*socks, *errs]:
            s.close()


_OWN: list = []  # this process's own starter (no sandbox), started at its first run_world


def _own_starter() -> Any:
    """This process's starter for ranks where there is no sandbox (a student's kernel, a grading
    without one): a child of this process that imported torch once, so that each rank starts in a
    fraction of a second; started afresh if a rank ended it (a rank that kills its parent kills it,
    not this process). None where it cannot start (each rank then starts an interpreter of its own)."""
    import tempfile

    from .starter import Starter, StarterGone

    if _OWN and _OWN[0].owner != os.getpid():  # (a fork of the process that started it: its own, not that one's)
        _OWN.clear()
    if _OWN and _OWN[0].alive():
        return _OWN[0]
    if _OWN:
        _OWN.pop().close()
    import atexit
    import shutil

    folder = tempfile.mkdtemp(prefix="vramlab-starter-")
    try:
        _OWN.append(Starter(folder, [], ["torch", "torch.distributed"]))
    except StarterGone:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    _OWN[0].owner = os.getpid()
    atexit.register(lambda s=_OWN[0]: (s.close(), shutil.rmtree(s.scratch, ignore_errors=True))
                    if s.owner == os.getpid() else None)
    return _OWN[0]


def run_linked(harness: str, world: int, case: Any, *, source: str, names: list[str], tmp: str, timeout: float,
               what: str, dealt: list | None = None) -> list:
    """`run_world` for labs 3-4's checks, in a folder of `tmp` of the case's own: each rank's report (or
    None, or {"error": ...}), with the switchboard's log of its calls."""
    import json

    here = os.path.join(tmp, f"case-{world}-{abs(hash(json.dumps(case))) % 10**8}")
    return run_world(harness, world, case, source=source, names=names, tmp=here, dealt=dealt, log="calls",
                     timeout=timeout, on_timeout=f"{what} on {world} ranks: no answer within {timeout:.0f} s (a rank "
                                                 "waits for a collective another never calls, or for a handle it never "
                                                 "waits on?)")
