"""Context parallelism: one rank of cp training on its share of every sequence (ring attention,
zig-zag or contiguous, or Ulysses' all-to-alls), its memory, its step's moments (the states whole and
all-reduced, or sharded by FSDP2), what it sends and how long that takes, and whether it fits.
Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from . import checks as _checks
from . import optimizers as _optim
from . import collectives as _coll
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import fitting as _fitting
from . import activations as _act
from . import zero as _zero
from .parallel import DECODER_FAMILIES, check_count
from .specs import ModelSpec
from .step import Step


# ============================================================================ context parallelism
# Context parallelism (CP) splits every sequence over cp ranks; each rank runs the whole model on its
# s/cp tokens, so everything the ledger saves per token shrinks by cp. Attention alone needs the other
# ranks' tokens:
# - ring attention (Liu et al. 2023, arXiv:2310.01889; Megatron-LM's context parallelism): each rank's
#   K/V block travels round the ring, point to point, the next block received while the current one is
#   attended to; the partial outputs are merged by their log-sum-exp (online softmax). A rank saves
#   what a flash kernel saves on one device -- q, k, v at its own tokens, the merged output and its
#   log-sum-exp -- and in the backward sends K/V round again with their gradient accumulators, which
#   come home after cp steps. Zig-zag (load balance for causal attention): the sequence is cut into
#   2cp chunks and rank r holds chunks r and 2cp-1-r, so each rank attends to the same number of pairs;
# - Ulysses (Jacobs et al. 2023, arXiv:2309.14509, DeepSpeed-Ulysses): an all-to-all turns the
#   sequence-sharded q, k, v (all heads, s/cp tokens) into head-sharded ones (heads/cp, all s tokens),
#   attention runs on whole sequences, and a fourth all-to-all brings the output back; cp must divide
#   the heads and the key/value heads (GQA).
CP_METHODS: tuple[str, ...] = ("ring", "ulysses")
CP_RECOMPUTE: tuple[str, ...] = ("none", "full")  # the recompute plans priced with context parallelism
MAX_CP = 1 << 12


def cp_positions(seq_len: int, cp: int, rank: int, *, zigzag: bool = True) -> list[int]:
    """The global token positions rank `rank` of `cp` holds, in its order: zig-zag, chunks r and
    2cp-1-r of 2cp (seq_len a multiple of 2cp); otherwise the r-th contiguous s/cp tokens."""
    cp = check_count("cp", cp, hi=MAX_CP)
    s = check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    rank = _checks.whole("rank", rank, lo=0, hi=cp - 1)
    zigzag = _checks.flag("zigzag", zigzag)
    parts = 2 * cp if zigzag else cp
    if s % parts:
        raise ValueError(f"seq_len {s:,} must be a multiple of {parts} to cut it into "
                         + (f"2 x cp = {parts} zig-zag chunks" if zigzag else f"cp = {cp} shards"))
    c = s // parts
    if not zigzag:
        return list(range(rank * c, (rank + 1) * c))
    return list(range(rank * c, (rank + 1) * c)) + list(range((parts - 1 - rank) * c, (parts - rank) * c))


def _ring_step_flops(b: int, n: int, qd: int, cp: int, zigzag: bool) -> list[Fraction]:
    """Forward attention FLOPs of each ring step on the busiest rank (2 x 2 b q k d per pair attended):
    zig-zag: every step half an n x n block (its own block causal: half; an earlier rank's: all rows x
    its first chunk; a later rank's: the second half of the rows x all its tokens); contiguous: the last
    rank attends to every earlier rank's whole block and to half of its own."""
    block = Fraction(4 * b * n * n * qd)
    if zigzag:
        return [block / 2] * cp
    return [block / 2] + [block] * (cp - 1)


# shard_states: `precision` -> (the `zero` recipe of FSDP2's policy, the engine's phases' precision)
_CP_FSDP_RECIPES: dict[str, tuple[str, str]] = {"fp32": ("fp32-adam", "fp32"),
                                                "bf16-mixed": ("mixed-adam", "bf16-fp32-states")}


def _cp_fsdp_moments(rank: Step, cp: int, totals: list, ddp_states: int, recipe: str, *, extra_saved: int, kept: int,
                     alive: dict[int, int] | None = None, made: int | None = None) -> tuple[list, dict[str, int]]:
    """`context_parallel`'s moments with the states sharded over the cp ranks by FSDP2: the step's phases are
    `zero.rank_phases(implementation="fsdp2")`'s at the rank's n tokens (Ulysses' saved all-to-all outputs added
    where the blocks' activations are alive, as with DDP), and each attention moment in `totals` (computed with
    DDP's whole states, `ddp_states` bytes) gets FSDP2's instead: the shards, the root unit and the last block
    gathered, in the backward the next block prefetched and the gradients made so far (under full recompute, at
    the block where the most is alive: `kept` bytes, a block's checkpointed input, freed per later block against
    its gradient shard kept). Under full recompute, `alive` (block -> bytes alive in its backward,
    `activation_bytes`' "backward") puts the last block's re-run backward right: FSDP2's phase keeps the last
    block's saved tensors (every block's checkpointed input is still alive), which the one-device phase it
    starts from (the block with the most gradients made) leaves out. `made`: "block_grads_made", the elements
    of the last block's gradients `zero.rank_phases` counts in its phase (taken out again to leave the head's). Every
    moment's shards are
    then set to their storage (each tensor's shard ceil(numel / cp), Adam's step counters). Returns (moments,
    states between steps)."""
    spec, b, n, L, recompute = rank.model, rank.batch_size, rank.seq_len, rank.model.num_layers, rank.recompute
    fph = _zero.rank_phases(spec, cp, 3, micro_batch_size=b, seq_len=n, recipe=recipe, implementation="fsdp2",
                            attention="sdpa", optimizer_impl=rank.optimizer_impl, device=rank.device, gpu=rank.gpu,
                            recompute=recompute, loss=rank.loss, loss_chunk_tokens=rank.loss_chunk_tokens)
    between = _zero.model_states(spec, cp, 3, recipe=recipe, implementation="fsdp2")
    pb = _zero.RECIPES[recipe][0]  # the gathered copies' and unsharded gradients' bytes
    block, root = _zero.zero_units(spec)
    R, unit = root * pb, block * pb
    prefetch = unit if L >= 2 else 0
    # the last block's gradients made before its attention's backward: o_proj, the MLP, the second norm
    last = [(name, x) for name, x in spec.param_tensors() if _zero.block_index(name) == L - 1]
    before_attention = sum(x for name, x in last if not any(k in name for k in ("q_proj", "k_proj", "v_proj",
                                                                                  "input_layernorm", "qkv")))
    own = min(made * pb, block * pb) if made is not None else 0  # the last block's own, in `zero`'s phase
    grads_block = next(p.gradients - between.gradients for p in fph if "block" in p.phase) - own  # the head's
    grads_last = grads_block + before_attention * pb
    # the last block's down_proj gradient: its MmBackward0 runs first, and the non-reentrant checkpoint re-runs
    # the block's forward from inside it (seen on gloo ranks, cp-val: a (256, 256) fp32 gradient beside the
    # re-run attention)
    down = sum(x for name, x in last if "down_proj" in name) * pb
    fsdp = between.parameters + between.optimizer_states
    # in the forward FSDP2 keeps a unit's flat all-gather output until the next unit's copy-out
    # (`FSDPParamGroup.wait_for_unshard`, implicit prefetch), the last block's until the root's post-forward
    # (`FSDPState._post_forward`): beside the last block's parameters in its attention, alone in the loss's forward
    # (the root here runs the loss, as a model called with labels does). `zero.rank_phases` leaves it out (its runs
    # never peaked there). A recomputed block's re-run forward runs after its pre-backward hook, which gathered it
    # and prefetched the block before it (the non-reentrant checkpoint unpacks in the block's backward)
    held = unit if cp > 1 else 0
    out = []
    again = recompute == "full"
    # under full recompute an earlier block's attention may hold more than the last one's: each later block has
    # freed its checkpointed input (`kept`) but left its fp32 gradient shard, and the block after it its flat fp32
    # gradients until their reduce-scatter is waited on (measured: gloo ranks, 8 blocks); block 0 prefetches none
    shift = 0
    if again:
        shard_b, flat_g = -(-block // cp) * 4, block * 4 if cp > 1 else 0
        shift = max((L - 1 - i) * (shard_b - kept) + (flat_g if i < L - 1 else 0) - (prefetch if i == 0 else 0)
                    for i in range(L))
    for t, phase in totals:
        if phase.startswith("attention forward"):
            # (re-run in the backward: the gradients made so far are alive)
            out.append((t - ddp_states + fsdp + R + unit + (prefetch + grads_block + down + shift if again else held),
                        phase))
        elif phase.startswith("attention backward"):
            out.append((t - ddp_states + fsdp + grads_last + R + unit + prefetch + shift, phase))
    for p in fph:
        t = p.total + (held if p.phase.startswith(("forward", "loss forward")) else 0)
        if not (p.phase.startswith(("embedding", "optimizer", "root's")) or again):
            t += L * extra_saved
        if again and "recomputed block" in p.phase:
            t += extra_saved
            if alive:  # the last block's saved tensors, not those of the block the one-device phase names
                i = int(p.phase.rsplit("block ", 1)[1].rstrip(")"))
                t += max(alive.values()) - alive[i]
        out.append((t, p.phase))
    shard = [-(-x // cp) for _, x in spec.param_tensors()]
    states = {"parameters": 4 * sum(shard), "gradients": 0,
              "optimizer_states": 8 * sum(shard) + 4 * len(shard)}  # Adam's m, v and step count per tensor, fp32
    delta = states["parameters"] + states["optimizer_states"] - fsdp
    return [(t + delta, phase) for t, phase in out], states


def _cp_in_flight(method: str, cp: int, zigzag: bool, *, b: int, a: int, n: int, q_b: int, kv_b: int
                  ) -> tuple[int, int]:
    """What CP holds on top during one block's attention on the busiest rank, (forward, backward): the bytes
    `context_parallel` documents as in_flight_forward / in_flight_backward."""
    if cp == 1:
        return 0, 0
    if method == "ring":
        # the busiest rank: a merge may update all its rows (zig-zag: an earlier rank's block is seen by
        # every row); one step's block gradients are all rows x half the keys or half the rows x all keys
        fwd_flight = 2 * 2 * kv_b + 4 * q_b + 3 * b * a * n * 4
        grads = max(q_b + 2 * (kv_b // 2), q_b // 2 + 2 * kv_b) if zigzag else q_b + 2 * kv_b
        # dq, the current and next K/V, the dK/dV accumulators, and either one step's block gradients or
        # the accumulators' receive buffers; from 3 ranks on both at once (gloo ranks' ledgers, cp-val, ring,
        # 4 ranks: three pairs of K/V-sized receive buffers beside a step's block gradients; 2 ranks: two)
        bwd_flight = q_b + 3 * 2 * kv_b + (grads + 2 * kv_b if cp > 2 else max(grads, 2 * kv_b))
        return fwd_flight, bwd_flight
    return 3 * q_b, 2 * q_b + 2 * kv_b + 2 * q_b


def _cp_traffic(method: str, cp: int, zigzag: bool, *, b: int, n: int, s: int, qd: int, q_b: int, kv_b: int,
                peak_flops: float, link: _coll.Link) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """One layer's communication on a rank, as (forward, backward) pairs: bytes sent, messages, seconds on
    `link`, attention's compute seconds at `peak_flops` (the busiest rank's share), and the seconds the
    transfers add beyond it (`context_parallel` documents each)."""
    if method == "ring":
        sent_f = (cp - 1) * 2 * kv_b
        sent_b = (cp - 1) * 2 * kv_b + (cp * 2 * kv_b if cp > 1 else 0)
        messages_f, messages_b = 2 * (cp - 1), 2 * (cp - 1) + (2 * cp if cp > 1 else 0)
        step_flops = _ring_step_flops(b, n, qd, cp, zigzag)
        t_f = [float(f) / peak_flops for f in step_flops]
        kv_step = link.alpha_s + 2 * kv_b / link.bytes_per_s  # one K/V block, point to point
        comm_f = (cp - 1) * kv_step
        comm_b = (cp - 1) * kv_step + cp * kv_step
        # each step's transfer runs under that step's attention; the last forward step sends nothing
        exposed_f = sum(max(0.0, kv_step - t) for t in t_f[:-1])
        exposed_b = sum(max(0.0, (2 * kv_step if i < cp - 1 else kv_step) - 2 * t) for i, t in enumerate(t_f)) \
            if cp > 1 else 0.0
        compute_f = sum(t_f)
    else:
        sizes = (q_b, kv_b, kv_b, q_b)
        sent_f = sent_b = sum(z * (cp - 1) // cp for z in sizes)
        messages_f = messages_b = 4 * (cp - 1)
        comm_f = comm_b = sum(_coll.collective_time("all_to_all", cp, z, link) for z in sizes)
        compute_f = 2 * b * s * s * qd / cp / peak_flops  # causal: half of 2 x 2 b s^2 q_dim, over the heads
        exposed_f, exposed_b = comm_f, comm_b
    compute_b = 2 * compute_f
    if cp == 1:
        exposed_f = exposed_b = comm_f = comm_b = 0.0
    return ((sent_f, sent_b), (messages_f, messages_b), (comm_f, comm_b), (compute_f, compute_b),
            (exposed_f, exposed_b))


def _cp_step_moments(rank: Step, phases: list, act: dict, *, cp: int, again: bool, extra_saved: int, pending: int,
                     q_b: int, flights: tuple[int, int]) -> list[tuple[int, str]]:
    """(bytes, phase) of every moment of a rank's step with its states whole (`context_parallel`): one
    device's `phases` at the rank's n tokens with Ulysses' extra saved outputs (`extra_saved` a block) and the
    tied head's gradient waiting (`pending`), and the two moments CP adds inside the last block's attention
    (re-run under full recompute, `again`) with its in-flight bytes."""
    spec, b, n, precision, device = rank.model, rank.batch_size, rank.seq_len, rank.precision, rank.device
    fwd_flight, bwd_flight = flights
    nb = _prec.dtype_sizes(precision, device)
    L, a = spec.num_layers, spec.num_heads
    block = _act.layer_saved(spec, attention="sdpa", device=device, precision=precision, batch_size=b)
    core = max(i for i, z in enumerate(block) if z.name == "logsumexp")  # a flash kernel's last saved tensor
    after_core = _act.ledger_bytes(block[core + 1:], tokens=b * n, scores=b * a * n * n,
                                    nbytes=dict(nb, loss=_prec.loss_bytes(spec, precision)), batch=b)
    # inside the last block's attention backward: the gradient entering the block (`block_grad_in`: one b x s x h
    # in a sequential pre-norm block, it also flows on down the residual) and the attention output's gradient
    # (o_proj's input gradient, b x n x q_dim: the attention kernel's `grad_out`, alive through every ring step).
    # Seen in the ledger of gloo ranks (cp-val, ring, 2 ranks, full recompute): an add (2, 512, 256) and an
    # mm (1024, 256) beside CP's own buffers; the re-run forward (under recompute) holds the first one only
    grads_in = act["block_grad_in"] + q_b
    totals = []
    for ph in phases:
        t = ph.total
        if "embedding" in ph.phase or ph.phase.startswith("optimizer") or again:
            pass  # every block's activations are gone (under recompute a block keeps its input, not the output)
        else:
            t += L * extra_saved
        if again and ph.phase.startswith("backward of a recomputed block"):
            t += extra_saved  # the recomputed block's own all-to-all output, kept for its o_proj's backward
        if ph.phase.startswith(("backward of a recomputed block", "backward of the last block")):
            t += pending
        totals.append((t, ph.phase))
        if cp > 1 and not again and ph.phase.startswith("backward of the last block"):
            # the blocks run before the loss: the moments are those of the whole loss's forward end, less
            # everything outside the blocks
            end = next(x for x in (phases if rank.loss == "whole" else _mem.training_phases(
                dataclasses.replace(rank, loss="whole", loss_chunk_tokens=None),
                share=_act.DeviceShare(keep_gradients=True))) if x.phase.startswith("forward end"))
            base = end.total - end.temporaries - end.kv_cache - (end.activations - act["layers"]) - after_core
            totals.append((base + (L - 1) * extra_saved + fwd_flight, "attention forward of the last block"))
            totals.append((base + L * extra_saved + grads_in + pending + bwd_flight,
                           "attention backward of the last block"))
        if cp > 1 and again and ph.phase.startswith("backward of a recomputed block"):
            # the last block re-run: the states, every block's input, the gradient entering the block and its
            # saved tensors up to the attention core (what it saves after the core is not made yet in the re-run
            # forward, and freed again by its backward before attention's), plus what CP holds in flight
            base = ph.total - ph.temporaries - ph.kv_cache - after_core + act["block_grad_in"] + pending
            # Ulysses' re-run forward holds one q-sized buffer more than the first forward's in-flight ones at its
            # peak (gloo ranks, cp-val, 2 and 4 ranks: the measured moment sat one q_b above, not identified further)
            totals.append((base + extra_saved + fwd_flight, "attention forward of the recomputed last block"))
            totals.append((base + q_b + extra_saved + bwd_flight, "attention backward of the recomputed last block"))
    return totals


# a CP rank's training-step options (a `Step`'s, at the rank's tokens) and their defaults here
CP_STEP_OPTIONS: dict[str, Any] = {"precision": "bf16-mixed", "device": "cuda", "optimizer": "adamw",
                                   "optimizer_impl": "foreach", "recompute": "none", "loss": "whole",
                                   "loss_chunk_tokens": None}


def context_parallel(model: ModelSpec | str, *, cp: int, method: str = "ring", batch_size: int, seq_len: int,
                     zigzag: bool = True, link: str | _coll.Link = "nvlink4", gpu="h100", mfu: float = 0.4,
                     shard_states: bool = False, **options) -> dict[str, Any]:
    """One CP rank of `cp` training on `batch_size` sequences of `seq_len` tokens (`method` "ring" or
    "ulysses"; `zigzag` for the ring's load balance; Ulysses uses contiguous shards).

    Memory (bytes):
    - saved_per_layer / activations: what one block / the whole model saves for backward on the rank,
      the ledger (`activations.activation_bytes`, under `recompute`) at its s/cp tokens -- ring attention
      saves what a flash kernel saves; Ulysses also keeps the all-to-all's output that feeds the attention's
      output projection (the projection saves its input; the kernel saves its own, head-sharded, output);
      `activations` counts the tensors outside the blocks as the whole loss saves them; `blocks_saved` is
      the blocks' alone (what CP divides, whatever the loss);
    - in_flight_forward / in_flight_backward: what CP holds on top during one block's attention, on
      the busiest rank. Ring: forward, the current and the next K/V blocks (receive buffers, 2 x 2 b
      (s/cp) kv_dim) and the partial outputs being merged (four b (s/cp) q_dim tensors, three
      log-sum-exps); backward, dq, the current and next K/V, the travelling dK/dV accumulators, and
      one step's block gradients or the accumulators' receive buffers, whichever is larger (from 3 ranks
      on, both). Ulysses:
      an all-to-all's send and receive buffers and its rearranged output (3 b (s/cp) q_dim), in the
      backward the gradients of q, k, v at once;
    - activation_peak: activations + the larger in-flight term;
    - peak, peak_phase, moments: the rank's whole training step, the largest of `moments` -- one
      device's phases at s/cp tokens (`memory.training_phases`: parameters, gradients kept between
      steps and all-reduced in place over the CP group, `optimizer` states, logits), with Ulysses'
      extra saved outputs where the blocks' activations are alive, and two moments inside the last
      block's attention: the states, the earlier blocks' saved tensors and the last block's up to
      its attention core, plus the in-flight bytes (and, backward, the gradient entering the block and the
      attention output's gradient; with a tied head, its gradient waiting for the embedding's).
      `recompute` "full" (activation checkpointing of every block, as long-context recipes run CP):
      each block keeps its input; the two moments are then inside the last block's recomputation
      (its forward re-run with the gradient entering it alive, then its backward), and the re-run
      forward sends its K/V round the ring (or through Ulysses' all-to-alls) again: `sent_per_layer`
      and `comm_seconds_per_layer` name it "recompute". `loss` / `loss_chunk_tokens`: the loss's
      implementation over the rank's tokens (`memory.training_phases`: whole, torchtune's chunked,
      Liger's fused), which sets the peak at the logits' gradient that long context meets first.

    Communication per layer and rank (bytes sent): ring forward (cp-1) K/V blocks; backward (cp-1)
    K/V blocks and cp dK/dV blocks (the accumulators' way home included). Ulysses: four all-to-alls
    forward (q, k, v, out) and four backward, each rank sending (cp-1)/cp of each buffer. Seconds:
    alpha-beta on `link` (`collectives`); attention's compute: 2 x 2 b s^2 q_dim FLOPs for the
    forward, halved for causal, over cp ranks (the busiest rank's share: zig-zag balances it,
    contiguous shards leave the last rank 2 - 1/cp times the mean), the backward twice the forward,
    at `mfu` of `gpu`'s peak. The ring overlaps each step's transfer with the step's attention
    ("hidden" when no step waits; `exposed_seconds` what the waits add); Ulysses' all-to-alls feed
    and follow attention, so they are exposed by construction.

    `shard_states`: the model states sharded over the cp ranks as well (FSDP2, torchtitan's dp_shard x cp
    mesh: `fully_shard` of every decoder block, then of the root -- embeddings, final norm, LM head -- over the
    CP group), instead of whole on every rank with gradients all-reduced. The step's moments are then
    `zero.rank_phases(implementation="fsdp2")`'s at s/cp tokens (under the same `recompute` and `loss`: the root
    gathered from the forward to the end of the backward, a block in use and the next prefetched, a block's
    unsharded gradients flat in fp32 until their reduce-scatter, the optimizer stepping shards; no gradients
    between steps), and the two attention moments hold, instead of DDP's states, the shards, the root and the
    last block gathered (the backward: the next block prefetched too, the head's gradients and those the last
    block has made after its attention -- o_proj, the MLP, its norm). `precision` "fp32" (FSDP2 in fp32) or
    "bf16-mixed", which here means FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32
    shards, bf16 gathered copies and activations (no autocast weight copies); `optimizer` adam or adamw.
    `states`: what a rank keeps between steps, exact against storage where cp divides each tensor's first
    dimension (each shard ceil(numel / cp) elements; FSDP2 pads by rows); `state_sync`: the step's collectives
    of the states per rank (FSDP2's all-gathers and reduce-scatter by `zero.communication`, all in the policy's
    parameter dtype; or DDP's all-reduce of every gradient), bytes sent and alpha-beta seconds on `link`.
    Validated on gloo ranks (`vramlab.measure.parallel cp --fsdp`, benchmarks/results/context_parallel/cpu.json):
    ring and Ulysses, 2 and 4 ranks, full recompute, chunked and fused losses, three models, with and without
    FSDP2; the shards exact, every rank's peak within -2 ... +0 %, CP's attention-backward moments within
    -0.6 ... 0 % and its attention-forward ones within -3.3 ... +0.8 % of the busiest rank's (the recomputed
    last block's moments traced tensor by tensor in the ranks' ledgers).

    Known limitations: ring attention's p2p and FSDP2's collectives share no buffers here, and
    neither's overlap with the other is priced; sharding over a dp x cp mesh (dp > 1) is cp x dp ranks of
    `zero` with CP's activations, not modelled here; FSDP2 measured in fp32 on gloo ranks only (its bf16
    policy is `zero`'s, validated there without CP); no reshard_after_forward=False (ZeRO-2-like) option."""
    _checks.no_unknown("context_parallel", options, CP_STEP_OPTIONS)
    options = {**CP_STEP_OPTIONS, **options}
    precision, device, optimizer, optimizer_impl = (options[k] for k in ("precision", "device", "optimizer",
                                                                         "optimizer_impl"))
    recompute, loss, loss_chunk_tokens = options["recompute"], options["loss"], options["loss_chunk_tokens"]
    spec = _specs.resolve(model)
    cp = check_count("cp", cp, hi=MAX_CP)
    shard_states = _checks.flag("shard_states", shard_states)
    method = str(_checks.one_of("method", method, CP_METHODS))
    b, s = check_count("batch_size", batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    _checks.one_of("optimizer", optimizer, _optim.SHARDED)
    _checks.one_of("optimizer_impl", optimizer_impl, _mem.OPTIMIZER_IMPLS)
    zigzag = _checks.flag("zigzag", zigzag)
    if not isinstance(recompute, str) or recompute not in CP_RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(CP_RECOMPUTE)} with context parallelism (every block "
                         f"checkpointed or none), got {_checks.show(recompute)}")
    _checks.one_of("loss", loss, _mem.LOSSES)
    mfu = _checks.number("mfu", mfu, lo=0, lo_open=True, hi=1, what="a fraction of the peak FLOP/s in (0, 1]")
    lk = _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)] if not isinstance(link, _coll.Link) else link
    g = _specs.gpu(gpu)
    if shard_states:
        if precision not in _CP_FSDP_RECIPES:
            raise ValueError(f"precision must be {' or '.join(_CP_FSDP_RECIPES)} with shard_states=True (FSDP2 in fp32, "
                             f"or its bf16 MixedPrecisionPolicy with fp32 shards), got {_checks.show(precision)}")
        if optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be adam or adamw with shard_states=True (FSDP2's sharded phases are "
                             f"Adam's), got {_checks.show(optimizer)}")
        fsdp_recipe, precision = _CP_FSDP_RECIPES[precision]  # the engine's phases in the policy's dtypes
    if spec.family not in DECODER_FAMILIES or not spec.is_causal_lm:
        raise ValueError(f"context parallelism is modelled for causal decoders ({', '.join(DECODER_FAMILIES)}), "
                         f"not {spec.name} ({spec.family})")
    if _act.uses_math_attention(spec, "sdpa", device, precision):
        raise ValueError(f"{spec.name} in {precision} on {device} runs SDPA's math path (it materialises the "
                         "s x s scores); CP here assumes a flash kernel (log-sum-exp merge)")
    a, kv = spec.num_heads, spec.num_kv_heads
    if method == "ulysses":
        zigzag = False  # Ulysses gathers whole sequences: contiguous shards, no imbalance
        if a % cp or kv % cp:
            raise ValueError(f"Ulysses shards attention by heads: cp {cp} must divide the {a} query heads and the "
                             f"{kv} key/value heads of {spec.name}")
    parts = 2 * cp if zigzag else cp
    if s % parts:
        raise ValueError(f"seq_len {s:,} must be a multiple of {parts} to cut it into "
                         + (f"2 x cp = {parts} zig-zag chunks" if zigzag else f"cp = {cp} equal shards"))
    n = s // cp
    nb = _prec.dtype_sizes(precision, device)
    xh, qd = nb["half"], spec.q_dim
    kvd = spec.kv_dim if device == "cpu" or precision != "fp32" or kv == 1 else qd  # as `layer_saved` keeps k, v
    L = spec.num_layers
    act = _act.activation_bytes(spec, batch_size=b, seq_len=n, precision=precision, attention="sdpa", device=device,
                                recompute=recompute)
    q_b, kv_b = b * n * qd * xh, b * n * kvd * xh  # one rank's q (or output) and k (or v)
    extra_saved = q_b if method == "ulysses" and cp > 1 else 0  # the all-to-all's output, o_proj's input
    saved_layer = act["one_layer"] + extra_saved
    activations = act["layers"] + act["outside"] + act["weight_copies"] + L * extra_saved
    fwd_flight, bwd_flight = _cp_in_flight(method, cp, zigzag, b=b, a=a, n=n, q_b=q_b, kv_b=kv_b)
    peak_flops = (g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16) * 1e12 * mfu
    ((sent_f, sent_b), (messages_f, messages_b), (comm_f, comm_b), (compute_f, compute_b),
     (exposed_f, exposed_b)) = _cp_traffic(method, cp, zigzag, b=b, n=n, s=s, qd=qd, q_b=q_b, kv_b=kv_b,
                                           peak_flops=peak_flops, link=lk)
    again = recompute == "full"  # the re-run forward of each block passes K/V (or its all-to-alls) once more
    # the rank's whole step: one device's phases at s/cp tokens (gradients kept between steps, all-reduced
    # in place), Ulysses' extra saved outputs wherever the blocks' activations are alive, and two moments
    # CP adds inside the last block's attention, where the most is alive: the states, every earlier block's
    # saved tensors and the last block's up to its attention core (what it saves after the core -- the
    # second norm, the MLP -- does not exist yet in the forward and was freed by its backward), plus CP's
    # in-flight bytes (and in the backward the gradient flowing into the block)
    rank = Step(spec, batch_size=b, seq_len=n, precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                attention="sdpa", device=device, gpu=g if device == "cuda" else None, recompute=recompute, loss=loss,
                loss_chunk_tokens=loss_chunk_tokens)  # one rank's step: its n tokens, in the policy's dtypes
    phases = _mem.training_phases(rank, share=_act.DeviceShare(keep_gradients=True))
    # a tied head's gradient waits in autograd's input buffer for the embedding's (one AccumulateGrad node, two
    # incoming edges) through every block's backward, beside the kept gradients (seen on gloo ranks: an add
    # (6144, 256) in llama-gqa-val's attention backward; FSDP2's phases count the head's gradients themselves)
    # (cp 1 stays the one-device ledger, `memory.training_phases` with kept gradients, which leaves it out)
    pending = 0 if shard_states or cp == 1 or not spec.tie_word_embeddings else \
        spec.vocab_size * (spec.word_embed_proj_dim or spec.hidden_size) * (phases[0].gradients // spec.params)
    totals = _cp_step_moments(rank, phases, act, cp=cp, again=again, extra_saved=extra_saved, pending=pending,
                              q_b=q_b, flights=(fwd_flight, bwd_flight))
    ddp_states = phases[0].parameters + phases[0].gradients + phases[0].optimizer_states  # kept whole, all step
    states = {"parameters": phases[0].parameters, "gradients": phases[0].gradients,
              "optimizer_states": phases[0].optimizer_states}
    pb_sync = 4 if precision == "fp32" else 2
    if shard_states:
        totals, states = _cp_fsdp_moments(rank, cp, totals, ddp_states, fsdp_recipe,
                                          extra_saved=extra_saved, kept=max(act["kept"], default=0),
                                          alive=dict(act["backward"]), made=act["block_grads_made"])
        sync = _zero.communication(spec.params, cp, 3, bytes_per_value=pb_sync, link=lk, implementation="fsdp2",
                                   root_params=_zero.zero_units(spec)[1]) if cp > 1 else None
    else:
        G = states["gradients"]  # every gradient, all-reduced over the CP group
        sync = {"bytes_sent_per_rank": _coll.bytes_sent_per_rank("all_reduce", cp, G),
                "seconds": _coll.collective_time("all_reduce", cp, G, lk)} if cp > 1 else None
    peak, peak_phase = max(totals)
    return {"model": spec.name, "cp": cp, "method": method, "zigzag": zigzag, "tokens_per_rank": n,
            "shard_states": shard_states, "states": states,
            "state_sync": {"bytes_sent_per_rank": sync["bytes_sent_per_rank"], "seconds": sync["seconds"]} if sync
            else {"bytes_sent_per_rank": 0, "seconds": 0.0},
            "saved_per_layer": saved_layer, "activations": activations, "in_flight_forward": fwd_flight,
            "blocks_saved": act["layers"] + (0 if again else L * extra_saved),
            "in_flight_backward": bwd_flight, "activation_peak": activations + max(fwd_flight, bwd_flight),
            "peak": peak, "peak_phase": peak_phase, "moments": {phase: t for t, phase in totals},
            "recompute": recompute, "loss": loss,
            "sent_per_layer": {"forward": sent_f, "backward": sent_b, "recompute": sent_f if again else 0},
            "messages_per_layer": {"forward": messages_f, "backward": messages_b,
                                   "recompute": messages_f if again else 0},
            "comm_seconds_per_layer": {"forward": comm_f, "backward": comm_b, "recompute": comm_f if again else 0.0},
            "attention_seconds_per_layer": {"forward": compute_f, "backward": compute_b,
                                            "recompute": compute_f if again else 0.0},
            "exposed_seconds_per_layer": {"forward": exposed_f, "backward": exposed_b,
                                          "recompute": exposed_f if again else 0.0},
            "verdict": "hidden" if exposed_f + exposed_b == 0 else "exposed", "link": lk.name, "gpu": g.name}


def context_fit(model: ModelSpec | str, gpu, *, cp: int, batch_size: int, seq_len: int,
                expandable_segments: bool = False, **kw) -> "tuple[dict[str, Any], _fitting.Fit]":
    """One CP rank (`context_parallel(model, cp=cp, ...)`, `kw` its options) and `fitting.device_fit` of its
    peak: the one definition of "fits" at s/cp tokens a rank (the allocator's block for the rank's largest
    tensor under the same precision, recompute and loss), as the context calculator and CLI use it.
    `shard_states=True` (in `kw`): the states sharded over the cp ranks by FSDP2 (`context_parallel`); the
    largest tensor is then also at least a block's flat all-gather output in the policy's dtype."""
    r = context_parallel(model, cp=cp, batch_size=batch_size, seq_len=seq_len, gpu=gpu, **kw)
    frag_kw = {k: kw[k] for k in ("precision", "recompute", "loss", "loss_chunk_tokens") if k in kw}
    largest = _fitting.fragmentation_bytes(model, batch_size=batch_size, seq_len=r["tokens_per_rank"],
                                           **{"precision": "bf16-mixed", **frag_kw})
    if r["shard_states"]:
        flat = _zero.zero_units(_specs.resolve(model))[0] * (4 if kw.get("precision", "bf16-mixed") == "fp32" else 2)
        largest = max(largest, flat)
    return r, _fitting.device_fit(r["peak"], gpu, largest_tensor=largest, expandable_segments=expandable_segments)


__all__ = ["context_parallel", "context_fit", "cp_positions", "CP_METHODS", "CP_RECOMPUTE", "MAX_CP"]
