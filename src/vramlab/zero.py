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
  reduce-scatter plus an all-gather; stage 3: 3 Psi) and their time on a link (`collectives`);
- gradient accumulation (`accumulation_steps` of `estimate_rank`, `rank_phases`, `communication`;
  FSDP2's `no_sync`): what each library keeps between micro-batches (`accumulation_held`) and which
  collectives run every micro-batch rather than once per optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from . import checks as _checks
from . import collectives as _coll
from . import memory as _mem
from . import specs as _specs
from . import fitting as _fitting
from . import activations as _act
from .specs import ModelSpec
from .step import Step

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


MAX_RANKS = 1 << 20  # data-parallel ranks: as parallel.MAX_DEVICES
MAX_ELEMENTS = 10**15  # parameters, bucket and threshold sizes in elements: far beyond any model


def _stage(stage, choices: tuple[int, ...] = STAGES) -> int:
    """A ZeRO stage as an int: a whole number (numpy's too; never a bool, 2.0 or '2') among `choices`."""
    try:
        v = _checks.whole("stage", stage, lo=0)
    except ValueError:
        v = None
    if v not in choices:
        raise ValueError(f"unknown stage {_checks.show(stage)}; choose from {', '.join(map(str, choices))}")
    return v


def _recipe(recipe: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter of a recipe, or a ValueError."""
    return RECIPES[_checks.one_of("recipe", recipe, RECIPES)]


def _psi(n_params) -> int:
    return _checks.whole("n_params", n_params, lo=0, hi=MAX_ELEMENTS)


def _ranks(n_ranks) -> int:
    return _checks.whole("n_ranks", n_ranks, hi=MAX_RANKS)


def _elements(name: str, value, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    return _checks.whole(name, value, lo=lo, hi=hi)


def paper_per_rank(n_params: int, n_ranks: int, stage: Stage, *, k: int = 12, param_bytes: int = 2,
                   grad_bytes: int = 2) -> _mem.MemoryBreakdown:
    """Model states per rank by the ZeRO paper (Section 5, Figure 1): 2 Psi + 2 Psi + K Psi, the
    optimizer states divided by N from stage 1, the gradients from stage 2, the parameters at stage 3.
    Exact integers: each partition rounded up (a rank holds ceil(x / N) of a flat buffer)."""
    psi, n, s = _psi(n_params), _ranks(n_ranks), _stage(stage)
    k, param_bytes, grad_bytes = (_checks.whole(name, v, lo=0, hi=64) for name, v in
                                  (("k", k), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)))

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
    spec = _specs.resolve(model)
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
    g = _checks.whole("gpus_per_node", gpus_per_node, hi=MAX_RANKS)
    nodes = _checks.whole("nodes", nodes, hi=MAX_RANKS)
    total = g * nodes
    try:
        stage = _stage(stage, (2, 3))
    except ValueError:
        raise ValueError(f"stage must be 2 or 3 (DeepSpeed's estimators cover ZeRO-2 and ZeRO-3), "
                         f"got {_checks.show(stage)}") from None
    _checks.one_of("formula", formula, ("code", "docs"))
    buffer_factor = _checks.number("buffer_factor", buffer_factor, lo=0, lo_open=True, hi=100, hi_open=True)
    offload_optimizer = _checks.flag("offload_optimizer", offload_optimizer)
    offload_params = _checks.flag("offload_params", offload_params)
    zero_init = _checks.flag("zero_init", zero_init)
    largest_layer = _elements("largest_layer", largest_layer)
    if stage == 2:
        if offload_params:
            raise ValueError("offload_params=True needs stage 3: ZeRO-2 cannot offload parameters (ZeRO-3 can)")
        if formula == "docs":  # memory.rst's table: 4 Psi + 16 Psi / N, or 2 Psi with the optimizer offloaded
            gpu = 4 * psi + int(16 * psi / total) if not offload_optimizer else 2 * psi
        else:
            gpu = 2 * psi + int(18 * psi / total) if not offload_optimizer else 2 * psi
        cpu = psi * max(4 * total, 16) * buffer_factor if offload_optimizer else psi * 4 * g * buffer_factor
        return {"gpu": int(gpu), "cpu": int(cpu)}
    layer = 4 * largest_layer
    if offload_params and not offload_optimizer:
        raise ValueError("offload_params=True needs offload_optimizer=True: DeepSpeed offloads parameters only "
                         "together with the optimizer")
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
    spec = _specs.resolve(model)
    threshold = _elements("threshold", threshold)
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
    spec = _specs.resolve(model)
    n, s = _ranks(n_ranks), _stage(stage)
    pb, gb, k = _recipe(recipe)
    _checks.one_of("implementation", implementation, IMPLEMENTATIONS)
    reduce_bucket = _elements("reduce_bucket", reduce_bucket, hi=10**12)
    persistence_threshold = _elements("persistence_threshold", persistence_threshold)
    psi = spec.params
    label = f"{spec.name}: ZeRO-{s} per rank, N = {n}, {recipe} ({implementation})"
    if implementation == "paper":
        base = paper_per_rank(psi, n, s, k=k, param_bytes=pb, grad_bytes=gb)
        return _mem.MemoryBreakdown(**base.to_dict(), label=label)
    share = -(-psi // n)
    if implementation == "fsdp2":
        if s != 3:
            raise ValueError(f"stage must be 3 with implementation='fsdp2', got {s}: FSDP2's fully_shard is ZeRO-3; "
                             "ZeRO-2 is reshard_after_forward=False, not modelled")
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
ACT_PRECISION = {"mixed-adam": "bf16-fp32-states", "fp32-adam": "fp32", "bf16-fp32-grads": "bf16-fp32-states"}
ALLREDUCE_BUCKET = 500_000_000  # DeepSpeed's engine all-reduces ZeRO-0's gradients in flat buffers of this many elements
MAX_LIVE = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default, in elements
REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default, in elements


def zero_units(spec: ModelSpec) -> tuple[int, int]:
    """(the largest block's parameters, the rest's): the FSDP2 units of lab 4's wrapping, each block
    its own unit and the rest (embeddings, final norm, head) the root."""
    blocks = _block_params(spec)
    return max(blocks, default=0), spec.params - sum(blocks)


def block_index(name: str) -> int | None:
    """The block a parameter belongs to (GPT-2's `h.i`, Llama/OPT/NeoX's `layers.i`, T5's `block.i`)."""
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part in ("h", "layers", "block") and parts[k + 1].isdigit():
            return int(parts[k + 1])
    return None


def block_tensor_sizes(spec: ModelSpec) -> list[int]:
    """Elements of each parameter tensor inside a block."""
    return [n for name, n in spec.param_tensors() if block_index(name) is not None]


def _block_params(spec: ModelSpec) -> list[int]:
    """Parameters per block (encoder blocks, then decoder blocks)."""
    per: dict[tuple[str, int], int] = {}
    for name, n in spec.param_tensors():
        i = block_index(name)
        if i is not None:
            key = ("decoder" if "decoder." in name and spec.family == "t5" else "", i)
            per[key] = per.get(key, 0) + n
    return list(per.values())


def partition_touches(model: ModelSpec | str, n_ranks: int) -> list[int]:
    """Per rank, the elements of whole parameters that overlap its partition of DeepSpeed's flat buffer
    (ZeRO-1/2's `grads_in_partition` is allocated for every parameter that touches the partition,
    whole): at least ceil(Psi / N) for most ranks, and all of a large embedding that straddles a
    boundary. Rank N-1 owns the end of the buffer: the last blocks and the head, whose gradients the
    backward makes first."""
    spec = _specs.resolve(model)
    n = _ranks(n_ranks)
    part = -(-spec.params // n)
    touch, start = [0] * n, 0
    for _, numel in spec.param_tensors():
        end = start + numel
        for r in range(start // part, min((end - 1) // part, n - 1) + 1):
            touch[r] += numel
        start = end
    return touch


def partition_touch(model: ModelSpec | str, n_ranks: int) -> int:
    """The most elements any rank's gradient partition holds (`partition_touches`)."""
    return max(partition_touches(model, n_ranks))


MAX_ACCUMULATION = 1 << 16  # micro-batches per optimizer step
# the phases of a step that happen once, at the accumulation boundary (after the last micro-batch's backward)
_BOUNDARY_PHASES = ("gradients all-reduced (flat copy)", "gradients reduced into the partition",
                    "root's gradients reduce-scattered", "optimizer step")


def _accumulation(accumulation_steps) -> int:
    return _checks.whole("accumulation_steps", accumulation_steps, hi=MAX_ACCUMULATION)


def _no_sync(no_sync, implementation: str) -> bool:
    no_sync = _checks.flag("no_sync", no_sync)
    if no_sync and implementation != "fsdp2":
        raise ValueError(f"no_sync=True needs implementation='fsdp2' (FSDP2's set_requires_gradient_sync(False)), got "
                         f"{_checks.show(implementation)}: DeepSpeed decides by stage (ZeRO-0/1 reduce once per step, "
                         "ZeRO-2/3 every micro-batch)")
    return no_sync


# ----------------------------------------------------------------------------- a sharded step's settings
# a rank's options besides the model, ranks and stage: the library's (a `Ranks`) and the step's (a `Step`: the
# micro-batch and sequence, given by name, the precision and optimizer, which follow the recipe)
RANK_OPTIONS: tuple[str, ...] = ("recipe", "implementation", "reduce_bucket", "max_live_parameters",
                                 "persistence_threshold", "prefetch_bucket", "max_reuse_distance", "no_sync")
STEP_OPTIONS: tuple[str, ...] = ("attention", "optimizer_impl", "device", "gpu", "use_cache", "accumulation_steps",
                                 "recompute", "loss", "loss_chunk_tokens")


@dataclass(frozen=True)
class Ranks:
    """How a training step is sharded over data-parallel ranks, checked once: `n_ranks` ranks at ZeRO `stage`
    (DeepSpeed's, or FSDP2's fully_shard: stage 3), the bytes-per-parameter `recipe` (`RECIPES`), and the
    library's buffers in elements (DeepSpeed's defaults: `reduce_bucket_size`, `stage3_max_live_parameters`,
    `stage3_param_persistence_threshold`, `stage3_prefetch_bucket_size`, `stage3_max_reuse_distance`);
    `no_sync`: FSDP2's `set_requires_gradient_sync(False)` on every micro-batch but the last."""

    n_ranks: int
    stage: int
    recipe: str = "mixed-adam"
    implementation: str = "deepspeed"
    reduce_bucket: int = REDUCE_BUCKET
    max_live_parameters: int = MAX_LIVE
    persistence_threshold: int = PERSISTENCE
    prefetch_bucket: int = PREFETCH
    max_reuse_distance: int = REUSE_DISTANCE
    no_sync: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "n_ranks", _ranks(self.n_ranks))
        put(self, "stage", _stage(self.stage))
        _recipe(self.recipe)
        _checks.one_of("implementation", self.implementation, ("deepspeed", "fsdp2"))
        put(self, "no_sync", _no_sync(self.no_sync, self.implementation))
        if self.implementation == "fsdp2" and self.stage != 3:
            raise ValueError(f"stage must be 3 with implementation='fsdp2', got {self.stage}: FSDP2's fully_shard is "
                             "ZeRO-3")
        put(self, "reduce_bucket", _elements("reduce_bucket", self.reduce_bucket, lo=1, hi=10**12))
        put(self, "max_live_parameters", _elements("max_live_parameters", self.max_live_parameters, lo=1))
        put(self, "prefetch_bucket", _elements("prefetch_bucket", self.prefetch_bucket))
        put(self, "max_reuse_distance", _elements("max_reuse_distance", self.max_reuse_distance))
        put(self, "persistence_threshold", _elements("persistence_threshold", self.persistence_threshold))


def _check_pair(step: Step, ranks: Ranks) -> None:
    """What a sharded step models: Adam's recipes at their precision, recompute none or full and the loss
    variants under FSDP2 only, no frozen base or per-parameter stepping."""
    _specs.resolve(step.model)  # a mixture of experts is refused here (one-device training only)
    if step.precision != ACT_PRECISION[ranks.recipe]:
        raise ValueError(f"a Step for recipe {ranks.recipe!r} has precision {ACT_PRECISION[ranks.recipe]!r}, got "
                         f"{step.precision!r}")
    if step.optimizer not in ("adamw", "adam") or step.trainable_params is not None or step.optimizer_in_backward:
        raise ValueError("a sharded step models Adam on every parameter, stepped after the backward: leave "
                         "optimizer, trainable_params and optimizer_in_backward at their defaults")
    _checks.one_of("recompute", step.recompute, ("none", "full"))
    if (step.recompute != "none" or step.loss != "whole") and ranks.implementation != "fsdp2":
        raise ValueError(f"recompute and loss are modelled with implementation='fsdp2' only (the DeepSpeed phases were "
                         f"measured without them), got recompute={_checks.show(step.recompute)}, "
                         f"loss={_checks.show(step.loss)}")


def sharded_step(model: "ModelSpec | str | Step", n_ranks: "int | Ranks", stage: "Stage | None" = None, *,
                 micro_batch_size: int | None = None, seq_len: int | None = None,
                 options: dict | None = None, where: str = "rank_phases") -> tuple[Step, Ranks]:
    """The checked (Step, Ranks) of a rank's arguments: a Step and a Ranks as they are, or a model with
    `n_ranks`, `stage`, the micro-batch and sequence and `options` (RANK_OPTIONS and STEP_OPTIONS; the
    Step's precision is the recipe's, its optimizer_impl by default "fused", DeepSpeed's and FSDP2's)."""
    options = dict(options or {})
    if isinstance(model, Step) or isinstance(n_ranks, Ranks):
        if not (isinstance(model, Step) and isinstance(n_ranks, Ranks)) or options or \
                (stage, micro_batch_size, seq_len) != (None, None, None):
            raise ValueError(f"{where} takes a Step and a Ranks, or a model, n_ranks, stage, micro_batch_size, "
                             "seq_len and options, not a mix")
        _check_pair(model, n_ranks)
        return model, n_ranks
    _checks.no_unknown(where, options, RANK_OPTIONS + STEP_OPTIONS)
    spec = _specs.resolve(model)
    ranks = Ranks(n_ranks, stage, **{k: options.pop(k) for k in RANK_OPTIONS if k in options})
    micro_batch_size = _checks.whole("micro_batch_size", micro_batch_size)
    _checks.one_of("recompute", options.get("recompute", "none"), ("none", "full"))
    step = Step(spec, batch_size=micro_batch_size, seq_len=seq_len, precision=ACT_PRECISION[ranks.recipe],
                **{"optimizer_impl": "fused", **options})
    _check_pair(step, ranks)
    return step, ranks


def accumulation_held(model: ModelSpec | str, n_ranks: int, stage: Stage, *, recipe: str = "mixed-adam",
                      implementation: str = "deepspeed", no_sync: bool = False,
                      reduce_bucket: int = REDUCE_BUCKET) -> dict[str, int | str]:
    """What one rank keeps between two micro-batches of one optimizer step, beyond `model_states`:
    {"bytes": ..., "what": ...}. From the sources (DeepSpeed 0.19.8, torch 2.13):

    DeepSpeed accumulates in the model's dtype unless `data_types.grad_accum_dtype` says fp32 (its
    default is the model's: `engine.get_data_types`); recipe "bf16-fp32-grads" is the fp32 case.
    - DeepSpeed ZeRO-0: the engine all-reduces only at the accumulation boundary
      (`engine.allreduce_gradients`: "Communicate only at gradient accumulation boundaries"), so every
      gradient accumulates whole in `param.grad`: Psi x the gradients' bytes.
    - ZeRO-1 (`partition_gradients` False): the same (`reduce_gradients` runs at the boundary only), plus
      the reduce bucket the first gradient hook allocated (`setup_buckets`), kept until the boundary's
      epilogue; with fp32 accumulation of a bf16 model, the fp32 `grad_accum` copies.
    - ZeRO-2: gradients are reduced every micro-batch (`overlapping_partition_gradients_reduce_epilogue`
      runs at every backward); the rank's partition (every parameter that touches it, whole:
      `partition_touch`) is kept in `all_grad_tensors` and the next micro-batch's added to it
      (`independent_gradient_partition_epilogue`); with fp32 accumulation of a bf16 model, the compact
      fp32 partition (`_build_compact_grad_partition_buffer`).
    Measured (tests/test_zero_accumulation.py): fp32 only.
    - ZeRO-3: reduce-scattered every micro-batch and added into the fp32 gradient partition that stays
      between steps anyway (`partition_grads`: copy at micro-step 0, add_ after): nothing more.
    - FSDP2: every micro-batch reduce-scatters; the fp32 gradient shards (`sharded_param.grad`) stay and
      the next are added in: Psi / N x 4. With no_sync (`set_requires_gradient_sync(False)`) the
      unsharded gradients stay instead (`post_backward` returns before the reduce-scatter; under a
      bf16 policy `to_accumulated_grad_if_needed` upcasts them to the fp32 reduce dtype): Psi x 4."""
    spec = _specs.resolve(model)
    n, s = _ranks(n_ranks), _stage(stage)
    pb, gb, _ = _recipe(recipe)
    _checks.one_of("implementation", implementation, ("deepspeed", "fsdp2"))
    no_sync = _no_sync(no_sync, implementation)
    fp32_accum = pb == 2 and gb == 4  # a 16-bit model accumulating in fp32
    bucket = _elements("reduce_bucket", reduce_bucket, lo=1, hi=10**12)
    psi = spec.params
    if implementation == "fsdp2":
        if s != 3:
            raise ValueError(f"stage must be 3 with implementation='fsdp2', got {s}: FSDP2's fully_shard is ZeRO-3")
        if no_sync:
            return {"bytes": psi * 4, "what": "every unsharded gradient (fp32), not reduce-scattered"}
        return {"bytes": sum(-(-x // n) for _, x in spec.param_tensors()) * 4,
                "what": "this rank's fp32 gradient shards, the next micro-batch's added in"}
    if s == 0:
        return {"bytes": psi * (4 if fp32_accum else pb),
                "what": "every gradient, whole (all-reduced once, at the boundary)"}
    if s == 1:
        return {"bytes": psi * (4 if fp32_accum else pb) + bucket * pb,  # the bucket is allocated whole
                "what": "every gradient, whole, and the reduce bucket (reduced once, at the boundary)"}
    if s == 2:
        held = -(-psi // n) * 4 if fp32_accum else max(partition_touches(spec, n)) * pb
        return {"bytes": held, "what": "this rank's gradient partition (reduced every micro-batch, added up)"}
    return {"bytes": 0, "what": "nothing more: the fp32 gradient partition stays between steps anyway"}


def _accumulated(phases: list, steps: list, spec: ModelSpec, s: int, pb: int, acc: int,
                 implementation: str, no_sync: bool, held: int, block_shards: int) -> list:
    """`phases` (one micro-batch, then the boundary's) with a later micro-batch's phases inserted before
    the boundary: the same forward and backward with what `accumulation_held` keeps under them."""
    at = next((i for i, x in enumerate(phases) if x[0] in _BOUNDARY_PHASES), len(phases))
    micro = phases[:at]
    name = f"micro-batch 2-{acc}: " if acc > 2 else "micro-batch 2: "
    if implementation == "fsdp2":
        if no_sync:  # every unsharded gradient; the one being made is the backward's temporary, added in place
            later = [(name + ph, held, a, t) for ph, g, a, t in micro]
        else:  # every shard; the blocks' shards made in this backward are added into them
            later = [(name + ph, held + g - (block_shards if ph.startswith("embedding") else 0), a, t)
                     for ph, g, a, t in micro]
    elif s in (0, 1):  # every gradient (and ZeRO-1's bucket); the one being made is the backward's temporary,
        # which autograd adds into `param.grad` in place (measured: the OPT-like model's tied embedding)
        later = [(name + ph.phase, held, ph.activations, ph.temporaries) for ph in steps]
    elif s == 2:  # the accumulated partition beside this micro-batch's
        later = [(name + ph, g + held, a, t) for ph, g, a, t in micro]
    else:
        later = []
    return phases[:at] + later + phases[at:]


def rank_phases(model: "ModelSpec | str | Step", n_ranks: "int | Ranks", stage: "Stage | None" = None, *,
                micro_batch_size: int | None = None, seq_len: int | None = None, **options) -> list[_mem.MemoryBreakdown]:
    """One rank's memory at each moment of a training step that may peak, in step order (`.phase`
    names each); `estimate_rank` returns the largest. The forward and backward come from
    `memory.training_phases` (activations, the logits and their gradient, the temporaries of each
    backward, the gradients as autograd makes them); each library then holds, beside what stays
    between steps (`model_states`):

    - DeepSpeed ZeRO-0: every gradient at the end of the backward, plus the engine's flat copy of
      them for the all-reduce (buffers of 5e8 elements); the optimizer's step on every gradient (bf16:
      the BF16 optimizer's fp32 copy of every gradient beside the 16-bit ones);
    - ZeRO-1: the reduce bucket from the first gradient on (`reduce_bucket_size` elements, allocated
      whole), and after the backward every gradient at once while they are reduced bucket by bucket
      into this rank's partition (`grads_in_partition`: every parameter that touches the partition,
      whole: `partition_touch`);
    - ZeRO-2 (`partition_gradients`): no full set of gradients ever. Each gradient goes into the
      bucket as autograd makes it, is reduced when the bucket fills, and is freed unless this rank
      owns it (`reduce_ipg_grads` -> `clear_grad_attribute`); the partition buffer exists from the
      rank's first owned gradient on (counted from the backward's start: the rank owning the last
      layers gets them first);
    - ZeRO-3: the gathered parameters (every parameter above the persistence threshold when the model
      is within `stage3_max_live_parameters`, else that many plus the largest layer), in the forward's
      end and the backward's start; the gradient partition and bucket are between-step states;
    - FSDP2: the root unit (embeddings, final norm, head) gathered from the forward to the end of the
      backward; in the backward one block in use and the next prefetched, with the block's unsharded
      gradients (and their fp32 copy for the reduce-scatter under a bf16 policy) and the root's
      unsharded gradients until its reduce-scatter;
    - every ZeRO stage and FSDP2, the optimizer's step: this rank's fp32 gradient partition (the 16-bit
      gradients and the bucket are freed by then) and the optimizer's temporaries on it (`optimizer_impl`:
      for-loop = torch's AdamW(foreach=False), two copies of the tensor it updates; DeepSpeed steps one
      flat partition tensor, FSDP2 each parameter's shard).
    On CUDA the two cuBLAS workspaces are under `other`, as in `memory`. `use_cache`: the model trains
    with transformers' KV cache on (`memory.training_phases`; vramlab.measure.zero's models do, as their
    configs default).

    `accumulation_steps` (micro-batches per optimizer step, as `memory`'s): from the second micro-batch
    on, what each library keeps between micro-batches sits under the next forward and backward (phases
    named "micro-batch 2-k: ..."; `accumulation_held` says what and cites the code). `no_sync` (FSDP2
    only): `set_requires_gradient_sync(False)` on every micro-batch but the last, so the unsharded
    gradients are kept instead of reduce-scattered.

    `recompute` and `loss` / `loss_chunk_tokens` (`memory.training_phases`' plans; defaults: none, the whole
    loss, as every stored ZeRO measurement ran): FSDP2 only, as `context_parallel.context_parallel(shard_states=True)`
    composes it (its measured runs: full recompute, chunked and fused losses); under recompute an earlier
    block's backward frees the later block's checkpointed input, not its saved tensors.

    Called as `rank_phases(step, ranks)` with a `step.Step` and a `Ranks`, or with a model, `n_ranks`,
    `stage`, `micro_batch_size`, `seq_len` and options (RANK_OPTIONS, STEP_OPTIONS): `sharded_step`."""
    return _sharded_phases(*sharded_step(model, n_ranks, stage, micro_batch_size=micro_batch_size,
                                         seq_len=seq_len, options=options))


def _sharded_phases(step: Step, ranks: Ranks) -> list[_mem.MemoryBreakdown]:
    """`rank_phases` of a checked (Step, Ranks) pair."""
    spec, micro_batch_size, seq_len = step.model, step.batch_size, step.seq_len
    attention, device, gpu, use_cache = step.attention, step.device, step.gpu, step.use_cache
    optimizer_impl, acc, recompute, loss = step.optimizer_impl, step.accumulation_steps, step.recompute, step.loss
    loss_chunk_tokens = step.loss_chunk_tokens
    n, s, recipe, implementation, no_sync = ranks.n_ranks, ranks.stage, ranks.recipe, ranks.implementation, ranks.no_sync
    bucket, live, prefetch_bucket = ranks.reduce_bucket, ranks.max_live_parameters, ranks.prefetch_bucket
    reuse_distance, persistence_threshold = ranks.max_reuse_distance, ranks.persistence_threshold
    pb, gb, k = _recipe(recipe)
    between = model_states(spec, n, s, recipe=recipe, implementation=implementation, reduce_bucket=bucket,
                           persistence_threshold=persistence_threshold)
    psi = spec.params
    part = -(-psi // n)
    engine = _mem.training_phases(spec, batch_size=micro_batch_size, seq_len=seq_len, precision=ACT_PRECISION[recipe],
                                  attention=attention, device=device, optimizer_impl="fused", gpu=gpu,
                                  use_cache=use_cache, recompute=recompute, loss=loss,
                                  loss_chunk_tokens=loss_chunk_tokens)
    steps = [ph for ph in engine if not ph.phase.startswith("optimizer")]
    G = psi * pb  # every gradient, in the model's dtype
    V, e = spec.vocab_size, spec.word_embed_proj_dim or spec.hidden_size
    head_grad = V * e * pb

    def temps(sizes) -> int:  # the optimizer's own, on fp32 tensors
        return _mem.optimizer_step_temporaries("adamw", optimizer_impl, list(sizes), 0, "fp32") if optimizer_impl != "foreach" \
            else 4 * sum(sizes)

    phases: list[tuple[str, int, int, int]] = []  # (phase, gradients, activations, temporaries) beyond `between`

    def engine_phases(grads, extra=lambda ph: 0, skip_forward_extra: bool = False) -> None:
        for ph in steps:
            fwd = ph.phase.startswith("forward")
            phases.append((ph.phase, grads(ph), ph.activations, ph.temporaries + (0 if fwd and skip_forward_extra else extra(ph))))

    workspaces = steps[0].other
    def one_block() -> int:  # one block's saved activations: freed by the time an earlier block's backward runs
        r = _act.activation_bytes(spec, batch_size=micro_batch_size, seq_len=seq_len,
                                  precision=ACT_PRECISION[recipe], attention=attention, device=device,
                                  share=_act.DeviceShare(blocks=(0, 1), first=False, last=False),
                                  use_cache=use_cache, recompute=recompute)
        return r["one_layer"] if recompute == "none" else max(r["kept"])  # recomputed: its checkpointed input
    inputs = steps[0].inputs
    if implementation == "fsdp2":
        block, root = zero_units(spec)
        two = n > 1  # on one rank the all-gathers still copy (measured), but nothing is reduce-scattered
        R = root * pb  # the root unit, gathered from the forward to the end of the backward
        unit = block * pb  # one block's all-gather output (its unsharded parameters)
        flat_grads = block * 4 if two else 0  # a block's unsharded gradients, flat, in the reduce dtype (fp32)
        block_shards = -(-(psi - root) // n) * 4  # every block's reduce-scattered gradient shard, fp32, kept
        untied_head = 0 if spec.tie_word_embeddings else head_grad  # waits for the root's reduce-scatter
        made = _act.activation_bytes(spec, batch_size=micro_batch_size, seq_len=seq_len, precision=ACT_PRECISION[recipe],
                                     attention=attention, device=device, use_cache=use_cache,
                                     recompute=recompute)["block_grads_made"]
        own_made = min(made * pb, unit) if made is not None else 0
        for ph in steps:
            if ph.phase.startswith("forward"):
                extra, grads = R, 0
            elif ph.phase.startswith("loss forward"):  # a fused loss: the head's gradient made in the forward
                extra, grads = R, min(ph.gradients, head_grad)
            elif ph.phase.startswith("embedding"):  # the root's backward: the blocks' shards made, the
                extra, grads = R + flat_grads, block_shards + untied_head  # last block's reduce-scatter input
            elif "block" in ph.phase:
                # the last block (first in the backward): it and the next one prefetched, and the gradients
                # it has made by its peak (`activation_bytes`' "block_grads_made": in its MLP's backward the
                # down projection's), unsharded in the policy's parameter dtype until the block's reduce-scatter
                # (measured: lab 4's 2-rank GPT-2, c_proj's gradient at the step's peak)
                phases.append((ph.phase, min(ph.gradients, head_grad) + own_made, ph.activations,
                               ph.temporaries + R + 2 * unit))
                # an earlier block: the later block's activations freed, its gradients flat in the reduce
                # dtype until their reduce-scatter is waited on, and their fp32 shard kept; this block
                # gathered and, where a block precedes it (three blocks or more), that one prefetched: its
                # all-gather output (measured: an H100's Mistral block, gloo ranks' 2-block models)
                prefetched = unit if spec.num_layers + spec.num_decoder_layers >= 3 else 0
                phases.append(("backward of an earlier block", min(ph.gradients, head_grad) + -(-block // n) * 4,
                               max(ph.activations - one_block(), 0),
                               ph.temporaries + R + unit + prefetched + flat_grads))
                continue
            else:  # the logits' gradient and the head: the last block prefetched
                extra, grads = R + unit, min(ph.gradients, head_grad)
            phases.append((ph.phase, grads, ph.activations, ph.temporaries + extra))
        if two:  # the root's reduce-scatter: its gradients flat in fp32 and their shard, beside the blocks'
            # shards; under a 16-bit policy one of its 16-bit gradients (the largest) is still referenced
            largest_root = max((x for name, x in spec.param_tensors() if block_index(name) is None), default=0)
            phases.append(("root's gradients reduce-scattered", block_shards + -(-root // n) * 4, 0,
                           root * 4 + (largest_root * pb if pb == 2 else 0)))
        shard_sizes = [-(-x // n) for _, x in spec.param_tensors()]
        phases.append(("optimizer step", part * 4, 0, temps(shard_sizes)))
    elif s == 0:
        engine_phases(lambda ph: ph.gradients)
        if pb == 4:  # the engine's flat copy of the gradients for the all-reduce, then torch's step
            phases.append(("gradients all-reduced (flat copy)", G + min(psi, ALLREDUCE_BUCKET) * pb, 0, 0))
            phases.append(("optimizer step", G, 0, temps(n_ for _, n_ in spec.param_tensors())))
        else:  # DeepSpeed's BF16 optimizer: an fp32 copy of every gradient beside the 16-bit ones
            phases.append(("optimizer step", G + psi * 4, 0, temps(n_ for _, n_ in spec.param_tensors())))
    elif s in (1, 2):
        B = bucket * pb
        touches = partition_touches(spec, n)
        owned = max(touches) * pb
        if s == 1:
            engine_phases(lambda ph: ph.gradients + (0 if ph.phase.startswith("forward") else B))
            phases.append(("gradients reduced into the partition", G + B + owned, 0, 0))
        else:
            # the partition buffer is allocated at the first bucket reduced: in the LM head's backward on
            # the last rank (which owns the head and the last blocks), in the blocks' backward on the
            # ranks that own blocks; a gradient larger than the bucket waits outside it until the next
            # one flushes it
            last = touches[-1] * pb
            # such a gradient waits alone (`extra_large_param_to_reduce`) until the next gradient's hook
            # (any size: the bucket is already over) flushes it; average_tensor reduces it in slices, one
            # per owning rank, and allreduce_bucket copies slices grouped together flat (torch.cat; a lone
            # slice is not copied) while the arriving gradient exists too: counted as a whole copy beside
            # the next tensor larger than the bucket where a block has two (measured: lab 4's 1 x 16 run,
            # a Llama-like model with 4 MB tensors and 2 MB buckets)
            bigs = sorted((x for x in block_tensor_sizes(spec) if x > bucket), reverse=True)
            two_big = len(bigs) >= 2 * (spec.num_layers + spec.num_decoder_layers)
            big = bigs[0] * pb if bigs else 0
            flushing = (2 * bigs[0] + bigs[1]) * pb if two_big else big

            def zero2(ph) -> int:
                if ph.phase.startswith("forward"):
                    return 0
                if ph.phase.startswith("backward start"):
                    return B
                if ph.phase.startswith("embedding"):
                    return B + owned
                if "block" in ph.phase:
                    return B + last + big + min(ph.gradients, head_grad)
                return B + last + min(ph.gradients, head_grad)
            engine_phases(zero2)
            # an earlier block: the later block's activations freed, every rank's buffer allocated
            blk = next(ph for ph in steps if "block" in ph.phase)
            at = next(i for i, x in enumerate(phases) if x[0] == blk.phase) + 1
            phases.insert(at, ("backward of an earlier block", B + owned + flushing + min(blk.gradients, head_grad),
                               max(blk.activations - one_block(), 0), blk.temporaries))
        phases.append(("optimizer step", part * 4, 0, temps([part])))
    else:
        gatherable = psi - persistent_params(spec, persistence_threshold)
        largest = largest_layer_params(spec)
        # a parameter used again within `stage3_max_reuse_distance` elements of fetching is not released:
        # below that, every parameter gathered in the forward stays gathered into the backward
        # (max_live_parameters does not bound it, measured); above it, the live window does
        window = gatherable if gatherable <= reuse_distance else min(gatherable, live + largest)
        # the forward's all-gathers keep their flat buffers (the handles) beside each parameter's copy
        # out of them (`AllGatherCoalescedHandle.wait`: torch.cat), as many as are prefetched at once:
        # a second copy of up to the prefetch bucket plus the layer in use, until the loss
        flat = min(window, prefetch_bucket + largest)
        b_s = micro_batch_size * seq_len
        loss = b_s * V * (8 + (2 if pb == 2 else 0))  # the logits (16-bit and fp32) and their log-softmax
        for ph in steps:
            if ph.phase.startswith("forward"):
                phases.append(("forward, every parameter gathered", 0, max(ph.activations - loss, 0),
                               ph.temporaries + (window + flat) * pb))
            gathered = window * pb if ph.phase.startswith(("forward", "backward start")) else 0
            phases.append((ph.phase, 0 if ph.phase.startswith("forward") else min(ph.gradients, head_grad),
                           ph.activations, ph.temporaries + gathered))
        phases.append(("optimizer step", part * 4, 0, temps([part])))
    if acc > 1:
        held = accumulation_held(spec, n, s, recipe=recipe, implementation=implementation, no_sync=no_sync,
                                 reduce_bucket=bucket)["bytes"]
        phases = _accumulated(phases, steps, spec, s, pb, acc, implementation, no_sync, held,
                              block_shards if implementation == "fsdp2" else 0)
    label = "FSDP2" if implementation == "fsdp2" else f"DeepSpeed ZeRO-{s}"
    if acc > 1:
        label += f", {acc} micro-batches per step" + (" (no_sync)" if no_sync else "")
    return [_mem.MemoryBreakdown(parameters=between.parameters, gradients=between.gradients + g,
                                 optimizer_states=between.optimizer_states, activations=a, temporaries=t,
                                 inputs=inputs if a else 0, other=between.other + workspaces, phase=name,
                                 precision=ACT_PRECISION[recipe], device=device,
                                 label=f"{spec.name}: {label}, {n} ranks, {recipe}, micro-batch "
                                       f"{micro_batch_size} x {seq_len}")
            for name, g, a, t in phases]


def estimate_rank(model: "ModelSpec | str | Step", n_ranks: "int | Ranks", stage: "Stage | None" = None, *,
                  micro_batch_size: int | None = None, seq_len: int | None = None, **options) -> _mem.MemoryBreakdown:
    """One rank's peak in a training step: what stays between steps (`model_states`) plus the step's
    worst moment, the largest of `rank_phases` (whose docstring says what each library holds when).
    Validated against independent measurements on real gloo ranks (DeepSpeed 0.19.8, torch 2.13) for
    several model families, buckets smaller than the model, bf16 and fp32, 2 and 4 ranks
    (tests/test_validation.py): within 5 % of the measured step peak."""
    phases = rank_phases(model, n_ranks, stage, micro_batch_size=micro_batch_size, seq_len=seq_len, **options)
    return max(phases, key=lambda b: b.total)


# ----------------------------------------------------------------------------- communication
COMM_IMPLEMENTATIONS: tuple[str, ...] = ("paper", "deepspeed", "fsdp2")


def communication(n_params: int, n_ranks: int, stage: Stage, *, bytes_per_value: int = 2,
                  link: str | _coll.Link = "nvlink4", implementation: str = "paper", accumulation_steps: int = 1,
                  no_sync: bool = False, root_params: int = 0) -> dict[str, float]:
    """Bytes each rank sends per optimizer step and their time on `link` (ring collectives, `collectives`).

    implementation="paper" (Rajbhandari+19, section 7): stages 0-2 move 2 Psi values per
    rank-equivalent: an all-reduce of the gradients (stage 0) or a reduce-scatter of the gradients
    plus an all-gather of the updated parameters (stages 1-2); each is (N-1)/N x S per rank. Stage 3
    all-gathers the parameters twice (forward and backward) and reduce-scatters the gradients: 3 Psi.

    implementation="deepspeed" (0.19's defaults): ZeRO-1/2 all-reduce each gradient bucket and keep
    their partition (`use_multi_rank_bucket_allreduce=True`, on every backend) before all-gathering
    the parameters: 3 Psi, half again the paper's. ZeRO-3 keeps a parameter gathered in the forward
    for its backward when fewer than `stage3_max_reuse_distance` (1e9) elements are fetched in
    between: a model below that gathers once, 2 Psi; a larger one twice, 3 Psi.

    implementation="fsdp2" (stage 3; `fully_shard` on each block and the root): every unit is
    all-gathered for the forward, every unit but the root (`root_params`, not resharded after the
    forward) again for the backward, and every gradient reduce-scattered.

    `accumulation_steps` micro-batches per optimizer step: the gradients' collective runs once per step
    at ZeRO-0/1 (the engine reduces only at the accumulation boundary; DDP's `no_sync`) and every
    micro-batch at ZeRO-2/3 (the backward hooks reduce as gradients are made); the parameters' all-gather
    once per step at stages 1-2 (after the optimizer's step) and every micro-batch at stage 3 (each
    forward and backward needs them). FSDP2 reduce-scatters every micro-batch unless `no_sync`
    (`set_requires_gradient_sync(False)` but on the last: once per step)."""
    psi, n, s = _psi(n_params), _ranks(n_ranks), _stage(stage)
    bytes_per_value = _checks.whole("bytes_per_value", bytes_per_value, hi=8)
    _checks.one_of("implementation", implementation, COMM_IMPLEMENTATIONS)
    acc = _accumulation(accumulation_steps)
    no_sync = _no_sync(no_sync, implementation)
    root = _elements("root_params", root_params, hi=psi)
    link = _coll.as_link(link, "link")
    size = psi * bytes_per_value
    ds = implementation == "deepspeed"
    if implementation == "fsdp2":
        if s != 3:
            raise ValueError(f"stage must be 3 with implementation='fsdp2', got {s}: FSDP2's fully_shard is ZeRO-3")
        ops = [("all_gather", "parameters, forward", size, acc),
               ("all_gather", "parameters but the root's, backward", (psi - root) * bytes_per_value, acc),
               ("reduce_scatter", "gradients", size, 1 if no_sync else acc)]
    elif s == 0:
        ops = [("all_reduce", "gradients", size, 1)]
    elif s in (1, 2):
        ops = [("all_reduce" if ds else "reduce_scatter", "gradients", size, 1 if s == 1 else acc),
               ("all_gather", "parameters", size, 1)]
    else:
        twice = not ds or psi > REUSE_DISTANCE
        ops = ([("all_gather", "parameters, forward", size, acc)]
               + ([("all_gather", "parameters, backward", size, acc)] if twice else [])
               + [("reduce_scatter", "gradients", size, acc)])
    rows = [{"op": op, "what": what, "times_per_step": times,
             "bytes_sent": times * _coll.bytes_sent_per_rank(op, n, nbytes),
             "seconds": times * _coll.collective_time(op, n, nbytes, link)} for op, what, nbytes, times in ops]
    volume = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}
    return {"bytes_sent_per_rank": sum(r["bytes_sent"] for r in rows), "seconds": sum(r["seconds"] for r in rows),
            "volume_in_psi": sum(volume[op] * times * nbytes / size if size else 0 for op, _, nbytes, times in ops),
            "collectives": rows}


# ----------------------------------------------------------------------------- does it fit
# what `fits` passes on to `estimate_rank` (its own micro_batch_size, seq_len and gpu aside)
_ESTIMATE_OPTIONS = tuple(k for k in RANK_OPTIONS + STEP_OPTIONS if k != "gpu")


def fits(model: ModelSpec | str, n_ranks: int, stage: Stage, gpu, *, micro_batch_size: int, seq_len: int,
         expandable_segments: bool = False, max_search: int = 1 << 12, **kw) -> _fitting.Fit:
    """Does one rank's step fit on `gpu`, and what is the largest micro-batch size that does?
    `fitting.fit`'s definition (`fitting.device_fit`: estimate + margin + fragmentation + CUDA context
    <= usable) applied to `estimate_rank` (whose keyword arguments `kw` are)."""
    from .specs import gpu as _gpu

    _checks.no_unknown("zero.fits", kw, _ESTIMATE_OPTIONS)
    spec = _specs.resolve(model)
    g = _gpu(gpu)
    micro_batch_size = _checks.whole("micro_batch_size", micro_batch_size)
    max_search = _checks.whole("max_search", max_search)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    if kw.get("device", "cuda") != "cuda":
        raise ValueError(f"device must be 'cuda' in fits(), which answers for a GPU, got {_checks.show(kw['device'])}")
    _recipe(kw.get("recipe", "mixed-adam"))
    _checks.one_of("attention", kw.get("attention", "sdpa"), _act.ATTENTIONS)

    def verdict(b: int, **found) -> _fitting.Fit:
        est = estimate_rank(spec, n_ranks, stage, micro_batch_size=b, seq_len=seq_len, gpu=g, **kw)  # checks kw
        largest = _fitting.fragmentation_bytes(spec, batch_size=b, seq_len=seq_len,
                                            precision=ACT_PRECISION[kw.get("recipe", "mixed-adam")],
                                            attention=kw.get("attention", "sdpa"))
        return _fitting.device_fit(est, g, largest_tensor=largest, expandable_segments=expandable_segments, **found)

    here = verdict(micro_batch_size)
    lo = _fitting.largest_true(lambda b: verdict(b).fits, limit=max_search, start=micro_batch_size)
    return dataclasses.replace(here, max_batch_size=lo, capped=lo >= max_search)
