"""Lab 7's measurement: each recompute plan's training step, measured one configuration per
process, against `vramlab.checkpointing`'s prediction (memory) and recompute fraction (time).

    python -m vramlab.measure.checkpointing --out results.json               # memory: trace on CPU, allocator on a GPU
    python -m vramlab.measure.checkpointing --time --out results.json        # and step times (real steps)

Memory is the peak of one steady-state step: on the CPU, FakeTensor tracking of the CPU kernels
(`measure` mode "trace", exact for CPU kernels); on a GPU, `max_memory_allocated`. Time is the
median of the timed steps after a warm-up, with the plan's overhead t_plan / t_none - 1 set beside
the predicted recompute FLOPs over the step's FLOPs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .. import checkpointing as ck
from .. import checks
from ..specs import ModelSpec, SpecError, from_config, preset

# the lab's models: GPT-2 (12 blocks, as released) and a Llama-style model small enough that its
# activations, not its 128k-token embedding, decide the peak (Llama 3.2's block shapes, scaled down)
LLAMA_SMALL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
               "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
MODELS = ("gpt2", "llama-small")
# measured plans: Korthikanti's attention-core recompute and offloading are computed, not measured
PLANS = ("none", "full", "sac-matmuls", "sqrt", "every-2", "first-4", "segments-4")
TIMED = ("none", "full", "sqrt", "sac-matmuls")


def lab_spec(name: str) -> ModelSpec:
    if name == "llama-small":
        return from_config(LLAMA_SMALL, name="llama-small")
    return preset(name)


def _case(spec: ModelSpec, plan: str, *, batch_size: int, seq_len: int, mode: str, precision: str,
          timing_steps: int) -> dict[str, Any]:
    from .memory import measure_isolated

    t0 = time.perf_counter()
    m = measure_isolated("training", spec, batch_size=batch_size, seq_len=seq_len, recompute=plan, mode=mode,
                         precision=precision, warmup_steps=1 if timing_steps else None, timing_steps=timing_steps)
    device = "cuda" if mode == "cuda" else "cpu"
    r = ck.evaluate(spec, plan, batch_size=batch_size, seq_len=seq_len, precision=precision, device=device)
    measured = m.peak_allocated if mode == "cuda" else m.breakdown.total
    return {"model": spec.name, "plan": plan, "batch_size": batch_size, "seq_len": seq_len, "precision": precision,
            "mode": mode, "num_layers": spec.num_layers, "measured_bytes": measured,
            "measured": m.breakdown.to_dict(), "estimated_bytes": r.peak.total, "estimated_phase": r.peak.phase,
            "estimated": r.peak.to_dict(), "error_pct": 100 * (r.peak.total - measured) / measured,
            "recompute_fraction": r.recompute_fraction, "step_seconds": list(m.step_seconds),
            "wall_seconds": round(time.perf_counter() - t0, 2)}


def run(*, models=MODELS, plans=PLANS, batch_size: int = 2, seq_len: int = 512, mode: str = "auto",
        precision: str = "fp32", time_steps: int = 0, timed_plans=TIMED, time_batch: int = 2, time_seq: int = 256,
        progress=print) -> dict[str, Any]:
    """Memory of every plan for every model, and (time_steps > 0) step times of `timed_plans`."""
    from .record import provenance, resolve_mode

    mode_ = resolve_mode(mode)
    if mode_ == "cpu":
        mode_ = "trace"  # memory by tracing the CPU kernels: the same bytes, seconds instead of minutes
        import torch

        torch.set_num_threads(1)  # one compute thread: on a busy machine several wait on each other at every op
    from .memory import check_measurable

    for name in models:  # a plan that cannot be measured fails here, before any process starts
        for p in (*plans, *(timed_plans if time_steps else ())):
            check_measurable(lab_spec(name), p)
    if time_steps and (not timed_plans or timed_plans[0] != "none"):
        raise ValueError("the first timed plan is the baseline the overheads are measured from: it must be none")
    cases, times = [], []
    todo = len(models) * len(plans) + (len(models) * len(timed_plans) if time_steps else 0)
    done = 0
    for name in models:
        spec = lab_spec(name)
        for plan in plans:
            c = _case(spec, plan, batch_size=batch_size, seq_len=seq_len, mode=mode_, precision=precision,
                      timing_steps=0)
            cases.append(c)
            done += 1
            progress(f"[{done}/{todo}] {name} {plan:12s} measured {c['measured_bytes'] / 2**30:6.3f} GiB, "
                     f"predicted {c['estimated_bytes'] / 2**30:6.3f} GiB ({c['error_pct']:+.2f} %)")
    if time_steps:
        tmode = "cuda" if mode_ == "cuda" else "cpu"
        for name in models:
            spec = lab_spec(name)
            b, s = (batch_size, seq_len) if tmode == "cuda" else (time_batch, time_seq)
            rows = []
            for plan in timed_plans:
                c = _case(spec, plan, batch_size=b, seq_len=s, mode=tmode, precision=precision, timing_steps=time_steps)
                rows.append(c)
                done += 1
                med = statistics.median(c["step_seconds"])
                progress(f"[{done}/{todo}] {name} (b={b} s={s}, timed) {plan:12s} "
                         f"step {1e3 * med:7.0f} ms, predicted recompute +{100 * c['recompute_fraction']:.1f} %")
            base = statistics.median(rows[0]["step_seconds"])
            for c in rows:
                c["overhead"] = statistics.median(c["step_seconds"]) / base - 1
            times += rows
    return {"experiment": "activation checkpointing", "mode": mode_, "provenance": provenance(), "cases": cases,
            "timing": times, "time_method": "median of the timed steps after one warm-up step, one process per "
            "plan; overhead = t_plan / t_none - 1 against recompute FLOPs / step FLOPs (checkpointing.flops)"}


PROG = "python -m vramlab.measure.checkpointing"


def _names(option: str, text: str) -> tuple[str, ...]:
    """A comma-separated list given to `option`: at least one name, each once."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        checks.fail(PROG, f"{option} must name at least one, got {text!r}")
    if len(set(names)) != len(names):
        checks.fail(PROG, f"{option} names each once, got {text!r}")
    return names


def _validated(a) -> dict[str, Any]:
    """Every argument and every constraint the models put on them, checked before any process
    starts (`run`'s arguments); one line and SystemExit(2) otherwise."""
    from .memory import check_measurable
    from .record import resolve_mode

    models, plans = _names("--models", a.models), _names("--plans", a.plans)
    if a.timed_plans is not None and not a.time:
        checks.fail(PROG, "--timed-plans applies with --time STEPS only")
    timed = _names("--timed-plans", a.timed_plans) if a.timed_plans is not None else TIMED
    if a.time and timed[0] != "none":
        checks.fail(PROG, f"--timed-plans: the first timed plan is the baseline the overheads are measured from: "
                          f"it must be none, got {timed[0]}")
    try:
        mode = resolve_mode(a.mode)
    except (ValueError, RuntimeError):
        checks.fail(PROG, f"--mode {a.mode} needs a CUDA GPU and this machine has none; use --mode trace or auto")
    mode = "trace" if mode == "cpu" else mode
    device = "cuda" if mode == "cuda" else "cpu"
    sizes = [("--seq-len", a.batch_size, a.seq_len)]
    if a.time and mode != "cuda":  # the CPU times run()'s smaller steps
        sizes.append(("the timed steps' sequence length", 2, 256))
    for name in models:
        try:
            spec = lab_spec(name)
        except (SpecError, ValueError) as e:
            checks.fail(PROG, f"--models: {e}")
        for what, b, s in sizes:
            try:
                checks.positions(spec, s, name=what)
            except ValueError as e:
                checks.fail(PROG, str(e))
        for plan in (*plans, *(timed if a.time else ())):
            try:  # measurable, and predictable for this model at these sizes (what run() asks after measuring)
                check_measurable(spec, plan)
                for _, b, s in sizes:
                    ck.evaluate(spec, plan, batch_size=b, seq_len=s, precision=a.precision, device=device)
            except (ValueError, SpecError, NotImplementedError) as e:
                checks.fail(PROG, str(e))
    return dict(models=models, plans=plans, batch_size=a.batch_size, seq_len=a.seq_len, mode=a.mode,
                precision=a.precision, time_steps=a.time, timed_plans=timed)


def main(argv: list[str] | None = None) -> int:
    A, whole = checks.argtype, checks.whole
    ap = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} or presets")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--batch-size", type=A(whole, int, lo=1, hi=4096), default=2)
    ap.add_argument("--seq-len", type=A(whole, int, lo=1), default=512, help="at most the models' positions")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "fp16-mixed", "bf16"))
    ap.add_argument("--mode", default="auto", choices=("auto", "cuda", "trace"))
    ap.add_argument("--time", type=A(whole, int, lo=0, hi=1000), default=0, metavar="STEPS",
                    help="also time STEPS steps per plan (0: no)")
    ap.add_argument("--timed-plans", default=None,
                    help=f"the plans --time times (the first is the baseline; default {','.join(TIMED)})")
    ap.add_argument("--out", type=Path, help="write the results as JSON here (checked before any measurement)")
    a = ap.parse_args(argv)
    try:  # refusals return 2, as a failed run does
        kw = _validated(a)
        checks.output_path(PROG, a.out, make_folder=True)
    except SystemExit as e:
        return e.code
    try:
        res = run(**kw, progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (ValueError, SpecError, NotImplementedError, RuntimeError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    from .record import write_results

    return write_results(res, "vramlab.measure.checkpointing", argv, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
