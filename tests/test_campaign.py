"""The GPU campaign: its plan runs anywhere (--dry-run), it refuses to run without a GPU in one
line, and its scheduler never holds more than the memory budget at once."""

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "benchmarks" / "gpu_campaign.py")
campaign = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(campaign)


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_campaign.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_dry_run_lists_every_step_and_lab():
    r = run("--dry-run")
    assert r.returncode == 0, r.stderr
    for needle in ("accuracy: 33 cases", "inference: 6 configurations", "fit() says 104", "fit() says 111",
                   "serving: vLLM's KV blocks", "snapshots: GPT-2 b8 s1024", "fp8: Llama-3.2-1B",
                   *campaign.LABS, "nothing measured"):
        assert needle in r.stdout, needle
    assert set(campaign.LABS) == {p.name for p in (ROOT / "labs" / "source").iterdir() if p.is_dir()}


@pytest.mark.slow
def test_without_a_gpu_it_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        return
    r = run()
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = run("--only", "accuracy,benchmarks")
    assert bad.returncode == 2 and "unknown step benchmarks" in bad.stderr


def _jobs(needs, held, peak, running, lock):
    def job(need):
        def fn():
            with lock:
                held[0] += need
                running[0] += 1
                peak[0] = max(peak[0], held[0])
                peak[1] = max(peak[1], running[0])
            time.sleep(0.03)
            with lock:
                held[0] -= need
                running[0] -= 1
            return need
        return fn
    return [(f"j{i}", n, job(n)) for i, n in enumerate(needs)]


def test_parallel_runs_stay_within_the_memory_budget():
    needs = [70, 50, 40, 30, 30, 20, 10, 10, 5]
    held, peak, running, lock = [0], [0, 0], [0], threading.Lock()
    out = campaign.run_parallel(_jobs(needs, held, peak, running, lock), budget=100, workers=4)
    assert sorted(out.values()) == sorted(needs)
    assert peak[0] <= 100  # never more than the budget at once
    assert peak[1] >= 2  # but several at a time when they fit
    held, peak, running = [0], [0, 0], [0]
    out = campaign.run_parallel(_jobs([120, 10], held, peak, running, lock), budget=100, workers=4)
    assert sorted(out.values()) == [10, 120] and peak[1] == 1  # a job larger than the budget runs alone


@pytest.mark.slow
def test_lab_runs_on_a_gpu_go_in_that_gpus_folder():
    """The labs step writes beside the stored H100 runs (labs/results/h100/<lab>_h100.json), never
    over a lab's CPU run (labs/results/<lab>.json)."""
    import os

    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    assert campaign.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert campaign.gpu_tag("Tesla T4") == "t4"
    assert campaign.gpu_tag("NVIDIA L4") == "nvidia-l4"
    r = run("--dry-run", "--only", "labs")
    assert r.returncode == 0, r.stderr
    assert os.path.join("labs", "results", "h100", "lab08_compression_h100.json") in r.stdout
    assert (ROOT / "labs" / "results" / "h100" / "lab06_offload_h100.json").exists()


@pytest.mark.slow
def test_the_fp8_probe_says_in_one_line_what_it_needs():
    """benchmarks/fp8_probe.py measures on a GPU only: elsewhere one line, exit 0, nothing written."""
    import torch

    if torch.cuda.is_available():
        return
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_probe.py")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("fp8_probe: needs a CUDA GPU") and len(r.stdout.splitlines()) == 1
    assert not (ROOT / "benchmarks" / "results" / "fp8").exists()
