"""ipywidgets calculators, one per chapter, built on the pure-Python estimators.
ipywidgets and matplotlib are imported when a widget is made, never at `import vramlab`."""

from __future__ import annotations

from . import memory, plots, specs
from .units import fmt_bytes


def training_calculator(*, model: str = "gpt2", batch_size: int = 8, seq_len: int = 1024,
                        precision: str = "bf16-mixed", optimizer: str = "adamw", gpu: str = "t4"):
    """Chapter 1: model, batch, sequence, precision, optimizer, GPU -> stacked breakdown of training
    and inference, the fit verdict and the largest batch that fits."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    style = {"description_width": "110px"}
    w_model = W.Dropdown(options=specs.preset_names(), value=model, description="model", style=style)
    w_batch = W.IntSlider(value=batch_size, min=1, max=128, description="batch size", style=style)
    w_seq = W.Dropdown(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=seq_len, description="seq length",
                       style=style)
    w_prec = W.Dropdown(options=memory.PRECISIONS, value=precision, description="precision", style=style)
    w_opt = W.Dropdown(options=memory.OPTIMIZERS, value=optimizer, description="optimizer", style=style)
    w_attn = W.Dropdown(options=memory.ATTENTIONS, value="sdpa", description="attention", style=style)
    w_rec = W.Dropdown(options=memory.RECOMPUTES, value="none", description="recompute", style=style)
    w_gpu = W.Dropdown(options=list(specs.GPUS), value=gpu, description="GPU", style=style)
    out = W.Output()

    def update(*_):
        spec = specs.preset(w_model.value)
        g = specs.gpu(w_gpu.value)
        opts = dict(seq_len=w_seq.value, precision=w_prec.value, optimizer=w_opt.value, attention=w_attn.value,
                    recompute=w_rec.value)
        train = memory.estimate_training(spec, batch_size=w_batch.value, gpu=g, **opts)
        infer_dtype = "fp32" if w_prec.value == "fp32" else "bf16"
        infer = memory.estimate_inference(spec, batch_size=w_batch.value, seq_len=w_seq.value, dtype=infer_dtype, gpu=g)
        verdict = memory.fit(spec, g, batch_size=w_batch.value, **opts)
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.6))
            plots.stacked([train, infer], ["training step", f"inference prefill ({infer_dtype})"], ax=ax,
                          capacity=g.usable_bytes, capacity_label=f"{g.name} (usable)",
                          title=f"{spec.name}: {spec.params / 1e6:,.0f} M params, b={w_batch.value}, s={w_seq.value}")
            plt.show()
            print(train.table(title="training step"))
            print(f"\n{verdict}")
            print(f"inference prefill: {fmt_bytes(infer.total)} (KV cache {fmt_bytes(infer.kv_cache)})")

    controls = [w_model, w_batch, w_seq, w_prec, w_opt, w_attn, w_rec, w_gpu]
    for w in controls:
        w.observe(update, names="value")
    update()
    return W.VBox([W.HBox([W.VBox(controls[:4]), W.VBox(controls[4:])]), out])


def collectives_calculator(*, op: str = "all_reduce", ranks: int = 8, size_mib: float = 256.0, link: str = "nvlink4"):
    """Chapter 2: op, ranks, message size, link -> alpha-beta time, algbw, busbw, and time vs size."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from . import collectives as C

    style = {"description_width": "110px"}
    w_op = W.Dropdown(options=C.OPS, value=op, description="collective", style=style)
    w_n = W.IntSlider(value=ranks, min=2, max=256, description="ranks", style=style)
    w_size = W.FloatLogSlider(value=size_mib, base=2, min=-10, max=14, description="size (MiB)", style=style)
    w_link = W.Dropdown(options=list(C.LINKS), value=link, description="link", style=style)
    out = W.Output()

    def update(*_):
        S = int(w_size.value * 2**20)
        t = C.collective_time(w_op.value, w_n.value, S, w_link.value)
        with out:
            out.clear_output(wait=True)
            print(f"{w_op.value} of {fmt_bytes(S)} on {w_n.value} ranks over {w_link.value}: {t * 1e3:.3f} ms, "
                  f"algbw {C.algbw(S, t) / 1e9:.1f} GB/s, busbw {C.busbw(w_op.value, w_n.value, S, t) / 1e9:.1f} GB/s "
                  f"(factor {C.busbw_factor(w_op.value, w_n.value)})")
            sizes = [2**k for k in range(10, 35)]
            fig, ax = plt.subplots(figsize=(6.5, 3))
            for name in C.LINKS:
                ax.loglog(sizes, [C.collective_time(w_op.value, w_n.value, s, name) for s in sizes], label=name,
                          lw=2.5 if name == w_link.value else 1)
            ax.axvline(S, color="black", ls=":", lw=1)
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel("seconds")
            ax.legend(fontsize=6, frameon=False)
            ax.grid(alpha=0.3)
            plt.show()

    for w in (w_op, w_n, w_size, w_link):
        w.observe(update, names="value")
    update()
    return W.VBox([W.HBox([W.VBox([w_op, w_n]), W.VBox([w_size, w_link])]), out])


def precision_calculator(*, model: str = "gpt2", value: float = 1e-4):
    """Chapter 5: a format explorer (a value rounded in every format) and the training peak of
    `model` under each precision recipe."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from . import precision as P

    style = {"description_width": "110px"}
    w_val = W.FloatLogSlider(value=value, base=10, min=-10, max=5, step=0.01, description="value", style=style)
    w_model = W.Dropdown(options=specs.preset_names(), value=model, description="model", style=style)
    w_batch = W.IntSlider(value=8, min=1, max=64, description="batch size", style=style)
    out = W.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            x = w_val.value
            print(f"{'format':10s}{'rounded':>14}{'rel. error':>12}")
            for f in P.FORMATS.values():
                if f.is_float:
                    r = P.round_to(x, f)
                    print(f"{f.name:10s}{r:>14.6g}{abs(r - x) / x:>12.2e}")
            ests = [memory.estimate_training(w_model.value, batch_size=w_batch.value, seq_len=1024, precision=p)
                    for p in memory.PRECISIONS]
            fig, ax = plt.subplots(figsize=(6.5, 3))
            plots.stacked(ests, list(memory.PRECISIONS), ax=ax, title=f"{w_model.value}, b={w_batch.value}, s=1024")
            plt.show()

    for w in (w_val, w_model, w_batch):
        w.observe(update, names="value")
    update()
    return W.VBox([W.HBox([w_val, w_model, w_batch]), out])
