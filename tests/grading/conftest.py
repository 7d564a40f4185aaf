"""What the tests of `vramlab.grading` share: the labs' own solution cells (`solution`), and an answer
as the grader hands it to a check (`answer`: a name and its cell's source)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("labtools", ROOT / "labs" / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)


def solution(lab: str, gid: str) -> str:
    return next(c.source for c in tools.source_notebook(lab).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == gid)


def answer(source: str, name: str):
    """What a check receives from the grader: the object's name and its cell's source."""
    return types.SimpleNamespace(__name__=name, __vramlab_source__=source)


def edited(source: str, old: str, new: str) -> str:
    assert old in source, old
    return source.replace(old, new)


def _function(source: str, name: str):
    ns: dict = {}
    exec(compile(source, "<answer>", "exec"), ns)
    return ns[name]
