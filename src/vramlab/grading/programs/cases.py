"""The program of labs 1, 3, 6 and 7's single-process checks, in a folder that holds `programs/` (this package)
and `answer.json`:

    python -I -c <vramlab.grading.run.launch("cases")> HARNESS CASES OUT

It runs the answer's source (`common.run_answer`; what that raises ends the program, its last line of
error output the check's reason), then the harness's `run(case, answer, names)` for every case of the
JSON list CASES, and writes the reports (or the error each raised) to OUT as JSON.
"""

from __future__ import annotations

import importlib
import json
import sys

from . import common


def main() -> None:
    name, cases, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    with open("answer.json") as fh:
        answer = json.load(fh)
    common.block(answer["blocked"])
    harness = importlib.import_module(f"{__package__}.{name}")
    module = common.run_answer(answer["source"])
    reports = []
    for case in cases:
        try:
            reports.append(harness.run(case, module, answer["names"]))
        except Exception as e:
            reports.append({"error": f"{type(e).__name__}: {e}"[:500]})
    with open(out, "w") as fh:
        json.dump(reports, fh)
