"""Does it fit: one answer per `vramlab` subcommand (`answer`), as its chapter's calculator computes it: the bytes
needed on the fullest GPU against what is usable, and the largest batch that fits; and each command's options
for the library, after the checks that span flags (`estimate_options`, `lora_precision`, `prompt_options`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable

from .. import checks, fitting, memory, specs
from .. import checkpointing as CK
from .. import compression as COMP
from .. import offload as OFF
from .. import parallel as PAR
from .. import precision as P
from .. import zero as Z
from .. import context_parallel as CP
from ..units import fmt_bytes
from .cli_args import OFFLOAD_SCHEMES, PROMPT_METHODS

# a ZeRO rank's recipe (zero.RECIPES) for each --precision: DeepSpeed and FSDP keep fp32 master weights
# and Adam's fp32 moments beside a 16-bit model; pure bf16 (bf16 optimizer states) is not one of theirs
ZERO_RECIPE = {"fp32": "fp32-adam", "bf16-mixed": "mixed-adam", "fp16-mixed": "mixed-adam",
               "bf16-fp32-states": "mixed-adam", "fp16-fp32-master": "mixed-adam"}
# the base's precision of each fine-tuning method, as the compression calculator chooses it
LORA_PRECISION = {"full": "bf16-mixed", "lora": "bf16", "lora-int8": "bf16", "qlora": "bf16", "prompt": "bf16",
                  "prefix": "bf16", "p-tuning": "bf16"}


@dataclass(frozen=True)
class Answer:
    """Does it fit: bytes needed on the fullest GPU (`fitting.device_fit`) of what is usable, and the
    largest batch (`of` says which) that fits, where searched."""

    fits: bool
    needed: int
    available: int
    largest: int | None = None
    of: str = "batch size"
    capped: bool = False
    note: str = ""

    def short(self) -> str:
        s = f"{fmt_bytes(self.needed)}, {'fits' if self.fits else 'does NOT fit'}"
        if self.largest:
            s += f", {self.of} ≤ {self.largest:,}" + ("+" if self.capped else "")
        return s + (f"; {self.note}" if self.note else "")

    def to_dict(self) -> dict:
        return {"fits": self.fits, "needed_bytes": self.needed, "usable_bytes": self.available,
                "largest": self.largest, "largest_of": self.of, "note": self.note}


_SPECS: dict = {}


def model_spec(ns) -> specs.ModelSpec:
    key = (ns.model, ns.hf_config)
    if key not in _SPECS:
        _SPECS[key] = specs.preset(ns.model) if ns.model else specs.from_config(ns.hf_config)
    return _SPECS[key]


def gpu_of(ns) -> specs.GPUSpec | None:
    return specs.gpu(ns.gpu) if ns.gpu is not None else None


def is_sharded(ns) -> bool:
    return ns.command == "estimate" and (ns.zero is not None or ns.fsdp2)


def _galore(ns) -> dict:
    """--galore-rank, which only GaLore takes."""
    if ns.galore_rank is None:
        return {}
    if ns.optimizer != "galore-adamw":
        raise ValueError("--galore-rank is GaLore's projection rank: give --optimizer galore-adamw too")
    return {"galore_rank": ns.galore_rank}


def estimate_options(ns) -> tuple[dict, argparse.Namespace]:
    """estimate's options for the library, after every check that spans flags."""
    spec, gpu = model_spec(ns), gpu_of(ns)
    only = {"train": ("optimizer", "optimizer_impl", "recompute", "zero", "gpus", "recipe", "accumulation_steps", "loss",
                      "loss_chunk_tokens", "capacity_factor", "optimizer_in_backward", "galore_rank"),
            "infer": ("new_tokens",)}
    for mode, flags in only.items():
        given = [f for f in flags if getattr(ns, f) is not None] + (["fsdp2"] if mode == "train" and ns.fsdp2 else [])
        if mode != ns.mode and given:
            raise ValueError(f"--{given[0].replace('_', '-')} does not apply to 'estimate {ns.mode}' "
                             f"(it is for 'estimate {mode}')")
    if gpu and ns.device != "cuda":
        raise ValueError("--gpu checks the fit on a GPU: leave --device at cuda")
    if ns.expandable_segments and not gpu:
        raise ValueError("--expandable-segments changes the fit on a GPU: give --gpu too")
    if ns.mode == "infer":
        if ns.new_tokens is not None:
            checks.has_decoder(spec, "--new-tokens (generation; leave it out for a prefill)")
        return dict(seq_len=ns.seq_len, dtype=ns.precision or "bf16", attention=ns.attention,
                    new_tokens=ns.new_tokens, device=ns.device), ns
    if not is_sharded(ns):
        for f in ("gpus", "recipe"):
            if getattr(ns, f) is not None:
                raise ValueError(f"--{f} is for one rank of many: give --zero 0-3 or --fsdp2 too "
                                 "(tensor and pipeline parallelism: `vramlab plan`)")
        return dict(seq_len=ns.seq_len, precision=ns.precision or "fp32", optimizer=ns.optimizer or "adamw",
                    optimizer_impl=ns.optimizer_impl or "foreach", attention=ns.attention,
                    recompute=ns.recompute or "none", device=ns.device,
                    accumulation_steps=ns.accumulation_steps or 1, loss=ns.loss or "whole",
                    loss_chunk_tokens=ns.loss_chunk_tokens, capacity_factor=ns.capacity_factor,
                    optimizer_in_backward=bool(ns.optimizer_in_backward), **_galore(ns)), ns
    if ns.loss is not None or ns.loss_chunk_tokens is not None:
        raise ValueError("--loss prices one GPU's step: leave it out with --zero/--fsdp2 (zero.estimate_rank models the "
                         "whole loss)")
    if ns.capacity_factor is not None or spec.is_moe:
        raise ValueError("a mixture of experts is priced on one GPU (`estimate train`) or split over ranks by expert "
                         "parallelism (expert_parallel.expert_parallel); ZeRO and FSDP ranks are modelled for dense models")
    if ns.fsdp2 and ns.zero not in (None, 3):
        raise ValueError(f"--fsdp2 shards like ZeRO-3: leave --zero out (or give --zero 3), not --zero {ns.zero}")
    if ns.recompute is not None:
        raise ValueError("--recompute does not apply with --zero/--fsdp2: zero.estimate_rank models no activation "
                         "checkpointing (layouts that recompute: `vramlab plan`)")
    if ns.optimizer not in (None, "adam", "adamw"):
        raise ValueError(f"--optimizer {ns.optimizer}: ZeRO and FSDP are estimated with Adam(W) only")
    if ns.optimizer_in_backward or ns.galore_rank is not None:
        raise ValueError(f"--{'optimizer-in-backward' if ns.optimizer_in_backward else 'galore-rank'} is modelled on "
                         "one GPU: leave out --zero/--fsdp2")
    if ns.device != "cuda":
        raise ValueError("--zero/--fsdp2 estimate a GPU rank: leave --device at cuda")
    if ns.recipe is not None and ns.precision is not None:
        raise ValueError("give --precision or --recipe with --zero/--fsdp2, not both (--recipe says the bytes per "
                         "parameter directly)")
    recipe = ns.recipe
    if recipe is None:
        precision = ns.precision or "fp32"
        if precision not in ZERO_RECIPE:
            checks.one_of("precision", precision, P.PRECISIONS)
            raise ValueError(f"--precision {precision} (bf16 optimizer states) is not a ZeRO recipe: DeepSpeed and "
                             "FSDP keep fp32 master weights and Adam states; use --precision bf16-mixed")
        recipe = ZERO_RECIPE[precision]
    return dict(recipe=recipe, implementation="fsdp2" if ns.fsdp2 else "deepspeed", attention=ns.attention,
                optimizer_impl=ns.optimizer_impl or "fused", accumulation_steps=ns.accumulation_steps or 1), ns


def zero_stage(ns) -> int:
    return 3 if ns.fsdp2 else ns.zero


def answer_estimate(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    spec, gpu = model_spec(ns), gpu_of(ns)
    if gpu is None:
        raise ValueError("give --gpu to check the fit")
    options, _ = estimate_options(ns)
    if is_sharded(ns):
        f = Z.fits(spec, ns.gpus or 1, zero_stage(ns), gpu, micro_batch_size=ns.batch_size, seq_len=ns.seq_len,
                   expandable_segments=ns.expandable_segments, max_search=1 << 12 if search else 1, **options)
        f = dataclasses.replace(f, batch_size=ns.batch_size)
        of = "micro-batch"
    else:
        fit_options = {k: v for k, v in options.items() if k != "device"}
        f = fitting.fit(spec, gpu, batch_size=ns.batch_size, mode=ns.mode, expandable_segments=ns.expandable_segments,
                        max_search=1 << 16 if search else 1, **fit_options)
        of = "batch size"
    return Answer(f.fits, f.needed, f.available, f.max_batch_size if search else None, of, f.capped), f


def _largest(fits: Callable[[int], bool], start: int, search: bool, limit: int = 1 << 12) -> tuple[int | None, bool]:
    if not search:
        return None, False
    lo = fitting.largest_true(fits, start=start, limit=limit)
    return lo, lo >= limit


def prompt_options(ns) -> dict:
    """peft_training's prompt-learning options, refusing the flags that belong to another method."""
    if ns.method in PROMPT_METHODS:
        if ns.prefix_projection and ns.method != "prefix":
            raise ValueError(f"--prefix-projection is prefix tuning's reparameterisation MLP, not {ns.method}'s")
        return dict(num_virtual_tokens=ns.virtual_tokens or 20, prefix_projection=ns.prefix_projection)
    if ns.virtual_tokens is not None or ns.prefix_projection:
        raise ValueError(f"--virtual-tokens and --prefix-projection are for prompt, prefix and p-tuning, not {ns.method}")
    return {}


def lora_precision(ns) -> str:
    if ns.method in ("qlora", "lora-int8") and ns.precision not in (None, "bf16"):
        raise ValueError(f"--precision {ns.precision} does not apply to {ns.method}: its quantized base computes in "
                         "bf16 (adapters fp32); leave --precision out")
    return ns.precision or LORA_PRECISION[ns.method]


def lora_fit(ns, batch_size: int) -> tuple[memory.MemoryBreakdown, fitting.Fit]:
    """As the compression calculator: `peft_training` against `fitting.device_fit` (fragmentation as
    bf16 AMP's, or fp32's for an fp32 step)."""
    spec, g, precision = model_spec(ns), gpu_of(ns), lora_precision(ns)
    peak = COMP.peft_training(spec, method=ns.method, rank=ns.rank, targets=ns.targets, batch_size=batch_size,
                              seq_len=ns.seq_len, precision=precision, optimizer=ns.optimizer, recompute=ns.recompute,
                              gpu=g, **prompt_options(ns))
    frag = fitting.fragmentation_bytes(spec, batch_size=batch_size, seq_len=ns.seq_len, mode="train",
                                       precision="fp32" if precision == "fp32" else "bf16-mixed")
    return peak, fitting.device_fit(peak, g, largest_tensor=frag)


def answer_lora(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    _, f = lora_fit(ns, ns.batch_size)
    lo, capped = _largest(lambda b: lora_fit(ns, b)[1].fits, ns.batch_size, search)
    return Answer(f.fits, f.needed, f.available, lo, "batch size", capped), dataclasses.replace(
        f, max_batch_size=lo, capped=capped, batch_size=ns.batch_size)


def offload_rows(spec, g, batch_size: int, seq_len: int, schemes=("none",) + OFFLOAD_SCHEMES) -> dict:
    """As the offload calculator: scheme -> (GPU peak, host bytes, bytes over PCIe, step seconds)."""
    kw = dict(batch_size=batch_size, seq_len=seq_len)
    gpu_s = CK.evaluate(spec, "none", precision="bf16-mixed", gpu=g, **kw).step_seconds  # at CK.MFU
    rows = {}
    if {"none", "save-on-cpu"} & set(schemes):
        act = OFF.activation_offload(spec, precision="bf16-mixed", gpu=g, baseline_seconds=gpu_s, **kw)
        rows["none"] = (act.baseline_peak, 0, 0, gpu_s)
        rows["save-on-cpu"] = (act.gpu_peak, act.host_bytes, 2 * act.moved_bytes, act.step_seconds)
    for s in ("zero-offload", "fsdp2-cpu"):
        if s in schemes:
            m = OFF.model_offload(spec, scheme=s, gpu=g, gpu_seconds=gpu_s, **kw)
            rows[s] = (m.gpu_peak, m.host_bytes, m.moved_bytes, m.step_seconds)
    return {s: rows[s] for s in schemes}


def _offload_fit(ns, batch_size: int, scheme: str | None = None) -> fitting.Fit:
    spec, g = model_spec(ns), gpu_of(ns)
    peak = offload_rows(spec, g, batch_size, ns.seq_len, (scheme or ns.scheme,))[scheme or ns.scheme][0]
    frag = fitting.fragmentation_bytes(spec, precision="bf16-mixed", batch_size=batch_size, seq_len=ns.seq_len)
    return fitting.device_fit(peak, g, largest_tensor=frag)


def answer_offload(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    f = _offload_fit(ns, ns.batch_size)
    lo, capped = _largest(lambda b: _offload_fit(ns, b).fits, ns.batch_size, search)
    return Answer(f.fits, f.needed, f.available, lo, "batch size", capped), dataclasses.replace(
        f, max_batch_size=lo, capped=capped, batch_size=ns.batch_size)


def ck_kw(ns, batch_size: int) -> dict:
    return dict(batch_size=batch_size, seq_len=ns.seq_len, precision=ns.precision, optimizer=ns.optimizer,
                attention=ns.attention, gpu=gpu_of(ns))


def _some_plan_fits(spec, kw: dict) -> bool:
    """Whether a plan fits, quickly: checkpointing every block, on the GPU or offloaded, keeps the least
    (a plan that fits beside them is what `cheapest_plan` then finds)."""
    return any(CK.evaluate(spec, p, **kw).fit.fits for p in ("full", "offload"))


def answer_checkpoint(ns, search: bool = True) -> tuple[Answer, CK.PlanResult | None]:
    spec = model_spec(ns)
    if not search:
        if not _some_plan_fits(spec, ck_kw(ns, ns.batch_size)):
            r = CK.evaluate(spec, "full", **ck_kw(ns, ns.batch_size))
            return Answer(False, r.fit.needed, r.fit.available, None, "batch size"), None
    best = CK.cheapest_plan(spec, None, **ck_kw(ns, ns.batch_size))
    lo, capped = _largest(lambda b: _some_plan_fits(spec, ck_kw(ns, b)), ns.batch_size, search)
    while search and not capped and CK.cheapest_plan(spec, None, **ck_kw(ns, lo + 1)) is not None:
        lo += 1  # a plan between the two found room for one more sequence
    if best is not None:
        return Answer(True, best.fit.needed, best.fit.available, lo, "batch size", capped,
                      note=f"recompute {best.plan.name}"), best
    weighed = CK.PLANS if search else ("full",)
    least = min((CK.evaluate(spec, p, **ck_kw(ns, ns.batch_size)) for p in weighed), key=lambda r: r.fit.needed)
    return Answer(False, least.fit.needed, least.fit.available, lo, "batch size", capped,
                  note=f"least memory: recompute {least.plan.name}"), None


def _plans(ns, recomputes=PAR.RECOMPUTE) -> list[PAR.LayoutPlan]:
    plans = PAR.plan_layouts(model_spec(ns), ns.gpus, gpu_of(ns), seq_len=ns.seq_len, global_batch=ns.global_batch,
                             micro_batch_size=ns.micro_batch_size, gpus_per_node=ns.gpus_per_node,
                             precision=ns.precision, recomputes=recomputes)
    if not plans:
        raise ValueError(f"no dp x tp x pp layout of {ns.gpus} GPUs: tp must divide the heads and the MLP width "
                         f"(at most --gpus-per-node {ns.gpus_per_node}), and dp x micro-batch size must divide "
                         f"--global-batch {ns.global_batch}")
    return plans


def answer_plan(ns, search: bool = True) -> tuple[Answer, list]:
    # the least memory a layout can have is under full recompute: screening weighs that plan alone
    plans = _plans(ns, PAR.RECOMPUTE if search else ("full",))
    ok = [x for x in plans if x.fit.fits]
    top = ok[0] if ok else plans[0]
    note = (f"fastest: {top.name}, {top.tokens_per_s:,.0f} tokens/s" if ok and search
            else f"{top.name}" + ("" if ok else " needs the least"))
    return Answer(bool(ok), top.fit.needed, top.fit.available, None, "", note=note), plans


CP_SWEEP = (1, 2, 4, 8, 16, 32, 64)  # the CP sizes the context command sets beside the one asked for


def cp_rank(ns, cp: int, batch_size: int | None = None) -> tuple[dict, fitting.Fit]:
    """One CP rank and its fit (`context_parallel.context_fit`)."""
    return CP.context_fit(model_spec(ns), gpu_of(ns), cp=cp, method=ns.method,
                           batch_size=ns.batch_size if batch_size is None else batch_size, seq_len=ns.seq_len,
                           precision=ns.precision, optimizer=ns.optimizer, zigzag=not ns.contiguous, link=ns.link,
                           recompute=ns.recompute, loss=ns.loss, shard_states=ns.fsdp)


def answer_context(ns, search: bool = True) -> tuple[Answer, tuple[dict, fitting.Fit]]:
    here = cp_rank(ns, ns.cp)
    fit = here[1]
    lo, capped = _largest(lambda b: cp_rank(ns, ns.cp, b)[1].fits, ns.batch_size, search)
    return Answer(fit.fits, fit.needed, fit.available, lo, "batch size", capped,
                  note=f"{ns.method}, {here[0]['tokens_per_rank']:,} tokens a rank"), here


ANSWERS: dict[str, Callable] = {"estimate": answer_estimate, "lora": answer_lora, "offload": answer_offload,
                                "checkpoint": answer_checkpoint, "plan": answer_plan, "context": answer_context}


def answer(ns, search: bool = True) -> Answer:
    """Does the configuration `ns` (a parsed command line) fit? With `search`, the largest batch too."""
    return ANSWERS[ns.command](ns, search)[0]
