"""The ledger of what a training step saves for backward, layer by layer, and the recompute plans
that shrink it (chapters 1, 3 and 7). Pure Python: no torch import.

`layer_saved` lists every tensor one transformer block saves for its backward (name, kind, width,
and what it scales with), `model_saved` what the embeddings and the loss save; `activation_bytes`
prices the ledger for a batch, a precision and a share of the model (`DeviceShare`: a pipeline
stage, a tensor-parallel rank). `recompute_plan` turns a plan's name ("full", "selective",
"every-2", ...) or a set of blocks into a `Plan`: which blocks keep only their inputs and recompute
the rest in the backward. `vramlab.memory` walks the step with it; `vramlab.checkpointing` searches
the plans.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Literal

from . import checks as _checks
from . import moe as _moe
from .checks import MAX_BYTES, MAX_PARAMS
from .precision import PRECISIONS, PURE_16BIT, Precision, dtype_sizes, loss_bytes
from .specs import ModelSpec, resolve as _resolve


AttentionImpl = Literal["eager", "sdpa"]
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa")
Recompute = str  # a recompute plan: see `recompute_plan`
# the named recompute plans (`recompute_plan` also takes every-K, first-N, segments-K and block sets)
RECOMPUTES: tuple[str, ...] = ("none", "full", "selective", "sac-matmuls", "sqrt", "offload")
_PLAN_NAMES = ", ".join(RECOMPUTES) + ", every-K, first-N, segments-K (K >= 1, N >= 0 whole numbers)"


# Every tensor autograd saves for backward, per token of one layer, derived op by op from the
# transformers 5.x forward code (the method of Korthikanti+22, arXiv:2205.05198, sec. 4, which
# gives sbh(34 + 5as/h) bytes per layer for GPT-3 in 16-bit with 1-byte dropout masks). Views
# share their base's storage and are counted once. Checked against traced peaks in
# benchmarks/estimator_accuracy.py.

@dataclass(frozen=True, kw_only=True)
class Saved:
    """One saved tensor: `width` elements per token (or per score for `per_score`), of `kind`."""

    name: str
    width: int
    kind: str
    per_score: bool = False  # one element per attention score, i.e. b * a * s^2 in all
    shared_batch: bool = False  # with per_score: one (1, a, s, s) tensor that the whole batch broadcasts
    part: str = "attn"  # "mlp" for the MLP's tensors (freed first in the block's backward)
    # saved only for a weight's gradient: a linear's input. Autograd saves what the gradients it
    # must compute need, so a frozen linear (PEFT's base) keeps no copy of its input
    for_weight: bool = False
    stage: str = "last"  # outside the blocks: "first" (embeddings) or "last" (final norm, head, loss)

    def __post_init__(self) -> None:
        if (type(self.name) is str and self.name and type(self.width) is int and 0 <= self.width <= MAX_BYTES
                and type(self.kind) is str and self.kind in SAVED_KINDS and self.part in ("attn", "mlp")
                and self.stage in ("first", "last") and type(self.per_score) is bool
                and type(self.shared_batch) is bool and type(self.for_weight) is bool):
            return  # the ledger builds thousands: the common case costs one test
        _checks.text("name", self.name)
        if type(self.width) is not int or self.width < 0:
            object.__setattr__(self, "width", _checks.whole("width", self.width, lo=0, hi=MAX_BYTES))
        _checks.one_of("kind", self.kind, SAVED_KINDS)
        _checks.one_of("part", self.part, ("attn", "mlp"))
        _checks.one_of("stage", self.stage, ("first", "last"))
        for k in ("per_score", "shared_batch", "for_weight"):
            if type(getattr(self, k)) is not bool:
                object.__setattr__(self, k, _checks.flag(k, getattr(self, k)))


# a saved tensor's dtype, by kind (`dtype_sizes`)
SAVED_KINDS: tuple[str, ...] = ("x", "half", "f32", "loss", "mask", "i64", "up32")


# elements per token the activation function saves: transformers' gelu_new is written out
# (0.5 * x * (1 + tanh(c * (x + 0.044715 * x^3)))) and keeps four intermediates; the others one
_ACT_SAVES = {"gelu_new": 4, "gelu_fast": 4, "quick_gelu": 2}
# ...of which CUDA autocast computes some in fp32: `pow` is on its fp32 list (torch/csrc/autograd/
# autocast_mode / aten/src/ATen/autocast_mode.cpp, "fp32" ops; CPU autocast's list has no pow), so
# gelu_new's x^3 upcasts x, and everything downstream of it (tanh, 1 + tanh) is fp32 too; only
# 0.5 * x stays in the compute dtype. Measured on an H100 (gpu-truth, live blocks at the peak).
_ACT_SAVES_F32_CUDA_AMP = {"gelu_new": 3}


def cuda_amp(precision: Precision, device: str) -> bool:
    """PyTorch AMP (fp32 model + autocast) running CUDA kernels."""
    return device == "cuda" and precision in ("bf16-mixed", "fp16-mixed")


def _cast_inputs(name: str, width: int, n_linears: int, *, amp: bool, for_weight: bool = False) -> list[Saved]:
    """The input saved by `n_linears` projections that read the same fp32 tensor. Without autocast
    they share it; autocast caches its casts of parameters only, so under CUDA AMP each projection
    casts (and saves) its own half copy (measured: OPT/BERT keep three per layer for q, k, v)."""
    return [Saved(name=name, width=width, kind="half", for_weight=for_weight)] * (n_linears if amp else 1)


def _norm(spec: ModelSpec, name: str) -> list[Saved]:
    h = spec.hidden_size
    if spec.norm == "rmsnorm":  # x (fp32) for x.pow(2); x * rsqrt(var) for the weight multiply (only
        # the weight's gradient needs it: a frozen norm keeps none, measured with peft); rsqrt.
        # T5's norm squares x.to(torch.float32), a copy under pure 16 bits that pow saves, and multiplies
        # the 16-bit x by the fp32 rsqrt: pure 16 bits keep both (8h bytes a token, as fp32; measured
        # with saved-tensor hooks). Llama's multiplies the fp32 copy and saves 6h, not x's 2h: measured
        # per norm, but the whole-model trace is then 3 % over in pure bf16 (-1 % without): left as is
        # until the rest of the pure-bf16 Llama ledger is traced
        extra = [Saved(name=f"{name} input's fp32 copy (pure 16-bit)", width=h, kind="up32")] if spec.family == "t5" else []
        return [Saved(name=f"{name} input", width=h, kind="x"), *extra,
                Saved(name=f"{name} normalized", width=h, kind="x", for_weight=True),
                Saved(name=f"{name} rsqrt", width=1, kind="f32")]
    return [Saved(name=f"{name} input", width=h, kind="x"), Saved(name=f"{name} mean, rstd", width=2, kind="f32")]


def _t5_fused_self_attention(spec: ModelSpec, attention: AttentionImpl, device: str) -> bool:
    """Does a fused SDPA kernel run T5's self-attention, whose mask is the relative-position bias
    (which needs a gradient)? On CUDA from transformers 5.23 on, which makes the mask contiguous
    (`create_position_bias_mask`): the memory-efficient kernel takes it (H100, torch 2.11). Up to 5.22
    the mask was a strided view of the bias, which no fused kernel takes: the math path, as on the
    CPU, whose kernels take no mask that needs a gradient (measured: mT5-base +0.28 GiB fp32 and
    +0.53 GiB pure bf16 under 5.17, benchmarks/results/h100/t5_transformers_versions.json)."""
    return spec.family == "t5" and device == "cuda" and attention == "sdpa"


def uses_math_attention(spec: ModelSpec, attention: AttentionImpl, device: str, precision: str | None = None) -> bool:
    """True where the s x s scores are materialised: eager attention; SDPA on the CPU with attention
    dropout (PyTorch's CPU flash kernel has no dropout, so it falls back to math); and SDPA on CUDA in
    fp32 for a grouped-query model: transformers passes `enable_gqa=True` (no mask), which CUDA's flash
    kernel would take but not in fp32, and the memory-efficient kernel does not take, so PyTorch runs the
    math path (measured on an H100, torch 2.11: Llama-3.2-1B and a Mistral-7B block in fp32 save
    `_safe_softmax`'s b x heads x s x s probabilities in every block; bf16 keeps none)."""
    return (attention == "eager" or (device == "cpu" and spec.attention_dropout > 0)
            or (device == "cuda" and attention == "sdpa" and precision == "fp32" and spec.family == "llama"
                and spec.num_kv_heads < spec.num_heads))


def _attention(spec: ModelSpec, *, attention: AttentionImpl, device: str, precision: Precision,
               qkv: list[Saved], out_copy_flash: bool = False, math_upcast: bool = False) -> list[Saved]:
    """Scaled dot-product attention after the projections: `qkv` are the saved q, k, v.
    `math_upcast`: SDPA's math path runs this attention in pure 16 bits, on any device."""
    a, qd = spec.num_heads, spec.q_dim
    saved = list(qkv)
    # PyTorch's math SDPA computes 16-bit attention in fp32: q, k, v are upcast copies, scores fp32 (on
    # the CPU always; on CUDA where no fused kernel takes the call)
    cpu_upcast = (device == "cpu" and attention == "sdpa" and precision != "fp32") or math_upcast
    if cpu_upcast:
        saved = [dataclasses.replace(q, kind="f32") for q in saved]
    if uses_math_attention(spec, attention, device, precision):
        # fp32, or autocast's fp32 softmax; pure bf16 keeps bf16 probabilities (except CPU SDPA)
        soft = "f32" if precision not in PURE_16BIT or cpu_upcast else "half"
        saved.append(Saved(name="softmax(QK^T)", width=1, kind=soft, per_score=True))
        if precision in ("bf16-mixed", "fp16-mixed") and device == "cuda":  # autocast: fp32 softmax, half copy
            saved.append(Saved(name="probs in half", width=1, kind="half", per_score=True))
        if spec.attention_dropout > 0:
            saved += [Saved(name="attn dropout mask", width=1, kind="f32" if cpu_upcast else "mask", per_score=True),
                      Saved(name="attn dropout out", width=1, kind="f32" if cpu_upcast else "half", per_score=True)]
        saved.append(Saved(name="attn out (o_proj input)", width=qd, kind="half", for_weight=True))
    else:  # flash / memory-efficient kernel: output and log-sum-exp only (Dao+22)
        saved += [Saved(name="attn out", width=qd, kind="half"), Saved(name="logsumexp", width=a, kind="f32")]
        if out_copy_flash:
            saved.append(Saved(name="o_proj input", width=qd, kind="half", for_weight=True))
    return saved


def _mlp(spec: ModelSpec, *, dropout_inside: bool = False, amp: bool = False) -> list[Saved]:
    return [dataclasses.replace(x, part="mlp") for x in _mlp_saved(spec, dropout_inside=dropout_inside, amp=amp)]


def _act_saved(spec: ModelSpec, *, amp: bool) -> list[Saved]:
    i = spec.intermediate_size
    n_act = _ACT_SAVES.get(spec.activation, 1)
    n_f32 = _ACT_SAVES_F32_CUDA_AMP.get(spec.activation, 0) if amp else 0
    saved = [Saved(name="act saved", width=(n_act - n_f32) * i, kind="half")]
    if n_f32:
        saved.append(Saved(name="act saved (fp32 under CUDA autocast)", width=n_f32 * i, kind="f32"))
    return saved


def _mlp_saved(spec: ModelSpec, *, dropout_inside: bool, amp: bool) -> list[Saved]:
    h, i = spec.hidden_size, spec.intermediate_size
    saved = _cast_inputs("mlp input", h, 2 if spec.gated_mlp else 1, amp=amp, for_weight=True)
    if spec.gated_mlp:  # down(act(gate(x)) * up(x))
        saved += _act_saved(spec, amp=amp) + [Saved(name="act(gate), up", width=2 * i, kind="half")]
    elif spec.activation == "relu":  # relu saves its output, which is also the next matmul's input
        saved += [Saved(name="relu out", width=i, kind="half")]
    else:
        saved += _act_saved(spec, amp=amp)
    if dropout_inside:
        saved += [Saved(name="mlp dropout mask", width=i, kind="mask"), Saved(name="down input", width=i, kind="half", for_weight=True)]
    elif not (spec.activation == "relu" and not spec.gated_mlp):
        saved.append(Saved(name="down input", width=i, kind="half", for_weight=True))
    return saved


def _drop(spec: ModelSpec, name: str, n: int = 1, stage: str = "last") -> list[Saved]:
    if spec.hidden_dropout <= 0:
        return []
    return [Saved(name=f"{name} dropout mask", width=spec.hidden_size, kind="mask", stage=stage)] * n


def _qkv_separate(spec: ModelSpec, *, gqa_native: bool = False) -> list[Saved]:
    # q, k, v outputs; grouped-query k and v are expanded to all heads (repeat_kv, or the math
    # SDPA's repeat_interleave) before attention. With a single KV head the expansion is a stride-0
    # view: no copy. `gqa_native`: transformers passes enable_gqa=True to SDPA (no mask) and CUDA's
    # flash kernel reads the KV heads as they are (16-bit only; measured on an H100: Llama-3.2-1B
    # bf16 AMP keeps k and v at the KV width).
    kv = spec.kv_dim if (spec.num_kv_heads == 1 or gqa_native) else spec.q_dim
    return [Saved(name="q", width=spec.q_dim, kind="half"), Saved(name="k (all heads)", width=kv, kind="half"),
            Saved(name="v (all heads)", width=kv, kind="half")]


def layer_saved(spec: ModelSpec, *, attention: AttentionImpl = "sdpa", device: str = "cuda",
                precision: Precision = "fp32", decoder: bool = False, batch_size: int = 2,
                use_cache: bool = False) -> list[Saved]:
    """The tensors one transformer block saves for backward (T5: `decoder=True` for a decoder block).
    `batch_size` matters only at 1, where some views need no copy. `use_cache`: the model trains with
    transformers' KV cache on (see `training_phases`); only fused-QKV blocks (GPT-2, GPT-NeoX) change."""
    spec = _resolve(spec)
    _checks.one_of("attention implementation", attention, ATTENTIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    _checks.one_of("precision", precision, PRECISIONS)
    decoder, use_cache = _checks.flag("decoder", decoder), _checks.flag("use_cache", use_cache)
    batch_size = _checks.whole("batch_size", batch_size)
    f = spec.family
    h = spec.hidden_size
    kw = dict(attention=attention, device=device, precision=precision)
    math = uses_math_attention(spec, attention, device, precision)
    amp = cuda_amp(precision, device)
    if f == "gpt2":
        fused = [Saved(name="c_attn out (q,k,v views)", width=3 * h, kind="half")]
        if math and attention == "sdpa" and batch_size == 1:  # math SDPA scales q and k into copies;
            # at batch 1, v's view needs no copy and keeps the whole qkv output alive
            fused.append(Saved(name="scaled q, k", width=2 * h, kind="half"))
        if use_cache:  # the cache's torch.cat copies k and v, which attention saves; q's view keeps c_attn out
            fused.append(Saved(name="k, v copied into the cache", width=2 * h, kind="half"))
        return (_norm(spec, "ln_1") + [Saved(name="c_attn input", width=h, kind="half")]
                + _attention(spec, qkv=fused, **kw) + _drop(spec, "resid")
                + _norm(spec, "ln_2") + _mlp(spec, amp=amp) + _drop(spec, "mlp"))
    if f == "gpt_neox":
        qkv = [Saved(name="q, k after rotary", width=2 * h, kind="half")]
        if math and batch_size > 1:  # matmul(probs, v) saves a contiguous copy of v
            qkv.append(Saved(name="v", width=h, kind="half"))
        elif use_cache:  # the cache's torch.cat copies k and v; attention saves the copies, the fused output is freed
            qkv.append(Saved(name="v copied into the cache", width=h, kind="half"))
        else:  # SDPA saves v, a view of the fused qkv output, which keeps all of it alive
            qkv.append(Saved(name="qkv out (v view)", width=3 * h, kind="half"))
        norms = _norm(spec, "input_layernorm")
        if spec.parallel_residual:  # both norms read the same x: only the second's statistics are new
            norms += [s for s in _norm(spec, "post_attention_layernorm") if s.kind == "f32"]
        else:
            norms += _norm(spec, "post_attention_layernorm")
        return (norms + [Saved(name="qkv input", width=h, kind="half")]
                + _attention(spec, qkv=qkv, out_copy_flash=True, **kw) + _drop(spec, "hidden", 2) + _mlp(spec, amp=amp))
    if f == "opt":
        return (_norm(spec, "self_attn_layer_norm") + _cast_inputs("q/k/v input", h, 3, amp=amp)
                + _attention(spec, qkv=_qkv_separate(spec), **kw) + _drop(spec, "hidden", 2)
                + _norm(spec, "final_layer_norm") + _mlp(spec, amp=amp))
    if f == "llama":
        # CUDA's flash kernel (16-bit) and the CPU's flash kernel (any dtype; measured: torch 2.13 keeps
        # a GQA model's k and v at the KV width) read the KV heads as they are
        flash_gqa = not math and (device == "cpu" or precision != "fp32")
        return (_norm(spec, "input_layernorm") + _cast_inputs("q/k/v input", h, 3, amp=amp)
                + _attention(spec, qkv=_qkv_separate(spec, gqa_native=flash_gqa), **kw)
                + _norm(spec, "post_attention_layernorm") + _mlp(spec, amp=amp))
    if f == "bert":  # post-norm: LayerNorm(x + dropout(dense(...)))
        return (_cast_inputs("q/k/v input", h, 3, amp=amp) + _attention(spec, qkv=_qkv_separate(spec), **kw)
                + _drop(spec, "attn output") + _norm(spec, "attention LayerNorm")
                + _mlp(spec, amp=amp) + _drop(spec, "output") + _norm(spec, "output LayerNorm"))
    if f == "t5":
        # self-attention adds the relative-position bias, which needs a gradient, as SDPA's mask
        if _t5_fused_self_attention(spec, attention, device):
            # the memory-efficient kernel takes the mask, its gradient included (transformers >= 5.23
            # passes it contiguous), and keeps q, k, v, its output, the log-sum-exp and the mask: each
            # layer's contiguous (1, a, s, s) copy of the bias in the compute dtype (cast to 16 bits under
            # autocast), which the batch broadcasts (H100: T5-small, mT5-small and mT5-base, 256-2048 tokens)
            mask = Saved(name="position-bias mask (one for the batch)", width=1, kind="half", per_score=True,
                         shared_batch=True)
            core = _attention(spec, qkv=_qkv_separate(spec), **kw) + [mask]
        else:
            # no fused kernel takes it on the CPU (nor eager attention anywhere): the math path, which in
            # pure 16 bits upcasts q, k, v and the probabilities to fp32 (mT5-base pure bf16 CPU trace)
            upcast = attention == "sdpa" and precision in PURE_16BIT
            core = _attention(spec, qkv=_qkv_separate(spec), **{**kw, "attention": "eager"}, math_upcast=upcast)
        self_attn = (_norm(spec, "self-attn norm") + _cast_inputs("q/k/v input", h, 3, amp=amp)
                     + core + _drop(spec, "self-attn"))
        ff = _norm(spec, "ff norm") + _mlp(spec, dropout_inside=spec.hidden_dropout > 0, amp=amp) + _drop(spec, "ff")
        if not decoder:
            return self_attn + ff
        # cross-attention's bias needs no gradient, so SDPA may use its fused kernel; k and v are
        # projections of the encoder's output (kept once, see activation_bytes)
        # under CUDA autocast each decoder layer's k and v projections cast the (fp32) encoder output
        cross_kv = [Saved(name="cross k/v input (cast)", width=h, kind="half")] * (2 if amp else 0)
        cross = (_norm(spec, "cross-attn norm") + [Saved(name="cross q input", width=h, kind="half")] + cross_kv
                 + _attention(spec, qkv=_qkv_separate(spec), **kw) + _drop(spec, "cross-attn"))
        return self_attn + cross + ff
    raise ValueError(f"no activation model for family {f!r}")


def model_saved(spec: ModelSpec) -> list[Saved]:
    """Saved tensors outside the blocks, per token: embeddings, final norm, LM head, loss."""
    spec = _resolve(spec)
    h, V = spec.hidden_size, spec.vocab_size
    f = spec.family
    saved: list[Saved] = []
    if f == "gpt2":
        saved += _drop(spec, "embedding", stage="first")
    elif f == "bert":
        saved += _norm(spec, "embedding LayerNorm") + _drop(spec, "embedding")
    elif f == "t5":  # encoder and decoder: embedding dropout, final norm, final dropout
        saved += 2 * (_drop(spec, "embedding") + _norm(spec, "final norm") + _drop(spec, "final"))
    if f == "bert":  # MLM head: dense -> gelu -> LayerNorm -> decoder
        saved += [Saved(name="head dense input", width=h, kind="half", for_weight=True), Saved(name="head gelu input", width=h, kind="half")]
        saved += _norm(spec, "head LayerNorm")
    elif f == "t5":
        pass
    elif f != "opt" or spec.final_norm:
        saved += _norm(spec, "final norm")
    e = spec.word_embed_proj_dim or h
    saved += [Saved(name="lm_head input", width=e, kind="half", for_weight=True),
              # the loss upcasts the logits to fp32; cross-entropy keeps log_softmax(logits)
              Saved(name="log_softmax(logits)", width=V, kind="loss")]
    if spec.is_causal_lm:  # causal LMs shift (pad) the labels into a new int64 tensor
        saved.append(Saved(name="shifted targets", width=1, kind="i64"))
    return saved


def saved_tensor_bytes(s: Saved, *, tokens: int, scores: int, nbytes: dict[str, int], batch: int) -> int:
    """One saved tensor's bytes: `tokens` (or `scores`, or the scores of one sequence for a tensor
    the batch shares) times its width, in its kind's dtype."""
    n = (scores // batch if s.shared_batch else scores) if s.per_score else tokens
    return s.width * nbytes[s.kind] * n


# saved tensors inside the heads or the MLP's width, by name (with as many query heads as h/d, q, k
# and v are as wide as the replicated h-wide tensors: the width alone cannot tell them apart)
_SPLIT_NAMES = ("attn out", "o_proj input", "down input", "logsumexp", "q ", "k (", "v (", "scaled q", "c_attn out",
                "qkv out", "projection outputs (split)", "probs @ V", "attention out")
_SPLIT_EXACT = ("q", "k", "v")


def tp_split(x: Saved, spec: ModelSpec) -> bool:
    """Does Megatron's tensor parallelism split this saved tensor by t? Everything inside the heads
    and the MLP width (q, k, v, scores, attention output before the row-parallel projection, the
    MLP's inner tensors) and the vocabulary (the logits' log-softmax under a vocabulary-parallel
    loss) is split; the h-wide tensors around them (norm inputs, the column-parallel linears' input,
    dropout masks on the residual, the head's input) and norm statistics are replicated."""
    if not isinstance(x, Saved):
        raise ValueError(f"x must be a vramlab.activations.Saved, got {_checks.show(x)}")
    spec = _resolve(spec)
    if x.per_score or x.name in _SPLIT_EXACT or any(x.name.startswith(n) for n in _SPLIT_NAMES):
        return True
    if x.width == spec.vocab_size:
        return True
    return x.width not in (spec.hidden_size, spec.word_embed_proj_dim or spec.hidden_size, 1, 2)


def ledger_bytes(saved: list[Saved], *, tokens: int, scores: int, nbytes: dict[str, int], batch: int,
                  spec: ModelSpec | None = None, tp: int = 1, sp: bool = False) -> int:
    """Bytes of saved tensors on one tensor-parallel rank (`tp_split`; with sequence parallelism the
    replicated tensors are split along the sequence too), rounded up once."""
    size = dict(tokens=tokens, scores=scores, nbytes=nbytes, batch=batch)
    if tp == 1:
        return sum(saved_tensor_bytes(s, **size) for s in saved)
    return math.ceil(sum(Fraction(saved_tensor_bytes(s, **size), tp) if sp or tp_split(s, spec) else saved_tensor_bytes(s, **size)
                         for s in saved))


def _linear_weight_params(spec: ModelSpec) -> int:
    """Parameters that pass through a matmul (autocast casts them and keeps the copy for backward):
    all but embeddings, norms and biases."""
    g = spec.param_groups()
    h = spec.hidden_size
    blocks = spec.num_layers + spec.num_decoder_layers
    per_block_norm_bias = 8 * h  # generous: norms and biases are tiny next to the matrices
    lm = spec.vocab_size * (spec.word_embed_proj_dim or h)
    return max(0, g["layers"] - blocks * per_block_norm_bias) + lm


# ============================================================================ recompute plans
@dataclass(frozen=True)
class Plan:
    """Which blocks activation checkpointing recomputes, and what a checkpointed block keeps.

    segments  checkpointed [start, end) ranges of blocks (0 = the first block the forward runs; T5:
              the encoder's, then the decoder's). A segment keeps only its input; in the backward it
              is run again whole, and all its blocks' saved tensors are alive at once (Chen+16).
    keep      what a checkpointed block keeps: "input", or "matmuls" (PyTorch's selective
              activation checkpointing with a policy that saves matmul and attention outputs and
              recomputes the rest: norms, activation functions, dropout)
    attention_core  Korthikanti+22's selective recompute: every block keeps all but the attention
              core (QK^T, softmax, dropout, attention over V), recomputed in its backward
    offload   the segments' inputs go to host memory in the forward and come back in the backward
    """

    name: str
    segments: tuple[tuple[int, int], ...] = ()
    keep: str = "input"
    attention_core: bool = False
    offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string (a plan needs a name), got {_checks.show(self.name)}")
        pairs = self.segments
        if type(pairs) is tuple and all(type(p) is tuple and len(p) == 2 and type(p[0]) is int and type(p[1]) is int
                                        and 0 <= p[0] <= _checks.MAX_COUNT and 0 <= p[1] <= _checks.MAX_COUNT
                                        for p in pairs):
            segs = pairs  # pairs of plain ints (what recompute_plan builds): nothing to convert
        else:
            segs = self._checked_segments()
        for a, b in segs:
            if not 0 <= a < b:
                raise ValueError(f"plan {self.name!r}: segment ({a}, {b}) is empty or reversed: a segment is "
                                 "[start, end) with 0 <= start < end")
        if any(b0 > a1 for (_, b0), (a1, _) in zip(sorted(segs), sorted(segs)[1:])):
            raise ValueError(f"plan {self.name!r}: segments {segs} overlap: each block is in one segment at most")
        if not isinstance(self.keep, str) or self.keep not in ("input", "matmuls"):
            raise ValueError(f"plan {self.name!r}: keep must be 'input' or 'matmuls', got {_checks.show(self.keep)}")
        for flag in ("attention_core", "offload"):
            if type(getattr(self, flag)) is not bool:
                object.__setattr__(self, flag, _checks.flag(f"plan {self.name!r}: {flag}", getattr(self, flag)))
        object.__setattr__(self, "segments", tuple(sorted(segs)))

    def _checked_segments(self) -> tuple[tuple[int, int], ...]:
        """`segments` as pairs of ints (numpy's integers too), or one ValueError saying what they must be."""
        pairs = self.segments
        bad = isinstance(pairs, (str, bytes, dict)) or not isinstance(pairs, Iterable)
        if not bad:
            pairs = list(pairs)
            bad = any(isinstance(p, (str, bytes, dict)) or not isinstance(p, Iterable) for p in pairs)
        if not bad:
            pairs = [list(p) for p in pairs]
            bad = any(len(p) != 2 or not all(_checks.index(x) is not None for x in p) for p in pairs)
        if bad:
            raise ValueError(f"plan {self.name!r}: segments must be (start, end) pairs of block indices, "
                             f"got {_checks.show(self.segments)}")
        return tuple((_checks.whole(f"plan {self.name!r}: segment start", a, lo=0),
                      _checks.whole(f"plan {self.name!r}: segment end", b, lo=0)) for a, b in pairs)

    def checkpointed(self) -> frozenset[int]:
        return frozenset(i for a, b in self.segments for i in range(a, b))


def _stacks(spec: ModelSpec) -> list[tuple[int, int]]:
    """[start, end) of each stack of blocks in forward order (T5: encoder, then decoder)."""
    stacks = [(0, spec.num_layers)]
    if spec.num_decoder_layers:
        stacks.append((spec.num_layers, spec.num_layers + spec.num_decoder_layers))
    return stacks


def _segments_of(stacks: list[tuple[int, int]], k: int) -> tuple[tuple[int, int], ...]:
    return tuple((a, min(a + k, end)) for start, end in stacks for a in range(start, end, k))


def recompute_plan(recompute: "str | Plan | Iterable[int]", model: ModelSpec | str) -> Plan:
    """A recompute plan for `model`'s blocks, from a name:

    none         keep every saved tensor (no recompute)
    full         checkpoint every block: keep its input, recompute it in the backward (one extra
                 forward of the blocks)
    selective    Korthikanti+22: recompute only the attention core (no memory saved where the
                 attention kernel keeps no scores: SDPA's flash kernels)
    sac-matmuls  checkpoint every block, saving matmul and attention outputs (PyTorch's selective
                 activation checkpointing): recompute only norms, activations and dropout
    sqrt         segments of round(sqrt(L)) blocks (Chen+16): memory O(sqrt L), one extra forward
    offload      full, with the checkpoints (block inputs) moved to host memory
    every-K      checkpoint blocks 0, K, 2K, ... (1 in K)
    first-N      checkpoint the first N blocks (Megatron-LM's "block" method)
    segments-K   segments of K consecutive blocks (Megatron-LM's "uniform" method)

    or a set of block indices, each checkpointed alone (a `Plan` passes through)."""
    spec = _resolve(model, moe=True)
    stacks = _stacks(spec)
    n = stacks[-1][1]
    if isinstance(recompute, Plan):
        bad = [x for seg in recompute.segments for x in seg if not 0 <= x <= n]
        if bad:
            raise ValueError(f"plan {recompute.name!r} has segments outside {spec.name}'s {n} blocks")
        for a, b in recompute.segments:
            if not any(lo <= a and b <= hi for lo, hi in stacks):
                raise ValueError(f"plan {recompute.name!r}: segment ({a}, {b}) crosses from {spec.name}'s encoder "
                                 f"into its decoder (blocks {stacks[0][1]}..): checkpoint each stack separately")
        return recompute
    if not isinstance(recompute, str):
        try:
            if isinstance(recompute, (bytes, dict)) or not all(_checks.index(i) is not None for i in recompute):
                raise TypeError
            blocks = sorted({operator.index(i) for i in recompute})
        except TypeError:
            raise ValueError(f"recompute must be a plan name ({_PLAN_NAMES}) or a set of block indices, "
                             f"not {_checks.show(recompute)}") from None
        if blocks and not 0 <= blocks[0] <= blocks[-1] < n:
            raise ValueError(f"block indices must lie in 0..{n - 1} ({spec.name} has {n} blocks), got {blocks}")
        return Plan(name=f"blocks {blocks}", segments=tuple((i, i + 1) for i in blocks))
    name = recompute.strip()
    every = _segments_of(stacks, 1)
    fixed = {"none": lambda: Plan(name="none"), "full": lambda: Plan(name="full", segments=every),
             "selective": lambda: Plan(name="selective", attention_core=True),
             "sac-matmuls": lambda: Plan(name="sac-matmuls", segments=every, keep="matmuls"),
             "sqrt": lambda: Plan(name="sqrt", segments=_segments_of(stacks, max(1, round(math.sqrt(n))))),
             "offload": lambda: Plan(name="offload", segments=every, offload=True)}
    if name in fixed:  # (built on demand: only the plan asked for)
        return fixed[name]()
    kind, _, num = name.partition("-")
    if kind in ("every", "first", "segments"):
        letter, lo = ("N", 0) if kind == "first" else ("K", 1)
        # ASCII digits only: str.isdigit() also takes '²' and '٣', which int() then refuses or reads
        digits = num.lstrip("0") or "0"
        if num.isascii() and num.isdigit() and (len(digits) > 10 or int(digits) > _checks.MAX_COUNT):
            raise ValueError(f"recompute plan {_checks.show(recompute)}: {letter} must be at most {_checks.MAX_COUNT:,}")
        if not (num.isascii() and num.isdigit()) or int(digits) < lo:
            raise ValueError(f"unknown recompute plan {_checks.show(recompute)}: {kind}-{letter} needs {letter} a whole number "
                             f">= {lo} in digits; choose from {_PLAN_NAMES}")
        k = int(digits)
        if kind == "every":
            return Plan(name=name, segments=tuple((i, i + 1) for i in range(0, n, k)))
        if kind == "first":
            if k > n:
                raise ValueError(f"first-{k}: {spec.name} has only {n} blocks")
            return Plan(name=name, segments=every[:k])
        return Plan(name=name, segments=_segments_of(stacks, k))
    raise ValueError(f"unknown recompute plan {_checks.show(recompute)}; choose from {_PLAN_NAMES} or a set of block indices")


def _matmul_outputs(spec: ModelSpec, *, attention: AttentionImpl, device: str, precision: Precision) -> list[Saved]:
    """What a block keeps under selective activation checkpointing with the "save matmuls" policy
    (mm, addmm, bmm and the fused attention kernels' outputs are saved, everything else recomputed):
    the outputs of its projections and of attention, per token (the scores per score)."""
    h, i, qd, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    if spec.family == "gpt2":  # one fused c_attn projection
        kv = h
    saved = [Saved(name="projection outputs (split)", width=qd + 2 * kv + i * (2 if spec.gated_mlp else 1), kind="half"),
             Saved(name="projection outputs (h wide)", width=2 * h, kind="half")]  # o/down: after the all-reduce
    if uses_math_attention(spec, attention, device, precision):  # QK^T and probs @ V are bmm: both outputs saved
        f32 = device == "cpu" and attention == "sdpa" and precision != "fp32"
        saved += [Saved(name="QK^T", width=1, kind="f32" if f32 else "half", per_score=True),
                  Saved(name="probs @ V", width=qd, kind="half")]
    else:
        saved += [Saved(name="attention out", width=qd, kind="half"), Saved(name="logsumexp", width=spec.num_heads, kind="f32")]
    return saved


@dataclass(frozen=True, kw_only=True)
class DeviceShare:
    """One device's part of a training step, for `training_phases`: the default is the whole model on
    one device (`estimate_training`); `parallel.estimate_layout` builds one per pipeline stage.

    blocks          [start, end) of the blocks this device runs (None: all). Under the interleaved
                    schedule, the largest of its chunks (`in_flight` counts micro-batch-chunk pairs)
    first, last     it runs the embeddings (and holds the input ids); the final norm, head and loss
    tp, sp          tensor-parallel degree (Megatron's split, `tp_split`); sequence parallelism
    param_tensors   element counts of the parameter tensors it holds (None: the model's)
    in_flight       micro-batches whose saved activations are alive at once (a pipeline schedule's)
    stage_output    the stage keeps each in-flight micro-batch's output until its backward (b x s x h;
                    on the last stage the logits: torch.distributed.pipelining, DeepSpeed; Megatron-LM
                    frees a sent output and its last stage keeps only the loss)
    others_at_end   on the last stage, the other micro-batches in flight are past the model's end (their
                    logits and the loss's tensors kept, GPipe); False where the device holds them in
                    earlier chunks (the interleaved schedule's last device), each with a b x s x h output
    loss_parallel   DTensor's vocabulary-parallel loss (`loss_parallel`): its backward makes three
                    (V/t)-wide fp32 tensors where the local cross-entropy makes two
    buffers         bytes the framework holds for the whole step (torch.distributed.pipelining's receive
                    buffers: one per micro-batch and chunk, for activations and for gradients)
    received        of the micro-batches in flight, those whose stage input is a receive buffer counted in
                    `buffers` (torch.distributed.pipelining hands the buffer itself to the first block,
                    which saves it): their saved input is not counted again
    pending_sends   sent b x s x h tensors (outputs whose backward is done, input gradients) still held by
                    their send's work: torch's interleaved schedule waits on its sends at the end of the
                    step, and gloo's work holds its tensor until then (NCCL's frees it on completion)
    keep_gradients  gradients stay allocated between steps (Megatron's contiguous buffer, DDP with
                    zero_grad(set_to_none=False)); False: set_to_none=True, they exist from the backward on
    gradient_copies 2 with DDP's flat buckets beside the gradients (gradient_as_bucket_view=False)
    optimizer_shards  optimizer states (and their step) split over this many data-parallel ranks
                    (ZeRO-1, Megatron's distributed optimizer)
    embedding_grad  "sharded": the vocabulary-parallel embedding's gradient is V/t x e (Megatron);
                    "dense": DTensor's embedding backward builds the full V x e gradient first"""

    blocks: tuple[int, int] | None = None
    first: bool = True
    last: bool = True
    tp: int = 1
    sp: bool = False
    param_tensors: tuple[int, ...] | None = None
    in_flight: int = 1
    stage_output: bool = False
    buffers: int = 0
    received: int = 0
    pending_sends: int = 0
    keep_gradients: bool = False
    gradient_copies: int = 1
    optimizer_shards: int = 1
    embedding_grad: str = "sharded"
    others_at_end: bool = True
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: store the checked, plain values)
        if self.blocks is not None:
            pair = () if isinstance(self.blocks, (str, bytes, dict)) or not isinstance(self.blocks, Iterable) \
                else tuple(self.blocks)
            if len(pair) != 2:
                raise ValueError(f"blocks must be None or a (start, end) pair of block indices, got {_checks.show(self.blocks)}")
            a, b = _checks.wholes("blocks", pair, lo=0)
            if a > b:
                raise ValueError(f"blocks must be [start, end) with start <= end, got {_checks.show(self.blocks)}")
            put("blocks", (a, b))
        for k in ("first", "last", "sp", "stage_output", "keep_gradients", "others_at_end", "loss_parallel"):
            put(k, _checks.flag(k, getattr(self, k)))
        for k, lo, hi in (("tp", 1, _checks.MAX_COUNT), ("in_flight", 1, _checks.MAX_COUNT),
                          ("buffers", 0, MAX_BYTES), ("received", 0, _checks.MAX_COUNT),
                          ("pending_sends", 0, _checks.MAX_COUNT), ("gradient_copies", 1, _checks.MAX_COUNT),
                          ("optimizer_shards", 1, _checks.MAX_COUNT)):
            put(k, _checks.whole(k, getattr(self, k), lo=lo, hi=hi))
        if self.param_tensors is not None:
            put("param_tensors", tuple(_checks.wholes("param_tensors", self.param_tensors, lo=0, hi=MAX_PARAMS,
                                                      empty=True)))
        _checks.one_of("embedding_grad", self.embedding_grad, ("sharded", "dense"))

    @property
    def whole(self) -> bool:
        return self == WHOLE_MODEL


WHOLE_MODEL = DeviceShare()


def _moe_twin(spec: ModelSpec) -> ModelSpec:
    """The Llama block whose attention and norms an MoE layer (Mixtral, Qwen-MoE, OLMoE) has: the same
    heads, kv heads, head width, RMSNorm and dense MLP width (its MLP part is not read for MoE layers)."""
    return ModelSpec(name=spec.name, model_type="llama", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                     num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
                     max_position_embeddings=spec.max_position_embeddings, activation=spec.activation, gated_mlp=True,
                     tie_word_embeddings=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias, norm="rmsnorm",
                     norm_bias=False, rotary_fraction=1.0, attention_dropout=spec.attention_dropout)


def _qk_norm_bytes(spec: ModelSpec, tokens: int, nb: dict[str, int]) -> int:
    """Qwen3-MoE's per-head and OLMoE's whole-projection RMSNorm on q and k: each saves its input's fp32
    copy (the input itself in fp32), the normalised values in the input's dtype for the weight, and one
    fp32 rsqrt per normalised row (per head, or per token)."""
    if not spec.qk_norm:
        return 0
    rows = (spec.num_heads + spec.num_kv_heads) if spec.qk_norm == "head" else 2
    return tokens * ((spec.q_dim + spec.kv_dim) * (4 + nb["half"]) + rows * 4)


@dataclass(frozen=True)
class _ShareView:
    """What `activation_bytes` reads of a DeviceShare (its cache key)."""
    blocks: "tuple[int, int] | None"
    first: bool
    last: bool
    tp: int
    sp: bool
    whole: bool


def activation_bytes(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                     attention: AttentionImpl = "sdpa", recompute: "Recompute | Plan" = "none", device: str = "cuda",
                     frozen_base: bool = False, share: DeviceShare = WHOLE_MODEL, use_cache: bool = False,
                     capacity_factor: float | None = None) -> dict:
    """Bytes saved for backward at the end of the forward pass, split into 'layers' (all blocks),
    'one_layer' (the largest block), 'outside' (embeddings, head, loss) and 'weight_copies'
    (autocast's half-precision weights). `recompute` is a plan (`recompute_plan`): a checkpointed
    segment keeps only its input. Per block, in forward order: 'full' (what it saves without
    recompute) and 'kept' (what it keeps under the plan); 'backward': for each block, last first,
    (block, activations of the blocks alive during its backward).
    `frozen_base`: PEFT with adapters on the attention projections (LoRA's default targets): the
    frozen linears save no input (checked on mT5-base LoRA r=8 q,v on an H100).
    `share`: one device's part (its blocks, first/last stage, tensor and sequence parallelism):
    everything above is then that device's, per micro-batch.
    A mixture of experts (family "moe"): attention and norms as a Llama block's (with Qwen3's and
    OLMoE's q/k norms), each layer's MLP from `moe.training_layer_saved` (`capacity_factor`: None is
    dropless routing, a number drop-and-pad buffers); whole model on one device only."""
    spec = _resolve(spec, moe=True)
    capacity_factor = _moe.check_trainable(spec, capacity_factor)
    batch_size, seq_len = _checks.whole("batch_size", batch_size), _checks.whole("seq_len", seq_len)
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("attention implementation", attention, ATTENTIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    frozen_base, use_cache = _checks.flag("frozen_base", frozen_base), _checks.flag("use_cache", use_cache)
    if not isinstance(share, DeviceShare):
        raise ValueError(f"share must be a vramlab.activations.DeviceShare, got {_checks.show(share)}")
    plan = recompute_plan(recompute, spec)
    if spec.is_moe and plan.keep == "matmuls":
        raise ValueError(f"{spec.name}: the {plan.name!r} plan (saving the matmuls' outputs) is not modelled for a "
                         f"mixture of experts; use none, full, selective, every-K, first-N or segments-K")
    if spec.is_moe and not share.whole:
        raise ValueError(f"{spec.name}: mixture-of-experts training is modelled on one device (no parallel layout) only")
    # the answer depends on these of the share only: a planner asks again for layouts that differ
    # elsewhere (ZeRO-1 or not: the optimizer's shards), and gets the same answer at once
    return dict(_activation_bytes(spec, batch_size, seq_len, precision, attention, plan, device, frozen_base,
                                  use_cache, share.blocks, share.first, share.last, share.tp, share.sp, share.whole,
                                  capacity_factor))


@functools.lru_cache(maxsize=512)
def _activation_bytes(spec: ModelSpec, batch_size: int, seq_len: int, precision: str, attention: str, plan: "Plan",
                      device: str, frozen_base: bool, use_cache: bool, blocks, first: bool, last: bool, tp: int,
                      sp: bool, whole: bool, capacity_factor: float | None = None) -> dict:
    share = _ShareView(blocks, first, last, tp, sp, whole)
    moe_spec = None
    if spec.is_moe:  # attention, norms, embeddings and loss as its Llama twin's; the MLPs below
        moe_spec, spec = spec, _moe_twin(spec)
    nb = dtype_sizes(precision, device)
    nb["loss"] = loss_bytes(spec, precision)
    b, s, a = batch_size, seq_len, spec.num_heads
    tokens, scores = b * s, b * a * s * s
    t, sp = share.tp, share.sp
    kw = dict(attention=attention, device=device, precision=precision, batch_size=b, use_cache=use_cache)
    sizes = dict(tokens=tokens, scores=scores, nbytes=nb, batch=b, spec=spec, tp=t, sp=sp)
    seq_split = t if sp else 1  # h-wide tensors are split along the sequence under SP

    def keep(saved: list[Saved]) -> list[Saved]:
        return [x for x in saved if not (frozen_base and x.for_weight)]

    enc_saved = keep(layer_saved(spec, **kw))
    block = keep(layer_saved(spec, decoder=True, **kw)) if spec.family == "t5" else enc_saved  # the larger block
    enc = ledger_bytes(enc_saved, **sizes)
    dec = ledger_bytes(block, **sizes) if spec.family == "t5" else 0
    mlp_part = ledger_bytes([x for x in block if x.part == "mlp"], **sizes)
    n_enc, n_dec = spec.num_layers, spec.num_decoder_layers
    lo_dev, hi_dev = share.blocks or (0, n_enc + n_dec)
    mine = range(lo_dev, hi_dev)
    # per block, in forward order: all it saves, and what it keeps under the plan
    full = [enc] * n_enc + [dec] * n_dec
    if moe_spec is not None:
        if moe_spec.is_mla:  # the twin's two norms, and the latent attention between them
            norms = [x for x in enc_saved if x.name.startswith(("input_layernorm", "post_attention_layernorm"))]
            attn = ledger_bytes(norms, **sizes) + sum(_moe.mla_attention_saved(
                moe_spec, tokens=tokens, precision=precision, device=device).values())
            if nb["up32"]:  # DeepSeek's RMSNorms save an fp32 copy of a 16-bit input (traced: V2 and V3, pure bf16)
                attn += 2 * tokens * moe_spec.hidden_size * (nb["up32"] - nb["x"])
        else:
            attn = ledger_bytes([x for x in enc_saved if x.part == "attn"], **sizes) + _qk_norm_bytes(moe_spec, tokens, nb)
        mlps = [sum(_moe.training_layer_saved(moe_spec, layer=i, tokens=tokens, precision=precision, device=device,
                                              capacity_factor=capacity_factor).values()) for i in range(n_enc)]
        full = [attn + m for m in mlps]
        mlp_part = max(mlps)
    one = max((full[i] for i in mine), default=0)
    scores_of = [ledger_bytes([x for x in blk if x.per_score], **sizes) for blk in (enc_saved, block)]
    per_score = [scores_of[0]] * n_enc + [scores_of[1]] * n_dec
    block_in = -(-tokens * spec.hidden_size * nb["x"] // seq_split)  # a checkpoint: the block's input (Korthikanti+22: 2sbh in 16-bit)
    matmuls = ledger_bytes(_matmul_outputs(spec, attention=attention, device=device, precision=precision), **sizes)
    kept = [f - p if plan.attention_core else f for f, p in zip(full, per_score)]
    for lo, hi in plan.segments:  # (not `a`: that is the number of heads here)
        for i in range(lo, hi):
            kept[i] = (block_in + matmuls) if plan.keep == "matmuls" else 0
        if plan.keep == "input":
            kept[lo] = 0 if plan.offload else block_in
    for i in range(len(kept)):  # blocks that run on other devices keep nothing here
        if i not in mine:
            kept[i] = full[i] = 0
    kept_before = list(itertools.accumulate(kept, initial=0))  # kept_before[i]: what blocks 0..i-1 keep
    full_before = list(itertools.accumulate(full, initial=0))
    seg_of = {i: (lo, hi) for lo, hi in plan.segments for i in range(lo, hi)}
    backward = []  # (block, activations of the blocks alive in its backward), in backward order
    for i in reversed(mine):
        if i in seg_of:  # the whole segment is recomputed when its last block's backward begins, then freed block by block
            lo, hi = seg_of[i]
            # SAC's saved outputs stay beside the recomputed tensors until the block's backward ends
            extra = kept_before[hi] - kept_before[lo] - (hi - lo) * block_in if plan.keep == "matmuls" else 0
            backward.append((i, kept_before[lo] + full_before[i + 1] - full_before[lo] + extra))
        else:
            backward.append((i, kept_before[i] + full[i]))
    layers = sum(kept)
    n_mine = len(mine)
    plain = n_mine - len(plan.checkpointed() & set(mine))  # blocks run once: autocast keeps their weights' casts
    if precision in ("bf16-mixed", "fp16-mixed") and n_mine:
        if moe_spec is not None:  # transformers' grouped_mm experts run in the weights' fp32: no cast of theirs
            routed = _moe.param_breakdown(moe_spec)["routed_experts"] if capacity_factor is None else 0
            lm = moe_spec.vocab_size * moe_spec.hidden_size  # the head runs once (never checkpointed): its cast stays
            copies = 2 * (_linear_weight_params(moe_spec) - routed - lm) * plain // n_mine + 2 * lm
        else:  # the blocks' matrices run once (`plain`) keep their casts; the LM head (never checkpointed: it
            # runs once, and its matmul saves its cast weight for the backward) always does, on the last stage,
            # split by t (H100: Llama 3.2 1B b=4 s=2048 bf16-mixed, full recompute: 2 V h was the -1.8 % left)
            lm = spec.vocab_size * (spec.word_embed_proj_dim or spec.hidden_size)
            blocks_w = Fraction(_linear_weight_params(spec) - lm, n_enc + n_dec) * n_mine
            copies = math.floor(2 * (blocks_w * plain / n_mine + (lm if share.whole or share.last else 0)) / t)
    else:
        copies = 0
    outside_saved = [x for x in keep(model_saved(spec)) if (share.first if x.stage == "first" else share.last)]
    outside = ledger_bytes(outside_saved, **sizes)
    if moe_spec is not None and moe_spec.is_mla and nb["up32"] and share.last:  # the final norm's fp32 copy, as above
        outside += tokens * moe_spec.hidden_size * (nb["up32"] - nb["x"])
    if spec.family == "t5":
        # relative-position buckets: an (s, s) int64 index per stack, kept by the bias embedding
        outside += 2 * s * s * nb["i64"]
        outside += tokens * spec.hidden_size * nb["x"]  # the encoder's output, read by every cross-attention
        if not uses_math_attention(spec, attention, device, precision):  # SDPA keeps the (zero) cross-attention bias,
            outside += a * s * s * nb["half"]  # in the compute dtype (16 bits under autocast)
        if plan.segments:  # checkpointed blocks also keep their shared inputs: a (1, a, s, s) bias
            outside += a * s * s * nb["x"]
    # A block's backward runs the MLP first (all the block's tensors still saved, plus the MLP's
    # d(hidden)s), then attention (the MLP's tensors freed; with the scores materialised, d(probs)
    # and d(scores), b * a * s^2 each). The extra over the block's saved tensors at its worst
    # (inside the heads and the MLP width: split by t):
    t5_fused = _t5_fused_self_attention(spec, attention, device)
    math_path = uses_math_attention(spec, attention, device, precision) or (spec.family == "t5" and not t5_fused)
    # (a gated MLP's backward holds three (b, s, intermediate) tensors at once on CUDA, two on the CPU:
    # measured on every Llama-like CPU run, ZeRO-0 to FSDP2 and pipelines, tests/test_validation.py)
    # An ungated MLP whose activation is one kernel saving only its input (GELU): the down projection's
    # input is freed when its backward ends, before the activation's gradient is made, so one more
    # (b, s, intermediate) tensor at a time (traced: GPT-NeoX blocks recomputed in their backward)
    one_kernel = not spec.gated_mlp and spec.activation == "gelu"
    mlp_grads = (3 if spec.gated_mlp and device == "cuda" else 1 if one_kernel else 2) * tokens * spec.intermediate_size * nb["half"]
    attn_grads = 2 * scores * nb["f32"] if math_path else 3 * tokens * spec.q_dim * nb["half"]
    if t5_fused:  # the fused kernel's gradient of the (broadcast) bias, (b, a, s, s), before autograd sums it
        attn_grads += scores * nb["half"]
    if moe_spec is not None:
        mlp_grads = max(_moe.training_block_bytes(moe_spec, layer=i, tokens=tokens, precision=precision, device=device,
                                                  capacity_factor=capacity_factor) for i in range(n_enc))
    mlp_moment, attn_moment = -(-mlp_grads // t), -(-attn_grads // t) - mlp_part
    transient = max(mlp_moment, attn_moment, 0)
    outside_last = ledger_bytes([x for x in outside_saved if x.stage != "first"], **sizes) if share.last else 0
    # Freed before any block's backward: autograd releases a node's saved tensors once it has run
    # (torch/csrc/autograd/engine.cpp, Engine::evaluate_function: fn.release_variables() unless
    # retain_graph), and the final norm runs its backward between the head's and the last block's.
    # One norm's worth (T5's encoder norm lives until the encoder's backward: only the decoder's counts)
    # Full fine-tuning only: a frozen base with adapters (PEFT) is left as it was (its blocks' backward
    # holds adapter transients this ledger does not list, which these terms stood in for: LoRA traces in
    # tests/test_compression.py fall 5-7 % short without them)
    final_norm = ledger_bytes(keep(_norm(spec, "final norm")), **sizes) \
        if share.last and not frozen_base and any(x.name.startswith("final norm") for x in outside_saved) else 0
    # The gradient entering the block: at the block's peak (inside its MLP's backward, or inside
    # attention's) only one b x s x h gradient exists in a sequential pre-norm block: d(out) (AddBackward0
    # hands the same tensor to both branches of the residual), then d(h) once the MLP's branch is summed
    # into it. A parallel residual (GPT-NeoX) or a post-norm block (BERT) and T5's decoder hold a second one
    # (traced op by op on Llama-family blocks, CPU, with and without recompute)
    grads_in = 2 if frozen_base or spec.parallel_residual or spec.family in ("bert", "t5") else 1
    # The block's own weight gradients made by that moment (element counts): in the MLP's backward only
    # the output projection's (its MmBackward0 runs first); in attention's the whole MLP's, the second
    # norm's and the attention output projection's. None: all of the block's (a mixture of experts, PEFT)
    h_, i_ = spec.hidden_size, spec.intermediate_size
    if moe_spec is not None or frozen_base:
        made = None
    elif attn_moment > mlp_moment:
        made = (3 if spec.gated_mlp else 2) * h_ * i_ + spec.q_dim * h_ + 2 * h_
    else:
        made = h_ * i_ + (h_ if spec.mlp_bias else 0)
    return {"layers": layers, "one_layer": one, "outside": outside, "outside_last": outside_last, "weight_copies": copies,
            "block_backward": transient,
            "block_grad_in": -(-grads_in * tokens * spec.hidden_size * nb["x"] // seq_split),
            "final_norm": final_norm, "block_grads_made": made,
            "full": tuple(full), "kept": tuple(kept), "backward": tuple(backward), "block_in": block_in}
