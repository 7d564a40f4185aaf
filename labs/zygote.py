"""One grading's process starter, inside its sandbox (labs/README.md, threat model).

Started by the grader (`labs/sandbox.py`, `Zygote`) as `python -I zygote.py CTRL_FD MODULES` in a
sandbox of its own, as that sandbox's first process (PID 1 of its PID namespace), it imports the
lab's modules (torch, ...: `MODULES`, a JSON list) once, before any student code exists, and then,
asked over its one socket (which only the grader holds), forks each answer's process from that
state instead of starting an interpreter that imports torch again: a test cell's process is ready
in milliseconds instead of seconds. Standard library only, besides the modules it is asked to import.

What keeps it the grader's:
- nothing of a submission ever runs in it: a request names a script (or a program's code) and its
  arguments; the fork runs it, in a session of its own, with only the descriptors the grader passed;
- as its namespace's init it receives no signal from inside the sandbox (the kernel drops them), and
  it is not dumpable (no process of the sandbox can trace it or read its memory);
- `killall` kills every other process of the namespace (kill(-1) from its init reaches nothing outside
  it): what a test cell's answer started, however it left its session, is gone before the next one.

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


def _dumpable(on):
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 1 if on else 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def _limits(limits):
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
        _limits(req.get("limits"))
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
                done[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

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
                        done[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
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


if __name__ == "__main__":
    main()
