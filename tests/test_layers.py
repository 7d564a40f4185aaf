"""The package's layout is its architecture: the folder tells the layer, and the import graph reads as
layers. Read from the source (every import statement, those inside functions too), not from a list
kept by hand: a module added anywhere is checked the day it is added.

- `vramlab/*.py`: the calculators, pure Python. They import the standard library and each other,
  nothing else (no torch, numpy, matplotlib, ipywidgets, transformers, ever), and nothing above them.
- `vramlab/measure/`, `vramlab/present/`, `vramlab/grading/`: each imports the pure folder and its
  own folder, never another of the three.
- No import cycle anywhere, and what the browser runs is pure.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "vramlab"
LAYERS = ("measure", "present", "grading")
# the package's entry point for `python -m vramlab`: a program, imported by no module, that starts the
# command line (vramlab.present.cli)
ENTRY = "vramlab.__main__"


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(SRC.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` statement in `package` names, its relative dots resolved."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in module `name`: a vramlab module where it is one
    (`from . import x` names module x when x is a module), else the top-level package."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            out += [(s, node.lineno) for s in subs] or [(mod, node.lineno)]
    return out


def _vramlab_module(imported: str) -> str | None:
    """The vramlab module an import names (`vramlab.memory.x` -> `vramlab.memory`), or None."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "pure"


GRAPH = {name: sorted({m for i, _ in _imports(name) if i.split(".")[0] == "vramlab" and (m := _vramlab_module(i))} - {name})
         for name in MODULES}


def test_the_tree_has_the_layers():
    assert {_layer(n) for n in MODULES} == {"pure", *LAYERS}
    pure = {n.split(".")[1] for n in MODULES if _layer(n) == "pure" and n.count(".") == 1}
    assert {"units", "specs", "precision", "memory", "activations", "fitting", "collectives", "parallel", "zero",
            "offload", "checkpointing", "compression"} <= pure
    # predicted and measured by one name: every chapter's calculator has its measurement
    for chapter in ("memory", "collectives", "parallel", "zero", "precision", "offload", "checkpointing", "compression"):
        assert f"vramlab.{chapter}" in MODULES and f"vramlab.measure.{chapter}" in MODULES, chapter


def test_pure_folder_imports_only_the_standard_library_and_itself():
    bad = []
    for name in MODULES:
        if _layer(name) != "pure" or name == ENTRY:
            continue
        for imported, line in _imports(name):
            top = imported.split(".")[0]
            if top == "vramlab":
                target = _vramlab_module(imported)
                if target is None or _layer(target) != "pure":
                    bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {imported}")
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, "\n".join(bad)


def test_no_upward_or_sideways_import():
    bad = [f"{a} ({_layer(a)}) imports {b} ({_layer(b)})" for a, targets in GRAPH.items() if a != ENTRY
           for b in targets if _layer(b) not in ("pure", _layer(a))]
    assert not bad, "\n".join(bad)
    assert GRAPH[ENTRY] == ["vramlab.present.cli"] and not any(ENTRY in t for t in GRAPH.values())


def test_no_import_cycle():
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in GRAPH[n]:
            if state.get(m) == 1:
                cycles.append(" -> ".join(path[path.index(m):] + [m]) if m in path else f"{n} -> {m}")
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in MODULES:
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_what_the_browser_runs_is_pure(assert_pure_python):
    spec = importlib.util.spec_from_file_location("vramlab_live", ROOT / "book" / "_ext" / "vramlab_live.py")
    live = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(live)
    shipped = {_name(p) for p in live.browser_files() if p.suffix == ".py"}
    assert {"vramlab.memory", "vramlab.present.calculators", "vramlab.present.svg"} <= shipped
    assert not any(_layer(n) in ("measure", "grading") for n in shipped)
    assert "vramlab.present.widgets" not in shipped and "vramlab.present.cli" not in shipped
    for n in shipped:  # everything a shipped module imports is shipped too
        assert set(GRAPH[n]) <= shipped, (n, set(GRAPH[n]) - shipped)
    assert_pure_python("import " + ", ".join(sorted(shipped)))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _is_package(n) and n != ENTRY))
def test_every_module_has_its_test_file(name):
    """One test file per module, where the tree puts it: tests/test_<name>.py for `vramlab.<name>`,
    tests/<layer>/test_<name>.py for `vramlab.<layer>.<name>`; the programs the grader's processes run
    (`vramlab.grading.programs.*`, only ever run as programs) share tests/grading/test_programs.py."""
    parts = name.split(".")[1:]
    if parts[:2] == ["grading", "programs"]:
        parts = ["grading", "programs"]
    assert (ROOT / "tests" / Path(*parts[:-1]) / f"test_{parts[-1]}.py").exists()


def test_the_grading_programs_import_nothing_of_vramlab():
    """They run where the answers run, in a sandbox that hides the course: the standard library,
    torch, and each other only."""
    bad = [f"{n} imports {i}" for n in MODULES if n.startswith("vramlab.grading.programs")
           for i, _ in _imports(n) if i.split(".")[0] == "vramlab" and not i.startswith("vramlab.grading.programs")]
    assert not bad, bad


def test_the_readmes_package_map_names_every_module():
    """The README's map of the package (its section 'The package') lists each folder's modules, every one of them
    and none that is gone."""
    text = (ROOT / "README.md").read_text().split("## The package: the folder tells the layer", 1)[1]
    block = text.split("```\n", 2)[1]
    folders = {"src/vramlab/": SRC, "measure/": SRC / "measure", "present/": SRC / "present",
               "grading/": SRC / "grading", "programs/": SRC / "grading" / "programs"}
    listed: dict[Path, set[str]] = {}
    current = None
    for line in block.splitlines():
        head = line.split()[0] if line.strip() else ""
        if head in folders:
            current = folders[head]
            listed[current] = set()
        elif current is not None and line.strip():  # module names, then (after a wide gap) a description
            listed[current] |= set(re.split(r"\s{3,}", line.strip())[0].split())
    for folder in folders.values():
        modules = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
        assert modules <= listed[folder], (folder.name, sorted(modules - listed[folder]))
        assert listed[folder] <= modules, (folder.name, sorted(listed[folder] - modules))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_name():
    """What another module imports is public: `from vramlab.x import _y`, or `x._y` on an imported vramlab module,
    is refused (the name is made public, or moves to the module that uses it)."""
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        package = name if _is_package(name) else name.rpartition(".")[0]
        aliases: dict[str, str] = {}  # a local name bound to a vramlab module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _from_module(node, package)
                for a in node.names:
                    if f"{mod}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{mod}.{a.name}"
                    elif mod in MODULES and mod != name and _private(a.name):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != name and _private(node.attr)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_source_cites_this_projects_issue_numbers():
    """The code says why, not which issue asked for it: no number of this project's issues (up to three digits,
    after "issue" or "until #") in the package, the tests, the benchmarks or the labs; another project's (DeepSpeed's
    four-digit ones) are citations and stay."""
    pattern = re.compile(r"\b[Ii]ssues? #?\d{1,3}\b|until #\d{1,3}\b|\btest_issue\d")
    files = [p for folder in ("src", "tests", "benchmarks", "labs") for p in sorted((ROOT / folder).rglob("*"))
             if p.suffix in (".py", ".md", ".mjs") and not {"node_modules", "release", "__pycache__"} & set(p.parts)]
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not bad, "\n".join(bad)
