"""In-place operations (chapter 1): `vramlab.inplace.mlp_block_memory` (the ledger's prediction of
what a block saves for backward and its forward peak, with and without in-place ops) against real
tensors: saved-tensor hooks and live storages (`vramlab.measure.inplace`), on several shapes and
precisions that are not the chapter's; and autograd's refusals against `inplace_refusal`."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from vramlab import preset
from vramlab.inplace import INPLACE_OPS, MLPBlock, inplace_refusal, inplace_sites, mlp_block_memory

torch = pytest.importorskip("torch")
ip = pytest.importorskip("vramlab.measure.inplace")

BLOCKS = [
    MLPBlock(hidden_size=16, intermediate_size=48, activation="relu", inner_dropout=0.1, outer_dropout=0.1),
    MLPBlock(hidden_size=24, intermediate_size=64, activation="silu", norm="layernorm", inner_dropout=0.2,
             outer_dropout=0.1),
    MLPBlock(hidden_size=32, intermediate_size=32, activation="gelu", norm="layernorm", outer_dropout=0.3),
    MLPBlock(hidden_size=8, intermediate_size=40, activation="tanh"),
    MLPBlock(hidden_size=12, intermediate_size=36, activation="relu", norm="rmsnorm", inner_dropout=0.1,
             outer_dropout=0.1),
    MLPBlock(hidden_size=12, intermediate_size=20, activation="sigmoid", norm="rmsnorm", outer_dropout=0.1,
             branch_ref=True),
]
OPS = ("activation", "inner_dropout", "outer_dropout", "residual")


def _combos():
    return [c for r in range(len(OPS) + 1) for c in itertools.combinations(OPS, r)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.activation}-{b.norm}")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_prediction_equals_measurement_for_every_allowed_choice(block, precision):
    torch.set_num_threads(1)
    checked = 0
    for ops in _combos():
        if inplace_refusal(block, ops):
            continue
        p = mlp_block_memory(block, batch_size=3, seq_len=5, precision=precision, device="cpu", inplace=ops)
        m = ip.measure_mlp_block(block, batch_size=3, seq_len=5, precision=precision, inplace=ops)
        assert (p["saved"], p["forward_peak"], p["end"]) == (m.saved, m.forward_peak, m.end), ops
        checked += 1
    assert checked >= 4


def test_inplace_relu_and_residual_save_nothing_for_backward_only_the_forward_transient():
    """The regime where the effect exists: the forward peak is at the ReLU (fc1's output and ReLU's
    output alive at once) and at the residual add; in place removes one intermediate-wide and one
    hidden-wide tensor there, and nothing from what backward keeps."""
    b, s, h, i = 4, 6, 16, 64
    block = MLPBlock(hidden_size=h, intermediate_size=i, activation="relu")
    kw = dict(batch_size=b, seq_len=s, precision="fp32", device="cpu")
    base = mlp_block_memory(block, **kw)
    relu = mlp_block_memory(block, inplace=("activation",), **kw)
    both = mlp_block_memory(block, inplace=("activation", "residual"), **kw)
    assert base["saved"] == relu["saved"] == both["saved"] == b * s * (h + i) * 4  # fc1's input, ReLU's output
    t = b * s * 4  # bytes per element-per-token, fp32
    # by hand: the peak is fc1's output and ReLU's output together (2i); in place, it moves to the end of
    # the block: ReLU's output (saved), fc2's output and the sum (i + 2h); in place there too, i + h
    assert (base["forward_peak"], relu["forward_peak"], both["forward_peak"]) == (2 * i * t, (i + 2 * h) * t, (i + h) * t)
    m0 = ip.measure_mlp_block(block, batch_size=b, seq_len=s)
    m1 = ip.measure_mlp_block(block, batch_size=b, seq_len=s, inplace=("activation",))
    assert m0.saved == m1.saved and (m0.forward_peak, m1.forward_peak) == (2 * i * t, (i + 2 * h) * t)


def test_inplace_silu_saves_nothing_at_all():
    # silu's backward reads its input: silu_ makes autograd keep a copy first (the same bytes)
    block = MLPBlock(hidden_size=16, intermediate_size=48, activation="silu")
    kw = dict(batch_size=2, seq_len=3)
    assert mlp_block_memory(block, **kw) == {**mlp_block_memory(block, inplace=("activation",), **kw),
                                             "inplace": ()}
    assert ip.measure_mlp_block(block, **kw) == ip.measure_mlp_block(block, inplace=("activation",), **kw)


def test_on_cuda_inplace_dropout_saves_more():
    """Out of place, CUDA's fused dropout saves a 1-byte mask; dropout_ saves its noise in the dtype
    (ATen native/Dropout.cpp). Predicted only: no GPU here."""
    block = MLPBlock(hidden_size=16, intermediate_size=48, activation="gelu", outer_dropout=0.1)
    kw = dict(batch_size=2, seq_len=8, device="cuda")
    for precision, nb in (("fp32", 4), ("bf16", 2)):
        out = mlp_block_memory(block, precision=precision, **kw)
        inp = mlp_block_memory(block, precision=precision, inplace=("outer_dropout",), **kw)
        assert inp["saved"] - out["saved"] == 2 * 8 * 16 * (nb - 1)
    cpu = dict(kw, device="cpu")
    assert mlp_block_memory(block, **cpu)["saved"] == mlp_block_memory(block, inplace=("outer_dropout",), **cpu)["saved"]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.activation}-{b.norm}")
def test_autograd_refuses_exactly_what_the_ledger_refuses(block):
    torch.set_num_threads(1)
    for ops in _combos() + [("residual_into_input",)]:
        why = inplace_refusal(block, ops)
        if "activation" in ops and block.activation == "gelu":
            assert why and "no in-place GELU" in why
            continue
        module = ip.MLPBlockModule(block, ops)
        x = torch.randn(2, 3, block.hidden_size, requires_grad=True) * 1
        refused = ip.backward_refusal(lambda: module(x))
        assert (refused is not None) == (why is not None), (ops, refused, why)
        if why:
            assert "modified by an inplace operation" in refused
            with pytest.raises(ValueError, match="in place refused: .*modified by an inplace operation"):
                mlp_block_memory(block, batch_size=2, seq_len=3, inplace=ops)


def test_inplace_on_a_leaf_is_refused_in_the_forward():
    block = MLPBlock(hidden_size=8, intermediate_size=16)
    module = ip.MLPBlockModule(block, ("residual_into_input",))
    leaf = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        module(leaf)
    assert "leaf Variable" in inplace_refusal(block, ("residual_into_input",))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_t5_feed_forward_layer_of_transformers(precision):
    """A preset family's real block part: transformers' T5LayerFF (T5's ReLU MLP with two dropouts),
    its nn.ReLU / nn.Dropout modules switched to in place, against the ledger; in-place dropout after
    the ReLU is refused by autograd and by the ledger."""
    from transformers.models.t5.modeling_t5 import T5LayerFF

    from vramlab.measure.models import hf_config

    torch.set_num_threads(1)
    h, i, b, s = 48, 160, 2, 5
    spec = dataclasses.replace(preset("t5-small"), hidden_size=h, intermediate_size=i, num_heads=4,
                               num_kv_heads=4, head_dim=12)
    block = MLPBlock(hidden_size=h, intermediate_size=i, activation="relu", norm="rmsnorm",
                     inner_dropout=spec.hidden_dropout, outer_dropout=spec.hidden_dropout, branch_ref=True)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    peaks = {}
    for ops in ((), ("activation",), ("outer_dropout",), ("activation", "outer_dropout"), ("inner_dropout",)):
        ff = T5LayerFF(hf_config(spec)).to(dtype)
        switch = {"activation": ff.DenseReluDense.act, "inner_dropout": ff.DenseReluDense.dropout,
                  "outer_dropout": ff.dropout}
        for op in ops:
            switch[op].inplace = True
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True) * 1
        refused = ip.backward_refusal(lambda: ff(x))
        if ops == ("inner_dropout",):
            assert refused and "output 0 of Relu" in refused and inplace_refusal(block, ops)
            continue
        assert refused is None
        m = ip.measure_forward(ff, x)
        p = mlp_block_memory(block, batch_size=b, seq_len=s, precision=precision, device="cpu", inplace=ops)
        assert (p["saved"], p["forward_peak"], p["end"]) == (m.saved, m.forward_peak, m.end), ops
        peaks[ops] = m.forward_peak
    # T5's peak is at the residual add: the in-place ReLU removes a transient that is not the peak; the
    # in-place output dropout removes its site's transient there, and leaves the saved bytes alone
    assert peaks[()] == peaks[("activation",)]
    sites = {x.name: x for x in inplace_sites(spec, device="cpu", precision=precision)}
    ff_drop, relu, inner = sites["feed-forward output dropout"], sites["relu (the MLP's activation)"], \
        sites["dropout inside the MLP"]
    assert ff_drop.allowed and ff_drop.saved_change == 0 and peaks[()] - peaks[("outer_dropout",)] == ff_drop.transient * b * s
    assert relu.allowed and relu.saved_change == 0 and relu.transient == i * dtype.itemsize
    assert not inner.allowed and "relu's output" in inner.why


def test_bad_input_is_one_clear_line():
    block = MLPBlock(hidden_size=8, intermediate_size=16)
    for kwargs, msg in ((dict(inplace=("relu",)), "in-place op"), (dict(inplace=True), "inplace must be"),
                        (dict(inplace=[["residual"]]), "in-place op"),
                        (dict(precision="bf16-mixed"), "precision"), (dict(device="tpu"), "device")):
        with pytest.raises(ValueError, match=msg):
            mlp_block_memory(block, batch_size=1, seq_len=1, **kwargs)
    for bad, msg in ((dict(activation="swish"), "activation"), (dict(inner_dropout=1.0), "inner_dropout"),
                     (dict(norm=True), "norm"), (dict(hidden_size=0), "hidden_size")):
        with pytest.raises(ValueError, match=msg):
            MLPBlock(**{"hidden_size": 8, "intermediate_size": 16, **bad})
    with pytest.raises(ValueError, match="MLPBlock"):
        inplace_refusal("block")
    assert set(INPLACE_OPS) >= set(OPS)


def test_family_sites():
    """What each preset family's block allows (the rules measured above, read off transformers' code)."""
    def sites(name, **kw):
        return {x.name.split(" (")[0]: x for x in inplace_sites(preset(name), **kw)}

    llama = sites("llama-3.2-1b", device="cpu")
    assert llama["silu"].allowed and llama["silu"].transient == llama["silu"].saved_change == 0  # nothing at all
    gpt2 = sites("gpt2", attention="eager")
    assert not gpt2["gelu_new"].allowed and not gpt2["attention-probabilities dropout"].allowed
    # CUDA: the fused dropout's 1-byte mask becomes a noise tensor in the dtype
    h = preset("gpt2").hidden_size
    assert gpt2["MLP output dropout"].saved_change == 3 * h  # fp32: 4 bytes instead of 1
    assert sites("gpt2", precision="bf16")["MLP output dropout"].saved_change == h
    assert sites("gpt2", device="cpu")["MLP output dropout"].saved_change == 0
    assert "attention-probabilities dropout" not in sites("gpt2")  # SDPA: inside the kernel
    opt = sites("opt-125m")
    assert opt["relu"].allowed and opt["relu"].saved_change == 0
    assert sites("mt5-small")["dropout inside the MLP"].allowed  # after act(wi_0) * wi_1: nothing saved it
    for name in ("gpt2", "bert-base", "llama-3.2-1b", "t5-small", "pythia-160m"):
        into_stream = [x for x in inplace_sites(preset(name)) if x.name.startswith("residual add into the stream")]
        assert len(into_stream) == 1 and not into_stream[0].allowed
    with pytest.raises(ValueError, match="device"):
        inplace_sites(preset("gpt2"), device="tpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "t5-small", "opt-125m"])
def test_inplace_step_counts_the_output_dropouts_transformers_builds(name):
    """`inplace_step` multiplies one block's sites by the blocks, and T5's decoder blocks carry one more
    output dropout (after the cross-attention): the count of output dropouts on a projection's output is
    read here from transformers' own model, built from the preset's config (no weights)."""
    from vramlab.inplace import inplace_step
    from vramlab.measure.models import build_model

    spec = preset(name)
    model = build_model(spec)
    if spec.family == "t5":  # T5LayerSelfAttention / T5LayerCrossAttention / T5LayerFF each end in .dropout
        outputs = sum(1 for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)
                      and ".layer." in n and n.endswith(".dropout") and "DenseReluDense" not in n)
    elif spec.family == "gpt2":  # attn.resid_dropout and mlp.dropout
        outputs = sum(1 for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)
                      and n.endswith(("attn.resid_dropout", "mlp.dropout")))
    else:  # OPT calls F.dropout on both sublayers' outputs: two per decoder layer
        outputs = 2 * sum(1 for n, _ in model.named_modules() if n.count(".layers.") == 1 and n.split(".")[-1].isdigit())
    b, s, half = 2, 64, 2
    got = inplace_step(spec, batch_size=b, seq_len=s, precision="bf16-mixed")
    assert got["saved"] == outputs * spec.hidden_size * (half - 1) * b * s  # each: a bf16 noise for a 1-byte mask
    assert inplace_step(spec, batch_size=b, seq_len=s, choice="where it frees memory", precision="bf16-mixed")["saved"] == 0
    assert inplace_step(spec, batch_size=b, seq_len=s, choice="none")["transient"] == 0


def test_inplace_step_refuses_bad_input_in_one_line():
    from vramlab.inplace import inplace_step

    with pytest.raises(ValueError, match="in-place choice"):
        inplace_step("gpt2", batch_size=1, seq_len=8, choice="all")
    with pytest.raises(ValueError, match="batch_size"):
        inplace_step("gpt2", batch_size=0, seq_len=8)
