"""Expert parallelism, measured on gloo ranks (`python -m vramlab.measure.parallel ep --ep N --dp N`,
`ep_main`; issue H2): a small mixture-of-experts transformer (written here, parameter for parameter the
tensors `ModelSpec.param_tensors` lists for a Mixtral or Qwen2-MoE config: embedding, per layer q/k/v/o with their biases, two RMSNorms, a dense gated MLP or a
router + routed experts stored as transformers 5 stores them -- 3-D `gate_up_proj` (E, 2i, h) and
`down_proj` (E, h, i) -- + an optional shared expert and its gate, final norm, LM head; no rotary
embedding) on dp gloo ranks whose routed experts are split over ep: rank r holds experts
(r % ep) E/ep ... of every MoE layer; the EP group is the ep consecutive ranks, the expert-data-parallel
group the dp/ep ranks holding the same experts (Megatron-Core's layout, `parallel_state`).

Tokens travel with `dist.all_to_all_single` (gloo supports it on CPU, variable splits included):
- dropless: the per-expert counts are exchanged first (an all-to-all of E/ep counts per peer), then the
  rows, sorted by expert (Megatron-Core's `MoEAlltoAllTokenDispatcher`, `token_dispatcher.py`);
- capacity factor: every rank sends a fixed E x C buffer, C = moe.expert_capacity of its own tokens, the
  choices beyond an expert's capacity dropped in token order (GShard; DeepSpeed's `sharded_moe.py`).

Forward and backward each run two all-to-alls per MoE layer (dispatch, combine), an autograd Function
here that counts the bytes each sends to other ranks at the call. Gradients: dense over the whole world,
experts over the expert-data-parallel group only, both divided by dp; AdamW (foreach), ZeRO 0.
The trained parameters are checked against one process running the same MoE with all experts on every
rank's tokens (the same drops), and one steady-state step is measured with the ledger.

The campaign stored in benchmarks/results/expert_parallel/cpu.json: `EP_CAMPAIGN`, `ep_campaign`. Imports torch
inside its functions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .. import checks
from .. import expert_parallel as EPP
from ..specs import ModelSpec, from_config
from .ledger import ledger_step
from .ranks import (PROG, RANK_IMPORTS, ParlabError, adamw, campaign, error, lm_loss, run_in_subprocess, run_rank,
                    steady, token_batch, zero_grads)


EP_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Mixtral-like: every layer MoE, 4 experts
    "ep-mixtral": ("ep-mixtral", dict(model_type="mixtral", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, vocab_size=128, max_position_embeddings=512,
                                      tie_word_embeddings=False)),
    # Mixtral-like with 8 experts (2 per rank at ep 4), wider experts
    "ep-mixtral8": ("ep-mixtral8", dict(model_type="mixtral", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=512,
                                        tie_word_embeddings=False)),
    # top-1 routing (Switch), 8 experts
    "ep-switch8": ("ep-switch8", dict(model_type="mixtral", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                      num_experts_per_tok=1, vocab_size=128, max_position_embeddings=512,
                                      tie_word_embeddings=False)),
    # Qwen2-MoE-like: a dense first layer, then MoE layers with a gated shared expert
    "ep-qwen2": ("ep-qwen2", dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=128, shared_expert_intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                  vocab_size=128, max_position_embeddings=512, mlp_only_layers=[0],
                                  tie_word_embeddings=False)),
}


def ep_model_spec(name: str) -> ModelSpec:
    if name not in EP_MODELS:
        raise ValueError(f"unknown EP model {name!r}; known: {', '.join(EP_MODELS)}")
    label, cfg = EP_MODELS[name]
    return from_config(cfg, name=label)


class _EPComm:
    """The groups of this rank and the bytes its all-to-alls sent to other ranks, by direction."""

    def __init__(self, ep_group=None, ep: int = 1, ep_rank: int = 0):
        self.group, self.ep, self.ep_rank = ep_group, ep, ep_rank
        self.reset()

    def reset(self) -> None:
        self.sent = {"forward": 0, "backward": 0}
        self.calls = {"forward": 0, "backward": 0}
        self.counts_sent = 0
        self.received: list[int] = []  # rows each MoE layer's dispatch received (forward)
        self.kept: list[int] = []  # choices each MoE layer kept (all of them dropless)
        self.home: list[int] = []  # rows each MoE layer's dispatch routed to this rank's own experts


def _a2a_function():
    import torch
    import torch.distributed as dist

    class A2A(torch.autograd.Function):
        """all_to_all_single of rows (send_splits rows to each EP peer, recv_splits from each); its backward
        is the all-to-all of the gradients the other way. Counts the bytes that leave the rank."""

        @staticmethod
        def forward(ctx, x, send, recv, comm):
            ctx.send, ctx.recv, ctx.comm = send, recv, comm
            return _a2a_rows(x, send, recv, comm, "forward")

        @staticmethod
        def backward(ctx, g):
            return _a2a_rows(g.contiguous(), ctx.recv, ctx.send, ctx.comm, "backward"), None, None, None

    def _a2a_rows(x, send, recv, comm, direction):
        if comm.ep == 1:  # the reference process: nothing leaves
            return x.clone()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row = (x.numel() // max(x.shape[0], 1)) * x.element_size()  # bytes per row
        comm.sent[direction] += (sum(send) - send[comm.ep_rank]) * row  # all but the rows that stay here
        comm.calls[direction] += 1
        dist.all_to_all_single(out, x, list(recv), list(send), group=comm.group)
        return out

    return A2A


_A2A = None


def _capacity_keep(top_i, num_experts: int, capacity: int):
    """Which (token, choice) pairs keep their expert under a capacity, and their slot in its buffer: choices in
    token order (token 0's first choice, its second, token 1's ...), each expert's first `capacity` kept."""
    import torch.nn.functional as F

    flat = top_i.reshape(-1)  # (T k,)
    onehot = F.one_hot(flat, num_experts)  # (T k, E)
    pos = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # place in its expert's queue
    return pos < capacity, pos


def _layer_classes():
    """The EP model's dense modules (RMSNorm, the gated MLP, attention) and its experts' tensors."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, h, eps):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    class MLP(nn.Module):
        def __init__(self, h, width, names=("gate_proj", "up_proj", "down_proj")):
            super().__init__()
            for n, (i, o) in zip(names, ((h, width), (h, width), (width, h))):
                setattr(self, n, nn.Linear(i, o, bias=False))
            self.names = names

        def forward(self, x):
            g, u, dn = (getattr(self, n) for n in self.names)
            return dn(F.silu(g(x)) * u(x))

    class Attention(nn.Module):
        def __init__(self, spec):
            super().__init__()
            h, a, kv, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
            bias = spec.qkv_bias if hasattr(spec, "qkv_bias") else False
            self.a, self.kv, self.d = a, kv, d
            self.q_proj, self.k_proj = nn.Linear(h, a * d, bias=bias), nn.Linear(h, kv * d, bias=bias)
            self.v_proj, self.o_proj = nn.Linear(h, kv * d, bias=bias), nn.Linear(a * d, h, bias=False)

        def forward(self, x):  # x (b, s, h)
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, self.a, self.d).transpose(1, 2)
            k = self.k_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
            v = self.v_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.a)
            return self.o_proj(o.transpose(1, 2).reshape(b, s, self.a * self.d))

    class Experts(nn.Module):
        def __init__(self, n, h, i):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(n, h, i))

    return RMSNorm, MLP, Attention, Experts


def _moe_class(MLP, Experts):
    """The MoE layer of one rank: its router, its experts (`Experts`), the shared expert (an `MLP`) and the
    dispatch, dropless or with a capacity."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MoE(nn.Module):
        """Router (top-k of a softmax, renormalised when k > 1), the rank's experts, the dispatch."""

        def __init__(self, spec, ep_rank: int, ep: int, comm, capacity_factor):
            super().__init__()
            h, E = spec.hidden_size, spec.num_experts
            self.E, self.k, self.El, self.ep, self.ep_rank = E, spec.num_experts_per_tok, E // ep, ep, ep_rank
            self.comm, self.cf = comm, capacity_factor
            self.gate = nn.Linear(h, E, bias=False)
            self.experts = Experts(E // ep, h, spec.moe_intermediate_size)
            self.shared_expert = self.shared_expert_gate = None
            if spec.num_shared_experts:
                w = spec.num_shared_experts * (spec.shared_expert_intermediate_size or spec.moe_intermediate_size)
                self.shared_expert = MLP(h, w)
                if spec.shared_expert_gate:
                    self.shared_expert_gate = nn.Linear(h, 1, bias=False)
            self.shards = 1  # the reference: the batch is `shards` ranks' tokens, each dropped on its own

        def route(self, x):  # x (T, h)
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)  # (T, E)
            w, i = torch.topk(probs, self.k, dim=-1)  # (T, k)
            if self.k > 1:
                w = w / w.sum(dim=-1, keepdim=True)
            return w.to(x.dtype), i

        def forward(self, hidden):  # (b, s, h)
            b, s, h = hidden.shape
            x = hidden.reshape(-1, h)
            w, i = self.route(x)
            if self.shards > 1:  # the reference process: every rank's tokens routed (and dropped) as that rank would
                parts = [self.dispatch(xs, ws, is_) for xs, ws, is_ in
                         zip(x.chunk(self.shards), w.chunk(self.shards), i.chunk(self.shards))]
                y = torch.cat(parts)
            else:
                y = self.dispatch(x, w, i)
            if self.shared_expert is not None:
                sh = self.shared_expert(x)
                if self.shared_expert_gate is not None:
                    sh = torch.sigmoid(self.shared_expert_gate(x)) * sh
                y = y + sh
            return y.view(b, s, h)

        def dispatch(self, x, w, i):
            if self.cf is None:
                return self.dropless(x, w, i)
            return self.capacity(x, w, i)

        def expert(self, e, rows):  # rows (n, h) -> (n, h), the transformers expert: down(act(gate) * up)
            gate, up = F.linear(rows, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.experts.down_proj[e])

        def dropless(self, x, w, i):
            import torch.distributed as dist

            T, k, E, El, ep = x.shape[0], self.k, self.E, self.El, self.ep
            flat = i.reshape(-1)  # (T k,) expert of each choice
            order = torch.argsort(flat, stable=True)  # the choices sorted by expert
            counts = torch.bincount(flat, minlength=E)  # (E,) rows this rank sends to each expert
            if ep > 1:  # every peer's counts for my experts: (ep, El)
                got = torch.empty_like(counts)
                dist.all_to_all_single(got, counts, group=self.comm.group)
                self.comm.counts_sent += (ep - 1) * El * counts.element_size()
            else:
                got = counts
            got = got.view(ep, El)
            send = counts.view(ep, El).sum(1).tolist()
            recv = got.sum(1).tolist()
            rows = x[order.div(k, rounding_mode="floor")]  # (T k, h) the send buffer, sorted by expert
            self.comm.received.append(sum(recv))
            self.comm.kept.append(T * k)
            self.comm.home.append(send[self.ep_rank])
            recv_rows = _A2A.apply(rows, send, recv, self.comm)  # (R, h), by source rank, then expert
            del rows
            # regroup by my expert: source-major -> expert-major
            loc_e = torch.arange(El).repeat(ep).repeat_interleave(got.reshape(-1))
            by_e = torch.argsort(loc_e, stable=True)
            mine = recv_rows[by_e]  # (R, h) expert-major
            del recv_rows
            outs = [self.expert(e, part) for e, part in enumerate(mine.split(got.sum(0).tolist()))]
            out = torch.cat(outs) if outs else mine[:0]
            del outs, mine
            back_in = torch.empty_like(by_e)
            back_in[by_e] = torch.arange(by_e.numel())
            out = out[back_in]  # source-major again
            back = _A2A.apply(out, recv, send, self.comm)  # (T k, h) sorted by expert
            del out
            unsort = torch.empty_like(order)
            unsort[order] = torch.arange(order.numel())
            contrib = back[unsort] * w.reshape(-1, 1)  # (T k, h) in choice order, weighted
            del back
            return contrib.view(T, k, -1).sum(1)

        def capacity(self, x, w, i):
            from .. import moe as _moe

            T, h, k, E, El, ep = x.shape[0], x.shape[1], self.k, self.E, self.El, self.ep
            C = _moe.expert_capacity(T, E, k, self.cf)  # rows per expert buffer, from this rank's tokens
            keep, pos = _capacity_keep(i, E, C)
            kept = keep.nonzero()[:, 0]  # the choices kept (index into T k)
            slot = i.reshape(-1)[kept] * C + pos[kept]  # their rows in the E x C send buffer
            tok = kept.div(k, rounding_mode="floor")
            self.comm.received.append(ep * El * C)
            self.comm.kept.append(kept.numel())
            self.comm.home.append(El * C)
            buf = x.new_zeros(E * C, h).index_copy(0, slot, x[tok])  # (E C, h) zero-padded send buffer
            recv = _A2A.apply(buf, [El * C] * ep, [El * C] * ep, self.comm)  # (ep El C, h): [source][expert][slot]
            del buf
            rows = recv.view(ep, El, C, h).transpose(0, 1).reshape(El, ep * C, h)  # expert-major copy
            del recv
            gate, up = torch.bmm(rows, self.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (El, ep C, 2i)
            out = torch.bmm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2))  # (El, ep C, h)
            del gate, up, rows
            out = out.view(El, ep, C, h).transpose(0, 1).reshape(ep * El * C, h)  # source-major copy
            back = _A2A.apply(out, [El * C] * ep, [El * C] * ep, self.comm)  # (E C, h) my buffer, processed
            del out
            contrib = back[slot] * w.reshape(-1)[kept][:, None]  # (kept, h) weighted
            del back
            return x.new_zeros(T, h).index_add(0, tok, contrib)

    return MoE


def _ep_classes():
    """The EP model's modules: RMSNorm, the dense gated MLP, attention and the MoE layer."""
    RMSNorm, MLP, Attention, Experts = _layer_classes()
    return RMSNorm, MLP, Attention, _moe_class(MLP, Experts)


def _ep_model(spec: ModelSpec, *, ep: int, ep_rank: int, comm, capacity_factor, dev, seed: int = 0):
    """The EP model of one rank (all experts when ep = 1): every tensor of `spec.param_tensors()` in its
    order and shape, the routed experts E/ep of them; the weights drawn from the full model's, the same on
    every rank (the rank keeps its experts' slices)."""
    import torch
    import torch.nn as nn

    RMSNorm, MLP, Attention, MoE = _ep_classes()
    h, eps = spec.hidden_size, 1e-6

    class Block(nn.Module):
        def __init__(self, layer: int):
            super().__init__()
            self.self_attn = Attention(spec)
            if layer in spec.moe_layer_ids:
                self.mlp = MoE(spec, ep_rank, ep, comm, capacity_factor)
            else:
                self.mlp = MLP(h, spec.intermediate_size)
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(spec.vocab_size, h)
            self.layers = nn.ModuleList(Block(i) for i in range(spec.num_layers))
            self.norm = RMSNorm(h, eps)
            self.lm_head = nn.Linear(h, spec.vocab_size, bias=False)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Model()
    model = model.to_empty(device=dev)
    g = torch.Generator().manual_seed(seed)
    El = spec.num_experts // ep
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            if ".experts." in name:  # draw all E experts, keep mine
                full = torch.randn((spec.num_experts, *p.shape[1:]), generator=g) * 0.08
                p.copy_(full[ep_rank * El:(ep_rank + 1) * El])
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model


class _EPZero:
    """ZeRO-1 for EP with `torch.distributed.optim.ZeroRedundancyOptimizer`: the dense parameters' AdamW states
    sharded over the whole world, the experts' over their expert-data-parallel group (two optimizers, stepped
    one after the other; each broadcasts its updated parameters from their owners)."""

    def __init__(self, named, edp_group, lr: float, optimizer_class=None):
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dense = [p for n, p in named if ".experts." not in n]
        experts = [p for n, p in named if ".experts." in n]
        kw = dict(optimizer_class=optimizer_class or torch.optim.AdamW, lr=lr, foreach=True)
        self.zs = [ZeroRedundancyOptimizer(dense, **kw), ZeroRedundancyOptimizer(experts, process_group=edp_group, **kw)]

    def step(self) -> None:
        for z in self.zs:
            z.step()

    @property
    def state(self) -> dict:  # this rank's shard of both
        return {p: st for z in self.zs for p, st in z.optim.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for z in self.zs for g in z.param_groups]


def ep_problem(spec: ModelSpec, ep: int, dp: int, capacity_factor) -> str | None:
    """Why the EP experiment cannot run this layout (None when it can)."""
    if spec.model_type not in ("mixtral", "qwen2_moe"):
        return f"{spec.name}: the EP experiment builds Mixtral- and Qwen2-MoE-shaped models, not {spec.model_type}"
    try:
        EPP.expert_parallel(spec, ep=ep, dp=dp, batch_size=1, seq_len=8, capacity_factor=capacity_factor,
                          precision="fp32", device="cpu")
    except ValueError as e:
        return str(e)
    return None


def _ep_loss(logits, ids):
    return lm_loss(logits, ids)


def _run_ep(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    global _A2A
    _A2A = _a2a_function()
    spec, b, s, ep, cf = ep_model_spec(args.model), args.micro_batch, args.seq, args.ep, args.capacity_factor
    dp = world
    El = spec.num_experts // ep
    # groups: EP = ep consecutive ranks; expert-data-parallel = the ranks holding the same experts
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(dp // ep)]
    edp_groups = [dist.new_group(list(range(j, dp, ep))) for j in range(ep)]
    comm = _EPComm(ep_groups[rank // ep], ep, rank % ep)
    edp = edp_groups[rank % ep]
    # the rank's own sequences (a copy: the measured step holds only these); the check trains on every rank's
    ids = token_batch(spec, b * dp, s, dev)[rank * b:(rank + 1) * b].clone()

    def expert_param(name: str) -> bool:
        return ".experts." in name

    def sync(model):  # gradients: dense over the world, experts over their edp group, both / dp
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=edp if expert_param(name) else None)
            p.grad.div_(dp)

    # 1. a steady-state step, measured (first: nothing of the check below is alive)
    model = _ep_model(spec, ep=ep, ep_rank=rank % ep, comm=comm, capacity_factor=cf, dev=dev)
    params = list(model.parameters())
    opt = _EPZero(list(model.named_parameters()), edp, 1e-4) if args.zero else adamw(params, True)
    steady(opt, params)
    names = [n for n, _ in model.named_parameters()]

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        phase("forward")
        logits = model(ids)
        phase("loss")
        loss = _ep_loss(logits, ids)
        del logits
        if tr:
            tr.mark("forward end")
        phase("backward")
        loss.backward()
        sync(model)
        phase("optimizer")
        opt.step()
        zero_grads(opt)
        phase("after step")

    step()
    comm.reset()
    memory = ledger_step(step, [model], opt, [ids])
    # 2. one step against one process with all experts on every rank's tokens (same drops)
    ids_all = token_batch(spec, b * dp, s, dev)
    ref = _ep_model(spec, ep=1, ep_rank=0, comm=_EPComm(), capacity_factor=cf, dev=dev)
    for m in ref.modules():
        if hasattr(m, "shards"):
            m.shards = dp
    check_comm = _EPComm(comm.group, ep, rank % ep)
    model_c = _ep_model(spec, ep=ep, ep_rank=rank % ep, comm=check_comm, capacity_factor=cf, dev=dev)
    # SGD for this check: Adam's first step is lr x sign(g), which turns float noise in a gradient that is zero in
    # exact arithmetic (a key bias: softmax ignores it) into a full step
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    opt_c = _EPZero(list(model_c.named_parameters()), edp, 0.1, torch.optim.SGD) if args.zero else \
        torch.optim.SGD(model_c.parameters(), lr=0.1, foreach=True)
    # the reference's loss: the mean of the dp ranks' mean losses (each rank's own sequences)
    logits_ref = ref(ids_all)
    sum(_ep_loss(logits_ref[r * b:(r + 1) * b], ids_all[r * b:(r + 1) * b]) for r in range(dp)).div(dp).backward()
    _ep_loss(model_c(ids), ids).backward()
    sync(model_c)
    opt_ref.step()
    opt_c.step()
    lo, hi = (rank % ep) * El, (rank % ep + 1) * El
    worst, worst_name = 0.0, ""
    mine = dict(model_c.named_parameters())
    for name, q in ref.named_parameters():
        p = mine[name]
        want = q[lo:hi] if expert_param(name) else q
        rel = ((p - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    del ref, model_c, opt_c, opt_ref, logits_ref, mine, p, q, want, ids_all
    by = {"dense": 0, "experts": 0}
    opt_by = {"dense": 0, "experts": 0}
    for n, p in zip(names, params):
        key = "experts" if expert_param(n) else "dense"
        by[key] += p.untyped_storage().nbytes()
        opt_by[key] += sum(v.untyped_storage().nbytes() for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    grads = sum(p.grad.untyped_storage().nbytes() for p in params)
    moe_layers = len(spec.moe_layer_ids)
    return {"rank": rank, "param_max_rel_diff": worst, "param_worst": worst_name, "memory": memory,
            "states": {"parameters": by, "gradients": grads, "optimizer_states": opt_by},
            "sent_per_layer": {k: v // moe_layers for k, v in comm.sent.items()},
            "a2a_calls": dict(comm.calls), "counts_sent": comm.counts_sent,
            "sent_total": dict(comm.sent), "received_rows": comm.received[-moe_layers:],
            "kept_rows": comm.kept[-moe_layers:], "home_rows": comm.home[-moe_layers:]}


def ep_prediction(spec: ModelSpec, *, ep: int, dp: int, batch_size: int, seq_len: int,
                  capacity_factor=None, received_rows=None, kept_rows=None, home_rows=None, zero: int = 0,
                  rank: int = 0) -> dict[str, Any]:
    """What `vramlab.expert_parallel.expert_parallel` predicts for one rank of this experiment (fp32, CPU, AdamW),
    given the rows the rank's router really sent it (dropless routing depends on the data)."""
    return EPP.expert_parallel(spec, ep=ep, dp=dp, batch_size=batch_size, seq_len=seq_len,
                             capacity_factor=capacity_factor, precision="fp32", device="cpu",
                             received_rows=received_rows, kept_rows=kept_rows, home_rows=home_rows, zero_stage=zero,
                             zero_partition="greedy", rank=rank)


def ep_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank: states, the peak and the all-to-all bytes against the prediction. Dropless, the
    bytes a rank sends depend on its router: the prediction is checked on the rank's own counts."""
    spec = ep_model_spec(result["model_name"])
    out = []
    for r in result["per_rank"]:
        pred = ep_prediction(spec, ep=result["ep"], dp=result["ranks"], batch_size=result["micro_batch_size"],
                             seq_len=result["seq_len"], capacity_factor=result["capacity_factor"],
                             received_rows=tuple(r["received_rows"]), kept_rows=tuple(r["kept_rows"]),
                             home_rows=tuple(r["home_rows"]), zero=result.get("zero", 0), rank=r["rank"])
        mem = r["memory"]
        row = {"rank": r["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
               "predicted": pred["peak"], "predicted_phase": pred["peak_phase"],
               "error": error(pred["peak"], mem["peak"]), "param_max_rel_diff": r["param_max_rel_diff"],
               "sent_forward": r["sent_per_layer"]["forward"], "sent_backward": r["sent_per_layer"]["backward"]}
        row["predicted_sent_forward"] = pred["sent_per_layer"]["forward"]
        row["predicted_sent_backward"] = pred["sent_per_layer"]["backward"]
        out.append(row)
    return out


def _ep_report(ranks: list[dict], args, world: int) -> None:
    from ..units import fmt_bytes
    from .record import provenance

    out = {"experiment": "ep", "backend": "gloo", "ranks": world, "ep": args.ep, "model": EP_MODELS[args.model][1],
           "model_name": args.model, "micro_batch_size": args.micro_batch, "seq_len": args.seq,
           "capacity_factor": args.capacity_factor, "precision": "fp32", "zero": args.zero,
           "optimizer": "AdamW foreach" + (", ZeRO-1: ZeroRedundancyOptimizer, dense over the world, experts over edp"
                                           if args.zero else ", ZeRO 0"),
           "command": " ".join([PROG, *sys.argv[1:]]), "provenance": provenance("cpu"), "per_rank": ranks}
    out["rows"] = ep_rows(out)
    print(f"# vramlab.measure.parallel ep: ep {args.ep} x dp {world}, gloo, {args.model}, batch {args.micro_batch} x "
          f"{args.seq}, " + ("dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"))
    print(f"#{'rank':>5}{'predicted':>12}{'measured':>12}{'error':>8}  {'phase':<10}{'sent fwd':>11}{'params':>10}")
    for r in out["rows"]:
        print(f" {r['rank']:>5}{fmt_bytes(r['predicted']):>12}{fmt_bytes(r['measured']):>12}{100 * r['error']:>+7.1f}%"
              f"  {r['measured_phase']:<10}{fmt_bytes(r['sent_forward']):>11}{r['param_max_rel_diff']:>10.1e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def _worker(rank: int, world: int, args, port: int) -> None:
    """One EP rank (started by `collectives.launch`, by reference: a module-level function)."""
    run_rank(rank, world, args, port, _run_ep, _ep_report)


def ep_main(argv: list[str]) -> int:
    """`python -m vramlab.measure.parallel ep ...`: expert parallelism on gloo ranks."""
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=f"{PROG} ep", description="Expert parallelism (all-to-all dispatch) on gloo ranks, "
                                                      "measured per rank against vramlab.expert_parallel.expert_parallel.")
    p.add_argument("--ep", type=A(whole, int, lo=1, hi=64), default=2, help="expert-parallel ranks (default 2)")
    p.add_argument("--dp", type=A(whole, int, lo=1, hi=64), default=2, help="data-parallel ranks = processes (default 2)")
    p.add_argument("--model", default="ep-mixtral", choices=list(EP_MODELS))
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=2, help="sequences per rank (default 2)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=64, help="tokens per sequence (default 64)")
    p.add_argument("--capacity-factor", type=A(checks.positive, float, hi=1024), default=None,
                   help="route with a capacity (fixed E x C buffers, drops); default dropless")
    p.add_argument("--zero", type=int, choices=(0, 1), default=0,
                   help="1: ZeroRedundancyOptimizer, dense states over all ranks, expert states over edp")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0)
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0)
    args = p.parse_args(argv)
    args.backend, args.experiment, args.nproc = "gloo", "ep", args.dp
    spec = ep_model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    why = ep_problem(spec, args.ep, args.dp, args.capacity_factor)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=f"{PROG} ep", error=ParlabError, torchrun_port=29514, preload=RANK_IMPORTS)


# the campaign stored in benchmarks/results/expert_parallel/cpu.json: ep 2 and 4 (dp 4 with ep 2: edp = 2), top-1
# and top-2, dropless and capacity factors 1.0 and 1.5, 1 and 2 experts per rank, a shared expert and a dense
# first layer (ep-qwen2), several shapes
EP_CAMPAIGN: tuple[dict[str, Any], ...] = (
    dict(model="ep-mixtral", ep=2, dp=2, micro_batch=2, seq=64),
    dict(model="ep-mixtral", ep=4, dp=4, micro_batch=2, seq=64, capacity_factor=1.0),
    dict(model="ep-mixtral", ep=2, dp=4, micro_batch=2, seq=96, capacity_factor=1.5),
    dict(model="ep-mixtral8", ep=4, dp=4, micro_batch=1, seq=128),
    dict(model="ep-switch8", ep=4, dp=4, micro_batch=2, seq=64, capacity_factor=1.5),
    dict(model="ep-switch8", ep=2, dp=2, micro_batch=2, seq=128),
    dict(model="ep-qwen2", ep=2, dp=2, micro_batch=2, seq=96),
    dict(model="ep-qwen2", ep=2, dp=4, micro_batch=2, seq=64, capacity_factor=1.0),
    dict(model="ep-qwen2", ep=2, dp=4, micro_batch=1, seq=64, zero=1),
    dict(model="ep-mixtral8", ep=2, dp=2, micro_batch=2, seq=64, capacity_factor=1.5, zero=1),
)


def ep_argv(config: dict[str, Any], out: str) -> list[str]:
    argv = ["ep", "--model", config["model"], "--ep", str(config["ep"]), "--dp", str(config["dp"]),
            "--micro-batch", str(config["micro_batch"]), "--seq", str(config["seq"]), "--out", out]
    return argv + (["--capacity-factor", str(config["capacity_factor"])] if config.get("capacity_factor") else []) \
        + (["--zero", "1"] if config.get("zero") else [])


def run_ep(config: dict[str, Any], *, timeout: float = 600) -> dict[str, Any]:
    """One EP run in a subprocess, its results read back (`run_in_subprocess`)."""
    return run_in_subprocess(ep_argv, config, timeout)


def ep_campaign(path: str, configs=EP_CAMPAIGN) -> dict[str, Any]:
    """Run every configuration and store them, with each row's error, in one JSON file at `path`."""
    return campaign(path, configs, run_ep, str, name="ep_campaign", module=__name__,
                     what="expert parallelism on gloo ranks (CPU): each rank's states, peak through a steady-state "
                          "training step (the ledger) and the bytes its all-to-alls sent per MoE layer, against "
                          "vramlab.expert_parallel.expert_parallel")
