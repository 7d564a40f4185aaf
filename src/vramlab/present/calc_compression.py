"""Chapter 8's calculators: quantization, PEFT (LoRA, QLoRA, prompt, prefix, P-tuning) and MoEfication
(`compression`), and every optimizer's states and training peak (`optimizers`)."""

from __future__ import annotations

from .. import compression as COMP
from .. import fitting, memory, optimizers, specs
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, GPU_CHOICES, SEQ_CHOICES, Calculator, Input, Result, both, refused
from .svg import stacked_bars

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



def _compression(*, model: str, method: str, rank: int, bits: int, targets: str, batch_size: int, seq_len: int,
                 gpu: str, recompute: str = "none", virtual_tokens: int = 20, experts: int = 32,
                 active: int = 4) -> Result:
    spec, g = specs.preset(model), specs.gpu(gpu)
    kw = dict(batch_size=batch_size, seq_len=seq_len, gpu=g)
    prompt, moe = method in _PROMPT, method == "moefication"
    pl = mo = None
    limit = spec.max_position_embeddings if spec.family != "t5" else 0
    if limit and seq_len > limit:  # as checks.positions says it, before a prompt lengthens the sequence
        return refused(f"{spec.name} reads at most {limit:,} positions; seq_len {seq_len:,} is longer", "seq_len")
    # the combinations the library cannot estimate, refused in one line that names the control
    if prompt:
        how, opts = _PROMPT[method]
        if bits not in _PROMPT_PRECISION:
            return refused(f"{_PROMPT_NAMES[how]} is estimated on a 32- or 16-bit base (peft keeps the prompt in "
                            "fp32): choose 32 or 16 bits", "bits")
        if how == "prefix" and recompute != "none":
            return refused("peft refuses prefix tuning with gradient checkpointing (its prefix is a KV cache): "
                            "set gradient checkpointing to none, or choose prompt tuning or P-tuning", "recompute")
        if how == "prefix" and spec.family == "t5" and spec.q_dim != spec.hidden_size:
            return refused(f"{spec.name}: peft's prefix tuning cannot wrap it (its attention is {spec.num_heads} x "
                            f"{spec.head_dim} = {spec.q_dim} wide, d_model {spec.hidden_size}): choose prompt tuning "
                            "or P-tuning", "method")
        # a prompt lengthens the sequence; a prefix is a cache p tokens long, so the sequence's positions
        # start at p (GPT-2 with n_positions 16, p=4 and 14 tokens: IndexError in peft 0.21)
        if limit and seq_len + virtual_tokens > limit:
            return refused(f"{spec.name} reads at most {limit:,} positions; the {virtual_tokens:,} virtual "
                            f"token{'s come' if virtual_tokens > 1 else ' comes'} "
                            f"first and make the sequence {seq_len + virtual_tokens:,}: choose fewer, or a shorter "
                            "sequence", "virtual_tokens")
        pl = COMP.prompt_learning(spec, method=how, num_virtual_tokens=virtual_tokens, **opts)
    if moe:
        i = spec.intermediate_size
        if bits not in _MOE_PRECISION:
            return refused("MoEfication trains every expert: choose 32 bits (fp32) or 16 (bf16-mixed); "
                            "8- and 4-bit bases are not modelled for it", "bits")
        if recompute != "none":
            return refused("MoEfication's estimate cuts the FFN tensors a step saves, which gradient checkpointing "
                            "does not keep: set gradient checkpointing to none", "recompute")
        if experts > i or i % experts:
            return refused(f"{spec.name}'s FFN has {i:,} neurons a layer, which do not split into {experts:,} equal "
                            f"experts: choose a divisor of {i:,}", "experts")
        if active > experts:
            return refused(f"active experts: {active:,} is more than the {experts:,} experts", "active")
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
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}, {batch_size} x {seq_len}: the peak of each method",
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



# ----------------------------------------------------------------------------- optimizers

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
    for name in optimizers.NAMES:
        lg = memory.optimizer_ledger(spec, name, precision, galore_rank=galore_rank)
        peak = memory.estimate_training(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                        optimizer=name, optimizer_in_backward=in_bwd,
                                        galore_rank=galore_rank if name == "galore-adamw" else None)
        rows.append((name, lg, peak))
        segs = [(c.replace("_", " "), getattr(peak, c) / GiB, COLORS[c]) for c in memory.CATEGORIES]
        bars.append((OPT_LABELS[name] + (" <" if name == optimizer else ""), segs))
    step = "stepped in the backward" if in_bwd else "optimizer.step() after the backward"
    svg, narrow = both(stacked_bars, bars, title=f"{spec.name}, {precision}, b={batch_size}, s={seq_len}: "
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
            Input(name="optimizer", label="optimizer", kind="choice", default="adafactor", choices=optimizers.NAMES),
            Input(name="in_backward", label="optimizer in the backward", kind="choice", default="no", choices=("no", "yes")),
            Input(name="galore_rank", label="GaLore rank", kind="choice", default=128, choices=(16, 32, 64, 128, 256, 512, 1024)),
            Input(name="batch_size", label="batch size", kind="int", default=1, min=1, max=64),
            Input(name="seq_len", label="sequence length", kind="choice", default=1024, choices=SEQ_CHOICES)))
