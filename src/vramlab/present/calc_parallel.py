"""Chapters 2 and 3's calculators: a collective's alpha-beta cost (`collectives`), data, tensor and pipeline
parallelism per device (`parallel`), every layout of N GPUs (`layouts`), context parallelism (`context`) and
expert parallelism (`experts`)."""

from __future__ import annotations

from .. import collectives as C
from .. import memory, specs
from .. import parallel as PAR
from .. import precision as P
from .. import pipeline as PIPE
from .. import context_parallel as CP
from .. import expert_parallel as EP
from ..units import GiB, fmt_bytes
from .calc_base import (CAPACITIES, COLORS, DECODER_PRESETS, GPU_CHOICES, MOE_SEQ_CHOICES, SEQ_CHOICES,
                        Calculator, Input, Result, both, capacity_factor)
from .svg import gantt, loglog_lines, stacked_bars

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
    svg, narrow = both(loglog_lines, series, title=f"{op} on {ranks} ranks: time vs message size", xlabel="message size (bytes)",
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



# ----------------------------------------------------------------------------- chapter 3

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
    bubble = PIPE.bubble_fraction(pp, micro_batches, schedule, chunks=chunks) if pp > 1 else 0
    shown = list(enumerate(stages))
    shown = shown if len(shown) <= 8 else shown[:4] + shown[-4:]  # the first and last stages differ most
    bars = [(f"stage {i}", [(c.replace("_", " "), getattr(b, c) / GiB, COLORS[c]) for c in memory.CATEGORIES])
            for i, b in shown]
    title = f"{spec.name} on {layout.devices} GPUs (dp {dp} x tp {tp} x pp {pp}): memory per device"
    svgs = [both(stacked_bars, bars, title=title, line=(g.usable_bytes / GiB, f"{g.name} usable"))]
    if pp > 1 and pp * micro_batches * chunks <= 512:
        run = PIPE.simulate(pp, micro_batches, schedule, chunks=chunks)
        svgs.append(both(gantt, run.ops, devices=pp, makespan=run.makespan, chunks=chunks,
                          title=f"{schedule}, {pp} stages, {micro_batches} micro-batches: bubble {float(bubble):.1%} of the step"))
    worst = max(stages, key=lambda b: b.total)
    lines = [worst.table(title=f"fullest device: {worst.label}"), "",
             str(verdict), verdict.explain(),
             f"pipeline bubble: {float(bubble):.1%} of the step's time"
             + (f" ({float(PIPE.bubble_fraction(pp, micro_batches, schedule, chunks=chunks, of='ideal')):.1%} of the ideal time)"
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
    """One context-parallel rank (`context_parallel.context_parallel`), beside the same step at every other CP size;
    `fsdp` "yes": the model states sharded over the CP ranks too (FSDP2)."""
    spec, g = specs.preset(model), specs.gpu(gpu)
    kw = dict(method=method, batch_size=batch_size, seq_len=seq_len, precision=precision, zigzag=zigzag == "yes",
              link=link, gpu=g, recompute=recompute, loss=loss, shard_states=fsdp == "yes")
    r = CP.context_parallel(spec, cp=cp, **kw)
    bars = []
    for n in CP_CHOICES:
        try:
            x = CP.context_parallel(spec, cp=n, **kw)
        except ValueError:  # this size does not split the heads or the sequence: left out of the sweep
            continue
        rest = x["peak"] - x["blocks_saved"]
        bars.append((f"cp {n}", [("saved by the blocks", x["blocks_saved"] / GiB, COLORS["activations"]),
                                 ("states, the loss and the rest", rest / GiB, COLORS["other"])]))
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len:,} tokens, {method}"
                                                  + (", recompute" if recompute == "full" else "")
                                                  + (f", {loss} loss" if loss != "whole" else "")
                                                  + (", FSDP2" if fsdp == "yes" else "")
                                                  + ": one rank's peak against the CP size",
                        line=(g.usable_bytes / GiB, f"{g.name} usable"))
    fits = CP.context_fit(spec, g, cp=cp, **{k: v for k, v in kw.items() if k != "gpu"})[1].fits
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
            Input(name="method", label="method", kind="choice", default="ring", choices=CP.CP_METHODS),
            Input(name="cp", label="context parallel", kind="choice", default=8, choices=CP_CHOICES),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=65536, choices=LONG_SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default="bf16-mixed", choices=P.PRECISIONS),
            Input(name="zigzag", label="zig-zag (ring)", kind="choice", default="yes", choices=("yes", "no")),
            Input(name="gpu", label="GPU", kind="choice", default="h100-80gb", choices=GPU_CHOICES),
            Input(name="link", label="link", kind="choice", default="nvlink4", choices=tuple(C.LINKS)),
            Input(name="recompute", label="recompute", kind="choice", default="none", choices=CP.CP_RECOMPUTE),
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
            Input(name="schedule", label="schedule", kind="choice", default="1f1b", choices=PIPE.SCHEDULES),
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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name} on {gpus} x {g.name}: the fullest GPU of each layout (dp x tp x pp)",
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


def _experts(*, model: str, ep: int, dp: int, capacity: str, zero: int, batch_size: int, seq_len: int,
             link: str) -> Result:
    """One expert-parallel rank (`expert_parallel.expert_parallel`): its states, dispatch buffers and all-to-all
    traffic, beside every other EP size that divides the experts and the ranks."""
    spec = specs.preset(model)
    kw = dict(dp=dp, batch_size=batch_size, seq_len=seq_len, capacity_factor=capacity_factor(capacity), zero_stage=zero,
              link=link)
    r = EP.expert_parallel(spec, ep=ep, **kw)
    bars = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        try:
            x = EP.expert_parallel(spec, ep=n, **kw)
        except ValueError:  # this size does not divide the experts or the ranks: left out of the sweep
            continue
        dense = sum(x[k]["dense"] for k in ("parameters", "gradients", "optimizer_states"))
        expert = sum(x[k]["experts"] for k in ("parameters", "gradients", "optimizer_states"))
        bars.append((f"ep {n}", [("dense states", dense / GiB, COLORS["parameters"]),
                                 ("expert states", expert / GiB, COLORS["optimizer_states"]),
                                 ("dispatch buffers (worst, all layers)",
                                  len(spec.moe_layer_ids) * (x["dispatch_bytes"]["sent"] + x["dispatch_bytes"]["received_worst"]) / GiB,
                                  COLORS["activations"])]))
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name} on {dp} ranks, ZeRO-{zero}: one rank's states against "
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
