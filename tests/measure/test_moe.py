"""`vramlab.measure.moe`: the drop-and-pad experts layer the capacity-factor measurements run. Checked
against a plain loop over tokens (no buffers): which choices it keeps at a capacity, and what it computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vramlab.measure.moe import DropAndPadExperts, use_capacity  # noqa: E402
from vramlab.moe import expert_capacity  # noqa: E402


class _Experts(torch.nn.Module):
    """transformers' experts layout: gate_up_proj (E, 2i, h), down_proj (E, h, i), an activation."""

    def __init__(self, E: int, h: int, i: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * i, h, generator=g, dtype=torch.float64) / h ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, h, i, generator=g, dtype=torch.float64) / i ** 0.5)
        self.act_fn = torch.nn.functional.silu


def _loop(experts, x, index, weights, C):
    """Token by token: first choices of every token (in token order), then second choices; an expert past
    C rows drops the choice."""
    T, k = index.shape
    used = [0] * experts.gate_up_proj.shape[0]
    keep = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in range(T):
            e = int(index[t, j])
            if used[e] < C:
                used[e] += 1
                keep[t, j] = True
    out = torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            if keep[t, j]:
                e = int(index[t, j])
                gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
                out[t] += weights[t, j] * (experts.down_proj[e] @ (experts.act_fn(gate) * up))
    return out, keep


@pytest.mark.parametrize("T, E, k, cf", [(12, 4, 2, 1.0), (12, 4, 1, 0.5), (9, 3, 2, 2.0), (16, 8, 2, 1.25)])
def test_drop_and_pad_keeps_first_choices_first_and_computes_the_experts(T, E, k, cf):
    experts = _Experts(E, h=6, i=5)
    g = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, 6, generator=g, dtype=torch.float64)
    scores = torch.randn(T, E, generator=g)
    index = scores.topk(k, dim=-1).indices
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    C = expert_capacity(T, E, k, cf)
    want, keep = _loop(experts, x, index, weights, C)
    got = DropAndPadExperts(experts, cf)(x, index, weights)
    assert torch.allclose(got, want, atol=1e-12)
    if cf < 1.0:
        assert not keep.all()  # the case drops some choices


def test_use_capacity_swaps_every_experts_module_and_refuses_a_model_without_one():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = _Experts(4, 6, 5)

    model = torch.nn.Sequential(Block(), Block())
    use_capacity(model, 1.0)
    assert all(isinstance(b.experts, DropAndPadExperts) for b in model)
    with pytest.raises(ValueError, match="no transformers experts module"):
        use_capacity(torch.nn.Linear(2, 2), 1.0)
