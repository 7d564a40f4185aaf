"""The grader against a hostile student and a careless instructor: each attack scores
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

pytestmark = pytest.mark.slow  # notebooks, processes, a browser or a book build

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tools", ROOT / "labs" / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)
LAB = "lab01_where_memory_goes"
HANG = 600  # seconds: grading that has not returned by then hangs (the limits under test are 5-120 s)
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


def run_cli(*args, timeout=300, env=None):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {})}
    if args[:1] == ("grade",) and not _sandbox_works() and "--no-sandbox" not in args:
        args = (*args, "--no-sandbox")  # (the command refuses to grade without a sandbox otherwise)
    return subprocess.run([sys.executable, str(ROOT / "labs" / "tools.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_structure_attacks_score_the_honest_score():
    """Correct answers (one of them warning on stderr), with every test tampered with: turned into
    markdown, renamed to a bonus-free `pass`, deleted, plus a forged 100-point cell and a solution that
    tries to read and rewrite the instructor source. The honest score: 21/21, out of 21."""
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
    assert set(scores) == {"ex1-test", "ex2-test", "ex3-test", "accum-test", "alloc-test", "inplace-test", "serve-test"} and tools.total(scores) == (21, 21), scores
    # grading some test cells (as the attacks below do, to read one exercise) scores them as the whole grading does
    assert tools.grade(nb, LAB, timeout=300, only=("ex2-test", "ex3-test")) == {k: scores[k] for k in ("ex2-test", "ex3-test")}
    with pytest.raises(ValueError, match="no test cell ex9-test"):
        tools.grade(nb, LAB, only="ex9-test")


def test_stubs_with_forged_and_deleted_tests_score_zero_of_the_real_total():
    nb = student()
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "ex1-test"]
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") in ("ex2-test", "ex3-test"):
            c.metadata = {}  # metadata deleted
    scores = tools.grade(nb, LAB, timeout=300)
    assert tools.total(scores) == (0, 21), scores


def test_an_endless_solution_ends_with_a_reason():
    """An infinite loop that swallows every interrupt: the answer's process is killed at the limit,
    the tests that need it score 0 with that reason, and grading returns in seconds."""
    nb = student()
    cell(nb, "ex1-solution").source = "while True:\n    try:\n        pass\n    except BaseException:\n        pass"
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=5)
    assert time.perf_counter() - t0 < HANG  # a hang guard, not a budget
    assert tools.total(scores) == (0, 21) and "ran past the 5 s limit" in scores["ex1-test"][2], scores


@pytest.mark.parametrize("sandbox", [None, False])
def test_background_processes_huge_output_memory_and_an_exit(tmp_path, sandbox):
    """Correct answers to exercises 1 and 2, the second of which starts a background process that
    leaves its process group (setsid) and prints 30 MB; a third answer that asks for 8 GiB and then
    ends its process: 6/21, the third's 0 with its reason; no process the answers started outlives
    grading, with the sandbox (a PID namespace) and without (the grader is their subreaper)."""
    pidfile = tmp_path / "bg.pid"
    dur = f"300.{os.getpid()}{int(time.time() * 1000) % 10**6}"  # this run's own sleep: not another session's
    nb = student()
    sol = solutions()
    cell(nb, "ex1-solution").source = sol["ex1-solution"]
    cell(nb, "ex2-solution").source = sol["ex2-solution"] + (
        f"\nimport subprocess\n_p = subprocess.Popen(['setsid', 'sleep', {dur!r}])\n"
        f"open({str(pidfile)!r}, 'w').write(str(_p.pid))\nprint('x' * 30_000_000)\n")
    cell(nb, "ex3-solution").source = ("try:\n    _big = bytearray(8 << 30)\nexcept MemoryError:\n    pass\n"
                                       "import os\nos._exit(3)")
    report: dict = {}
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=120, sandbox=sandbox, report=report)
    assert time.perf_counter() - t0 < HANG  # a hang guard, not a budget
    assert scores["ex1-test"][0] == 3 and scores["ex2-test"][0] == 3 and tools.total(scores) == (6, 21), scores
    assert "ended" in scores["ex3-test"][2] and "exit code 3" in scores["ex3-test"][2]
    time.sleep(0.5)
    if pidfile.exists() and sandbox is False:  # (in the sandbox the pid is the namespace's own)
        assert not _running(int(pidfile.read_text())), "a process the submission started outlived grading"
    assert not subprocess.run(["pgrep", "-f", f"^sleep {dur}$"], capture_output=True).stdout.strip()
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
    r = run_cli("grade", str(path), timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "total 0/21" in r.stdout and ("not" in r.stdout)


def test_names_folders_and_missing_files(tmp_path):
    nb = student()
    for name in ("alice.ipynb", f"{LAB} (1).ipynb"):  # found by its cells, or by its name
        nbformat.write(nb, tmp_path / name)
        r = run_cli("grade", str(tmp_path / name), "--timeout", "300")
        assert r.returncode == 0 and "total 0/21" in r.stdout and f"({LAB})" in r.stdout, r.stdout + r.stderr
    (tmp_path / "folder").mkdir()
    for target in (tmp_path / "folder", tmp_path / "missing.ipynb"):
        r = run_cli("grade", str(target), timeout=300)
        assert r.returncode == 2 and "pass --lab" in r.stderr and "Traceback" not in r.stderr
        r = run_cli("grade", str(target), "--lab", LAB, timeout=300)
        assert r.returncode == 0 and "total 0/21" in r.stdout and "not a file" in r.stdout
    r = run_cli("grade", str(tmp_path / "alice.ipynb"), "--lab", "lab99", timeout=300)
    assert r.returncode == 2 and "unknown lab 'lab99'" in r.stderr


def test_unwritable_json_report_is_a_reason(tmp_path):
    nbformat.write(student(), tmp_path / f"{LAB}.ipynb")
    r = run_cli("grade", str(tmp_path / f"{LAB}.ipynb"), "--json", "/proc/nope/scores.json")
    assert r.returncode == 1 and "cannot write /proc/nope/scores.json" in r.stderr and "total 0/21" in r.stdout


@pytest.mark.writes_checkout  # a folder in the checkout, for as long as the check runs
def test_instructor_commands_fail_cleanly():
    r = run_cli("record", "UNKNOWN", timeout=300)
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
    extra = nbformat.v4.new_code_cell("import vramlab.grading.memory as g\ng.check_int = lambda *a, **k: None")
    nb.cells.insert(0, extra)
    graded = tools.assemble(nb, LAB)
    instructor = tools.source_notebook(LAB)
    assert [c.cell_type for c in graded.cells] == [c.cell_type for c in instructor.cells]
    assert all("check_int = lambda" not in c.source for c in graded.cells)
    assert copy.deepcopy(graded).cells[0].source == instructor.cells[0].source


# --- the answers run in a process of their own: they cannot reach the checks or the package ---

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
    import vramlab.grading.memory as g
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
    (LAB, "ex1-solution", LYING_INT, "ex1-test", "got 0, expected"),  # arrives as the int it holds
    ("lab02_collectives", "ex1-solution", WRAP_VRAMLAB_2, "ex1-test", "cannot be used by a graded answer"),
    ("lab05_mixed_precision", "ex2-solution", WRAP_VRAMLAB_5, "ex2-test", "cannot be used by a graded answer"),
    ("lab02_collectives", "ex3-solution", RING_CALLS_ALL_REDUCE, "ex3-test", "dist.all_reduce is not available"),
    ("lab02_collectives", "ex3-solution", RING_CALLS_C10D, "ex3-test", "dist.all_reduce is not available"),
    ("lab02_collectives", "ex3-solution", RING_FAKES_TRAFFIC, "ex3-test", "dist.all_reduce is not available"),
    ("lab03_parallelism", "ex3-solution", DDP_CALLS_C10D, "ex3-test", "made 6 all-reduces"),  # seen: one a parameter
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
    probe = f'''
_found = []
for _p in ({str(INSTRUCTOR_SOURCE)!r}, {str(ROOT / "labs" / "tools.py")!r}, {str(ROOT / "src" / "vramlab" / "grading" / "memory.py")!r}):
    try:
        open(_p, "a").close()
        _found.append(_p)
    except OSError:
        pass
if _found:
    raise SystemExit(f"reachable: {{_found}}")
''' + solutions()["ex1-solution"]  # (before the answer: what it finds leaves the answer undefined)
    before = INSTRUCTOR_SOURCE.read_bytes()
    scores = _graded_with(LAB, "ex1-solution", probe)
    assert tools.total(scores) == (21, 21), scores
    assert INSTRUCTOR_SOURCE.read_bytes() == before


@pytest.mark.writes_checkout
def test_without_a_sandbox_a_changed_file_voids_the_grading():
    """Without a sandbox an answer can write to the checkout: the grader notices (change times, sizes and contents of
    labs/, src/ and the Python packages) and scores nothing, saying which file."""
    readme = ROOT / "labs" / "README.md"
    code = solutions()["ex1-solution"] + f"\nimport os\nos.utime({str(readme)!r})\n"
    scores = _graded_with(LAB, "ex1-solution", code, sandbox=False)
    assert tools.total(scores) == (0, 21) and "labs/README.md" in scores["ex1-test"][2], scores


def test_two_gradings_at_once_do_not_interfere(tmp_path):
    """Lab 2's ring check twice at the same time (free ports, own process groups): both full marks."""
    path = tmp_path / "lab02_collectives.ipynb"
    nbformat.write(tools.source_notebook("lab02_collectives"), path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "labs" / "tools.py"), "grade", str(path), "--timeout", "120",
                               *([] if _sandbox_works() else ["--no-sandbox"])],
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
    assert totals == [("alice", [21, 21]), ("bob", [0, 21]), ("carol", [0, 21])]
    assert r.stdout.count("total ") == 3


def _source_solutions(lab: str) -> tuple[nbformat.NotebookNode, dict[str, str]]:
    """The lab's setup, exercises and tests (no measurement cells), and its solution cells' code."""
    nb = tools.source_notebook(lab)
    sols = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id", "").startswith(("setup", "ex"))]
    return nb, sols


def _graded(lab: str, nb, answers: dict[str, str], only=None) -> dict:
    """`nb` with `answers` for some solution cells, graded; `only`: the test cells the test reads (the others are
    not run: each test cell is graded in a process of its own, as in a whole grading)."""
    nb = copy.deepcopy(nb)
    for c in nb.cells:
        gid = c.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers:
            c.source = answers[gid]
    return tools.grade(nb, lab, timeout=300, only=only)


def test_correct_answers_in_plain_containers_score_full_marks():
    """A correct answer is a correct answer whatever plain value carries it: lab 7's
    checkpoint choice as a set, lab 6's rates and times as numpy floats (and float subclasses), a
    tuple of numpy integers. They come back to the grader as the built-in values they stand for."""
    nb7, s7 = _source_solutions("lab07_checkpointing")
    as_set = s7["ex3-solution"].replace("return None if best is None else best[1]",
                                        "return None if best is None else set(best[1])")
    assert as_set != s7["ex3-solution"]
    scores = _graded("lab07_checkpointing", nb7, {"ex3-solution": as_set}, only="ex3-test")
    assert scores["ex3-test"][0] == scores["ex3-test"][1] > 0, scores["ex3-test"]
    nb6, s6 = _source_solutions("lab06_offload")
    numpy_floats = {
        "ex1-solution": s6["ex1-solution"].replace(
            "return host.numel() * host.element_size() / statistics.median(seconds) / 1e9",
            "import numpy as np\n    return np.float64(host.numel() * host.element_size() / statistics.median(seconds) / 1e9)"),
        "ex2-solution": s6["ex2-solution"].replace(
            "return t - pass_start, device",
            "import numpy as np\n    class F(float):\n        def __eq__(self, other):\n            return True\n"
            "    return np.float32(t - pass_start).item() and F(t - pass_start), np.int64(device)"),
    }
    for gid, src in numpy_floats.items():
        assert src != s6[gid], gid
    scores = _graded("lab06_offload", nb6, numpy_floats, only=("ex1-test", "ex2-test"))
    for gid in ("ex1-test", "ex2-test"):
        assert scores[gid][0] == scores[gid][1] > 0, (gid, scores[gid])


def test_a_float_subclass_that_equals_everything_is_read_as_its_value():
    """An answer cannot win by returning an object whose __eq__ says yes: a float subclass comes back
    as its float, a list subclass as its items (read through list's own iterator)."""
    nb7, s7 = _source_solutions("lab07_checkpointing")
    liar = ("class L(list):\n    def __eq__(self, other):\n        return True\n    def __iter__(self):\n        return iter([])\n"
            "def choose_checkpoints(full, inputs, flops, outside, budget):\n    return L([0])\n")
    scores = _graded("lab07_checkpointing", nb7, {"ex3-solution": liar}, only="ex3-test")
    assert scores["ex3-test"][0] == 0, scores["ex3-test"]


def test_int8_check_computes_its_own_scales():
    """Lab 8's per-row INT8 check measured the error against the answer's own scales, so
    scales of 1e300 with every weight dequantized to 0 passed. The reference scale is now the row's
    absmax / 127, from the weights; the answer's scales, codes and dequantized values are checked
    against it (and must be finite numbers)."""
    nb8, s8 = _source_solutions("lab08_compression")
    huge = s8["ex1-solution"] + (
        "\n\n_q = quantize_rows\n\ndef quantize_rows(w):\n    q, s = _q(w)\n    return q, [1e300] * len(w)\n\n"
        "def dequantize_rows(q, scales):\n    return [[0.0] * len(r) for r in q]\n")
    nan = s8["ex1-solution"] + "\n\ndef dequantize_rows(q, scales):\n    return [[float('nan')] * len(r) for r in q]\n"
    for attack in (huge, nan):
        scores = _graded("lab08_compression", nb8, {"ex1-solution": attack}, only="ex1-test")
        assert scores["ex1-test"][0] == 0, scores["ex1-test"]
    honest = _graded("lab08_compression", nb8, {}, only="ex1-test")
    assert honest["ex1-test"][0] == honest["ex1-test"][1] > 0


ZERO1_FULL_STATES = {
    "an AdamW object in state": 'def zero1_adamw_step(params, grads, state, rank, world_size, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):\n    import torch\n    import torch.distributed as dist\n    g = grads.clone()\n    dist.all_reduce(g)\n    g /= world_size\n    if not state:\n        state["p"] = torch.nn.Parameter(params.clone())\n        state["opt"] = torch.optim.AdamW([state["p"]], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)\n    state["p"].grad = g\n    state["opt"].step()\n    out = torch.empty(params.numel() * world_size, dtype=params.dtype)\n    dist.all_gather_into_tensor(out, state["p"].detach())\n    params.copy_(state["p"].detach())\n',
    "moments as Python lists in a default argument": '\ndef zero1_adamw_step(params, grads, state, rank, world_size, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, _M={}):\n    import torch, math\n    import torch.distributed as dist\n    g = grads.clone()\n    dist.all_reduce(g)\n    g /= world_size\n    g = g.tolist()\n    if "m" not in _M:\n        _M.update(m=[0.0] * len(g), v=[0.0] * len(g), t=0)\n    _M["t"] += 1\n    t = _M["t"]\n    p = params.tolist()\n    for i in range(len(g)):\n        _M["m"][i] = betas[0] * _M["m"][i] + (1 - betas[0]) * g[i]\n        _M["v"][i] = betas[1] * _M["v"][i] + (1 - betas[1]) * g[i] ** 2\n        p[i] = p[i] * (1 - lr * weight_decay) - lr * (_M["m"][i] / (1 - betas[0] ** t)) / (math.sqrt(_M["v"][i] / (1 - betas[1] ** t)) + eps)\n    new = torch.tensor(p, dtype=params.dtype)\n    dist.all_gather_into_tensor(torch.empty(params.numel() * world_size, dtype=params.dtype), new)\n    params.copy_(new)\n',
    "moments as array.array": '\ndef zero1_adamw_step(params, grads, state, rank, world_size, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, _M={}):\n    import torch, math\n    import torch.distributed as dist\n    g = grads.clone()\n    dist.all_reduce(g)\n    g /= world_size\n    g = g.tolist()\n    if "m" not in _M:\n        import array\n        _M.update(m=array.array("d", [0.0] * len(g)), v=array.array("d", [0.0] * len(g)), t=0)\n    _M["t"] += 1\n    t = _M["t"]\n    p = params.tolist()\n    for i in range(len(g)):\n        _M["m"][i] = betas[0] * _M["m"][i] + (1 - betas[0]) * g[i]\n        _M["v"][i] = betas[1] * _M["v"][i] + (1 - betas[1]) * g[i] ** 2\n        p[i] = p[i] * (1 - lr * weight_decay) - lr * (_M["m"][i] / (1 - betas[0] ** t)) / (math.sqrt(_M["v"][i] / (1 - betas[1] ** t)) + eps)\n    new = torch.tensor(p, dtype=params.dtype)\n    dist.all_gather_into_tensor(torch.empty(params.numel() * world_size, dtype=params.dtype), new)\n    params.copy_(new)\n',
}


def test_zero1_counts_state_however_it_is_kept():
    """Lab 4's ZeRO-1 check counted optimizer state only as tensors inside the state dict's
    dicts, lists and tuples: a torch.optim.AdamW kept in `state`, or full moments as Python lists (in
    a default argument) or array.arrays, passed as sharded. The rank now counts every number it holds
    after its steps (live tensors' storages, lists of floats, arrays, wherever kept) beyond what it
    held before the answer's code ran. Each computes the right parameters and loses the points; the
    instructor's answer keeps its full marks."""
    nb4, _ = _source_solutions("lab04_zero")
    honest = _graded("lab04_zero", nb4, {}, only="ex1-test")
    assert honest["ex1-test"][0] == honest["ex1-test"][1] > 0, honest["ex1-test"]
    for what, code in ZERO1_FULL_STATES.items():
        got = _graded("lab04_zero", nb4, {"ex1-solution": code}, only="ex1-test")["ex1-test"]
        assert got[0] == 0 and "optimizer-state values" in got[2], (what, got)


RING_WITHOUT_TRAFFIC = {
    "the old harness's data, a forged log": '''def ring_all_reduce(tensor, rank, world_size):
    import torch
    n, w = tensor.numel(), world_size
    log = globals().get("_LOG", [])  # (the log is no longer the rank's: this forges nothing)
    chunks = torch.tensor_split(torch.arange(n), w)
    for step in range(2 * (w - 1)):  # forge a ring's traffic: partial sums of the old deterministic data
        ranks = [(rank - j) % w for j in range(min(step, w - 1) + 1)] if step < w - 1 else range(w)
        idx = chunks[(rank - step) % w]
        log.append([(rank + 1) % w, [float(i * sum(r + 1 for r in ranks) + sum(ranks)) for i in idx.tolist()]])
    return torch.arange(n, dtype=torch.float64) * w * (w + 1) / 2 + w * (w - 1) / 2
''',
    "the other ranks' dealt files": '''def ring_all_reduce(tensor, rank, world_size):
    import glob, json, torch
    total = tensor.clone()
    for path in glob.glob("**/*secret*", recursive=True) + glob.glob("/tmp/**/*secret*", recursive=True):
        try:
            total += torch.tensor(json.load(open(path)), dtype=torch.float64)
        except Exception:
            pass
    return total
''',
}


def test_ranks_hold_data_no_other_rank_can_know():
    """Lab 2's harness gave every rank data any rank could compute (x_r[i] = i(r+1) + r) and
    kept its traffic log where the answer's code runs, so an answer that forged the log and returned
    the formula's sum scored full marks without communicating. Each rank is now dealt random numbers
    by the grader, read and deleted before any of the answer's code runs (which runs only in the
    ranks): the sum can only come from the other ranks. Both routes (the formula with a forged log,
    reading the dealt files) lose the points; the instructor's ring keeps them."""
    nb2, _ = _source_solutions("lab02_collectives")
    honest = _graded("lab02_collectives", nb2, {}, only="ex3-test")
    ring_test = "ex3-test"
    assert honest[ring_test][0] == honest[ring_test][1] > 0, honest
    for what, code in RING_WITHOUT_TRAFFIC.items():
        got = _graded("lab02_collectives", nb2, {"ex3-solution": code}, only=ring_test)[ring_test]
        assert got[0] == 0 and "wrong result" in got[2], (what, got)


TP_WITHOUT_TRAFFIC = '''class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        globals()["_LOG"].append({"call": "all_reduce", "phase": "f backward", "async": False, "op": "ReduceOp.SUM",
                                  "shape": list(grad.shape), "values": grad.flatten().tolist()})
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        globals()["_LOG"].append({"call": "all_reduce", "phase": "g forward", "async": False, "op": "ReduceOp.SUM",
                                  "shape": list(partial.shape), "values": partial.flatten().tolist()})
        return partial.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_mlp(x, w1_shard, w2_shard):
    b, s, h = x.shape
    f = w1_shard.shape[1] * torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1234 + 7 * b + 5 * s + 3 * h + f)  # the old harness's weights
    _, w1, w2, _ = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((b, s, h), (h, f), (f, h), (b, s, h)))
    for phase in ("mlp forward", "mlp backward"):
        globals()["_LOG"].append({"call": "all_reduce", "phase": phase, "async": False, "op": "ReduceOp.SUM",
                                  "shape": [b, s, h], "values": [0.0] * (b * s * h)})
    return torch.nn.functional.gelu(x @ w1) @ w2
'''


def test_tensor_parallel_ranks_cannot_compute_the_whole_mlp_alone():
    """Lab 3's ranks could rebuild the whole MLP from the harness's fixed seed and forge
    the traffic log: 9/9 with no communication. Each rank now holds only its own shards, drawn afresh
    by the grader for every grading."""
    nb3, _ = _source_solutions("lab03_parallelism")
    honest = _graded("lab03_parallelism", nb3, {}, only="ex2-test")
    assert honest["ex2-test"][0] == honest["ex2-test"][1] > 0, honest["ex2-test"]
    got = _graded("lab03_parallelism", nb3, {"ex2-solution": "import torch\nimport torch.distributed as dist\n\n\n" + TP_WITHOUT_TRAFFIC},
                  only="ex2-test")
    assert got["ex2-test"][0] == 0, got["ex2-test"]


ZERO1_WITHOUT_REDUCTION = '''def zero1_adamw_step(params, grads, state, rank, world_size, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.01):
    import torch
    import torch.distributed as dist
    n = params.numel() // world_size
    if not state:
        state.update(step=0, m=torch.zeros(n, dtype=params.dtype), v=torch.zeros(n, dtype=params.dtype))
    k = state["step"]
    # every rank's gradients from the old harness's seeds: the average without a reduce-scatter
    g = torch.stack([torch.randn(params.numel(), generator=torch.Generator().manual_seed(1000 * r + k),
                                 dtype=torch.float64) for r in range(world_size)]).mean(0)[rank * n:(rank + 1) * n]
    state["step"] += 1
    t, m, v = state["step"], state["m"], state["v"]
    shard = params[rank * n:(rank + 1) * n].clone()
    shard.mul_(1 - lr * weight_decay)
    m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    shard.addcdiv_(m / (1 - betas[0] ** t), (v / (1 - betas[1] ** t)).sqrt().add_(eps), value=-lr)
    dist.all_gather_into_tensor(params, shard)
'''


def test_zero1_ranks_cannot_average_gradients_they_were_not_given():
    """Lab 4's gradients came from seeds any rank could reproduce (1000 rank + step), so an
    answer could average every rank's gradients without a reduce-scatter. Each rank is now dealt
    only its own gradients, drawn afresh for every grading (so are the batches of lab 3's DDP and
    lab 4's ZeRO-2)."""
    nb4, _ = _source_solutions("lab04_zero")
    got = _graded("lab04_zero", nb4, {"ex1-solution": ZERO1_WITHOUT_REDUCTION}, only="ex1-test")["ex1-test"]
    assert got[0] == 0 and "differ from one process's AdamW" in got[2], got


def test_ranks_get_the_workers_limits_and_the_graders_timeout(monkeypatch):
    """Labs 2-4's ranks ran without the answer worker's limits, their output was read whole
    into the grader's memory, and their 60 s ignored --timeout. A ring that prints without end now
    fills at most a 64 MiB file of which the grader reads the tail (the exercise scores 0 with a
    reason, the grader lives; no wall-clock bound is asserted), and a correct ring slower than the check's own
    limit scores full marks under a longer --timeout. (The check's own 60 s is lowered to 6 here, so that the slow ring
    sleeps 9 s rather than 62: the rule, the longer of the two, is the same.)"""
    from vramlab.grading import collectives

    monkeypatch.setitem(collectives.check_ring_all_reduce.__kwdefaults__, "timeout", 6.0)
    nb2, sols = _source_solutions("lab02_collectives")
    ring = sols["ex3-solution"]
    loud = ring.replace("def ring_all_reduce(tensor, rank, world_size):",
                        "def ring_all_reduce(tensor, rank, world_size):\n    import sys\n"
                        "    while True:\n        sys.stdout.write('x' * (1 << 20))\n", 1)
    assert loud != ring
    got = _graded("lab02_collectives", nb2, {"ex3-solution": loud}, only="ex3-test")["ex3-test"]
    assert got[0] == 0 and got[2], got  # no points, a reason, and the grader went on
    slow = ring.replace("def ring_all_reduce(tensor, rank, world_size):",
                        "def ring_all_reduce(tensor, rank, world_size):\n    import time\n"
                        "    if tensor.numel() == 8:\n        time.sleep(9)\n", 1)
    nb = copy.deepcopy(nb2)
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") == "ex3-solution":
            c.source = slow
    scores = tools.grade(nb, "lab02_collectives", timeout=30, only="ex3-test")
    assert scores["ex3-test"][0] == scores["ex3-test"][1] > 0, scores["ex3-test"]
    scores = tools.grade(nb, "lab02_collectives", timeout=5, only="ex3-test")  # a shorter --timeout: the check's own 6 s holds
    assert scores["ex3-test"][0] == 0 and "no answer within 6 s" in scores["ex3-test"][2], scores["ex3-test"]


@pytest.mark.writes_checkout  # a probe file in labs/ and in the packages
def test_without_a_sandbox_same_size_writes_with_the_mtime_restored_are_seen():
    """The (size, mtime) fingerprint was dodged by writing as many bytes and restoring the
    mtime. The course's files are now compared by content, the packages' by inode and change time
    (which a process cannot set back)."""
    import sysconfig

    targets = [ROOT / "labs" / "_fingerprint_probe.txt", Path(sysconfig.get_paths()["purelib"]) / "_fingerprint_probe.txt"]
    try:
        for t in targets:
            t.write_text("honest")
        for t in targets:
            code = solutions()["ex1-solution"] + (
                f"\nimport os\n_st = os.stat({str(t)!r})\nopen({str(t)!r}, 'w').write('forged')\n"
                f"os.utime({str(t)!r}, ns=(_st.st_atime_ns, _st.st_mtime_ns))\n")
            # (one test cell: that a changed file voids the whole grading is the test above's)
            scores = _graded_with(LAB, "ex1-solution", code, sandbox=False, only="ex1-test")
            assert scores["ex1-test"][0] == 0 and "_fingerprint_probe.txt" in scores["ex1-test"][2], (t, scores)
            t.write_text("honest")
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


KILL_PARENT = "\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"


@pytest.mark.parametrize("sandbox", [None, False])
def test_an_answer_that_kills_its_parent_does_not_kill_the_grader(tmp_path, sandbox):
    """Without a sandbox, `os.kill(os.getppid(), SIGKILL)` in an answer killed the grader
    (no score, a batch lost): the answer's process and the ranks' harness were the grader's children.
    A go-between process is now their parent. Lab 6's last answer (its streaming loop, run by the
    check in a process of its own) kills its parent: the grader lives and the earlier exercises keep
    their points."""
    nb = tools.source_notebook("lab06_offload")
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") == "stream-solution":
            c.source += KILL_PARENT
    path = tmp_path / "lab06_offload.ipynb"
    nbformat.write(nb, path)
    code = ("import json, sys, nbformat; sys.path.insert(0, sys.argv[1]); import tools; "
            "s = tools.grade(nbformat.read(sys.argv[2], as_version=4), 'lab06_offload', timeout=120, "
            f"sandbox={sandbox!r}); print(json.dumps(s))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "labs"), str(path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    scores = json.loads(r.stdout.strip().splitlines()[-1])
    # the killing exercise: 0 with a reason, or its points where its loop had already run (the go-between
    # it killed is all it ended); either way the grader is alive and the exercises above keep theirs
    assert scores["stream-test"][0] == 0 and scores["stream-test"][2] or scores["stream-test"][0] == 3, scores
    assert all(v[0] == v[1] > 0 for k, v in scores.items() if k != "stream-test"), scores


# --- the sandbox holds nothing but what grading needs ---

SANDBOX_PROBE = '''
import ctypes, glob, json, os, socket, subprocess, sys
_found = []
for _p in {reads!r}:
    try:
        with open(_p, "rb") as _f:
            _f.read(1)
        _found.append("read " + _p)
    except OSError:
        pass
try:
    if subprocess.run(["git", "--git-dir", {git!r}, "show", "HEAD:" + {instructor!r}], capture_output=True).returncode == 0:
        _found.append("git show")
except OSError:
    pass
for _d in glob.glob(sys.prefix + "/lib/python*/site-packages/vramlab*.dist-info/direct_url.json"):
    try:
        _url = json.load(open(_d)).get("url", "")
        if _url.startswith("file://") and os.path.exists(_url[7:] + "/src/vramlab/grading/run.py"):
            _found.append("the editable source through " + _d)
    except (OSError, ValueError):
        pass
try:
    _extra = sorted(set(os.listdir({root!r})) - set({allowed!r}))
    if _extra:
        _found.append("the checkout: " + ", ".join(_extra))
except OSError:
    pass
for _p in {writes!r}:
    try:
        open(_p, "a").close()
        _found.append("wrote " + _p)
    except OSError:
        pass
if os.getuid() != 65534:
    _found.append(f"uid {{os.getuid()}}")
_caps = [l for l in open("/proc/self/status") if l.startswith("CapEff")]
if not _caps or int(_caps[0].split()[1], 16):
    _found.append("capabilities " + "".join(_caps).strip())
for _pid in [d for d in os.listdir("/proc") if d.isdigit()]:
    try:
        if b"pytest" in open(f"/proc/{{_pid}}/cmdline", "rb").read():
            _found.append("the grader's process " + _pid)
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    _found.append("the host's network")
except OSError:
    pass
_libc = ctypes.CDLL(None, use_errno=True)  # a process that can mount can also undo the sandbox's mounts
os.makedirs("mount-probe", exist_ok=True)
if _libc.mount(b"none", b"mount-probe", b"tmpfs", 0, None) == 0:
    _libc.umount2(b"mount-probe", 2)
    _found.append("mounts")
if _found:
    raise SystemExit("reachable: " + "; ".join(_found))
'''


@pytest.mark.skipif(not _sandbox_works(), reason="no user namespaces on this machine")
def test_the_sandbox_holds_nothing_but_what_grading_needs(tmp_path):
    """The answer's process sees a filesystem of its own: the checkout's .git (git show
    HEAD:labs/source/...), its labs/ and src/, the editable install's source path, another checkout on
    the machine, the grader's home: none exists there. It runs as uid 65534 without capabilities
    (it cannot undo the sandbox's mounts), with its own /proc (not the grader's command line) and no
    network (not the host's 127.0.0.1); it can write nowhere but its scratch
    directory (not /tmp, /etc, the Python installation or a sitecustomize.py on the grader's path)."""
    import socket

    import sandbox

    other = tmp_path / "other-checkout" / "labs" / "source"
    other.mkdir(parents=True)
    (other / "answers.md").write_text("the answers")
    site = next(p for p in sys.path if p.endswith("-packages"))
    staged = [p.resolve() for p in sandbox.staged_paths()]
    allowed = sorted({p.relative_to(ROOT).parts[0] for p in staged if ROOT in p.parents})
    writes = [str(tmp_path / "written"), "/tmp/vramlab-sandbox-probe", "/etc/vramlab-sandbox-probe",
              str(Path(site) / "sitecustomize.py"), str(Path(sys.prefix) / "vramlab-sandbox-probe"),
              str(ROOT / "src" / "vramlab-sandbox-probe"), "/vramlab-sandbox-probe"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        probe = SANDBOX_PROBE.format(
            reads=[str(ROOT / ".git" / "HEAD"), str(INSTRUCTOR_SOURCE), str(ROOT / "src" / "vramlab" / "grading" / "memory.py"),
                   str(ROOT / "labs" / "tools.py"), str(other / "answers.md"), str(Path.home() / ".bashrc")],
            git=str(ROOT / ".git"), instructor=f"labs/source/{LAB}/{LAB}.md", root=str(ROOT), allowed=allowed,
            writes=writes, port=listener.getsockname()[1]) + solutions()["ex1-solution"]  # (found: no answer)
        scores = _graded_with(LAB, "ex1-solution", probe, sandbox=True)
    finally:
        listener.close()
    assert tools.total(scores) == (21, 21), scores["ex1-test"]
    assert not [w for w in writes if Path(w).exists()]


STARTER_PROBE = '''
import ctypes, os, signal, subprocess, time
_found = []
_left = os.path.join(os.path.dirname(os.getcwd()), "leftover.pids")  # (the grading's folder, beside this cell's)
_cell = os.path.basename(os.getcwd())  # test-N: an answer's process (a check's program runs elsewhere, beside it)
if os.path.exists(_left) and _cell.startswith("test-"):
    for _entry in open(_left).read().split():
        _by, _pid = _entry.split(":")
        if _by != _cell and os.path.exists(f"/proc/{_pid}"):
            _found.append("a process an earlier test cell started: " + _pid)
if not globals().get("_started") and _cell.startswith("test-"):
    _started = subprocess.Popen(["setsid", "sleep", "300"])
    with open(_left, "a") as _f:
        _f.write(f"{_cell}:{_started.pid} ")
for _sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(1, _sig)
    except OSError:
        pass
time.sleep(0.2)
try:
    with open("/proc/1/mem", "rb") as _f:
        _found.append("the starter's memory")
except OSError:
    pass
_libc = ctypes.CDLL(None, use_errno=True)
if _libc.ptrace(16, 1, None, None) == 0:  # PTRACE_ATTACH
    _libc.ptrace(17, 1, None, None)
    _found.append("traced the starter")
_fds = sorted(int(_d) for _d in os.listdir("/proc/self/fd"))
if [_d for _d in _fds if _d > 4 and os.path.exists(f"/proc/self/fd/{_d}") and
        not os.readlink(f"/proc/self/fd/{_d}").startswith("/proc")]:
    _found.append(f"descriptors {_fds}")
if _found:
    raise SystemExit("reachable: " + "; ".join(_found))
'''


@pytest.mark.skipif(not _sandbox_works(), reason="no user namespaces on this machine")
def test_the_process_starter_is_out_of_an_answers_reach():
    """In the sandbox every test cell's process is forked from one starter that imported torch once
    (vramlab.grading.starter). An answer that signals it, traces it or reads its memory reaches nothing, holds
    no descriptor but its own, and a background process it starts (setsid) is gone before the next
    test cell's process runs: full marks, every test cell's process forked."""
    nb = tools.source_notebook(LAB)
    for c in nb.cells:  # (before every answer: what it finds leaves that answer undefined)
        if c.metadata.get("nbgrader", {}).get("solution"):
            c.source = STARTER_PROBE + c.source
    report: dict = {}
    scores = tools.grade(nb, LAB, timeout=120, sandbox=True, report=report)
    assert tools.total(scores) == (21, 21), scores
    assert report["forked"] == list(scores), report["forked"]


def test_the_grader_does_not_follow_links_an_answer_leaves(tmp_path):
    """An answer that replaces its output file with a link to a file only the grader can
    read, then ends its process: the grader reads its own descriptor, and the reason it reports
    holds the answer's last output, never the linked file."""
    secret = tmp_path / "grader-only.txt"
    secret.write_text("GRADER-ONLY-" + "x" * 20)
    secret.chmod(0o600)
    code = solutions()["ex1-solution"] + (
        f"\nimport os\nprint('last words', flush=True)\nos.remove('answer-output.txt')\n"
        f"os.symlink({str(secret)!r}, 'answer-output.txt')\nos._exit(3)\n")
    scores = _graded_with(LAB, "ex1-solution", code, only="ex1-test")
    assert scores["ex1-test"][0] == 0 and "exit code 3" in scores["ex1-test"][2], scores["ex1-test"]
    assert "GRADER-ONLY" not in json.dumps(scores) and "last words" in scores["ex1-test"][2]


def test_the_grader_reads_rank_reports_only_as_regular_files(tmp_path):
    """A report a rank could have replaced is read without following a link (to a file only
    the grader may read), without blocking on a FIFO and without reading more than its bound."""
    from vramlab.grading.run import read_regular

    secret = tmp_path / "secret"
    secret.write_text('{"grader": "only"}')
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"1" * 1001)
    (tmp_path / "ok").write_text("[1]")
    for name in ("link", "fifo"):
        with pytest.raises(OSError):
            read_regular(str(tmp_path / name), 1000)
    with pytest.raises(ValueError):
        read_regular(str(tmp_path / "big"), 1000)
    assert read_regular(str(tmp_path / "ok"), 1000) == b"[1]"


RING_THROUGH_ANOTHER_CHANNEL = '''
import json, os, socket, time
import torch
import torch.distributed as dist


def _share(rank, world_size, mine):
    """Every rank's numbers, through shared files or the loopback network, behind the check's back."""
    places = ["..", "../..", "/tmp", "/dev/shm", os.path.expanduser("~")]
    for d in places:
        try:
            with open(f"{d}/vramlab-share-{rank}.json", "w") as fh:
                json.dump(mine, fh)
        except OSError:
            pass
    server = None
    try:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 47100 + rank))
        server.listen()
        server.settimeout(0.05)
    except OSError:
        server = None
    known, t0 = {rank: mine}, time.time()
    while len(known) < world_size and time.time() - t0 < 8:
        for r in range(world_size):
            for d in places:
                try:
                    with open(f"{d}/vramlab-share-{r}.json") as fh:
                        known[r] = json.load(fh)
                except (OSError, ValueError):
                    pass
            try:
                with socket.create_connection(("127.0.0.1", 47100 + r), timeout=0.05) as c:
                    c.sendall(json.dumps([rank, mine]).encode())
            except OSError:
                pass
        if server is not None:
            try:
                conn, _ = server.accept()
                r, values = json.loads(conn.recv(1 << 20))
                known[r] = values
            except (OSError, ValueError):
                pass
        time.sleep(0.05)
    if len(known) < world_size:
        raise RuntimeError(f"no other channel: rank {rank} learned {len(known) - 1} other ranks' numbers")
    return known


def ring_all_reduce(tensor, rank, world_size):
    known = _share(rank, world_size, tensor.tolist())
    chunks = list(torch.arange(len(tensor)).tensor_split(world_size))
    data = torch.tensor([known[r] for r in range(world_size)], dtype=tensor.dtype)
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(2 * (world_size - 1)):  # the messages a ring would send, computed from every rank's numbers
        k = (rank - step) % world_size if step < world_size - 1 else (rank + 1 - (step - world_size + 1)) % world_size
        held = [(rank - j) % world_size for j in range(min(step, world_size - 1) + 1)] if step < world_size - 1 else list(range(world_size))
        out = data[held][:, chunks[k]].sum(0)
        req = dist.isend(out, nxt)
        dist.recv(torch.empty(len(chunks[(k - 1) % world_size]), dtype=tensor.dtype), prv)
        req.wait()
    tensor.copy_(data.sum(0))
'''


@pytest.mark.skipif(not _sandbox_works(), reason="no user namespaces on this machine")
def test_in_the_sandbox_ranks_have_no_channel_but_the_check():
    """The ranks' traffic is what crossed the check's own socket; in the sandbox each rank
    has its own folder, /tmp, /dev/shm and network, so a ring that first swaps every rank's numbers
    through shared files or the loopback network (then sends the messages a ring would) learns
    nothing: it scores 0, saying so."""
    nb2, _ = _source_solutions("lab02_collectives")
    got = _graded("lab02_collectives", nb2, {"ex3-solution": RING_THROUGH_ANOTHER_CHANNEL}, only="ex3-test")["ex3-test"]
    assert got[0] == 0 and "no other channel" in got[2], got


def test_the_command_grades_without_a_sandbox_only_when_told(tmp_path):
    """Without a sandbox an answer can read the instructor sources from disk, which no check
    can undo. The command then refuses, in one line that says why and what to do; with --no-sandbox
    it grades and marks the scores provisional (printed and in --json)."""
    path = tmp_path / f"{LAB}.ipynb"
    nbformat.write(tools.source_notebook(LAB), path)
    r = run_cli("grade", str(path), env={"VRAMLAB_GRADE_SANDBOX": "off"}, timeout=120)
    assert r.returncode == 2 and "--no-sandbox" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout
    out = tmp_path / "scores.json"
    r = run_cli("grade", str(path), "--no-sandbox", "--json", str(out), "--timeout", "120", timeout=300)
    assert r.returncode == 0 and "PROVISIONAL" in r.stdout and "total 21/21" in r.stdout, (r.stdout, r.stderr)
    got = json.loads(out.read_text())
    assert got["provisional"] is True and got["total"] == [21, 21]


ANSWER_FROM_THE_INSTRUCTOR_SOURCE = '''
import subprocess


def _instructor_cell(lab, gid):
    """The instructor's solution cell, from git or from the checkout's file."""
    text = ""
    try:
        text = subprocess.run(["git", "--git-dir", {git!r}, "show", f"HEAD:labs/source/{{lab}}/{{lab}}.md"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    if not text:
        try:
            text = open(f"{root}/labs/source/{{lab}}/{{lab}}.md").read()
        except OSError:
            raise RuntimeError("the instructor source is out of reach") from None
    for block in text.split("```{{code-cell}}")[1:]:
        head, _, body = block.partition("\\n---\\n")[2].partition("\\n---\\n")
        if f"grade_id: {{gid}}" in head:
            return body.split("\\n```")[0]
    raise RuntimeError("no such cell")


exec(_instructor_cell({lab!r}, {gid!r}), globals())
'''


@pytest.mark.skipif(not _sandbox_works(), reason="no user namespaces on this machine")
@pytest.mark.parametrize("lab, gid, test", [("lab04_zero", "ex1-solution", "ex1-test"),
                                            ("lab06_offload", "stream-solution", "stream-test"),
                                            ("lab07_checkpointing", "ex3-solution", "ex3-test")])
def test_in_the_sandbox_no_answer_comes_from_the_instructor_source(lab, gid, test):
    """`git show HEAD:labs/source/...` (or the file itself) and exec of the solution cell
    scored full marks on labs 4 and 7. In the sandbox neither the checkout's .git nor labs/ exists
    for the answer's process (nor for the ranks and harnesses that run its code): the exercise
    scores 0, saying the source is out of reach; the others keep their points."""
    nb = tools.source_notebook(lab)
    code = ANSWER_FROM_THE_INSTRUCTOR_SOURCE.format(git=str(ROOT / ".git"), root=str(ROOT), lab=lab, gid=gid)
    scores = _graded(lab, nb, {gid: code})
    assert scores[test][0] == 0 and "out of reach" in scores[test][2], scores[test]
    assert all(v[0] == v[1] for k, v in scores.items() if k != test), scores


def test_a_missing_solution_cell_is_named_not_a_syntax_error():
    """A submission without one of the solution cells: that exercise scores 0 with a reason that names
    the missing cell (the placeholder the grader put in its place was itself a syntax error)."""
    nb = student()
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "ex2-solution"]
    scores = tools.grade(nb, LAB, timeout=120, only="ex2-test")
    assert scores["ex2-test"][0] == 0 and "no code cell 'ex2-solution'" in scores["ex2-test"][2], scores["ex2-test"]
