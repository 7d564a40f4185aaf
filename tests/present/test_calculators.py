"""The calculators' one declaration and its two front ends (the book's HTML, ipywidgets): both show
what vramlab computes for the same inputs, bad input gives one line (never a traceback), and the
module stays pure Python (it must run in the browser, under Pyodide)."""

import json
import re

import pytest

from vramlab.present import calculators as C
from vramlab import collectives, estimate_inference, estimate_training, fit, precision

ALL = list(C.CALCULATORS)


def test_calculators_are_pure_python(assert_pure_python):
    assert_pure_python("import vramlab.present.calculators as c; c.get('training').run()")


@pytest.mark.parametrize("name", ALL)
def test_defaults_compute(name):
    r = C.get(name).run()
    assert not r.error and r.numbers and r.svg.startswith("<svg") and r.svg.endswith("</svg>") and r.text


def test_training_numbers_are_the_librarys():
    r = C.get("training").run(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16-mixed", gpu="h100-80gb")
    kw = dict(seq_len=2048, precision="bf16-mixed")
    assert r.numbers["train_total"][0] == estimate_training("llama-3.2-1b", batch_size=4, gpu="h100", **kw).total
    assert r.numbers["infer_total"][0] == estimate_inference("llama-3.2-1b", batch_size=4, seq_len=2048, gpu="h100").total
    assert r.numbers["max_batch"][0] == fit("llama-3.2-1b", "h100", batch_size=4, **kw).max_batch_size


def test_collectives_and_precision_numbers_are_the_librarys():
    r = C.get("collectives").run(op="reduce_scatter", ranks=16, size_mib=64, link="ib-ndr")
    assert r.numbers["time_ms"][0] == pytest.approx(1e3 * float(collectives.collective_time("reduce_scatter", 16, 64 << 20, "ib-ndr")))
    p = C.get("precision").run(value=3e-8)
    assert p.numbers["fp16"][0] == precision.round_to(3e-8, precision.FORMATS["fp16"])


def test_zero_numbers_are_the_librarys():
    from vramlab import zero

    r = C.get("zero").run(model="llama-3.1-8b", setup="2", ranks=16, recipe="mixed-adam", micro_batch_size=2,
                          seq_len=4096, gpu="h100-80gb", link="ib-ndr")
    est = zero.estimate_rank("llama-3.1-8b", 16, 2, micro_batch_size=2, seq_len=4096)
    assert r.numbers["per_rank"][0] == est.total
    assert r.numbers["comm_ms"][0] == pytest.approx(1e3 * zero.communication(est_params := 8_030_261_248, 16, 2,
                                                                                 link="ib-ndr", implementation="deepspeed")["seconds"])
    assert vramlab_preset_params("llama-3.1-8b") == est_params  # the preset's own count, as published


def test_checkpointing_numbers_are_the_librarys():
    from vramlab import checkpointing as CK

    r = C.get("checkpointing").run(model="llama-3.2-1b", plan="sqrt", batch_size=4, seq_len=2048,
                                   precision="bf16-mixed", gpu="h100-80gb")
    mine = CK.evaluate("llama-3.2-1b", "sqrt", batch_size=4, seq_len=2048, precision="bf16-mixed", gpu="h100-80gb")
    assert r.numbers["peak"][0] == mine.peak.total and r.numbers["recompute"][0] == mine.recompute_fraction
    assert r.numbers["cheapest"][1] == "none (recompute nothing)"  # the plan none: 44 GiB without recompute fits in an H100's 79 GiB
    t4 = C.get("checkpointing").run(model="llama-3.2-1b", plan="none", batch_size=4, seq_len=2048,
                                    precision="bf16-mixed", gpu="t4")
    assert t4.numbers["cheapest"][1] == C.NO_PLAN_FITS and "no plan fits" in t4.text  # the model states alone exceed 15 GiB


def test_offload_numbers_are_the_librarys():
    from vramlab import checkpointing as CK
    from vramlab import offload as OFF

    r = C.get("offload").run(model="llama-3.2-1b", scheme="fsdp2-cpu", batch_size=4, seq_len=2048, gpu="h100-80gb")
    gpu_s = CK.evaluate("llama-3.2-1b", "none", batch_size=4, seq_len=2048, precision="bf16-mixed", gpu="h100").step_seconds
    fs = OFF.model_offload("llama-3.2-1b", scheme="fsdp2-cpu", batch_size=4, seq_len=2048, gpu="h100", gpu_seconds=gpu_s)
    assert r.numbers["gpu_peak"][0] == fs.gpu_peak.total and r.numbers["host"][0] == fs.host_bytes
    assert r.numbers["step_ms"][0] == pytest.approx(1e3 * fs.step_seconds)
    t4 = C.get("offload").run(model="llama-3.2-1b", scheme="none", batch_size=4, seq_len=2048, gpu="t4")
    assert t4.numbers["fits"][1] == "no" and "NO" in t4.text


def test_streaming_the_10b_model_on_a_gtx_1060():
    """The chapter's worked example, against independent arithmetic: GPT-2's layout counted by hand,
    PCIe 3.0 x16 at 80 %, and for equal layers with prefetch the copies hide exactly when the streamed
    layers' copies fit in a pass of compute: s x copy <= n x compute."""
    import math

    from vramlab import offload as OFF

    h, L, V, P = 4096, 48, 50257, 2048
    spec = OFF.ten_b_model()
    assert spec.params == V * h + P * h + L * (12 * h * h + 13 * h) + 2 * h
    r = C.get("streaming").run(tokens=1, weights="int8", buffers=2)
    m = OFF.stream_model(spec, "gtx-1060", tokens=1, weight_bytes=1)
    copy = (12 * h * h + 13 * h) / (8e9 * 16 * 128 / 130 / 8 * 0.8)  # PCIe 3.0 x16 at 80 %
    assert m.layer_bytes == 12 * h * h + 13 * h and m.layer_bytes / (m.link_GBps * 1e9) == pytest.approx(copy, rel=3e-3)
    assert m.layer_seconds == pytest.approx(m.layer_bytes / 192e9)  # one token: reading the weights
    assert r.numbers["hide"][0] == L - math.floor(L * m.layer_seconds / copy)
    assert r.numbers["resident"][0] == m.most_resident and m.fitted.gpu_bytes + m.other_bytes <= m.usable_bytes
    more = m.other_bytes + (m.most_resident + 1 + min(2, L - m.most_resident - 1)) * m.layer_bytes
    assert more > m.usable_bytes  # one more resident block would not fit
    assert not m.fitted.hidden and OFF.stream_model(spec, "gtx-1060", tokens=512, weight_bytes=1).fitted.hidden
    big = C.get("streaming").run(model="llama-3.1-70b", weights="fp32")
    assert big.numbers["resident"][1] == "does not fit" and "does NOT fit" in big.text and not big.error


def vramlab_preset_params(name):
    from vramlab import preset

    return preset(name).params


@pytest.mark.parametrize("name, values, needle", [
    ("zero", {"setup": "4"}, "'4' is not one of"),
    ("checkpointing", {"plan": "most"}, "'most' is not one of"),
    ("offload", {"scheme": "nvme"}, "'nvme' is not one of"),
    ("streaming", {"tokens": 3}, "tokens per pass: 3 is not one of"),
    ("compression", {"rank": 3}, "LoRA rank: 3 is not one of"),
    ("compression", {"recompute": "most"}, "'most' is not one of"),
    ("compression", {"method": "full", "bits": 4}, "full fine-tuning cannot train 4-bit weights"),
    ("compression", {"model": "gpt2", "seq_len": 4096}, "gpt2 reads at most 1,024 positions"),
    ("offload", {"batch_size": 0}, "batch size: 0 is out of range"),
    ("checkpointing", {"model": "gpt2", "seq_len": 2048}, "gpt2 reads at most 1,024 positions"),
    ("zero", {"model": "gpt2", "seq_len": 4096}, "gpt2 reads at most 1,024 positions"),
    ("training", {"batch_size": 0}, "batch size: 0 is out of range: it must be between 1 and 128"),
    ("training", {"batch_size": 2.5}, "whole number"),
    ("training", {"model": "gpt5"}, "'gpt5' is not one of"),
    ("training", {"seq_len": 8192}, "gpt2 reads at most 1,024 positions"),
    ("collectives", {"size_mib": "lots"}, "expected a number"),
    ("collectives", {"ranks": 1}, "out of range: it must be between 2 and 256"),
    ("precision", {"value": float("nan")}, "expected a number, got nan"),
    ("training", {"colour": "red"}, "unknown input colour"),
])
def test_bad_input_is_one_line_not_a_traceback(name, values, needle):
    r = C.get(name).run(**values)
    assert needle in r.error and "\n" not in r.error and not r.numbers
    out = json.loads(C.run_json(name, json.dumps(values)))
    assert needle in out["error"]
    assert "unknown calculator" in json.loads(C.run_json("nope", "{}"))["error"]
    assert "Expecting" in json.loads(C.run_json("training", "{oops"))["error"]


def test_browser_strings_are_accepted():
    """The page sends every value as a string: '16' and '2048' mean the numbers."""
    a = C.get("training").run(batch_size="16", seq_len="1024", model="gpt2")
    b = C.get("training").run(batch_size=16, seq_len=1024, model="gpt2")
    assert a.to_dict() == b.to_dict()


@pytest.mark.parametrize("name", ALL)
def test_page_html_is_a_disabled_snapshot_with_the_numbers(name):
    html = C.page_html(name)
    assert 'data-state="snapshot"' in html and "snapshot" in html
    controls = re.findall(r"<(select|input)\b[^>]*>", html)
    tags = re.findall(r"<(?:select|input)\b[^>]*>", html)
    assert controls and all(" disabled" in t for t in tags)  # no control can disagree with the numbers
    for key, (value, shown) in C.get(name).run().numbers.items():
        assert f'data-key="{key}" data-value="{value!r}"' in html and shown in html
    assert "<script" not in html


def test_compression_calculator_is_the_library():
    """The page's numbers are vramlab.compression's; LoRA's trainable count is peft's (884,736 for
    the seeds' mT5-base r=8 on q and v, peft's defaults for T5)."""
    from vramlab import compression as COMP

    r = C.get("compression").run(model="mt5-base", method="lora", rank=8, bits=32, batch_size=32, seq_len=128)
    assert r.error == "" and r.numbers["trainable"][0] == 884_736
    est = COMP.peft_training("mt5-base", rank=8, targets="default", batch_size=32, seq_len=128, gpu="h100-80gb")
    assert r.numbers["peak"][0] == est.total
    q = C.get("compression").run(model="llama-3.1-8b", method="lora", rank=16, bits=4, seq_len=2048)
    assert q.numbers["peak"][0] == COMP.peft_training("llama-3.1-8b", method="qlora", rank=16, batch_size=1, seq_len=2048,
                                                      precision="bf16", gpu="h100-80gb").total
    # QLoRA with every block checkpointed (as QLoRA trained): peft_training(recompute="full")
    qr = C.get("compression").run(model="llama-3.1-8b", method="lora", rank=64, bits=4, targets="all-linear",
                                  batch_size=4, seq_len=4096, recompute="full")
    assert qr.numbers["peak"][0] == COMP.peft_training("llama-3.1-8b", method="qlora", rank=64, targets="all-linear",
                                                       batch_size=4, seq_len=4096, precision="bf16", gpu="h100-80gb",
                                                       recompute="full").total
    assert qr.numbers["peak"][0] < 0.5 * C.get("compression").run(model="llama-3.1-8b", method="lora", rank=64, bits=4,
                                                                 targets="all-linear", batch_size=4,
                                                                 seq_len=4096).numbers["peak"][0]
    inf = C.get("compression").run(model="llama-3.1-8b", method="inference", bits=8, seq_len=512)
    assert inf.numbers["peak"][0] == COMP.quantized_inference("llama-3.1-8b", fmt="int8", seq_len=512).total


# every calculator answers an infinite, huge or boolean input with one line naming it
_NUMBERS = [(c.name, i) for c in C.CALCULATORS.values() for i in c.inputs if i.kind in ("int", "float")]
_CHOICES = [(c.name, i) for c in C.CALCULATORS.values() for i in c.inputs if i.kind == "choice"]


@pytest.mark.parametrize("name, inp", _NUMBERS, ids=[f"{n}-{i.name}" for n, i in _NUMBERS])
@pytest.mark.parametrize("bad", [float("inf"), "inf", "-inf", "1e400", float("nan"), "nan", True, None, [1]])
def test_number_inputs_refuse_infinities_and_booleans_in_one_line(name, inp, bad):
    calc = C.get(name)
    r = calc.run(**{inp.name: bad})
    assert r.error.startswith(inp.label + ":") and "\n" not in r.error and not r.text, (bad, r.error)
    out = json.loads(C.run_json(name, json.dumps({inp.name: bad})))  # Python's json writes Infinity and NaN
    assert out["error"].startswith(inp.label + ":"), out
    assert json.loads(C.run_html(name, json.dumps({inp.name: bad})))["error"].startswith(inp.label + ":")
    with pytest.raises(ValueError, match=f"^calculator {name}: "):
        C.page_html(name, **{inp.name: bad})


@pytest.mark.parametrize("name, inp", _CHOICES, ids=[f"{n}-{i.name}" for n, i in _CHOICES])
def test_choice_inputs_refuse_booleans(name, inp):
    r = C.get(name).run(**{inp.name: True})
    assert r.error.startswith(inp.label + ":") and "is not one of" in r.error, r.error


def test_number_inputs_take_numpy_scalars():
    np = pytest.importorskip("numpy")
    for name, inp in _NUMBERS:
        value = np.int64(inp.default) if inp.kind == "int" else np.float64(inp.default)
        assert not C.get(name).run(**{inp.name: value}).error, (name, inp.name)


# what a reader types and what a phone shows
@pytest.mark.parametrize("name, values, needle, invalid", [
    ("training", {"batch_size": "1e9"}, "batch size: 1e+09 is out of range: it must be between 1 and 128", "batch_size"),
    ("training", {"batch_size": 1e9}, "batch size: 1e+09 is out of range: it must be between 1 and 128", "batch_size"),
    ("training", {"batch_size": "1e1"}, "", ""),  # 10, written as a float: a whole number in range
    ("training", {"batch_size": " 16 "}, "", ""),
    ("training", {"batch_size": "-3"}, "batch size: -3 is out of range", "batch_size"),
    ("collectives", {"size_mib": "1e9"}, "size: 1e+09 MiB is out of range: it must be between 0.0009766 and 1.638e+04 MiB",
     "size_mib"),
    ("precision", {"value": "1e-20"}, "value: 1e-20 is out of range", "value"),
    ("checkpointing", {"batch_size": "1e3"}, "batch size: 1000 is out of range: it must be between 1 and 128", "batch_size"),
])
def test_a_number_out_of_range_says_so_with_the_range(name, values, needle, invalid):
    r = C.get(name).run(**values)
    assert needle in r.error and "expected a number" not in r.error and "\n" not in r.error
    assert r.invalid == ((invalid,) if invalid else ())
    out = json.loads(C.run_html(name, json.dumps(values)))
    assert out["error"] == r.error and out["invalid"] == list(r.invalid)
    if r.error:
        assert 'class="vl-error" role="alert"' in out["html"] and not out["numbers"]


def test_no_plan_fits_is_not_the_plan_called_none():
    """'none' is a plan (recompute nothing); when nothing fits the page says 'no plan fits', never 'none'."""
    no = C.get("checkpointing").run(model="llama-3.1-70b", batch_size=4, seq_len=1024, gpu="t4")
    fits_without = C.get("checkpointing").run(model="gpt2", batch_size=1, seq_len=128)
    assert no.numbers["cheapest"] == (0, C.NO_PLAN_FITS) and "no plan fits" in no.text and "none" not in no.numbers["cheapest"][1]
    assert fits_without.numbers["cheapest"][1] == "none (recompute nothing)"
    assert "the plan with the least recompute that fits: none (recompute nothing)" in fits_without.text
    label = C.get("checkpointing").number_labels["cheapest"]
    assert "plan" in label and label in C.page_html("checkpointing")


@pytest.mark.parametrize("name", ALL)
def test_every_chart_comes_wide_and_for_a_phone(name):
    """The page carries both layouts of each chart (book.css shows the one that fits its box); the
    phone's is drawn at svg.PHONE wide, and its text is never under svg.MIN_FONT, so at a 390 px
    phone's column (about 1:1) it is legible; ipywidgets show the wide one only."""
    from vramlab.present import svg

    r = C.get(name).run(**({"schedule": "interleaved"} if name == "parallel" else {}))
    assert r.svg_narrow.startswith("<svg") and r.svg_narrow != r.svg
    assert all(f'viewBox="0 0 {svg.PHONE} ' in part for part in r.svg_narrow.split("</svg>")[:-1])
    sizes = [float(x) for x in re.findall(r'font-size="([\d.]+)"', r.svg + r.svg_narrow)]
    assert sizes and min(sizes) >= svg.MIN_FONT
    page = C.page_html(name)
    assert '<div class="vl-wide"><svg' in page and '<div class="vl-narrow"><svg' in page
    assert "vl-narrow" not in C.result_html(C.get(name), r, narrow=False)


def test_offload_nvme_tier_and_host_memory_are_the_librarys():
    from vramlab import offload as OFF

    kw = dict(model="llama-3.1-70b", batch_size=1, seq_len=2048, gpu="h100-80gb")
    r = C.get("offload").run(scheme="infinity-nvme", host_ram=64, **kw)
    inf = OFF.infinity("llama-3.1-70b", params="nvme", optimizer="nvme", batch_size=1, seq_len=2048, gpu="h100")
    assert r.numbers["gpu_peak"][0] == inf.gpu_bytes and r.numbers["host"][0] == inf.host_bytes
    assert r.numbers["fits"][1] == "yes" and '"device": "nvme"' in r.text
    need = OFF.needed_placement("llama-3.1-70b", host_ram_bytes=512 * 2**30, batch_size=1, seq_len=2048, gpu="h100")
    auto = C.get("offload").run(scheme="smallest that fits", host_ram=512, **kw)
    assert auto.numbers["host"][0] == need.host_bytes and f"parameters on {need.params}" in auto.text
    # host memory decides: ZeRO-Offload's 16 bytes a parameter of Llama-3.1-8B do not fit in 64 GiB
    small = C.get("offload").run(model="llama-3.1-8b", scheme="zero-offload", batch_size=1, seq_len=2048, gpu="h100-80gb",
                                 host_ram=64)
    assert small.numbers["fits"][1] == "no" and "does NOT fit" in small.text


# chapter 8's calculator offers prompt, prefix and P-tuning, and MoEfication
def _chart_words(svg: str) -> str:
    """The chart's text without spaces: its labels wrap (at spaces and hyphens) into several lines."""
    return "".join(re.sub(r"<[^>]+>", " ", svg).split())


def test_compression_calculator_prompt_learning_is_the_library_and_peft():
    """Trainable counts are peft's (hand-derived from its modules: T5's prompt embedding has T=2
    stacks' rows, prefix tuning p keys and values of d in each layer, P-tuning's MLP encoder
    d->H->H->d with biases); peaks are peft_training's with the calculator's mapping of bits."""
    from vramlab import compression as COMP

    calc = C.get("compression")
    d, L, p = 768, 12, 20
    prompt = calc.run(model="mt5-base", method="prompt", bits=32, batch_size=8, seq_len=128, virtual_tokens=p)
    assert prompt.numbers["trainable"][0] == 2 * p * d  # 30,720: PromptEmbedding(2p, d)
    prefix = calc.run(model="gpt2", method="prefix", bits=16, batch_size=4, seq_len=512, virtual_tokens=p)
    assert prefix.numbers["trainable"][0] == p * L * 2 * d  # 368,640: PrefixEncoder's Embedding(p, 2Ld)
    mlp = calc.run(model="gpt2", method="p-tuning", bits=16, batch_size=4, seq_len=512, virtual_tokens=p)
    assert mlp.numbers["trainable"][0] == p * d + 3 * (d * d + d)  # PromptEncoder, MLP with H = d (peft's default)
    proj = calc.run(model="gpt2", method="prefix (MLP)", bits=32, batch_size=4, seq_len=512, virtual_tokens=p)
    assert proj.numbers["trainable"][0] == p * d + d * d + d + d * L * 2 * d + L * 2 * d
    lstm = calc.run(model="gpt2", method="p-tuning (LSTM)", bits=32, batch_size=4, seq_len=512, virtual_tokens=p)
    assert lstm.numbers["trainable"][0] == COMP.prompt_params("gpt2", method="p-tuning", num_virtual_tokens=p,
                                                             encoder_type="LSTM")
    for r, kw in ((prompt, dict(model="mt5-base", method="prompt", precision="fp32", batch_size=8, seq_len=128)),
                  (prefix, dict(model="gpt2", method="prefix", precision="bf16", batch_size=4, seq_len=512)),
                  (mlp, dict(model="gpt2", method="p-tuning", precision="bf16", batch_size=4, seq_len=512)),
                  (proj, dict(model="gpt2", method="prefix", precision="fp32", batch_size=4, seq_len=512,
                              prefix_projection=True))):
        assert not r.error and r.numbers["peak"][0] == COMP.peft_training(num_virtual_tokens=p, gpu="h100-80gb", **kw).total
        assert "active" not in r.numbers and "flops" not in r.numbers
    # a longer prompt lengthens every block's sequence: the peak grows with p, the count with it
    longer = calc.run(model="mt5-base", method="prompt", bits=32, batch_size=8, seq_len=128, virtual_tokens=100)
    assert longer.numbers["peak"][0] > prompt.numbers["peak"][0] and longer.numbers["trainable"][0] == 2 * 100 * d
    # the chart shows the chosen method beside full, LoRA and inference
    assert "promptp=20" in _chart_words(prompt.svg) and "full32-bit" in _chart_words(prompt.svg)


def test_compression_calculator_moefication_is_the_library():
    """Active parameters and FLOPs a token are moefication()'s, checked here against the paper's
    definition written out for OPT-1.3B (ReLU FFN with biases, h=2048, i=8192, 24 layers, a linear
    router h x E each); the peak is moefied_training's."""
    from vramlab import compression as COMP, preset

    r = C.get("compression").run(model="opt-1.3b", method="moefication", bits=16, experts=32, active=4, batch_size=8,
                                 seq_len=2048)
    assert not r.error
    h, i, L, E, k = 2048, 8192, 24, 32, 4
    m = i // E
    dense = preset("opt-1.3b").params
    ffn = L * (h * i + i + i * h + h)
    active_ffn = L * (k * m * (h + 1 + h) + h)
    routers = L * h * E
    assert r.numbers["trainable"][0] == dense + routers  # every expert resident and trained, plus the routers
    assert r.numbers["active"][0] == dense + routers - ffn + active_ffn
    mo = COMP.moefication("opt-1.3b", experts=E, active=k, seq_len=2048, precision="bf16-mixed")
    assert mo.ffn_flops_dense - mo.ffn_flops == L * (2 * i * h * 2 - (2 * k * m * h * 2 + 2 * h * E))
    assert r.numbers["flops"][0] == mo.flops and r.numbers["flops"][1].endswith("% of dense)")
    est = COMP.moefied_training("opt-1.3b", experts=E, active=k, batch_size=8, seq_len=2048, precision="bf16-mixed",
                                gpu="h100-80gb")
    assert r.numbers["peak"][0] == est.total
    full = C.get("compression").run(model="opt-1.3b", method="full", bits=16, batch_size=8, seq_len=2048)
    assert r.numbers["peak"][0] < full.numbers["peak"][0]  # the FFN activations shrink ...
    assert est.parameters > COMP.peft_training("opt-1.3b", method="full", batch_size=8, seq_len=2048,
                                                precision="bf16-mixed").parameters  # ... the weights do not
    assert "MoE4/32" in _chart_words(r.svg) and "active parameters a token" in C.page_html(
        "compression", model="opt-1.3b", method="moefication", bits=16)


@pytest.mark.parametrize("method, ignored, changed", [
    ("prompt", ("LoRA rank", "LoRA targets", "experts", "active experts"), dict(rank=64, experts=8, active=8)),
    ("prefix", ("LoRA rank", "LoRA targets", "experts"), dict(rank=64, targets="all-linear", experts=7)),
    ("moefication", ("LoRA rank", "virtual tokens"), dict(rank=2, virtual_tokens=500)),
    ("lora", ("virtual tokens", "experts", "active experts"), dict(virtual_tokens=7, experts=5, active=64)),
    ("inference", ("LoRA rank", "virtual tokens", "experts", "gradient checkpointing"), dict(virtual_tokens=3, rank=1)),
])
def test_compression_inputs_a_method_does_not_read_are_ignored_and_named(method, ignored, changed):
    base = dict(model="llama-3.2-1b", method=method, bits=16, seq_len=1024)
    r, again = C.get("compression").run(**base), C.get("compression").run(**base, **changed)
    # the method's numbers and text do not move (the chart's LoRA bars, beside it, read the LoRA inputs)
    assert not r.error and (r.numbers, r.text) == (again.numbers, again.text)
    line = next(x for x in r.text.splitlines() if x.startswith("ignored for this method: "))
    assert all(word in line for word in ignored)
    assert "sequence length" not in line and "bits" not in line


@pytest.mark.parametrize("values, needle, invalid", [
    (dict(model="mt5-small", method="prefix", bits=32), "mt5-small: peft's prefix tuning cannot wrap it", "method"),
    (dict(method="prefix", bits=16, recompute="full"), "peft refuses prefix tuning with gradient checkpointing",
     "recompute"),
    (dict(method="prompt", bits=4), "prompt tuning is estimated on a 32- or 16-bit base", "bits"),
    (dict(method="p-tuning (LSTM)", bits=8), "P-tuning is estimated on a 32- or 16-bit base", "bits"),
    (dict(model="gpt2", method="prompt", bits=16, seq_len=1024, virtual_tokens=20),
     "the 20 virtual tokens come first and make the sequence 1,044", "virtual_tokens"),
    (dict(model="gpt2", method="prefix", bits=16, seq_len=1024, virtual_tokens=1),  # positions start after the prefix
     "gpt2 reads at most 1,024 positions; the 1 virtual token comes first and make the sequence 1,025", "virtual_tokens"),
    (dict(model="gpt2", method="p-tuning", bits=16, seq_len=2048), "gpt2 reads at most 1,024 positions; seq_len 2,048 is longer",
     "seq_len"),
    (dict(model="mt5-base", method="moefication", bits=16, experts=7), "2,048 neurons a layer, which do not split into 7",
     "experts"),
    (dict(model="gpt2", method="moefication", bits=16, experts=4096, seq_len=512), "do not split into 4,096", "experts"),
    (dict(method="moefication", bits=16, experts=8, active=9), "active experts: 9 is more than the 8 experts", "active"),
    (dict(method="moefication", bits=4), "MoEfication trains every expert: choose 32 bits", "bits"),
    (dict(method="moefication", bits=16, recompute="full"), "set gradient checkpointing to none", "recompute"),
    (dict(virtual_tokens=0), "virtual tokens (prompt, prefix, P-tuning): 0 is out of range", "virtual_tokens"),
    (dict(method="adapters"), "'adapters' is not one of", "method"),
])
def test_compression_bad_combinations_are_one_line_naming_the_control(values, needle, invalid):
    r = C.get("compression").run(**values)
    assert needle in r.error and "\n" not in r.error and not r.numbers and not r.text, r.error
    assert r.invalid == ((invalid,) if invalid else ())
    out = json.loads(C.run_html("compression", json.dumps(values)))
    assert out["error"] == r.error and out["invalid"] == list(r.invalid)


@pytest.mark.slow
def test_compression_new_methods_answer_every_model_without_a_traceback():
    """Every preset with every method at 16 bits: a result or one line, never an exception."""
    from vramlab import specs

    for model in specs.preset_names():
        for method in C.COMPRESSION_METHODS:
            r = C.get("compression").run(model=model, method=method, bits=16, seq_len=512)
            assert (r.error and "\n" not in r.error) or (r.numbers and r.svg), (model, method)


def test_training_in_place_adds_what_the_library_prices_where_every_block_is_saved():
    from vramlab import memory
    from vramlab.inplace import inplace_step

    kw = dict(model="gpt2", batch_size=4, seq_len=512, precision="bf16-mixed", gpu="h100-80gb")
    plain = C.get("training").run(**kw)
    freeing = C.get("training").run(**kw, inplace="where it frees memory")
    every = C.get("training").run(**kw, inplace="every allowed site")
    assert not (plain.error or freeing.error or every.error)
    # ReLU / the residual add into the branch free only forward transients: the step's peak does not move
    assert freeing.numbers["train_total"][0] == plain.numbers["train_total"][0]
    assert freeing.numbers["inplace_saved"][0] == 0 and freeing.numbers["inplace_transient"][0] > 0
    # CUDA's in-place dropout saves a bf16 noise for a 1-byte mask: every block's share, at the backward's start
    ip = inplace_step("gpt2", batch_size=4, seq_len=512, precision="bf16-mixed")
    phases = memory.training_phases("gpt2", batch_size=4, seq_len=512, precision="bf16-mixed", gpu="h100")
    start = next(m for m in phases if m.phase.startswith("backward start"))
    assert max(m.total for m in phases) == start.total == plain.numbers["train_total"][0]
    assert every.numbers["train_total"][0] == start.total + ip["saved"] > plain.numbers["train_total"][0]
    assert "+" in every.text and "noise tensor" in every.text


def test_training_in_place_with_recompute_is_refused_in_one_line():
    r = C.get("training").run(model="gpt2", inplace="every allowed site", recompute="full")
    assert r.error.startswith("in-place ops are priced for a step without recompute") and "\n" not in r.error


def test_training_in_place_max_batch_searches_with_the_extra_bytes():
    kw = dict(model="gpt2-large", seq_len=1024, precision="bf16-mixed", gpu="a100-40gb", inplace="every allowed site")
    b = C.get("training").run(**kw, batch_size=1).numbers["max_batch"][0]
    assert 1 <= b <= C.get("training").run(**{**kw, "inplace": "none"}, batch_size=1).numbers["max_batch"][0]
    # the largest batch that fits with the in-place dropouts' bytes: it fits, and the next one does not
    assert "\nfits on" in C.get("training").run(**kw, batch_size=b).text
    assert "does NOT fit" in C.get("training").run(**kw, batch_size=b + 1).text


def test_training_allocator_choice_is_fits_expandable_segments():
    kw = dict(model="gpt2", batch_size=8, seq_len=512, precision="bf16-mixed", gpu="h100-80gb")
    r = C.get("training").run(**kw, allocator="expandable segments")
    f = fit("gpt2", "h100-80gb", batch_size=8, seq_len=512, precision="bf16-mixed", expandable_segments=True)
    assert r.numbers["max_batch"][0] == f.max_batch_size
    assert r.numbers["max_batch"][0] >= C.get("training").run(**kw).numbers["max_batch"][0]
    assert "expandable" in r.text


@pytest.mark.parametrize("loss", ["whole", "chunked", "fused"])
def test_training_loss_choice_is_estimate_trainings(loss):
    kw = dict(batch_size=1, seq_len=8192, precision="bf16-mixed")
    r = C.get("training").run(model="llama-3.2-1b", gpu="h100-80gb", loss=loss, **kw)
    assert r.numbers["train_total"][0] == estimate_training("llama-3.2-1b", gpu="h100", loss=loss, **kw).total
    assert r.numbers["max_batch"][0] == fit("llama-3.2-1b", "h100-80gb", loss=loss, **kw).max_batch_size


def test_training_loss_refuses_an_encoder_in_one_line():
    r = C.get("training").run(model="bert-base", seq_len=512, loss="fused")
    assert "causal LMs" in r.error and "\n" not in r.error


def test_offload_loader_line_is_loader_memorys():
    from vramlab import offload as OFF
    from vramlab.units import fmt_bytes

    r = C.get("offload").run(model="llama-3.2-1b", batch_size=8, seq_len=4096, loader="pin_memory, 4 workers")
    lm = OFF.loader_memory([8 * 8 * 4096] * 3, num_workers=4, pin_memory=True, gpu="h100-80gb")
    line = next(x for x in r.text.splitlines() if x.startswith("data loader"))
    assert f"{lm.pinned_batches} pinned at once, {fmt_bytes(lm.pinned_bytes)} of page-locked" in line
    assert f"its copy {1e6 * lm.copy_seconds:.0f} us with non_blocking=True" in line
    pageable = C.get("offload").run(model="llama-3.2-1b", batch_size=8, seq_len=4096, loader="pageable, 4 workers")
    assert "nothing pinned" in pageable.text and "the host waits" in pageable.text


def test_context_calculator_is_context_parallels():
    from vramlab import context_parallel as CP

    r = C.get("context").run(model="llama-3.2-1b", method="ring", cp=4, batch_size=1, seq_len=32768, gpu="h100-80gb")
    want = CP.context_parallel("llama-3.2-1b", cp=4, method="ring", batch_size=1, seq_len=32768, gpu="h100-80gb",
                                precision="bf16-mixed")
    assert r.numbers["peak"][0] == want["peak"] and r.numbers["verdict"][1] == want["verdict"]
    assert r.numbers["sent"][0] == want["sent_per_layer"]["forward"] + want["sent_per_layer"]["backward"]
    bad = C.get("context").run(model="llama-3.2-1b", method="ulysses", cp=16)
    assert "must divide" in bad.error and "\n" not in bad.error


def test_moe_calculator_is_the_moe_estimators():
    """The chapter-1 mixture-of-experts calculator shows `specs`' exact counts, `moe.kv_cache_bytes`,
    `memory.estimate_inference` and `fitting.fit` (inference) as they are, for every MoE preset."""
    from vramlab import fitting, memory, moe, specs

    for name in specs.moe_preset_names():
        s = specs.preset(name)
        seq = min(4096, s.max_position_embeddings)
        r = C.get("moe").run(model=name, batch_size=2, seq_len=seq, dtype="bf16", gpu="h200")
        assert not r.error, r.error
        assert r.numbers["params"][0] == s.params and r.numbers["active"][0] == s.active_params
        assert r.numbers["kv_token"][0] == moe.kv_cache_bytes(s, batch_size=1, seq_len=1)
        assert r.numbers["peak"][0] == memory.estimate_inference(s, batch_size=2, seq_len=seq, gpu="h200").total
        assert r.numbers["max_batch"][0] == fitting.fit(s, "h200", batch_size=2, mode="infer", seq_len=seq,
                                                         dtype="bf16").max_batch_size
        assert "<svg" in r.svg and "routed experts" in r.svg
    big = C.get("moe").run(model="deepseek-v3", gpu="h100-80gb")
    assert "need 16 x h100-80gb" in big.text  # 1,250 GiB of bf16 weights over 78.4 GiB a GPU (usable less context)
    bad = C.get("moe").run(model="olmoe-1b-7b", seq_len=131072)
    assert "4,096 positions" in bad.error and "\n" not in bad.error


def test_moe_calculator_prices_training_as_estimate_training():
    from vramlab import fitting, memory

    r = C.get("moe").run(model="olmoe-1b-7b", batch_size=2, seq_len=2048, dtype="bf16", gpu="h200", step="training",
                         capacity="1.25", recompute="full")
    kw = dict(seq_len=2048, precision="bf16-mixed", recompute="full", capacity_factor=1.25)
    assert r.numbers["peak"][0] == memory.estimate_training("olmoe-1b-7b", batch_size=2, gpu="h200", **kw).total
    assert r.numbers["max_batch"][0] == fitting.fit("olmoe-1b-7b", "h200", batch_size=2, **kw).max_batch_size
    dropless = C.get("moe").run(model="olmoe-1b-7b", batch_size=2, seq_len=2048, gpu="h200", step="training")
    assert dropless.numbers["peak"][0] == memory.estimate_training("olmoe-1b-7b", batch_size=2, seq_len=2048,
                                                                    precision="bf16-mixed", gpu="h200").total
    for kw, says in ((dict(dtype="int8"), "int8"),):
        bad = C.get("moe").run(step="training", **kw)
        assert says in bad.error and "\n" not in bad.error


def test_experts_calculator_is_expert_parallel():
    from vramlab import expert_parallel as EP

    r = C.get("experts").run(model="qwen1.5-moe-a2.7b", ep=4, dp=8, capacity="dropless", zero=1, batch_size=2,
                             seq_len=2048, link="nvlink4")
    want = EP.expert_parallel("qwen1.5-moe-a2.7b", ep=4, dp=8, batch_size=2, seq_len=2048, zero_stage=1)
    assert not r.error and r.numbers["states"][0] == want["states"] and r.numbers["experts_per_rank"][0] == 15
    assert r.numbers["a2a"][0] == want["sent_per_layer"]["forward"] + want["sent_per_layer"]["backward"]
    assert "<svg" in r.svg and "ep 4" in r.svg and "ep 8" not in r.svg.split("ep 4")[0]
    bad = C.get("experts").run(model="mixtral-8x7b", ep=16, dp=16)
    assert bad.error and "\n" not in bad.error  # 8 experts cannot be split over 16 ranks


def test_serving_calculator_is_the_serving_plan():
    from vramlab import serving

    r = C.get("serving").run(model="llama-3.1-8b", gpu="h100-80gb", prompt_len=1024, output_len=1024, kv_dtype="fp8",
                             shared_prefix=512, n_samples=2)
    want = serving.serving_plan("llama-3.1-8b", gpu="h100", prompt_len=1024, output_len=1024, kv_dtype="fp8",
                                shared_prefix_len=512, n_samples=2)
    assert not r.error and r.numbers["blocks"][0] == want.num_blocks and r.numbers["requests"][0] == want.max_requests
    assert r.numbers["pool"][0] == want.available_kv_bytes and want.log_line() in r.text
    assert "<svg" in r.svg and f"fp8* ({want.max_requests:,})" in r.svg and "int8 (" in r.svg
    spec = C.get("serving").run(draft="llama-3.2-1b", speculative_tokens=4)
    assert not spec.error and "draft" in spec.text
    for kw in (dict(model="llama-3.1-405b"), dict(utilization=2), dict(shared_prefix=4096, prompt_len=1024),
               dict(draft="gpt2")):
        bad = C.get("serving").run(**kw)
        assert bad.error and "\n" not in bad.error, kw


# chapter 1's snapshot calculator, a file input read in the page
def _data_url(data: bytes, kind: str = "application/octet-stream") -> str:
    import base64

    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def test_explain_example_is_a_snapshot_pytorchs_parsers_read():
    """The built-in example is built to PyTorch's format: torch.cuda._memory_viz (PyTorch's own parser, no GPU
    needed) reads it and reports the reserved bytes the calculator shows."""
    import pickle

    viz = pytest.importorskip("torch.cuda._memory_viz")
    data = C.example_snapshot()
    r = C.get("explain").run()
    assert f"total_reserved: {viz.Bytes(r.numbers['reserved'][0])}" in viz.segsum(pickle.loads(data))
    oom = pickle.loads(data)["device_traces"][0][-1]
    assert oom["action"] == "oom" and oom["size"] > oom["device_free"]  # the request that did not fit
    small = pickle.loads(C.example_snapshot(batch_size=2))
    assert all(e["action"] != "oom" for e in small["device_traces"][0])  # batch 2 fits a T4: no OOM entry


def test_explain_calculator_is_snapshot_explain():
    """The numbers are vramlab.snapshot's for the same bytes; every allocated byte is in one category; the estimate
    column is memory.training_phases at the phase the OOM came in (the forward, for the example)."""
    from vramlab import memory, snapshot as S, specs

    r = C.get("explain").run(**C.EXAMPLE)
    g = specs.gpu("t4")
    est = memory.training_phases("gpt2", batch_size=8, seq_len=1024, precision="fp32")[0]
    e = S.explain(C.example_snapshot(), estimate=est, batch_size=8, device_total=g.usable_bytes,
                  context_bytes=g.context_bytes)
    assert r.numbers["allocated"][0] == e.allocated == sum(e.by_category.values())
    assert r.numbers["reserved"][0] == e.reserved and r.numbers["largest_batch"][0] == e.largest_batch_that_fits
    assert "\n".join(e.lines()) in r.text and "built to PyTorch's snapshot format" in r.text
    assert {c for c, _, _ in e.unexpected} == {"gradients", "kv_cache"}  # the example's two surprises
    plain = C.get("explain").run(model=C.NO_MODEL, gpu=C.NO_GPU)
    head = plain.text.split("\n")[2]
    assert head.split() == ["category", "snapshot"] and "outside the allocator" not in plain.text  # no model, no GPU
    assert plain.numbers["allocated"] == r.numbers["allocated"]  # the OOM entry alone gives the capacity: still answered


def test_explain_file_input_takes_bytes_data_urls_and_base64():
    import base64

    data = C.example_snapshot(batch_size=4)
    want = C.get("explain").run(snapshot=data)
    assert not want.error and "your file" in want.text
    for value in (_data_url(data), base64.b64encode(data).decode(), bytearray(data), memoryview(data)):
        assert C.get("explain").run(snapshot=value).to_dict() == want.to_dict()
    assert C.get("explain").run(snapshot="").to_dict() == C.get("explain").run().to_dict()  # no file: the example
    out = json.loads(C.run_html("explain", json.dumps({"snapshot": _data_url(data)})))  # the worker's call
    assert out["numbers"]["allocated"] == want.numbers["allocated"][0] and not out["error"]


@pytest.mark.parametrize("value, needle", [
    (_data_url(b"not a memory snapshot\n", "text/plain"), "snapshot file: not a memory snapshot"),
    ("data:,", "snapshot file: not a memory snapshot: the file is empty"),
    ("data:text/plain,hello", "snapshot file: a data URL without base64 data"),
    ("@@@ not base64", "snapshot file: the page sent no readable file"),
    (_data_url(__import__("pickle").dumps(print)), "refused: unpickling it could run code"),
    (_data_url(__import__("pickle").dumps({"segments": 3})), "snapshot file: "),
    (12, "snapshot file: expected a file's bytes"),
])
def test_explain_a_bad_file_is_one_line_naming_the_input(value, needle):
    r = C.get("explain").run(snapshot=value)
    assert needle in r.error and "\n" not in r.error and r.invalid == ("snapshot",) and not r.numbers, r.error
    out = json.loads(C.run_html("explain", json.dumps({"snapshot": value})))
    assert out["error"] == r.error and out["invalid"] == ["snapshot"] and 'class="vl-error" role="alert"' in out["html"]


def test_explain_page_has_a_file_input_and_no_upload():
    html = C.page_html("explain")
    assert re.search(r'<input type="file" [^>]*data-input="snapshot" disabled accept="\.pickle,\.pkl"', html)
    assert "never uploaded" in html and "<form" not in html and "action=" not in html
