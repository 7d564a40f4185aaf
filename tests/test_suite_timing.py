"""benchmarks/suite_timing.py, which times the README's setup and test commands on a fresh clone: the commands it
runs are the README's (and .ci/run's, verbatim), bad arguments are one line, and its reading of pytest's JUnit XML
says which files dominate."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("suite_timing", ROOT / "benchmarks" / "suite_timing.py")
st = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(st)


def test_ci_runs_the_readmes_test_command_verbatim():
    test = st.readme_command("Tests")
    assert test.startswith(".venv/bin/python -m pytest") and "\n" not in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marked = ci.index("# --- the README's test command, verbatim ---")
    assert ci[marked + 1].split(" || ")[0] == test
    workflow = (ROOT / ".github" / "workflows" / "tests.yml").read_text()
    assert f"run: {test}\n" in workflow


def test_the_fast_tier_is_the_test_command_without_the_slow_tests():
    fast = st.fast_tier_command()
    assert fast == st.readme_command("Tests") + ' -m "not slow"'


def test_junit_times_are_summed_by_file(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
<testcase classname="tests.test_labs" name="test_a" time="10.0"/>
<testcase classname="tests.test_labs" name="test_b[x]" time="5.0"><skipped/></testcase>
<testcase classname="tests.grading.test_run.TestX" name="test_c" time="2.5"><failure/></testcase>
</testsuite></testsuites>""")
    got = st.by_file(xml)
    assert got["tests"] == {"passed": 1, "skipped": 1, "failure": 1} and got["test_seconds_summed"] == 17.5
    assert got["files"][0] == {"file": "tests/test_labs.py", "seconds": 15.0, "share": round(15 / 17.5, 3)}
    assert got["files"][1]["file"] == "tests/grading/test_run.py"
    assert got["slowest_tests"][0] == {"test": "tests.test_labs::test_a", "seconds": 10.0}


def test_phase_marks_and_summary_are_read():
    out = "x\nci: setup took 95 s\n== 3 passed, 1 skipped in 12.0s ==\nci: tests took 13 s\n"
    assert st.ci_phases(out) == {"setup": 95.0, "tests": 13.0}
    assert st.summary_line(out) == "3 passed, 1 skipped in 12.0s"


def test_bad_arguments_are_one_line():
    for args in (["--tiers", "nope"], ["--tiers", ""], ["--out", "/proc/nope/x.json"]):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_timing.py"), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr, r.stderr
