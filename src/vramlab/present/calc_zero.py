"""Chapter 4's calculator (`zero`): one rank's memory under ZeRO stages 0-3 and FSDP2, its fit and its
communication."""

from __future__ import annotations

from .. import collectives as C
from .. import memory, specs
from .. import zero as Z
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, GPU_CHOICES, SEQ_CHOICES, Calculator, Input, Result, both
from .svg import stacked_bars

def _zero(*, model: str, setup: str, ranks: int, recipe: str, micro_batch_size: int, seq_len: int, gpu: str,
          link: str, accumulation_steps: int = 1) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    impl, stage = ("fsdp2", 3) if setup == "fsdp2" else ("deepspeed", int(setup))
    kw = dict(micro_batch_size=micro_batch_size, seq_len=seq_len, recipe=recipe, gpu=g,
              accumulation_steps=accumulation_steps)
    rows = [(f"ZeRO-{s}", Z.estimate_rank(spec, ranks, s, **kw)) for s in Z.STAGES]
    rows.append(("FSDP2", Z.estimate_rank(spec, ranks, 3, implementation="fsdp2", **kw)))
    mine = Z.estimate_rank(spec, ranks, stage, implementation=impl, **kw)
    verdict = Z.fits(spec, ranks, stage, g, implementation=impl, **{k: v for k, v in kw.items() if k != "gpu"})
    ok = verdict.fits
    pb, gb, k = Z.RECIPES[recipe]
    comm = Z.communication(spec.params, ranks, stage, bytes_per_value=gb, link=link,
                           implementation="deepspeed" if impl == "deepspeed" else "paper",
                           accumulation_steps=accumulation_steps)
    bars = [(label, [(c.replace("_", " "), getattr(b, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for label, b in rows]
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name} on {ranks} ranks, {recipe}: one rank's peak",
                       line=(g.usable_bytes / GiB, f"{g.name} usable"))
    paper = Z.paper_per_rank(spec.params, ranks, stage, k=k, param_bytes=pb, grad_bytes=gb)
    lines = [mine.table(title=mine.label), "",
             str(verdict), verdict.explain(),
             f"the paper's model states alone: {fmt_bytes(paper.total)} per rank",
             f"communication per step: {fmt_bytes(comm['bytes_sent_per_rank'])} sent per rank "
             f"({comm['volume_in_psi']:.0f} Psi), {comm['seconds'] * 1e3:.1f} ms over {link}",
             f"peak phase: {mine.phase} (model states between steps + the step's worst phase, "
             "checked against lab 4's measured steps)"]
    if accumulation_steps > 1:
        held = Z.accumulation_held(spec, ranks, stage, recipe=recipe, implementation=impl)
        lines.append(f"{accumulation_steps} micro-batches per step: held between them {fmt_bytes(held['bytes'])} "
                     f"({held['what']})")
        if impl == "fsdp2":
            ns = Z.estimate_rank(spec, ranks, 3, implementation="fsdp2", no_sync=True, **kw)
            lines.append(f"FSDP2 with set_requires_gradient_sync(False) but on the last: peak {fmt_bytes(ns.total)} "
                         "(the unsharded gradients kept), one reduce-scatter per step")
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "per_rank": (mine.total, fmt_bytes(mine.total)), "fits": (int(ok), "yes" if ok else "no"),
        "comm_ms": (comm["seconds"] * 1e3, f"{comm['seconds'] * 1e3:.1f} ms")})


ZERO = Calculator(
    name="zero", title="ZeRO and FSDP: one rank's memory", compute=_zero,
    number_labels={"per_rank": "one rank's peak", "fits": "fits", "comm_ms": "communication per step"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.1-8b", choices=specs.preset_names()),
            Input(name="setup", label="ZeRO stage", kind="choice", default="3", choices=("0", "1", "2", "3", "fsdp2")),
            Input(name="ranks", label="data-parallel ranks", kind="choice", default=8,
                  choices=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
            Input(name="recipe", label="recipe", kind="choice", default="mixed-adam", choices=tuple(Z.RECIPES)),
            Input(name="micro_batch_size", label="micro-batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=2048, choices=SEQ_CHOICES),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="link", label="link", kind="choice", default="nvlink4", choices=tuple(C.LINKS)),
            Input(name="accumulation_steps", label="micro-batches per step", kind="choice", default=1,
                  choices=(1, 2, 4, 8, 16, 32))))
