"""Chapter 6's calculators: offload in training (`offload`: save_on_cpu, ZeRO-Offload, FSDP2's CPU offload,
ZeRO-Infinity, the data loader) and a model bigger than the GPU streamed layer by layer (`streaming`)."""

from __future__ import annotations

import json

from .. import checkpointing as CK
from .. import fitting, memory, specs
from .. import offload as OFF
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, DECODER_PRESETS, GPU_CHOICES, SEQ_CHOICES, Calculator, Input, Result, both
from .svg import stacked_bars, streams

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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len}, bf16: the GPU's peak with each offload",
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
        svg, narrow = both(streams, f.events, makespan=f.seconds,
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
