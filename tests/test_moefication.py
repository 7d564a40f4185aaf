"""MoEfication (Zhang+22): a dense FFN's neurons split into experts, k of E computed per token.
`compression.moefication`'s counts (router parameters, active parameters, FLOPs and intermediate
bytes a token) against what `measure.compression.MoEFFN` really runs, counted in its forward by
torch's FlopCounterMode and a dispatch mode that sees every tensor the experts allocate; on gated
and plain FFNs of several shapes, with and without biases. The grouping is a partition; k = E
computes the dense FFN."""

from __future__ import annotations


import pytest
import torch

from vramlab import compression as C
from vramlab.specs import from_config
from vramlab.measure import compression as M

torch.set_num_threads(1)

LLAMA = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
         "hidden_act": "silu"}
OPT = {"model_type": "opt", "hidden_size": 40, "ffn_dim": 120, "num_hidden_layers": 3, "num_attention_heads": 4,
       "vocab_size": 64, "max_position_embeddings": 64, "activation_function": "relu", "word_embed_proj_dim": 40}
ACTS = {"silu": torch.nn.functional.silu, "relu": torch.relu}


def _ffn(spec, experts, k, *, seed=0, dtype=torch.float64):
    """A random FFN of `spec`'s shape as a MoEFFN with a linear router (bias), and its dense function."""
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden_size, spec.intermediate_size
    n_in = 2 if spec.gated_mlp else 1
    w_in = [torch.randn(i, h, generator=g, dtype=dtype) / h ** 0.5 for _ in range(n_in)]
    b_in = [torch.randn(i, generator=g, dtype=dtype) if spec.mlp_bias else None for _ in range(n_in)]
    w_out = torch.randn(h, i, generator=g, dtype=dtype) / i ** 0.5
    b_out = torch.randn(h, generator=g, dtype=dtype) if spec.mlp_bias else None
    act = ACTS[spec.activation]
    groups = M.balanced_kmeans(w_in[0], experts)
    router = torch.nn.Linear(h, experts, dtype=dtype)
    ffn = M.MoEFFN(w_in, b_in, act, w_out, b_out, groups, k, router)

    def dense(x):
        F = torch.nn.functional
        a = act(F.linear(x, w_in[0], b_in[0]))
        if n_in == 2:
            a = a * F.linear(x, w_in[1], b_in[1])
        return F.linear(a, w_out, b_out)

    return ffn, dense, router


SHAPES = [(LLAMA, 4), (LLAMA, 8), ({**LLAMA, "hidden_size": 32, "intermediate_size": 120, "mlp_bias": True}, 6),
          (OPT, 4), (OPT, 10), ({**OPT, "activation_function": "relu", "enable_bias": False}, 3)]


@pytest.mark.parametrize("cfg, experts", SHAPES)
def test_counted_flops_bytes_and_router_match_the_formula(cfg, experts):
    spec = from_config(cfg, name="t")
    tokens = 37
    x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    for k in sorted({1, 2, experts}):
        ffn, _, router = _ffn(spec, experts, k, dtype=torch.float32)
        ffn.count = True
        ffn(x)
        pred = C.moefication(spec, experts=experts, active=k, router="linear", router_bias=True, dtype="fp32")
        layers = pred.ffn_layers
        assert ffn.counted["tokens"] == tokens
        assert ffn.counted["flops"] == tokens * pred.ffn_flops // layers  # the k experts' matmuls and the router's
        assert ffn.counted["intermediate_bytes"] == tokens * 4 * pred.ffn_intermediate_values // layers
        assert sum(p.numel() for p in router.parameters()) == pred.router_params // layers
        # the active FFN parameters: the rows/columns of the k groups a token touches, plus the output bias
        m = spec.intermediate_size // experts
        used = sum(w.numel() for w in ffn.experts[0][0]) + sum(b.numel() for b in ffn.experts[0][1] if b is not None) \
            + ffn.experts[0][2].numel()  # one expert's rows, biases and output columns
        assert used == m * ((2 if spec.gated_mlp else 1) * (spec.hidden_size + spec.mlp_bias) + spec.hidden_size)
        assert pred.active_ffn_params == layers * (k * used + (spec.hidden_size if spec.mlp_bias else 0))


@pytest.mark.parametrize("cfg, experts", SHAPES)
def test_dense_flops_are_the_dense_ffns(cfg, experts):
    """k = E computes every neuron: the FFN FLOPs are the dense model's (FlopCounterMode on the dense
    function), the router's added; and the whole-model counts equal `checkpointing.flops`' FFN part."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = from_config(cfg, name="t")
    x = torch.randn(5, spec.hidden_size, dtype=torch.float64)
    _, dense, _ = _ffn(spec, experts, experts)
    with FlopCounterMode(display=False) as fc:
        dense(x)
    pred = C.moefication(spec, experts=experts, active=experts)
    assert fc.get_total_flops() == 5 * pred.ffn_flops_dense // pred.ffn_layers
    assert pred.ffn_flops == pred.ffn_flops_dense + pred.ffn_layers * 2 * spec.hidden_size * experts
    assert pred.params == spec.params + pred.router_params and pred.active_params == pred.params


@pytest.mark.parametrize("n, groups", [(96, 4), (704, 8), (120, 10), (12, 12), (30, 1)])
def test_grouping_is_a_balanced_partition(n, groups):
    rows = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    got = M.balanced_kmeans(rows, groups)
    assert sorted(j for g in got for j in g) == list(range(n))
    assert all(len(g) == n // groups for g in got)


def test_grouping_finds_planted_clusters():
    """Rows drawn around 4 well-separated directions: k-means returns exactly those 4 groups."""
    g = torch.Generator().manual_seed(3)
    centres = torch.eye(16)[:4] * 10
    label = torch.randperm(40, generator=g) % 4
    rows = centres[label] + 0.1 * torch.randn(40, 16, generator=g)
    got = M.balanced_kmeans(rows, 4)
    assert sorted(sorted(gr) for gr in got) == sorted(sorted((label == c).nonzero().flatten().tolist()) for c in range(4))


@pytest.mark.parametrize("cfg, experts", SHAPES)
def test_all_experts_compute_the_dense_ffn(cfg, experts):
    spec = from_config(cfg, name="t")
    ffn, dense, _ = _ffn(spec, experts, experts)
    x = torch.randn(3, 7, spec.hidden_size, dtype=torch.float64)
    assert torch.allclose(ffn(x), dense(x), rtol=0, atol=1e-12)
    # and fewer experts compute something else (the test can tell)
    small, _, _ = _ffn(spec, experts, 1)
    if experts > 1:
        assert not torch.allclose(small(x), dense(x), atol=1e-6)


def test_moefied_model_with_every_expert_is_the_dense_model():
    spec = from_config({**LLAMA, "hidden_act": "relu"}, name="t")
    model = M.build(spec).double()
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    groups = [M.balanced_kmeans(layer.mlp.gate_proj.weight, 4) for layer in model.model.layers]
    routers = M.moe_routers(model, x, groups)
    with torch.no_grad():
        want = model(input_ids=x).logits
        for r in M.MOE_ROUTERS:
            got = M.moefied(model, groups, 4, routers[r])(input_ids=x).logits
            assert torch.allclose(got, want, rtol=0, atol=1e-10), r
        # the oracle with k = 1 keeps each token's largest group: closer to dense than the worst group
        assert not torch.allclose(M.moefied(model, groups, 1, routers["oracle"])(input_ids=x).logits, want, atol=1e-6)


def test_training_keeps_every_expert_and_saves_activations():
    from vramlab.memory import estimate_training

    dense = estimate_training("gpt2", batch_size=4, seq_len=512, precision="bf16-mixed")
    moe = C.moefied_training("gpt2", experts=8, active=2, batch_size=4, seq_len=512, precision="bf16-mixed")
    mo = C.moefication("gpt2", experts=8, active=2, precision="bf16-mixed")
    assert moe.parameters == dense.parameters + mo.router_params * 4  # bf16-mixed keeps fp32 weights
    assert moe.gradients >= dense.gradients and moe.optimizer_states > dense.optimizer_states
    assert moe.activations < dense.activations
    assert mo.weight_bytes > mo.weight_bytes_dense  # no weight memory saved: the routers add some
    assert mo.ffn_saved_bytes < mo.ffn_saved_bytes_dense / 3


def test_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match="equal experts"):
        C.moefication("gpt2", experts=7, active=1)
    with pytest.raises(ValueError, match="active"):
        C.moefication("gpt2", experts=8, active=9)
    with pytest.raises(ValueError, match="router"):
        C.moefication("gpt2", experts=8, active=1, router="oracle")
    with pytest.raises(ValueError, match="router_hidden"):
        C.moefication("gpt2", experts=8, active=1, router="mlp")
    with pytest.raises(ValueError, match="equal groups"):
        M.balanced_kmeans(torch.randn(10, 3), 3)


def test_mlp_router_counts():
    mo = C.moefication("llama-3.2-1b", experts=16, active=4, router="mlp", router_hidden=256)
    h, L = 2048, 16
    assert mo.router_params == L * (h * 256 + 256 + 256 * 16 + 16)
    assert mo.ffn_flops == L * (2 * 4 * (8192 // 16) * h * 3 + 2 * (h * 256 + 256 * 16))


def test_stored_run():
    """The committed `--moefication` run that chapter 8 plots: what its forwards counted equals what
    `compression.moefication` predicts now (recomputed here), and k = E is the dense model."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "moefication" / "moefication_cpu.json"
    saved = json.loads(path.read_text())
    assert {"date", "torch", "platform"} <= set(saved["provenance"]) and "--moefication" in saved["command"]
    specs = {"silu": M.teacher_spec(), "relu": M.relu_teacher_spec()}
    assert [m["activation"] for m in saved["models"]] == ["silu", "relu"]
    for m in saved["models"]:
        spec, E = specs[m["activation"]], m["experts"]
        assert m["counted_dense_ffn_flops_per_token"] == C.moefication(spec, experts=E, active=E).ffn_flops_dense
        assert [r["k"] for r in m["rows"]] == list(range(1, E + 1))
        for r in m["rows"]:
            pred = C.moefication(spec, experts=E, active=r["k"], router_bias=True, dtype="fp32")
            assert r["counted_ffn_flops_per_token"] == pred.ffn_flops
            assert r["counted_intermediate_bytes_per_token"] == 4 * pred.ffn_intermediate_values
            assert r["router_params"] == pred.router_params
        last = m["rows"][-1]
        assert all(abs(last[f"loss_{r}"] - m["dense_loss"]) < 1e-4 for r in M.MOE_ROUTERS)
        assert abs(last["energy_share"] - 1) < 1e-6


def test_moefied_training_refuses_recompute_rather_than_a_wrong_number():
    """Checkpointing would subtract the dense FFN's saved bytes from a block that keeps only its input:
    the estimate refuses in one line instead of clamping the activations to zero."""
    with pytest.raises(ValueError, match="recompute is not modelled"):
        C.moefied_training("opt-1.3b", experts=32, active=4, batch_size=1, seq_len=128, recompute="full")
    assert C.moefied_training("opt-1.3b", experts=32, active=4, batch_size=1, seq_len=128).total > 0
