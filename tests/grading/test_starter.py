"""The process starter (vramlab.grading.starter): what it forks, what it refuses, and the ranks and
programs forked from a process's own starter where there is no sandbox. In the sandbox: tests/test_grading_attacks.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from vramlab.grading import run, starter
from vramlab.grading.starter import Starter, StarterGone


def test_the_process_starter_refuses_to_kill_outside_a_sandbox(tmp_path):
    """Outside a PID namespace of its own, the starter refuses `killall` (kill(-1) would reach every
    process of the grader's user), and the grader does not use it; a process it forks holds only the
    descriptors it was given and runs with the arguments, folder and environment asked for."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-I", starter.__file__,
                             str(theirs.fileno()), "[]"],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
        ours.settimeout(60)
        assert json.loads(ours.recv(1 << 16))["init"] is False
        socket.send_fds(ours, [json.dumps({"op": "killall"}).encode()], [])
        assert "not the sandbox's init" in json.loads(ours.recv(1 << 16))["error"]
        code = ("import os, sys\nprint(sys.argv, os.getcwd(), os.environ.get('HOME'), "
                "sorted(int(d) for d in os.listdir('/proc/self/fd')))")
        with open(tmp_path / "out.txt", "wb+") as out:  # (the fork holds its own descriptor of it)
            socket.send_fds(ours, [json.dumps({"op": "spawn", "cwd": str(tmp_path), "env": {"HOME": str(tmp_path)},
                                               "argv": ["-c", "a"], "code": code, "fds": [1]}).encode()], [out.fileno()])
        pid = json.loads(ours.recv(1 << 16))["pid"]
        for _ in range(3000):  # (a hang guard of a minute, not a budget)
            socket.send_fds(ours, [json.dumps({"op": "status", "pid": pid}).encode()], [])
            if json.loads(ours.recv(1 << 16))["code"] is not None:
                break
            time.sleep(0.02)
        printed = (tmp_path / "out.txt").read_text()
        assert printed.startswith(f"['-c', 'a'] {tmp_path} {tmp_path} [0, 1, 2, 3]"), printed  # (3: listdir's own)
    finally:
        ours.close()
        proc.wait(timeout=30)
    with pytest.raises(StarterGone, match="not its sandbox's init"):  # (a prefix that makes no namespace)
        Starter(str(tmp_path), ["env"], [])
    own = Starter(str(tmp_path), [], [])  # (a process's own, for ranks without a sandbox)
    try:
        with pytest.raises(StarterGone, match="not the sandbox's init"):
            own.kill_all()
    finally:
        own.close()


def test_a_rank_that_kills_its_parent_ends_the_starter_not_this_process(tmp_path):
    """Without a sandbox a rank's parent is this process's own starter: a rank that kills it ends the
    starter (its check fails with a reason), and the next check starts a new one and passes."""
    before = os.getpid()
    own = run._own_starter()
    assert own is not None and own.alive()
    source = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos._exit(1)\n"
    with pytest.raises(AssertionError):
        run.run_program("accum", _Fn(source, "f"), [{"seed": 1}], what="probe", timeout=60, on_timeout="no answer within 60 s")
    for _ in range(1200):  # (a hang guard of a minute, not a budget)
        if not own.alive():
            break
        time.sleep(0.05)
    assert os.getpid() == before and not own.alive()
    again = run._own_starter()
    assert again is not own and again.alive()


class _Fn:
    """A function as the checks see a graded answer's: its source and name."""

    def __init__(self, source, name):
        self.__vramlab_source__, self.__name__ = source, name
