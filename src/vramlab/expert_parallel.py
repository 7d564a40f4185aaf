"""Expert parallelism: one rank of an MoE whose routed experts are split over ep of the dp data-parallel
ranks (its states, dispatch buffers, all-to-alls and peak), and Megatron-Core's MoE parallel folding
(the experts re-folded over a pipeline stage's tp x dp ranks: the states one rank holds).
Pure Python: no torch import.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from . import checks as _checks
from . import optimizers as _optim
from . import collectives as _coll
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import moe as _moe
from .parallel import MAX_DEVICES, check_count, copies_on_stage, stage_layers, tensor_placement, tp_numel
from .specs import ModelSpec


# ============================================================================ expert parallelism
# Expert parallelism (EP; GShard, Lepikhin et al. 2020, arXiv:2006.16668; DeepSpeed-MoE, Rajbhandari et al.
# 2022, arXiv:2201.05596; Megatron-Core's MoE) splits each MoE layer's routed experts over ep ranks of the dp
# data-parallel ranks: a rank holds E/ep experts and everything dense whole. Tokens go to their experts and
# come back by two all-to-alls per MoE layer (dispatch, combine), two more in the backward. The experts'
# gradients are all-reduced over the expert-data-parallel group (edp = dp/ep ranks holding the same
# experts) only; the dense ones over all dp (Megatron-Core `parallel_state`'s expert-data-parallel group,
# DeepSpeed's `expert_data_parallel_group`), so ZeRO shards dense states over dp and expert states over edp.
MAX_EP = 1 << 12


def _is_routed_expert(name: str) -> bool:
    """A routed experts' parameter tensor (not a shared expert's, not the router's)."""
    return ".experts." in name and ".shared" not in name


def _moe_spec(model: "ModelSpec | str") -> ModelSpec:
    """The model's spec, refused in one line when it has no routed experts to split."""
    spec = _specs.resolve(model, moe=True)
    if not spec.is_moe:
        raise ValueError(f"{spec.name} is a dense model: expert parallelism needs routed experts (an MoE preset, "
                         f"e.g. {', '.join(_specs.moe_preset_names()[:2])})")
    return spec


def _ep_tensors(spec: ModelSpec, ep: int) -> tuple[list[int], list[int]]:
    """One EP rank's parameter tensors' element counts, (dense, experts), in `param_tensors` order: a routed
    experts' tensor (transformers 5 stores each layer's experts as one 3-D tensor, or one per expert in
    older layouts) counts 1/ep."""
    dense, experts = [], []
    for name, n in spec.param_tensors():
        if _is_routed_expert(name):
            experts.append(n // ep)
        else:
            dense.append(n)
    return dense, experts


def _greedy_shard(sizes: list[int], world: int, me: int) -> list[int]:
    """The tensors `torch.distributed.optim.ZeroRedundancyOptimizer` gives group rank `me` of `world`
    (`_partition_parameters`): whole tensors, largest first (a stable sort), each to the rank with the fewest
    elements so far (the lowest such rank)."""
    totals, mine = [0] * world, []
    for n in sorted(sizes, reverse=True):
        r = totals.index(min(totals))
        totals[r] += n
        if r == me:
            mine.append(n)
    return mine


def _ep_saved_dense_layer(h: int, a: int, kv: int, d: int, b: int, s: int, e: int) -> int:
    """Bytes one block of `measure.expert_parallel`'s EP model saves for backward outside its MLP (read from its
    code, one rank, T = b s tokens, e bytes per activation): each RMSNorm (F.rms_norm) saves its input, its
    normalised input and the (T, 1) rstd; the output is saved by the projections after it; SDPA (CPU flash
    kernel) saves q, k, v, its output (o_proj's input, a view) and the (b, a, s) fp32 log-sum-exp."""
    T = b * s
    norms = 2 * (2 * T * h * e + T * e) + 2 * T * h * e  # two norms + their outputs
    return norms + T * (2 * a * d + 2 * kv * d) * e + 4 * b * a * s


def _ep_states(dense_t: list[int], expert_t: list[int], *, ep: int, dp: int, edp: int, rank: int, pb: int,
               zero_stage: int, zero_partition: str, optimizer: str, precision: str
               ) -> tuple[dict[str, int], dict[str, int], dict[str, int], list[int], list[int]]:
    """One EP rank's parameters, gradients and optimizer states (bytes, dense and experts; `expert_parallel`
    documents them) from its tensors' element counts, and the element counts its optimizer steps (dense,
    experts): its ZeRO shards, or every tensor."""
    n_dense, n_exp = sum(dense_t), sum(expert_t)
    params = {"dense": n_dense * pb, "experts": n_exp * pb}
    shard_d, shard_e = (dp, edp) if zero_stage >= 1 else (1, 1)
    if zero_stage and zero_partition == "greedy":  # ZeroRedundancyOptimizer: whole tensors, one optimizer per group
        own_d, own_e = _greedy_shard(dense_t, dp, rank), _greedy_shard(expert_t, edp, rank // ep)
    elif zero_stage:
        own_d, own_e = [-(-n_dense // shard_d)] * bool(dense_t), [-(-n_exp // shard_e)] * bool(expert_t)
        own_d, own_e = own_d and [own_d[0]] + [0] * (len(dense_t) - 1), own_e and [own_e[0]] + [0] * (len(expert_t) - 1)
    else:
        own_d, own_e = dense_t, expert_t
    opt_states = {"dense": _mem.optimizer_state_bytes(optimizer, sum(own_d), precision),
                  "experts": _mem.optimizer_state_bytes(optimizer, sum(own_e), precision)}
    if optimizer in ("adam", "adamw"):  # torch.optim keeps each tensor's step count as an fp32 scalar tensor
        opt_states = {"dense": opt_states["dense"] + 4 * len(own_d), "experts": opt_states["experts"] + 4 * len(own_e)}
    g_d, g_e = (dp, edp) if zero_stage >= 2 else (1, 1)
    grads = {"dense": -(-n_dense // g_d) * pb, "experts": -(-n_exp // g_e) * pb}
    return params, grads, opt_states, own_d, own_e


def _ep_experts_backward(held: int, *, R: int, El: int, h: int, i: int, e: int, pb: int, dropless: bool) -> int:
    """The rank's bytes inside the last MoE layer's experts' backward, from `held` (what is alive as it
    starts): the weights' gradients of the 3-D expert tensors -- select (dropless loop) or bmm (capacity)
    gives a whole (E/ep, ...) tensor, G for gate_up, D for down, in the parameters' dtype -- beside the
    activations' gradients at R received rows."""
    G, D = El * 2 * i * h * pb, El * h * i * pb
    if dropless:
        # the expert loop's backward, last expert first, Re rows each (balanced): in its product's backward
        # (the product freed; the gradients of the product, act(gate) and up), then at its gate_up weight
        # gradient (its saved tensors freed; the gradients of gate/up's output and of its input rows); the
        # next expert adds a second G that autograd sums out of place (3 G at once) and a second D (3 D)
        Re = -(-R // El)
        moments_e = [held + 2 * Re * i * e + D, held - Re * 4 * i * e + Re * (2 * i + h) * e + G + D]
        if El > 1:
            moments_e += [held - Re * 5 * i * e + Re * h * e + Re * i * e + G + 3 * D,
                          held - 2 * Re * 4 * i * e + 2 * Re * h * e + Re * 2 * i * e + 3 * G + D]
        return max(moments_e)
    down = held + R * i * e + D  # bmm(down)'s backward: the product's gradient and D
    gate_up = held - 2 * R * i * e + R * (2 * i + h) * e + G  # bmm(gate_up)'s: act, product freed
    return max(down, gate_up)


def expert_parallel(model: "ModelSpec | str", *, ep: int, dp: int, batch_size: int, seq_len: int,
                    top_k: int | None = None, capacity_factor: float | None = None, precision: str = "bf16-mixed",
                    optimizer: str = "adamw", zero_stage: int = 0, link: "str | _coll.Link" = "nvlink4",
                    device: str = "cuda", received_rows: "tuple[int, ...] | None" = None,
                    kept_rows: "tuple[int, ...] | None" = None, home_rows: "tuple[int, ...] | None" = None,
                    zero_partition: str = "even",
                    rank: int = 0) -> dict[str, Any]:
    """One rank of `dp` data-parallel ranks training an MoE whose routed experts are split over `ep` of them
    (ep divides dp and num_experts; edp = dp/ep ranks hold the same experts), on its own `batch_size`
    sequences of `seq_len` tokens (T = b s tokens, k = top_k choices each).

    States (bytes; `memory.param_bytes` / `optimizer_state_bytes` per element, fp32 master as `memory` counts):
    dense tensors (attention, norms, embeddings, head, routers, shared experts) whole, routed experts E/ep per
    MoE layer; gradients likewise; ZeRO stage 1 shards optimizer states (2: and gradients) of dense tensors
    over dp, of experts over edp: `zero_partition` "even" (ceil division: Megatron's distributed optimizer
    pads its flat buffer) or "greedy" (whole tensors, as `ZeroRedundancyOptimizer` assigns them: the answer is
    for global rank `rank`, its dense shard at group rank `rank`, its expert shard at `rank // ep`, one
    optimizer per group, stepped one after the other). AdamW's step counts: 4 bytes per tensor held.

    Dispatch buffers per MoE layer, in the activation dtype (h values a row):
    - sent: dropless T k rows (each choice's copy of its token, sorted by expert); with a capacity factor
      the E x C padded buffer, C = `moe.expert_capacity(T, E, k, capacity_factor)` of the rank's own tokens;
    - received: dropless T k (E/ep)/E x ep = T k rows expected from a balanced router, worst ep T min(k, E/ep)
      (every token of the EP group picks this rank's experts); with a capacity (E/ep) C ep rows exactly.
    Communication per MoE layer (bytes leaving the rank): dispatch and combine forward, their two backward
    all-to-alls, each (ep-1)/ep of the buffer (a balanced router's share stays home); per step the experts'
    gradients all-reduced over edp and the dense ones over dp. Seconds: alpha-beta on `link` (`collectives`).

    Peak: for a step of `vramlab.measure.expert_parallel`'s EP model (RMSNorm, SDPA attention, the transformers expert
    -- down(act(gate) * up) on 3-D gate_up/down tensors -- as a loop over the rank's experts (dropless) or two
    batched matmuls (capacity); derived from its code, validated fp32 on the CPU), the largest of three moments:
    - "loss": the states, every block's saved tensors (`_ep_saved_dense_layer`; a dense MLP 4 T I; the shared
      expert 4 T w and its gate; the router's fp32 probabilities, top-k ids and weights; the received rows
      regrouped by expert and per row 4 i for gate/up's output, act(gate), up and the product; the combine's
      weighted rows; the index tensors), the head's (final norm, lm_head input, fp32 log-softmax) and the logits;
    - "experts backward": inside the last MoE layer's experts' backward, the head's, shared expert's and
      combine's saved tensors freed, the residual's and the received rows' gradients alive, and the weight
      gradients the 3-D expert tensors get whole per expert (select's / bmm's backward: G = E/ep x 2i x h,
      D = E/ep x h x i; summed out of place across experts, 3 G at once), at a balanced expert's rows;
    - "optimizer step": foreach AdamW's one copy of the stepped parameters (per optimizer under greedy ZeRO).
    `received_rows` / `kept_rows` / `home_rows` (one per MoE layer: rows received, choices kept, rows routed to
    this rank's own experts) replace the balanced router's expectation with a run's real routing (dropless
    routing depends on the data: that is what the measured peaks and bytes are checked with).

    Known limitations: the activations are those of the measured model, not of a fused kernel (grouped GEMM,
    DeepEP) nor of another attention (MLA); activations are counted in the compute dtype throughout; no rotary
    embedding, dropout or auxiliary load-balancing loss; an unbalanced router's experts (more rows on one expert)
    are not modelled beyond `received_rows`; the all-to-all is priced as one collective of the whole buffer (no
    overlap with compute, no hierarchical intra/inter-node dispatch); the counts exchanged before a dropless
    dispatch (E/ep integers per peer) are not counted; ZeRO-2's gradient shards are the even split."""
    spec = _moe_spec(model)
    ep, dp = check_count("ep", ep, hi=MAX_EP), check_count("dp", dp)
    E = spec.num_experts
    if dp % ep:
        raise ValueError(f"ep must divide dp (the experts are split over ep of the dp ranks), got ep={ep}, dp={dp}")
    if E % ep:
        raise ValueError(f"ep must divide {spec.name}'s {E} routed experts, got ep={ep}")
    b, s = check_count("batch_size", batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    k = spec.num_experts_per_tok if top_k is None else _checks.whole("top_k", top_k, hi=E)
    if capacity_factor is not None:
        capacity_factor = _checks.number("capacity_factor", capacity_factor, lo=0, lo_open=True,
                                         hi=_moe.MAX_CAPACITY_FACTOR, what="a number > 0 (None: dropless)")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("optimizer", optimizer, _optim.SHARDED)
    _checks.one_of("device", device, ("cuda", "cpu"))
    zero_stage = _checks.one_of("zero_stage", zero_stage, (0, 1, 2))
    zero_partition = _checks.one_of("zero_partition", zero_partition, ("even", "greedy"))
    rank = _checks.whole("rank", rank, lo=0, hi=dp - 1)
    lk = link if isinstance(link, _coll.Link) else _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)]
    edp, El, T = dp // ep, E // ep, b * s
    moe_layers = len(spec.moe_layer_ids)
    for name, rows in (("received_rows", received_rows), ("kept_rows", kept_rows), ("home_rows", home_rows)):
        if rows is not None and len(_checks.wholes(name, rows, lo=0)) != moe_layers:
            raise ValueError(f"{name} must hold one count per MoE layer ({moe_layers}), got {len(rows)}")
    # -- states
    dense_t, expert_t = _ep_tensors(spec, ep)
    n_dense, n_exp = sum(dense_t), sum(expert_t)
    pb = _mem.param_bytes(precision)
    params, grads, opt_states, own_d, own_e = _ep_states(dense_t, expert_t, ep=ep, dp=dp, edp=edp, rank=rank, pb=pb,
                                                         zero_stage=zero_stage, zero_partition=zero_partition,
                                                         optimizer=optimizer, precision=precision)
    states = sum(params.values()) + sum(grads.values()) + sum(opt_states.values())
    # -- dispatch buffers, one MoE layer
    nb = _prec.dtype_sizes(precision, device)
    e, h, i = nb["half"], spec.hidden_size, spec.moe_intermediate_size
    row = h * e
    if capacity_factor is None:
        C = None
        sent_rows, recv_expected, recv_worst = T * k, T * k, ep * T * min(k, El)
    else:
        C = _moe.expert_capacity(T, E, k, capacity_factor)
        sent_rows = recv_expected = recv_worst = E * C
    leave = Fraction(ep - 1, ep)
    a2a_sent = int(sent_rows * row * leave)  # one all-to-all's bytes leaving the rank
    sent = {"forward": 2 * a2a_sent, "backward": 2 * a2a_sent}
    sent_total = {d: moe_layers * v for d, v in sent.items()}
    if capacity_factor is None and home_rows is not None and received_rows is not None and ep > 1:
        # a run's routing: the dispatch sends all but the rows routed home, the combine returns all but those;
        # the backward's two all-to-alls carry the same rows' gradients the other way
        total = sum((T * k - m) + (r - m) for m, r in zip(home_rows, received_rows)) * row
        sent_total = {"forward": total, "backward": total}
        sent = {d: v // moe_layers for d, v in sent_total.items()}
    a2a_s = _coll.collective_time("all_to_all", ep, sent_rows * row, lk) if ep > 1 else 0.0
    grad_ar = {"dense": _coll.collective_time("all_reduce", dp, n_dense * pb, lk) if dp > 1 else 0.0,
               "experts": _coll.collective_time("all_reduce", edp, n_exp * pb, lk) if edp > 1 else 0.0}
    # -- activations of the measured model (read from `measure.expert_parallel`'s EP model; e bytes each), per block
    a, kv, d, V = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size
    dense_layer = _ep_saved_dense_layer(h, a, kv, d, b, s, e)
    mlp_dense = T * 4 * spec.intermediate_size * e  # gate's output, act(gate), up's output, the product
    shared_w = spec.num_shared_experts * (spec.shared_expert_intermediate_size or i)
    # the shared expert as a dense MLP; its gate: sigmoid's output (T, 1) and the expert's output (T, h)
    shared = (T * 4 * shared_w * e + (T * e + T * h * e if spec.shared_expert_gate else 0)) if shared_w else 0
    # router: fp32 softmax output (T, E), top-k ids (int64), the weights' sum (T, 1) and top-k weights (T, k);
    # dropless also keeps the normalised weights (T k) for the combine, a capacity keeps the kept ones
    router = T * E * 4 + T * k * 8 + T * e + T * k * e
    moe, combine, recv = [], [], []
    for layer in range(moe_layers):
        R = received_rows[layer] if received_rows is not None else recv_expected
        experts = R * (h + 4 * i) * e  # received rows regrouped by expert (the experts' input), gate/up, act, product
        if capacity_factor is None:
            # the combine's weighted rows (T k, h) and weights; the sort order, its inverse; the regrouping, its inverse
            comb = T * k * h * e + T * k * e
            moe.append(router + experts + comb + 2 * T * k * 8 + 2 * R * 8)
        else:
            kept = kept_rows[layer] if kept_rows is not None else min(T * k, E * C)
            # index_copy's source rows, the processed rows gathered back and the weighted ones (index_add's source),
            # the kept weights; the kept choices, their slots, their tokens (int64)
            comb = 2 * kept * h * e + kept * e
            moe.append(router + experts + kept * h * e + comb + 3 * kept * 8)
        combine.append(comb)
        recv.append(R)
    head = 2 * T * h * e + T * e + T * h * e + T * V * 4 + T * 8 + 4  # final norm, lm_head's input, log-softmax, labels
    saved = (spec.num_layers * dense_layer + (spec.num_layers - moe_layers) * mlp_dense + moe_layers * shared
             + sum(moe) + head)
    ids = T * 8
    base = states + ids
    moments = {"loss": base + saved + T * V * 4}  # + the logits, alive while the log-softmax is computed
    if moe_layers:
        # the last MoE layer's experts in the backward: the head's, the shared expert's and the combine's saved
        # tensors are freed; the residual's gradient (T, h) and the received rows' gradient (R, h) alive; the
        # weights' gradients of the 3-D expert tensors (`_ep_experts_backward`)
        R = recv[-1]
        # (the shared expert runs after the routed ones: its backward, first, has freed its saved tensors)
        held = base + saved - head - combine[-1] - shared + T * h * e + R * h * e
        # the combine's backward all-to-all: its input (the rows sent home: T k, or E C with a capacity) and its
        # output (R) gradient buffers, which gloo's work may still hold when the experts' backward starts (seen on
        # some ranks, not others: freed when the work is released)
        in_flight = ((T * k if capacity_factor is None else E * C) + R) * h * e
        held += in_flight
        moments["experts backward"] = _ep_experts_backward(held, R=R, El=El, h=h, i=i, e=e, pb=pb,
                                                           dropless=capacity_factor is None)
    # the step's foreach temporaries: one optimizer over the rank's tensors, or (greedy ZeRO) one per group in turn
    steps = [own_d, own_e] if zero_stage and zero_partition == "greedy" else [own_d + own_e]
    moments["optimizer step"] = base + max(_mem.optimizer_step_temporaries(optimizer, "foreach", t, sum(t), precision)
                                           for t in steps)
    peak_phase = max(moments, key=moments.get)
    return {"model": spec.name, "ep": ep, "dp": dp, "edp": edp, "experts_per_rank": El, "top_k": k,
            "capacity": C, "tokens_per_rank": T,
            "param_counts": {"dense": n_dense, "experts": n_exp},
            "expert_share": Fraction(n_exp * ep, n_exp * ep + n_dense) if n_exp else Fraction(0),
            "parameters": params, "gradients": grads, "optimizer_states": opt_states, "states": states,
            "dispatch_rows": {"sent": sent_rows, "received_expected": recv_expected, "received_worst": recv_worst},
            "dispatch_bytes": {"sent": sent_rows * row, "received_expected": recv_expected * row,
                               "received_worst": recv_worst * row},
            "sent_per_layer": sent, "sent_total": sent_total, "a2a_seconds_per_layer": {"forward": 2 * a2a_s, "backward": 2 * a2a_s},
            "grad_allreduce_bytes": {"dense": n_dense * pb, "experts": n_exp * pb},
            "grad_allreduce_seconds": grad_ar, "saved_activations": saved, "moe_layer_saved": moe,
            "dense_layer_saved": dense_layer,
            "peak": moments[peak_phase], "peak_phase": peak_phase, "moments": moments, "link": lk.name}


# ---------------------------------------------------------------------------- experts with tensor and pipeline parallelism
# Megatron-Core's "MoE parallel folding" (Liu et al. 2025, arXiv:2504.14960; megatron/core/parallel_state.py's
# expert groups, transformer/moe/experts.py): a pipeline stage's tp x dp ranks run its attention and dense
# layers as tp-way tensor parallelism replicated dp times, and the same ranks are re-folded for its MoE
# layers into etp x ep x edp: each rank holds E/ep routed experts, each split etp ways (gate/up by columns,
# down by rows), and the experts' optimizer states are sharded over the edp ranks holding the same ones.
_MLA_DUPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")  # MCore: "duplicated"
_MLA_COLUMN = ("q_b_proj", "kv_b_proj")


def _moe_tensor_share(spec: ModelSpec, name: str, numel: int, tp: int, ep: int, etp: int) -> tuple[str, int]:
    """(kind, elements one rank holds) of one parameter tensor: kind "experts" for the routed experts
    (E/ep of them, each 1/etp: transformers 5 keeps a layer's experts as 3-D tensors, E first), "dense" for
    the rest -- tensor-parallel as Megatron splits it (`parallel.tp_numel`: heads, MLP widths, vocabulary rows;
    MLA's up-projections by columns, its down-projections and their norms duplicated; the router's E x h
    weight and the norms whole on every rank)."""
    if _is_routed_expert(name):
        return "experts", numel // ep // etp
    last = name.rsplit(".", 2)[-2] if name.endswith(".weight") or name.endswith(".bias") else name.rsplit(".", 1)[-1]
    if last in _MLA_DUPLICATED or name.endswith("mlp.gate.weight"):
        return "dense", numel
    if last in _MLA_COLUMN:
        return "dense", numel // tp
    return "dense", tp_numel(name, numel, tp, spec.vocab_size)


def moe_layout_states(model: "ModelSpec | str", *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1,
                      etp: int = 1, zero_stage: int = 0, precision: str = "bf16-mixed",
                      optimizer: str = "adamw") -> dict[str, Any]:
    """Model states (bytes) one rank holds when an MoE trains on tp x pp x dp devices with its routed experts
    over ep ranks (Megatron-Core's parallel folding, above): per pipeline stage (`stage_layers`' even split;
    the first holds the embeddings, the last the final norm and head, and a tied embedding's copy), the
    dense tensors' tensor-parallel share (`_moe_tensor_share`) and E/ep of each MoE layer's experts, each
    1/etp. etp x ep must divide tp x dp (the stage's ranks); edp = tp dp / (etp ep) ranks hold the same
    experts. Gradients as the parameters; `zero_stage` 1 (Megatron's distributed optimizer, DeepSpeed ZeRO-1)
    shards the optimizer states (2: and the gradients) of the dense tensors over dp and of the experts over
    edp, evenly (ceil). Bytes per element as `memory` counts them (`param_bytes`, `optimizer_state_bytes`).

    Returns "stages" (one dict per stage: params/gradients/optimizer_states split into dense and experts,
    states, the stage's layers) and the busiest stage's "states", with the group sizes.

    Known limitations: states only (activations under TP/PP with experts, the dispatch under TP -- Megatron
    gathers a sequence-parallel shard's tokens before routing -- are not modelled here: `expert_parallel`
    prices one data-parallel rank's dispatch and step); no uneven first/last stages
    (`num_layers_in_first_pipeline_stage`), no context parallelism in the folding; fp32 gradient buffers
    (Megatron's `main_grad` under bf16 parameters) as `memory`'s precision says; MTP modules are not counted."""
    spec = _moe_spec(model)
    tp, pp, ep, dp, etp = (check_count(n, v, hi=MAX_EP if n in ("ep", "etp") else MAX_DEVICES)
                           for n, v in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp), ("etp", etp)))
    if tp * pp * dp > MAX_DEVICES:
        raise ValueError(f"tp x pp x dp must be at most {MAX_DEVICES:,} devices, got {tp * pp * dp:,}")
    _checks.divides_heads(spec, tp)
    for name, width in (("MLP width", spec.intermediate_size), ("shared experts' width",
                        spec.shared_expert_intermediate_size or spec.moe_intermediate_size)):
        if width and width % tp:
            raise ValueError(f"tp={tp} must divide {spec.name}'s {name} ({width})")
    if spec.num_experts % ep:
        raise ValueError(f"ep must divide {spec.name}'s {spec.num_experts} routed experts, got ep={ep}")
    if spec.moe_intermediate_size % etp:
        raise ValueError(f"etp must divide {spec.name}'s expert width ({spec.moe_intermediate_size}), got etp={etp}")
    if (tp * dp) % (etp * ep):
        raise ValueError(f"etp x ep must divide tp x dp (the experts are re-folded over a stage's tp x dp ranks), "
                         f"got etp x ep = {etp * ep}, tp x dp = {tp * dp}")
    if pp > spec.num_layers:
        raise ValueError(f"pp must be at most {spec.name}'s {spec.num_layers} blocks, got {pp}")
    zero_stage = _checks.one_of("zero_stage", zero_stage, (0, 1, 2))
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("optimizer", optimizer, _optim.SHARDED)
    edp = tp * dp // (etp * ep)
    layers = stage_layers(spec.num_layers, pp)
    pb = _mem.param_bytes(precision)
    stages = []
    for k in range(pp):
        n = {"dense": 0, "experts": 0}
        count = {"dense": 0, "experts": 0}
        for name, numel in spec.param_tensors():
            if not copies_on_stage(*tensor_placement(spec, name), k, pp, layers[k]):
                continue
            kind, share = _moe_tensor_share(spec, name, numel, tp, ep, etp)
            n[kind] += share
            count[kind] += 1
        over = {"dense": dp, "experts": edp}
        own = {d: (-(-n[d] // over[d]) if zero_stage else n[d]) for d in n}
        opt = {d: _mem.optimizer_state_bytes(optimizer, own[d], precision)
               + (4 * count[d] if optimizer in ("adam", "adamw") and not zero_stage else 0) for d in n}
        grads = {d: (-(-n[d] // over[d]) if zero_stage >= 2 else n[d]) * pb for d in n}
        params = {d: n[d] * pb for d in n}
        stages.append({"stage": k, "layers": layers[k], "param_counts": n, "parameters": params,
                       "gradients": grads, "optimizer_states": opt,
                       "states": sum(params.values()) + sum(grads.values()) + sum(opt.values())})
    worst = max(stages, key=lambda x: x["states"])
    return {"model": spec.name, "tp": tp, "pp": pp, "ep": ep, "etp": etp, "dp": dp, "edp": edp,
            "devices": tp * pp * dp, "zero_stage": zero_stage, "precision": precision, "stages": stages,
            "states": worst["states"], "busiest_stage": worst["stage"]}


__all__ = ["expert_parallel", "moe_layout_states", "MAX_EP"]
