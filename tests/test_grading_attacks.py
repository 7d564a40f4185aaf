"""The grader against a hostile student and a careless instructor (issue #11): each attack scores
the honest score or fails cleanly with a reason — never a traceback, a hang, or points for nothing.
Threat model: labs/README.md."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tools", ROOT / "labs" / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)
LAB = "lab01_where_memory_goes"
RELEASED = ROOT / "labs" / "release" / LAB / f"{LAB}.ipynb"
INSTRUCTOR_SOURCE = ROOT / "labs" / "source" / LAB / f"{LAB}.md"


def student() -> nbformat.NotebookNode:
    return nbformat.read(RELEASED, as_version=4)


def cell(nb, gid):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)


def solutions() -> dict[str, str]:
    return {c.metadata["nbgrader"]["grade_id"]: c.source for c in tools.source_notebook(LAB).cells
            if c.metadata.get("nbgrader", {}).get("solution")}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child whose parent is gone may wait a moment to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def run_cli(*args, timeout=300):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, str(ROOT / "labs" / "tools.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_structure_attacks_score_the_honest_score():
    """Correct answers (one of them warning on stderr), with every test tampered with: turned into
    markdown, renamed to a bonus-free `pass`, deleted, plus a forged 100-point cell and a solution that
    tries to read and rewrite the instructor source. The honest score: 9/9, out of 9."""
    nb = student()
    sol = solutions()
    for gid, src in sol.items():
        cell(nb, gid).source = src
    cell(nb, "ex1-solution").source = "import warnings\nwarnings.warn('a correct answer may warn')\n" + sol["ex1-solution"]
    cell(nb, "ex2-solution").source = sol["ex2-solution"] + (
        "\nimport pathlib\nfor p in pathlib.Path('.').rglob('*.md'):\n    p.write_text('pwned')\n"
        "try:\n    open('lab01_where_memory_goes.md').read()\nexcept OSError:\n    pass\n")
    t1 = cell(nb, "ex1-test")
    t1.cell_type = "markdown"
    t1.pop("outputs", None)
    t1.pop("execution_count", None)
    cell(nb, "ex2-test").metadata["nbgrader"]["grade_id"] = "renamed"
    cell(nb, "renamed").source = "pass"
    nb.cells.remove(cell(nb, "ex3-test"))
    forged = nbformat.v4.new_code_cell("pass")
    forged.metadata["nbgrader"] = {"grade": True, "grade_id": "bonus", "points": 100, "solution": False, "locked": True}
    nb.cells.append(forged)
    before = INSTRUCTOR_SOURCE.read_bytes()
    scores = tools.grade(nb, LAB, timeout=300)
    assert INSTRUCTOR_SOURCE.read_bytes() == before  # graded in a scratch directory
    assert set(scores) == {"ex1-test", "ex2-test", "ex3-test"} and tools.total(scores) == (9, 9), scores


def test_stubs_with_forged_and_deleted_tests_score_zero_of_the_real_total():
    nb = student()
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "ex1-test"]
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") in ("ex2-test", "ex3-test"):
            c.metadata = {}  # metadata deleted
    scores = tools.grade(nb, LAB, timeout=300)
    assert tools.total(scores) == (0, 9), scores


def test_an_endless_solution_ends_with_a_reason():
    """An infinite loop that swallows every interrupt: the answer's process is killed at the limit,
    the tests that need it score 0 with that reason, and grading returns in seconds."""
    nb = student()
    cell(nb, "ex1-solution").source = "while True:\n    try:\n        pass\n    except BaseException:\n        pass"
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=5)
    assert time.perf_counter() - t0 < 90
    assert tools.total(scores) == (0, 9) and "ran past the 5 s limit" in scores["ex1-test"][2], scores


@pytest.mark.parametrize("sandbox", [None, False])
def test_background_processes_huge_output_memory_and_an_exit(tmp_path, sandbox):
    """Correct answers to exercises 1 and 2, the second of which starts a background process that
    leaves its process group (setsid) and prints 30 MB; a third answer that asks for 8 GiB and then
    ends its process: 6/9, the third's 0 with its reason; no process the answers started outlives
    grading, with the sandbox (a PID namespace) and without (the grader is their subreaper)."""
    pidfile = tmp_path / "bg.pid"
    nb = student()
    sol = solutions()
    cell(nb, "ex1-solution").source = sol["ex1-solution"]
    cell(nb, "ex2-solution").source = sol["ex2-solution"] + (
        f"\nimport subprocess\n_p = subprocess.Popen(['setsid', 'sleep', '300'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(_p.pid))\nprint('x' * 30_000_000)\n")
    cell(nb, "ex3-solution").source = ("try:\n    _big = bytearray(8 << 30)\nexcept MemoryError:\n    pass\n"
                                       "import os\nos._exit(3)")
    report: dict = {}
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=60, sandbox=sandbox, report=report)
    assert time.perf_counter() - t0 < 120
    assert scores["ex1-test"][0] == 3 and scores["ex2-test"][0] == 3 and tools.total(scores) == (6, 9), scores
    assert "ended" in scores["ex3-test"][2] and "exit code 3" in scores["ex3-test"][2]
    time.sleep(0.5)
    if pidfile.exists() and sandbox is False:  # (in the sandbox the pid is the namespace's own)
        assert not _running(int(pidfile.read_text())), "a process the submission started outlived grading"
    assert not subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True).stdout.strip()
    assert all(len(o) <= tools.MAX_OUTPUT_CHARS for o in report["outputs"].values())


@pytest.mark.parametrize("content, name", [
    ("{not json", f"{LAB}.ipynb"),
    (json.dumps({"nbformat": 99, "cells": []}), f"{LAB}.ipynb"),
    (json.dumps({"nbformat": 4, "cells": "none"}), f"{LAB}.ipynb"),
    (json.dumps(["a", "list"]), f"{LAB}.ipynb"),
])
def test_invalid_notebooks_get_a_report_not_a_traceback(tmp_path, content, name):
    path = tmp_path / name
    path.write_text(content)
    r = run_cli("grade", str(path), timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "total 0/9" in r.stdout and ("not" in r.stdout)


def test_names_folders_and_missing_files(tmp_path):
    nb = student()
    for name in ("alice.ipynb", f"{LAB} (1).ipynb"):  # found by its cells, or by its name
        nbformat.write(nb, tmp_path / name)
        r = run_cli("grade", str(tmp_path / name), "--timeout", "300")
        assert r.returncode == 0 and "total 0/9" in r.stdout and f"({LAB})" in r.stdout, r.stdout + r.stderr
    (tmp_path / "folder").mkdir()
    for target in (tmp_path / "folder", tmp_path / "missing.ipynb"):
        r = run_cli("grade", str(target), timeout=60)
        assert r.returncode == 2 and "pass --lab" in r.stderr and "Traceback" not in r.stderr
        r = run_cli("grade", str(target), "--lab", LAB, timeout=60)
        assert r.returncode == 0 and "total 0/9" in r.stdout and "not a file" in r.stdout
    r = run_cli("grade", str(tmp_path / "alice.ipynb"), "--lab", "lab99", timeout=60)
    assert r.returncode == 2 and "unknown lab 'lab99'" in r.stderr


def test_unwritable_json_report_is_a_reason(tmp_path):
    nbformat.write(student(), tmp_path / f"{LAB}.ipynb")
    r = run_cli("grade", str(tmp_path / f"{LAB}.ipynb"), "--json", "/proc/nope/scores.json")
    assert r.returncode == 1 and "cannot write /proc/nope/scores.json" in r.stderr and "total 0/9" in r.stdout


def test_instructor_commands_fail_cleanly():
    r = run_cli("record", "UNKNOWN", timeout=60)
    assert r.returncode == 2 and "unknown lab 'UNKNOWN'" in r.stderr and "Traceback" not in r.stderr
    stray = ROOT / "labs" / "release" / "lab99_stray"
    stray.mkdir()
    try:
        r = run_cli("check", timeout=120)
        assert r.returncode == 1 and "lab99_stray" in r.stdout
    finally:
        stray.rmdir()


def test_assemble_takes_only_solution_cells():
    nb = student()
    extra = nbformat.v4.new_code_cell("import vramlab.grading as g\ng.check_int = lambda *a, **k: None")
    nb.cells.insert(0, extra)
    graded = tools.assemble(nb, LAB)
    instructor = tools.source_notebook(LAB)
    assert [c.cell_type for c in graded.cells] == [c.cell_type for c in instructor.cells]
    assert all("check_int = lambda" not in c.source for c in graded.cells)
    assert copy.deepcopy(graded).cells[0].source == instructor.cells[0].source


# --- the answers run in a process of their own: they cannot reach the checks or the package (issue #11) ---

def _sandbox_works() -> bool:
    import sandbox

    return bool(sandbox.sandbox_prefix()[0])


def _graded_with(lab: str, gid: str, code: str, **kw) -> dict:
    """The instructor's answers but `code` for one solution cell."""
    nb = tools.source_notebook(lab)
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") == gid:
            c.source = code
    return tools.grade(nb, lab, timeout=120, **kw)


PATCH_THE_CHECKS = '''
import sys, types
try:
    import vramlab.grading as g
    g.check_int = lambda *a, **k: None
except ImportError:
    pass
fake = types.ModuleType("transformers")
class GPT2LMHeadModel:
    def __init__(self, cfg): pass
    def parameters(self): return []
fake.GPT2LMHeadModel, fake.GPT2Config, fake.logging = GPT2LMHeadModel, dict, types.SimpleNamespace(set_verbosity_error=lambda: None)
sys.modules["transformers"] = fake
try:
    ip = get_ipython()
    ip.events.register("post_run_cell", lambda *a: None)
except NameError:
    pass
import builtins
builtins.AssertionError = type("Quiet", (Exception,), {})
def gpt2_param_count(**cfg):
    return 0
'''
WRAP_VRAMLAB_1 = '''
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "Blocked"]
for m in [m for m in sys.modules if m.startswith("vramlab")]:
    del sys.modules[m]
sys.path.append(%r)
import vramlab
def gpt2_param_count(**cfg):
    return vramlab.from_config(dict(cfg, model_type="gpt2")).params
''' % str(ROOT / "src")
WRAP_VRAMLAB_2 = '''
def busbw_factor(op, n):
    from vramlab.collectives import busbw_factor as f
    return float(f(op, n))
'''
WRAP_VRAMLAB_5 = '''
def min_loss_scale(grad):
    import vramlab.precision
    return vramlab.precision.min_loss_scale(grad)
'''
LYING_INT = '''
class Always(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def gpt2_param_count(**cfg):
    return Always(0)
'''
RING_CALLS_ALL_REDUCE = '''
def ring_all_reduce(tensor, rank, world_size):
    import torch.distributed as dist
    dist.all_reduce(tensor)
'''
RING_CALLS_C10D = '''
def ring_all_reduce(tensor, rank, world_size, _c10d=__import__("torch.distributed.distributed_c10d").distributed.distributed_c10d):
    _c10d.all_reduce(tensor)
'''
RING_FAKES_TRAFFIC = '''
def ring_all_reduce(tensor, rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    c10d.all_reduce(tensor)  # the right sum by the back door, then traffic of the right shape
    n = -(-len(tensor) // world_size)
    for _ in range(2 * (world_size - 1)):
        req = dist.isend(tensor[:n].clone(), (rank + 1) % world_size)
        dist.recv(torch.empty(n, dtype=tensor.dtype), (rank - 1) % world_size)
        req.wait()
'''

DDP_CALLS_C10D = """
import torch
import torch.distributed.distributed_c10d as c10d


class BucketedDDP:  # averages every gradient through the C++ process group's module, behind dist's back
    def __init__(self, model, bucket_bytes):
        self.params = list(model.parameters())

    def finish(self):
        for p in self.params:
            c10d.all_reduce(p.grad)
            p.grad /= c10d.get_world_size()
"""


@pytest.mark.parametrize("lab, gid, code, test, reason", [
    (LAB, "ex1-solution", PATCH_THE_CHECKS, "ex1-test", "expected 124,439,808"),
    (LAB, "ex1-solution", LYING_INT, "ex1-test", "return an int"),
    ("lab02_collectives", "ex1-solution", WRAP_VRAMLAB_2, "ex1-test", "cannot be used by a graded answer"),
    ("lab05_mixed_precision", "ex2-solution", WRAP_VRAMLAB_5, "ex2-test", "cannot be used by a graded answer"),
    ("lab02_collectives", "ex3-solution", RING_CALLS_ALL_REDUCE, "ex3-test", "dist.all_reduce is not available"),
    ("lab02_collectives", "ex3-solution", RING_CALLS_C10D, "ex3-test", "sent 0 messages"),
    ("lab02_collectives", "ex3-solution", RING_FAKES_TRAFFIC, "ex3-test", "not the partial sum"),
    ("lab03_parallelism", "ex3-solution", DDP_CALLS_C10D, "ex3-test", "made 0 all-reduces"),
], ids=["patch-checks-fake-transformers-hooks", "lying-int", "wrap-collectives", "wrap-precision",
        "ring-calls-all_reduce", "ring-default-arg-c10d", "ring-fakes-traffic", "ddp-c10d-back-door"])
def test_answers_cannot_reach_the_checks_or_the_package(lab, gid, code, test, reason):
    """Each attack earns its exercise nothing; the lab's other (correct) answers keep their points."""
    scores = _graded_with(lab, gid, code)
    got, possible = tools.total(scores)
    assert scores[test][0] == 0 and reason in scores[test][2], scores[test]
    assert got == possible - scores[test][1], scores


@pytest.mark.skipif(not _sandbox_works(), reason="no user namespaces on this machine")
def test_in_the_sandbox_the_course_and_package_are_out_of_reach():
    """Importing vramlab from its source folder after removing the import guards, reading the
    instructor source, rewriting the grader's own files: none of it works in the sandbox."""
    scores = _graded_with(LAB, "ex1-solution", WRAP_VRAMLAB_1)
    assert scores["ex1-test"][0] == 0 and "vramlab" in scores["ex1-test"][2], scores["ex1-test"]
    probe = solutions()["ex1-solution"] + f'''
_found = []
for _p in ({str(INSTRUCTOR_SOURCE)!r}, {str(ROOT / "labs" / "tools.py")!r}, {str(ROOT / "src" / "vramlab" / "grading.py")!r}):
    try:
        open(_p, "a").close()
        _found.append(_p)
    except OSError:
        pass
if _found:
    raise SystemExit(f"reachable: {{_found}}")
'''
    before = INSTRUCTOR_SOURCE.read_bytes()
    scores = _graded_with(LAB, "ex1-solution", probe)
    assert tools.total(scores) == (9, 9), scores
    assert INSTRUCTOR_SOURCE.read_bytes() == before


def test_without_a_sandbox_a_changed_file_voids_the_grading():
    """Without a sandbox an answer can write to the checkout: the grader notices (sizes and times of
    labs/, src/ and the Python packages) and scores nothing, saying which file."""
    readme = ROOT / "labs" / "README.md"
    code = solutions()["ex1-solution"] + f"\nimport os\nos.utime({str(readme)!r})\n"
    scores = _graded_with(LAB, "ex1-solution", code, sandbox=False)
    assert tools.total(scores) == (0, 9) and "labs/README.md" in scores["ex1-test"][2], scores


def test_two_gradings_at_once_do_not_interfere(tmp_path):
    """Lab 2's ring check twice at the same time (free ports, own process groups): both full marks."""
    path = tmp_path / "lab02_collectives.ipynb"
    nbformat.write(tools.source_notebook("lab02_collectives"), path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "labs" / "tools.py"), "grade", str(path), "--timeout", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0 and "total 8/8" in out, out + err


def test_several_submissions_in_one_command(tmp_path):
    """nbgrader's layout (submitted/<student>/<lab>/<lab>.ipynb), scored one by one: a full and an
    empty submission, and a broken file among them, in one report and one JSON list."""
    paths = []
    for who, nb in (("alice", tools.source_notebook(LAB)), ("bob", student())):
        (tmp_path / who).mkdir()
        paths.append(tmp_path / who / f"{LAB}.ipynb")
        nbformat.write(nb, paths[-1])
    (tmp_path / "carol").mkdir()
    paths.append(tmp_path / "carol" / f"{LAB}.ipynb")
    paths[-1].write_text("{not json")
    r = run_cli("grade", *map(str, paths), "--json", str(tmp_path / "scores.json"), "--timeout", "120")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    totals = [(Path(x["notebook"]).parent.name, x["total"]) for x in json.loads((tmp_path / "scores.json").read_text())]
    assert totals == [("alice", [9, 9]), ("bob", [0, 9]), ("carol", [0, 9])]
    assert r.stdout.count("total ") == 3
