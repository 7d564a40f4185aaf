"""Mixture-of-experts training, measured: a drop-and-pad (capacity) experts layer to swap into a
transformers MoE model, and the switch that lets fake tensors trace transformers' experts in fp32.
Imports torch.

transformers runs its experts dropless (integrations/moe.py::grouped_mm_experts_forward): every
token copied once per chosen expert. GShard/Switch routing with a capacity factor (DeepSpeed's
`moe/sharded_moe.py`, Megatron-Core's drop-and-pad mode) gives each expert a fixed buffer of
C = `vramlab.moe.expert_capacity(tokens, E, k, capacity_factor)` rows: a token's choice past its
expert's C-th is dropped (it skips that expert through the residual), an expert with fewer tokens
is padded with zeros. `DropAndPadExperts` is that layer, written here (no code copied): the same
parameters as transformers' experts module (gate_up_proj E x 2i x h, down_proj E x h x i), the
family's router unchanged. Slots go first to every token's first choice, in token order, then to
the second choices (DeepSpeed's top-2 gating gives the first choices priority the same way).
"""

from __future__ import annotations

import contextlib

import torch

from .. import moe as _moe


class DropAndPadExperts(torch.nn.Module):
    """Experts with a capacity: `forward(hidden (T, h), top_k_index (T, k), top_k_weights (T, k))`,
    the call transformers' MoE blocks make, returning (T, h). Saved for backward: the slot->token
    index (E*C int64), the E x C x h buffers (the batched matmul's input), gate_up's output, act(gate)
    and the down projection's input (E x C x i each, 2i for gate_up), the choice->slot index (T*k
    int64), the gathered outputs (T*k x h) and the routing weights."""

    def __init__(self, experts: torch.nn.Module, capacity_factor: float):
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj  # (E, 2i, h): the same parameters, shared
        self.down_proj = experts.down_proj  # (E, h, i)
        self.act_fn = experts.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.capacity_factor = capacity_factor

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, h = hidden.shape
        k, E = top_k_index.shape[-1], self.num_experts
        C = _moe.expert_capacity(T, E, k, self.capacity_factor)
        # each choice's position in its expert's buffer: first choices before second ones (k-major order)
        choice = top_k_index.t().reshape(-1)  # (k*T,) expert of each choice
        onehot = torch.nn.functional.one_hot(choice, E)  # (k*T, E) int64, no gradient
        position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # (k*T,)
        kept = position < C
        trash = E * C  # the slot of a dropped choice: a zero row
        slot_kT = torch.where(kept, choice * C + position, torch.full_like(choice, trash))
        token_kT = torch.arange(T, device=hidden.device).repeat(k)
        # slot -> token (T: the zero row) for the buffers, choice -> slot for the way back
        slot_token = torch.full((E * C + 1,), T, dtype=torch.long, device=hidden.device)
        slot_token[slot_kT] = token_kT
        slot_token = slot_token[:trash]
        slot_of_choice = slot_kT.view(k, T).t().reshape(-1)  # (T*k,) in token-major order
        zero = hidden.new_zeros(1, h)
        buffers = torch.cat([hidden, zero])[slot_token].view(E, C, h)  # (E, C, h), padded with zeros
        gate_up = torch.bmm(self.gate_up_proj, buffers.transpose(1, 2))  # (E, 2i, C)
        gate, up = gate_up.chunk(2, dim=1)
        out = torch.bmm(self.down_proj, self.act_fn(gate) * up)  # (E, h, C)
        out = out.transpose(1, 2).reshape(E * C, h)
        gathered = torch.cat([out, out.new_zeros(1, h)])[slot_of_choice]  # (T*k, h), dropped choices zero
        weighted = gathered * top_k_weights.reshape(-1, 1)
        return weighted.view(T, k, h).sum(1).to(hidden.dtype)


def use_capacity(model: torch.nn.Module, capacity_factor: float) -> torch.nn.Module:
    """Swap every transformers experts module of `model` (one with gate_up_proj and down_proj
    parameters, inside an MoE block) for a `DropAndPadExperts` with the same parameters."""
    swapped = 0
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.Module) and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            module.experts = DropAndPadExperts(experts, capacity_factor)
            swapped += 1
    if not swapped:
        raise ValueError("use_capacity: the model has no transformers experts module to swap")
    return model


@contextlib.contextmanager
def grouped_mm_fallback_unless_bf16():
    """Fake tensors carry CUDA's grouped_mm shape rule (bf16 only), so transformers' experts in fp32
    cannot be traced with it; transformers' own fallback op (`transformers::grouped_mm_fallback`,
    which saves the same input and weight for its backward) runs instead where the weights are not
    bf16, as transformers itself does where grouped_mm cannot run."""
    from transformers.integrations import moe as hf_moe

    original = hf_moe._can_use_grouped_mm
    hf_moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(input, weight, offs)
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm = original


__all__ = ["DropAndPadExperts", "grouped_mm_fallback_unless_bf16", "use_capacity"]
