"""How long a new contributor and CI wait: the README's setup, its test command and the fast tier, timed on a fresh
clone of this checkout's HEAD, with what dominates each. The tests never time anything (a busy machine must not
fail a test): the README's figures come from this file.

    python benchmarks/suite_timing.py                 # setup + full suite (as .ci/run) + fast tier
    python benchmarks/suite_timing.py --busy          # the same with one core kept busy by another process
    python benchmarks/suite_timing.py --tiers fast    # only the fast tier (setup still runs, from pip's cache)

Steps, in a fresh `git clone` of HEAD (commit first: uncommitted changes are not timed):
- ci      `bash .ci/run` with CI=true, which runs the README's setup (without the book build: the tests build it)
          and then the README's test command verbatim; its setup and test phases are timed apart
- fast    the README's fast-tier command, in the same environment

Each test's own time comes from pytest's JUnit XML (PYTEST_ADDOPTS, which .ci/run passes through), summed by file
to say what dominates. Writes benchmarks/results/speed/suite_<host>.json (with provenance); progress on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("ci", "fast")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def readme_command(heading: str) -> str:
    """The first ```bash block under the README's section `heading` (its commands, verbatim)."""
    return re.search(r"```bash\n(.*?)\n```", _readme_section(heading), re.S).group(1).strip()


def fast_tier_command() -> str:
    """The README's fast-tier command: the ```bash block that follows 'The fast tier' in its Tests section."""
    return re.search(r"fast tier.*?```bash\n(.*?)\n```", _readme_section("Tests"), re.S | re.I).group(1).strip()


def busy_core() -> subprocess.Popen:
    """Another job on one core: a pure-Python loop that runs until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])


def by_file(junit: Path, top: int = 12) -> dict:
    """The JUnit XML's test times: totals, the files that dominate and the slowest tests."""
    tree = ET.parse(junit)
    files: dict[str, float] = defaultdict(float)
    tests = []
    counts = defaultdict(int)
    for case in tree.iter("testcase"):
        seconds = float(case.get("time") or 0)
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        path = case.get("classname", "").split(".")
        # classname "tests.grading.test_run" or "tests.test_labs.TestX": the module is the part up to test_*
        module = ".".join(path[:next((i + 1 for i, p in enumerate(path) if p.startswith("test_")), len(path))])
        files[module.replace(".", "/") + ".py"] += seconds
        tests.append((seconds, name))
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
    tests.sort(reverse=True)
    total = sum(files.values())
    return {"tests": dict(counts), "test_seconds_summed": round(total, 1),
            "files": [{"file": f, "seconds": round(s, 1), "share": round(s / total, 3) if total else 0.0}
                      for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:top]],
            "slowest_tests": [{"test": n, "seconds": round(s, 1)} for s, n in tests[:top]]}


def run_phase(cmd: list[str] | str, *, cwd: Path, env: dict, log_file: Path, shell: bool = False) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    with open(log_file, "w") as fh:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, shell=shell,
                           executable="/bin/bash" if shell else None)
    return time.perf_counter() - t0, r.returncode, log_file.read_text(errors="replace")


def ci_phases(output: str) -> dict:
    """.ci/run's own phase marks ('ci: <phase> took N s')."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^ci: (\S+) took (\d+) s$", output, re.M)}


def summary_line(output: str) -> str:
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1] if lines else "(no pytest summary)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def one_line(message: str):
        print(f"suite_timing.py: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    ap.error = one_line
    ap.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, of {', '.join(TIERS)} (default: both)")
    ap.add_argument("--busy", action="store_true", help="keep one core busy with another process throughout")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/speed/suite_<host>.json)")
    ap.add_argument("--keep", default=None, help="clone into this folder and keep it (default: a temporary one)")
    a = ap.parse_args(argv)
    tiers = [t.strip() for t in a.tiers.split(",") if t.strip()]
    if not tiers or [t for t in tiers if t not in TIERS]:
        ap.error(f"--tiers takes tiers among {', '.join(TIERS)}, got {a.tiers!r}")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "speed" / f"suite_{socket.gethostname()}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.touch()
    except OSError as e:
        ap.error(f"cannot write --out {out}: {e.strerror or e}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not commit:
        ap.error(f"{ROOT} is not a git checkout with a commit")

    keep = Path(a.keep) if a.keep else None
    tmp = tempfile.TemporaryDirectory(prefix="vramlab-suite-")
    clone = keep or Path(tmp.name) / "clone"
    result: dict = {"what": "the README's setup and test commands timed on a fresh clone (benchmarks/suite_timing.py)",
                    "commit": commit, "busy_core": a.busy, "steps": {}}
    busy = busy_core() if a.busy else None
    try:
        log(f"cloning {commit[:12]} into {clone} ...")
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = {**os.environ, "CI": "true"}
        env.pop("VIRTUAL_ENV", None)
        junit = Path(tmp.name) / "junit-ci.xml"
        if "ci" in tiers:
            log("running .ci/run (setup, then the README's test command) ...")
            seconds, rc, output = run_phase(["bash", ".ci/run"], cwd=clone, log_file=Path(tmp.name) / "ci.log",
                                            env={**env, "PYTEST_ADDOPTS": f"--junitxml={junit}"})
            phases = ci_phases(output)
            result["steps"]["ci"] = {"command": "bash .ci/run", "test_command": readme_command("Tests"),
                                     "exit_code": rc, "seconds": round(seconds, 1), "phases_s": phases,
                                     "summary": summary_line(output),
                                     **(by_file(junit) if junit.exists() else {"tail": output[-3000:]})}
            log(f"ci: {seconds / 60:.1f} min, exit {rc}: {result['steps']['ci']['summary']}")
        if "fast" in tiers:
            if not (clone / ".venv" / "bin" / "python").exists():
                log("setting up (.ci/run's setup) ...")
                subprocess.run(["bash", "-c", "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && "
                                "npm install --prefix tests/browser --no-audit --no-fund --silent"],
                               cwd=clone, env=env, check=True)
            cmd = fast_tier_command()
            junit_fast = Path(tmp.name) / "junit-fast.xml"
            log(f"running the fast tier: {cmd} ...")
            seconds, rc, output = run_phase(cmd, cwd=clone, shell=True, log_file=Path(tmp.name) / "fast.log",
                                            env={**env, "PYTEST_ADDOPTS": f"--junitxml={junit_fast}"})
            result["steps"]["fast"] = {"command": cmd, "exit_code": rc, "seconds": round(seconds, 1),
                                       "summary": summary_line(output),
                                       **(by_file(junit_fast) if junit_fast.exists() else {"tail": output[-3000:]})}
            log(f"fast tier: {seconds / 60:.1f} min, exit {rc}: {result['steps']['fast']['summary']}")
    finally:
        if busy:
            busy.kill()
            busy.wait()
        if not keep:
            tmp.cleanup()
    result["provenance"] = {
        "device": "cpu", "host": socket.gethostname(), "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/suite_timing.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, step in result["steps"].items():
        print(f"{name:<5} {step['seconds'] / 60:6.1f} min  exit {step['exit_code']}  {step['summary']}")
        for f in step.get("files", [])[:5]:
            print(f"      {f['seconds'] / 60:6.1f} min  {f['file']}")
    log(f"wrote {out}")
    return 0 if all(s["exit_code"] == 0 for s in result["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
