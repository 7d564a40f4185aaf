"""What each `vramlab` subcommand prints (a table, the breakdown, the fit) or gives as one JSON object (--json),
beside every other setting of its main lever (ZeRO stages, CP and EP sizes, offload schemes, recompute plans,
KV dtypes); `COMMANDS` maps a subcommand to its function.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from .. import checkpointing as CK
from .. import compression as COMP
from .. import checks, fitting, memory, specs
from .. import offload as OFF
from .. import parallel as PAR
from .. import serving as SERVE
from .. import zero as Z
from .. import expert_parallel as EP
from ..units import fmt_bytes
from . import explain as _explain
from . import from_config
from .cli_answers import (CP_SWEEP, answer_checkpoint, answer_context, answer_estimate, answer_lora,
                          answer_offload, answer_plan, ck_kw, cp_rank, estimate_options, gpu_of, is_sharded, lora_fit,
                          lora_precision, model_spec, offload_rows, prompt_options, zero_stage)
from .cli_args import PROMPT_METHODS
from .cli_levers import answer_out, print_suggestions
from .tables import Cell, Table

def _fit_json(f: fitting.Fit) -> dict:
    return {"name": f.gpu.name, "usable_bytes": f.available, "fits": f.fits, "needed_bytes": f.needed,
            "reserve_bytes": f.reserve,
            "reserve": {"estimate_margin_bytes": f.margin, "fragmentation_bytes": f.fragmentation,
                        "cuda_context_bytes": f.context},
            "expandable_segments": f.expandable_segments, "max_batch_size": f.max_batch_size}


def _estimate(ns) -> int:
    if ns.from_file is not None:  # the training configuration the user has
        return from_config.answer_from(ns)
    spec, gpu = model_spec(ns), gpu_of(ns)
    options, _ = estimate_options(ns)
    if is_sharded(ns):
        return _estimate_rank(ns, spec, gpu, options)
    if ns.mode == "train":
        est = memory.estimate_training(spec, batch_size=ns.batch_size, gpu=gpu, **options)
    else:
        est = memory.estimate_inference(spec, batch_size=ns.batch_size, gpu=gpu, **options)
    here = verdict = None
    if gpu:
        here, verdict = answer_estimate(ns)
    out = {"model": spec.name, "model_type": spec.model_type, "mode": ns.mode, "params": spec.params,
           "batch_size": ns.batch_size, "seq_len": ns.seq_len, "options": options,
           "total_bytes": est.total, "breakdown": est.to_dict(), "peak_phase": est.phase}
    longest = None
    if verdict:  # the other question a GPU answers: the longest sequence at this batch size
        longest = fitting.longest_sequence(spec, gpu, batch_size=ns.batch_size, mode=ns.mode,
                                           expandable_segments=ns.expandable_segments,
                                           **{k: v for k, v in options.items() if k not in ("seq_len", "device")})
    if not ns.json:
        print(f"{spec.name}: {spec.params:,} parameters ({spec.model_type})")
        print(est.table())
        if verdict:
            print(verdict)
            print(verdict.explain())
            print(longest)
    if verdict:
        out["gpu"] = _fit_json(verdict)
        out["gpu"]["longest_seq_len"] = longest.seq_len
        out["gpu"]["longest_seq_len_capped_by_positions"] = longest.capped
        if not verdict.fits:
            out["suggestions"] = print_suggestions(ns, here)
    if ns.json:
        print(json.dumps(out, indent=2))
    return 0


def _estimate_rank(ns, spec, gpu, options: dict) -> int:
    n, stage = ns.gpus or 1, zero_stage(ns)
    setup = "FSDP2" if ns.fsdp2 else f"ZeRO-{stage}"
    kw = dict(micro_batch_size=ns.batch_size, seq_len=ns.seq_len, gpu=gpu, **options)
    est = Z.estimate_rank(spec, n, stage, **kw)
    desc = (f"{setup} ({'FSDP2' if ns.fsdp2 else 'DeepSpeed'}), {n} rank{'s' if n > 1 else ''}, recipe "
            f"{options['recipe']} ({'+'.join(map(str, Z.RECIPES[options['recipe']]))} bytes per parameter), "
            f"micro-batch {ns.batch_size} x {ns.seq_len}")
    out = {"model": spec.name, "model_type": spec.model_type, "mode": "train", "params": spec.params,
           "setup": setup, "ranks": n, "micro_batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "options": {**options, "stage": stage}, "total_bytes": est.total, "breakdown": est.to_dict(),
           "peak_phase": est.phase}
    if not ns.json:
        print(f"{spec.name}: {spec.params:,} parameters ({spec.model_type}); {desc}")
        print(est.table(title=f"one rank's peak: {est.label}"))
    if gpu is None:
        if ns.json:
            print(json.dumps(out, indent=2))
        return 0
    here, verdict = answer_estimate(ns)
    others = {k: v for k, v in options.items() if k != "implementation"}
    rows, setups = [], []
    for name, s, impl in [(f"ZeRO-{s}", s, "deepspeed") for s in Z.STAGES] + [("FSDP2", 3, "fsdp2")]:
        try:
            f = Z.fits(spec, n, s, gpu, micro_batch_size=ns.batch_size, seq_len=ns.seq_len,
                       expandable_segments=ns.expandable_segments, implementation=impl, **others)
        except ValueError:
            continue
        mine = name == setup
        cell = (lambda t: Cell(t, "strong")) if mine else str
        rows.append([cell(name), fmt_bytes(f.estimate), fmt_bytes(f.needed),
                     Cell("yes", "good") if f.fits else Cell("NO", "bad"), f"{f.max_batch_size:,}"])
        setups.append({"setup": name, "estimate_bytes": f.estimate, "needed_bytes": f.needed, "fits": f.fits,
                       "max_micro_batch_size": f.max_batch_size})
    out["gpu"] = {**_fit_json(verdict), "max_micro_batch_size": verdict.max_batch_size}
    out["setups"] = setups
    largest = f"{verdict.max_batch_size:,}" + (" or more" if verdict.capped else "")
    yes = (f"{'YES' if verdict.fits else 'NO'}: {spec.name} with {setup} on {n} x {gpu.name} "
           f"{'fits' if verdict.fits else 'does NOT fit'} ({fmt_bytes(verdict.needed)} needed a rank, "
           f"{fmt_bytes(verdict.available)} usable); largest micro-batch that fits: {largest}")
    out["answer"] = yes
    if not ns.json:
        print(Table(["setup", "one rank's peak", "needs", "fits", "largest micro-batch"], rows,
                    caption=f"every setup on {n} x {gpu.name}, micro-batch {ns.batch_size} x {ns.seq_len}, "
                            f"{options['recipe']}",
                    notes=["needs: the peak + 3 % margin + fragmentation + CUDA context (fitting.device_fit)"]))
        print()
        print(yes)
        print(verdict.explain())
    return answer_out(ns, out, here, fits=verdict.fits, per=" a rank")


def _plan(ns) -> int:
    spec = model_spec(ns)
    here, plans = answer_plan(ns)
    ok = [x for x in plans if x.fit.fits]
    shown = (ok or plans)[:ns.top]

    def row(x: PAR.LayoutPlan) -> list:
        return [x.name, fmt_bytes(x.peak.total), fmt_bytes(x.fit.needed),
                Cell("yes", "good") if x.fit.fits else Cell("NO", "bad"), f"{x.tokens_per_s:,.0f}",
                f"{float(x.bubble):.1%}", f"+{x.recompute_fraction:.0%}"]
    g = gpu_of(ns)
    caption = (f"{spec.name} on {ns.gpus} x {g.name}: {len(ok)} of {len(plans)} layouts fit ({ns.global_batch} "
               f"sequences of {ns.seq_len} tokens a step, micro-batch {ns.micro_batch_size}, {ns.precision}, "
               f"AdamW fused, 1F1B)" + ("" if ok else "; the closest:"))
    table = Table(["layout", "fullest GPU", "needs", "fits", "tokens/s", "bubble", "recompute"],
                  [row(x) for x in shown], caption=caption,
                  notes=["time: a roofline at 40 % of the GPU's 16-bit peak, the bubble (p-1)/m, tensor-parallel "
                         "all-reduces on NVLink and the pipeline's sends exposed; data-parallel all-reduce hidden"])
    out = {"model": spec.name, "gpus": ns.gpus, "gpu": g.name, "seq_len": ns.seq_len, "global_batch": ns.global_batch,
           "micro_batch_size": ns.micro_batch_size, "precision": ns.precision, "fits": bool(ok),
           "layouts_fitting": len(ok), "layouts": len(plans),
           "shown": [{"layout": x.name, "dp": x.layout.dp, "tp": x.layout.tp, "pp": x.layout.pp, "sp": x.layout.sp,
                      "zero": x.layout.zero, "recompute": x.recompute, "peak_bytes": x.peak.total,
                      "needed_bytes": x.fit.needed, "usable_bytes": x.fit.available, "fits": x.fit.fits,
                      "tokens_per_s": x.tokens_per_s, "step_seconds": x.step_seconds, "bubble": float(x.bubble),
                      "recompute_fraction": x.recompute_fraction} for x in shown]}
    if not ns.json:
        print(table)
        if ok:
            print()
            print(ok[0].peak.table(title=f"fastest that fits: {ok[0].name}; its fullest GPU, {ok[0].peak.label}"))
            print(ok[0].fit)
    return answer_out(ns, out, here, fits=ok, per=" on the fullest GPU")


def _lora(ns) -> int:
    spec = model_spec(ns)
    here, verdict = answer_lora(ns)
    peak, _ = lora_fit(ns, ns.batch_size)
    precision = lora_precision(ns)
    if ns.method in PROMPT_METHODS:
        pl = COMP.prompt_learning(spec, method=ns.method, **prompt_options(ns))
        n = pl.trainable
        trainable = (f"trainable: {n:,} of {spec.params + n:,} parameters ({100 * n / (spec.params + n):.3f} %; "
                     f"{ns.method} with {ns.virtual_tokens or 20} virtual tokens, as peft counts)")
    else:
        n = COMP.lora_params(spec, rank=ns.rank, targets=ns.targets) if ns.method != "full" else spec.params
        trainable = (f"trainable: {n:,} of {spec.params:,} parameters ({100 * n / spec.params:.3f} %; LoRA r={ns.rank} "
                     f"on {len(COMP.lora_targets(spec, ns.targets))} matrices, as peft counts)" if ns.method != "full"
                     else f"trainable: all {spec.params:,} parameters")
    out = {"model": spec.name, "method": ns.method, "rank": ns.rank, "targets": ns.targets, "precision": precision,
           "optimizer": ns.optimizer, "recompute": ns.recompute, "batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "trainable_params": n, "params": spec.params, "total_bytes": peak.total, "breakdown": peak.to_dict(),
           "peak_phase": peak.phase, "gpu": _fit_json(verdict)}
    if ns.method in PROMPT_METHODS:
        out.update(prompt_options(ns))
        del out["rank"], out["targets"]
    if peak.warning:
        out["warning"] = peak.warning
    if not ns.json:
        print(peak.table(title=f"{ns.method}: {peak.label}"))
        if peak.warning:
            print(f"note: {peak.warning}")
        print(trainable)
        print(verdict)
        print(verdict.explain())
    return answer_out(ns, out, here, fits=verdict.fits)


def _offload(ns) -> int:
    spec, g = model_spec(ns), gpu_of(ns)
    here, verdict = answer_offload(ns)
    rows = offload_rows(spec, g, ns.batch_size, ns.seq_len)
    frag = fitting.fragmentation_bytes(spec, precision="bf16-mixed", batch_size=ns.batch_size, seq_len=ns.seq_len)
    fits = {s: fitting.device_fit(r[0], g, largest_tensor=frag) for s, r in rows.items()}
    table = Table(["scheme", "GPU peak", "needs", "host memory", "over PCIe", "step", "fits"],
                  [[Cell(s, "strong") if s == ns.scheme else s, fmt_bytes(b.total), fmt_bytes(fits[s].needed),
                    fmt_bytes(h), fmt_bytes(m), f"{1e3 * t:,.0f} ms", Cell("yes", "good") if fits[s].fits else Cell("NO", "bad")]
                   for s, (b, h, m, t) in rows.items()],
                  caption=f"{spec.name}, {ns.batch_size} x {ns.seq_len}, bf16, on {g.name}: each offload scheme",
                  notes=[f"host link: PCIe {OFF.pcie_generation(g)}.0 x16, {OFF.host_link_GBps(g):.1f} GB/s each way "
                         f"(nominal), copies at {OFF.SAVE_ON_CPU_EFFICIENCY:.2f} of it; the step without offload at "
                         f"{100 * CK.MFU:.0f} % of the GPU's peak FLOP/s"])
    mine = rows[ns.scheme]
    out = {"model": spec.name, "scheme": ns.scheme, "batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "gpu_peak_bytes": mine[0].total, "breakdown": mine[0].to_dict(), "host_bytes": mine[1],
           "moved_bytes": mine[2], "step_seconds": mine[3], "gpu": _fit_json(verdict),
           "schemes": {s: {"gpu_peak_bytes": b.total, "host_bytes": h, "moved_bytes": m, "step_seconds": t,
                           "needed_bytes": fits[s].needed, "fits": fits[s].fits} for s, (b, h, m, t) in rows.items()}}
    if not ns.json:
        print(table)
        print()
        print(mine[0].table(title=f"{ns.scheme}: {mine[0].label}"))
        print(verdict)
        print(verdict.explain())
    return answer_out(ns, out, here, fits=verdict.fits)


def _checkpoint(ns) -> int:
    spec, g = model_spec(ns), gpu_of(ns)
    here, best = answer_checkpoint(ns)
    kw = ck_kw(ns, ns.batch_size)
    plans = list(CK.PLANS)
    if best is not None and best.plan.name not in plans:
        plans.append(best.plan.name)
    if ns.plan is not None:
        mine = CK.evaluate(spec, ns.plan, **kw)  # checks the plan
        if mine.plan.name not in plans:
            plans.append(mine.plan.name)
    results = {p: CK.evaluate(spec, p, **kw) for p in plans}
    rows = [[Cell(p, "strong") if best is not None and p == best.plan.name else p, fmt_bytes(r.peak.total),
             fmt_bytes(r.fit.needed), Cell("yes", "good") if r.fit.fits else Cell("NO", "bad"),
             f"+{100 * r.recompute_fraction:.1f} %", f"{1e3 * r.step_seconds:,.0f} ms", r.peak.phase]
            for p, r in results.items()]
    table = Table(["plan", "peak", "needs", "fits", "recompute", "step", "peak during"], rows,
                  caption=f"{spec.name}, batch {ns.batch_size} x {ns.seq_len}, {ns.precision}, on {g.name}: every plan",
                  notes=[f"recompute: extra FLOPs over the step's; step: FLOPs at {100 * CK.MFU:.0f} % of the GPU's "
                         "peak FLOP/s (offload: plus the copies)"], align="lrrcrrl")
    line = (f"least recompute that fits: {best.plan.name} ({fmt_bytes(best.peak.total)}, +"
            f"{100 * best.recompute_fraction:.1f} % FLOPs); largest batch size that fits with some plan: "
            f"{here.largest:,}" if best is not None else "no plan fits")
    out = {"model": spec.name, "batch_size": ns.batch_size, "seq_len": ns.seq_len, "precision": ns.precision,
           "gpu": g.name, "usable_bytes": g.usable_bytes, "fits": best is not None,
           "cheapest": None if best is None else {"plan": best.plan.name, "peak_bytes": best.peak.total,
                                                  "needed_bytes": best.fit.needed,
                                                  "recompute_fraction": best.recompute_fraction},
           "max_batch_size": here.largest,
           "plans": {p: {"peak_bytes": r.peak.total, "needed_bytes": r.fit.needed, "fits": r.fit.fits,
                         "recompute_fraction": r.recompute_fraction, "step_seconds": r.step_seconds,
                         "peak_phase": r.peak.phase} for p, r in results.items()}}
    if not ns.json:
        print(table)
        print()
        if ns.plan is not None:
            r = results[mine.plan.name]
            print(r.peak.table(title=f"plan {r.plan.name}: peak at {r.peak.phase}"))
            print(r.fit)
            print(r.fit.explain())
        print(line)
    return answer_out(ns, out, here, fits=best is not None)


def _context(ns) -> int:
    spec, g = model_spec(ns), gpu_of(ns)
    here, (mine, fit) = answer_context(ns)
    rows, sweep = [], {}
    for n in sorted(set(CP_SWEEP) | {ns.cp}):
        try:
            r, f = (mine, fit) if n == ns.cp else cp_rank(ns, n)
        except ValueError:  # this size does not split the heads or the sequence: left out of the sweep
            continue
        c, a = r["comm_seconds_per_layer"], r["attention_seconds_per_layer"]
        sweep[n] = {"tokens_per_rank": r["tokens_per_rank"], "peak_bytes": r["peak"], "blocks_saved_bytes": r["blocks_saved"],
                    "needed_bytes": f.needed, "fits": f.fits,
                    "sent_per_layer_bytes": sum(r["sent_per_layer"].values()),
                    "comm_seconds_per_layer": sum(c.values()),
                    "attention_seconds_per_layer": sum(a.values()), "verdict": r["verdict"]}
        s = sweep[n]
        rows.append([Cell(str(n), "strong") if n == ns.cp else str(n), f"{s['tokens_per_rank']:,}",
                     fmt_bytes(s["blocks_saved_bytes"]), fmt_bytes(s["peak_bytes"]), fmt_bytes(s["needed_bytes"]),
                     Cell("yes", "good") if s["fits"] else Cell("NO", "bad"), fmt_bytes(s["sent_per_layer_bytes"]),
                     f"{1e3 * s['comm_seconds_per_layer']:.2f} / {1e3 * s['attention_seconds_per_layer']:.2f} ms",
                     "—" if n == 1 else s["verdict"]])
    shards = "contiguous shards" if not mine["zigzag"] else "zig-zag chunks"
    table = Table(["cp", "tokens a rank", "blocks save", "peak", "needs", "fits", "sent a layer",
                   "comm / attention a layer", "communication"], rows,
                  caption=f"{spec.name}, {ns.batch_size} x {ns.seq_len:,} tokens, {ns.precision}, "
                          + (f"recompute {ns.recompute}, " if ns.recompute != "none" else "")
                          + (f"{ns.loss} loss, " if ns.loss != "whole" else "") + f"{ns.method}"
                          + (f" ({shards})" if ns.method == "ring" else "")
                          + (", FSDP2 over the CP ranks" if ns.fsdp else "") + f", on {g.name}: one rank at each CP size",
                  notes=[f"comm / attention: forward + backward (+ the recomputed forward) seconds a layer, the transfers "
                         f"on {ns.link} (alpha-beta), "
                         f"attention at 40 % of {g.name}'s peak FLOP/s; hidden: the ring's transfers run under its "
                         "attention; Ulysses' all-to-alls are exposed by construction"], align="rrrrrcrrl")
    out = {"model": spec.name, "method": ns.method, "cp": ns.cp, "zigzag": mine["zigzag"], "recompute": ns.recompute,
           "loss": ns.loss, "fsdp": ns.fsdp, "states_bytes": mine["states"], "batch_size": ns.batch_size,
           "seq_len": ns.seq_len, "precision": ns.precision, "link": ns.link, "tokens_per_rank": mine["tokens_per_rank"],
           "peak_bytes": mine["peak"], "peak_phase": mine["peak_phase"], "blocks_saved_bytes": mine["blocks_saved"],
           "in_flight_bytes": {"forward": mine["in_flight_forward"], "backward": mine["in_flight_backward"]},
           "sent_per_layer_bytes": mine["sent_per_layer"], "messages_per_layer": mine["messages_per_layer"],
           "comm_seconds_per_layer": mine["comm_seconds_per_layer"],
           "attention_seconds_per_layer": mine["attention_seconds_per_layer"],
           "exposed_seconds_per_layer": mine["exposed_seconds_per_layer"], "verdict": mine["verdict"],
           "gpu": _fit_json(dataclasses.replace(fit, max_batch_size=here.largest)),
           "sweep": {str(n): s for n, s in sweep.items()}}
    if not ns.json:
        print(table)
        print()
        print(f"cp {ns.cp}: the rank's peak {fmt_bytes(mine['peak'])} ({mine['peak_phase']}); in flight inside "
              f"attention: forward {fmt_bytes(mine['in_flight_forward'])}, backward {fmt_bytes(mine['in_flight_backward'])}")
        print(fit)
        print(fit.explain())
        print(f"largest batch size that fits at cp {ns.cp}: {here.largest:,}" + ("+" if here.capped else ""))
    return answer_out(ns, out, here, fits=fit.fits)


EP_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _experts(ns) -> int:
    """`expert_parallel.expert_parallel` at --ep and at every other EP size that divides the experts and the ranks.
    No fit verdict: the states and bytes are exact, a real model's activations depend on its kernels."""
    if ns.model not in specs.moe_preset_names():
        raise ValueError(f"--model {ns.model!r}: expert parallelism needs a mixture of experts; presets: "
                         f"{', '.join(specs.moe_preset_names())}")
    spec = specs.preset(ns.model)
    if (ns.tp, ns.pp, ns.etp) != (1, 1, 1):
        return _experts_layout(ns, spec)
    kw = dict(dp=ns.dp, batch_size=ns.batch_size, seq_len=ns.seq_len, capacity_factor=ns.capacity_factor,
              zero_stage=ns.zero, precision=ns.precision, link=ns.link)
    mine = EP.expert_parallel(spec, ep=ns.ep, **kw)
    sweep = {}
    for n in sorted(set(EP_SWEEP) | {ns.ep}):
        try:
            r = mine if n == ns.ep else EP.expert_parallel(spec, ep=n, **kw)
        except ValueError:  # does not divide the experts or the ranks
            continue
        states = {k: sum(r[c][k] for c in ("parameters", "gradients", "optimizer_states")) for k in ("dense", "experts")}
        sweep[n] = {"experts_per_rank": r["experts_per_rank"], "dense_states_bytes": states["dense"],
                    "expert_states_bytes": states["experts"], "states_bytes": r["states"],
                    "dispatch_bytes": r["dispatch_bytes"], "sent_per_layer_bytes": r["sent_per_layer"],
                    "a2a_seconds_per_layer": r["a2a_seconds_per_layer"], "grad_allreduce_bytes": r["grad_allreduce_bytes"]}
    rows = [[Cell(str(n), "strong") if n == ns.ep else str(n), f"{s['experts_per_rank']:,}", fmt_bytes(s["dense_states_bytes"]),
             fmt_bytes(s["expert_states_bytes"]), fmt_bytes(s["states_bytes"]), fmt_bytes(s["dispatch_bytes"]["received_worst"]),
             fmt_bytes(sum(s["sent_per_layer_bytes"].values())), f"{1e3 * sum(s['a2a_seconds_per_layer'].values()):.2f} ms"]
            for n, s in sweep.items()]
    routing = "dropless" if ns.capacity_factor is None else f"capacity factor {ns.capacity_factor:g}"
    table = Table(["ep", "experts a rank", "dense states", "expert states", "states", "receive buffer (worst)",
                   "all-to-all a layer", "its time"], rows,
                  caption=f"{spec.name} on {ns.dp} ranks, {ns.batch_size} x {ns.seq_len:,} tokens a rank, {routing}, "
                          f"{ns.precision} AdamW, ZeRO-{ns.zero}: one rank at each EP size",
                  notes=["expert_parallel.expert_parallel: states exact (dense over dp, experts over dp/ep under ZeRO); buffers "
                         "and all-to-all bytes (dispatch and combine, forward and backward) per MoE layer; time on "
                         f"{ns.link} (alpha-beta). A step's activations depend on the kernels: `estimate train` prices "
                         "one device's"], align="rrrrrrrr")
    out = {"model": spec.name, "ep": ns.ep, "dp": ns.dp, "edp": mine["edp"], "batch_size": ns.batch_size,
           "seq_len": ns.seq_len, "capacity_factor": ns.capacity_factor, "capacity": mine["capacity"], "zero": ns.zero,
           "precision": ns.precision, "link": ns.link, "experts_per_rank": mine["experts_per_rank"],
           "parameters_bytes": mine["parameters"], "gradients_bytes": mine["gradients"],
           "optimizer_states_bytes": mine["optimizer_states"], "states_bytes": mine["states"],
           "dispatch_rows": mine["dispatch_rows"], "dispatch_bytes": mine["dispatch_bytes"],
           "sent_per_layer_bytes": mine["sent_per_layer"], "a2a_seconds_per_layer": mine["a2a_seconds_per_layer"],
           "grad_allreduce_bytes": mine["grad_allreduce_bytes"], "sweep": {str(n): s for n, s in sweep.items()}}
    if ns.json:
        print(json.dumps(out, indent=2))
    else:
        print(table)
    return 0


def _experts_layout(ns, spec) -> int:
    """`expert_parallel.moe_layout_states`: one rank's states on every pipeline stage of tp x pp x dp devices with the
    experts folded over ep x etp (states only: the dispatch and activations under TP are not modelled)."""
    r = EP.moe_layout_states(spec, tp=ns.tp, pp=ns.pp, ep=ns.ep, etp=ns.etp, dp=ns.dp, zero_stage=ns.zero,
                              precision=ns.precision)
    rows = []
    for s in r["stages"]:
        part = {k: sum(s[c][k] for c in ("parameters", "gradients", "optimizer_states")) for k in ("dense", "experts")}
        rows.append([Cell(str(s["stage"]), "strong") if s["stage"] == r["busiest_stage"] else str(s["stage"]),
                     f"{s['layers'].start}-{s['layers'].stop - 1}", f"{s['param_counts']['dense']:,}",
                     f"{s['param_counts']['experts']:,}", fmt_bytes(part["dense"]), fmt_bytes(part["experts"]),
                     fmt_bytes(s["states"])])
    table = Table(["stage", "blocks", "dense parameters", "expert parameters", "dense states", "expert states", "states"],
                  rows, caption=f"{spec.name} on tp {ns.tp} x pp {ns.pp} x dp {ns.dp} = {r['devices']:,} GPUs, experts over "
                                f"ep {ns.ep} x etp {ns.etp} (each on edp = {r['edp']} ranks), {ns.precision} AdamW, "
                                f"ZeRO-{ns.zero}: one rank of each stage",
                  notes=["expert_parallel.moe_layout_states (Megatron-Core's parallel folding): the rank's tensors exact; states "
                         "only -- the dispatch and the activations with tensor parallelism are not modelled (without "
                         "--tp/--pp/--etp the command prices one rank's dispatch and all-to-alls)"], align="rrrrrrr")
    if ns.json:
        print(json.dumps({"model": spec.name, "tp": ns.tp, "pp": ns.pp, "ep": ns.ep, "etp": ns.etp, "dp": ns.dp,
                          "edp": r["edp"], "devices": r["devices"], "zero": ns.zero, "precision": ns.precision,
                          "states_bytes": r["states"], "busiest_stage": r["busiest_stage"],
                          "stages": [{"stage": s["stage"], "blocks": [s["layers"].start, s["layers"].stop],
                                      "param_counts": s["param_counts"], "parameters_bytes": s["parameters"],
                                      "gradients_bytes": s["gradients"], "optimizer_states_bytes": s["optimizer_states"],
                                      "states_bytes": s["states"]} for s in r["stages"]]}, indent=2))
    else:
        print(table)
    return 0



def _profile_peak(ns) -> int:
    """--activation-peak-gib in bytes."""
    gib = checks.number("--activation-peak-gib", ns.activation_peak_gib, lo=0, hi=1 << 20, what="GiB, 0 or more")
    return int(gib * 2**30)


def _serve_plan(ns, spec, g, kv_dtype=None):
    return SERVE.serving_plan(spec, gpu=g, prompt_len=ns.prompt_len, output_len=ns.output_len,
                              gpu_memory_utilization=ns.utilization, dtype=ns.dtype,
                              kv_dtype=kv_dtype or ns.kv_dtype, block_size=ns.block_size, tp=ns.tp,
                              shared_prefix_len=ns.shared_prefix, n_samples=ns.n,
                              activation_peak_bytes=_profile_peak(ns), draft_model=ns.draft_model,
                              num_speculative_tokens=ns.speculative_tokens, max_num_seqs=ns.max_num_seqs)


def _serve(ns) -> int:
    """`serving.serving_plan`: vLLM's pool and its start-up concurrency line, the requests that fit with the
    sharing asked for, the same at every KV dtype, and `serving.throughput_bounds` at that concurrency."""
    spec = specs.preset(ns.model) if ns.model else specs.from_config(ns.hf_config)
    g = specs.gpu(ns.gpu)
    plan = _serve_plan(ns, spec, g)
    seqs = max(1, min(plan.max_sequences, ns.max_num_seqs))
    tput = SERVE.throughput_bounds(spec, gpu=g, batch_size=seqs, context_len=plan.tokens_per_request,
                                   prompt_len=ns.prompt_len, dtype=ns.dtype, kv_dtype=plan.block.kv_dtype)
    budget = int(g.usable_bytes * ns.utilization)
    rows = [["the engine's share", f"{ns.utilization:g} x {fmt_bytes(g.usable_bytes)}", fmt_bytes(budget)],
            ["weights", f"{spec.params:,} parameters in {ns.dtype}" + (f", over tp {ns.tp}" if ns.tp > 1 else ""),
             fmt_bytes(plan.weights_bytes)]]
    if plan.draft_model:
        rows.append(["draft model's weights", plan.draft_model, fmt_bytes(plan.draft_weights_bytes)])
        rows.append(["verify logits (fp32)", f"{ns.max_num_seqs} sequences x {ns.speculative_tokens + 1} positions",
                     fmt_bytes(plan.verify_logits_bytes)])
    rows += [["activations (profile run)", "given" if ns.activation_peak_gib else "not known here: 0",
              fmt_bytes(_profile_peak(ns))],
             ["outside torch (CUDA context)", g.name, fmt_bytes(g.context_bytes)],  # serving_plan's non-torch memory
             [Cell("KV cache pool", "strong"), "", Cell(fmt_bytes(plan.available_kv_bytes), "strong")],
             ["a block", f"{plan.block.block_size} tokens x {spec.num_layers} layers, {plan.block.kv_dtype}"
              + (" + the draft's" if plan.draft_model else ""),
              fmt_bytes(plan.block.bytes_per_block + plan.draft_page_bytes)],
             ["blocks in the pool", "", f"{plan.num_blocks:,}"],
             ["blocks a request", f"{plan.tokens_per_request:,} tokens, {plan.last_block_waste} slots of the last empty",
              f"{plan.blocks_per_request:,}"],
             [Cell("concurrency", "strong"), "blocks in the pool / blocks a request",
              Cell(f"{plan.max_concurrency:.2f}x", "strong")],
             ["requests at once" + (" (sharing)" if ns.shared_prefix or ns.n > 1 else ""),
              "; ".join(([f"{plan.shared_prefix_blocks} prefix blocks held once"] if ns.shared_prefix else [])
                        + ([f"{ns.n} sequences a request, the prompt's full blocks shared"] if ns.n > 1 else [])),
              f"{plan.max_requests:,}"],
             ["decode bound", f"{seqs} sequences, weights + KV read a step ({g.bandwidth_GBps:.0f} GB/s)",
              f"{tput['decode_tokens_per_s']:,.0f} tokens/s"],
             ["prefill bound", f"{ns.prompt_len:,} tokens at the data sheet's peak", f"{tput['prefill_tokens_per_s']:,.0f} tokens/s"]]
    table = Table(["", "what", "bytes / count"], rows,
                  caption=f"{spec.name} served on {g.name} (vLLM's accounting: vramlab.serving.serving_plan)",
                  notes=["exact arithmetic where the engine's is (blocks, bytes a block, the pool less what is given); the "
                         "profile run's activation peak and CUDA graphs are measured by vLLM at start-up: pass "
                         "--activation-peak-gib; tokens/s are upper bounds from the data sheet"], align="llr")
    by_dtype = {}
    for kv in SERVE.KV_DTYPES:
        try:
            x = plan if kv == plan.block.kv_dtype else _serve_plan(ns, spec, g, kv)
        except ValueError:
            continue
        by_dtype[kv] = {"bytes_per_block": x.block.bytes_per_block, "num_blocks": x.num_blocks,
                        "max_concurrency": x.max_concurrency, "max_requests": x.max_requests}
    kv_table = Table(["KV dtype", "a block", "blocks", "concurrency (vLLM's line)", "requests at once"],
                     [[Cell(k, "strong") if k == plan.block.kv_dtype else k, fmt_bytes(v["bytes_per_block"]),
                       f"{v['num_blocks']:,}", f"{v['max_concurrency']:.2f}x", f"{v['max_requests']:,}"]
                      for k, v in by_dtype.items()],
                     caption="the same deployment with the KV cache in each dtype (int8 keeps an fp32 scale per token "
                             "and head; fp8 one per layer, outside the pool)", align="lrrrr")
    if ns.json:
        print(json.dumps({**plan.to_dict(), "throughput": tput, "by_kv_dtype": by_dtype}, indent=2, default=str))
    else:
        print(table)
        print(f"vLLM would log: {plan.log_line()}")
        print()
        print(kv_table)
    return 0


COMMANDS: dict[str, Callable] = {"estimate": _estimate, "plan": _plan, "lora": _lora, "offload": _offload,
                                 "checkpoint": _checkpoint, "context": _context, "experts": _experts, "serve": _serve,
                                 "explain": _explain.answer}
