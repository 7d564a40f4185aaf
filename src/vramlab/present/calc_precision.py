"""Chapter 5's calculator (`precision`): a value in every number format, the training peak of every
precision recipe, and the FP8 recipes' model states."""

from __future__ import annotations

from .. import memory, specs
from .. import precision as P
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, Calculator, Input, Result, both
from .svg import stacked_bars

def _precision(*, value: float, model: str, batch_size: int, fp8_recipe: str = "deepseek-v3") -> Result:
    lines = [f"{'format':10s}{'rounded':>14}{'rel. error':>12}"]
    rounded = {}
    for f in P.FORMATS.values():
        if f.is_float:
            r = P.round_to(value, f)
            rounded[f.name] = r
            lines.append(f"{f.name:10s}{r:>14.6g}{abs(r - value) / value:>12.2e}")
    ests = [memory.estimate_training(model, batch_size=batch_size, seq_len=1024, precision=p) for p in P.PRECISIONS]
    bars = [(p, [(c.replace("_", " "), getattr(e, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for p, e in zip(P.PRECISIONS, ests)]
    svg, narrow = both(stacked_bars, bars, title=f"{model}, b={batch_size}, s=1024: training peak by recipe", wide=720)
    lines += ["", f"{'recipe':20s}{'training peak':>14}"] + [f"{p:20s}{fmt_bytes(e.total):>14}"
                                                             for p, e in zip(P.PRECISIONS, ests)]
    spec = specs.preset(model)
    gemms = [sh for n, sh in spec.param_shapes() if len(sh) == 2 and memory.in_block(n)]
    lines += ["", f"FP8 training recipes, {model}'s model states (the Ultra-Scale Playbook's bytes a parameter; "
                  "scales of its matmul weights)", f"{'recipe':34s}{'B/param':>8}{'states':>12}{'scales':>12}"]
    kept = {}  # each recipe's model states and its scales
    for r in P.FP8_RECIPES.values():
        kept[r.name] = (P.fp8_model_states(r, spec.params)["total"], P.fp8_scale_bytes(r, gemms))
        lines.append(f"{r.name:34s}{r.total:>8g}{fmt_bytes(kept[r.name][0]):>12}{fmt_bytes(kept[r.name][1]):>12}"
                     + (" <" if r.name == fp8_recipe else ""))
    chosen = P.FP8_RECIPES[fp8_recipe]
    lines += ["", f"{chosen.label}: {chosen.note} ({chosen.source})"]
    fp8_states = sum(kept[fp8_recipe])
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "fp16": (rounded["fp16"], f"{rounded['fp16']:.6g}"), "bf16": (rounded["bf16"], f"{rounded['bf16']:.6g}"),
        "fp8": (rounded["fp8-e4m3"], f"{rounded['fp8-e4m3']:.6g}"),
        "amp_peak": (ests[1].total, fmt_bytes(ests[1].total)), "fp8_states": (fp8_states, fmt_bytes(fp8_states))})


PRECISION = Calculator(
    name="precision", title="Number formats and precision recipes", compute=_precision,
    number_labels={"fp16": "in fp16", "bf16": "in bf16", "fp8": "in fp8 e4m3", "amp_peak": "bf16 AMP peak",
                   "fp8_states": "FP8 recipe's model states"},
    inputs=(Input(name="value", label="value", kind="float", default=1e-4, min=1e-10, max=1e5, log=True),
            Input(name="model", label="model", kind="choice", default="gpt2", choices=specs.preset_names()),
            Input(name="batch_size", label="batch size", kind="int", default=8, min=1, max=64),
            Input(name="fp8_recipe", label="FP8 recipe", kind="choice", default="deepseek-v3", choices=tuple(P.FP8_RECIPES))))
