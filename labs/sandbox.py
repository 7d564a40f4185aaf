"""The grader's side of grading: the instructor's test cells run here, the student's answers in
another process (labs/answer_worker.py), inside a sandbox where one can be made.

A test cell sees the answer's functions and classes as `Remote` objects: calling one sends the
arguments (plain values) to the worker and returns what came back (plain values again, or another
`Remote`). So no student code runs in this process: it cannot replace a check, fake the library a
reference value comes from, or hook the interpreter; and the expected values never leave this
process. Threat model and limits: labs/README.md.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from answer_worker import MAX_FRAME  # the one bound on a message, both ways
from vramlab.grading.run import ANSWER_PACKAGES, sandbox_env, tail as file_tail
from vramlab.grading.starter import SANDBOX_UID, Starter, StarterGone

LABS = Path(__file__).resolve().parent
ROOT = LABS.parent
WORKER = LABS / "answer_worker.py"
# the interpreter, by a path without ".." (the sandbox holds its folder, not the folders around it)
PYTHON = os.path.abspath(sys.executable)
BLOCKED = ANSWER_PACKAGES  # vramlab's calculators, a real model's parameter count, ...: not for answers


class GradingStopped(BaseException):
    """The answer's process ran past its limit or died: ends the test cell (a BaseException, so a
    test's own `except Exception` does not swallow it)."""


class AnswerError(RuntimeError):
    """The answer raised an exception that is not one of Python's built-in ones."""


def _mount_options(path: Path) -> str:
    """The per-mount flags of the mount holding `path` (nosuid, nodev, ...): a read-only remount in
    a user namespace must keep them, or the kernel refuses it."""
    best, opts = "", ""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, opts = point, fields[5]
    except OSError:
        return ""
    return ",".join(o for o in opts.split(",") if o in ("nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime"))


def _outermost(paths) -> list[Path]:
    paths = sorted({Path(p).resolve() for p in paths if p and Path(p).is_dir()}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in paths:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return kept


def hidden_paths() -> list[Path]:
    """What an answer must not see: the instructor material (labs/) and the blocked packages' files."""
    import importlib.util

    out = [LABS]
    for name in BLOCKED:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            out += [Path(p) for p in (spec.submodule_search_locations or [])] or (
                [Path(spec.origin)] if spec.origin and spec.origin not in ("built-in", "frozen") else [])
    return [p.resolve() for p in out if p.exists()]


_UNPRIVILEGED = SANDBOX_UID  # "nobody": the answer's uid, in the sandbox (and on the host when the grader is root)


def staged_paths() -> list[Path]:
    """What the answer's process sees, read-only, of the machine: the system's programs, libraries
    and /etc, and the Python installation the grader runs (its prefixes and package folders). Not
    the checkout, not $HOME, not /tmp, not any other folder: the rest of the filesystem does not
    exist in the sandbox."""
    system = [Path(p) for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")]
    python = [Path(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)]
    python += [Path(p) for p in sys.path if p and "-packages" in p]
    out = [p for p in system if p.is_symlink() or p.exists()]
    return out + [p for p in _outermost(python) if not any(p == s or s in p.parents for s in system)]


def _stage_script(root_mode: bool) -> str:
    """The shell script that builds the sandbox's filesystem and starts the command in it. It runs
    with the privileges of new mount, PID, IPC and network namespaces (real root's when the grader
    is root; a user namespace's otherwise), in the scratch directory, which is the only writable
    folder the command will see. Steps: an empty tmpfs as the new root; each staged path bound
    read-only at its own path (symbolic links such as /bin -> usr/bin recreated); the blocked
    packages, and the checkout where a staged path holds it, replaced by empty folders; /dev with null, zero, full,
    random and urandom and a private /dev/shm; a /proc of the new PID namespace; the scratch
    directory; pivot_root into it and the old root detached (nothing else of the machine is left in
    the namespace); the root made read-only; then the command runs as uid 65534 without
    capabilities: on the host too when the grader is root (setpriv), in a nested user namespace
    otherwise (so that the mounts above are locked and cannot be undone)."""
    q = shlex.quote
    lines = ["set -e", "export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH", 'S=$(pwd -P)', 'R="$S/.vramlab-root"',
             'mkdir -p "$R"', 'mount -t tmpfs -o size=1m,mode=0755,nosuid,nodev vramlab-root "$R"']
    for p in staged_paths():
        if p.is_symlink():
            lines.append(f'mkdir -p "$R"{q(str(p.parent))}; ln -s {q(os.readlink(p))} "$R"{q(str(p))}')
            continue
        p = p.resolve()
        kept = [f for f in _mount_options(p).split(",") if f and f not in ("nosuid", "nodev")]  # (locked flags)
        flags = ",".join(["ro", "nosuid", "nodev", *kept])
        lines.append(f'mkdir -p "$R"{q(str(p))}; mount --bind {q(str(p))} "$R"{q(str(p))}; '
                     f'mount -o remount,bind,{flags} "$R"{q(str(p))}')
    staged = [p.resolve() for p in staged_paths() if not p.is_symlink()]
    for p in [*hidden_paths(), ROOT]:
        if any(p == s or s in p.parents for s in staged):
            if p.is_dir():
                lines.append(f'mount -t tmpfs -o size=16k,mode=0555 vramlab-hidden "$R"{q(str(p))}')
            else:
                lines.append(f'mount --bind /dev/null "$R"{q(str(p))}')
    lines += ['mkdir -p "$R/dev/shm" "$R/proc" "$R/tmp" "$R$S"',
              'for d in null zero full random urandom; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done',
              'mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev vramlab-shm "$R/dev/shm"',
              'mount --bind "$S" "$R$S"',
              'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
              'cd "$R"; mkdir .old; pivot_root . .old; umount -l /.old; rmdir /.old',
              'mount -o remount,bind,ro,nosuid,nodev /',
              'cd "$S"']
    if root_mode:
        lines += [f'chown {_UNPRIVILEGED}:{_UNPRIVILEGED} "$S"',
                  f'exec setpriv --reuid={_UNPRIVILEGED} --regid={_UNPRIVILEGED} --clear-groups --bounding-set=-all '
                  '--inh-caps=-all --no-new-privs -- "$@"']
    else:
        lines.append(f'exec unshare --user --map-user={_UNPRIVILEGED} --map-group={_UNPRIVILEGED} --mount -- "$@"')
    return "\n".join(lines)


_PROBE: dict = {}


def sandbox_prefix() -> tuple[list[str], str]:
    """(command prefix, description). The prefix runs a command, in the directory it is started in
    (its scratch directory), inside new mount, PID, IPC and network namespaces with a filesystem of
    its own (`_stage_script`): read-only system and Python, nothing of the checkout, of $HOME or of
    other users' files, the blocked packages replaced by empty folders, its own /proc, no network;
    as uid 65534 without capabilities; every process it starts killed with it.
    Where namespaces cannot be made (some distributions forbid them to users), ([], why)."""
    if "result" in _PROBE:
        return _PROBE["result"]
    if os.environ.get("VRAMLAB_GRADE_SANDBOX") == "off":
        _PROBE["result"] = ([], "no sandbox (VRAMLAB_GRADE_SANDBOX=off)")
        return _PROBE["result"]
    root_mode = os.geteuid() == 0
    unshare = shutil.which("unshare")
    needs = ["unshare", *(["setpriv"] if root_mode else [])]
    missing = [n for n in needs if not shutil.which(n, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    if missing or unshare is None or not sys.platform.startswith("linux"):
        _PROBE["result"] = ([], f"no sandbox (needs Linux's {' and '.join(needs)})")
        return _PROBE["result"]
    import tempfile

    namespaces = ["--mount", "--pid", "--ipc", "--net", "--fork", "--kill-child", "--propagation", "private"]
    prefix = [unshare, *([] if root_mode else ["--user", "--map-root-user"]), *namespaces, "--",
              "sh", "-c", _stage_script(root_mode), "sandbox"]
    try:
        with tempfile.TemporaryDirectory(prefix="vramlab-probe-") as cwd:
            r = subprocess.run([*prefix, PYTHON, "-I", "-c", "import os; assert os.getuid() == %d" % _UNPRIVILEGED],
                               capture_output=True, text=True, timeout=60, cwd=cwd, env=sandbox_env(cwd))
        ok, why = r.returncode == 0, (r.stderr.strip().splitlines() or ["failed"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    _PROBE["result"] = (prefix, "sandbox: own read-only filesystem without the course, uid 65534, own PID, IPC "
                                "and network namespaces") if ok else ([], f"no sandbox (namespaces unavailable: {why[:160]})")
    return _PROBE["result"]


def fingerprint() -> dict[str, tuple]:
    """Each file's change time (ctime: any write, rename, chmod or utime moves it, and a process
    cannot set it back, so writing the same number of bytes and restoring the mtime is seen) and
    size, for every file of the checkout's labs/ and src/ (with its content's SHA-256) and of the
    Python packages the grader imports (with its inode): an answer that writes to any of them
    (possible without a sandbox) is caught, as is a file added (a sitecustomize.py on the grader's
    path)."""
    import hashlib

    course = [str(r) for r in (LABS, ROOT / "src")]
    roots = _outermost([LABS, ROOT / "src", *[p for p in sys.path if p and "-packages" in p]])
    seen: dict[str, tuple] = {}
    for root in roots:
        by_content = any(str(root) == c or str(root).startswith(c + os.sep) for c in course)
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                if f.endswith(".pyc"):
                    continue
                path = os.path.join(dirpath, f)
                try:
                    st = os.stat(path)
                    if by_content:
                        with open(path, "rb") as fh:
                            seen[path] = (st.st_size, st.st_ctime_ns, hashlib.sha256(fh.read()).hexdigest())
                    else:
                        seen[path] = (st.st_size, st.st_ino, st.st_ctime_ns)
                except OSError:
                    pass
    return seen


def setup_imports(cells: list[str]) -> list[str]:
    """The top-level import statements of the lab's setup cells (what an answer may rely on being
    imported, as in the notebook), minus the blocked packages."""
    out = []
    for src in cells:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if not any(m.split(".")[0] in BLOCKED for m in mods) and not getattr(node, "level", 0):
                    out.append(ast.unparse(node))
    return out


def preamble_modules(preamble: list[str]) -> list[str]:
    """The modules the setup's import statements name (`import torch.distributed as dist`: torch.distributed;
    `from pathlib import Path`: pathlib), without the blocked packages: what the grading's `Starter` imports."""
    out: list[str] = []
    for stmt in preamble:
        try:
            node = ast.parse(stmt).body[0]
        except (SyntaxError, IndexError):
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        out += [n for n in names if n.split(".")[0] not in BLOCKED and n not in out]
    return out


def kill_group(pid: int | None) -> None:
    """SIGKILL a session's whole process group (it and whatever it started); gone already is fine."""
    if pid:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                out.add(int(d))
    return out


def _become_subreaper() -> None:
    """Orphans of the answer's process (a `setsid` child that left its process group) are re-parented
    to this process instead of init, so that `Worker.close` can find and kill them (Linux)."""
    if _PROBE.get("subreaper") is None:
        try:
            import ctypes

            _PROBE["subreaper"] = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            _PROBE["subreaper"] = False


class Worker:
    """One answer process: started with the solution cells, then asked for calls and attributes."""

    def __init__(self, cells: list[tuple[str, str]], *, scratch: str, timeout: float, preamble: list[str],
                 memory_bytes: int, prefix: list[str], starter: Starter | None = None):
        self.timeout = timeout
        self.starter = starter
        self.deadline = time.monotonic() + timeout
        self.dead: str | None = None
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        script = Path(scratch) / "answer_worker.py"
        script.write_bytes(WORKER.read_bytes())
        self.log = Path(scratch) / "answer-output.txt"
        # the grader keeps its own descriptor of the output file and reads through it (the answer may
        # replace the name with a link to a file only the grader can read)
        self._log = open(self.log, "wb+")
        self.proc = None
        if starter is not None:  # forked from the grading's starter, in its sandbox (torch imported there once)
            starter.own(scratch)
            try:
                self.proc = starter.spawn(cwd=scratch, argv=[str(script), "3", "4"], script=str(script),
                                          env=sandbox_env(scratch),
                                          fds={1: self._log.fileno(), 2: self._log.fileno(), 3: req_r, 4: resp_w})
            except StarterGone:  # (it ended: this process starts as it would without one)
                self.starter = None
        if self.proc is None:
            _become_subreaper()
            self.others = _children()  # this process's children before the answer's (not to be killed)
            # without a sandbox the answer's process is not this one's child: a small go-between is (so
            # that os.kill(os.getppid(), ...) from an answer ends the go-between, not the grader)
            from vramlab.grading.run import go_between

            between = [] if prefix else go_between((req_r, resp_w))
            self.proc = subprocess.Popen([*prefix, *between, PYTHON, "-I", str(script), str(req_r), str(resp_w)],
                                         cwd=scratch, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                         pass_fds=(req_r, resp_w), start_new_session=True,
                                         env=sandbox_env(scratch))
        os.close(req_r)
        os.close(resp_w)
        self._send({"cells": cells, "block": list(BLOCKED), "preamble": preamble, "memory_bytes": memory_bytes})
        hello = self._receive("running the answer cells")
        self.names: dict = hello.get("names", {})
        self.errors: dict = hello.get("errors", {})
        self.deadline = time.monotonic() + timeout
        self._next = 0

    # --- transport ---
    def _send(self, obj: dict) -> None:
        data = json.dumps(obj, allow_nan=False).encode()
        data = len(data).to_bytes(8, "big") + data
        try:
            while data:
                data = data[os.write(self.req_w, data):]
        except (BrokenPipeError, OSError):
            self._stop(self._died("sending it a request"))

    def _read(self, n: int, doing: str) -> bytes:
        out = bytearray()
        while len(out) < n:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.resp_r], [], [], left)[0]:
                self._stop(f"ran past the {self.timeout:g} s limit while {doing}: its process was stopped")
            chunk = os.read(self.resp_r, min(1 << 20, n - len(out)))
            if not chunk:
                self._stop(self._died(doing))
            out += chunk
        return bytes(out)

    def _receive(self, doing: str) -> dict:
        if self.dead:
            raise GradingStopped(self.dead)
        n = int.from_bytes(self._read(8, doing), "big")
        if n > MAX_FRAME:
            self._stop("the answer's process sent a message larger than 4 MiB")
        try:
            msg = json.loads(self._read(n, doing))
        except (ValueError, RecursionError):
            self._stop("the answer's process sent something that is not a reply")
        if not isinstance(msg, dict):
            self._stop("the answer's process sent something that is not a reply")
        return msg

    def _died(self, doing: str) -> str:
        try:
            code = self.proc.wait(timeout=2)
        except (subprocess.TimeoutExpired, StarterGone):
            code = None
        tail = ""
        try:
            lines = file_tail(self._log.fileno(), 2000).strip().splitlines()
            tail = f" (its last output: {lines[-1][:200]})" if lines else ""
        except OSError:
            pass
        return f"the answer's process ended while {doing} (exit code {code}){tail}"

    def _stop(self, why: str):
        self.dead = why
        self.close()
        raise GradingStopped(why)

    def close(self) -> None:
        for fd in (self.req_w, self.resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.req_w = self.resp_r = -1
        if self.starter is not None:  # everything of the sandbox but the starter: the answer's process and its own
            try:
                self.starter.kill_all()
            except StarterGone:
                pass
            self._log.close()
            return
        kill_group(self.proc.pid)
        self._log.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(3):  # what escaped the process group and was re-parented here: killed, reaped
            strays = _children() - self.others - {self.proc.pid}
            if not strays:
                break
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError, PermissionError, OSError):
                    pass
            time.sleep(0.1)

    # --- requests ---
    def request(self, op: str, **kw) -> Any:
        if self.dead:
            raise GradingStopped(self.dead)
        self._next += 1
        rid = self._next
        self._send({"id": rid, "op": op, **kw})
        msg = self._receive(f"answering {op} of {kw.get('name') or 'a function'}")
        if msg.get("id") != rid:
            self._stop("the answer's process replied out of turn")
        if "error" in msg:
            raise_error(msg["error"])
        return self.decode(msg.get("ok"))

    def encode(self, x: Any, depth: int = 0) -> Any:
        if isinstance(x, Remote) and x._worker is self:
            return {"$r": x._ref}
        t = type(x)
        if x is None or t in (bool, int, str):
            return x
        if t is float:
            return x if x == x and abs(x) != float("inf") else {"$f": repr(x)}
        if t in (list, tuple) and depth < 32:
            items = [self.encode(v, depth + 1) for v in x]
            return items if t is list else {"$t": items}
        if t is dict and depth < 32:
            return {"$d": [[self.encode(k, depth + 1), self.encode(v, depth + 1)] for k, v in x.items()]}
        if t in (set, frozenset) and depth < 32:
            return {"$s" if t is set else "$fs": [self.encode(v, depth + 1) for v in x]}
        raise TypeError(f"the grader cannot send a {t.__name__} to the answer's process")

    def decode(self, x: Any, depth: int = 0) -> Any:
        if depth > 40:
            self._stop("the answer's process sent a value nested too deeply")
        if isinstance(x, list):
            return [self.decode(v, depth + 1) for v in x]
        if isinstance(x, dict):
            if "$f" in x and x["$f"] in ("inf", "-inf", "nan"):
                return float(x["$f"])
            if isinstance(x.get("$t"), list):
                return tuple(self.decode(v, depth + 1) for v in x["$t"])
            for key, kind in (("$s", set), ("$fs", frozenset)):
                if isinstance(x.get(key), list):
                    try:
                        return kind(self.decode(v, depth + 1) for v in x[key])
                    except TypeError:  # an unhashable member
                        self._stop("the answer's process sent a set with an unhashable member")
            if isinstance(x.get("$d"), list):
                out = {}
                for kv in x["$d"]:
                    k = self.decode(kv[0], depth + 1) if isinstance(kv, list) and len(kv) == 2 else None
                    try:
                        out[k] = self.decode(kv[1], depth + 1)
                    except TypeError:  # an unhashable key (a reference is hashable; a list is not)
                        self._stop("the answer's process sent a dict with an unhashable key")
                return out
            if isinstance(x.get("$r"), int):
                return Remote(self, x["$r"], str(x.get("type", "object"))[:100], x.get("name"))
            self._stop("the answer's process sent something that is not a value")
        if x is None or type(x) in (bool, int, str, float):
            return x
        self._stop("the answer's process sent something that is not a value")


def raise_error(err: Any) -> None:
    """Raise, here, the exception the answer raised there: a built-in exception type as itself (a
    test may expect `ValueError`), anything else as AnswerError. The message says where."""
    name, msg, where = (list(err) + ["", "", ""])[:3] if isinstance(err, list) else ("Error", str(err), "")
    text = f"{str(msg)[:2000]}" + (f" [{where}]" if where else "")
    cls = getattr(builtins, str(name), None)
    if name == "MemoryError":
        text += " (the answers' process may hold --memory-gib of data)"
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        try:
            raise cls(text)
        except TypeError:  # an exception type that wants other arguments (UnicodeDecodeError, ...)
            pass
    raise AnswerError(f"{name}: {text}")


class Remote:
    """An object of the answer's, seen from the grader: calling it or reading its attributes asks
    the answer's process. It is never equal to anything but itself, and has no truth value."""

    __slots__ = ("_worker", "_ref", "_type", "__name__", "__vramlab_source__", "__vramlab_type__")

    def __init__(self, worker: Worker, ref: int, type_name: str, name: Any = None, source: str | None = None):
        self._worker, self._ref, self._type = worker, ref, type_name
        self.__name__ = name if isinstance(name, str) else type_name
        self.__vramlab_source__ = source
        self.__vramlab_type__ = type_name

    def __call__(self, *args, **kwargs):
        w = self._worker
        return w.request("call", ref=self._ref, args=w.encode(list(args)), kwargs=w.encode(kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._worker.request("getattr", ref=self._ref, name=name)

    def __setattr__(self, name, value):
        if name in Remote.__slots__:
            object.__setattr__(self, name, value)
        else:
            raise TypeError("the grader does not change the answer's objects")

    def __bool__(self):
        raise TypeError(f"a {self._type} from the answer has no truth value here: return a bool, int or float")

    def __repr__(self):
        return f"<{self._type} {self.__name__} from the answer>" if self.__name__ != self._type else f"<{self._type} from the answer>"


def run_test(source: str, gid: str, worker: Worker, sources: dict[str, str]) -> tuple[bool, str | None, str]:
    """Run one instructor test cell here, against the answer's names. (passed, reason, its output)."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    for name, info in worker.names.items():
        val = worker.decode(info.get("value"))
        if isinstance(val, Remote):
            val.__vramlab_source__ = sources.get(info.get("cell"))
        ns[name] = val
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"<{gid}>", "exec"), ns)
        return True, None, out.getvalue()
    except GradingStopped as e:
        return False, str(e), out.getvalue()
    except Exception as e:  # noqa: BLE001 - a failing test is a score with its reason
        reason = f"{type(e).__name__}: {e}"
        if isinstance(e, NameError) and worker.errors:
            gid_e, err = next(iter(worker.errors.items()))
            reason += f" (the answer cell {gid_e} raised {err[0]}: {str(err[1])[:200]})"
        return False, reason[:500], out.getvalue()
