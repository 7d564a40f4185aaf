"""The GPU campaign: re-measure, on whatever CUDA GPU this machine has, everything the book and the
tests compare the estimator with. One command, from the repository root:

    python benchmarks/gpu_campaign.py              # everything
    python benchmarks/gpu_campaign.py --only accuracy,maxbatch
    python benchmarks/gpu_campaign.py --dry-run    # the plan, without running it (works without a GPU)

Steps (each configuration measured in its own process, so nothing of one can count in another):
- accuracy:  the 33 cases of benchmarks/estimator_accuracy.py against max_memory_allocated, several
             processes at a time within a memory budget the estimator itself computes (peaks are
             per process; no timings are reported from this step)
             -> benchmarks/results/estimator_accuracy_cuda.json
- inference: prefill (all logits) and generate() for Llama-3.2-1B and GPT-2, and the source
             article's mT5-base runs -> benchmarks/results/gpu_campaign.json ("inference")
- maxbatch:  the largest GPT-2 s512 bf16-mixed batch that trains, default allocator and
             expandable_segments, bisected one probe per process from vramlab.fit's answer, with
             the GPU to itself -> benchmarks/results/gpu_campaign.json ("maxbatch")
- fsdp2:     FSDP2's per-rank peak for GPU-scale models, one rank of 1-8 alone per process with torch's
             fake process group (benchmarks/fsdp2_gpu_validation.py) -> benchmarks/results/zero/gpu/
- offload:   DeepSpeed ZeRO-Offload (stage 2, offload_optimizer: cpu) on three models, one process each:
             the allocator's peak, the bytes each way from the profiler's memcpy records, the host step;
             DeepSpeedCPUAdam against torch's AdamW; INT8 and bf16 matmul rates (needs deepspeed)
             -> benchmarks/results/offload/gpu/ (benchmarks/offload_gpu_validation.py)
- allocator: the caching allocator itself (benchmarks/allocator_gpu_probe.py, GPT-2 b8 s1024 bf16-mixed,
             one process per setting: default and expandable_segments:True): allocated/reserved before
             and after empty_cache() between steps and after a phase change (an eval at 4x the batch),
             memory_summary(), memory_stats() counters, and the steps' allocation trace replayed through
             vramlab.allocator -> benchmarks/results/allocator/gpu/<gpu>_{default,expandable}.json
- pinned:    chapter 6's pinned memory, one process each: pinned and pageable host<->device copies (1 GiB),
             and a pin_memory=True DataLoader of image batches (2 workers x prefetch 2): the pinned
             caching host allocator's peak (torch.cuda.host_memory_stats) against
             vramlab.offload.loader_memory, one batch's copy pinned vs pageable
             -> benchmarks/results/offload/gpu/<gpu>_pinned.json
- serving:   vLLM's own KV-cache pool, blocks and concurrency for a few presets with dummy weights, beside
             vramlab.serving (benchmarks/vllm_serving_probe.py; skipped where vLLM is not installed)
             -> benchmarks/results/serving/<gpu>_vllm.json
- snapshots: real torch.cuda.memory._snapshot() pickles for `vramlab explain` (benchmarks/snapshot_probe.py: GPT-2
             after the forward and the backward, and at a real out-of-memory error, each with its sidecar of
             provenance; the probe then checks explain's verdicts by running them) -> benchmarks/results/snapshots/
             (tests/test_snapshot.py gains these real snapshots once they are stored)
- fp8:       one training step of Llama-3.2-1B (b=4, s=2048), bf16 against torchao's float8 training, one process
             each: the allocator's peak beside vramlab's bf16 estimate (benchmarks/fp8_probe.py; skipped where
             torchao's float8 is not installed) -> benchmarks/results/fp8/<gpu>.json
- labs:      every lab's instructor version, run without a Jupyter kernel (labs/kernelless.py)
             -> labs/results/<gpu>/<lab>_<gpu>.json (<gpu>: the catalogue's key, h100 on an H100, else
             the device's name; labs/results/<lab>.json holds each lab's CPU run)

Needs torch and transformers (peft for nothing here); not the Jupyter stack, not the network: it
runs on a bare GPU image from a checkout, without installing vramlab. Later chapters add their labs and cases here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _use_this_checkout() -> None:
    """This checkout's vramlab, for this process and every process it starts (labs change
    directory): no install needed on a bare GPU image. Called by main(), never at import."""
    sys.path.insert(0, str(ROOT / "src"))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *rest])
STEPS = ("accuracy", "inference", "maxbatch", "fsdp2", "offload", "allocator", "pinned", "inplace", "compile", "serving",
         "snapshots", "fp8", "labs")
LABS = ("lab01_where_memory_goes", "lab02_collectives", "lab03_parallelism", "lab04_zero", "lab05_mixed_precision",
        "lab06_offload", "lab07_checkpointing", "lab08_compression")
INFERENCE = [  # (preset, batch, prompt, new tokens or None for a prefill with all logits, dtype)
    ("llama-3.2-1b", 16, 1024, None, "bf16"), ("llama-3.2-1b", 16, 1024, 128, "bf16"),
    ("gpt2", 32, 512, None, "bf16"), ("gpt2", 32, 512, 128, "bf16"),
    ("mt5-base", 1, 10, None, "fp32"), ("mt5-base", 1, 10, 20, "fp32"),
]
MAXBATCH = dict(model="gpt2", seq_len=512, precision="bf16-mixed")
T0 = time.perf_counter()


def _pinned(package: str) -> str | None:
    """The version requirements.txt pins `package` to (None if it pins none)."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower() == package and version:
            return version.strip()
    return None


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def _bench(name: str = "estimator_accuracy"):
    """A script of benchmarks/ as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_parallel(jobs: list[tuple[str, int, object]], budget: int, workers: int = 4) -> dict[str, object]:
    """Run (name, bytes it will hold, callable) jobs concurrently while the bytes of the running ones
    stay within `budget`; the largest first. Returns {name: result}."""
    cond, held = threading.Condition(), [0]  # one lock guards the budget and the results
    results: dict[str, object] = {}

    def one(name: str, need: int, fn) -> None:
        need = min(need, budget)
        with cond:
            cond.wait_for(lambda: held[0] + need <= budget)
            held[0] += need
        try:
            r = fn()
        finally:
            with cond:
                held[0] -= need
                cond.notify_all()
        with cond:
            results[name] = r
            say(f"  {len(results)}/{len(jobs)} {name}")

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(one, *job) for job in sorted(jobs, key=lambda j: -j[1])]:
            f.result()
    return results


def accuracy(gpu_spec, dry: bool) -> None:
    from vramlab import estimate_training, preset
    from vramlab.measure.record import provenance

    bench = _bench()
    jobs = []
    for name, over, opts in bench.CASES:
        spec = dataclasses.replace(preset(name), **over)
        need = int(estimate_training(spec, gpu=gpu_spec, **opts).total * 1.3) + gpu_spec.context_bytes
        jobs.append((bench.case_name(name, over, opts), need,
                     lambda n=name, o=over, p=opts: bench.run_case(n, o, p, mode="cuda")))
    say(f"accuracy: {len(jobs)} cases, one process each, up to 4 at a time within {0.85 * gpu_spec.usable_bytes / 2**30:.0f} GiB")
    if dry:
        return
    done = run_parallel(jobs, int(0.85 * gpu_spec.usable_bytes))
    rows = [done[n] for n, _, _ in jobs]
    for r in rows:  # peaks are per process; the device's use and step times are shared by the parallel runs
        r["device_in_use_bytes"] = r["step_seconds"] = None
    summary = bench.summarize(rows)
    out = RESULTS / "estimator_accuracy_cuda.json"
    out.write_text(json.dumps({"mode": "cuda", "measured_as": "torch.cuda.max_memory_allocated()",
                               "command": "python benchmarks/gpu_campaign.py", "provenance": provenance("cuda"),
                               "summary": summary, "cases": rows}, indent=1) + "\n")
    worst = max(abs(r["error_pct"]) for r in rows)
    say(f"accuracy: wrote {out.relative_to(ROOT)}; worst |error| {worst:.2f} %")


def inference(gpu_spec, dry: bool) -> list[dict]:
    from vramlab import estimate_inference, preset
    from vramlab.measure.memory import measure_isolated

    say(f"inference: {len(INFERENCE)} configurations, one process each")
    if dry:
        return []
    rows = []
    for name, b, s, new, dtype in INFERENCE:
        est = estimate_inference(name, batch_size=b, seq_len=s, dtype=dtype, new_tokens=new, gpu=gpu_spec)
        # generate() of a random model is slow (a Python loop per token: 20 s for 128 tokens on the H100):
        # no warm-up (the cuBLAS workspace is made during the run either way) and one timed run
        gen = dict(warmup_steps=0, timing_steps=1) if new is not None else {}
        m = measure_isolated("inference", preset(name), batch_size=b, seq_len=s, precision=dtype, mode="cuda",
                             new_tokens=new, **gen)
        row = {"model": name, "batch_size": b, "seq_len": s, "new_tokens": new, "dtype": dtype,
               "estimated": est.total, "estimated_phase": est.phase,
               "peak_allocated": None if m is None else m.peak_allocated,
               "peak_reserved": None if m is None else m.peak_reserved,
               "device_in_use": None if m is None else m.device_in_use, "seconds": None if m is None else m.seconds}
        rows.append(row)
        err = "OOM" if m is None else f"{100 * (est.total - m.peak_allocated) / m.peak_allocated:+.2f} %"
        say(f"  {name} b={b} s={s} new={new} {dtype}: estimate {err}")
    return rows


def maxbatch(gpu_spec, dry: bool) -> list[dict]:
    from vramlab import fit, preset
    from vramlab.measure.memory import largest_batch

    opts = {k: v for k, v in MAXBATCH.items() if k != "model"}
    rows = []
    for expandable in (False, True):
        predicted = fit(MAXBATCH["model"], gpu_spec, expandable_segments=expandable, **opts).max_batch_size
        conf = "expandable_segments:True" if expandable else ""
        say(f"maxbatch: {MAXBATCH['model']} {opts} alloc_conf={conf or 'default'}: fit() says {predicted}; bisecting")
        if dry:
            continue
        measured, probes = largest_batch(preset(MAXBATCH["model"]), start=max(predicted, 1), alloc_conf=conf or None,
                                         progress=lambda m: say("  " + m), **opts)
        rows.append({"case": f"{MAXBATCH['model']} s={opts['seq_len']} {opts['precision']} sdpa adamw foreach",
                     "alloc_conf": conf, "predicted_max_batch": predicted, "measured_max_batch": measured,
                     "probes": {str(k): v for k, v in sorted(probes.items())}})
        say(f"maxbatch: measured {measured}, predicted {predicted}")
    return rows


def fsdp2(dry: bool) -> None:
    mod = _bench("fsdp2_gpu_validation")
    say(f"fsdp2: {len(mod.CASES)} cases, one rank per process, 3 at a time -> benchmarks/results/zero/gpu/")
    if not dry:
        mod.main(["--jobs", "3"])


def offload(dry: bool) -> None:
    mod = _bench("offload_gpu_validation")
    say(f"offload: {len(mod.EXTRA) + len(mod.CASES)} cases, one process each -> benchmarks/results/offload/gpu/")
    if not dry:
        mod.main([])


def pinned_memory(dry: bool, tag: str) -> None:
    """Chapter 6's pinned-memory probes (vramlab.measure.offload --probe bandwidth / loader-pinned), each
    in a fresh process (the pinned host cache is per process), into one file."""
    import subprocess
    import tempfile

    dest = RESULTS / "offload" / "gpu" / f"{tag}_pinned.json"
    say(f"pinned: host link pinned/pageable and a pin_memory DataLoader, one process each -> {dest.relative_to(ROOT)}")
    if dry:
        return
    report: dict = {}
    for probe in ("bandwidth", "loader-pinned"):
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "probe.json"
            r = subprocess.run([sys.executable, "-m", "vramlab.measure.offload", "--probe", probe, "--out", str(f)],
                               capture_output=True, text=True, timeout=600)
            report[probe] = json.loads(f.read_text()) if r.returncode == 0 else \
                {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
            say(f"pinned: {probe} {'done' if r.returncode == 0 else 'failed: ' + report[probe]['error']}")
    from vramlab.measure.record import provenance

    report.update(provenance=provenance("cuda"), command="python benchmarks/gpu_campaign.py --only pinned")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1) + "\n")


def allocator(dry: bool, tag: str) -> None:
    """The allocator probe in a fresh process per setting: a process's allocator state (its cache, its
    segments) is exactly what is measured, so nothing before it may touch the GPU."""
    import subprocess

    out = RESULTS / "allocator" / "gpu"
    for conf in ("", "expandable_segments:True"):
        dest = out / f"{tag}_{'expandable' if conf else 'default'}.json"
        say(f"allocator: GPT-2 b8 s1024 bf16-mixed, empty_cache() and a phase change, alloc_conf={conf or 'default'} "
            f"-> {dest.relative_to(ROOT)}")
        if dry:
            continue
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "allocator_gpu_probe.py"), "--out", str(dest)],
                           env=env, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            say(f"allocator: failed ({r.returncode}): {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
            continue
        res = json.loads(dest.read_text())
        m = res["points"][1]
        say(f"allocator: measured step peak allocated {m['peak_allocated'] / 2**30:.2f} GiB, reserved "
            f"{m['peak_reserved'] / 2**30:.2f} GiB; the model on this trace: "
            f"{res['model_on_this_trace']['peak_reserved'] / 2**30:.2f} GiB reserved")


def inplace_ops(dry: bool, tag: str) -> None:
    """Chapter 1's in-place probe on CUDA's kernels (python -m vramlab.measure.inplace --device cuda): the
    dropout's saved bytes in place and out of place, which the CPU cannot show (its dropout saves the
    noise either way), beside `inplace.mlp_block_memory(device="cuda")`."""
    import subprocess

    dest = RESULTS / "inplace" / f"{tag}.json"
    say(f"inplace: 3 feed-forward sublayers x in-place choices x fp32/bf16 on CUDA -> {dest.relative_to(ROOT)}")
    if dry:
        return
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.inplace", "--device", "cuda", "--out", str(dest)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    say("inplace: " + ((r.stdout.strip().splitlines() or ["done"])[-1] if r.returncode == 0 else
                       f"failed ({r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1]}"))


def compile_step(dry: bool, tag: str) -> None:
    """Chapter 7's compiled blocks on CUDA's inductor under bf16 autocast (python -m vramlab.measure.checkpointing
    compile --device cuda --precision bf16-mixed): what the partitioner saves where the CPU run (fp32,
    benchmarks/results/checkpointing/compile_cpu.json) cannot say, beside checkpointing.compiled_activations."""
    import subprocess

    dest = RESULTS / "checkpointing" / f"compile_{tag}_bf16-mixed.json"
    say(f"compile: 4 blocks x memory budgets on CUDA inductor, bf16-mixed -> {dest.relative_to(ROOT)}")
    if dry:
        return
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.checkpointing", "compile", "--device", "cuda",
                        "--precision", "bf16-mixed", "--out", str(dest)], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800)
    say("compile: " + ("done" if r.returncode == 0 else
                       f"failed ({r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1]}"))


def _script(step: str, script: str, args: list[str], *, timeout: int, env: dict | None = None) -> None:
    """Run benchmarks/<script> in its own process and say its last line (or why it failed)."""
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=env)
    say(f"{step}: " + ((r.stdout.strip().splitlines() or ["done"])[-1] if r.returncode == 0 else
                       f"failed ({r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1]}"))


def serving_vllm(dry: bool, tag: str) -> None:
    """Chapter 1's serving section on a GPU: vLLM's pool and blocks (benchmarks/vllm_serving_probe.py)."""
    dest = RESULTS / "serving" / f"{tag}_vllm.json"
    say(f"serving: vLLM's KV blocks and concurrency for 3 presets, dummy weights -> {dest.relative_to(ROOT)}")
    if not dry:
        _script("serving", "vllm_serving_probe.py", ["--out", str(dest)], timeout=3600,
                env={**os.environ, "VRAMLAB_GPU": tag})


def snapshots(dry: bool) -> None:
    """The real snapshots: benchmarks/snapshot_probe.py, each case in its own process."""
    dest = RESULTS / "snapshots"
    say(f"snapshots: GPT-2 b8 s1024 fp32 after forward and backward, and at a real OOM -> {dest.relative_to(ROOT)}/")
    if not dry:
        _script("snapshots", "snapshot_probe.py", ["--out-dir", str(dest)], timeout=1800)


def fp8_training(dry: bool, tag: str) -> None:
    """Chapter 5's FP8 training on a GPU (benchmarks/fp8_probe.py)."""
    dest = RESULTS / "fp8" / f"{tag}.json"
    say(f"fp8: Llama-3.2-1B b=4 s=2048, bf16 against torchao float8 training -> {dest.relative_to(ROOT)}")
    if not dry:
        _script("fp8", "fp8_probe.py", ["--out", str(dest)], timeout=3600)


def gpu_tag(name: str) -> str:
    """The folder a GPU's lab runs go in: the catalogue's name for the device where it has one
    (labs/results/h100/ on any H100, t4/ on a Colab T4), else the device's name as a file name."""
    from vramlab.specs import gpu_for_device

    spec = gpu_for_device(name)
    if spec is not None:
        return {"h100-80gb": "h100"}.get(spec.name, spec.name)
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "gpu"


def labs(dry: bool, tag: str) -> None:
    sys.path.insert(0, str(ROOT / "labs"))
    import kernelless

    for lab in LABS:
        out = ROOT / "labs" / "results" / tag / f"{lab}_{tag}.json"
        say(f"labs: {lab} (instructor version, no kernel) -> {out.relative_to(ROOT)}")
        if not dry:
            out.parent.mkdir(parents=True, exist_ok=True)
            kernelless.run(lab, results=out, command=f"python benchmarks/gpu_campaign.py (labs/kernelless.py {lab})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps: {', '.join(STEPS)}")
    p.add_argument("--dry-run", action="store_true", help="print the plan; measure nothing (no GPU needed)")
    args = p.parse_args(argv)
    _use_this_checkout()
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"gpu_campaign: unknown step {', '.join(unknown)}; choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    import torch

    from vramlab import gpu as catalogue
    from vramlab.specs import custom_gpu

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        gpu_spec = custom_gpu(torch.cuda.mem_get_info()[1], name=name)
        if "H100" in name:
            gpu_spec = catalogue("h100")
    elif args.dry_run:
        name, gpu_spec = "no GPU (dry run: the H100's catalogue entry)", catalogue("h100")
    else:
        print("gpu_campaign: no CUDA GPU here; run it on a GPU machine (or --dry-run for the plan)", file=sys.stderr)
        return 2
    say(f"GPU campaign on {name}: {', '.join(steps)}")
    pinned = _pinned("transformers")
    import transformers

    if pinned and transformers.__version__ != pinned:
        say(f"warning: transformers {transformers.__version__} here, requirements.txt pins {pinned}: the estimator models "
            f"the pin (T5's self-attention, for one, runs another SDPA kernel before 5.23). Carry the pinned wheel: "
            f"pip download --no-deps transformers=={pinned}, then PYTHONPATH (see benchmarks/results/h100/README.md)")
    report: dict = {}
    out = RESULTS / "gpu_campaign.json"
    if out.exists():
        report = json.loads(out.read_text())
    if "accuracy" in steps:
        accuracy(gpu_spec, args.dry_run)
    for step, run in (("inference", inference), ("maxbatch", maxbatch)):
        if step not in steps:
            continue
        report[step] = run(gpu_spec, args.dry_run)
        if not args.dry_run:  # after each step: a step cut short by a time limit keeps the ones before it
            from vramlab.measure.record import provenance

            report.update(provenance=provenance("cuda"), command="python benchmarks/gpu_campaign.py --only " + args.only)
            out.write_text(json.dumps(report, indent=1) + "\n")
            say(f"wrote {out.relative_to(ROOT)} ({step})")
    if "fsdp2" in steps:
        fsdp2(args.dry_run)
    if "offload" in steps:
        offload(args.dry_run)
    if "allocator" in steps:
        allocator(args.dry_run, gpu_tag(name))
    if "pinned" in steps:
        pinned_memory(args.dry_run, gpu_tag(name))
    if "inplace" in steps:
        inplace_ops(args.dry_run, gpu_tag(name))
    if "compile" in steps:
        compile_step(args.dry_run, gpu_tag(name))
    if "serving" in steps:
        serving_vllm(args.dry_run, gpu_tag(name))
    if "snapshots" in steps:
        snapshots(args.dry_run)
    if "fp8" in steps:
        fp8_training(args.dry_run, gpu_tag(name))
    if "labs" in steps:
        labs(args.dry_run, gpu_tag(name))
    say("done" + (" (dry run: nothing measured)" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
