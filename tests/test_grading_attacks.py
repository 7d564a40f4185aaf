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
    """An infinite loop: the per-cell limit stops it (the kernel is killed if it ignores the
    interrupt), and every test not yet run scores 0 with that reason; grading returns in seconds."""
    nb = student()
    cell(nb, "ex1-solution").source = "while True:\n    pass"
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=5)
    assert time.perf_counter() - t0 < 90
    assert tools.total(scores) == (0, 9) and "ran past the 5 s limit" in scores["ex1-test"][2], scores


def test_background_processes_huge_output_and_a_dying_kernel(tmp_path):
    """Correct answers to exercises 1 and 2, one of which starts a background process and prints 30 MB,
    and a third that ends the kernel: 6/9, the third's 0 with its reason; the background process is
    killed with the kernel's process group and the kept output is bounded."""
    pidfile = tmp_path / "bg.pid"
    nb = student()
    sol = solutions()
    cell(nb, "ex1-solution").source = sol["ex1-solution"]
    cell(nb, "ex2-solution").source = sol["ex2-solution"] + (
        f"\nimport subprocess\n_p = subprocess.Popen(['sleep', '300'])\nopen({str(pidfile)!r}, 'w').write(str(_p.pid))\n"
        "print('x' * 30_000_000)\n")
    cell(nb, "ex3-solution").source = "import os\nos._exit(3)"
    executed = []
    t0 = time.perf_counter()
    scores = tools.grade(nb, LAB, timeout=120, executed=executed)
    assert time.perf_counter() - t0 < 120
    assert scores["ex1-test"][0] == 3 and scores["ex2-test"][0] == 3 and tools.total(scores) == (6, 9), scores
    assert "died" in scores["ex3-test"][2]
    pid = int(pidfile.read_text())
    time.sleep(0.5)
    assert not _running(pid), "a process the submission started outlived grading"
    kept = [len(o.get("text", "")) for c in executed[0].cells for o in c.get("outputs", [])]
    assert max(kept) <= tools.MAX_OUTPUT_CHARS + 100


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
