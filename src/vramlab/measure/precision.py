"""What fp16 mixed precision loses without a loss scale, measured on a real backward pass. Imports torch.

A gradient smaller than half of fp16's smallest subnormal (2^-25) becomes exactly 0 when the
backward pass casts it to fp16 (Micikevicius et al. 2017, arXiv:1710.03740, fig. 3): the update
it carried is lost. `flushed_fraction` compares the gradients of one backward without a scale with
those of the same backward with a loss scale (unscaled afterwards, as GradScaler does): elements
that are non-zero with the scale and exactly zero without it were flushed.
"""

from __future__ import annotations

from typing import Iterable

import torch


def flushed_fraction(unscaled: Iterable[torch.Tensor], reference: Iterable[torch.Tensor]) -> float:
    """Share of gradient elements that are non-zero in `reference` but exactly 0 in `unscaled`.
    The two iterables pair up tensor by tensor (same shapes); None gradients are skipped."""
    lost = kept = 0
    for u, r in zip(unscaled, reference, strict=True):
        if r is None:
            continue
        if u is None:
            u = torch.zeros_like(r)
        if u.shape != r.shape:
            raise ValueError(f"gradient shapes differ: {tuple(u.shape)} vs {tuple(r.shape)}")
        live = r != 0
        lost += int((live & (u == 0)).sum())
        kept += int(live.sum())
    return lost / kept if kept else 0.0


def fp16_flushed_fraction(model: torch.nn.Module, batch: dict, *, scale: float = 2.0**16,
                          dtype: torch.dtype = torch.float16) -> float:
    """Run the same backward twice under `dtype` autocast, without and with a loss scale, and
    return the share of parameter-gradient elements the unscaled backward flushed to zero. The
    model's gradients are left as they were (None)."""
    device = next(model.parameters()).device.type
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(s: float) -> list[torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = model(**batch).loss
        (loss * s).backward()
        out = [None if p.grad is None else p.grad.detach().float() / s for p in params]
        model.zero_grad(set_to_none=True)
        return out

    return flushed_fraction(grads(1.0), grads(scale))
