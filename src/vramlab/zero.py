"""ZeRO (Rajbhandari et al. 2019, arXiv:1910.02054) and FSDP: model states partitioned across the
data-parallel ranks. Pure Python (no torch): runs in the browser too.

Stage 0 is plain data parallelism: every rank holds all model states. Stage 1 partitions the
optimizer states (each rank updates its 1/N of the parameters, then they are all-gathered); stage 2
also the gradients (reduce-scattered during the backward, each rank keeping only its shard); stage 3
the parameters too (each layer all-gathered just before its forward and again before its backward,
freed after). PyTorch's FSDP is ZeRO-3 (FSDP2: `fully_shard`); its SHARD_GRAD_OP is ZeRO-2.

What is here:
- `paper_per_rank`: the paper's per-rank formulas with K bytes of optimizer state per parameter
  (Figure 1: Psi = 7.5 B, K = 12, N = 64 -> 120, 31.4, 16.6, 1.9 GB);
- `deepspeed_estimate`: DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` and
  `estimate_zero3_model_states_mem_needs`), reproduced formula for formula, with the version that its
  documentation still prints for ZeRO-2 (4 Psi + 16 Psi / N) beside the one its code computes since
  PR #5099 (2 Psi + 18 Psi / N);
- `model_states`: what one rank holds between steps, in `memory`'s categories, for a real model and
  recipe, with what the Psi/N formulas leave out: the fp32 master partition even for an fp32 model,
  ZeRO-3's persistent small tensors and its reduce bucket;
- `estimate_rank`: one rank's peak in a step, `model_states` plus the step's worst phase (activations,
  the gradients' copies and buckets, stage 3's gathered parameters, FSDP2's units in flight);
- `communication`: bytes each rank sends per step (stages 0-2: 2 Psi, as one all-reduce or a
  reduce-scatter plus an all-gather; stage 3: 3 Psi) and their time on a link (`collectives`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from . import collectives as _coll
from . import memory as _mem
from .parallel import _count
from .specs import ModelSpec

Stage = Literal[0, 1, 2, 3]
STAGES: tuple[int, ...] = (0, 1, 2, 3)

# Bytes per parameter of each recipe: (16-bit or fp32 parameters as the model holds them, gradients,
# optimizer states incl. fp32 master weights = the paper's K). DeepSpeed's bf16/fp16 optimizers keep
# fp32 master weights and Adam's m and v (K = 12) beside 16-bit parameters and gradients.
RECIPES: dict[str, tuple[int, int, int]] = {
    "mixed-adam": (2, 2, 12),        # the paper's mixed-precision Adam: 2 + 2 + 12 = 16 B/param
    "fp32-adam": (4, 4, 8),          # fp32 model, Adam's m and v
    "bf16-fp32-grads": (2, 4, 12),   # DeepSpeed's bf16 optimizer accumulating gradients in fp32 (Ultra-Scale Playbook: 20 B)
}


def _stage(stage) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    return int(stage)


def _recipe(recipe: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter of a recipe, or a ValueError."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[recipe]


def _psi(n_params) -> int:
    return _count("n_params", n_params, lo=0, hi=10**15)


def paper_per_rank(n_params: int, n_ranks: int, stage: Stage, *, k: int = 12, param_bytes: int = 2,
                   grad_bytes: int = 2) -> _mem.MemoryBreakdown:
    """Model states per rank by the ZeRO paper (Section 5, Figure 1): 2 Psi + 2 Psi + K Psi, the
    optimizer states divided by N from stage 1, the gradients from stage 2, the parameters at stage 3.
    Exact integers: each partition rounded up (a rank holds ceil(x / N) of a flat buffer)."""
    psi, n, s = _psi(n_params), _count("n_ranks", n_ranks), _stage(stage)
    for name, v in (("k", k), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        _count(name, v, lo=0, hi=64)

    def share(total: int, split: bool) -> int:
        return -(-total // n) if split else total

    return _mem.MemoryBreakdown(parameters=share(param_bytes * psi, s >= 3), gradients=share(grad_bytes * psi, s >= 2),
                                optimizer_states=share(k * psi, s >= 1),
                                label=f"ZeRO-{s} model states per rank, N = {n} (paper)")


def paper_figure1() -> list[tuple[int, float]]:
    """The paper's Figure 1: Psi = 7.5 B parameters, K = 12, N_d = 64: GB per device, stages 0-3."""
    return [(s, paper_per_rank(7_500_000_000, 64, s).total / 1e9) for s in STAGES]


# ----------------------------------------------------------------------------- DeepSpeed's estimators
def largest_layer_params(model: ModelSpec | str) -> int:
    """The parameters of the largest module counted without its children (what DeepSpeed's
    `estimate_zero3_model_states_mem_needs_all_live` calls the largest layer: usually the embedding)."""
    spec = _mem._resolve(model)
    by_module: dict[str, int] = {}
    for name, numel in spec.param_tensors():
        module = name.rsplit(".", 1)[0]
        by_module[module] = by_module.get(module, 0) + numel
    return max(by_module.values())


def deepspeed_estimate(n_params: int, stage: Literal[2, 3], *, gpus_per_node: int = 1, nodes: int = 1,
                       offload_optimizer: bool = False, offload_params: bool = False, largest_layer: int = 0,
                       zero_init: bool = True, buffer_factor: float = 1.5,
                       formula: Literal["code", "docs"] = "code") -> dict[str, int]:
    """{"gpu": bytes per GPU, "cpu": bytes per node} as DeepSpeed 0.19's estimators compute them
    (model states only: no activations, no buffers, which is why users measure 15-30x more; DeepSpeed
    issues #4527, #4093).

    ZeRO-2 (`stage_1_and_2.estimate_zero2_model_states_mem_needs`), formula="code" (since PR #5099):
    GPU 2 Psi + 18 Psi / N (16-bit parameters whole; 16-bit and fp32 gradients, fp32 master weights,
    Adam's two fp32 moments partitioned); with the optimizer offloaded 2 Psi on the GPU.
    formula="docs": the older 4 Psi + 16 Psi / N that DeepSpeed's documentation still prints.
    ZeRO-3 (`stage3.estimate_zero3_model_states_mem_needs`): 4 x largest layer + 18 Psi / N; offloading
    the optimizer leaves 2 Psi / N on the GPU, offloading the parameters too leaves the largest layer."""
    psi = _psi(n_params)
    g, nodes = _count("gpus_per_node", gpus_per_node), _count("nodes", nodes)
    total = g * nodes
    if stage not in (2, 3) or isinstance(stage, bool):
        raise ValueError(f"DeepSpeed's estimators cover ZeRO-2 and ZeRO-3, got stage {stage!r}")
    if formula not in ("code", "docs"):
        raise ValueError(f"formula must be 'code' or 'docs', got {formula!r}")
    if isinstance(buffer_factor, bool) or not isinstance(buffer_factor, (int, float)) or not 0 < buffer_factor < 100:
        raise ValueError(f"buffer_factor must be a positive number, got {buffer_factor!r}")
    for name, flag in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params),
                       ("zero_init", zero_init)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if stage == 2:
        if offload_params:
            raise ValueError("ZeRO-2 cannot offload parameters (ZeRO-3 can)")
        if formula == "docs":  # memory.rst's table: 4 Psi + 16 Psi / N, or 2 Psi with the optimizer offloaded
            gpu = 4 * psi + int(16 * psi / total) if not offload_optimizer else 2 * psi
        else:
            gpu = 2 * psi + int(18 * psi / total) if not offload_optimizer else 2 * psi
        cpu = psi * max(4 * total, 16) * buffer_factor if offload_optimizer else psi * 4 * g * buffer_factor
        return {"gpu": int(gpu), "cpu": int(cpu)}
    layer = 4 * _count("largest_layer", largest_layer, lo=0, hi=10**15)
    if offload_params and not offload_optimizer:
        raise ValueError("DeepSpeed offloads parameters only together with the optimizer")
    share = 1 / nodes
    if offload_optimizer and offload_params:
        gpu = layer
        cpu = psi * (18 * share if zero_init else max(4 * g, 18 * share)) * buffer_factor
    elif offload_optimizer:
        gpu = layer + int(2 * psi / total)
        cpu = psi * (16 * share if zero_init else max(4 * g, 16 * share)) * buffer_factor
    else:
        gpu = layer + int(18 * psi / total)
        cpu = (largest_layer if zero_init else psi) * 4 * g * buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}


# ----------------------------------------------------------------------------- a real model, per rank
IMPLEMENTATIONS: tuple[str, ...] = ("paper", "deepspeed", "fsdp2")
REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default, in elements
PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default, in elements
PREFETCH = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size default, in elements


def persistent_params(model: ModelSpec | str, threshold: int = PERSISTENCE) -> int:
    """Parameters that ZeRO-3 keeps whole on every rank (tensors below the persistence threshold),
    as well as their partition."""
    spec = _mem._resolve(model)
    _count("threshold", threshold, lo=0, hi=10**15)
    return sum(n for _, n in spec.param_tensors() if n < threshold)


def model_states(model: ModelSpec | str, n_ranks: int, stage: Stage, *, recipe: str = "mixed-adam",
                 implementation: str = "deepspeed", reduce_bucket: int = REDUCE_BUCKET,
                 persistence_threshold: int = PERSISTENCE) -> _mem.MemoryBreakdown:
    """One rank's model states, in `memory`'s categories.

    implementation="paper": the ZeRO paper's formulas for `recipe` (`paper_per_rank`): the peak of a
    step, with every gradient counted.

    implementation="deepspeed" or "fsdp2": what stays allocated *between* steps with each library's
    defaults, as lab 4 measured it (the gradients are freed after the step in both; the step's own
    peak adds gradients, buckets and activations on top):
    - DeepSpeed ZeRO-0: the model and the optimizer's states as the recipe has them.
    - ZeRO-1/2: the model whole (a flat buffer), and from stage 1 on a fp32 master partition beside
      Adam's fp32 moments, *even for an fp32 model*: 12 bytes per parameter over N.
    - ZeRO-3: the parameters' partition plus every tensor smaller than the persistence threshold
      whole (on one rank the partition is the whole model, held once); the gradients' partition (a flat buffer that stays); 12 bytes per parameter over N of
      optimizer states; and the reduce bucket (`reduce_bucket_size`, 5e8 elements by default, in the
      gradients' dtype: 2 GB in fp32, whatever the model's size), counted under `other`.
    - FSDP2 (`fully_shard`, the optimizer built on the sharded parameters): fp32 parameters (its
      `MixedPrecisionPolicy` casts a gathered copy for compute) and Adam's fp32 moments, sharded over
      N; nothing else between steps."""
    spec = _mem._resolve(model)
    n, s = _count("n_ranks", n_ranks), _stage(stage)
    pb, gb, k = _recipe(recipe)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    _count("reduce_bucket", reduce_bucket, lo=0, hi=10**12)
    psi = spec.params
    label = f"{spec.name}: ZeRO-{s} per rank, N = {n}, {recipe} ({implementation})"
    if implementation == "paper":
        base = paper_per_rank(psi, n, s, k=k, param_bytes=pb, grad_bytes=gb)
        return _mem.MemoryBreakdown(**base.to_dict(), label=label)
    share = -(-psi // n)
    if implementation == "fsdp2":
        if s != 3:
            raise ValueError("FSDP2's fully_shard is ZeRO-3 (stage 3); ZeRO-2 is reshard_after_forward=False, not modelled")
        # the sharded parameters stay fp32 (MixedPrecisionPolicy casts a gathered copy for compute)
        return _mem.MemoryBreakdown(parameters=share * 4, optimizer_states=share * 8,
                                    label=label.replace(f"ZeRO-{s}", "FSDP2"))
    if s == 0:
        return _mem.MemoryBreakdown(parameters=psi * pb, optimizer_states=psi * k, label=label)
    states = share * (4 + 8)  # fp32 master partition + Adam's two fp32 moments
    if s in (1, 2):
        return _mem.MemoryBreakdown(parameters=psi * pb, optimizer_states=states, label=label)
    grad_dtype = 4 if pb == 4 else gb
    # persistent tensors stay whole beside their partition; on one rank the partition is the whole
    # tensor (one storage), so nothing is held twice
    whole = persistent_params(spec, persistence_threshold) if n > 1 else 0
    return _mem.MemoryBreakdown(parameters=(share + whole) * pb,
                                gradients=share * grad_dtype, optimizer_states=states,
                                other=reduce_bucket * grad_dtype, label=label)


# ----------------------------------------------------------------------------- one rank's step
_ACT_PRECISION = {"mixed-adam": "bf16-fp32-states", "fp32-adam": "fp32", "bf16-fp32-grads": "bf16-fp32-states"}


def _step_side(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, precision: str, attention: str,
               device: str) -> int:
    """What one rank's forward and backward add to its model states at their worst moment, with
    local gradients in the model's dtype (`memory.training_phases`' phases up to the last block's
    backward: activations, temporaries and the gradients made so far)."""
    phases = _mem.training_phases(spec, batch_size=micro_batch_size, seq_len=seq_len, precision=precision,
                                  attention=attention, device=device, optimizer_impl="fused")
    return max(ph.activations + ph.temporaries + ph.gradients for ph in phases
               if not ph.phase.startswith(("embedding", "optimizer")))


def _units(spec: ModelSpec) -> tuple[int, int]:
    """(one block's parameters, the rest's): the FSDP2 units of `lab 4`'s wrapping, each block its
    own unit and the rest (embeddings, final norm, head) the root."""
    groups = spec.param_groups()
    blocks = max(spec.num_layers + spec.num_decoder_layers, 1)
    return groups["layers"] // blocks, spec.params - groups["layers"]


def _unit_params(spec: ModelSpec) -> int:
    """The largest FSDP2 unit of `lab 4`'s wrapping."""
    return max(_units(spec))


def estimate_rank(model: ModelSpec | str, n_ranks: int, stage: Stage, *, micro_batch_size: int, seq_len: int,
                  recipe: str = "mixed-adam", implementation: str = "deepspeed", attention: str = "sdpa",
                  reduce_bucket: int = REDUCE_BUCKET, optimizer_impl: str = "fused",
                  device: Literal["cuda", "cpu"] = "cuda", gpu=None) -> _mem.MemoryBreakdown:
    """One rank's peak in a training step: what stays between steps (`model_states`, as lab 4
    measured it) plus the step's worst moment, the larger of these phases:
    - forward/backward: the rank's micro-batch's activations, temporaries and local gradients
      (`memory.training_phases`; a 16-bit model for the 16-bit recipes, as DeepSpeed runs it);
    - DeepSpeed ZeRO-0, optimizer step: every gradient in the model's dtype, a second fp32 copy of
      them all (fp32: the flat copy the all-reduce works on; bf16: the BF16 optimizer's fp32
      accumulation) and the optimizer's temporaries;
    - ZeRO-1/2: the reduce bucket (`reduce_bucket` elements, allocated whole whatever the model's
      size) beside the backward, or beside the flat gradients and this rank's fp32 gradient partition;
    - ZeRO-3: the gathered parameters, twice (the all-gather's flat output and the parameters'
      copies), of every parameter above the persistence threshold (DeepSpeed gathers the whole model
      when it fits the prefetch window, as in lab 4; at most 2 x (prefetch bucket + largest layer)
      for a large model); the bucket and the gradient partition are between-step states already;
    - FSDP2: two units gathered (the one in use and the one prefetched) in the compute dtype, the
      unit's unsharded gradients, their fp32 copy that the reduce-scatter reads, and the fp32
      gradient shards.
    The optimizer's temporaries follow `optimizer_impl` (fused: none, DeepSpeed's FusedAdam; for-loop:
    torch's AdamW(foreach=False), as lab 4 runs it; foreach: a copy of the states it steps). On CUDA
    the two cuBLAS workspaces (sized for `gpu`) are under `other`, as in `memory`. Checked against lab
    4's measured step peaks (gloo ranks, fp32 and bf16, the largest over ranks and steps; the H100's
    allocator) in tests/test_zero.py: within 5 %, never below."""
    spec = _mem._resolve(model)
    n, s = _count("n_ranks", n_ranks), _stage(stage)
    pb, gb, k = _recipe(recipe)
    if implementation not in ("deepspeed", "fsdp2"):
        raise ValueError(f"implementation must be deepspeed or fsdp2, got {implementation!r}")
    if implementation == "fsdp2" and s != 3:
        raise ValueError("FSDP2's fully_shard is ZeRO-3 (stage 3)")
    _mem._check_choice(optimizer_impl, _mem.OPTIMIZER_IMPLS, "optimizer implementation")
    _mem._check_choice(device, ("cuda", "cpu"), "device")
    _mem._check_positive(batch_size=micro_batch_size, seq_len=seq_len)
    _mem._check_positions(spec, seq_len)
    bucket_elems = _count("reduce_bucket", reduce_bucket, lo=0, hi=10**12)
    between = model_states(spec, n, s, recipe=recipe, implementation=implementation, reduce_bucket=bucket_elems)
    psi = spec.params
    share = -(-psi // n)
    act = _step_side(spec, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=_ACT_PRECISION[recipe],
                     attention=attention, device=device)

    def temps(tensors: int, largest_pair: int) -> int:  # the optimizer step's own, on fp32 masters
        return {"fused": 0, "for-loop": largest_pair * 4, "foreach": tensors * 4}[optimizer_impl]

    if implementation == "fsdp2":
        unit = _unit_params(spec)
        # (gradients, activations, temporaries) of each phase, beyond the between-step states; on one
        # rank only the unit in use is gathered and the gradients need no reduce-scatter copy (as
        # measured on the H100, lab 4's one-rank run)
        grads, gathered = (share * 4 + unit * pb + unit * 4, 2 * unit * pb) if n > 1 else (share * 4, unit * pb)
        phases = {"backward, two units gathered" if n > 1 else "backward, one unit gathered": (grads, act, gathered),
                  "optimizer step": (share * 4, 0, temps(share, _mem._for_loop_peak(spec) // n + 1))}
    elif s == 0:
        phases = {"forward and backward": (0, act, 0),
                  # fp32: the all-reduce's flat copy (one bucket at most); 16-bit: the fp32 accumulation of all
                  "optimizer step": (psi * pb + (min(psi, bucket_elems) if pb == 4 else psi) * 4, 0,
                                     temps(psi, _mem._for_loop_peak(spec)))}
    elif s in (1, 2):
        bucket = bucket_elems * gb
        phases = {"backward, with the reduce bucket": (0, act, bucket),
                  "gradients reduced": (psi * pb + share * 4, 0, bucket + temps(share, 2 * share))}
    else:
        window = min(psi - persistent_params(spec), PREFETCH + largest_layer_params(spec))
        phases = {"backward, parameters gathered": (0, act, 2 * window * pb),
                  "optimizer step": (0, 0, temps(share, 2 * share))}
    name, (step_grads, step_act, step_tmp) = max(phases.items(), key=lambda kv: sum(kv[1]))
    workspaces = 2 * _mem.cublas_workspace_bytes(gpu) if device == "cuda" else 0
    label = "FSDP2" if implementation == "fsdp2" else f"DeepSpeed ZeRO-{s}"
    return _mem.MemoryBreakdown(parameters=between.parameters, gradients=between.gradients + step_grads,
                                optimizer_states=between.optimizer_states, activations=step_act,
                                temporaries=step_tmp, other=between.other + workspaces, phase=name,
                                label=f"{spec.name}: {label}, {n} ranks, {recipe}, micro-batch "
                                      f"{micro_batch_size} x {seq_len}")


# ----------------------------------------------------------------------------- communication
REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default, in elements
COMM_IMPLEMENTATIONS: tuple[str, ...] = ("paper", "deepspeed")


def communication(n_params: int, n_ranks: int, stage: Stage, *, bytes_per_value: int = 2,
                  link: str | _coll.Link = "nvlink4", implementation: str = "paper") -> dict[str, float]:
    """Bytes each rank sends per step and their time on `link` (ring collectives, `collectives`).

    implementation="paper" (Rajbhandari+19, section 7): stages 0-2 move 2 Psi values per
    rank-equivalent: an all-reduce of the gradients (stage 0) or a reduce-scatter of the gradients
    plus an all-gather of the updated parameters (stages 1-2); each is (N-1)/N x S per rank. Stage 3
    all-gathers the parameters twice (forward and backward) and reduce-scatters the gradients: 3 Psi.

    implementation="deepspeed" (0.19's defaults): ZeRO-1/2 all-reduce each gradient bucket and keep
    their partition (`use_multi_rank_bucket_allreduce=True`, on every backend) before all-gathering
    the parameters: 3 Psi, half again the paper's. ZeRO-3 keeps a parameter gathered in the forward
    for its backward when fewer than `stage3_max_reuse_distance` (1e9) elements are fetched in
    between: a model below that gathers once, 2 Psi; a larger one twice, 3 Psi."""
    psi, n, s = _psi(n_params), _count("n_ranks", n_ranks), _stage(stage)
    _count("bytes_per_value", bytes_per_value, hi=8)
    _mem._check_choice(implementation, COMM_IMPLEMENTATIONS, "communication implementation")
    size = psi * bytes_per_value
    ds = implementation == "deepspeed"
    if s == 0:
        ops = [("all_reduce", "gradients")]
    elif s in (1, 2):
        ops = [("all_reduce" if ds else "reduce_scatter", "gradients"), ("all_gather", "parameters")]
    else:
        twice = not ds or psi > REUSE_DISTANCE
        ops = ([("all_gather", "parameters, forward")] + ([("all_gather", "parameters, backward")] if twice else [])
               + [("reduce_scatter", "gradients")])
    rows = [{"op": op, "what": what, "bytes_sent": _coll.bytes_sent_per_rank(op, n, size),
             "seconds": _coll.collective_time(op, n, size, link)} for op, what in ops]
    volume = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}
    return {"bytes_sent_per_rank": sum(r["bytes_sent"] for r in rows), "seconds": sum(r["seconds"] for r in rows),
            "volume_in_psi": sum(volume[op] for op, _ in ops), "collectives": rows}


# ----------------------------------------------------------------------------- does it fit
def fits(model: ModelSpec | str, n_ranks: int, stage: Stage, gpu, *, micro_batch_size: int, seq_len: int,
         expandable_segments: bool = False, max_search: int = 1 << 12, **kw) -> _mem.Fit:
    """Does one rank's step fit on `gpu`, and what is the largest micro-batch size that does?
    `memory.fit`'s definition (`memory.device_fit`: estimate + margin + fragmentation + CUDA context
    <= usable) applied to `estimate_rank` (whose keyword arguments `kw` are)."""
    from .specs import gpu as _gpu

    spec = _mem._resolve(model)
    g = _gpu(gpu)
    _mem._check_positive(micro_batch_size=micro_batch_size, max_search=max_search)
    if kw.get("device", "cuda") != "cuda":
        raise ValueError("fits() answers for a GPU: leave device at 'cuda'")

    def verdict(b: int, **found) -> _mem.Fit:
        est = estimate_rank(spec, n_ranks, stage, micro_batch_size=b, seq_len=seq_len, gpu=g, **kw)  # checks kw
        largest = _mem.largest_tensor_bytes(spec, batch_size=b, seq_len=seq_len,
                                            precision=_ACT_PRECISION[kw.get("recipe", "mixed-adam")],
                                            attention=kw.get("attention", "sdpa"))
        return _mem.device_fit(est, g, largest_tensor=largest, expandable_segments=expandable_segments, **found)

    here = verdict(micro_batch_size)
    lo = _mem.largest_true(lambda b: verdict(b).fits, limit=max_search, start=micro_batch_size)
    return dataclasses.replace(here, max_batch_size=lo, capped=lo >= max_search)
