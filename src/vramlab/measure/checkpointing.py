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

from .. import activations
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


def _names(option: str, text: str, prog: str = PROG) -> tuple[str, ...]:
    """A comma-separated list given to `option`: at least one name, each once."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        checks.fail(prog, f"{option} must name at least one, got {text!r}")
    if len(set(names)) != len(names):
        checks.fail(prog, f"{option} names each once, got {text!r}")
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




# ============================================================================ what torch.compile keeps
# `python -m vramlab.measure.checkpointing compile --out FILE`: one block of each model, eager and
# compiled (inductor; on the CPU here), the bytes it saves for backward counted where autograd hands
# them over: `torch.autograd.graph.saved_tensors_hooks` sees eager ops' saves and the compiled
# function's `save_for_backward` alike (unique storages; parameters and the block's other inputs
# (rotary tables, masks) left out: they are no activations). Fused attention (SDPA against eager) and
# chunked cross-entropy are measured the same way, their peaks with live-tensor tracking.

def _no_dropout(spec: ModelSpec) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, attention_dropout=0.0, hidden_dropout=0.0,
                               name=spec.name if spec.attention_dropout == spec.hidden_dropout == 0 else f"{spec.name} (no dropout)")


# other configurations than the lab's: a GPT-NeoX (parallel residual, partial rotary) and an OPT block
NEOX_SMALL = {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 1024, "rotary_pct": 0.25,
              "use_parallel_residual": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}
OPT_SMALL = {"model_type": "opt", "hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
             "vocab_size": 1024, "max_position_embeddings": 1024, "word_embed_proj_dim": 256, "dropout": 0.0,
             "attention_dropout": 0.0, "do_layer_norm_before": True}
COMPILE_MODELS = ("gpt2", "llama-small", "neox-small", "opt-small")  # the lab's two, and two others
BUDGETS = (1.0, 0.5, 0.0)


def compile_spec(name: str) -> ModelSpec:
    """The compile experiment's models, without dropout (its masks are random ops the estimator leaves out)."""
    if name == "neox-small":
        return from_config(NEOX_SMALL, name="neox-small")
    if name == "opt-small":
        return from_config(OPT_SMALL, name="opt-small")
    return _no_dropout(lab_spec(name))


def block_saved_bytes(spec: ModelSpec, *, batch_size: int, seq_len: int, compiled: bool = False,
                      memory_budget: float = 1.0, attention: str = "sdpa", device: str = "cpu",
                      precision: str = "fp32") -> dict[str, Any]:
    """The bytes block 0 of `spec` saves for backward (unique storages seen by saved_tensors_hooks),
    run eagerly or through `torch.compile` (with `torch._functorch.config.activation_memory_budget`
    set to `memory_budget`). The block runs on the inputs the model gives it (captured from a forward
    of a one-block model) and its backward runs, to show the saved set is what it needs. `device`
    "cuda" runs CUDA's kernels (the GPU campaign's `compile` step); `precision` "fp32", "bf16" (the
    model in bf16) or "bf16-mixed" (fp32 weights under autocast)."""
    import contextlib
    import dataclasses

    import torch
    import torch._functorch.config as fconfig

    from .memory import block_list
    from .models import build_model, make_batch

    if precision not in ("fp32", "bf16", "bf16-mixed"):
        raise ValueError(f"precision must be fp32, bf16 or bf16-mixed, got {precision!r}")
    one = dataclasses.replace(spec, num_layers=1)
    torch.manual_seed(0)
    model = build_model(one, attention=attention, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    model.to(device)
    block = block_list(model, one)[0]

    def amp():
        return torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    got: dict[str, Any] = {}

    def capture(module, args, kwargs):
        got["args"], got["kwargs"] = args, dict(kwargs)

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad(), amp():
        model(**make_batch(one, batch_size=batch_size, seq_len=seq_len, with_labels=False, device=device))
    handle.remove()
    args, kwargs = got["args"], got["kwargs"]
    hidden = args[0] if args else kwargs.pop("hidden_states")
    rest = args[1:] if args else ()
    hidden = hidden.detach().clone().requires_grad_()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for v in (*rest, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                skip.add(t.untyped_storage().data_ptr())
    fn = block
    if compiled:
        torch._dynamo.reset()  # a fresh compile: the budget is read when the graph is partitioned
        fn = torch.compile(block)
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape))
        return t

    t0 = time.perf_counter()
    with fconfig.patch(activation_memory_budget=memory_budget), amp(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(hidden, *rest, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    ok = hidden.grad is not None and bool(torch.isfinite(hidden.grad).all())
    return {"bytes": sum(n for n, _ in seen.values()), "tensors": len(seen),
            "shapes": sorted((list(s) for _, s in seen.values()), key=lambda s: -len(s)),
            "backward_ok": ok, "seconds": round(time.perf_counter() - t0, 2)}


class _LivePeak:
    """The peak of bytes held by live tensors created inside (unique storages; a dispatch mode sees
    every op's outputs, a weakref finalizer each storage's end)."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        peak = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch

                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        key = st.data_ptr()
                        if key and key not in peak.live:
                            peak.live[key] = st.nbytes()
                            peak.now += st.nbytes()
                            peak.peak = max(peak.peak, peak.now)
                            weakref.finalize(st, peak._free, key)
                return out

        self.mode, self.live, self.now, self.peak = Mode(), {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def cross_entropy_bytes(*, tokens: int, hidden_size: int, vocab_size: int, chunk_tokens: int | None = None) -> dict:
    """One loss and its backward from hidden states (tokens x hidden, fp32) through an LM head
    (vocab x hidden): `F.cross_entropy(h @ W.T, y)` whole, or chunk by chunk of `chunk_tokens` inside
    `torch.utils.checkpoint` (the chunk's logits recomputed in the backward). Returns the bytes saved
    for backward beyond the hidden states and the head ('saved'), the peak of tensors alive during
    forward and backward beyond them ('peak'), and the loss and gradients' agreement with the whole
    loss ('max_grad_diff'). The peak counts every tensor made inside (gradients included), the inputs
    (hidden states, head, targets) not."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    head = torch.randn(vocab_size, hidden_size, generator=g) * hidden_size ** -0.5
    y = torch.randint(0, vocab_size, (tokens,), generator=g)

    def loss_of(h, w):
        if chunk_tokens is None:
            return F.cross_entropy(h @ w.T, y)
        parts = [checkpoint(lambda hc, yc: F.cross_entropy(hc @ w.T, yc, reduction="sum"), h[a:a + chunk_tokens],
                            y[a:a + chunk_tokens], use_reentrant=False) for a in range(0, tokens, chunk_tokens)]
        return torch.stack(parts).sum() / tokens

    h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    skip = {t.untyped_storage().data_ptr() for t in (h, w, y)}  # the inputs: hidden states, head, targets
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with _LivePeak() as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(h, w)
        loss.backward()
    h0, w0 = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    ref = F.cross_entropy(h0 @ w0.T, y)
    ref.backward()
    diff = max(float((h.grad - h0.grad).abs().max()), float((w.grad - w0.grad).abs().max()),
               float((loss - ref).detach().abs()))
    return {"saved": sum(seen.values()), "peak": live.peak, "max_grad_diff": diff}


CE_CASES = ({"tokens": 1024, "hidden_size": 64, "vocab_size": 4096}, {"tokens": 512, "hidden_size": 32, "vocab_size": 8192})
CE_CHUNKS = (None, 256, 128)


def run_compile(*, models=COMPILE_MODELS, budgets=BUDGETS, batch_size: int = 2, seq_len: int = 256,
                progress=print, device: str = "cpu", precision: str = "fp32") -> dict[str, Any]:
    """Saved bytes of one block of each model: eager (SDPA and eager attention) and compiled at each
    activation_memory_budget, beside `checkpointing.compiled_activations`; and cross-entropy whole
    and chunked beside `checkpointing.loss_bytes`. Inductor compiles on the CPU: minutes in all."""
    import torch

    from .record import provenance

    torch.set_num_threads(1)
    cases = []
    for name in models:
        spec = compile_spec(name)
        row: dict[str, Any] = {"model": spec.name, "family": spec.family, "batch_size": batch_size, "seq_len": seq_len,
                               "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size}
        for attention in ("sdpa", "eager"):
            m = block_saved_bytes(spec, batch_size=batch_size, seq_len=seq_len, attention=attention, device=device,
                                  precision=precision)
            pred = activations.activation_bytes(spec, batch_size=batch_size, seq_len=seq_len, attention=attention,
                                            device=device, precision=precision)["full"][0]
            row[f"eager_{attention}"] = {"measured": m["bytes"], "estimated": pred, "tensors": m["tensors"]}
            progress(f"{name} eager ({attention} attention): measured {m['bytes']:,} B, ledger {pred:,} B")
        row["compiled"] = []
        for b in budgets:
            m = block_saved_bytes(spec, batch_size=batch_size, seq_len=seq_len, compiled=True, memory_budget=b,
                                  device=device, precision=precision)
            est = ck.compiled_activations(spec, batch_size=batch_size, seq_len=seq_len, memory_budget=b, device=device,
                                          precision=precision)
            row["compiled"].append({"memory_budget": b, "measured": m["bytes"], "tensors": m["tensors"],
                                    "shapes": m["shapes"], "backward_ok": m["backward_ok"],
                                    "estimated_default": est["compiled"], "estimated_bound": est["budget"],
                                    "minimum": est["minimum"], "compile_and_run_seconds": m["seconds"]})
            progress(f"{name} compiled, budget {b}: measured {m['bytes']:,} B, predicted at most {est['budget']:,} B "
                     f"({m['seconds']:.0f} s; {m['tensors']} tensors)")
        cases.append(row)
    ce = []
    for case in CE_CASES:
        for chunk in CE_CHUNKS:
            m = cross_entropy_bytes(**case, chunk_tokens=chunk)
            est = ck.loss_bytes(**case, chunk_tokens=chunk)
            ce.append({**case, "chunk_tokens": chunk, "measured_saved": m["saved"], "measured_peak": m["peak"],
                       "estimated_saved": est["saved"], "estimated_peak": est["peak"], "max_grad_diff": m["max_grad_diff"]})
            progress(f"cross-entropy {case} chunk {chunk}: peak measured {m['peak']:,} B, "
                     f"estimated {est['peak']:,} B")
    return {"experiment": "torch.compile: saved activations, eager against compiled", "mode": f"{device}-inductor",
            "precision": precision, "provenance": provenance(device if device == "cuda" else None), "blocks": cases,
            "cross_entropy": ce, "cross_entropy_device": "cpu",
            "method": "saved_tensors_hooks on one block's forward (unique storages, parameters and the block's other "
                      "inputs left out), eager and torch.compile (inductor, CPU) with "
                      "torch._functorch.config.activation_memory_budget patched; cross-entropy: live tensors "
                      "(a dispatch mode with weakref finalizers) over forward and backward, the inputs left out"}


def compile_main(argv: list[str]) -> int:
    """`python -m vramlab.measure.checkpointing compile [--models ...] [--seq-len N] [--out FILE]`."""
    prog = f"{PROG} compile"
    A, whole = checks.argtype, checks.whole
    ap = checks.Parser(prog=prog, description=run_compile.__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(COMPILE_MODELS), help=f"comma-separated, of {', '.join(COMPILE_MODELS)}")
    ap.add_argument("--batch-size", type=A(whole, int, lo=1, hi=64), default=2)
    ap.add_argument("--seq-len", type=A(whole, int, lo=1, hi=1024), default=256)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="whose kernels (default cpu)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "bf16-mixed"), default="fp32", help="default fp32")
    try:
        a = ap.parse_args(argv)
        if a.device == "cuda" and not __import__("torch").cuda.is_available():
            checks.fail(prog, "--device cuda needs a CUDA GPU (the GPU campaign's compile step runs it)")
        models = _names("--models", a.models, prog)
        bad = [m for m in models if m not in COMPILE_MODELS]
        if bad:
            checks.fail(prog, f"--models: unknown model {bad[0]!r}; choose from {', '.join(COMPILE_MODELS)}")
        checks.output_path(prog, a.out, make_folder=True)
    except SystemExit as e:
        return e.code
    res = run_compile(models=models, batch_size=a.batch_size, seq_len=a.seq_len, device=a.device, precision=a.precision,
                      progress=lambda s: print(s, file=sys.stderr, flush=True))
    from .record import write_results

    return write_results(res, "vramlab.measure.checkpointing compile", argv, a.out)


if __name__ == "__main__":
    raise SystemExit(compile_main(sys.argv[2:]) if sys.argv[1:2] == ["compile"] else main())
