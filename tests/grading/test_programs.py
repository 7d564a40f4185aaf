"""The programs that run graded answers (vramlab.grading.programs): real modules, imported here as
`vramlab.grading.programs.*` (so that the linter and coverage see them), that import nothing of
vramlab (in the sandbox there is none) and run from a copy of their folder."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vramlab.grading import offload, run
from vramlab.grading.programs import common

PROGRAMS = Path(run.PROGRAMS)
MODULES = sorted(p.stem for p in PROGRAMS.glob("*.py") if p.stem != "__init__")
RANK_HARNESSES = ("ring", "tp", "ddp", "zero1", "zero2", "ddp_accum", "ring_attn")
CASE_HARNESSES = ("sac", "stream", "link_rate", "accum", "chunk_ce", "inplace", "disk", "dispatch")

LINK_GBPS = '''
import statistics


def link_GBps(link, host, repeats=5):
    buf = link.buffer(host.numel(), host.dtype)
    link.wait(link.copy(buf, host))  # the warm-up pays the setup
    seconds = []
    for _ in range(repeats):
        start = link.clock()
        link.wait(link.copy(buf, host))
        seconds.append(link.clock() - start)
    return host.numel() * host.element_size() / statistics.median(seconds) / 1e9
'''


def test_the_folder_holds_the_programs_and_one_harness_a_check():
    assert set(MODULES) == {"common", "ranks", "cases", *RANK_HARNESSES, *CASE_HARNESSES}


@pytest.mark.parametrize("name", ["__init__", *MODULES])
def test_a_program_imports_nothing_of_vramlab(name):
    """Only the standard library, torch and the package's own modules (relative, one level: never
    vramlab.grading or vramlab, which the sandbox hides)."""
    tree = ast.parse((PROGRAMS / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level in (0, 1), f"{name}: from {'.' * node.level}{node.module or ''} reaches outside programs/"
            roots = {(node.module or "").split(".")[0]} if node.level == 0 else set()
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("__import__",
                                                                                                         "import_module"):
            assert not any(isinstance(a, ast.Constant) and "vramlab" in str(a.value) for a in node.args), name
            continue
        else:
            continue
        assert not roots & set(run.ANSWER_PACKAGES), f"{name} imports {roots & set(run.ANSWER_PACKAGES)}"
        assert roots <= set(sys.stdlib_module_names) | {"torch"}, f"{name} imports {roots}"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_each_program_module_imports_as_part_of_vramlab(name):
    module = importlib.import_module(f"vramlab.grading.programs.{name}")
    if name in RANK_HARNESSES:
        assert isinstance(module.ALLOWED, tuple) and module.ALLOWED and isinstance(module.HINT, str) and module.HINT
        assert set(module.ALLOWED) <= set(importlib.import_module("vramlab.grading.programs.ranks")._IMPLEMENTED)
    if name in (*RANK_HARNESSES, *CASE_HARNESSES):
        assert callable(module.run)
    if name in ("ranks", "cases"):
        assert callable(module.main)


def test_the_answer_runs_in_a_module_of_its_own():
    """The answer's source runs in a fresh `__main__` holding the modules the old harness globals gave
    it (and none of a harness's names); the check gets its functions from there by name."""
    saved = sys.modules["__main__"]
    try:
        answer = common.run_answer("def f(x):\n    return torch.tensor(x) * 2\nSEEN = sorted(k for k in globals() if "
                                   "not k.startswith('__'))\nNAME = __name__\n")
        assert sys.modules["__main__"] is answer and answer is not saved
    finally:
        sys.modules["__main__"] = saved
    assert answer.NAME == "__main__"
    assert set(answer.SEEN) == {"CheckpointPolicy", "F", "dist", "gc", "json", "math", "mp", "os", "statistics", "sys",
                                "torch", "f"}
    assert common.defined(answer, "f")(3).item() == 6
    with pytest.raises(NameError, match="name 'g' is not defined"):
        common.defined(answer, "g")


def test_the_answer_packages_are_blocked_with_their_loaded_submodules(monkeypatch):
    for name in ("vramlab_fake_pkg", "vramlab_fake_pkg.sub", "vramlab_fake_pkgx"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    common.block(("vramlab_fake_pkg", "vramlab_fake_other"))
    assert sys.modules["vramlab_fake_pkg"] is None and sys.modules["vramlab_fake_pkg.sub"] is None
    assert sys.modules["vramlab_fake_other"] is None and sys.modules["vramlab_fake_pkgx"] is not None
    with pytest.raises(ImportError):
        importlib.import_module("vramlab_fake_pkg.sub")
    del sys.modules["vramlab_fake_other"]


@pytest.mark.slow
def test_one_count_of_what_a_process_holds():
    """ZeRO-2 counts tensors' bytes, ZeRO-1 numbers however held (a float32 tensor's elements, lists of
    floats): one function, `common.held`."""
    import torch

    before_bytes, before_values = common.held(), common.held(values=True)
    kept = [torch.zeros(1000, dtype=torch.float32), [0.5] * 100]
    view = kept[0][:10]  # a view of the same storage: counted once
    assert common.held() - before_bytes == 4000
    assert common.held(values=True) - before_values == 1000 + 100
    assert common.held(kept, values=True) - before_values == 0
    assert common.held([kept[0]]) - before_bytes == 0 and view.numel() == 10


@pytest.mark.slow
def test_a_program_runs_from_a_copy_of_its_folder_without_vramlab(tmp_path):
    """The single-process program, staged as a check stages it, run where vramlab cannot be imported at
    all (as in the sandbox): the link measurement on a correct answer reports the link's rate."""
    run._stage(str(tmp_path), LINK_GBPS, ["link_GBps"])
    assert (tmp_path / "programs" / "cases.py").is_file() and not (tmp_path / "programs" / "__pycache__").exists()
    cases = offload.link_cases(0, 2)
    args = run.launch("cases")
    args[-1] = "import sys\nsys.modules['vramlab'] = None\n" + args[-1]
    r = subprocess.run([sys.executable, *args, "link_rate", json.dumps(cases), str(tmp_path / "out")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = json.loads((tmp_path / "out").read_text())
    assert [round(rep["got"], 6) for rep in reports] == [c["GBps"] for c in cases]


@pytest.mark.slow
def test_the_runner_runs_a_harness_and_reads_its_reports():
    """Through the real runner (a go-between, a process group, the report read as a regular file): a
    correct answer passes, a misuse comes back with the harness's words, a syntax error with Python's."""
    answer = types.SimpleNamespace(__name__="link_GBps", __vramlab_source__=LINK_GBPS)
    offload.check_link_GBps(answer, n=2)
    misuse = types.SimpleNamespace(__name__="link_GBps", __vramlab_source__=LINK_GBPS.replace(
        "link.copy(buf, host))  # the warm-up", "link.copy(host, host))  # the warm-up"))
    with pytest.raises(AssertionError, match="link.copy's destination must be"):
        offload.check_link_GBps(misuse, n=1)
    broken = types.SimpleNamespace(__name__="link_GBps", __vramlab_source__="def link_GBps(link, host):\n    return (\n")
    with pytest.raises(AssertionError, match="the measurement did not finish: SyntaxError"):
        offload.check_link_GBps(broken, n=1)


def test_the_checks_use_the_calculators_only_and_import_no_cycle():
    """vramlab.grading.* may import vramlab's pure calculators, never vramlab.measure or vramlab.present
    (nor the programs, which are copied, not imported); its modules import each other without a cycle."""
    folder = PROGRAMS.parent
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = (node.module or "").split(".")[0] if node.level == 1 else None
                if node.level == 2:
                    assert (node.module or "").split(".")[0] not in ("measure", "present", "grading"), (path.name, node.module)
                elif target:
                    assert target != "programs", f"{path.name} imports the programs"
                    deps.add(target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith(("vramlab.measure", "vramlab.present")) for n in names), path.name
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, " -> ".join((*stack, name))
        if name not in done:
            for dep in graph.get(name, ()):
                visit(dep, (*stack, name))
            done.add(name)

    for name in graph:
        visit(name, ())
    assert graph["zero"] == {"parallel", "run"} and graph["__init__"] == set()


def test_the_vocabulary_tracker_counts_live_storages():
    """programs/chunk_ce.py's dispatch mode: a tensor of at least V elements counts while its storage
    lives (a view as its whole storage, once), a freed one no longer; the head's shape and the inputs'
    storages never; the largest one is named with its op and phase."""
    import torch

    from vramlab.grading.programs import chunk_ce

    V, h = 50, 3
    w = torch.randn(V, h)
    with chunk_ce.VocabTracker(V, h, (w,)) as t:
        a = torch.zeros(4, V)  # 200
        view = a[:2]  # the same storage: not counted again
        b = torch.zeros(2, V)  # 100: 300 alive
        del a, b  # the view keeps a's storage: 200 alive
        c = torch.zeros(1, V)  # 250
        w2 = w.t().contiguous() + w.t()  # the head's transpose: not counted
        flat = w.reshape(-1)[:60] * 1  # a new tensor of 60 >= V elements: counted (310)
        t.phase = "backward"
        small = torch.zeros(V - 1)  # under V elements: never counted
    assert t.peak == 310 and t.peak_phase == "forward" and t.ops == 4
    assert t.largest[:2] == [200, [4, V]] and t.largest[3] == "forward"
    assert view.shape == (2, V) and c.numel() == V and w2.shape == (h, V) and flat.numel() == 60 and small.numel() == V - 1
