"""Data, tensor and pipeline parallelism: memory per device of a layout, communication, DDP's
buckets, and the planner that tries every layout of a cluster. Pure Python: no torch import.

A layout is `dp` data-parallel replicas x `tp` tensor-parallel ranks x `pp` pipeline stages
(dp * tp * pp devices), optionally with sequence parallelism (`sp`, Korthikanti et al. 2022) and
`micro_batches` micro-batches per step run by a pipeline schedule (`pipeline`: the bubble, the
schedules simulated, the micro-batches each stage holds in flight).

- Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053) splits each block's
  matrices by t: the first linear of the MLP and the q/k/v projections by columns (output features,
  i.e. attention heads) with their biases, the second linear of the MLP and the attention's output
  projection by rows (input features; their biases are replicated); the word embedding and the LM
  head by vocabulary. Norms and learned position embeddings are replicated.
- Pipeline parallelism splits the blocks into contiguous stages; the first stage also holds the
  embeddings, the last the final norm and the LM head (a tied head: the last stage keeps its own copy
  of the embedding matrix, whose gradient Megatron all-reduces with the first stage's).

Context parallelism is `context_parallel`, expert parallelism and MoE folding `expert_parallel`.
"""

from __future__ import annotations

import collections.abc as _abc
import dataclasses
import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from . import checks as _checks
from . import optimizers as _optim
from . import collectives as _coll
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import fitting as _fitting
from . import activations as _act
from . import pipeline as _pipe
from .specs import ModelSpec
from .step import Step

RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MAX_DEVICES = 1 << 20


def check_count(name: str, value, *, lo: int = 1, hi: int = MAX_DEVICES) -> int:
    """A whole number in [lo, hi] (numpy integers too), or a ValueError naming the argument."""
    return _checks.whole(name, value, lo=lo, hi=hi)


def _byte_counts(name: str, values, *, hint: str = "") -> list[int]:
    """A non-empty sequence (a list, a tuple, a numpy array; not a string or a mapping) of whole byte
    counts, as ints; `checks.whole` names a bad element by its index."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, _abc.Iterable):
        raise ValueError(f"{name} must be a non-empty list of byte counts{hint}, got {_checks.show(values)}")
    out = list(values)
    if not out:
        raise ValueError(f"{name} must be a non-empty list of byte counts{hint}, got an empty one")
    return [_checks.whole(f"{name}[{i}]", n, lo=0, hi=1 << 50) for i, n in enumerate(out)]


def _check_layout(layout) -> "Layout":
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a vramlab.parallel.Layout, got {_checks.show(layout)}")
    return layout


@dataclass(frozen=True, kw_only=True)
class Layout:
    """dp x tp x pp devices. `micro_batches` (m) per step and per data-parallel replica; `chunks`
    (v) model chunks per device for the interleaved schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    micro_batches: int = 1
    schedule: _pipe.Schedule = "1f1b"
    chunks: int = 1
    zero: int = 0  # 1: the optimizer states sharded over the dp replicas (ZeRO-1, Megatron's distributed optimizer)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            object.__setattr__(self, name, check_count(name, getattr(self, name)))
        object.__setattr__(self, "micro_batches", check_count("micro_batches", self.micro_batches, hi=_pipe.MAX_MICRO_BATCHES))
        object.__setattr__(self, "chunks", check_count("chunks", self.chunks, hi=1024))
        object.__setattr__(self, "sp", _checks.flag("sp", self.sp))
        try:
            zero = _checks.whole("zero", self.zero, lo=0, hi=1)
        except ValueError:
            raise ValueError(f"zero must be 0 or 1 (ZeRO-1: optimizer states sharded over dp), "
                             f"got {_checks.show(self.zero)}") from None
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "schedule", _pipe.check_schedule(self.schedule, self.pp, self.micro_batches, self.chunks,
                                                             names=("pp", "micro_batches", "chunks")))
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1: sequence parallelism splits along the tensor-parallel group")
        if self.zero and self.dp == 1:
            raise ValueError("zero=1 needs dp > 1: ZeRO-1 shards the optimizer states over the data-parallel replicas")
        if self.devices > MAX_DEVICES:
            raise ValueError(f"dp x tp x pp must be at most {MAX_DEVICES:,} devices (what this calculator models), "
                             f"got {self.devices:,}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


# ============================================================================ activations (Korthikanti+22)
def korthikanti_layer_activations(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                                  recompute: str = "none") -> Fraction:
    """Bytes of activations one transformer layer keeps per tensor-parallel rank, exactly as in
    Korthikanti et al. 2022 (arXiv:2205.05198) Table 2: 16-bit values, 1-byte dropout masks, the
    attention scores materialised (no FlashAttention).
        none, t = 1        sbh (34 + 5as/h)
        TP                 sbh (10 + 24/t + 5as/(ht))
        TP + SP            sbh/t (34 + 5as/h)
        TP + selective     sbh (10 + 24/t)          (+ SP: 34 sbh/t)
        full recompute     2 sbh
    An exact Fraction (t need not divide the terms)."""
    s, b, h, a = (check_count(n, v, hi=1 << 40) for n, v in (("s", s), ("b", b), ("h", h), ("a", a)))
    t = check_count("t", t)
    _checks.one_of("recompute", recompute, RECOMPUTE)
    sp = _checks.flag("sp", sp)
    if sp and t == 1:
        raise ValueError("sp=True needs t > 1: sequence parallelism splits along the tensor-parallel group")
    sbh = Fraction(s * b * h)
    if recompute == "full":
        return 2 * sbh
    scores = 0 if recompute == "selective" else Fraction(5 * a * s, h)
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + Fraction(24, t) + scores / t)



# ============================================================================ parameters per device
_COLUMN = ("c_attn", "q_proj", "k_proj", "v_proj", "query_key_value", "c_fc", "gate_proj", "up_proj", "fc1",
           "dense_h_to_4h")
_ROW = ("attn.c_proj", "o_proj", "out_proj", "attention.dense", "down_proj", "fc2", "dense_4h_to_h", "mlp.c_proj")
_VOCAB = ("wte", "embed_tokens", "embed_in", "lm_head")
_FIRST = ("wte", "wpe", "embed_tokens", "embed_in", "embed_positions", "project_in")
DECODER_FAMILIES = ("gpt2", "llama", "opt", "gpt_neox")


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part in ("h", "layers") and parts[k + 1].isdigit():
            return int(parts[k + 1])
    return None


def tp_numel(name: str, numel: int, t: int, vocab: int) -> int:
    """One rank's share of a tensor: column- and row-parallel weights (and column-parallel biases)
    divided by t; vocabulary-parallel matrices by rows, ceil(V/t) of them (the largest rank); the
    rest whole."""
    if any(name.startswith(k) for k in _VOCAB):
        return -(-vocab // t) * (numel // vocab)
    last = name.rsplit(".", 1)[-1]
    if any(k in name for k in _COLUMN) or (last == "weight" and any(k in name for k in _ROW)):
        return numel // t
    return numel


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous blocks per stage; the first num_layers % pp stages take one more."""
    num_layers, pp = check_count("num_layers", num_layers, hi=_checks.MAX_COUNT), check_count("pp", pp)
    return list(_stage_layers(num_layers, pp))


@functools.lru_cache(maxsize=256)
def _stage_layers(num_layers: int, pp: int) -> tuple[range, ...]:
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for k in range(pp):
        n = base + (1 if k < extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def _check_tp(spec: ModelSpec, t: int, name: str = "tp") -> int:
    """Megatron splits attention by heads (and key/value heads) and the MLP by its width: t divides them."""
    _checks.divides_heads(spec, t, name=name)
    if spec.intermediate_size % t:
        raise ValueError(f"{name}={t} must divide {spec.name}'s MLP width ({spec.intermediate_size})")
    return t


def _check_layout_model(spec: ModelSpec, layout: Layout) -> None:
    _check_layout(layout)
    if spec.family not in DECODER_FAMILIES:
        raise ValueError(f"tensor and pipeline layouts are modelled for decoder-only LMs ({', '.join(DECODER_FAMILIES)}); "
                         f"{spec.name} is {spec.family}")
    _check_tp(spec, layout.tp)
    if spec.num_layers < layout.pp * layout.chunks:
        raise ValueError(f"pp x chunks must be at most {spec.num_layers} ({spec.name} has {spec.num_layers} blocks, "
                         f"fewer than pp x chunks = {layout.pp * layout.chunks} stages)")


def rank_params(model: ModelSpec | str, layout: Layout, stage: int) -> int:
    """Parameters held by one tensor-parallel rank of pipeline stage `stage` (the largest rank
    when the vocabulary does not divide by t). Interleaved: the device's v chunks."""
    return sum(stage_tensors(model, layout, stage))


def stage_tensors(model: ModelSpec | str, layout: Layout, stage: int) -> tuple[int, ...]:
    """Element counts of the parameter tensors one tensor-parallel rank of pipeline stage `stage`
    holds, in the model's order: its blocks' shares, the embeddings on the first stage, the final
    norm and head on the last (and, tied, its own copy of the embedding)."""
    spec = _specs.resolve(model)
    _check_layout_model(spec, layout)
    stage = check_count("stage", stage, lo=0, hi=layout.pp - 1)
    return _stage_tensors(spec, layout.tp, layout.pp, layout.chunks, stage)


def tensor_placement(spec: ModelSpec, name: str) -> tuple[int, bool]:
    """Where a parameter tensor sits: (its block, or -1 before the blocks, -2 after them; whether it is a
    tied vocabulary matrix)."""
    i = _layer_index(name)
    where = i if i is not None else (-1 if any(name.startswith(k) for k in _FIRST) else -2)
    return where, where == -1 and spec.tie_word_embeddings and name.split(".")[0] in _VOCAB


def copies_on_stage(where: int, tied: bool, stage: int, p: int, mine) -> int:
    """Copies of a tensor placed at `where` (`tensor_placement`) that pipeline stage `stage` of `p` holds (`mine`:
    its blocks): its block's stage; the embeddings on the first, the final norm and head on the last, and
    the last stage's own copy of a tied embedding."""
    if where >= 0:
        return int(where in mine)
    if where == -1:
        return int(stage == 0) + int(stage == p - 1 and p > 1 and tied)
    return int(stage == p - 1)


@functools.lru_cache(maxsize=64)
def _tensor_table(spec: ModelSpec, t: int) -> tuple[tuple[int, int, bool], ...]:
    """Per parameter tensor: (its block, or -1 before the blocks, -2 after them; one tensor-parallel
    rank's elements; whether it is a tied vocabulary matrix)."""
    out = []
    for name, numel in spec.param_tensors():
        where, tied = tensor_placement(spec, name)
        out.append((where, tp_numel(name, numel, t, spec.vocab_size), tied))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _stage_tensors(spec: ModelSpec, t: int, p: int, v: int, stage: int) -> tuple[int, ...]:
    chunks = _stage_layers(spec.num_layers, p * v)
    mine = {i for c in range(v) for i in chunks[c * p + stage]}
    return tuple(n for where, n, tied in _tensor_table(spec, t)
                 for _ in range(copies_on_stage(where, tied, stage, p, mine)))


# ============================================================================ activations per device
def layer_activation_bytes(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, tp: int = 1, sp: bool = False,
                           precision: str = "fp32", attention: str = "sdpa", device: str = "cuda") -> int:
    """One block's saved tensors on one tensor-parallel rank, from `memory`'s ledger (the tensors
    PyTorch really saves for this model), split as Megatron splits them (`activations.tp_split`); with
    sequence parallelism the replicated part is split along the sequence too."""
    spec = _specs.resolve(spec)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    tp = _check_tp(spec, check_count("tp", tp))
    sp = _checks.flag("sp", sp)
    if sp and tp == 1:
        raise ValueError("sp=True needs tp > 1: sequence parallelism splits along the tensor-parallel group")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("attention", attention, _act.ATTENTIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    share = _act.DeviceShare(tp=tp, sp=sp, blocks=(0, 1), first=False, last=False)
    return _act.activation_bytes(spec, batch_size=b, seq_len=s, precision=precision,
                                 attention=attention, device=device, share=share)["one_layer"]


IMPLEMENTATIONS: tuple[str, ...] = ("megatron", "dtensor")


def in_flight(layout: Layout) -> tuple[int, ...]:
    """Per stage, the most (micro-batch, chunk) activations held at once: GPipe m on every stage,
    1F1B min(p - s, m) on stage s (Narayanan+21), interleaved min(2(p - s - 1) + (v - 1)p + 1, vm)
    (what `pipeline.simulate` counts, for every layout)."""
    layout = _check_layout(layout)
    p, m = layout.pp, layout.micro_batches
    if p == 1:
        return (1,)
    return _pipe.in_flight_counts(p, m, layout.schedule, layout.chunks)


def _schedule_points(layout: Layout, stage: int, held: int, received_inputs: bool,
                     sends_pend: bool = True) -> list[tuple[int, int, int]]:
    """The moments of a stage's backward that may peak, as (micro-batch-chunk pairs in flight, those
    whose input is a receive buffer, sent tensors still held). GPipe and 1F1B hold the most at one
    moment with nothing pending (torch's single-stage schedules wait on each send before the next).
    torch's `ScheduleInterleaved1F1B` waits on its sends only at the end of the step, and gloo's send
    work holds its tensor until then (`sends_pend`): the outputs and input gradients it sent
    accumulate, so a later backward with fewer micro-batches in flight may hold more; every moment
    that can be the peak is returned. ProcessGroupNCCL hands a completed send's tensors back at the
    group's next call (its watchdog moves them to the group's shelves): on CUDA nothing accumulates."""
    if layout.schedule != "interleaved":
        return [(held, held if received_inputs and stage > 0 else 0, 0)]
    return list(_pipe.interleaved_points(layout.pp, layout.micro_batches, layout.chunks, stage, received_inputs,
                                    received_inputs and sends_pend))





# the Step's options a layout takes (beside the micro-batch and sequence): what one device of a layout models
LAYOUT_STEP_OPTIONS: tuple[str, ...] = ("precision", "optimizer", "optimizer_impl", "attention", "recompute", "device",
                                        "gpu")


def layout_step(model: "ModelSpec | str | Step", *, micro_batch_size: int | None = None, seq_len: int | None = None,
                options: dict | None = None, where: str = "estimate_layout") -> Step:
    """The checked Step of one device of a layout: a Step as it is, or a model with the micro-batch, sequence and
    `options` (LAYOUT_STEP_OPTIONS; precision bf16-mixed unless given). A layout models torch.optim's sharded
    optimizers, recompute none, selective or full, and no accumulation, frozen base, chunked loss or KV cache."""
    options = dict(options or {})
    if isinstance(model, Step):
        if options or (micro_batch_size, seq_len) != (None, None):
            raise ValueError(f"{where} takes a Step, or a model with micro_batch_size, seq_len and options, not both")
        step = model
        _specs.resolve(step.model)  # a mixture of experts: expert_parallel.moe_layout_states
        _checks.one_of("optimizer", step.optimizer, _optim.SHARDED)
        _checks.one_of("recompute", step.recompute, RECOMPUTE)
    else:
        _checks.no_unknown(where, options, LAYOUT_STEP_OPTIONS)
        spec = _specs.resolve(model)
        b = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT)
        s = check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
        _checks.positions(spec, s)
        options = {"precision": "bf16-mixed", **options}
        # checked before the Step where a layout's own words or choices differ from the Step's (which checks the rest)
        for name, choices in (("optimizer", _optim.SHARDED), ("attention", _act.ATTENTIONS), ("recompute", RECOMPUTE)):
            if name in options:
                _checks.one_of(name, options[name], choices)
        step = Step(spec, batch_size=b, seq_len=s, **options)
    if (step.accumulation_steps, step.loss, step.trainable_params, step.use_cache, step.optimizer_in_backward) != \
            (1, "whole", None, False, False):
        raise ValueError(f"{where} models one step of the whole model's parameters: leave accumulation_steps, loss, "
                         "trainable_params, use_cache and optimizer_in_backward at their defaults")
    return step


def estimate_layout(model: "ModelSpec | str | Step", layout: Layout, *, micro_batch_size: int | None = None,
                    seq_len: int | None = None, gradient_as_bucket_view: bool = False, keep_stage_output: bool = True,
                    keep_gradients: bool = True, implementation: str = "megatron",
                    stages: "tuple[int, ...] | None" = None, **options) -> list[_mem.MemoryBreakdown]:
    """Peak memory of one device of each pipeline stage (index = stage): the largest of
    `memory.training_phases` for that device's share (`activations.DeviceShare`) -- its parameters,
    gradients and optimizer states, the activations of the micro-batches the schedule holds in
    flight on it (from `pipeline.simulate`), the logits and loss on the last stage, the embedding's backward
    on the first, the optimizer's step. A 1 x 1 x 1 layout with keep_gradients=False is
    `memory.estimate_training` exactly.

    - keep_gradients: the gradients stay allocated between steps (Megatron-LM's contiguous gradient
      buffer, `zero_grad(set_to_none=False)`); False: set_to_none=True, as `estimate_training`.
    - keep_stage_output: a stage keeps the output it sent to the next stage (b x s x h) until that
      micro-batch's backward, the last stage the model's output (the logits), and every stage a
      receive buffer per micro-batch and chunk for the activations and the gradients it is sent,
      as torch.distributed.pipelining does (a received input is its buffer; on gloo the interleaved
      schedule's sends hold their tensors until the step ends: `_schedule_points`); Megatron-LM frees
      a sent output (`deallocate_output_tensor`), its last stage keeps only the loss: pass False for it.
    - With dp > 1, DDP's buckets: a flat copy of the gradients (counted with them) unless
      `gradient_as_bucket_view=True` makes the gradients views into the buckets. `layout.zero = 1`
      shards the optimizer states (and their step) over the dp replicas.
    - recompute: none, selective (Korthikanti+22: the attention core) or full (every block keeps its input).
    - implementation: "megatron" (vocabulary-parallel embedding, V/t x e gradient) or "dtensor"
      (PyTorch's `parallelize_module`, whose vocabulary-parallel embedding's backward builds the full
      V x e gradient on every rank before keeping its shard).
    - stages: only these stages (the list then holds theirs, in this order): the first and the last
      are the fullest (the most micro-batches in flight; the logits), which a planner needs."""
    _check_layout_model(model.model if isinstance(model, Step) else _specs.resolve(model), layout)
    step = layout_step(model, micro_batch_size=micro_batch_size, seq_len=seq_len, options=options)
    spec, b, s, precision, device = step.model, step.batch_size, step.seq_len, step.precision, step.device
    _checks.one_of("implementation", implementation, IMPLEMENTATIONS)
    gradient_as_bucket_view = _checks.flag("gradient_as_bucket_view", gradient_as_bucket_view)
    keep_stage_output = _checks.flag("keep_stage_output", keep_stage_output)
    keep_gradients = _checks.flag("keep_gradients", keep_gradients)
    p, v, t = layout.pp, layout.chunks, layout.tp
    if stages is not None:
        stages = _checks.wholes("stages", stages, lo=0, hi=p - 1)
    step = dataclasses.replace(step, recompute=step.plan)  # the plan made once (training_phases takes it as it is)
    chunks = _stage_layers(spec.num_layers, p * v)
    held = in_flight(layout)
    # torch.distributed.pipelining's receive buffers, allocated for every micro-batch and kept: the
    # activations a stage receives and the gradients sent back to it, b x s x h each
    x = _prec.dtype_sizes(precision, device)["x"]
    recv = layout.micro_batches * -(-b * s * spec.hidden_size * x // (t if layout.sp else 1))
    out = []
    torch_pp = keep_stage_output and p > 1  # torch.distributed.pipelining's buffers and sends
    for stage in (range(p) if stages is None else stages):
        mine = [chunks[c * p + stage] for c in range(v)]
        largest = max(mine, key=len)
        # a receive buffer for each virtual stage's input (all but the first) and for the gradient of
        # its output (all but the last)
        directions = sum(int(c * p + stage > 0) + int(c * p + stage < p * v - 1) for c in range(v))
        share = dict(  # a DeviceShare, built once per moment of the schedule (its checks read every tensor)
            blocks=(largest.start, largest.stop), first=stage == 0, last=stage == p - 1, tp=t, sp=layout.sp,
            param_tensors=_stage_tensors(spec, t, p, v, stage),
            stage_output=torch_pp, keep_gradients=keep_gradients, buffers=recv * directions if torch_pp else 0,
            gradient_copies=2 if layout.dp > 1 and not gradient_as_bucket_view else 1,
            optimizer_shards=layout.dp if layout.zero else 1, embedding_grad="dense" if implementation == "dtensor" else "sharded",
            others_at_end=v == 1, loss_parallel=implementation == "dtensor" and t > 1)
        # the stage's peak over the moments of its schedule that can hold the most
        peak = max((phase for n, got, sends in _schedule_points(layout, stage, held[stage], torch_pp,
                                                                 sends_pend=device == "cpu")
                    for phase in _mem.training_phases(
                        step, share=_act.DeviceShare(**share, in_flight=n, received=got, pending_sends=sends))),
                   key=lambda x: x.total)
        label = (f"{spec.name} stage {stage} of {p}, tp {t}" + (" + sp" if layout.sp else "")
                 + (" + ZeRO-1" if layout.zero else "") + f", {layout.schedule} m={layout.micro_batches}")
        out.append(dataclasses.replace(peak, label=label))
    return out


# ============================================================================ communication
def communication(model: ModelSpec | str, layout: Layout, *, micro_batch_size: int, seq_len: int,
                  precision: str = "bf16-mixed", dp_link: str = "ib-ndr", tp_link: str = "nvlink4",
                  pp_link: str = "ib-ndr") -> dict[str, dict[str, float]]:
    """What each kind of parallelism sends in one training step, and how long it takes on its link
    (alpha-beta model, `collectives`):
    - dp: one ring all-reduce of the device's gradients over the dp replicas (DDP overlaps it with
      the backward: see `ddp_overlap`);
    - tp: per block and micro-batch, two all-reduces of the b x s x h activations in the forward
      and two in the backward (with SP: all-gathers and reduce-scatters of the same volume);
    - pp: per micro-batch, one activation tensor forward and one gradient backward across each stage
      boundary (point to point)."""
    spec = _specs.resolve(model)
    _check_layout_model(spec, layout)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    links = {k: _coll.LINKS[_checks.one_of(f"{k}_link", v, _coll.LINKS)]
             for k, v in (("dp", dp_link), ("tp", tp_link), ("pp", pp_link))}
    grad = max(rank_params(spec, layout, k) for k in {0, layout.pp - 1}) * _mem.param_bytes(precision)  # the fullest stages
    act = b * s * spec.hidden_size * _prec.dtype_sizes(precision, "cuda")["half"]
    m, L = layout.micro_batches, spec.num_layers
    per_stage_layers = -(-L // layout.pp)
    tp_calls = 4 * per_stage_layers * m
    out = {"dp": {"bytes": grad, "calls": 1, "seconds": _coll.collective_time("all_reduce", layout.dp, grad, links["dp"])},
           "tp": {"bytes": act, "calls": tp_calls,
                  "seconds": tp_calls * _coll.collective_time("all_reduce", layout.tp, act, links["tp"])},
           "pp": {"bytes": act, "calls": 2 * m * (layout.pp - 1) * layout.chunks,
                  "seconds": 0.0 if layout.pp == 1 else 2 * m * layout.chunks * (links["pp"].alpha_s + act / links["pp"].bytes_per_s)}}
    return out


def ddp_buckets(param_bytes: list[int], *, bucket_cap_mb: float = 25, first_bucket_mb: float = 1) -> list[int]:
    """DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel) once it has rebuilt them
    after the first iteration (before that, with the default find_unused_parameters=False, all
    gradients share one bucket): parameters in the order their gradients become ready in backward
    (here: the reverse of model.parameters()), each added to the open bucket, which is closed once it
    holds at least its cap; the first bucket's cap is `first_bucket_mb` (torch's
    _DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) so that communication starts early. Returns bucket bytes, in
    the order they are all-reduced."""
    sizes = _byte_counts("param_bytes", param_bytes)
    bucket_cap_mb, first_bucket_mb = (
        _checks.number(name, cap, lo=0, lo_open=True, hi=1 << 20, hi_open=True,
                       what="a positive number of MiB (below 1,048,576)")
        for name, cap in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)))
    buckets, current, cap = [], 0, int(first_bucket_mb * 2**20)
    for n in reversed(sizes):
        current += n
        if current >= cap:
            buckets.append(current)
            current, cap = 0, int(bucket_cap_mb * 2**20)
    if current:
        buckets.append(current)
    return buckets


def ddp_overlap(buckets: list[int], *, n: int, backward_seconds: float, link: str | _coll.Link) -> dict[str, float]:
    """How much of DDP's gradient all-reduce hides behind the backward pass: bucket k is ready when
    the backward has produced its share of the gradients (gradients assumed to appear at a constant
    rate), all-reduces run one at a time on the link. Returns the communication time, the time it
    exceeds the backward by (exposed), and the share hidden."""
    buckets = _byte_counts("buckets", buckets, hint=" (see ddp_buckets)")
    n = check_count("n", n, hi=_checks.MAX_COUNT)
    backward_seconds = _checks.number("backward_seconds", backward_seconds, lo=0)
    if not isinstance(link, _coll.Link):
        link = _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)]
    total = sum(buckets)
    ready, t_link, comm = 0, 0.0, 0.0
    for size in buckets:
        ready += size
        t_ready = backward_seconds * ready / total if total else backward_seconds
        dt = _coll.collective_time("all_reduce", n, size, link)
        t_link = max(t_link, t_ready) + dt
        comm += dt
    exposed = max(0.0, t_link - backward_seconds)
    return {"communication_s": comm, "exposed_s": exposed, "hidden_share": 1 - exposed / comm if comm else 1.0}


def _stage_fit(spec: ModelSpec, layout: Layout, gpu, *, micro_batch_size: int, seq_len: int,
               expandable_segments: bool, kw: dict) -> "tuple[_fitting.Fit, _mem.MemoryBreakdown]":
    """`fitting.device_fit` of the layout's fullest device at this micro-batch size, and that device's peak."""
    ends = tuple(sorted({0, layout.pp - 1}))  # the fullest stages: the most in flight, and the logits
    stages = estimate_layout(spec, layout, micro_batch_size=micro_batch_size, seq_len=seq_len, gpu=gpu, stages=ends, **kw)
    i = max(range(len(stages)), key=lambda j: stages[j].total)
    k, t, dense = ends[i], layout.tp, kw.get("implementation", "megatron") == "dtensor"
    share = _act.DeviceShare(first=k == 0, last=k == layout.pp - 1, tp=t, embedding_grad="dense" if dense else "sharded",
                             blocks=(0, 1))
    largest = _fitting.fragmentation_bytes(spec, batch_size=micro_batch_size, seq_len=seq_len, share=share,
                                        precision=kw.get("precision", "bf16-mixed"), attention=kw.get("attention", "sdpa"))
    return _fitting.device_fit(stages[i], gpu, largest_tensor=largest, expandable_segments=expandable_segments), stages[i]


# what `fits` passes on to `estimate_layout` (it sets the rest itself)
_ESTIMATE_OPTIONS = ("precision", "optimizer", "optimizer_impl", "attention", "recompute", "device",
                     "gradient_as_bucket_view", "keep_stage_output", "keep_gradients", "implementation")


def fits(model: ModelSpec | str, layout: Layout, gpu, *, micro_batch_size: int, seq_len: int,
         expandable_segments: bool = False, max_search: int = 1 << 12, **kw) -> "_fitting.Fit":
    """Does the layout fit on GPUs of type `gpu`, and what is the largest micro-batch size that does?
    `fitting.fit`'s definition (`fitting.device_fit`) applied to the fullest device of `estimate_layout`
    (whose keyword arguments `kw` are): estimate + margin + fragmentation + CUDA context <= usable."""
    from .specs import gpu as _gpu

    spec = _specs.resolve(model)
    _check_layout(layout)
    g = _gpu(gpu)
    micro_batch_size = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT)
    max_search = check_count("max_search", max_search, hi=_checks.MAX_COUNT)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    _checks.no_unknown("fits", kw, _ESTIMATE_OPTIONS)
    if kw.get("device", "cuda") != "cuda":
        raise ValueError(f"device must be 'cuda' here (fits() answers for a GPU), got {_checks.show(kw['device'])}")

    def verdict(b: int, **found) -> "_fitting.Fit":
        return dataclasses.replace(_stage_fit(spec, layout, g, micro_batch_size=b, seq_len=seq_len,
                                              expandable_segments=expandable_segments, kw=kw)[0], **found)

    here = verdict(micro_batch_size)  # checks every argument before the search
    lo = _fitting.largest_true(lambda b: verdict(b).fits, limit=max_search, start=micro_batch_size)
    return dataclasses.replace(here, max_batch_size=lo, capped=lo >= max_search)


# ============================================================================ planning a cluster
@dataclass(frozen=True)
class LayoutPlan:
    """One candidate layout for `plan_layouts`: its fullest device (`peak`), `fitting.device_fit`'s
    verdict, and the step's estimated time and throughput."""

    layout: Layout
    recompute: str
    peak: _mem.MemoryBreakdown
    fit: "_fitting.Fit"
    bubble: Fraction  # of the ideal time (Megatron's convention)
    recompute_fraction: float  # extra FLOPs over the step's
    step_seconds: float
    tokens_per_s: float

    @property
    def name(self) -> str:
        L = self.layout
        extras = [x for x, on in (("SP", L.sp), ("ZeRO-1", L.zero), (f"recompute {self.recompute}", self.recompute != "none"))
                  if on]
        return f"dp {L.dp} x tp {L.tp} x pp {L.pp}" + (" + " + ", ".join(extras) if extras else "")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def plan_layouts(model: ModelSpec | str, gpus: int, gpu, *, seq_len: int, global_batch: int, micro_batch_size: int = 1,
                 gpus_per_node: int = 8, precision: str = "bf16-mixed", mfu: float = 0.4,
                 recomputes: tuple[str, ...] = RECOMPUTE) -> list[LayoutPlan]:
    """Every dp x tp x pp layout of `gpus` GPUs (tp within a node: at most `gpus_per_node`, dividing
    the heads, KV heads and MLP width; pp at most the blocks), with and without sequence parallelism
    and ZeRO-1 over dp, under each recompute plan in `recomputes`, for a global batch of
    `global_batch` sequences of `seq_len` tokens (m = global_batch / (dp x micro_batch_size)
    micro-batches, 1F1B). Each is checked with `fits` (the fullest device by `fitting.device_fit`) and
    timed (with a fused optimizer step, as Megatron-LM's FusedAdam): the step's FLOPs plus the
    recompute's at `mfu` of the GPU's dense 16-bit peak, shared by
    tp x pp devices, stretched by the bubble (p-1)/m, plus the tensor-parallel all-reduces on NVLink
    (not overlapped) and the pipeline's sends; data parallelism's all-reduce is taken as hidden behind
    the backward. A recompute plan that saves no memory over a cheaper one (selective recompute
    under SDPA, which keeps no scores) is left out. The list holds the layouts that fit, fastest
    first, then those that do not, smallest need first.

    Known limitations: the time model is a roofline with one MFU for every layout (real MFU falls
    with small per-device matrices, i.e. with large tp); the exposed part of the dp all-reduce is
    left out."""
    from . import checkpointing as _ck
    from .specs import gpu as _gpu

    spec = _specs.resolve(model)
    g = _gpu(gpu)
    n = check_count("gpus", gpus)
    node = check_count("gpus_per_node", gpus_per_node, hi=1024)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    gb = check_count("global_batch", global_batch, hi=_checks.MAX_COUNT)
    if gb > _pipe.MAX_MICRO_BATCHES * b:  # a layout with one replica would run gb / b micro-batches
        raise ValueError(f"global_batch must be at most {_pipe.MAX_MICRO_BATCHES:,} micro-batches of micro_batch_size={b} "
                         f"({_pipe.MAX_MICRO_BATCHES * b:,} sequences), got {gb:,}")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    mfu = _checks.fraction("mfu", mfu)
    if g.peak_tflops_16 <= 0:
        raise ValueError(f"gpu must have a FLOP/s figure ({g.name} has none): pass a GPU preset")
    if isinstance(recomputes, (str, bytes, dict)) or not isinstance(recomputes, _abc.Iterable):
        raise ValueError(f"recomputes must be a list of recompute plans ({', '.join(RECOMPUTE)}), "
                         f"got {_checks.show(recomputes)}")
    recomputes = tuple(str(_checks.one_of(f"recomputes[{i}]", r, RECOMPUTE)) for i, r in enumerate(recomputes))
    if not recomputes:
        raise ValueError(f"recomputes must name at least one recompute plan ({', '.join(RECOMPUTE)}), got none")
    if spec.family not in DECODER_FAMILIES:
        raise ValueError(f"layouts are planned for decoder-only LMs ({', '.join(DECODER_FAMILIES)}); {spec.name} is {spec.family}")
    f = _ck.flops(spec, batch_size=b, seq_len=s)
    extra = {r: _ck.recompute_flops(spec, r, batch_size=b, seq_len=s) for r in recomputes}
    peak_flops = (g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16) * 1e12 * mfu
    plans = []
    for tp in _divisors(n):
        if tp > node or any(x % tp for x in (spec.num_heads, spec.num_kv_heads, spec.intermediate_size)):
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > spec.num_layers or gb % (dp * b):
                continue
            m = gb // (dp * b)
            for sp in ((False, True) if tp > 1 else (False,)):
                for zero in ((0, 1) if dp > 1 else (0,)):
                    layout = Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batches=m)
                    comm = communication(spec, layout, micro_batch_size=b, seq_len=s, precision=precision)
                    kept: list[LayoutPlan] = []
                    for r in sorted(recomputes, key=extra.get):  # least recompute first
                        verdict, peak = _stage_fit(spec, layout, g, micro_batch_size=b, seq_len=s, expandable_segments=False,
                                                   kw=dict(precision=precision, recompute=r, optimizer_impl="fused"))
                        bubble = Fraction(pp - 1, m)
                        compute = m * (f["step"] + extra[r]) / (tp * pp) / peak_flops
                        seconds = compute * (1 + bubble) + comm["tp"]["seconds"] + comm["pp"]["seconds"]
                        if any(k.peak.total <= peak.total for k in kept):
                            continue  # more recompute for no less memory (selective under SDPA: no scores to drop)
                        kept.append(LayoutPlan(layout=layout, recompute=r, peak=peak, fit=verdict, bubble=bubble,
                                               recompute_fraction=extra[r] / f["step"], step_seconds=seconds,
                                               tokens_per_s=gb * s / seconds))
                    plans += kept
    return sorted(plans, key=lambda x: (not x.fit.fits, -x.tokens_per_s if x.fit.fits else x.fit.needed))


__all__ = ["Layout", "korthikanti_layer_activations",
           "rank_params", "stage_layers", "layer_activation_bytes", "estimate_layout", "communication",
           "ddp_buckets", "ddp_overlap", "fits", "stage_tensors", "plan_layouts", "LayoutPlan"]
