"""The built book as a reader meets it, in a real browser (Debian's chromium, driven by
playwright-core from tests/browser/): every page, at 1280 px (a laptop) and 390 px (a phone), loads
nothing from outside the book, logs no console error and fails no request, never scrolls sideways,
has nothing wider than the content column outside a box that scrolls, and no text under 9 px in its
charts, output images or calculators; and every chapter's calculator is live: change a control and
the number shown is what CPython's vramlab computes for the same inputs, with no Pyodide byte fetched
before the first change; a refused input leaves an error state (never "live") naming what CPython
names, and the next valid change makes it live again; a memory snapshot set on chapter 1's file input
is explained in the page (every allocated byte, the same total as CPython's), a file that is not one
is one error line. Behaviour only: how fast is
benchmarks/page_speed.py's to measure (check.mjs reports the times; they are printed here).

Needs chromium (apt-get install chromium) and `npm install --prefix tests/browser`; without them
the test is skipped with the reason, except under CI (CI=true), where it must run.
VRAMLAB_HTML=<built book's html folder> checks that book instead of building one;
VRAMLAB_SCREENSHOTS=<folder> is where the screenshots of a few pages at both widths go (default: a
temporary folder, printed)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vramlab.present import calculators as C

pytestmark = pytest.mark.slow  # notebooks, processes, a browser or a book build

ROOT = Path(__file__).resolve().parents[1]
BROWSER = ROOT / "tests" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# each calculator: its page, changes of its controls (the first starts Python), maybe a refused input and
# its fix; shared with benchmarks/page_speed.py
def _with_files(case: dict) -> dict:
    """A file input's value {name, example: {...}} gets the bytes of C.example_snapshot(**example) as base64,
    which check.mjs sets on the input (playwright's setInputFiles), as a reader picks or drops a file."""
    def value(v):
        if isinstance(v, dict) and "example" in v:
            return {**v, "base64": base64.b64encode(C.example_snapshot(**v["example"])).decode()}
        return v

    def change(c):
        return {k: value(v) for k, v in c.items()}

    out = {**case, "changes": [change(c) for c in case["changes"]]}
    out.update({k: change(case[k]) for k in ("bad", "fix") if k in case})
    return out


CASES = [_with_files(c) for c in json.loads((BROWSER / "cases.json").read_text())["cases"]]
WIDTHS = (1280, 390)
# the pages photographed at both widths for a reviewer
SHOTS = ["book/01_where_memory_goes.html", "book/03_parallelism.html", "book/07_checkpointing.html",
         "labs/release/lab06_offload/lab06_offload.html"]


def _missing() -> str | None:
    if not CHROMIUM:
        return "chromium is not installed (apt-get install chromium)"
    if not (BROWSER / "node_modules" / "playwright-core").is_dir():
        return "playwright-core is not installed (npm install --prefix tests/browser)"
    if not shutil.which("node"):
        return "node is not installed"
    return None


def pages_of(html: Path) -> list[str]:
    return sorted(str(p.relative_to(html)) for p in html.rglob("*.html")
                  if not p.relative_to(html).parts[0].startswith(("_", "reports")))


def serve(html: Path) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def check(html: Path, plan: dict, plan_file: Path, timeout: int = 1800) -> dict:
    """Run tests/browser/check.mjs on the book in `html` with `plan` (pages, widths, calcs, ...)."""
    server = serve(html)
    plan_file.write_text(json.dumps(plan))
    try:
        r = subprocess.run(["node", str(BROWSER / "check.mjs"), f"http://127.0.0.1:{server.server_port}/", str(plan_file)],
                           capture_output=True, text=True, timeout=timeout, env={**os.environ, "CHROMIUM": CHROMIUM or ""})
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def html(request):
    why = _missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test must run under CI: {why}")
        pytest.skip(why)
    given = os.environ.get("VRAMLAB_HTML")
    if given:
        assert (Path(given) / "book").is_dir(), f"VRAMLAB_HTML={given} is not a built book's html folder"
        return Path(given)
    return request.getfixturevalue("built_book")[0]


@pytest.fixture(scope="module")
def report(html, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    shots = Path(os.environ.get("VRAMLAB_SCREENSHOTS") or tmp / "screenshots")
    plan = {"pages": pages_of(html), "widths": list(WIDTHS), "calcs": CASES, "screenshots": str(shots),
            "shots": [p for p in SHOTS if (html / p).exists()]}
    out = check(html, plan, tmp / "plan.json")
    print(f"\nscreenshots ({len(out['screenshots'])}) in {shots}")
    return out


class _Quiet(SimpleHTTPRequestHandler):
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript", ".wasm": "application/wasm"}

    def log_message(self, *args):
        pass


def test_every_page_is_clean_at_both_widths(report):
    assert len(report["pages"]) >= 2 * 8  # chapters, labs, notation, references, search, index; at each width
    assert {key.rsplit(" @", 1)[1] for key in report["pages"]} == {str(w) for w in WIDTHS}
    problems = {page: {k: v for k, v in r.items() if v} for page, r in report["pages"].items()}
    problems = {p: v for p, v in problems.items() if v}
    assert not problems, json.dumps(problems, indent=1)[:6000]


def test_screenshots_were_taken(report):
    assert len(report["screenshots"]) == 2 * len([p for p in SHOTS if any(k.startswith(p + " @") for k in report["pages"])])
    assert all(Path(f).stat().st_size > 0 for f in report["screenshots"])


def _agrees(calc: str, run: dict) -> None:
    expected = C.get(calc).run(**run["values"])  # CPython, the same inputs the page sent
    assert not expected.error and set(run["numbers"]) == set(expected.numbers)
    for key, (value, shown) in expected.numbers.items():
        got_value, got_shown = run["numbers"][key]
        assert float(got_value) == pytest.approx(value, rel=1e-12), (key, got_value, value)
        assert got_shown == shown


@pytest.mark.parametrize("case", CASES, ids=[c["calc"] for c in CASES])
def test_calculator_is_live_and_agrees_with_cpython(report, case):
    r = next(x for x in report["calcs"] if x["calc"] == case["calc"])
    assert r["pyodideBeforeChange"] == 0, "Pyodide was fetched before the reader used a calculator"
    assert not r["errors"] and not r["external"], r
    for run in r["runs"]:
        assert run["state"] == "live" and run["status"].startswith("live:") and not run["error"], run
        _agrees(case["calc"], run)
    # times are a benchmark's (benchmarks/page_speed.py), not a test's: printed, never asserted
    print(f"{case['calc']}: first live result {r['runs'][0]['seconds']:.1f} s, recomputes "
          + ", ".join(f"{1000 * run['seconds']:.0f}" for run in r["runs"][1:]) + " ms")


BAD = [c for c in CASES if "bad" in c]


@pytest.mark.parametrize("case", BAD, ids=[c["calc"] for c in BAD])
def test_a_refused_input_is_an_error_state_not_live(report, case):
    r = next(x for x in report["calcs"] if x["calc"] == case["calc"])
    bad = r["bad"]
    expected = C.get(case["calc"]).run(**bad["values"])
    assert expected.error and bad["error"] == expected.error  # the line CPython writes, in the result area
    assert bad["state"] == "error" and not bad["status"].startswith("live") and "error" in bad["status"], bad
    assert bad["invalid"] == list(expected.invalid) == list(case["bad"])  # the control is marked
    assert bad["statusColor"] != r["runs"][-1]["statusColor"]  # not live's green
    fixed = r["fixed"]
    assert fixed["state"] == "live" and fixed["status"].startswith("live:") and not fixed["invalid"], fixed
    _agrees(case["calc"], fixed)


def test_out_of_range_and_no_plan_fits_read_as_such_in_the_page(report):
    training = next(x for x in report["calcs"] if x["calc"] == "training")["bad"]
    assert "is out of range" in training["error"] and "between 1 and 128" in training["error"]
    shown = {run["numbers"]["cheapest"][1] for run in next(x for x in report["calcs"] if x["calc"] == "checkpointing")["runs"]}
    assert C.NO_PLAN_FITS in shown and "none (recompute nothing)" in shown  # both, each unmistakable


def test_a_snapshot_file_is_explained_in_the_page(report):
    """Chapter 1's snapshot calculator: the file set on its input (read by FileReader, never uploaded) is
    explained by the worker's Python: the allocated total shown is what `snapshot.explain_bytes` gives in
    CPython for the same bytes, and the categories of the page's table sum to it; a text file is one line; a file
    dropped on the calculator (not set on its input) is read and explained the same way."""
    from vramlab import snapshot as S

    case = next(c for c in CASES if c["calc"] == "explain")
    r = next(x for x in report["calcs"] if x["calc"] == "explain")
    sent = next(c["snapshot"] for c in case["changes"] if "snapshot" in c)
    run = next(run for run in r["runs"] if run["values"]["snapshot"])  # the first run after the file was set
    data = base64.b64decode(run["values"]["snapshot"].split(",", 1)[1])
    assert data == base64.b64decode(sent["base64"])  # the page read the bytes it was given
    expected = S.explain_bytes(data)
    assert int(run["numbers"]["allocated"][0]) == expected["allocated"] == sum(expected["by_category"].values())
    assert int(run["numbers"]["reserved"][0]) == expected["reserved"]
    bad = r["bad"]
    assert bad["error"].startswith("snapshot file: not a memory snapshot") and "\n" not in bad["error"]
    assert bad["invalid"] == ["snapshot"] and r["fixed"]["state"] == "live"
    # the fix is a file dropped on the calculator (a DataTransfer, as from a desktop): read and explained the same
    fix = next(c for c in CASES if c["calc"] == "explain")["fix"]["snapshot"]
    assert fix.get("drop") is True
    fixed = r["fixed"]
    dropped = base64.b64decode(fixed["values"]["snapshot"].split(",", 1)[1])
    assert dropped == base64.b64decode(fix["base64"]) != data
    again = S.explain_bytes(dropped)
    assert int(fixed["numbers"]["allocated"][0]) == again["allocated"] == sum(again["by_category"].values())
    assert fixed["invalid"] == []
    assert not r["external"]  # nothing left the page
