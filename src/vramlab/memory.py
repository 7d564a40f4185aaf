"""Training and inference memory, by category. Pure Python: no torch import.

`estimate_training` returns the peak of one steady-state training step (optimizer states already
exist; forward, backward, optimizer.step(), zero_grad(set_to_none=True)), taken as the maximum over
the step's phases, with the breakdown at that peak. `estimate_inference` returns a prefill's peak
(weights, KV cache, activations, logits). Both return a frozen `MemoryBreakdown` of integer bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from .specs import GPUSpec, ModelSpec, gpu as _gpu
from .units import fmt_bytes

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-fp32-states", "fp16-fp32-master"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit"]
OptimizerImpl = Literal["for-loop", "foreach", "fused"]
AttentionImpl = Literal["eager", "sdpa"]
Recompute = Literal["none", "full"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-fp32-states", "fp16-fp32-master")
# 16-bit models: pure bf16 (torch.optim keeps the states in bf16), bf16 with fp32 optimizer states
# ("How to Scale Your Model": 10 B/param with fp32 moments only), and the ZeRO paper's recipe: fp16
# weights and gradients with fp32 master weights, momentum and variance (2 + 2 + 12 = 16 B/param)
PURE_16BIT: tuple[str, ...] = ("bf16", "bf16-fp32-states", "fp16-fp32-master")
FP32_STATES: tuple[str, ...] = ("bf16-fp32-states", "fp16-fp32-master")  # 16-bit model, fp32 optimizer states
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit")
OPTIMIZER_IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa")
RECOMPUTES: tuple[str, ...] = ("none", "full")
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "activations", "temporaries",
                               "kv_cache", "inputs", "other")


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Integer bytes by category. `a - b` subtracts category by category (predicted - measured)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    temporaries: int = 0
    kv_cache: int = 0
    inputs: int = 0
    other: int = 0
    label: str = ""
    phase: str = ""  # the step phase where the peak occurs (estimates)

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def to_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}

    def __sub__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(**{c: getattr(self, c) - getattr(other, c) for c in CATEGORIES},
                               label=f"{self.label} - {other.label}")

    def table(self, *, title: str | None = None) -> str:
        """A readable table in binary units, largest category first, with shares of the total."""
        rows = [(c, getattr(self, c)) for c in CATEGORIES if getattr(self, c)]
        rows.sort(key=lambda r: -abs(r[1]))
        total = self.total
        head = title or self.label or "memory"
        lines = [head, "-" * max(len(head), 38)]
        for name, n in rows:
            share = f"{100 * n / total:5.1f}%" if total else ""
            lines.append(f"{name.replace('_', ' '):<18}{fmt_bytes(n):>12}  {share}")
        lines.append(f"{'total':<18}{fmt_bytes(total):>12}")
        if self.phase:
            lines.append(f"(peak during: {self.phase})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ============================================================================ byte sizes
# Which dtype each saved tensor has, by recipe. Kinds of saved tensor:
#   "x"    the residual stream and what norms save: the parameter dtype (fp32 under AMP)
#   "half" inputs and outputs of matmuls: the compute dtype (bf16/fp16 under AMP)
#   "f32"  always fp32 (norm statistics, the loss's log-softmax, softmax under CUDA autocast)
#   "mask" a dropout mask: 1 byte (bool) from CUDA's fused dropout; CPU dropout multiplies by a
#          mask of the input's dtype
def _dtype_bytes(precision: Precision, device: str) -> dict[str, int]:
    half = 4 if precision == "fp32" else 2
    x = 2 if precision in PURE_16BIT else 4
    return {"x": x, "half": half, "f32": 4, "mask": 1 if device == "cuda" else half, "i64": 8}


def param_bytes(precision: Precision) -> int:
    """Bytes per parameter of the model as held in memory: PyTorch AMP keeps the model (the
    master weights) in fp32 and casts on the fly; pure bf16 holds bf16 weights."""
    return 2 if precision in PURE_16BIT else 4


def state_bytes(precision: Precision) -> int:
    """Bytes per element of the optimizer's states: fp32 where the recipe asks for it, otherwise the
    parameters' dtype (torch.optim's behaviour)."""
    return 4 if precision in FP32_STATES else param_bytes(precision)


def optimizer_state_bytes(optimizer: Optimizer, n_params: int, precision: Precision) -> int:
    """Persistent optimizer state. PyTorch keeps Adam's m and v (and momentum) in the parameter's
    dtype: 8 B/param for fp32 params (ZeRO's K=12 counts fp32 master weights too, which AMP keeps
    as the model itself), 4 B/param for pure-bf16 params. 8-bit Adam (Dettmers+21, arXiv:2110.02861):
    1 byte each for m and v plus one fp32 scale per 2048-value block of each."""
    sb = state_bytes(precision)
    master = 4 * n_params if precision == "fp16-fp32-master" else 0  # fp32 master weights (ZeRO's K includes them)
    if optimizer in ("adamw", "adam"):
        return 2 * n_params * sb + master
    if optimizer == "sgd-momentum":
        return n_params * sb + master
    if optimizer == "sgd":
        return master
    if optimizer == "adamw-8bit":
        return 2 * n_params + 2 * 4 * -(-n_params // 2048) + master
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def optimizer_step_temporaries(optimizer: Optimizer, impl: OptimizerImpl, spec: ModelSpec, n_params: int,
                               precision: Precision) -> int:
    """Transient memory inside optimizer.step() (PyTorch 2.x implementations):
    - foreach (the CUDA default): each _foreach_ op over the whole parameter list returns a full new
      list, so AdamW briefly holds one extra copy of all parameters (the denominator sqrt(v)+eps);
    - for-loop: the same ops one tensor at a time: sqrt(v) and sqrt(v)/c make two copies of the
      tensor being updated, while the previous tensor's denominator is still referenced (Python frees
      it only when the name is rebound): max over neighbours of size[i-1] + 2 size[i];
    - fused: one kernel updates in place: ~0. SGD (no momentum) updates in place."""
    pb = param_bytes(precision)
    if impl == "fused" or optimizer in ("sgd", "sgd-momentum"):  # SGD updates buffers and params in place
        return 0
    if optimizer == "adamw-8bit":  # bitsandbytes dequantizes block by block, in place
        return 0
    if impl == "foreach":  # the copy has the states' dtype
        return n_params * state_bytes(precision)
    if impl == "for-loop":
        return _for_loop_peak(spec) * pb
    raise ValueError(f"unknown optimizer implementation {impl!r}; choose from {', '.join(OPTIMIZER_IMPLS)}")


def model_states(model: ModelSpec | str, *, precision: Precision = "fp32", optimizer: Optimizer = "adamw",
                 trainable_params: int | None = None) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states: what the ZeRO paper calls model states
    (Rajbhandari+19: 16 bytes/param for mixed-precision Adam, 2 + 2 + 12)."""
    spec = _resolve(model)
    _check_choice(precision, PRECISIONS, "precision")
    _check_choice(optimizer, OPTIMIZERS, "optimizer")
    n_all = spec.params
    n_train = n_all if trainable_params is None else trainable_params
    if not 0 <= n_train <= n_all:
        raise ValueError(f"trainable_params must be between 0 and {n_all}, got {trainable_params}")
    pb = param_bytes(precision)
    return MemoryBreakdown(parameters=n_all * pb, gradients=n_train * pb,
                           optimizer_states=optimizer_state_bytes(optimizer, n_train, precision),
                           label=f"{spec.name} model states ({precision}, {optimizer})")


def _for_loop_peak(spec: ModelSpec) -> int:
    sizes = [0] + [n for _, n in spec.param_tensors()]
    return max(a + 2 * b for a, b in zip(sizes, sizes[1:]))


# ============================================================================ activations
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
    part: str = "attn"  # "mlp" for the MLP's tensors (freed first in the block's backward)


# elements per token the activation function saves: transformers' gelu_new is written out
# (0.5 * x * (1 + tanh(c * (x + 0.044715 * x^3)))) and keeps four intermediates; the others one
_ACT_SAVES = {"gelu_new": 4, "gelu_fast": 4, "quick_gelu": 2}


def _norm(spec: ModelSpec, name: str) -> list[Saved]:
    h = spec.hidden_size
    if spec.norm == "rmsnorm":  # x (fp32) for x.pow(2); x * rsqrt(var) for the weight multiply; rsqrt
        return [Saved(name=f"{name} input", width=h, kind="x"), Saved(name=f"{name} normalized", width=h, kind="x"),
                Saved(name=f"{name} rsqrt", width=1, kind="f32")]
    return [Saved(name=f"{name} input", width=h, kind="x"), Saved(name=f"{name} mean, rstd", width=2, kind="f32")]


def _math_path(spec: ModelSpec, attention: AttentionImpl, device: str) -> bool:
    """True where the s x s scores are materialised: eager attention, and SDPA on the CPU with
    attention dropout (PyTorch's CPU flash kernel has no dropout, so it falls back to math)."""
    return attention == "eager" or (device == "cpu" and spec.attention_dropout > 0)


def _attention(spec: ModelSpec, *, attention: AttentionImpl, device: str, precision: Precision,
               qkv: list[Saved], out_copy_flash: bool = False) -> list[Saved]:
    """Scaled dot-product attention after the projections: `qkv` are the saved q, k, v."""
    a, qd = spec.num_heads, spec.q_dim
    saved = list(qkv)
    # PyTorch's CPU math SDPA computes 16-bit attention in fp32: q, k, v are upcast copies, scores fp32
    cpu_upcast = device == "cpu" and attention == "sdpa" and precision != "fp32"
    if cpu_upcast:
        saved = [dataclasses.replace(q, kind="f32") for q in saved]
    if _math_path(spec, attention, device):
        # fp32, or autocast's fp32 softmax; pure bf16 keeps bf16 probabilities (except CPU SDPA)
        soft = "f32" if precision not in PURE_16BIT or cpu_upcast else "half"
        saved.append(Saved(name="softmax(QK^T)", width=1, kind=soft, per_score=True))
        if precision in ("bf16-mixed", "fp16-mixed") and device == "cuda":  # autocast: fp32 softmax, half copy
            saved.append(Saved(name="probs in half", width=1, kind="half", per_score=True))
        if spec.attention_dropout > 0:
            saved += [Saved(name="attn dropout mask", width=1, kind="f32" if cpu_upcast else "mask", per_score=True),
                      Saved(name="attn dropout out", width=1, kind="f32" if cpu_upcast else "half", per_score=True)]
        saved.append(Saved(name="attn out (o_proj input)", width=qd, kind="half"))
    else:  # flash / memory-efficient kernel: output and log-sum-exp only (Dao+22)
        saved += [Saved(name="attn out", width=qd, kind="half"), Saved(name="logsumexp", width=a, kind="f32")]
        if out_copy_flash:
            saved.append(Saved(name="o_proj input", width=qd, kind="half"))
    return saved


def _mlp(spec: ModelSpec, *, dropout_inside: bool = False) -> list[Saved]:
    return [dataclasses.replace(x, part="mlp") for x in _mlp_saved(spec, dropout_inside=dropout_inside)]


def _mlp_saved(spec: ModelSpec, *, dropout_inside: bool) -> list[Saved]:
    h, i = spec.hidden_size, spec.intermediate_size
    n_act = _ACT_SAVES.get(spec.activation, 1)
    saved = [Saved(name="mlp input", width=h, kind="half")]
    if spec.gated_mlp:  # down(act(gate(x)) * up(x))
        saved += [Saved(name="act saved", width=n_act * i, kind="half"),
                  Saved(name="act(gate), up", width=2 * i, kind="half")]
    elif spec.activation == "relu":  # relu saves its output, which is also the next matmul's input
        saved += [Saved(name="relu out", width=i, kind="half")]
    else:
        saved += [Saved(name="act saved", width=n_act * i, kind="half")]
    if dropout_inside:
        saved += [Saved(name="mlp dropout mask", width=i, kind="mask"), Saved(name="down input", width=i, kind="half")]
    elif not (spec.activation == "relu" and not spec.gated_mlp):
        saved.append(Saved(name="down input", width=i, kind="half"))
    return saved


def _drop(spec: ModelSpec, name: str, n: int = 1) -> list[Saved]:
    if spec.hidden_dropout <= 0:
        return []
    return [Saved(name=f"{name} dropout mask", width=spec.hidden_size, kind="mask")] * n


def _qkv_separate(spec: ModelSpec) -> list[Saved]:
    # q, k, v outputs; grouped-query k and v are expanded to all heads (repeat_kv) before attention.
    # With a single KV head the expansion is a stride-0 view: no copy.
    kv = spec.kv_dim if spec.num_kv_heads == 1 else spec.q_dim
    return [Saved(name="q", width=spec.q_dim, kind="half"), Saved(name="k (all heads)", width=kv, kind="half"),
            Saved(name="v (all heads)", width=kv, kind="half")]


def layer_saved(spec: ModelSpec, *, attention: AttentionImpl = "sdpa", device: str = "cuda",
                precision: Precision = "fp32", decoder: bool = False, batch_size: int = 2) -> list[Saved]:
    """The tensors one transformer block saves for backward (T5: `decoder=True` for a decoder block).
    `batch_size` matters only at 1, where some views need no copy."""
    f = spec.family
    h = spec.hidden_size
    kw = dict(attention=attention, device=device, precision=precision)
    math = _math_path(spec, attention, device)
    if f == "gpt2":
        fused = [Saved(name="c_attn out (q,k,v views)", width=3 * h, kind="half")]
        if math and attention == "sdpa" and batch_size == 1:  # math SDPA scales q and k into copies;
            # at batch 1, v's view needs no copy and keeps the whole qkv output alive
            fused.append(Saved(name="scaled q, k", width=2 * h, kind="half"))
        return (_norm(spec, "ln_1") + [Saved(name="c_attn input", width=h, kind="half")]
                + _attention(spec, qkv=fused, **kw) + _drop(spec, "resid")
                + _norm(spec, "ln_2") + _mlp(spec) + _drop(spec, "mlp"))
    if f == "gpt_neox":
        qkv = [Saved(name="q, k after rotary", width=2 * h, kind="half")]
        if math and batch_size > 1:  # matmul(probs, v) saves a contiguous copy of v
            qkv.append(Saved(name="v", width=h, kind="half"))
        else:  # SDPA saves v, a view of the fused qkv output, which keeps all of it alive
            qkv.append(Saved(name="qkv out (v view)", width=3 * h, kind="half"))
        norms = _norm(spec, "input_layernorm")
        if spec.parallel_residual:  # both norms read the same x: only the second's statistics are new
            norms += [s for s in _norm(spec, "post_attention_layernorm") if s.kind == "f32"]
        else:
            norms += _norm(spec, "post_attention_layernorm")
        return (norms + [Saved(name="qkv input", width=h, kind="half")]
                + _attention(spec, qkv=qkv, out_copy_flash=True, **kw) + _drop(spec, "hidden", 2) + _mlp(spec))
    if f == "opt":
        return (_norm(spec, "self_attn_layer_norm") + [Saved(name="q/k/v input", width=h, kind="half")]
                + _attention(spec, qkv=_qkv_separate(spec), **kw) + _drop(spec, "hidden", 2)
                + _norm(spec, "final_layer_norm") + _mlp(spec))
    if f == "llama":
        return (_norm(spec, "input_layernorm") + [Saved(name="q/k/v input", width=h, kind="half")]
                + _attention(spec, qkv=_qkv_separate(spec), **kw)
                + _norm(spec, "post_attention_layernorm") + _mlp(spec))
    if f == "bert":  # post-norm: LayerNorm(x + dropout(dense(...)))
        return ([Saved(name="q/k/v input", width=h, kind="half")] + _attention(spec, qkv=_qkv_separate(spec), **kw)
                + _drop(spec, "attn output") + _norm(spec, "attention LayerNorm")
                + _mlp(spec) + _drop(spec, "output") + _norm(spec, "output LayerNorm"))
    if f == "t5":
        self_attn = (_norm(spec, "self-attn norm") + [Saved(name="q/k/v input", width=h, kind="half")]
                     + _attention(spec, qkv=_qkv_separate(spec), **{**kw, "attention": "eager"})
                     + _drop(spec, "self-attn"))
        ff = _norm(spec, "ff norm") + _mlp(spec, dropout_inside=spec.hidden_dropout > 0) + _drop(spec, "ff")
        if not decoder:
            return self_attn + ff
        # cross-attention's bias needs no gradient, so SDPA may use its fused kernel; k and v are
        # projections of the encoder's output (kept once, see activation_bytes)
        cross = (_norm(spec, "cross-attn norm") + [Saved(name="cross q input", width=h, kind="half")]
                 + _attention(spec, qkv=_qkv_separate(spec), **kw) + _drop(spec, "cross-attn"))
        return self_attn + cross + ff
    raise ValueError(f"no activation model for family {f!r}")


def model_saved(spec: ModelSpec) -> list[Saved]:
    """Saved tensors outside the blocks, per token: embeddings, final norm, LM head, loss."""
    h, V = spec.hidden_size, spec.vocab_size
    f = spec.family
    saved: list[Saved] = []
    if f == "gpt2":
        saved += _drop(spec, "embedding")
    elif f == "bert":
        saved += _norm(spec, "embedding LayerNorm") + _drop(spec, "embedding")
    elif f == "t5":  # encoder and decoder: embedding dropout, final norm, final dropout
        saved += 2 * (_drop(spec, "embedding") + _norm(spec, "final norm") + _drop(spec, "final"))
    if f == "bert":  # MLM head: dense -> gelu -> LayerNorm -> decoder
        saved += [Saved(name="head dense input", width=h, kind="half"), Saved(name="head gelu input", width=h, kind="half")]
        saved += _norm(spec, "head LayerNorm")
    elif f == "t5":
        pass
    elif f != "opt" or spec.final_norm:
        saved += _norm(spec, "final norm")
    e = spec.word_embed_proj_dim or h
    saved += [Saved(name="lm_head input", width=e, kind="half"),
              # the loss upcasts the logits to fp32; cross-entropy keeps log_softmax(logits)
              Saved(name="log_softmax(logits)", width=V, kind="f32")]
    if spec.is_causal_lm:  # causal LMs shift (pad) the labels into a new int64 tensor
        saved.append(Saved(name="shifted targets", width=1, kind="i64"))
    return saved


def _ledger_bytes(saved: list[Saved], *, tokens: int, scores: int, nbytes: dict[str, int]) -> int:
    return sum(s.width * nbytes[s.kind] * (scores if s.per_score else tokens) for s in saved)


def _linear_weight_params(spec: ModelSpec) -> int:
    """Parameters that pass through a matmul (autocast casts them and keeps the copy for backward):
    all but embeddings, norms and biases."""
    g = spec.param_groups()
    h = spec.hidden_size
    blocks = spec.num_layers + spec.num_decoder_layers
    per_block_norm_bias = 8 * h  # generous: norms and biases are tiny next to the matrices
    lm = spec.vocab_size * (spec.word_embed_proj_dim or h)
    return max(0, g["layers"] - blocks * per_block_norm_bias) + lm


def activation_bytes(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                     attention: AttentionImpl = "sdpa", recompute: Recompute = "none", device: str = "cuda") -> dict[str, int]:
    """Bytes saved for backward at the end of the forward pass, split into 'layers' (all blocks),
    'one_layer' (the largest block), 'outside' (embeddings, head, loss) and 'weight_copies'
    (autocast's half-precision weights). With full recompute a block keeps only its input."""
    nb = _dtype_bytes(precision, device)
    b, s, a = batch_size, seq_len, spec.num_heads
    tokens, scores = b * s, b * a * s * s
    kw = dict(attention=attention, device=device, precision=precision, batch_size=b)
    enc_saved = layer_saved(spec, **kw)
    block = layer_saved(spec, decoder=True, **kw) if spec.family == "t5" else enc_saved  # the larger block
    enc = _ledger_bytes(enc_saved, tokens=tokens, scores=scores, nbytes=nb)
    dec = _ledger_bytes(block, tokens=tokens, scores=scores, nbytes=nb) if spec.family == "t5" else 0
    mlp_part = _ledger_bytes([x for x in block if x.part == "mlp"], tokens=tokens, scores=scores, nbytes=nb)
    n_enc, n_dec = spec.num_layers, spec.num_decoder_layers
    one = max(enc, dec)
    if recompute == "full":  # checkpoint keeps each block's input (Chen+16; Korthikanti+22: 2sbh in 16-bit)
        kept = tokens * spec.hidden_size * nb["x"]
        layers = (n_enc + n_dec) * kept
        copies = 0  # weights are re-cast during recompute, one block at a time
    else:
        layers = n_enc * enc + n_dec * dec
        copies = 2 * _linear_weight_params(spec) if precision in ("bf16-mixed", "fp16-mixed") else 0
    outside = _ledger_bytes(model_saved(spec), tokens=tokens, scores=scores, nbytes=nb)
    if spec.family == "t5":
        # relative-position buckets: an (s, s) int64 index per stack, kept by the bias embedding
        outside += 2 * s * s * nb["i64"]
        outside += tokens * spec.hidden_size * nb["x"]  # the encoder's output, read by every cross-attention
        if not _math_path(spec, attention, device):  # SDPA keeps the (zero) cross-attention bias
            outside += a * s * s * nb["x"]
        if recompute == "full":  # checkpointed blocks also keep their shared inputs: a (1, a, s, s) bias
            outside += a * s * s * nb["x"]
    # A block's backward runs the MLP first (all the block's tensors still saved, plus the MLP's
    # d(hidden)s), then attention (the MLP's tensors freed; with the scores materialised, d(probs)
    # and d(scores), b * a * s^2 each). The extra over the block's saved tensors at its worst:
    math = _math_path(spec, attention, device) or spec.family == "t5"
    mlp_grads = (3 if spec.gated_mlp else 2) * tokens * spec.intermediate_size * nb["half"]
    attn_grads = 2 * scores * nb["f32"] if math else 3 * tokens * spec.q_dim * nb["half"]
    transient = max(mlp_grads, attn_grads - mlp_part, 0)
    return {"layers": layers, "one_layer": one, "outside": outside, "weight_copies": copies,
            "block_backward": transient, "block_grad_in": 2 * tokens * spec.hidden_size * nb["x"]}


# ============================================================================ training
def _resolve(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        from .specs import preset

        return preset(model)
    raise TypeError(f"model must be a ModelSpec or a preset name, got {type(model).__name__}")


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")


def _check_positive(**sizes: int) -> None:
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def estimate_training(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                      optimizer: Optimizer = "adamw", optimizer_impl: OptimizerImpl = "foreach",
                      attention: AttentionImpl = "sdpa", recompute: Recompute = "none",
                      device: Literal["cuda", "cpu"] = "cuda", trainable_params: int | None = None) -> MemoryBreakdown:
    """Peak memory of one steady-state training step: the largest of `training_phases(...)`, whose
    docstring describes the arguments."""
    phases = training_phases(model, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                             optimizer_impl=optimizer_impl, attention=attention, recompute=recompute, device=device,
                             trainable_params=trainable_params)
    return max(phases, key=lambda m: m.total)


def training_phases(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                    optimizer: Optimizer = "adamw", optimizer_impl: OptimizerImpl = "foreach",
                    attention: AttentionImpl = "sdpa", recompute: Recompute = "none",
                    device: Literal["cuda", "cpu"] = "cuda", trainable_params: int | None = None) -> list[MemoryBreakdown]:
    """Memory, in bytes, at each candidate peak of one steady-state training step, in step order
    (`.phase` names each); `estimate_training` returns the largest.

    batch_size  # sequences per step (micro-batch)
    seq_len     # tokens per sequence (T5: encoder and decoder each)
    precision   fp32 | bf16-mixed | fp16-mixed (PyTorch AMP: fp32 model + autocast) | bf16 (pure)
    optimizer   adamw | adam | sgd | sgd-momentum | adamw-8bit;  optimizer_impl for-loop | foreach | fused
    attention   eager (stores the s x s scores) | sdpa (flash / memory-efficient kernels)
    recompute   none | full (activation checkpointing of every block)
    device      cuda | cpu: which kernels run (dropout masks are 1-byte bool on CUDA, full-width on
                CPU; CPU SDPA with dropout materialises the scores)
    trainable_params  fewer than all for frozen-base fine-tuning (PEFT): gradients and optimizer
                states cover only these (activations are still those of the full model)

    The step's phases are forward end, backward start (the logits' gradient), the LM head's
    backward, a recomputed block's backward, and optimizer.step(); the peak is their maximum.
    Model states follow ZeRO (Rajbhandari+19, arXiv:1910.02054) as PyTorch implements them;
    activations follow the op-by-op ledger in `layer_saved` (cf. Korthikanti+22, Table 2).

    Known limitations: allocator rounding and fragmentation, the CUDA context and cuBLAS/NCCL
    workspaces are not included (see `fit`'s reserve). Where the peak falls inside one block's
    backward (tiny models with small vocabularies, especially under full recompute) the transient
    gradients are modelled, not traced: errors up to ~10-20 % there, against < 1 % for real models
    (benchmarks/estimator_accuracy.py). CUDA kernels are modelled from their documentation: the GPU
    validation run is still outstanding.
    """
    spec = _resolve(model)
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    _check_choice(precision, PRECISIONS, "precision")
    _check_choice(optimizer, OPTIMIZERS, "optimizer")
    _check_choice(optimizer_impl, OPTIMIZER_IMPLS, "optimizer implementation")
    _check_choice(attention, ATTENTIONS, "attention implementation")
    _check_choice(recompute, RECOMPUTES, "recompute")
    _check_choice(device, ("cuda", "cpu"), "device")
    states = model_states(spec, precision=precision, optimizer=optimizer, trainable_params=trainable_params)
    P, G, O = states.parameters, states.gradients, states.optimizer_states
    n_all = spec.params
    n_train = n_all if trainable_params is None else trainable_params

    b, s, V = batch_size, seq_len, spec.vocab_size
    pb = param_bytes(precision)
    T_opt = optimizer_step_temporaries(optimizer, optimizer_impl, spec, n_train, precision)
    inputs = b * s * 8 * (2 if spec.family == "t5" else 1)  # int64 ids (+ T5's separate labels)
    act = activation_bytes(spec, batch_size=b, seq_len=s, precision=precision, attention=attention,
                           recompute=recompute, device=device)
    A = act["layers"] + act["outside"] + act["weight_copies"]
    logits32 = b * s * V * 4  # the loss works on fp32 logits
    logits_alive = logits32 + (b * s * V * 2 if precision != "fp32" else 0)  # + the half logits under AMP
    e = spec.word_embed_proj_dim or spec.hidden_size
    head_grad = V * e * pb if n_train == n_all else 0  # the (tied) embedding's gradient, made first

    base = dict(parameters=P, optimizer_states=O, inputs=inputs, label=f"{spec.name} train b={b} s={s} {precision}")
    phases = [
        MemoryBreakdown(**base, activations=A + logits_alive, phase="forward end (loss computed)"),
        # nll_loss backward makes d(log_softmax) and log_softmax backward makes d(logits): two fp32 b*s*V
        MemoryBreakdown(**base, activations=A, temporaries=2 * logits32, phase="backward start (logits gradient)"),
        MemoryBreakdown(**base, activations=A - b * s * V * 4, temporaries=logits32, gradients=head_grad,
                        phase="LM head backward"),
    ]
    half = _dtype_bytes(precision, device)["half"]
    loss_side = b * s * (V * 4 + e * half + (8 if spec.is_causal_lm else 0))  # freed by now
    block_grads = spec.param_groups()["layers"] * pb // (spec.num_layers + spec.num_decoder_layers)
    if recompute == "full":  # a block is recomputed (all it saves, at once) while its gradient flows
        phases.append(MemoryBreakdown(**base, activations=act["layers"] + act["outside"] - loss_side + act["one_layer"],
                                      temporaries=act["block_grad_in"], gradients=head_grad + block_grads,
                                      phase="backward of a recomputed block"))
    else:  # the last block's backward: its gradients in flight (small vocabularies peak here)
        phases.append(MemoryBreakdown(**base, activations=A - loss_side, gradients=head_grad,
                                      temporaries=act["block_backward"] + act["block_grad_in"],
                                      phase="backward of the last block"))
    # the embedding's backward makes a dense V x e gradient; tied to the LM head, AccumulateGrad then
    # adds it to the head's gradient: old, new and sum coexist for a moment
    emb = V * e * pb if n_train == n_all else 0
    phases.append(MemoryBreakdown(parameters=P, gradients=G - emb, optimizer_states=O, inputs=inputs,
                                  temporaries=emb * (3 if spec.tie_word_embeddings else 1), label=base["label"],
                                  phase="embedding backward (gradient accumulation)"))
    phases.append(MemoryBreakdown(parameters=P, gradients=G, optimizer_states=O, temporaries=T_opt, inputs=inputs,
                                  label=base["label"], phase="optimizer.step()"))
    return phases


# ============================================================================ inference
_INFER_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def kv_cache_bytes(spec: ModelSpec, *, batch_size: int, seq_len: int, dtype: str = "bf16") -> int:
    """K and V for every layer and token: 2 * L * n_kv_heads * head_dim * s * b * bytes.
    Grouped-query attention stores n_kv_heads, not n_heads (a calculator that uses the hidden size
    overestimates Llama-3-8B's cache 4x). T5: the decoder's self-attention cache plus its
    cross-attention cache of the encoder's seq_len tokens. Source: Pope+22 (arXiv:2211.05102);
    vLLM (Kwon+23, arXiv:2309.06180): OPT-13B ~ 800 KB per token in fp16."""
    layers = spec.num_decoder_layers if spec.family == "t5" else spec.num_layers
    if spec.family == "bert":
        return 0
    per_token = 2 * layers * spec.num_kv_heads * spec.head_dim * _INFER_BYTES[dtype]
    return per_token * seq_len * batch_size * (2 if spec.family == "t5" else 1)


def estimate_inference(model: ModelSpec | str, *, batch_size: int, seq_len: int, dtype: str = "bf16",
                       kv_dtype: str | None = None, attention: AttentionImpl = "sdpa",
                       all_logits: bool = True) -> MemoryBreakdown:
    """Peak memory of a prefill of batch_size x seq_len tokens without gradients: weights, the KV
    cache (in `kv_dtype`, default the model's dtype), the largest transient inside one block, and
    the logits (every position when `all_logits`, as `model(ids)` returns; generation keeps only
    the last). T5 runs the encoder on seq_len tokens and one decoder token.

    Known limitations: the transient is a bound on the block's largest simultaneous intermediates,
    not a trace of the kernel's workspace."""
    spec = _resolve(model)
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    _check_choice(dtype, tuple(_INFER_BYTES), "dtype")
    _check_choice(attention, ATTENTIONS, "attention implementation")
    kv_dtype = kv_dtype or dtype
    _check_choice(kv_dtype, tuple(_INFER_BYTES), "KV-cache dtype")
    e = 2 if dtype == "int8" else _INFER_BYTES[dtype]  # int8 weights compute in 16-bit
    b, s, h, i = batch_size, seq_len, spec.hidden_size, spec.intermediate_size
    weights = spec.params * _INFER_BYTES[dtype]
    kv = kv_cache_bytes(spec, batch_size=b, seq_len=s, dtype=kv_dtype)
    stream = 2 * b * s * h * e  # the residual stream and a normalised copy
    attn = b * s * (spec.q_dim * 3) * e
    if attention == "eager":
        attn += 2 * b * spec.num_heads * s * s * e  # scores and probabilities
    mlp = b * s * i * e * (3 if spec.gated_mlp else 2)
    logits_tokens = (b * s if all_logits else b) if spec.family != "t5" else b
    logits = logits_tokens * spec.vocab_size * e
    return MemoryBreakdown(parameters=weights, kv_cache=kv, activations=stream + max(attn, mlp) + logits,
                           inputs=b * s * 8, label=f"{spec.name} prefill b={b} s={s} {dtype}",
                           phase="prefill")


# ============================================================================ checkpoints and fit
def checkpoint_bytes(model: ModelSpec | str | int, *, dtype: str = "fp32") -> int:
    """Size of the weights on disk: params x bytes per param (BERT-base, 110 M params in fp32:
    419.62 MiB). Accepts a ModelSpec, a preset name or a parameter count."""
    n = model if isinstance(model, int) and not isinstance(model, bool) else _resolve(model).params
    _check_choice(dtype, tuple(_INFER_BYTES), "dtype")
    return n * _INFER_BYTES[dtype]


DEFAULT_RESERVE = 512 * 1024 * 1024  # assumed CUDA context + workspaces + fragmentation; lab 1 measures it


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Whether a workload fits a GPU, and the largest batch size that does."""

    gpu: GPUSpec
    needed: int  # bytes at the given batch size, reserve included
    available: int
    fits: bool
    max_batch_size: int  # 0: not even batch size 1 fits
    reserve: int

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{verdict} on {self.gpu.name} ({fmt_bytes(self.needed)} needed incl. {fmt_bytes(self.reserve)} "
                f"reserve, {fmt_bytes(self.available)} available); largest batch size that fits: {self.max_batch_size}")


def fit(model: ModelSpec | str, gpu: GPUSpec | str, *, batch_size: int = 1, mode: Literal["train", "infer"] = "train",
        reserve: int = DEFAULT_RESERVE, max_search: int = 1 << 16, **options) -> Fit:
    """Does the training step (or inference prefill) fit on `gpu`, and what is the largest batch size
    that does? `options` are those of estimate_training / estimate_inference. `reserve` bytes are
    held back for the CUDA context, cuBLAS workspace and allocator fragmentation (an assumption:
    measure yours with `vramlab.measure`)."""
    g = _gpu(gpu) if isinstance(gpu, str) else gpu
    est = estimate_training if mode == "train" else estimate_inference
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")

    def need(bs: int) -> int:
        return est(model, batch_size=bs, **options).total + reserve

    needed = need(batch_size)
    lo, hi = 0, 1  # memory grows with batch size: exponential then binary search
    while hi <= max_search and need(hi) <= g.memory_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, max_search + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= g.memory_bytes else (lo, mid)
    return Fit(gpu=g, needed=needed, available=g.memory_bytes, fits=needed <= g.memory_bytes, max_batch_size=lo,
               reserve=reserve)
