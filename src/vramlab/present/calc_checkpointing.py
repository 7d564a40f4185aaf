"""Chapter 7's calculator (`checkpointing`): a recompute plan's peak against its extra compute, and the plan
with the least recompute that fits."""

from __future__ import annotations

from .. import checkpointing as CK
from .. import activations, memory, specs
from .. import precision as P
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, GPU_CHOICES, SEQ_CHOICES, Calculator, Input, Result, both
from .svg import stacked_bars

def _checkpointing(*, model: str, plan: str, batch_size: int, seq_len: int, precision: str, gpu: str) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    kw = dict(batch_size=batch_size, seq_len=seq_len, precision=precision, gpu=gpu)
    plans = list(CK.PLANS)
    if plan not in plans:
        plans.append(plan)
    results = {p: CK.evaluate(spec, p, **kw) for p in plans}
    mine = results[plan]
    bars = [(f"{p} (+{100 * r.recompute_fraction:.0f} %)",
             [(c.replace("_", " "), getattr(r.peak, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for p, r in results.items()]
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}, b={batch_size}, s={seq_len}, {precision}: peak by plan "
                                   "(extra FLOPs in brackets)", line=(g.usable_bytes / GiB, f"{g.name} usable"))
    best = CK.cheapest_plan(spec, None, **kw)
    lines = [mine.peak.table(title=f"plan {plan}: peak at {mine.peak.phase}"), "",
             f"recompute: {100 * mine.recompute_fraction:.1f} % of the step's FLOPs; step ≈ {1e3 * mine.step_seconds:,.0f} ms "
             f"on {g.name} at {100 * CK.MFU:.0f} % of its peak FLOP/s",
             str(mine.fit), mine.fit.explain(),
             (f"the plan with the least recompute that fits: {_plan_name(best.plan.name)} "
              f"({fmt_bytes(best.peak.total)}, +{100 * best.recompute_fraction:.1f} % FLOPs)") if best else
             "no plan fits, not even the one that recomputes most: fewer tokens per step, or a bigger GPU",
             _compiled_line(spec, batch_size=batch_size, seq_len=seq_len, precision=precision)]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "peak": (mine.peak.total, fmt_bytes(mine.peak.total)),
        "recompute": (mine.recompute_fraction, f"+{100 * mine.recompute_fraction:.1f} %"),
        "cheapest": (0 if best is None else best.peak.total, _plan_name(best.plan.name) if best else NO_PLAN_FITS)})


NO_PLAN_FITS = "no plan fits"


def _compiled_line(spec, *, batch_size: int, seq_len: int, precision: str) -> str:
    """What torch.compile's partitioner keeps per block (no plan), where the compiled ledger covers the model."""
    if spec.family not in ("gpt2", "gpt_neox", "opt", "llama") or spec.attention_dropout > 0 or spec.hidden_dropout > 0:
        return (f"torch.compile: what its partitioner keeps is modelled for decoder blocks without dropout, "
                f"not {spec.name}")
    c = CK.compiled_activations(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, device="cuda")
    checked = "" if precision == "fp32" else " (checked in fp32 on CPU inductor only)"
    if activations.uses_math_attention(spec, "sdpa", "cuda", precision):  # eager keeps the scores here; the compiled ledger does not
        checked += " (with a fused attention kernel; here eager SDPA falls back to the math path)"
    return (f"torch.compile, no plan: each block keeps {fmt_bytes(c['compiled'])} for backward instead of "
            f"{fmt_bytes(c['eager'])} eager{checked}; activation_memory_budget=0 keeps only its input, "
            f"{fmt_bytes(c['minimum'])}")


def _plan_name(name: str) -> str:
    """A plan as a reader reads it: the plan called 'none' recomputes nothing (it is not 'no plan')."""
    return "none (recompute nothing)" if name == "none" else name


CHECKPOINTING = Calculator(
    name="checkpointing", title="Activation checkpointing: memory against recompute", compute=_checkpointing,
    number_labels={"peak": "peak of the step", "recompute": "extra compute",
                   "cheapest": "the plan with the least recompute that fits"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.2-1b", choices=specs.preset_names()),
            Input(name="plan", label="recompute plan", kind="choice", default="full",
                  choices=CK.PLANS + ("every-2", "first-4", "segments-4")),
            Input(name="batch_size", label="batch size", kind="int", default=4, min=1, max=128),
            Input(name="seq_len", label="sequence length", kind="choice", default=2048, choices=SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default="bf16-mixed", choices=P.PRECISIONS),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES)))
