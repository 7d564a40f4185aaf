"""Context parallelism, measured on gloo ranks (`python -m vramlab.measure.parallel cp --method ring|ulysses
--nproc 2|4`, `cp_main`): the sequence split over cp ranks, each rank running the whole model on its own
tokens. Attention is replaced (a registered transformers attention function, this process only) by

- ring attention (Liu et al. 2023; Megatron-LM's context parallelism): each rank's K/V block travels
  round the ring (P2P send/recv, the next block received while the current one is attended to), the
  partial outputs merged by their log-sum-exp (online softmax); in the backward K/V travel again, with
  their gradient accumulators, which come home after cp steps. Zig-zag: rank r holds sequence chunks r
  and 2cp-1-r (`context_parallel.cp_positions`), so every rank does the same causal work;
- Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded q, k,
  v, full-sequence causal attention on heads/cp heads, all-to-all of the output back.

Each rank's outputs and (all-reduced) gradients are checked against one process on the whole sequence,
its peak through a steady-state training step is measured with the ledger (`ledger.Ledger`), and the bytes
each attention sends are counted, against `vramlab.context_parallel.context_parallel` (`cp_rows`).
`--fsdp`: the model states sharded over the CP ranks too (torchtitan's dp_shard x cp mesh): FSDP2's
`fully_shard` of every block, then of the root (a module running the loss), fp32; its gradients gathered
whole are checked against one process, the ledger sees its in-place storage resizes (`ledger.track_resizes`),
and each rank's shards are counted in storage bytes (`shard_states=True` of the calculator).

The campaign stored in benchmarks/results/context_parallel/cpu.json: `CP_CAMPAIGN`, `cp_campaign`. Imports
torch inside its functions.
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import Any

from .. import checks
from .. import context_parallel as CPP
from ..memory import LOSSES, loss_chunk_size
from ..specs import ModelSpec, from_config
from . import ledger
from .ledger import ledger_step, track_resizes
from .ranks import (MODELS, PROG, RANK_IMPORTS, ParlabError, adamw, campaign, error, model_spec, run_in_subprocess,
                    run_rank, seeded_model, steady, storage_bytes, token_batch, zero_grads)


CP_METHODS = ("ring", "ulysses")
CP_ATTENTION = "vramlab_cp"  # the name the attention function is registered under


# a model for CP only: attention-heavy (an MLP as narrow as the model, 4 key/value heads, 1024 positions), so
# that the moments inside attention, where CP's blocks are in flight, are the step's peak
CP_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "cp-val": ("llama-cp-val", dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                                    max_position_embeddings=1024, tie_word_embeddings=False)),
}


def cp_model_spec(name: str) -> ModelSpec:
    """A model the CP experiment runs: `CP_MODELS`' or a Llama of `MODELS`."""
    if name in CP_MODELS:
        label, cfg = CP_MODELS[name]
        return from_config(cfg, name=label)
    return model_spec(name)


class _CPState:
    """What the replaced attention needs on this rank, and the bytes it sent (forward, backward)."""

    def __init__(self, method: str, rank: int, cp: int, zigzag: bool):
        self.method, self.rank, self.cp, self.zigzag = method, rank, cp, zigzag
        self.sent = {"forward": 0, "backward": 0, "recompute": 0}
        self.messages = {"forward": 0, "backward": 0, "recompute": 0}


_CP: _CPState | None = None


def _forward_kind() -> str:
    """'recompute' for a forward that runs inside the backward (activation checkpointing re-runs the block),
    else 'forward'."""
    import torch

    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def _cp_phase(name: str):
    """Name the ledger's phase while CP's attention runs (its peak there is reported as that phase's), then
    restore the step's."""
    led = ledger.LEDGER
    before = led.phase if led is not None else None
    if led is not None:
        led.set_phase(name)
    try:
        yield
    finally:
        if led is not None:
            led.set_phase(before)


def _ring_block(rank: int, src: int, n: int, zigzag: bool):
    """Which of this rank's query rows attend to which of `src`'s key columns, and whether causally
    (None: none). Zig-zag, rank r holding chunks r and 2cp-1-r: its own block is causal over its n tokens
    (chunk r precedes chunk 2cp-1-r); an earlier rank's first chunk is seen by all rows, its second by none;
    a later rank's two chunks are seen by the second half of the rows only. Contiguous: earlier ranks whole."""
    if src == rank:
        return slice(None), slice(None), True
    if not zigzag:
        return (slice(None), slice(None), False) if src < rank else None
    half = n // 2
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


# Gloo runs a collective on a worker thread, whose reference to the collective's tensors (its Work's) can
# outlive the wait by a thread switch: a buffer the rank drops right after the collective was then freed on
# that thread after the rank had allocated more, and a peak came and went with thread timing (FSDP2's
# gathered block at once with the next one, +4 % one run in five; a Ulysses all-to-all buffer, +3 %). NCCL's
# buffers go back to the caching allocator on the rank's own stream order. So FSDP2's collectives and Ulysses'
# all-to-alls wait, after their wait, until the worker has let go (the tensors' use counts back to what they
# were before): frees happen where the program means them, the same peak every run (20 runs each). Left
# alone: the ring's point-to-point buffers (gloo keeps a reference to a receive buffer past its Work, so a
# use count never comes back; the ring's peaks were the same in every run seen) and EP's all-to-alls (within
# 5 % in every run so far; the same race could reach them).
_GLOO_UNSETTLED = [0]  # collectives whose tensors gloo still held after 60 s (reported; stays 0)


def _use_counts(tensors) -> list[int]:
    return [t._use_count() for t in tensors]


def _settle(tensors, before: list[int]) -> None:
    """Wait until gloo's worker has dropped a finished collective's references to `tensors` (use counts back to
    `before`, read before the collective started); at most 60 s, then counted in `_GLOO_UNSETTLED` (the worker
    lets go within a thread switch, microseconds; the bound is for a machine so busy it never switches, not a
    budget a busy machine could miss)."""
    import time

    deadline = time.monotonic() + 60.0
    while any(t._use_count() > n for t, n in zip(tensors, before)):
        if time.monotonic() > deadline:
            _GLOO_UNSETTLED[0] += 1
            return
        time.sleep(1e-5)


def _rotate(tensors, st: _CPState, phase: str):
    """Send `tensors` to the next rank and receive as many from the previous one (new buffers); returns
    (received, requests to wait on)."""
    import torch
    import torch.distributed as dist

    nxt, prev = (st.rank + 1) % st.cp, (st.rank - 1) % st.cp
    got = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt) for t in tensors] + [dist.P2POp(dist.irecv, g, prev) for g in got]
    st.sent[phase] += sum(t.numel() * t.element_size() for t in tensors)
    st.messages[phase] += len(tensors)
    return got, dist.batch_isend_irecv(ops)


_CP_FUNCTIONS: dict[str, Any] = {}  # the autograd functions, defined once per process (they import torch)


def _ring_function():
    if "ring" in _CP_FUNCTIONS:
        return _CP_FUNCTIONS["ring"]
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    class RingAttention(torch.autograd.Function):
        """Causal ring attention over the CP group. Saves what a flash kernel saves on one device (q, k, v
        at the key/value heads, the output, the log-sum-exp), at the rank's tokens."""

        @staticmethod
        def forward(ctx, q, k, v, scale):
            st = _CP
            with _cp_phase("attention forward"):
                return RingAttention._forward(ctx, q, k, v, scale, st)

        @staticmethod
        def _forward(ctx, q, k, v, scale, st):
            k, v = k.contiguous(), v.contiguous()
            n = q.shape[2]
            out = lse = None
            cur, reqs = (k, v), []
            for i in range(st.cp):
                src = (st.rank - i) % st.cp
                nxt = None
                if i < st.cp - 1:  # the next block is received while this one is attended to
                    nxt, reqs = _rotate(cur, st, _forward_kind())
                blk = _ring_block(st.rank, src, n, st.zigzag)
                if blk is not None:
                    rows, cols, causal = blk
                    o, l = flash(q[:, :, rows], cur[0][:, :, cols], cur[1][:, :, cols], 0.0, causal, scale=scale)
                    if out is None:  # the rank's own block comes first and covers every row
                        out, lse = o, l
                    else:
                        old_l, old_o = lse[:, :, rows], out[:, :, rows]
                        new = torch.logaddexp(old_l, l)
                        merged = old_o * torch.exp(old_l - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
                        out[:, :, rows] = merged
                        lse[:, :, rows] = new
                        del o, l, old_l, old_o, new, merged
                for r in reqs:
                    r.wait()
                if nxt is not None:
                    cur = tuple(nxt)
                reqs = []
            del cur
            ctx.scale = scale
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            with _cp_phase("attention backward"):
                return RingAttention._backward(ctx, dout, _CP)

        @staticmethod
        def _backward(ctx, dout, st):
            q, k, v, out, lse = ctx.saved_tensors
            n = q.shape[2]
            dq = torch.zeros_like(q)
            cur = (k, v)
            acc = (torch.zeros_like(k), torch.zeros_like(v))
            for i in range(st.cp):
                src = (st.rank - i) % st.cp
                nxt, reqs = (None, [])
                if i < st.cp - 1:
                    nxt, reqs = _rotate(cur, st, "backward")
                blk = _ring_block(st.rank, src, n, st.zigzag)
                if blk is not None:
                    rows, cols, causal = blk
                    gq, gk, gv = flash_backward(dout[:, :, rows], q[:, :, rows], cur[0][:, :, cols],
                                                cur[1][:, :, cols], out[:, :, rows], lse[:, :, rows], 0.0, causal,
                                                scale=ctx.scale)
                    dq[:, :, rows] += gq
                    acc[0][:, :, cols] += gk
                    acc[1][:, :, cols] += gv
                    del gq, gk, gv
                # the block's gradient travels with it; after cp steps each rank's comes home
                back, reqs2 = _rotate(acc, st, "backward")
                for r in reqs + reqs2:
                    r.wait()
                acc = tuple(back)
                if nxt is not None:
                    cur = tuple(nxt)
            return dq, acc[0], acc[1], None

    _CP_FUNCTIONS["ring"] = RingAttention
    return RingAttention


def _a2a(x, to_heads: bool, phase: str):
    """Ulysses' all-to-all on (b, heads, tokens, d): sequence-sharded (all heads, the rank's tokens) to
    head-sharded (heads/cp, the whole sequence), or back (`to_heads=False`; the result laid out
    (b, tokens, heads, d) in memory, a transposed view, as the projection after attention reads it)."""
    import torch
    import torch.distributed as dist

    st = _CP
    cp = st.cp
    b, H, n, d = x.shape
    if to_heads:
        send = x.reshape(b, cp, H // cp, n, d).permute(1, 0, 2, 3, 4).contiguous()
    else:
        send = x.reshape(b, H, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    before = _use_counts([got, send])
    dist.all_to_all_single(got, send)
    _settle([got, send], before)
    st.sent[phase] += send.numel() * send.element_size() * (cp - 1) // cp  # its own chunk stays
    st.messages[phase] += cp - 1
    del send
    c, b, h, m, d = got.shape  # got[j]: rank j's part
    if to_heads:  # got[j] = rank j's tokens of this rank's heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, h, c * m, d)
    # got[j] = this rank's tokens of rank j's heads -> (b, m, c, h, d) in memory
    return got.permute(1, 3, 0, 2, 4).reshape(b, m, c * h, d).transpose(1, 2)


def _ulysses_function():
    if "ulysses" in _CP_FUNCTIONS:
        return _CP_FUNCTIONS["ulysses"]
    import torch

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, to_heads):
            ctx.to_heads = to_heads
            return _a2a(x, to_heads, _forward_kind())

        @staticmethod
        def backward(ctx, g):
            return _a2a(g, not ctx.to_heads, "backward"), None

    _CP_FUNCTIONS["ulysses"] = AllToAll
    return AllToAll


def _cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The transformers attention function CP models run: (b, heads, tokens, d) in, (b, tokens, heads, d) out."""
    import torch.nn.functional as F

    st = _CP
    if st.method == "ring":
        out = _ring_function().apply(query, key, value, scaling)
    else:
        a2a = _ulysses_function()
        with _cp_phase("attention forward"):
            q, k, v = (a2a.apply(t, True) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            del q, k, v
            out = a2a.apply(o, False)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """No mask: the CP attention applies causality by global positions itself."""
    return None


def _register_cp() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CP_ATTENTION, _no_mask)


def cp_problem(spec: ModelSpec, cp: int, method: str, seq: int, zigzag: bool = True) -> str | None:
    """Why `spec` cannot run `method` over cp ranks at `seq` tokens here (None when it can)."""
    if spec.family != "llama":
        return f"{spec.name}: the CP experiment replaces Llama-family attention only, not {spec.family}'s"
    try:
        CPP.context_parallel(spec, cp=cp, method=method, batch_size=1, seq_len=seq, precision="fp32",
                           device="cpu", zigzag=zigzag)
    except ValueError as e:
        return str(e)
    return None


def _cp_loss(logits, labels, count: int):
    """The rank's share of the whole sequence's mean next-token loss: its tokens' sum over all tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum") / count


def _cp_step_loss(model, mine, pos, labels, count: int, loss: str, chunk: int):
    """The rank's share of the mean loss, by the loss's implementation: the whole one (the LM head's logits,
    then cross-entropy), torchtune's chunked loss (the head on each chunk of `chunk` tokens, each chunk's
    logits upcast and reduced) or Liger's fused linear cross-entropy (`measure.memory`), on the rank's tokens
    with the targets already shifted over the whole sequence."""
    import torch.nn.functional as F

    from .memory import FusedLinearCrossEntropy

    if loss == "whole":
        logits = model(input_ids=mine, position_ids=pos[None]).logits
        out = _cp_loss(logits, labels, count)
        del logits
        return out
    hidden = model.model(input_ids=mine, position_ids=pos[None])[0]
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    head = model.get_output_embeddings()
    if loss == "chunked":
        logits = [F.linear(x, head.weight) for x in flat.split(chunk)]
        total = 0.0
        for z, y in zip(logits, targets.split(chunk)):
            total = total + F.cross_entropy(z.float(), y, ignore_index=-100, reduction="sum")
        del logits
        return total / count
    mean = FusedLinearCrossEntropy.apply(flat, head.weight, targets, chunk)  # over the rank's valid targets
    return mean * (int((targets != -100).sum()) / count)


def _run_cp(rank: int, world: int, args, dev) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        return _run_cp_in(rank, world, args, dev, stack)


def _run_cp_in(rank: int, world: int, args, dev, stack) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    global _CP
    spec, b, s = cp_model_spec(args.model), args.micro_batch, args.seq
    why = cp_problem(spec, world, args.method, s, args.zigzag)
    if why:
        raise ParlabError(why)
    _register_cp()
    _CP = _CPState(args.method, rank, world, args.zigzag)
    zig = args.zigzag and args.method == "ring"  # Ulysses gathers the whole sequence: contiguous shards
    pos = torch.tensor(CPP.cp_positions(s, world, rank, zigzag=zig), device=dev)
    batch = token_batch(spec, b, s, dev)  # the same sequences on every rank: CP splits them, not the batch
    labels_all = F.pad(batch, (0, 1), value=-100)[:, 1:]
    count = int((labels_all != -100).sum())
    mine = batch[:, pos]
    # 1. outputs and gradients against one process on the whole sequence
    recompute = getattr(args, "recompute", "none") == "full"

    def checkpointed(m):  # every block re-run in its backward (torch.utils.checkpoint, non-reentrant)
        if recompute:
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    ref = seeded_model(spec, dev)
    model = checkpointed(seeded_model(spec, dev))
    model.config._attn_implementation = CP_ATTENTION
    logits_ref = ref(batch).logits
    _cp_loss(logits_ref, labels_all, count).backward()
    logits = model(input_ids=mine, position_ids=pos[None]).logits
    _cp_loss(logits, labels_all[:, pos], count).backward()
    want = logits_ref.detach()[:, pos]
    out_rel = ((logits.detach() - want).abs().max() / want.abs().max()).item()
    floor = 1e-6 * max(q.grad.abs().max().item() for q in ref.parameters())
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(max(floor, 1e-30))).item())
    ref_grads = [q.grad.detach().clone() for q in ref.parameters()] if getattr(args, "fsdp", False) else []
    del ref, model, logits, logits_ref, want, g, p, q  # (p, q: the last parameters of both models)
    gc.collect()
    # 2. a steady-state step: forward and backward on the rank's tokens, gradients all-reduced over the group
    #    (or, --fsdp, the model states sharded over it by FSDP2 and the gradients reduce-scattered)
    shard = getattr(args, "fsdp", False)
    model = checkpointed(seeded_model(spec, dev))
    model.config._attn_implementation = CP_ATTENTION
    loss_kind = getattr(args, "loss", "whole")
    chunk = loss_chunk_size(spec, tokens=b * len(pos), loss=loss_kind, loss_chunk_tokens=getattr(args, "loss_chunk", None))
    runner = _cp_loss_module_class()(model, loss_kind, chunk, count)
    shard_check = None
    if shard:
        stack.enter_context(track_resizes(ledger.LEDGER))  # FSDP2 frees and reallocates its gathered parameters so
        _cp_fully_shard(runner, world)
        shard_check = _cp_fsdp_check(runner, ref_grads, mine, pos, labels_all[:, pos], world)
    del ref_grads
    gc.collect()
    params = list(model.parameters())
    opt = adamw(params, args.foreach)
    if not shard:
        steady(opt, params)

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        phase("forward")
        loss = runner(mine, pos, labels_all[:, pos])
        if tr:
            tr.mark("forward end")
        phase("backward")
        loss.backward()
        del loss
        if not shard:
            for p in params:
                dist.all_reduce(p.grad)
        phase("optimizer")
        opt.step()
        if shard:  # FSDP2's recipe: nothing of the gradients between steps
            opt.zero_grad(set_to_none=True)
        else:
            zero_grads(opt)
        phase("after step")

    step()
    step()
    _CP.sent = {"forward": 0, "backward": 0, "recompute": 0}
    _CP.messages = {"forward": 0, "backward": 0, "recompute": 0}
    memory = ledger_step(step, [model], opt, [batch, pos, labels_all])
    sent = {k: v // spec.num_layers for k, v in _CP.sent.items()}
    messages = {k: v // spec.num_layers for k, v in _CP.messages.items()}
    out = {"rank": rank, "logits_max_rel_diff": out_rel, "grad_max_rel_diff": worst,
           "memory": memory, "sent_per_layer": sent, "messages_per_layer": messages,
           "gloo_unsettled": _GLOO_UNSETTLED[0],
           "positions": [int(x) for x in pos]}
    if shard:
        out |= {"fsdp_grad_max_rel_diff": shard_check, "states": _cp_state_bytes(model, opt)}
    return out


def _cp_loss_module_class():
    import torch

    class CPLoss(torch.nn.Module):
        """The rank's loss as one module (`_cp_step_loss`), so that FSDP2's root unit (embeddings, final norm,
        LM head) is gathered by its own forward whatever the loss reads (the chunked and fused losses call the
        head outside the model's forward)."""

        def __init__(self, model, loss: str, chunk: int, count: int):
            super().__init__()
            self.model, self.loss, self.chunk, self.count = model, loss, chunk, count

        def forward(self, mine, pos, labels):
            return _cp_step_loss(self.model, mine, pos, labels, self.count, self.loss, self.chunk)

    return CPLoss


def _cp_fully_shard(runner, world: int) -> None:
    """FSDP2 over the CP group (the whole world here): `fully_shard` on every decoder block, then on the root
    (embeddings, final norm, LM head), fp32, as torchtitan's dp_shard x cp mesh shards states over the CP ranks.
    FSDP2 averages the reduce-scattered gradients (gloo has no PREMUL_SUM: it divides in place, no memory of its
    own), so each rank holds 1/cp of the sum over the ranks' losses (each its share of the whole mean)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    gather, scatter = _cp_fsdp_comms()
    for unit in [*runner.model.model.layers, runner]:
        fully_shard(unit, mesh=mesh)
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)


def _cp_fsdp_comms():
    """FSDP2's all-gather and reduce-scatter with a GPU's memory on gloo, so that a rank's peak is the same
    every run: each collective settled before FSDP2 goes on (`_settle`: FSDP2 frees its buffers where it means
    to), and the reduce-scatter an in-place all-reduce of FSDP2's input with this rank's chunk copied to its
    output -- gloo's own reduce-scatter copies the whole input into a storage of its own (NCCL does not), freed
    on gloo's thread (+8 % one run in four). FSDP2's two buffers, nothing else, the same sums. An asynchronous
    call still returns a Work (completed), so that FSDP2 keeps its asynchronous bookkeeping. (Twice a
    reduce-scatter's bytes are sent; the bytes counted here are attention's.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class Done(dist.Work):
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

    def released(run, tensors, async_op):
        before = _use_counts(tensors)
        run()
        _settle(tensors, before)
        return Done() if async_op else None

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return released(lambda: dist.all_gather_into_tensor(output_tensor, input_tensor, group=group),
                            [output_tensor, input_tensor], async_op)

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            def run():
                dist.all_reduce(input_tensor, op=op, group=group)
                output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
            return released(run, [output_tensor, input_tensor], async_op)

    return AllGather(), ReduceScatter()


def _cp_fsdp_check(runner, ref_grads: list, mine, pos, labels, world: int) -> float:
    """One more forward and backward of the FSDP2 model; its gradients (gathered whole from the shards, times
    cp: FSDP2 averages) against one process on the whole sequence: the largest relative difference."""
    runner(mine, pos, labels).backward()
    worst = 0.0
    floor = 1e-6 * max(g.abs().max().item() for g in ref_grads)
    for p, want in zip(runner.model.parameters(), ref_grads):
        got = p.grad.full_tensor() * world
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(max(floor, 1e-30))).item())
    runner.zero_grad(set_to_none=True)
    return worst


def _cp_state_bytes(model, opt) -> dict[str, int]:
    """This rank's parameter shards and optimizer states, in bytes of storage (the states are checked exactly)."""
    seen: set = set()
    params = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    states = [getattr(v, "_local_tensor", v) for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    return {"parameters": storage_bytes(params, seen), "optimizer_states": storage_bytes(states, seen)}


def cp_prediction(spec: ModelSpec, *, cp: int, method: str, batch_size: int, seq_len: int, zigzag: bool = True,
                  foreach: bool = True, recompute: str = "none", loss: str = "whole",
                  loss_chunk: int | None = None, fsdp: bool = False) -> dict[str, Any]:
    """What `vramlab.parallel` predicts for one rank of a CP run (fp32 on the CPU, AdamW; `fsdp`: the states
    sharded over the CP ranks, `shard_states`)."""
    return CPP.context_parallel(spec, cp=cp, method=method, batch_size=batch_size, seq_len=seq_len, precision="fp32",
                              device="cpu", zigzag=zigzag, optimizer_impl="foreach" if foreach else "for-loop",
                              recompute=recompute, loss=loss, loss_chunk_tokens=loss_chunk, shard_states=fsdp)


def cp_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank: measured peak against the prediction, bytes sent per layer against it."""
    spec = cp_model_spec(result["model_name"])
    recompute = result.get("recompute", "none")  # (runs stored before recompute and the loss were options)
    pred = cp_prediction(spec, cp=result["ranks"], method=result["method"], batch_size=result["micro_batch_size"],
                         seq_len=result["seq_len"], zigzag=result["zigzag"], foreach=result["foreach"],
                         recompute=recompute, loss=result.get("loss", "whole"), loss_chunk=result.get("loss_chunk"),
                         fsdp=result.get("fsdp", False))
    block = "the recomputed last block" if recompute == "full" else "the last block"
    # the calculator's in-flight moments are the busiest rank's (zig-zag ranks differ in which rows a step updates)
    busiest = {ph: max(r["memory"]["phases"][ph]["peak"] for r in result["per_rank"] if ph in r["memory"]["phases"])
               for ph in ("attention forward", "attention backward")
               if any(ph in r["memory"]["phases"] for r in result["per_rank"])}
    out = []
    for r in result["per_rank"]:
        mem = r["memory"]
        out.append({"rank": r["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
                    "predicted": pred["peak"], "predicted_phase": pred["peak_phase"],
                    "error": error(pred["peak"], mem["peak"]),
                    "sent_forward": r["sent_per_layer"]["forward"], "sent_backward": r["sent_per_layer"]["backward"],
                    "predicted_sent_forward": pred["sent_per_layer"]["forward"],
                    "predicted_sent_backward": pred["sent_per_layer"]["backward"],
                    "sent_recompute": r["sent_per_layer"].get("recompute", 0),
                    "predicted_sent_recompute": pred["sent_per_layer"]["recompute"],
                    "logits_max_rel_diff": r["logits_max_rel_diff"], "grad_max_rel_diff": r["grad_max_rel_diff"]})
        if "states" in r:  # --fsdp: the rank's shards and optimizer states, storage bytes, against the calculator's
            out[-1] |= {"states_measured": r["states"],
                        "states_predicted": {k: pred["states"][k] for k in ("parameters", "optimizer_states")},
                        "fsdp_grad_max_rel_diff": r["fsdp_grad_max_rel_diff"]}
        # the peaks inside CP's attention (the last block's, where the most is alive) against those moments
        for phase in ("attention forward", "attention backward"):
            got, want = mem["phases"].get(phase), pred["moments"].get(f"{phase} of {block}")
            if got is not None and want is not None:
                key = phase.replace(" ", "_")
                out[-1] |= {f"{key}_measured": got["peak"], f"{key}_busiest_rank": busiest[phase],
                            f"{key}_predicted": want, f"{key}_error": error(want, busiest[phase])}
    return out


def _cp_report(ranks: list[dict], args, world: int) -> None:
    from ..units import fmt_bytes
    from .record import provenance

    out = {"experiment": "cp", "backend": "gloo", "ranks": world, "method": args.method, "zigzag": args.zigzag,
           "model": {**MODELS, **CP_MODELS}[args.model][1], "model_name": args.model,
           "micro_batch_size": args.micro_batch, "seq_len": args.seq, "foreach": args.foreach, "precision": "fp32",
           "recompute": args.recompute, "loss": args.loss, "loss_chunk": args.loss_chunk,
           "fsdp": getattr(args, "fsdp", False),
           "command": " ".join([PROG, *sys.argv[1:]]), "provenance": provenance("cpu"), "per_rank": ranks}
    out["rows"] = cp_rows(out)
    print(f"# vramlab.measure.parallel cp: {args.method}{' zig-zag' if args.zigzag and args.method == 'ring' else ''}, "
          f"gloo, {world} ranks, {cp_model_spec(args.model).name}, batch {args.micro_batch} x {args.seq} tokens"
          + (", states sharded by FSDP2" if getattr(args, "fsdp", False) else ""))
    print(f"#{'rank':>5}{'predicted':>12}{'measured':>12}{'error':>8}  {'phase':<10}{'sent fwd':>11}{'bwd':>11}"
          f"{'logits':>10}{'grads':>10}")
    for r in out["rows"]:
        print(f" {r['rank']:>5}{fmt_bytes(r['predicted']):>12}{fmt_bytes(r['measured']):>12}{100 * r['error']:>+7.1f}%"
              f"  {r['measured_phase']:<10}{fmt_bytes(r['sent_forward']):>11}{fmt_bytes(r['sent_backward']):>11}"
              f"{r['logits_max_rel_diff']:>10.1e}{r['grad_max_rel_diff']:>10.1e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def _worker(rank: int, world: int, args, port: int) -> None:
    """One CP rank (started by `collectives.launch`, by reference: a module-level function)."""
    run_rank(rank, world, args, port, _run_cp, _cp_report)


def cp_main(argv: list[str]) -> int:
    """`python -m vramlab.measure.parallel cp ...`: context parallelism on gloo ranks."""
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=f"{PROG} cp", description="Context parallelism (ring attention, Ulysses) on gloo ranks, "
                                                      "measured per rank against vramlab.context_parallel.context_parallel.")
    p.add_argument("--method", default="ring", choices=CP_METHODS)
    # (one rank is no CP: the ring would send to itself, which gloo refuses; one process on the whole sequence is
    # measured by `python -m vramlab.measure.memory`)
    p.add_argument("--nproc", type=A(whole, int, lo=2, hi=64), default=2, help="CP ranks (local processes), 2 to 64")
    p.add_argument("--model", default="lab", choices=[m for m in MODELS if MODELS[m][1]["model_type"] == "llama"]
                   + list(CP_MODELS), help="the model (Llama family; default lab 3's)")
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=2, help="sequences (default 2)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=256, help="tokens per sequence (default 256)")
    p.add_argument("--no-zigzag", dest="zigzag", action="store_false",
                   help="ring: contiguous sequence shards instead of the zig-zag (chunks r and 2cp-1-r)")
    p.add_argument("--optimizer-impl", default="foreach", choices=("foreach", "for-loop"))
    p.add_argument("--recompute", default="none", choices=CPP.CP_RECOMPUTE,
                   help="full: every block checkpointed (torch.utils.checkpoint), its attention re-run in the backward")
    p.add_argument("--loss", default="whole", choices=LOSSES,
                   help="whole, chunked (torchtune's) or fused (Liger's linear cross-entropy) on the rank's tokens")
    p.add_argument("--loss-chunk", type=A(whole, int), default=None, metavar="N",
                   help="with --loss chunked or fused: tokens a chunk (default: torchtune's 8 chunks, Liger's rule)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model states over the CP ranks too (FSDP2 fully_shard of every block, then the root)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0)
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0)
    args = p.parse_args(argv)
    if args.loss_chunk is not None and args.loss == "whole":
        p.error("--loss-chunk applies to --loss chunked or fused")
    args.foreach = args.optimizer_impl == "foreach"
    args.backend, args.experiment = "gloo", "cp"  # run_rank runs it as it runs ddp, tp and pp
    if args.method == "ulysses":
        args.zigzag = False
    spec = cp_model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    why = cp_problem(spec, args.nproc, args.method, args.seq, args.zigzag)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=f"{PROG} cp", error=ParlabError, torchrun_port=29513, preload=RANK_IMPORTS)


# the campaign stored in benchmarks/results/context_parallel/cpu.json: both methods, 2 and 4 ranks, MHA (lab 3's
# Llama) and GQA (8 query / 2 key-value heads), two shapes each, zig-zag and contiguous rings; full recompute and
# the chunked and fused losses
CP_CAMPAIGN: tuple[dict[str, Any], ...] = (
    dict(model="lab", method="ring", nproc=2, micro_batch=2, seq=256),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=256),
    dict(model="lab", method="ulysses", nproc=2, micro_batch=2, seq=256),
    dict(model="lab", method="ulysses", nproc=4, micro_batch=2, seq=256),
    dict(model="lab", method="ring", nproc=2, micro_batch=4, seq=512),
    dict(model="lab", method="ring", nproc=4, micro_batch=4, seq=512, zigzag=False),
    dict(model="lab", method="ulysses", nproc=4, micro_batch=4, seq=512),
    dict(model="llama-gqa-val", method="ring", nproc=2, micro_batch=2, seq=256),
    dict(model="llama-gqa-val", method="ring", nproc=4, micro_batch=4, seq=512),
    dict(model="llama-gqa-val", method="ulysses", nproc=2, micro_batch=4, seq=512),
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024),
    # with every block checkpointed (the re-run forward passes K/V again) and the loss chunked or fused
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024, recompute="full"),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024, recompute="full", loss="chunked"),
    dict(model="llama-gqa-val", method="ring", nproc=2, micro_batch=4, seq=512, recompute="full", loss="chunked"),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=512, loss="fused"),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024, zigzag=False, loss="fused"),
    # the model states sharded over the CP ranks too (FSDP2, --fsdp): both methods, 2 and 4 ranks, full recompute,
    # the chunked and fused losses, three models
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024, fsdp=True),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024, fsdp=True),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024, recompute="full", fsdp=True),
    dict(model="lab", method="ring", nproc=2, micro_batch=2, seq=256, fsdp=True),
    dict(model="llama-gqa-val", method="ulysses", nproc=2, micro_batch=4, seq=512, fsdp=True),
    dict(model="llama-gqa-val", method="ring", nproc=4, micro_batch=4, seq=512, recompute="full", loss="chunked",
         fsdp=True),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=512, loss="fused", fsdp=True),
    dict(model="cp-val", method="ulysses", nproc=2, micro_batch=2, seq=1024, recompute="full", fsdp=True),
)


def cp_argv(config: dict[str, Any], out: str) -> list[str]:
    """The command line of one CP run (`CP_CAMPAIGN`'s keys)."""
    argv = ["cp", "--model", config["model"], "--method", config["method"], "--nproc", str(config["nproc"]),
            "--micro-batch", str(config["micro_batch"]), "--seq", str(config["seq"]), "--out", out]
    argv += [] if config.get("recompute", "none") == "none" else ["--recompute", config["recompute"]]
    argv += [] if config.get("loss", "whole") == "whole" else ["--loss", config["loss"]]
    argv += [] if config.get("loss_chunk") is None else ["--loss-chunk", str(config["loss_chunk"])]
    argv += ["--fsdp"] if config.get("fsdp", False) else []
    return argv + ([] if config.get("zigzag", True) else ["--no-zigzag"])


def run_cp(config: dict[str, Any], *, timeout: float = 600) -> dict[str, Any]:
    """One CP run in a subprocess, its results read back (`run_in_subprocess`)."""
    return run_in_subprocess(cp_argv, config, timeout)


def _cp_label(config: dict[str, Any]) -> str:
    argv = cp_argv(config, "")
    del argv[argv.index("--out"):argv.index("--out") + 2]
    return " ".join(argv)


def cp_campaign(path: str, configs=CP_CAMPAIGN) -> dict[str, Any]:
    """Run every configuration and store them, with each row's error, in one JSON file at `path`."""
    return campaign(path, configs, run_cp, _cp_label, name="cp_campaign", module=__name__,
                     what="context parallelism on gloo ranks (CPU): each rank's peak through a steady-state training "
                          "step (the ledger) and the bytes its attention sent per layer, against "
                          "vramlab.context_parallel.context_parallel")
