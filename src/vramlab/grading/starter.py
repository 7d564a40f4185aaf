"""A process starter: a process that imports torch (the modules it is asked to) once and then forks,
on request, each process that runs a graded answer's code, instead of an interpreter that imports
torch again each time (seconds each). `Starter` is the side that asks; run as a script
(`python -I starter.py CTRL_FD MODULES`), this file is the starter itself: standard library only,
besides the modules it is asked to import, so that it runs from a copy in a sandbox that holds no vramlab.

Where it runs (labs/README.md, threat model):
- a grading's, in the grader's sandbox (`labs/tools.py grade`), as that sandbox's first process (PID 1
  of its PID namespace): it forks each test cell's answer process and the single-process check
  programs (`vramlab.grading.run.STARTER`);
- a process's own, without a sandbox (`vramlab.grading.run.run_world`'s ranks in a student's kernel or
  a grading without a sandbox): a child of that process, which a rank that kills its parent ends
  instead of the process that checks it.

What keeps it the grader's:
- nothing of a submission ever runs in it: a request names a script (or a program's code) and its
  arguments; the fork runs it, in a session of its own, with only the descriptors the grader passed;
- as its namespace's init it receives no signal from inside the sandbox (the kernel drops them), and
  it is not dumpable (no process of the sandbox can trace it or read its memory);
- `killall` kills every other process of the namespace (kill(-1) from its init reaches nothing outside
  it): what a test cell's answer started, however it left its session, is gone before the next one.
  Outside a PID namespace of its own it refuses (kill(-1) would reach every process of the user).

Requests (one JSON message each, descriptors attached), replies (one JSON message each):
  {"op": "spawn", "cwd", "env", "argv", "script" or "code", "fds": [targets], "limits": {...}} -> {"pid"}
      fds: the attached descriptors become these numbers in the fork (0, 1 and 2 among them or
      /dev/null); every other descriptor is closed.
  {"op": "status", "pid"} -> {"code": exit code (-signal) or None while it runs}
  {"op": "kill", "pid"} -> {"code"}: its process group killed and reaped
  {"op": "killall"} -> {"killed": n}: every other process of the namespace killed and reaped
The socket closing ends it, and with it (its namespace's init) everything the sandbox holds.
"""

import fcntl
import json
import os
import signal
import socket
import sys

RECV = 1 << 20  # bytes of one request at most
SANDBOX_UID = 65534  # "nobody": the uid that what runs in the grader's sandbox has (labs/sandbox.py)


def _dumpable(on):
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 1 if on else 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def apply_limits(limits):
    """Resource limits ({"RLIMIT_DATA": bytes, ...}) set on this process, soft and hard; what cannot be set is left."""
    import resource

    for name, value in (limits or {}).items():
        limit = getattr(resource, str(name), None)
        if isinstance(limit, int) and isinstance(value, int) and value >= 0:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass


def _child(req, fds, ctrl):
    """In the fork: become the process the request asks for, then exit as it ended. Never returns."""
    code = 1
    try:
        os.setsid()
        ctrl.close()
        targets = [int(t) for t in req.get("fds", [])]
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # (out of the way of the targets)
        for fd in fds:
            os.close(fd)
        for src, dst in zip(high, targets):
            os.dup2(src, dst)
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            if std not in targets:
                os.dup2(devnull, std)
        keep = sorted(set(targets) | {0, 1, 2})
        lo = 3
        for fd in keep + [1 << 20]:
            if fd >= lo:
                os.closerange(lo, min(fd, 1 << 20))
                lo = fd + 1
        for fd in targets:
            if fd > 2:
                os.set_inheritable(fd, True)
        _dumpable(True)  # an ordinary process again (the starter itself stays untraceable)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        apply_limits(req.get("limits"))
        import random

        random.seed()  # (a fork shares the starter's state: each process draws its own, as a fresh one does)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = [str(a) for a in req.get("argv", [])]
        if req.get("script"):
            import runpy

            runpy.run_path(req["script"], run_name="__main__")
        else:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            try:
                print(e.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - (its output may be gone)
                pass
    except BaseException:  # noqa: BLE001 - what the process raised, as an interpreter prints it
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(code & 0xFF)


def main():
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    _dumpable(False)
    import importlib

    for name in json.loads(sys.argv[2]):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing here is missing in the answer's process too
            pass
    init = os.getpid() == 1
    done = {}  # pid -> exit code (-signal), of the forks that ended
    live = set()

    def reap(block=False):
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in live:
                live.discard(pid)
                done[pid] = os.waitstatus_to_exitcode(status)

    def reply(obj):
        ctrl.sendall(json.dumps(obj).encode())

    reply({"ready": True, "init": init, "modules": sorted(m for m in sys.modules if "." not in m)})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, RECV, 16)
        except (OSError, ValueError):
            data, fds = b"", []
        if not data:
            os._exit(0)
        try:
            req = json.loads(data)
            op = req["op"]
            reap()
            if op == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, ctrl)
                for fd in fds:
                    os.close(fd)
                live.add(pid)
                reply({"pid": pid})
            elif op == "status":
                reply({"code": done.get(int(req["pid"]))})
            elif op == "kill":
                pid = int(req["pid"])
                if pid in live:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    try:
                        _, status = os.waitpid(pid, 0)
                        live.discard(pid)
                        done[pid] = os.waitstatus_to_exitcode(status)
                    except ChildProcessError:
                        live.discard(pid)
                reply({"code": done.get(pid)})
            elif op == "killall":
                if not init:  # kill(-1) outside a PID namespace of its own would reach the grader's user
                    reply({"error": "not the sandbox's init"})
                    continue
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
                reap(block=True)
                reply({"killed": True})
            else:
                reply({"error": f"unknown request {op!r}"})
        except (ValueError, KeyError, TypeError) as e:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            reply({"error": str(e)[:200]})


# --- the side that asks -------------------------------------------------------------------------

class StarterGone(RuntimeError):
    """The starter cannot start anything more (it ended, refused, or did not start)."""


class Forked:
    """A process the starter forked, seen as `subprocess.Popen` is seen: `pid` (in the starter's PID
    namespace), `poll()`, `wait(timeout)` and `kill()` (its process group, killed and reaped)."""

    def __init__(self, starter, pid):
        self.starter, self.pid, self.returncode = starter, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.starter.ask({"op": "status", "pid": self.pid}).get("code")
        return self.returncode

    def wait(self, timeout=None):
        import subprocess
        import time

        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid} of the starter", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            self.returncode = self.starter.ask({"op": "kill", "pid": self.pid}).get("code")


class Starter:
    """A starter process (this file run as a script) and the one socket to it. `prefix` is the command
    that runs it in a sandbox (labs/sandbox.py's; there it must be the sandbox's init, or it is refused:
    `kill_all` is safe only there), or [] for a plain child of this process (`kill_all` refused).
    `scratch`: its folder, which it and what it forks see; `env`: its environment (and its forks')."""

    def __init__(self, scratch, prefix, modules, *, env=None, timeout=300.0):
        import shutil
        import subprocess

        self.scratch, self.sandboxed, self.env = scratch, bool(prefix), env
        self.ctrl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = None
        script = shutil.copyfile(__file__, os.path.join(scratch, "starter.py"))  # (the sandbox shows no vramlab)
        self._log = open(os.path.join(scratch, "starter-output.txt"), "wb+")
        try:
            self.proc = subprocess.Popen([*prefix, os.path.abspath(sys.executable), "-I", script, str(theirs.fileno()),
                                          json.dumps(list(modules))], cwd=scratch, stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=self._log, pass_fds=(theirs.fileno(),),
                                         start_new_session=True, env=env)
        except OSError as e:
            self.close()
            raise StarterGone(f"the process starter could not start ({e})") from None
        finally:
            theirs.close()
        try:
            hello = self._receive(timeout)
            if self.sandboxed and not hello.get("init"):  # (a PID namespace of its own makes kill_all safe)
                raise StarterGone("the process starter is not its sandbox's init")
        except StarterGone:
            self.close()
            raise
        self.modules = hello.get("modules", [])

    def _receive(self, timeout):
        if self.ctrl is None:
            raise StarterGone("the process starter was closed")
        self.ctrl.settimeout(timeout)
        try:
            data = self.ctrl.recv(RECV)
        except OSError as e:
            raise StarterGone(f"the process starter did not answer ({e})") from None
        if not data:
            raise StarterGone("the process starter ended")
        try:
            msg = json.loads(data)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or "error" in msg:
            raise StarterGone(f"the process starter refused: {msg.get('error') if isinstance(msg, dict) else msg}")
        return msg

    def ask(self, req, fds=(), timeout=60.0):
        if self.ctrl is None:
            raise StarterGone("the process starter was closed")
        try:
            socket.send_fds(self.ctrl, [json.dumps(req).encode()], list(fds))
        except OSError as e:
            raise StarterGone(f"the process starter is gone ({e})") from None
        return self._receive(timeout)

    def alive(self):
        return self.ctrl is not None and self.proc is not None and self.proc.poll() is None

    def spawn(self, *, cwd, argv, fds, script=None, code=None, limits=None, env=None):
        """Fork a process that runs `script` (a file it can see) or `code` (as `python -c` would) with
        `argv`, in `cwd`, with `env` (else the starter's own), the descriptors `fds` ({number in the
        process: ours}) and no other, under `limits` ({"RLIMIT_DATA": bytes, ...})."""
        targets, ours = zip(*sorted(fds.items())) if fds else ((), ())
        msg = self.ask({"op": "spawn", "cwd": cwd, "env": env if env is not None else (self.env or dict(os.environ)),
                        "argv": argv, "script": script, "code": code, "fds": list(targets),
                        "limits": limits or {}}, tuple(ours))
        return Forked(self, int(msg["pid"]))

    def own(self, folder):
        """A folder made in the scratch by this process, made the sandbox's user's (who owns the scratch)."""
        if self.sandboxed and os.geteuid() == 0:
            os.chown(folder, SANDBOX_UID, SANDBOX_UID)

    def kill_all(self):
        """Every process of the sandbox but the starter: killed and reaped (refused without a sandbox)."""
        self.ask({"op": "killall"}, timeout=60)

    def close(self):
        """The socket closed and the starter (with, in a sandbox, everything it holds) killed; idempotent."""
        import subprocess

        if self.ctrl is not None:
            self.ctrl.close()
            self.ctrl = None
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if not self._log.closed:
            self._log.close()


if __name__ == "__main__":
    main()
