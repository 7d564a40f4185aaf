"""Each chapter's calculator, declared once: its inputs (with their choices or ranges and defaults)
and the pure function that turns them into the result — text, key numbers and an SVG chart. Pure
Python, no torch, no matplotlib: it runs the same in CPython and in the reader's browser (Pyodide).

Two front ends read these declarations: `vramlab.present.widgets` (ipywidgets, in Jupyter and Colab) and
`page_html` (the HTML of the online book, made live by book/_static/live.mjs, which runs this
module in a Web Worker). `vramlab.present.widgets.show(name, ...)` gives both at once: Jupyter draws the
widget, the book the HTML.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import pickle
from dataclasses import dataclass, field
from html import escape
from typing import Any, Callable, Literal

from .. import checkpointing as CK
from .. import collectives as C
from .. import compression as COMP
from .. import activations, fitting, memory, optimizers, specs
from .. import inplace as IP
from .. import offload as OFF
from .. import parallel as PAR
from .. import precision as P
from .. import serving as SERVE
from .. import snapshot as SNAP
from .. import zero as Z
from . import svg as SVG
from .svg import gantt, loglog_lines, stacked_bars, streams
from ..units import GiB, fmt_bytes

Kind = Literal["choice", "int", "float", "file"]


@dataclass(frozen=True, kw_only=True)
class Input:
    """One control. choice: one of `choices`; int: min..max; float: min..max, on a log scale if `log`;
    file: a file's bytes (`check` gives bytes, or None for "no file": the calculator's built-in example);
    `choices` then lists the file names it accepts (".pickle")."""

    name: str
    label: str
    kind: Kind
    default: Any
    choices: tuple = ()
    min: float | None = None
    max: float | None = None
    log: bool = False
    unit: str = ""

    def check(self, value: Any) -> Any:
        """The value converted to the input's type, or ValueError with one line that says why."""
        if self.kind == "file":
            return _file_bytes(self.label, value)
        if self.kind == "choice":
            for c in self.choices:  # choices may be numbers; the browser sends strings (True is not 1 here)
                if not isinstance(value, bool) and (value == c or str(value) == str(c)):
                    return c
            raise ValueError(f"{self.label}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        if isinstance(value, bool):
            raise ValueError(f"{self.label}: expected a number, got {value!r}")
        try:
            v = float(value.strip() if isinstance(value, str) else value)  # '1e9' and ' 16 ' are numbers
        except (TypeError, ValueError):
            raise ValueError(f"{self.label}: expected a number, got {value!r}") from None
        except OverflowError:  # a whole number too large for a float
            raise ValueError(f"{self.label}: expected a finite number, got {value!r}") from None
        if v != v:
            raise ValueError(f"{self.label}: expected a number, got {value!r}")
        if math.isinf(v):  # inf, "inf", JSON's Infinity, 1e400
            raise ValueError(f"{self.label}: expected a finite number, got {value!r}")
        if self.kind == "int":
            if v != int(v):
                raise ValueError(f"{self.label}: expected a whole number, got {value!r}")
            v = int(v)
        if not (self.min <= v <= self.max):
            raise ValueError(f"{self.label}: {v:g}{' ' + self.unit if self.unit else ''} is out of range: "
                             f"it must be between {self.min:.4g} and {self.max:.4g}{' ' + self.unit if self.unit else ''}")
        return v


def _file_bytes(label: str, value: Any) -> bytes | None:
    """A file input's value as bytes: bytes-like as is (Jupyter's FileUpload); the browser's string, a data
    URL (FileReader.readAsDataURL: "data:<type>;base64,<data>") or bare base64; "" or None: no file (None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str):
        raise ValueError(f"{label}: expected a file's bytes or base64 text, got {type(value).__name__}")
    text = value.strip()
    if text.startswith("data:"):  # "data:," is an empty file; "data:text/plain;base64,aGk=" a file
        head, sep, text = text.partition(",")
        if not sep or (text and not head.endswith(";base64")):
            raise ValueError(f"{label}: a data URL without base64 data")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{label}: the page sent no readable file (not base64)") from None


@dataclass(frozen=True, kw_only=True)
class Result:
    """What a calculator shows: monospace `text`, `numbers` (name -> (value, shown as)), an `svg`."""

    text: str
    numbers: dict[str, tuple[float, str]] = field(default_factory=dict)
    svg: str = ""
    svg_narrow: str = ""  # the same chart laid out for a phone's column (svg.PHONE wide); the book shows the one that fits
    error: str = ""
    invalid: tuple[str, ...] = ()  # the inputs the error is about

    def to_dict(self) -> dict:
        return {"text": self.text, "numbers": {k: [v, s] for k, (v, s) in self.numbers.items()}, "svg": self.svg,
                "svg_narrow": self.svg_narrow, "error": self.error, "invalid": list(self.invalid)}


def _both(draw: Callable[..., str], *args: Any, wide: int | None = None, **kwargs: Any) -> tuple[str, str]:
    """A chart at its own width (or `wide`) and at a phone's (svg.PHONE)."""
    return (draw(*args, **kwargs) if wide is None else draw(*args, width=wide, **kwargs),
            draw(*args, width=SVG.PHONE, **kwargs))


@dataclass(frozen=True, kw_only=True)
class Calculator:
    name: str
    title: str
    inputs: tuple[Input, ...]
    compute: Callable[..., Result]
    number_labels: dict[str, str] = field(default_factory=dict)

    def run(self, **values: Any) -> Result:
        """Validate `values` (missing ones take their defaults) and compute. Bad input gives a Result
        whose `error` says what is wrong in one line, never an exception."""
        unknown = set(values) - {i.name for i in self.inputs}
        if unknown:
            return Result(text="", error=f"unknown input {', '.join(sorted(unknown))}")
        checked = {}
        for i in self.inputs:
            try:
                checked[i.name] = i.check(values.get(i.name, i.default))
            except ValueError as e:
                return Result(text="", error=str(e.args[0]), invalid=(i.name,))
        try:
            return self.compute(**checked)
        except (ValueError, KeyError) as e:
            return Result(text="", error=str(e.args[0]) if e.args else str(e))


# ----------------------------------------------------------------------------- chapter 1

GPU_CHOICES = tuple(specs.GPUS)
SEQ_CHOICES = (128, 256, 512, 1024, 2048, 4096, 8192)


ALLOCATORS = ("default", "expandable segments")
# the phases of a step without recompute at which every block's saved tensors are alive (the last
# block's backward has begun to free its own)
_ALL_SAVED = ("forward end", "backward start", "LM head backward")


def _inplace_phases(phases, ip: dict) -> list:
    """The step's phases with what the in-place ops add to the saved tensors (`inplace.inplace_step`)."""
    out = []
    for m in phases:
        name = m.phase.split(": ")[-1]
        add = ip["saved"] if name.startswith(_ALL_SAVED) else \
            max(ip["saved"] - ip["per_block"], 0) if name.startswith("backward of the last block") else 0
        out.append(dataclasses.replace(m, activations=m.activations + add))
    return out


def _training(*, model: str, batch_size: int, seq_len: int, precision: str, optimizer: str, attention: str,
              recompute: str, gpu: str, accumulation_steps: int = 1, inplace: str = "none",
              allocator: str = "default", loss: str = "whole") -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    expandable = allocator == "expandable segments"
    if inplace != "none" and recompute != "none":
        raise ValueError("in-place ops are priced for a step without recompute (with recompute, which blocks' saved "
                         "tensors are alive at the peak is the plan's): set recompute to none, or in-place to none")
    # batch_size is the micro-batch; with accumulation_steps > 1 every gradient stays under the later ones
    opts = dict(seq_len=seq_len, precision=precision, optimizer=optimizer, attention=attention, recompute=recompute,
                accumulation_steps=accumulation_steps, loss=loss)

    def inplace_at(bs: int) -> dict:
        return IP.inplace_step(spec, batch_size=bs, seq_len=seq_len, choice=inplace, device="cuda",
                               precision=precision, attention=attention)

    def train_at(bs: int):
        phases = memory.training_phases(spec, batch_size=bs, gpu=g, **opts)
        if inplace != "none":
            phases = _inplace_phases(phases, inplace_at(bs))
        return max(phases, key=lambda m: m.total)

    train = train_at(batch_size)
    ip = inplace_at(batch_size) if inplace != "none" else None
    infer_dtype = "fp32" if precision == "fp32" else "bf16"
    infer = memory.estimate_inference(spec, batch_size=batch_size, seq_len=seq_len, dtype=infer_dtype, gpu=g)
    if ip is None or not ip["saved"]:
        verdict = fitting.fit(spec, g, batch_size=batch_size, expandable_segments=expandable, **opts)
    else:  # the in-place ops change the step's bytes at every batch size: search with them
        def at(bs: int, **found) -> fitting.Fit:
            return fitting.device_fit(train_at(bs), g, expandable_segments=expandable, **found,
                                      largest_tensor=fitting.fragmentation_bytes(spec, batch_size=bs, **opts))
        lo = fitting.largest_true(lambda bs: at(bs).fits, limit=1 << 12)
        verdict = dataclasses.replace(at(batch_size, max_batch_size=lo, capped=lo >= 1 << 12), batch_size=batch_size)
    bars = [(label, [(c.replace("_", " "), getattr(b, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for label, b in (("training step", train), (f"inference ({infer_dtype})", infer))]
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}: {spec.params / 1e6:,.0f} M params, b={batch_size}, s={seq_len}",
                       line=(g.usable_bytes / GiB, f"{g.name} usable"))
    step = "training step" if accumulation_steps == 1 else \
        f"training step: {accumulation_steps} micro-batches of {batch_size} (global batch {batch_size * accumulation_steps})"
    if ip is not None:
        step += f", in place: {inplace}"
    lines = [train.table(title=step), "", str(verdict), verdict.explain()]
    numbers = {"train_total": (train.total, fmt_bytes(train.total)), "infer_total": (infer.total, fmt_bytes(infer.total)),
               "max_batch": (verdict.max_batch_size, str(verdict.max_batch_size)),
               "global_batch": (batch_size * accumulation_steps, f"{batch_size * accumulation_steps:,}")}
    if ip is not None:
        names = "; ".join(ip["sites"]) or "none allowed in this model's blocks"
        lines += ["", f"in place ({inplace}), per block: {names}",
                  f"  saved for the backward: {'+' if ip['saved'] else ''}{fmt_bytes(ip['saved'])} over {ip['blocks']} "
                  "blocks" + (" (CUDA's in-place dropout saves a noise tensor in the dtype, its fused form a 1-byte "
                              "mask)" if ip["saved"] else " (no allowed in-place op frees a saved tensor)"),
                  f"  forward's momentary peak: at most {fmt_bytes(ip['transient'])} lower (one block's largest "
                  "allocation avoided; the step's peak is at the backward's start and does not move)"]
        numbers["inplace_saved"] = (ip["saved"], fmt_bytes(ip["saved"]))
        numbers["inplace_transient"] = (ip["transient"], fmt_bytes(ip["transient"]))
    lines += ["", f"inference prefill: {fmt_bytes(infer.total)} (KV cache {fmt_bytes(infer.kv_cache)})"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers=numbers)


COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868", "activations": "#C44E52",
          "temporaries": "#8172B3", "kv_cache": "#937860", "inputs": "#DA8BC3", "other": "#8C8C8C"}

TRAINING = Calculator(
    name="training", title="Training and inference memory", compute=_training,
    number_labels={"train_total": "training peak", "infer_total": "inference prefill",
                   "max_batch": "largest (micro-)batch that fits", "global_batch": "global batch",
                   "inplace_saved": "in place: added to the saved tensors",
                   "inplace_transient": "in place: forward transient avoided"},
    inputs=(Input(name="model", label="model", kind="choice", default="gpt2", choices=specs.preset_names()),
            Input(name="batch_size", label="batch size", kind="int", default=8, min=1, max=128),
            Input(name="seq_len", label="sequence length", kind="choice", default=1024, choices=SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default="bf16-mixed", choices=P.PRECISIONS),
            Input(name="optimizer", label="optimizer", kind="choice", default="adamw", choices=memory.OPTIMIZERS),
            Input(name="attention", label="attention", kind="choice", default="sdpa", choices=activations.ATTENTIONS),
            Input(name="recompute", label="recompute", kind="choice", default="none", choices=activations.RECOMPUTES),
            Input(name="gpu", label="GPU", kind="choice", default="t4", choices=GPU_CHOICES),
            Input(name="accumulation_steps", label="accumulation steps", kind="int", default=1, min=1, max=64),
            Input(name="inplace", label="in-place ops", kind="choice", default="none", choices=IP.INPLACE_CHOICES),
            Input(name="allocator", label="allocator", kind="choice", default="default", choices=ALLOCATORS),
            Input(name="loss", label="loss", kind="choice", default="whole", choices=memory.LOSSES)))


MOE_SEQ_CHOICES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_ROLE_COLORS = {"embeddings": "#DA8BC3", "attention": "#4C72B0", "norms": "#8C8C8C", "dense_mlp": "#937860",
                "router": "#8172B3", "routed_experts": "#C44E52", "shared_experts": "#DD8452", "head": "#55A868"}


CAPACITIES = ("dropless", "1.0", "1.25", "1.5", "2.0")


def _capacity(value: str) -> float | None:
    return None if value == "dropless" else float(value)


def _moe(*, model: str, batch_size: int, seq_len: int, dtype: str, gpu: str, step: str = "inference",
         capacity: str = "dropless", recompute: str = "none") -> Result:
    """A mixture of experts on one GPU: where its parameters sit (`moe.param_breakdown`), what a token uses
    (`active_params`), the KV cache, and an inference prefill's (`memory.estimate_inference`) or a training
    step's (`memory.estimate_training`, dropless or at a capacity factor) peak and fit."""
    from .. import moe as MOE

    spec, g = specs.preset(model), specs.gpu(gpu)
    e = memory.INFER_BYTES[dtype]
    if step == "training":
        precision = "fp32" if dtype == "fp32" else "bf16-mixed"
        if dtype == "int8":
            raise ValueError("weights int8: training keeps its weights in fp32 (bf16-mixed) or bf16; choose bf16 or fp32")
        opts = dict(seq_len=seq_len, precision=precision, recompute=recompute, capacity_factor=_capacity(capacity))
        est = memory.estimate_training(spec, batch_size=batch_size, gpu=g, **opts)
        verdict = fitting.fit(spec, g, batch_size=batch_size, **opts)
        what = (f"training step of {batch_size} x {seq_len:,} tokens, {precision}, AdamW, "
                f"{'dropless' if capacity == 'dropless' else 'capacity factor ' + capacity}, recompute {recompute}")
    else:
        est = memory.estimate_inference(spec, batch_size=batch_size, seq_len=seq_len, dtype=dtype, gpu=g)
        verdict = fitting.fit(spec, g, batch_size=batch_size, mode="infer", seq_len=seq_len, dtype=dtype)
        what = f"prefill of {batch_size} x {seq_len:,} tokens, {dtype}"
    roles = MOE.param_breakdown(spec)
    bars = [(f"weights ({dtype}) by role", [(k.replace("_", " "), v * e / GiB, _ROLE_COLORS[k]) for k, v in roles.items() if v]),
            (f"{step} peak, b={batch_size}", [(c.replace("_", " "), getattr(est, c) / GiB, COLORS[c])
                                              for c in memory.CATEGORIES])]
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}: {spec.params / 1e9:.1f} B parameters, "
                                                  f"{spec.active_params / 1e9:.1f} B active a token",
                        line=(g.usable_bytes / GiB, f"{g.name} usable"))
    per_token = MOE.kv_cache_bytes(spec, batch_size=1, seq_len=1, dtype="bf16" if dtype != "fp32" else "fp32")
    weights = spec.params * e
    gpus = -(-weights // max(1, g.usable_bytes - g.context_bytes))
    lines = [MOE.describe(spec), "", est.table(title=what), "", str(verdict), verdict.explain(),
             f"the weights alone ({fmt_bytes(weights)}) need {gpus:,} x {g.name} at the least: chapter 3 splits the "
             "experts over GPUs" if not verdict.fits else ""]
    return Result(text="\n".join(lines).rstrip(), svg=svg, svg_narrow=narrow, numbers={
        "params": (spec.params, f"{spec.params / 1e9:.1f} B"), "active": (spec.active_params, f"{spec.active_params / 1e9:.2f} B"),
        "kv_token": (per_token, fmt_bytes(per_token)), "peak": (est.total, fmt_bytes(est.total)),
        "max_batch": (verdict.max_batch_size, str(verdict.max_batch_size))})


MOE = Calculator(
    name="moe", title="Mixture of experts: every expert resident, a few used", compute=_moe,
    number_labels={"params": "parameters", "active": "active a token", "kv_token": "KV cache a token",
                   "peak": "peak", "max_batch": "largest batch that fits"},
    inputs=(Input(name="model", label="model", kind="choice", default="mixtral-8x7b", choices=specs.moe_preset_names()),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=256),
            Input(name="seq_len", label="sequence length", kind="choice", default=4096, choices=MOE_SEQ_CHOICES),
            Input(name="dtype", label="weights", kind="choice", default="bf16", choices=tuple(memory.INFER_BYTES)),
            Input(name="gpu", label="GPU", kind="choice", default="h200", choices=GPU_CHOICES),
            Input(name="step", label="step", kind="choice", default="inference", choices=("inference", "training")),
            Input(name="capacity", label="capacity factor (training)", kind="choice", default="dropless",
                  choices=CAPACITIES),
            Input(name="recompute", label="recompute (training)", kind="choice", default="none", choices=("none", "full"))))


def _experts(*, model: str, ep: int, dp: int, capacity: str, zero: int, batch_size: int, seq_len: int,
             link: str) -> Result:
    """One expert-parallel rank (`parallel.expert_parallel`): its states, dispatch buffers and all-to-all
    traffic, beside every other EP size that divides the experts and the ranks."""
    spec = specs.preset(model)
    kw = dict(dp=dp, batch_size=batch_size, seq_len=seq_len, capacity_factor=_capacity(capacity), zero_stage=zero,
              link=link)
    r = PAR.expert_parallel(spec, ep=ep, **kw)
    bars = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        try:
            x = PAR.expert_parallel(spec, ep=n, **kw)
        except ValueError:  # this size does not divide the experts or the ranks: left out of the sweep
            continue
        dense = sum(x[k]["dense"] for k in ("parameters", "gradients", "optimizer_states"))
        expert = sum(x[k]["experts"] for k in ("parameters", "gradients", "optimizer_states"))
        bars.append((f"ep {n}", [("dense states", dense / GiB, COLORS["parameters"]),
                                 ("expert states", expert / GiB, COLORS["optimizer_states"]),
                                 ("dispatch buffers (worst, all layers)",
                                  len(spec.moe_layer_ids) * (x["dispatch_bytes"]["sent"] + x["dispatch_bytes"]["received_worst"]) / GiB,
                                  COLORS["activations"])]))
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name} on {dp} ranks, ZeRO-{zero}: one rank's states against "
                                                  "the EP size")
    b = r["dispatch_bytes"]
    per_layer = r["sent_per_layer"]["forward"] + r["sent_per_layer"]["backward"]
    secs = r["a2a_seconds_per_layer"]["forward"] + r["a2a_seconds_per_layer"]["backward"]
    lines = [f"{spec.name}: experts split over ep = {ep} of {dp} ranks (each expert on dp/ep = {r['edp']}); "
             f"{r['experts_per_rank']} of {spec.num_experts} routed experts a rank in each of {len(spec.moe_layer_ids)} "
             "MoE layers",
             f"  states a rank: {fmt_bytes(r['states'])} (dense {fmt_bytes(sum(r[k]['dense'] for k in ('parameters', 'gradients', 'optimizer_states')))}, "
             f"experts {fmt_bytes(sum(r[k]['experts'] for k in ('parameters', 'gradients', 'optimizer_states')))}), "
             f"bf16-mixed AdamW" + (f", ZeRO-{zero}: dense over {dp}, experts over {r['edp']}" if zero else ""),
             f"  dispatch a layer: sends {r['dispatch_rows']['sent']:,} rows ({fmt_bytes(b['sent'])}), receives "
             f"{r['dispatch_rows']['received_expected']:,} expected, {r['dispatch_rows']['received_worst']:,} at worst "
             f"({fmt_bytes(b['received_worst'])})" + (f"; capacity {r['capacity']:,} rows an expert"
                                                     if capacity != "dropless" else "; dropless"),
             f"  all-to-all a layer: {fmt_bytes(per_layer)} leave the rank (dispatch and combine, forward and backward), "
             f"{1e3 * secs:.2f} ms on {link}",
             f"  gradients a step: dense {fmt_bytes(r['grad_allreduce_bytes']['dense'])} all-reduced over {dp}, experts "
             f"{fmt_bytes(r['grad_allreduce_bytes']['experts'])} over {r['edp']}",
             "  (the states and the bytes are exact; a step's activations depend on the kernels: the chapter-1 "
             "calculator prices one device's)"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "states": (r["states"], fmt_bytes(r["states"])),
        "experts_per_rank": (r["experts_per_rank"], str(r["experts_per_rank"])),
        "a2a": (per_layer, fmt_bytes(per_layer))})


EXPERTS = Calculator(
    name="experts", title="Expert parallelism: one rank's experts, buffers and all-to-alls", compute=_experts,
    number_labels={"states": "states a rank", "experts_per_rank": "experts a rank (a layer)",
                   "a2a": "all-to-all a layer"},
    inputs=(Input(name="model", label="model", kind="choice", default="mixtral-8x7b", choices=specs.moe_preset_names()),
            Input(name="ep", label="expert parallel", kind="choice", default=8, choices=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
            Input(name="dp", label="data-parallel ranks", kind="choice", default=8, choices=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
            Input(name="capacity", label="capacity factor", kind="choice", default="1.25", choices=CAPACITIES),
            Input(name="zero", label="ZeRO stage", kind="choice", default=1, choices=(0, 1, 2)),
            Input(name="batch_size", label="batch size (a rank)", kind="int", default=1, min=1, max=256),
            Input(name="seq_len", label="sequence length", kind="choice", default=4096, choices=MOE_SEQ_CHOICES),
            Input(name="link", label="link", kind="choice", default="nvlink4", choices=tuple(C.LINKS))))


SERVE_MODELS = tuple(n for n in specs.preset_names() + specs.moe_preset_names() if specs.preset(n).is_causal_lm)
SERVE_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
DRAFTS = ("none", "llama-3.2-1b", "gpt2", "opt-125m")


def _serving(*, model: str, gpu: str, utilization: float, prompt_len: int, output_len: int, dtype: str, kv_dtype: str,
             block_size: int, shared_prefix: int, n_samples: int, draft: str, speculative_tokens: int) -> Result:
    """A paged-KV engine on one GPU, as vLLM accounts for it (`serving.serving_plan`): the pool its weights
    leave, blocks, vLLM's logged concurrency, the requests that fit with sharing, beside every KV dtype."""
    spec, g = specs.preset(model), specs.gpu(gpu)
    if shared_prefix > prompt_len:
        raise ValueError(f"shared system prompt: {shared_prefix:,} tokens is longer than the prompt ({prompt_len:,})")
    kw = dict(gpu=g, prompt_len=prompt_len, output_len=output_len, gpu_memory_utilization=utilization, dtype=dtype,
              block_size=block_size, shared_prefix_len=shared_prefix, n_samples=n_samples,
              draft_model=None if draft == "none" else draft, num_speculative_tokens=0 if draft == "none" else speculative_tokens)
    plan = SERVE.serving_plan(spec, kv_dtype=kv_dtype, **kw)
    per_block = plan.block.bytes_per_block + plan.draft_page_bytes
    budget = int(g.usable_bytes * utilization)
    other = g.context_bytes  # what serving_plan leaves outside torch (the CUDA context)
    bars = []
    for kv in SERVE.KV_DTYPES:
        try:
            x = plan if kv == kv_dtype else SERVE.serving_plan(spec, kv_dtype=kv, **kw)
        except ValueError:
            continue
        segs = [("weights", x.weights_bytes / GiB, COLORS["parameters"])]
        if x.draft_model:
            segs += [("draft weights", x.draft_weights_bytes / GiB, COLORS["gradients"]),
                     ("verify logits", x.verify_logits_bytes / GiB, COLORS["temporaries"])]
        segs += [("outside torch", other / GiB, COLORS["other"]),
                 ("KV cache pool", x.available_kv_bytes / GiB, COLORS["kv_cache"])]
        bars.append((f"{kv}{'*' if kv == kv_dtype else ''} ({x.max_requests:,})", segs))
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name} on {g.name} at {utilization:g}: the pool by KV dtype "
                                                  "(* chosen), requests at once in brackets",
                        line=(budget / GiB, f"{utilization:g} x usable"))
    lines = [f"{spec.name} on {g.name}, weights {dtype}, KV cache {kv_dtype}, blocks of {plan.block.block_size} tokens",
             f"  pool: {utilization:g} x {fmt_bytes(g.usable_bytes)} - weights {fmt_bytes(plan.weights_bytes)}"
             + (f" - draft {fmt_bytes(plan.draft_weights_bytes)} - verify logits {fmt_bytes(plan.verify_logits_bytes)}"
                if plan.draft_model else "")
             + f" - outside torch {fmt_bytes(other)} = {fmt_bytes(plan.available_kv_bytes)}",
             f"  a block: {fmt_bytes(per_block)}; {plan.num_blocks:,} blocks; a request of {plan.tokens_per_request:,} "
             f"tokens holds {plan.blocks_per_request:,} ({plan.last_block_waste} token slots of its last block empty)",
             f"  vLLM would log: {plan.log_line()}",
             f"  requests at once: {plan.max_requests:,}"
             + (f" ({plan.max_sequences:,} sequences)" if n_samples > 1 else "")
             + (f"; the system prompt's {plan.shared_prefix_blocks} full blocks held once" if shared_prefix else ""),
             "  (the profile run's activation peak and CUDA graphs, which vLLM measures at start-up, are not in the "
             "pool here: `vramlab serve --activation-peak-gib`)"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "pool": (plan.available_kv_bytes, fmt_bytes(plan.available_kv_bytes)),
        "blocks": (plan.num_blocks, f"{plan.num_blocks:,}"),
        "concurrency": (plan.max_concurrency, f"{plan.max_concurrency:.2f}x"),
        "requests": (plan.max_requests, f"{plan.max_requests:,}")})


SERVING = Calculator(
    name="serving", title="Serving: a paged KV cache's pool, blocks and concurrent requests", compute=_serving,
    number_labels={"pool": "KV cache pool", "blocks": "blocks", "concurrency": "vLLM's concurrency",
                   "requests": "requests at once"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.1-8b", choices=SERVE_MODELS),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="utilization", label="gpu_memory_utilization", kind="float", default=0.9, min=0.1, max=1.0),
            Input(name="prompt_len", label="prompt tokens", kind="choice", default=1024, choices=SERVE_LENGTHS),
            Input(name="output_len", label="output tokens", kind="choice", default=1024, choices=SERVE_LENGTHS),
            Input(name="dtype", label="weights", kind="choice", default="bf16", choices=tuple(SERVE.WEIGHT_DTYPES)),
            Input(name="kv_dtype", label="KV cache", kind="choice", default="bf16", choices=tuple(SERVE.KV_DTYPES)),
            Input(name="block_size", label="block size (tokens)", kind="choice", default=16, choices=(8, 16, 32, 64, 128)),
            Input(name="shared_prefix", label="shared system prompt (tokens)", kind="choice", default=0,
                  choices=(0, 64, 256, 512, 1024, 2048, 4096)),
            Input(name="n_samples", label="sequences a request (n)", kind="int", default=1, min=1, max=16),
            Input(name="draft", label="draft model (speculative)", kind="choice", default="none", choices=DRAFTS),
            Input(name="speculative_tokens", label="draft tokens a step", kind="int", default=4, min=1, max=16)))


# ----------------------------------------------------------------------------- chapter 2

def _collectives(*, op: str, ranks: int, size_mib: float, link: str) -> Result:
    S = int(size_mib * 2**20)
    t = float(C.collective_time(op, ranks, S, link))
    alg, bus = float(C.algbw(S, t)), float(C.busbw(op, ranks, S, t))
    text = (f"{op} of {fmt_bytes(S)} on {ranks} ranks over {link}: {t * 1e3:.3f} ms\n"
            f"algbw {alg / 1e9:.1f} GB/s, busbw {bus / 1e9:.1f} GB/s (factor {float(C.busbw_factor(op, ranks)):g})")
    sizes = [2**k for k in range(10, 35)]
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    series = [(name, [(s, float(C.collective_time(op, ranks, s, name))) for s in sizes], palette[i % len(palette)], name == link)
              for i, name in enumerate(C.LINKS)]
    svg, narrow = _both(loglog_lines, series, title=f"{op} on {ranks} ranks: time vs message size", xlabel="message size (bytes)",
                       ylabel="seconds", vline=S)
    return Result(text=text, svg=svg, svg_narrow=narrow, numbers={"time_ms": (t * 1e3, f"{t * 1e3:.3f} ms"),
                                               "busbw_GBps": (bus / 1e9, f"{bus / 1e9:.1f} GB/s")})


COLLECTIVES = Calculator(
    name="collectives", title="Collectives: the alpha-beta cost", compute=_collectives,
    number_labels={"time_ms": "time", "busbw_GBps": "bus bandwidth"},
    inputs=(Input(name="op", label="collective", kind="choice", default="all_reduce", choices=tuple(C.OPS)),
            Input(name="ranks", label="ranks", kind="int", default=8, min=2, max=256),
            Input(name="size_mib", label="size", kind="float", default=256.0, min=2.0**-10, max=2.0**14, log=True,
                  unit="MiB"),
            Input(name="link", label="link", kind="choice", default="nvlink4", choices=tuple(C.LINKS))))


# ----------------------------------------------------------------------------- chapter 5

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
    svg, narrow = _both(stacked_bars, bars, title=f"{model}, b={batch_size}, s=1024: training peak by recipe", wide=720)
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

# ----------------------------------------------------------------------------- chapter 3

DECODER_PRESETS = tuple(n for n in specs.preset_names() if specs.preset(n).family in PAR.DECODER_FAMILIES)


def _parallel(*, model: str, dp: int, tp: int, pp: int, sp: str, zero: str, recompute: str, schedule: str,
              micro_batches: int, micro_batch_size: int, seq_len: int, precision: str, gpu: str, link: str) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    chunks = 2 if schedule == "interleaved" else 1
    layout = PAR.Layout(dp=dp, tp=tp, pp=pp, sp=sp == "yes", micro_batches=micro_batches, schedule=schedule,
                        chunks=chunks, zero=int(zero == "ZeRO-1"))
    kw = dict(micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision, recompute=recompute)
    stages = PAR.estimate_layout(spec, layout, gpu=g, **kw)
    verdict = PAR.fits(spec, layout, g, **kw)
    ok = verdict.fits
    comm = PAR.communication(spec, layout, dp_link=link, pp_link=link, tp_link="nvlink4",
                             **{k: v for k, v in kw.items() if k != "recompute"})
    bubble = PAR.bubble_fraction(pp, micro_batches, schedule, chunks=chunks) if pp > 1 else 0
    shown = list(enumerate(stages))
    shown = shown if len(shown) <= 8 else shown[:4] + shown[-4:]  # the first and last stages differ most
    bars = [(f"stage {i}", [(c.replace("_", " "), getattr(b, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for i, b in shown]
    title = f"{spec.name} on {layout.devices} GPUs (dp {dp} x tp {tp} x pp {pp}): memory per device"
    svgs = [_both(stacked_bars, bars, title=title, line=(g.usable_bytes / GiB, f"{g.name} usable"))]
    if pp > 1 and pp * micro_batches * chunks <= 512:
        run = PAR.simulate(pp, micro_batches, schedule, chunks=chunks)
        svgs.append(_both(gantt, run.ops, devices=pp, makespan=run.makespan, chunks=chunks,
                          title=f"{schedule}, {pp} stages, {micro_batches} micro-batches: bubble {float(bubble):.1%} of the step"))
    worst = max(stages, key=lambda b: b.total)
    lines = [worst.table(title=f"fullest device: {worst.label}"), "",
             str(verdict), verdict.explain(),
             f"pipeline bubble: {float(bubble):.1%} of the step's time"
             + (f" ({float(PAR.bubble_fraction(pp, micro_batches, schedule, chunks=chunks, of='ideal')):.1%} of the ideal time)"
                if pp > 1 else " (no pipeline)"), "",
             "communication per step (alpha-beta model):"]
    if dp > 1:
        lines.insert(1, "(gradients include DDP's bucket copy: gradient_as_bucket_view=False, its default)")
    for k, what in (("dp", f"data parallel: all-reduce of {fmt_bytes(comm['dp']['bytes'])} of gradients over {link}"),
                    ("tp", f"tensor parallel: {comm['tp']['calls']} all-reduces of {fmt_bytes(comm['tp']['bytes'])} over nvlink4"),
                    ("pp", f"pipeline: {comm['pp']['calls']} sends of {fmt_bytes(comm['pp']['bytes'])} over {link}")):
        lines.append(f"  {what}: {comm[k]['seconds'] * 1e3:.2f} ms")
    return Result(text="\n".join(lines), svg="".join(w for w, _ in svgs), svg_narrow="".join(n for _, n in svgs), numbers={
        "per_device": (worst.total, fmt_bytes(worst.total)), "fits": (int(ok), "yes" if ok else "no"),
        "bubble": (float(bubble), f"{float(bubble):.1%}")})


LONG_SEQ_CHOICES = (4096, 8192, 16384, 32768, 65536, 131072)
CP_CHOICES = (1, 2, 4, 8, 16, 32)


def _context(*, model: str, method: str, cp: int, batch_size: int, seq_len: int, precision: str, zigzag: str,
             gpu: str, link: str, recompute: str = "none", loss: str = "whole", fsdp: str = "no") -> Result:
    """One context-parallel rank (`parallel.context_parallel`), beside the same step at every other CP size;
    `fsdp` "yes": the model states sharded over the CP ranks too (FSDP2)."""
    spec, g = specs.preset(model), specs.gpu(gpu)
    kw = dict(method=method, batch_size=batch_size, seq_len=seq_len, precision=precision, zigzag=zigzag == "yes",
              link=link, gpu=g, recompute=recompute, loss=loss, shard_states=fsdp == "yes")
    r = PAR.context_parallel(spec, cp=cp, **kw)
    bars = []
    for n in CP_CHOICES:
        try:
            x = PAR.context_parallel(spec, cp=n, **kw)
        except ValueError:  # this size does not split the heads or the sequence: left out of the sweep
            continue
        rest = x["peak"] - x["blocks_saved"]
        bars.append((f"cp {n}", [("saved by the blocks", x["blocks_saved"] / GiB, COLORS["activations"]),
                                 ("states, the loss and the rest", rest / GiB, COLORS["other"])]))
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len:,} tokens, {method}"
                                                  + (", recompute" if recompute == "full" else "")
                                                  + (f", {loss} loss" if loss != "whole" else "")
                                                  + (", FSDP2" if fsdp == "yes" else "")
                                                  + ": one rank's peak against the CP size",
                        line=(g.usable_bytes / GiB, f"{g.name} usable"))
    fits = PAR.context_fit(spec, g, cp=cp, **{k: v for k, v in kw.items() if k != "gpu"})[1].fits
    f, b = r["comm_seconds_per_layer"], r["attention_seconds_per_layer"]
    lines = [f"{method} attention over {cp} ranks ({'zig-zag chunks' if r['zigzag'] else 'contiguous shards'}): "
             f"{r['tokens_per_rank']:,} tokens a rank",
             f"  saved for backward: {fmt_bytes(r['saved_per_layer'])} a layer, {fmt_bytes(r['blocks_saved'])} by the blocks"
             + (" (each keeps its input; the last re-run holds a layer's)" if recompute == "full" else ""),
             f"  in flight inside attention: forward {fmt_bytes(r['in_flight_forward'])}, backward "
             f"{fmt_bytes(r['in_flight_backward'])}",
             f"  the rank's peak: {fmt_bytes(r['peak'])} ({r['peak_phase']}); "
             f"{'fits' if fits else 'does NOT fit'} on {g.name} (fit's verdict: + margin, fragmentation, context)",
             f"  sent per layer: forward {fmt_bytes(r['sent_per_layer']['forward'])} in "
             f"{r['messages_per_layer']['forward']} messages, backward {fmt_bytes(r['sent_per_layer']['backward'])} in "
             f"{r['messages_per_layer']['backward']}"
             + (f", the recomputed forward {fmt_bytes(r['sent_per_layer']['recompute'])} again" if recompute == "full" else ""),
             f"  per layer on {link}: communication {1e3 * f['forward']:.2f} / {1e3 * f['backward']:.2f} ms against "
             f"attention's {1e3 * b['forward']:.2f} / {1e3 * b['backward']:.2f} ms (forward / backward, at 40 % of "
             f"{g.name}'s peak): {r['verdict']}"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "peak": (r["peak"], fmt_bytes(r["peak"])), "activations": (r["blocks_saved"], fmt_bytes(r["blocks_saved"])),
        "sent": (sum(r["sent_per_layer"].values()), fmt_bytes(sum(r["sent_per_layer"].values()))),
        "verdict": (int(r["verdict"] == "hidden"), r["verdict"])})


CONTEXT = Calculator(
    name="context", title="Context parallelism: one rank of ring attention or Ulysses", compute=_context,
    number_labels={"peak": "a rank's peak", "activations": "saved by its blocks", "sent": "sent per layer",
                   "verdict": "communication"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.2-1b", choices=DECODER_PRESETS),
            Input(name="method", label="method", kind="choice", default="ring", choices=PAR.CP_METHODS),
            Input(name="cp", label="context parallel", kind="choice", default=8, choices=CP_CHOICES),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=65536, choices=LONG_SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default="bf16-mixed", choices=P.PRECISIONS),
            Input(name="zigzag", label="zig-zag (ring)", kind="choice", default="yes", choices=("yes", "no")),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="link", label="link", kind="choice", default="nvlink4", choices=tuple(C.LINKS)),
            Input(name="recompute", label="recompute", kind="choice", default="none", choices=PAR.CP_RECOMPUTE),
            Input(name="loss", label="loss", kind="choice", default="whole", choices=memory.LOSSES),
            Input(name="fsdp", label="FSDP2 over the CP ranks", kind="choice", default="no", choices=("no", "yes"))))


PARALLEL = Calculator(
    name="parallel", title="Data, tensor and pipeline parallelism: memory per device", compute=_parallel,
    number_labels={"per_device": "fullest device", "fits": "fits", "bubble": "bubble"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.1-8b", choices=DECODER_PRESETS),
            Input(name="dp", label="data parallel", kind="choice", default=2, choices=(1, 2, 4, 8, 16, 32, 64)),
            Input(name="tp", label="tensor parallel", kind="choice", default=2, choices=(1, 2, 4, 8)),
            Input(name="pp", label="pipeline stages", kind="choice", default=4, choices=(1, 2, 4, 8, 16)),
            Input(name="sp", label="sequence parallel", kind="choice", default="no", choices=("no", "yes")),
            Input(name="zero", label="optimizer states", kind="choice", default="replicated",
                  choices=("replicated", "ZeRO-1")),
            Input(name="recompute", label="recompute", kind="choice", default="none", choices=PAR.RECOMPUTE),
            Input(name="schedule", label="schedule", kind="choice", default="1f1b", choices=PAR.SCHEDULES),
            Input(name="micro_batches", label="micro-batches", kind="choice", default=8, choices=(1, 2, 4, 8, 16, 32, 64)),
            Input(name="micro_batch_size", label="micro-batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=2048, choices=SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default="bf16-mixed", choices=P.PRECISIONS),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="link", label="link between nodes", kind="choice", default="ib-ndr", choices=tuple(C.LINKS))))


def _layouts(*, model: str, gpus: int, gpu: str, seq_len: int, global_batch: int, micro_batch_size: int) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    plans = PAR.plan_layouts(spec, gpus, g, seq_len=seq_len, global_batch=global_batch,
                             micro_batch_size=micro_batch_size)
    ok = [x for x in plans if x.fit.fits]
    shown = ok[:6] + [x for x in plans if not x.fit.fits][:max(2, 8 - len(ok[:6]))]
    bars = [(f"{x.layout.dp}x{x.layout.tp}x{x.layout.pp}" + ("+sp" if x.layout.sp else "") + ("+z1" if x.layout.zero else "")
             + ("" if x.recompute == "none" else f"+{x.recompute[:3]}"),
             [(c.replace("_", " "), getattr(x.peak, c) / GiB, COLORS[c]) for c in memory.CATEGORIES]) for x in shown]
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name} on {gpus} x {g.name}: the fullest GPU of each layout (dp x tp x pp)",
                       line=(g.usable_bytes / GiB, f"{g.name} usable"), wide=720)
    head = f"{'layout':50}{'fullest GPU':>12}{'needs':>11}{'tokens/s':>11}{'bubble':>8}{'recompute':>10}"
    rows = [f"{x.name:50}{fmt_bytes(x.peak.total):>12}{fmt_bytes(x.fit.needed):>11}{x.tokens_per_s:>11,.0f}"
            f"{float(x.bubble):>8.1%}{x.recompute_fraction:>+10.0%}" for x in shown]
    lines = [f"{len(ok)} of {len(plans)} layouts fit ({global_batch} sequences of {seq_len} tokens per step, "
             f"micro-batch {micro_batch_size}, bf16 AMP, AdamW fused, 1F1B):", head, *rows[:len(ok[:6])]]
    if len(shown) > len(ok[:6]):
        lines += ["", "the closest that do NOT fit:", head, *rows[len(ok[:6]):]]
    if ok:
        lines += ["", ok[0].peak.table(title=f"fastest that fits: {ok[0].name}, {ok[0].peak.label}"), str(ok[0].fit)]
    lines += ["", "time: a roofline at 40 % of the GPU's bf16 peak, the bubble (p-1)/m, tensor-parallel all-reduces on "
                  "NVLink and the pipeline's sends exposed; data-parallel all-reduce hidden behind the backward"]
    best = ok[0] if ok else None
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "fitting": (len(ok), f"{len(ok)} of {len(plans)}"),
        "best": (best.tokens_per_s if best else 0, best.name if best else "no layout fits"),
        "tokens": (best.tokens_per_s if best else 0, f"{best.tokens_per_s:,.0f} tokens/s" if best else "-")})


LAYOUTS = Calculator(
    name="layouts", title="Plan a cluster: every layout of N GPUs, the ones that fit, fastest first", compute=_layouts,
    number_labels={"fitting": "layouts that fit", "best": "fastest", "tokens": "throughput"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.1-70b", choices=DECODER_PRESETS),
            Input(name="gpus", label="GPUs", kind="choice", default=64, choices=(8, 16, 32, 64, 128, 256, 512, 1024)),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="seq_len", label="sequence length", kind="choice", default=4096, choices=SEQ_CHOICES),
            Input(name="global_batch", label="sequences per step", kind="choice", default=512,
                  choices=(64, 128, 256, 512, 1024, 2048)),
            Input(name="micro_batch_size", label="micro-batch size", kind="choice", default=1, choices=(1, 2, 4))))

# ----------------------------------------------------------------------------- chapter 4

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
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name} on {ranks} ranks, {recipe}: one rank's peak",
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

# ----------------------------------------------------------------------------- chapter 7

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
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}, b={batch_size}, s={seq_len}, {precision}: peak by plan "
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

# ----------------------------------------------------------------------------- chapter 6

OFFLOAD_SCHEMES = ("none", "save_on_cpu", "zero-offload", "fsdp2-cpu", "infinity-cpu", "infinity-nvme", "smallest that fits")
HOST_RAM_GIB = (16, 32, 64, 128, 256, 512, 1024, 2048)


LOADERS = ("pin_memory, 4 workers", "pin_memory, 0 workers", "pageable, 4 workers")


def _loader_lines(*, loader: str, batch_size: int, seq_len: int, gpu, step_seconds: float) -> list[str]:
    """The data loader's host memory and copy (`offload.loader_memory`): a causal LM's batch is its
    token ids, labels and attention mask, int64 each (transformers' collators)."""
    pinned, workers = loader.startswith("pin_memory"), int(loader.split(", ")[1].split()[0])
    lm = OFF.loader_memory([8 * batch_size * seq_len] * 3, num_workers=workers, pin_memory=pinned, gpu=gpu,
                           step_seconds=step_seconds)
    flight = f"{lm.batches_in_flight} batches in flight ({workers} workers x prefetch_factor 2)" if workers else \
        "no batch in flight (the loop's thread loads each one when asked)"
    held = f"{lm.pinned_batches} pinned at once, {fmt_bytes(lm.pinned_bytes)} of page-locked host memory" if pinned \
        else "nothing pinned: the driver stages each copy through its own pinned buffer"
    if pinned:
        other = OFF.loader_memory([8 * batch_size * seq_len] * 3, num_workers=workers, pin_memory=False, gpu=gpu)
        copy = (f"its copy {1e6 * lm.copy_seconds:.0f} us with non_blocking=True ({100 * lm.step_share:.3g} % of the "
                f"step); from pageable memory {1e6 * other.copy_seconds:.0f} us, and the host would wait for it")
    else:
        copy = (f"its copy {1e6 * lm.copy_seconds:.0f} us ({100 * lm.step_share:.3g} % of the step), and the host waits "
                "for it")
    return [f"data loader ({loader}): a batch is {fmt_bytes(lm.batch_bytes)} (ids, labels, mask: int64); {flight}; "
            f"{held}; {copy}"]


def _offload(*, model: str, scheme: str, batch_size: int, seq_len: int, gpu: str, host_ram: int = 256,
             loader: str = LOADERS[0]) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    ram = host_ram * GiB
    kw = dict(batch_size=batch_size, seq_len=seq_len)
    gpu_s = CK.evaluate(spec, "none", precision="bf16-mixed", gpu=g, **kw).step_seconds  # at CK.MFU
    act = OFF.activation_offload(spec, precision="bf16-mixed", gpu=g, baseline_seconds=gpu_s, **kw)
    zo = OFF.model_offload(spec, scheme="zero-offload", gpu=g, gpu_seconds=gpu_s, **kw)
    fs = OFF.model_offload(spec, scheme="fsdp2-cpu", gpu=g, gpu_seconds=gpu_s, **kw)
    rows = [("none", act.baseline_peak, 0, 0, gpu_s), ("save_on_cpu", act.gpu_peak, act.host_bytes, 2 * act.moved_bytes,
                                                       act.step_seconds),
            ("zero-offload", zo.gpu_peak, zo.host_bytes, zo.moved_bytes, zo.step_seconds),
            ("fsdp2-cpu", fs.gpu_peak, fs.host_bytes, fs.moved_bytes, fs.step_seconds)]
    largest = fitting.fragmentation_bytes(spec, precision="bf16-mixed", **kw)
    verdicts = {name: fitting.device_fit(b, g, largest_tensor=largest) for name, b, *_ in rows}
    # ZeRO-Infinity (DeepSpeed stage 3, every block recomputed): parameters and optimizer on the CPU, on NVMe
    inf = {"infinity-cpu": OFF.infinity(spec, params="cpu", optimizer="cpu", gpu=g, **kw),
           "infinity-nvme": OFF.infinity(spec, params="nvme", optimizer="nvme", gpu=g, **kw)}
    need = OFF.needed_placement(spec, host_ram_bytes=ram, gpu=g, **kw)
    room = g.usable_bytes - g.context_bytes
    ok = {name: verdicts[name].fits and h <= ram for name, b, h, *_ in rows}
    ok.update({name: r.gpu_bytes <= room and r.host_bytes <= ram for name, r in inf.items()})
    bars = [(name, [(c.replace("_", " "), getattr(b, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for name, b, *_ in rows]
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len}, bf16: the GPU's peak with each offload",
                       line=(g.usable_bytes / GiB, f"{g.name} usable"))
    link = OFF.host_link_GBps(g)
    lines = [f"{'scheme':>13}{'GPU peak':>12}{'host':>12}{'over PCIe':>12}{'on NVMe':>12}{'step':>10}   fits (GPU, {host_ram} GiB host)",
             *(f"{name:>13}{fmt_bytes(b.total):>12}{fmt_bytes(h):>12}{fmt_bytes(m):>12}{'-':>12}{1e3 * t:>8.0f}ms   "
               f"{'yes' if ok[name] else 'NO'}" for name, b, h, m, t in rows),
             *(f"{name:>13}{fmt_bytes(r.gpu_bytes):>12}{fmt_bytes(r.host_bytes):>12}{fmt_bytes(r.pcie_bytes):>12}"
               f"{fmt_bytes(r.nvme_bytes):>12}{1e3 * r.step_seconds:>8.0f}ms   {'yes' if ok[name] else 'NO'}"
               for name, r in inf.items()), "",
             "smallest placement that fits: " + (f"parameters on {need.params}, optimizer states on {need.optimizer}"
                                                 if need else "none (not even everything on NVMe)"), "",
             f"host link: PCIe {OFF.pcie_generation(g)}.0 x16, {link:.1f} GB/s each way (nominal); copies counted at "
             f"{OFF.SAVE_ON_CPU_EFFICIENCY:.2f} of it; ZeRO-Offload's gradients (fp32, as DeepSpeed copies them) hide "
             "behind the backward, nothing else overlaps",
             f"GPU step without offload: {1e3 * gpu_s:.0f} ms at {100 * CK.MFU:.0f} % of the GPU's peak; the CPU's Adam "
             f"step: {OFF.CPU_ADAM_SECONDS_PER_PARAM * 1e9:.2f} ns a parameter for FSDP2 (torch AdamW, an H100 host's "
             f"16 cores), {OFF.DS_CPU_ADAM_SECONDS_PER_PARAM * 1e9:.2f} ns for ZeRO-Offload (DeepSpeed's host step, "
             "measured on the same host)",
             f"ZeRO-Infinity: every block recomputed, copies at {OFF.STREAM_EFFICIENCY:.1f} of the link, NVMe at "
             f"{OFF.NVME_GBps:g} GB/s (one drive, an assumption), the overlap at its best",
             *_loader_lines(loader=loader, batch_size=batch_size, seq_len=seq_len, gpu=g, step_seconds=gpu_s), ""]
    pick = need if scheme == "smallest that fits" else inf.get(scheme)
    if scheme == "smallest that fits" and need is None:
        pick = inf["infinity-nvme"]
        lines += ["nothing fits: the closest is infinity-nvme", ""]
    if pick is not None:
        fits = pick.gpu_bytes <= room and pick.host_bytes <= ram
        lines += [f"{pick.label}: GPU {fmt_bytes(pick.gpu_bytes)}, host {fmt_bytes(pick.host_bytes)}, NVMe "
                  f"{fmt_bytes(pick.nvme_bytes)}; per step {fmt_bytes(pick.pcie_bytes)} over PCIe ({pick.pcie_seconds:.2f} s), "
                  f"{fmt_bytes(pick.nvme_read_bytes + pick.nvme_write_bytes)} to and from NVMe ({pick.nvme_seconds:.2f} s), "
                  f"compute {pick.compute_seconds:.2f} s, CPU Adam {pick.cpu_seconds:.2f} s", "",
                  "DeepSpeed config (zero_optimization):",
                  json.dumps(OFF.deepspeed_config(pick, batch_size=batch_size)["zero_optimization"], indent=1)]
        return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
            "gpu_peak": (pick.gpu_bytes, fmt_bytes(pick.gpu_bytes)), "host": (pick.host_bytes, fmt_bytes(pick.host_bytes)),
            "step_ms": (pick.step_seconds * 1e3, f"{pick.step_seconds * 1e3:.0f} ms"), "fits": (int(fits), "yes" if fits else "no")})
    mine = dict((r[0], r) for r in rows)[scheme]
    lines += [mine[1].table(title=f"{scheme}: {mine[1].label}"), "", str(verdicts[scheme]), verdicts[scheme].explain()]
    if mine[2] > ram:
        lines += [f"host memory: {fmt_bytes(mine[2])} needed, {host_ram} GiB given: does NOT fit"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "gpu_peak": (mine[1].total, fmt_bytes(mine[1].total)), "host": (mine[2], fmt_bytes(mine[2])),
        "step_ms": (mine[4] * 1e3, f"{mine[4] * 1e3:.0f} ms"), "fits": (int(ok[scheme]), "yes" if ok[scheme] else "no")})


OFFLOAD = Calculator(
    name="offload", title="Offload in training: the GPU's peak, host memory and the step", compute=_offload,
    number_labels={"gpu_peak": "GPU peak", "host": "host memory", "step_ms": "step", "fits": "fits"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.2-1b", choices=DECODER_PRESETS),
            Input(name="scheme", label="offload", kind="choice", default="save_on_cpu", choices=OFFLOAD_SCHEMES),
            Input(name="batch_size", label="batch size", kind="int", default=4, min=1, max=128),
            Input(name="seq_len", label="sequence length", kind="choice", default=2048, choices=SEQ_CHOICES),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="host_ram", label="host memory", kind="choice", default=256, choices=HOST_RAM_GIB, unit="GiB"),
            Input(name="loader", label="data loader", kind="choice", default=LOADERS[0], choices=LOADERS)))

TEN_B = "gpt-10b (48 x 4096)"


def _streaming(*, model: str, gpu: str, tokens: int, weights: str, buffers: int) -> Result:
    spec = OFF.ten_b_model() if model == TEN_B else specs.preset(model)
    g = specs.gpu(gpu)
    wb = {"int8": 1, "16-bit": 2, "fp32": 4}[weights]
    r = OFF.stream_model(spec, g, tokens=tokens, weight_bytes=wb, buffers=buffers)
    n = spec.num_layers + spec.num_decoder_layers
    hide = n - len(r.hiding.streamed)
    lines = [f"{spec.name} on {g.name}: {n} blocks of {fmt_bytes(r.layer_bytes)} ({weights}), "
             f"{fmt_bytes(r.other_bytes)} of embeddings and head kept on the GPU",
             f"one block: compute {1e3 * r.layer_seconds:.2f} ms for {tokens} token(s); copy "
             f"{1e3 * r.layer_bytes / (r.link_GBps * 1e9):.2f} ms over {r.link_GBps:.1f} GB/s "
             f"({100 * OFF.STREAM_EFFICIENCY:.0f} % of PCIe {OFF.pcie_generation(g)}.0 x16)",
             f"usable GPU memory: {fmt_bytes(r.usable_bytes)}"]
    if r.fitted is None:
        lines.append("does NOT fit: even with every block streamed, the embeddings, head and buffers exceed the GPU")
        svg = narrow = ""
        numbers = {"resident": (0, "does not fit"), "pass_ms": (0.0, "-"), "hide": (hide, f"{hide} of {n}")}
    else:
        f = r.fitted
        lines += [f"fits with {r.most_resident} of {n} blocks resident, {n - r.most_resident} streamed through "
                  f"{min(buffers, n - r.most_resident)} buffer(s): {fmt_bytes(f.gpu_bytes + r.other_bytes)} on the GPU, "
                  f"{fmt_bytes(f.host_bytes)} in host memory",
                  f"one pass: {1e3 * f.seconds:.1f} ms ({f.seconds / f.compute_seconds:.1f}x the compute alone, "
                  f"{1e3 * f.compute_seconds:.1f} ms){'' if f.hidden else ': the copies do not hide'}",
                  f"the copies hide with {hide} of {n} resident (needs "
                  f"{fmt_bytes(r.hiding.gpu_bytes + r.other_bytes)} on the GPU"
                  f"{'' if r.hiding.gpu_bytes + r.other_bytes <= r.usable_bytes else ': more than it has'})"]
        svg, narrow = _both(streams, f.events, makespan=f.seconds,
                      title=f"one pass, {r.most_resident} of {n} blocks resident: {1e3 * f.seconds:.1f} ms")
        numbers = {"resident": (r.most_resident, f"{r.most_resident} of {n}"),
                   "pass_ms": (1e3 * f.seconds, f"{1e3 * f.seconds:.1f} ms"), "hide": (hide, f"{hide} of {n}")}
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers=numbers)


STREAMING = Calculator(
    name="streaming", title="A model bigger than the GPU, streamed layer by layer (BMInf)", compute=_streaming,
    number_labels={"resident": "blocks resident", "pass_ms": "one pass", "hide": "resident blocks that hide the copies"},
    inputs=(Input(name="model", label="model", kind="choice", default=TEN_B, choices=(TEN_B,) + specs.preset_names()),
            Input(name="gpu", label="GPU", kind="choice", default="gtx-1060-6gb", choices=GPU_CHOICES),
            Input(name="tokens", label="tokens per pass", kind="choice", default=1,
                  choices=(1, 8, 64, 256, 512, 1024, 2048, 4096)),
            Input(name="weights", label="weights", kind="choice", default="int8", choices=("int8", "16-bit", "fp32")),
            Input(name="buffers", label="buffers", kind="choice", default=2, choices=(1, 2, 3, 4))))

# ----------------------------------------------------------------------------- chapter 8

_INFER_FMT = {32: "fp32", 16: "bf16", 8: "int8", 4: "nf4-dq"}
_TUNE = {("full", 32): ("full", "fp32", "adamw"), ("full", 16): ("full", "bf16-mixed", "adamw"),
         ("full", 8): ("full", "bf16-mixed", "adamw-8bit"), ("lora", 32): ("lora", "fp32", "adamw"),
         ("lora", 16): ("lora", "bf16", "adamw"), ("lora", 8): ("lora-int8", "bf16", "adamw"),
         ("lora", 4): ("qlora", "bf16", "adamw")}
# prompt learning (peft's defaults but where the name says): the method and its prompt_learning options
_PROMPT = {"prompt": ("prompt", {}), "prefix": ("prefix", {}), "prefix (MLP)": ("prefix", {"prefix_projection": True}),
           "p-tuning": ("p-tuning", {}), "p-tuning (LSTM)": ("p-tuning", {"encoder_type": "LSTM"})}
_PROMPT_NAMES = {"prompt": "prompt tuning", "prefix": "prefix tuning", "p-tuning": "P-tuning"}
_PROMPT_BARS = {"prompt": "prompt p={p}", "prefix": "prefix p={p}", "prefix (MLP)": "prefix MLP",
                "p-tuning": "P-tuning MLP", "p-tuning (LSTM)": "P-tuning LSTM"}  # the chosen method's bar
_PROMPT_PRECISION = {32: "fp32", 16: "bf16"}  # the frozen base's dtype; peft keeps the prompt in fp32
_MOE_PRECISION = {32: "fp32", 16: "bf16-mixed"}  # every expert trained, as full fine-tuning at those bits
COMPRESSION_METHODS = ("full", "lora", "inference") + tuple(_PROMPT) + ("moefication",)
# the inputs each method reads (beside model, method, bits, batch size, sequence length and GPU; prefix
# tuning and MoEfication read gradient checkpointing to refuse it)
_COMPRESSION_USES = {"full": ("recompute",), "lora": ("rank", "targets", "recompute"), "inference": (),
                     "moefication": ("experts", "active", "recompute"),
                     **{m: ("virtual_tokens", "recompute") for m in _PROMPT}}


def _refused(error: str, *inputs: str) -> Result:
    return Result(text="", error=error, invalid=inputs)


def _compression(*, model: str, method: str, rank: int, bits: int, targets: str, batch_size: int, seq_len: int,
                 gpu: str, recompute: str = "none", virtual_tokens: int = 20, experts: int = 32,
                 active: int = 4) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    kw = dict(batch_size=batch_size, seq_len=seq_len, gpu=g)
    prompt, moe = method in _PROMPT, method == "moefication"
    pl = mo = None
    limit = spec.max_position_embeddings if spec.family != "t5" else 0
    if limit and seq_len > limit:  # as checks.positions says it, before a prompt lengthens the sequence
        return _refused(f"{spec.name} reads at most {limit:,} positions; seq_len {seq_len:,} is longer", "seq_len")
    # the combinations the library cannot estimate, refused in one line that names the control
    if prompt:
        how, opts = _PROMPT[method]
        if bits not in _PROMPT_PRECISION:
            return _refused(f"{_PROMPT_NAMES[how]} is estimated on a 32- or 16-bit base (peft keeps the prompt in "
                            "fp32): choose 32 or 16 bits", "bits")
        if how == "prefix" and recompute != "none":
            return _refused("peft refuses prefix tuning with gradient checkpointing (its prefix is a KV cache): "
                            "set gradient checkpointing to none, or choose prompt tuning or P-tuning", "recompute")
        if how == "prefix" and spec.family == "t5" and spec.q_dim != spec.hidden_size:
            return _refused(f"{spec.name}: peft's prefix tuning cannot wrap it (its attention is {spec.num_heads} x "
                            f"{spec.head_dim} = {spec.q_dim} wide, d_model {spec.hidden_size}): choose prompt tuning "
                            "or P-tuning", "method")
        # a prompt lengthens the sequence; a prefix is a cache p tokens long, so the sequence's positions
        # start at p (GPT-2 with n_positions 16, p=4 and 14 tokens: IndexError in peft 0.21)
        if limit and seq_len + virtual_tokens > limit:
            return _refused(f"{spec.name} reads at most {limit:,} positions; the {virtual_tokens:,} virtual "
                            f"token{'s come' if virtual_tokens > 1 else ' comes'} "
                            f"first and make the sequence {seq_len + virtual_tokens:,}: choose fewer, or a shorter "
                            "sequence", "virtual_tokens")
        pl = COMP.prompt_learning(spec, method=how, num_virtual_tokens=virtual_tokens, **opts)
    if moe:
        i = spec.intermediate_size
        if bits not in _MOE_PRECISION:
            return _refused("MoEfication trains every expert: choose 32 bits (fp32) or 16 (bf16-mixed); "
                            "8- and 4-bit bases are not modelled for it", "bits")
        if recompute != "none":
            return _refused("MoEfication's estimate cuts the FFN tensors a step saves, which gradient checkpointing "
                            "does not keep: set gradient checkpointing to none", "recompute")
        if experts > i or i % experts:
            return _refused(f"{spec.name}'s FFN has {i:,} neurons a layer, which do not split into {experts:,} equal "
                            f"experts: choose a divisor of {i:,}", "experts")
        if active > experts:
            return _refused(f"active experts: {active:,} is more than the {experts:,} experts", "active")
        mo = COMP.moefication(spec, experts=experts, active=active, precision=_MOE_PRECISION[bits],
                              dtype="fp32" if bits == 32 else "bf16", seq_len=seq_len)

    def one(m: str, b: int) -> memory.MemoryBreakdown:
        if m == "inference":
            return COMP.quantized_inference(spec, fmt=_INFER_FMT[b], batch_size=batch_size, seq_len=seq_len)
        if m in _PROMPT:
            return COMP.peft_training(spec, method=_PROMPT[m][0], num_virtual_tokens=virtual_tokens,
                                      precision=_PROMPT_PRECISION[b], recompute=recompute, **_PROMPT[m][1], **kw)
        if m == "moefication":
            return COMP.moefied_training(spec, experts=experts, active=active, precision=_MOE_PRECISION[b], **kw)
        if (m, b) not in _TUNE:
            raise ValueError("full fine-tuning cannot train 4-bit weights: choose LoRA at 4 bits (QLoRA)")
        how, precision, opt = _TUNE[m, b]
        return COMP.peft_training(spec, method=how, rank=rank, targets=targets, precision=precision, optimizer=opt,
                                  recompute=recompute, **kw)

    mine = one(method, bits)
    rows = [(f"{'infer' if m == 'inference' else m} {b}-bit", mine if (m, b) == (method, bits) else one(m, b))
            for m in ("full", "lora", "inference") for b in (32, 16, 8, 4) if m == "inference" or (m, b) in _TUNE]
    if prompt or moe:  # the chosen method beside the others (MoEfication beside full fine-tuning at its bits)
        # (short: a label wraps into lines of about five characters, and three fit under the bars)
        rows.append((f"MoE {active}/{experts}" if moe else _PROMPT_BARS[method].format(p=virtual_tokens), mine))
    bars = [(name, [(c.replace("_", " "), getattr(r, c) / GiB, COLORS[c]) for c in memory.CATEGORIES]) for name, r in rows]
    infer = method == "inference"
    verdict = fitting.device_fit(mine, g, largest_tensor=fitting.fragmentation_bytes(
        spec, batch_size=batch_size, seq_len=seq_len, mode="infer" if infer else "train",
        precision="bf16-mixed", dtype="int8" if bits == 8 else "bf16"))
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len}: the peak of each method",
                       line=(g.usable_bytes / GiB, f"{g.name} usable"))
    if method == "lora":
        n = COMP.lora_params(spec, rank=rank, targets=targets)
        trainable = (f"trainable: {n:,} of {spec.params:,} parameters ({100 * n / spec.params:.3f} %; LoRA r={rank} on "
                     f"{len(COMP.lora_targets(spec, targets))} matrices, as peft counts)")
    elif prompt:
        n = pl.trainable
        shape = {"prompt": f"an embedding of {pl.submodules * virtual_tokens:,} x {pl.token_dim:,}",
                 "prefix": f"{virtual_tokens:,} keys and values of {pl.token_dim:,} in each of {pl.num_layers} layers"
                           + (f", through an MLP of {pl.encoder_hidden_size:,}" if pl.prefix_projection else ""),
                 "p-tuning": f"an embedding of {pl.submodules * virtual_tokens:,} x {pl.token_dim:,} and an "
                             f"{pl.encoder_type} prompt encoder of {pl.encoder_hidden_size:,}"}[pl.method]
        trainable = (f"trainable: {n:,} of {spec.params:,} parameters ({100 * n / spec.params:.4f} %; {shape}, "
                     f"as peft counts; the frozen base in {_PROMPT_PRECISION[bits]}, the prompt in fp32)")
    elif moe:
        n = mo.params
        trainable = (f"trainable: all {n:,} parameters (the dense {mo.params_dense:,} and {mo.router_params:,} in "
                     f"{mo.ffn_layers} linear routers): every expert stays resident and is trained")
    else:
        n = 0 if infer else spec.params
        trainable = "trainable: none (inference)" if infer else f"trainable: all {spec.params:,} parameters"
    what = {"full": f"full fine-tuning, {bits}-bit weights", "lora": f"LoRA, {bits}-bit base",
            "inference": f"inference, {bits}-bit weights", "moefication": f"MoEfication, {active} of {experts} experts, "
            f"{_MOE_PRECISION.get(bits)}"}.get(method, f"{method}, p={virtual_tokens}, {bits}-bit base")
    lines = [mine.table(title=f"{what}: {mine.label}"), "", trainable]
    numbers = {"peak": (mine.total, fmt_bytes(mine.total)), "trainable": (n, f"{n:,}"),
               "fits": (int(verdict.fits), "yes" if verdict.fits else "no")}
    if moe:
        share = mo.flops / mo.flops_dense
        lines += [f"experts: each FFN's {spec.intermediate_size:,} neurons in {experts} groups of "
                  f"{mo.neurons_per_expert:,}; a token computes {active} ({100 * mo.active_share:.1f} % of the FFN)",
                  f"active parameters a token: {mo.active_params:,} of {mo.params:,} "
                  f"({100 * mo.active_params / mo.params:.1f} %; the FFNs' {mo.active_ffn_params:,} of {mo.ffn_params:,})",
                  f"forward FLOPs a token at {seq_len:,} tokens of context: {mo.flops / 1e9:.3g} G against "
                  f"{mo.flops_dense / 1e9:.3g} G dense ({100 * share:.1f} %); the FFNs' {mo.ffn_flops / 1e9:.3g} G "
                  f"against {mo.ffn_flops_dense / 1e9:.3g} G (the routers' included)",
                  f"FFN tensors a training step saves a token: {fmt_bytes(mo.ffn_saved_bytes)} against "
                  f"{fmt_bytes(mo.ffn_saved_bytes_dense)} dense; weights, gradients and optimizer states do not shrink"]
        numbers["active"] = (mo.active_params, f"{mo.active_params / 1e6:,.1f} M of {mo.params / 1e6:,.1f} M")
        numbers["flops"] = (mo.flops, f"{mo.flops / 1e9:.3g} G ({100 * share:.0f} % of dense)")
    used = ("model", "method", "bits", "batch_size", "seq_len", "gpu") + _COMPRESSION_USES[method]
    labels = {i.name: i.label for i in COMPRESSION.inputs}
    lines += [str(verdict), verdict.explain(),
              "ignored for this method: " + ", ".join(labels[k] for k in labels if k not in used)]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers=numbers)


COMPRESSION = Calculator(
    name="compression", title="Quantization, PEFT and MoEfication: memory by category", compute=_compression,
    number_labels={"peak": "peak", "trainable": "trainable parameters", "fits": "fits",
                   "active": "active parameters a token", "flops": "forward FLOPs a token"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.1-8b", choices=specs.preset_names()),
            Input(name="method", label="method", kind="choice", default="lora", choices=COMPRESSION_METHODS),
            Input(name="rank", label="LoRA rank", kind="choice", default=16, choices=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
            Input(name="bits", label="bits of the base weights", kind="choice", default=4, choices=(32, 16, 8, 4)),
            Input(name="targets", label="LoRA targets", kind="choice", default="default", choices=("default", "all-linear")),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=128),
            Input(name="seq_len", label="sequence length", kind="choice", default=2048, choices=SEQ_CHOICES),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="recompute", label="gradient checkpointing (training)", kind="choice", default="none",
                  choices=("none", "full")),
            Input(name="virtual_tokens", label="virtual tokens (prompt, prefix, P-tuning)", kind="int", default=20,
                  min=1, max=1024),
            Input(name="experts", label="experts in each FFN (MoEfication)", kind="int", default=32, min=1, max=65536),
            Input(name="active", label="active experts a token (MoEfication)", kind="int", default=4, min=1,
                  max=65536)))


# ----------------------------------------------------------------------------- chapter 1: explain a snapshot

_TORCH = "/usr/lib/python3/site-packages/torch"  # where the example's frames say torch lives (any path works)
_TRAIN_FRAME = {"filename": "/home/me/train.py", "line": 41, "name": "main"}
_EXAMPLE_FRAMES = {  # innermost first, as torch/csrc/profiler/combined_traceback.cpp writes them
    "parameters": [{"filename": f"{_TORCH}/nn/modules/module.py", "line": 1341, "name": "convert"},
                   {"filename": f"{_TORCH}/nn/modules/module.py", "line": 900, "name": "_apply"}, _TRAIN_FRAME],
    "gradients": [{"filename": "??", "line": 0, "name": "torch::autograd::AccumulateGrad::apply(...)"},
                  {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(...)"}],
    "optimizer_states": [{"filename": f"{_TORCH}/optim/adam.py", "line": 150, "name": "_init_group"},
                         {"filename": f"{_TORCH}/optim/adam.py", "line": 220, "name": "step"}, _TRAIN_FRAME],
    "activations": [{"filename": f"{_TORCH}/nn/modules/linear.py", "line": 125, "name": "forward"},
                    {"filename": f"{_TORCH}/nn/modules/module.py", "line": 1750, "name": "_call_impl"}, _TRAIN_FRAME],
    "kv_cache": [{"filename": "/usr/lib/python3/site-packages/transformers/cache_utils.py", "line": 700,
                  "name": "update"}, _TRAIN_FRAME],
    "other": [{"filename": "??", "line": 0, "name": "at::cuda::getCUDABlasLtWorkspace()"}, _TRAIN_FRAME],
    "inputs": [_TRAIN_FRAME],  # torch.randint(..., device="cuda") in the script: no rule knows it
}
EXAMPLE = {"model": "gpt2", "batch_size": 8, "seq_len": 1024, "precision": "fp32", "gpu": "t4"}


def example_snapshot(*, batch_size: int = 8, gpu: str = "t4", oom: bool = True) -> bytes:
    """An example snapshot built to the format of `torch.cuda.memory._snapshot()` (not recorded on a GPU):
    GPT-2 small (124 M parameters, 12 layers, d=768) trained in fp32 with Adam at `batch_size` x 1024 tokens
    with eager attention and transformers' KV cache left on, in the forward of its second step; gradients
    of the first step are still alive (zero_grad() is called before backward). Each layer's forward makes
    one segment (six d-wide tensors, two 4d-wide, the attention scores and their softmax, each batch x 1024
    x width x 4 B; a 2 MiB block freed in it), its KV cache another; layers are added until the next tensor
    does not fit `gpu`'s memory less its CUDA context: that request is the trace's "oom" entry (with
    `oom`), else the forward ends and no OOM is recorded. Bytes: integers, multiples of 512.
    Known limitations: a real step's tensors are many more, smaller blocks; the sizes are the layer's
    tensor shapes, not what a given PyTorch version allocates."""
    b, s, d, a, v, layers = _checks_example(batch_size), 1024, 768, 12, 50257, 12
    g = specs.gpu(gpu)
    capacity = g.usable_bytes - g.context_bytes
    hidden, wide, scores = b * s * d * 4, b * s * 4 * d * 4, b * a * s * s * 4
    per_layer = 12 * d * d + 13 * d  # GPT-2's block: attention 4d^2 + 4d, MLP 8d^2 + 5d, two norms 4d
    params = [v * d * 4, 1024 * d * 4] + [per_layer * 4] * layers + [2 * d * 4]
    segments, trace, state = [], [], {"addr": 0x7F0000000000, "reserved": 0}

    def segment(blocks: list[tuple[int, str, str]]) -> None:  # (size, state, category of the frames)
        out, addr = [], state["addr"]
        for size, st, cat in blocks:
            out.append({"address": addr, "size": size, "requested_size": size, "state": st,
                        "frames": _EXAMPLE_FRAMES[cat] if st != "inactive" else []})
            if st == "active_allocated":
                trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": len(trace),
                              "frames": out[-1]["frames"]})
            addr += size
        total = addr - state["addr"]
        alloc = sum(x["size"] for x in out if x["state"] == "active_allocated")
        segments.append({"device": 0, "address": state["addr"], "total_size": total, "allocated_size": alloc,
                         "active_size": alloc, "requested_size": alloc, "stream": 0,
                         "segment_type": "large" if total > 1 << 20 else "small", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": out[0]["frames"], "blocks": out})
        state["addr"], state["reserved"] = addr + (2 << 20), state["reserved"] + total

    def rounded(n: int) -> int:  # the allocator's 2 MiB granularity for large segments
        return -(-n // (2 << 20)) * (2 << 20)

    for cat, sizes in (("parameters", params), ("gradients", params), ("optimizer_states", params + params)):
        used = sum(sizes)
        segment([(n, "active_allocated", cat) for n in sizes] + [(rounded(used) - used, "inactive", "")])
    segment([(8 << 20, "active_allocated", "other"), (b * s * 8, "active_allocated", "inputs"),
             (2 << 20, "inactive", "")])
    layer = [hidden] * 6 + [wide] * 2 + [scores] * 2
    failed = None
    for _ in range(layers):
        kv = [(hidden, "active_allocated", "kv_cache")] * 2
        need = sum(layer) + (2 << 20) + 2 * hidden
        if oom and state["reserved"] + need > capacity:  # this layer does not fit: as far as it gets
            room, done = capacity - state["reserved"], []
            for n in layer:
                if sum(done) + n > room:
                    failed = n
                    break
                done.append(n)
            if done:
                segment([(n, "active_allocated", "activations") for n in done])
            break
        segment([(n, "active_allocated", "activations") for n in layer] + [(2 << 20, "inactive", "")])
        segment(kv)
    if failed is not None:
        trace.append({"action": "oom", "device_free": capacity - state["reserved"], "size": failed, "stream": 0,
                      "time_us": len(trace), "frames": _EXAMPLE_FRAMES["activations"]})
    data = {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}
    return pickle.dumps(data, protocol=4)


def _checks_example(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 64:
        raise ValueError(f"batch_size must be a whole number from 1 to 64, got {batch_size!r}")
    return batch_size


_EXAMPLE_BYTES: list[bytes] = []


def _example() -> bytes:
    if not _EXAMPLE_BYTES:
        _EXAMPLE_BYTES.append(example_snapshot(batch_size=EXAMPLE["batch_size"], gpu=EXAMPLE["gpu"]))
    return _EXAMPLE_BYTES[0]


NO_MODEL = "none (no estimate)"
NO_GPU = "not given"
_SNAP_COLORS = {**COLORS, "unknown": "#CCB974", "unattributed": "#BBBBBB", "cached free": "#E5E5E5"}


def _explain(*, snapshot: bytes | None, model: str, batch_size: int, seq_len: int, precision: str, gpu: str) -> Result:
    data = _example() if snapshot is None else snapshot
    estimate, phase = None, ""
    if model != NO_MODEL:
        spec = specs.preset(model)
        phases = memory.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision)
        try:
            snap = SNAP.load_snapshot(data)
        except ValueError as e:
            return _refused(f"snapshot file: {e.args[0]}", "snapshot")
        estimate, _ = SNAP.phase_to_compare(snap, phases)  # the phase the OOM came in, as `vramlab explain`
        phase = f"estimate: {spec.name}, {batch_size} x {seq_len}, {precision}, Adam, at '{estimate.phase}'"
        data = snap
    opts = {}
    if gpu != NO_GPU:
        g = specs.gpu(gpu)
        opts = {"device_total": g.usable_bytes, "context_bytes": g.context_bytes}
    try:
        e = SNAP.explain(data, estimate=estimate, batch_size=batch_size, **opts)
    except ValueError as err:
        return _refused(f"snapshot file: {err.args[0]}", "snapshot")
    rows = e.rows()
    cached = e.reserved - e.allocated
    snap_bar = [(c.replace("_", " "), s / GiB, _SNAP_COLORS[c]) for c, s, _ in rows] + \
               [("cached free", cached / GiB, _SNAP_COLORS["cached free"])]
    bars = [("snapshot", snap_bar)]
    if estimate is not None:
        bars.append(("estimate", [(c.replace("_", " "), (est or 0) / GiB, _SNAP_COLORS[c]) for c, _, est in rows]))
    line = (e.capacity / GiB, "PyTorch's capacity") if e.capacity else None
    svg, narrow = _both(stacked_bars, bars, title="the snapshot's bytes by category" +
                        (" beside the estimate" if estimate is not None else ""), line=line)
    source = ("the built-in example (GPT-2, fp32, Adam, batch 8 on a T4; built to PyTorch's snapshot format, "
              "not recorded on a GPU)" if snapshot is None else f"your file ({len(snapshot):,} B, read in this page)")
    lines = [f"snapshot: {source}"] + ([phase] if phase else []) + [""] + e.lines()
    numbers = {"allocated": (e.allocated, fmt_bytes(e.allocated)), "reserved": (e.reserved, fmt_bytes(e.reserved)),
               "cached_free": (cached, fmt_bytes(cached))}
    if e.fits_with_expandable_segments is not None:
        yes = e.fits_with_expandable_segments
        numbers["expandable"] = (int(yes), "fits" if yes else "does not fit")
    if e.largest_batch_that_fits is not None:
        numbers["largest_batch"] = (e.largest_batch_that_fits, f"{e.largest_batch_that_fits:,}")
    return Result(text="\n".join(lines), numbers=numbers, svg=svg, svg_narrow=narrow)


EXPLAIN = Calculator(
    name="explain", title="Explain an out-of-memory error: a memory snapshot, byte by byte", compute=_explain,
    number_labels={"allocated": "allocated", "reserved": "reserved", "cached_free": "held by the allocator",
                   "expandable": "with expandable_segments", "largest_batch": "largest batch that fits"},
    inputs=(Input(name="snapshot", label="snapshot file", kind="file", default=None, choices=(".pickle", ".pkl")),
            Input(name="model", label="estimate for model", kind="choice", default=EXAMPLE["model"],
                  choices=(NO_MODEL,) + specs.preset_names()),
            Input(name="batch_size", label="batch size of the run", kind="int", default=EXAMPLE["batch_size"],
                  min=1, max=4096),
            Input(name="seq_len", label="sequence length", kind="choice", default=EXAMPLE["seq_len"], choices=SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default=EXAMPLE["precision"], choices=P.PRECISIONS),
            Input(name="gpu", label="GPU (its total memory)", kind="choice", default=EXAMPLE["gpu"],
                  choices=(NO_GPU,) + GPU_CHOICES)))

# ----------------------------------------------------------------------------- optimizers (chapter 8)
OPT_MODELS = tuple(n for n in specs.preset_names() if specs.preset(n).is_causal_lm)
OPT_LABELS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD+mom.", "adamw-8bit": "8-bit bnb",
              "adafactor": "Adafactor", "adafactor-hf": "Adafactor HF", "adafactor-momentum": "Adafactor+m",
              "adamw-8bit-ao": "8-bit ao", "adamw-4bit-ao": "4-bit ao", "adamw-fp8-ao": "FP8 ao",
              "galore-adamw": "GaLore", "paged-adamw": "paged", "paged-adamw-8bit": "paged 8-bit",
              "adamw-cpu-offload": "CPU offload"}


def _optimizers(*, model: str, precision: str, optimizer: str, in_backward: str, galore_rank: int, batch_size: int,
                seq_len: int) -> Result:
    spec = specs.preset(model)
    in_bwd = in_backward == "yes"
    rows, bars = [], []
    for name in memory.ALL_OPTIMIZERS:
        lg = memory.optimizer_ledger(spec, name, precision, galore_rank=galore_rank)
        peak = memory.estimate_training(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                        optimizer=name, galore_rank=galore_rank, optimizer_in_backward=in_bwd)
        rows.append((name, lg, peak))
        segs = [(c.replace("_", " "), getattr(peak, c) / GiB, COLORS[c]) for c in memory.CATEGORIES]
        bars.append((OPT_LABELS[name] + (" <" if name == optimizer else ""), segs))
    step = "stepped in the backward" if in_bwd else "optimizer.step() after the backward"
    svg, narrow = _both(stacked_bars, bars, title=f"{spec.name}, {precision}, b={batch_size}, s={seq_len}: "
                                                  f"each optimizer's training peak ({step})", wide=720, horizontal=True)
    lines = [f"{'optimizer':20s}{'device states':>14}{'paged':>11}{'host':>11}{'peak':>11}"]
    for name, lg, peak in rows:
        lines.append(f"{name:20s}{fmt_bytes(lg.device):>14}{fmt_bytes(lg.paged) if lg.paged else '-':>11}"
                     f"{fmt_bytes(lg.host) if lg.host else '-':>11}{fmt_bytes(peak.total):>11}")
    name, lg, peak = next(r for r in rows if r[0] == optimizer)
    info = optimizers.INFO[optimizer]
    lines += ["", f"{info.label}: {info.keeps} ({info.source}); its peak: {peak.phase}",
              "device states: what the caching allocator holds (max_memory_allocated); paged: CUDA unified memory the "
              "driver may move to the host; host: an offloaded optimizer's states and pinned copies"]
    return Result(text="\n".join(lines), svg=svg, svg_narrow=narrow, numbers={
        "states": (lg.device, fmt_bytes(lg.device)), "peak": (peak.total, fmt_bytes(peak.total)),
        "adamw_peak": (rows[0][2].total, fmt_bytes(rows[0][2].total))})


OPTIMIZERS = Calculator(
    name="optimizers", title="Optimizer memory: states, where they live, and the step's peak", compute=_optimizers,
    number_labels={"states": "its states on the device", "peak": "its training peak", "adamw_peak": "AdamW's peak"},
    inputs=(Input(name="model", label="model", kind="choice", default="llama-3.2-1b", choices=OPT_MODELS),
            Input(name="precision", label="model dtype", kind="choice", default="bf16", choices=("fp32", "bf16")),
            Input(name="optimizer", label="optimizer", kind="choice", default="adafactor", choices=memory.ALL_OPTIMIZERS),
            Input(name="in_backward", label="optimizer in the backward", kind="choice", default="no", choices=("no", "yes")),
            Input(name="galore_rank", label="GaLore rank", kind="choice", default=128, choices=(16, 32, 64, 128, 256, 512, 1024)),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=1024, choices=SEQ_CHOICES)))

CALCULATORS: dict[str, Calculator] = {c.name: c for c in (TRAINING, MOE, SERVING, COLLECTIVES, PRECISION, PARALLEL, CONTEXT, EXPERTS,
                                                           LAYOUTS, ZERO,
                                                           OFFLOAD, STREAMING, CHECKPOINTING, COMPRESSION, EXPLAIN,
                                                           OPTIMIZERS)}


def get(name: str) -> Calculator:
    if name not in CALCULATORS:
        raise ValueError(f"unknown calculator {name!r}; known: {', '.join(CALCULATORS)}")
    return CALCULATORS[name]


def run_json(name: str, values_json: str) -> str:
    """The browser's entry point: JSON in, JSON out (a Result's dict)."""
    try:
        values = json.loads(values_json)
        return json.dumps(get(name).run(**values).to_dict())
    except (ValueError, TypeError) as e:
        return json.dumps(Result(text="", error=str(e)).to_dict())


def run_html(name: str, values_json: str) -> str:
    """The live page's entry point (book/_static/live-worker.mjs): JSON values in, JSON out with
    the result area's HTML (the same markup the build pre-rendered) and the numbers."""
    try:
        calc = get(name)
        r = calc.run(**json.loads(values_json))
    except (ValueError, TypeError) as e:
        calc, r = None, Result(text="", error=str(e))
    html = result_html(calc, r) if calc else f'<p class="vl-error">{escape(r.error)}</p>'
    return json.dumps({"html": html, "error": r.error, "invalid": list(r.invalid),
                       "numbers": {k: v for k, (v, _) in r.numbers.items()}})


# ----------------------------------------------------------------------------- the book's front end

def _control(i: Input, value: Any, cid: str) -> str:
    """Disabled until the page's script enables it: without JavaScript no control can disagree
    with the pre-rendered numbers."""
    common = f'id="{cid}-{i.name}" data-input="{i.name}" disabled'
    label = f'<label for="{cid}-{i.name}">{escape(i.label)}{" (" + i.unit + ")" if i.unit else ""}</label>'
    if i.kind == "file":  # read in the page (FileReader, live.mjs): nothing is uploaded
        return (f'<div class="vl-field vl-file">{label}<input type="file" {common} accept="{escape(",".join(i.choices))}" '
                f'data-file=""><small class="vl-file-name">{"the built-in example" if value is None else "a file"}'
                '; pick or drop a file: it is read in this page, never uploaded</small></div>')
    if i.kind == "choice":
        opts = "".join(f'<option value="{escape(str(c))}"{" selected" if str(c) == str(value) else ""}>'
                       f'{escape(str(c))}</option>' for c in i.choices)
        return f'<div class="vl-field">{label}<select {common}>{opts}</select></div>'
    if i.log:  # a log-scale slider: positions 0..1000 map to min..max geometrically (live.mjs: the same map)
        pos = round(1000 * math.log(value / i.min) / math.log(i.max / i.min))
        return (f'<div class="vl-field">{label}<input type="range" {common} min="0" max="1000" step="1" value="{pos}" '
                f'data-log-min="{i.min!r}" data-log-max="{i.max!r}"><output>{value:.4g}</output></div>')
    return (f'<div class="vl-field">{label}<input type="number" {common} min="{i.min:g}" max="{i.max:g}" step="1" '
            f'value="{value}"></div>')


def result_html(calc: Calculator, r: Result, *, narrow: bool = True) -> str:
    """The result area: the numbers, the chart and the text; an error is one line in the error's
    style (role="alert"). With `narrow`, the chart comes twice (wide, and laid out for a phone) and
    the book's CSS shows the one that fits the column (book.css: .vl-chart's container query)."""
    if r.error:
        return f'<p class="vl-error" role="alert">{escape(r.error)}</p>'
    nums = " · ".join(f'<span class="vl-number">{escape(calc.number_labels.get(k, k))} <strong data-key="{k}" '
                      f'data-value="{v!r}">{escape(s)}</strong></span>' for k, (v, s) in r.numbers.items())
    chart = (f'<div class="vl-wide">{r.svg}</div><div class="vl-narrow">{r.svg_narrow}</div>' if narrow and r.svg_narrow
             else r.svg)
    return f'<p class="vl-numbers">{nums}</p><div class="vl-chart">{chart}</div><pre class="vl-text">{escape(r.text)}</pre>'


def page_html(name: str, **values: Any) -> str:
    """The calculator as the online book shows it: its controls (disabled until the page's script
    takes over), the result pre-rendered by CPython at build time, and a status line: 'snapshot',
    then 'loading', then 'live' (Python running in this page, in a Web Worker), or 'error' (the
    inputs were refused: nothing computed for them) or 'failed' (Python could not start)."""
    calc = get(name)
    r = calc.run(**values)
    if r.error:
        raise ValueError(f"calculator {name}: {r.error}")
    checked = {i.name: i.check(values.get(i.name, i.default)) for i in calc.inputs}
    cid = f"vl-{name}"
    controls = "".join(_control(i, checked[i.name], cid) for i in calc.inputs)
    return (f'<div class="vramlab-calc" id="{cid}" data-calc="{name}" data-state="snapshot">'
            f'<div class="vl-head"><strong>{escape(calc.title)}</strong> '
            f'<span class="vl-status" role="status">snapshot: computed when this page was built</span></div>'
            f'<div class="vl-controls">{controls}</div>'
            f'<div class="vl-result" aria-live="polite">{result_html(calc, r)}</div></div>')
