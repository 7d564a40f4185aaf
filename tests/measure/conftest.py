"""What the tests of `vramlab.measure` share: small models of a preset's family (`tiny`), and a lab command's arguments are refused before any work
starts (`nothing_starts` replaces everything that would start a process or a measurement with a
function that fails the test if reached; `refused` checks the one line and exit status 2)."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

pytest.importorskip("torch")

from vramlab.measure import checkpointing as ckptlab  # noqa: E402
from vramlab.measure import collectives as commbench  # noqa: E402
from vramlab.measure import compression as complab  # noqa: E402
from vramlab.measure import offload as offloadlab  # noqa: E402
from vramlab.measure import zero as zerolab  # noqa: E402
from vramlab.specs import preset  # noqa: E402

TINY = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=512)


def tiny(name="gpt2", **extra):
    """A small model of a preset's family (2 blocks of width 128): seconds to build and run."""
    return dataclasses.replace(preset(name), **{**TINY, **extra})


class Reached(BaseException):
    """Work started: a BaseException, so that no `except Exception` on the way can swallow it."""


def _boom(*args, **kwargs):
    raise Reached(f"a process or measurement started: {args[:1]}")


@pytest.fixture
def nothing_starts(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", _boom)
    monkeypatch.setattr(commbench, "launch", _boom)  # parlab and zerolab import it from commbench when run
    monkeypatch.setattr(zerolab, "_fake_rank", _boom)
    monkeypatch.setattr(ckptlab, "run", _boom)
    monkeypatch.setattr(complab, "run", _boom)
    monkeypatch.setattr(complab, "_probe", _boom)
    monkeypatch.setattr(offloadlab, "run_probe", _boom)
    monkeypatch.setattr(subprocess, "run", _boom)
    monkeypatch.setattr(subprocess, "Popen", _boom)


def refused(main, argv, capsys) -> str:
    """`main(argv)` refuses: exit status 2 (raised, or returned as the commands that return their
    status do), exactly one line on stderr, which it returns."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "error:" in err and "Traceback" not in err and "usage:" not in err, err
    return err.strip()


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("not a folder\n")
    return f


CUDA = __import__("torch").cuda.is_available()
