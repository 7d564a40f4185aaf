"""Chapter 1's calculators (where memory goes): a training step and inference on one GPU (`training`), a
mixture of experts on one GPU (`moe`), and a paged-KV serving engine (`serving`)."""

from __future__ import annotations

import dataclasses

from .. import activations, fitting, memory, specs
from .. import optimizers
from .. import precision as P
from .. import serving as SERVE
from .. import inplace as IP
from ..units import GiB, fmt_bytes
from .calc_base import (CAPACITIES, COLORS, GPU_CHOICES, MOE_SEQ_CHOICES, SEQ_CHOICES, Calculator, Input, Result,
                        both, capacity_factor)
from .svg import stacked_bars

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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}: {spec.params / 1e6:,.0f} M params, b={batch_size}, s={seq_len}",
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
            Input(name="optimizer", label="optimizer", kind="choice", default="adamw", choices=optimizers.SHARDED),
            Input(name="attention", label="attention", kind="choice", default="sdpa", choices=activations.ATTENTIONS),
            Input(name="recompute", label="recompute", kind="choice", default="none", choices=activations.RECOMPUTES),
            Input(name="gpu", label="GPU", kind="choice", default="t4", choices=GPU_CHOICES),
            Input(name="accumulation_steps", label="accumulation steps", kind="int", default=1, min=1, max=64),
            Input(name="inplace", label="in-place ops", kind="choice", default="none", choices=IP.INPLACE_CHOICES),
            Input(name="allocator", label="allocator", kind="choice", default="default", choices=ALLOCATORS),
            Input(name="loss", label="loss", kind="choice", default="whole", choices=memory.LOSSES)))



_ROLE_COLORS = {"embeddings": "#DA8BC3", "attention": "#4C72B0", "norms": "#8C8C8C", "dense_mlp": "#937860",
                "router": "#8172B3", "routed_experts": "#C44E52", "shared_experts": "#DD8452", "head": "#55A868"}


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
        opts = dict(seq_len=seq_len, precision=precision, recompute=recompute, capacity_factor=capacity_factor(capacity))
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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}: {spec.params / 1e9:.1f} B parameters, "
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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name} on {g.name} at {utilization:g}: the pool by KV dtype "
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
