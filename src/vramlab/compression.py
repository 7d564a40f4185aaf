"""Compression: quantization, LoRA / QLoRA, 8-bit optimizer states, distillation, pruning, weight
sharing and low-rank factorisation. Pure Python: no torch import (runs in the browser too).

Quantization works on weights given as rows (a list of lists of numbers): absmax integer
quantization with one scale per tensor, per row (vector-wise) or per group of a row; LLM.int8()'s
outlier decomposition; NF4 with double quantization (QLoRA) by its byte layout. Model-level
functions take a `ModelSpec` (or a preset name) and return bytes, parameter counts, a pruned
`ModelSpec`, or a `MemoryBreakdown` built from `vramlab.memory`'s training and inference estimates.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from . import checks as _checks
from .activations import ledger_bytes, layer_saved, recompute_plan
from .memory import MemoryBreakdown, estimate_inference, optimizer_state_bytes, param_bytes, training_phases
from .precision import PRECISIONS, dtype_sizes
from .specs import resolve as _resolve
from .units import fmt_bytes
from .specs import ModelSpec, SpecError

SCHEMES: tuple[str, ...] = ("per-tensor", "per-row", "per-group")
SCALE_BYTES = 4  # one fp32 scale per tensor, row or group (bitsandbytes' SCB and absmax are fp32)


# ============================================================================ absmax quantization
def _matrix(weights, name: str = "weights") -> list[list[float]]:
    """Rows of finite numbers (numpy's too; no bool, no string), all the same length, as floats; or a
    ValueError naming the argument (and the offending element). A row that is a list or tuple of
    plain ints and floats of ordinary size is taken in one pass; any other goes through
    `checks.numbers`, which decides and names what is wrong."""
    if isinstance(weights, (str, bytes, dict)) or not isinstance(weights, Iterable):
        raise ValueError(f"{name} must be a matrix: a list of rows of numbers, got {_checks.show(weights)}")
    rows = []
    for i, row in enumerate(weights):
        if isinstance(row, (list, tuple)) and all((type(v) is float or type(v) is int) and -1e300 < v < 1e300 for v in row):
            rows.append([float(v) for v in row])
        else:
            rows.append([float(v) for v in _checks.numbers(f"{name}[{i}]", row, lo=None, empty=True)])
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"{name} must be a non-empty matrix whose rows all have the same length")
    return rows


def _scheme(scheme: str, group_size: int, bits: int) -> tuple[int, int]:
    _checks.one_of("quantization scheme", scheme, SCHEMES)
    return _checks.whole("group_size", group_size, hi=1 << 24), _checks.whole("bits", bits, lo=2, hi=8)


def _blocks(cols: int, scheme: str, group_size: int) -> list[tuple[int, int]]:
    """The column ranges one scale covers within a row (per-tensor: the whole row, one scale shared)."""
    if scheme != "per-group":
        return [(0, cols)]
    return [(lo, min(lo + group_size, cols)) for lo in range(0, cols, group_size)]


@dataclass(frozen=True)
class Quantized:
    """Integers in [-qmax, qmax] (`q`, rows like the input) and their fp32 scales: w ~ q * scale."""

    q: tuple[tuple[int, ...], ...]
    scales: tuple[float, ...]  # per-tensor: 1; per-row: one a row; per-group: rows x groups, row-major
    scheme: str
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        """Storage: the integers packed at `bits` each, plus the scales."""
        return quant_bytes(len(self.q), len(self.q[0]), scheme=self.scheme, bits=self.bits, group_size=self.group_size)

    def dequantize(self) -> list[list[float]]:
        blocks = _blocks(len(self.q[0]), self.scheme, self.group_size)
        return [[v * _scale(self.scales, self.scheme, i, j, len(blocks)) for j, (lo, hi) in enumerate(blocks)
                 for v in row[lo:hi]] for i, row in enumerate(self.q)]


def _scale(scales, scheme: str, row: int, block: int, n_blocks: int) -> float:
    """The scale of block `block` of row `row` (per-tensor: the one scale)."""
    return scales[0] if scheme == "per-tensor" else scales[row * n_blocks + block]


def quantize(weights, *, scheme: str = "per-row", bits: int = 8, group_size: int = 128) -> Quantized:
    """Symmetric absmax quantization (BMInf, LLM.int8()): scale = max|w| / qmax over the tensor, the
    row or the group, qmax = 2^(bits-1) - 1 (127 for INT8); q = round(w / scale), ties to even as
    torch.round. An all-zero block gets scale 0 and q = 0."""
    group_size, bits = _scheme(scheme, group_size, bits)
    rows = _matrix(weights)
    qmax = (1 << (bits - 1)) - 1
    blocks = _blocks(len(rows[0]), scheme, group_size)
    if scheme == "per-tensor":
        scales = [max(abs(v) for r in rows for v in r) / qmax]
    else:
        scales = [max(abs(v) for v in r[lo:hi]) / qmax for r in rows for lo, hi in blocks]
    q = []
    for i, r in enumerate(rows):
        qr: list[int] = []
        for j, (lo, hi) in enumerate(blocks):
            s = _scale(scales, scheme, i, j, len(blocks))
            qr += [max(-qmax, min(qmax, round(v / s))) if s else 0 for v in r[lo:hi]]
        q.append(tuple(qr))
    return Quantized(q=tuple(q), scales=tuple(scales), scheme=scheme, bits=bits, group_size=group_size)


def quant_bytes(rows: int, cols: int, *, scheme: str = "per-row", bits: int = 8, group_size: int = 128) -> int:
    """Bytes of a rows x cols matrix quantized to `bits` (packed) with fp32 scales."""
    group_size, bits = _scheme(scheme, group_size, bits)
    rows, cols = _checks.whole("rows", rows, hi=1 << 40), _checks.whole("cols", cols, hi=1 << 40)
    n_scales = {"per-tensor": 1, "per-row": rows, "per-group": rows * -(-cols // group_size)}[scheme]
    return -(-rows * cols * bits // 8) + SCALE_BYTES * n_scales


@dataclass(frozen=True)
class QuantError:
    """Reconstruction error of a quantized matrix: the largest |w - w_hat|, the root mean square
    error, and that over the weights' own root mean square (relative)."""

    max_abs: float
    rms: float
    relative: float
    nbytes: int


def quant_error(weights, *, scheme: str = "per-row", bits: int = 8, group_size: int = 128) -> QuantError:
    """Quantize `weights`, dequantize, and measure the error against the original."""
    rows = _matrix(weights)
    qz = quantize(rows, scheme=scheme, bits=bits, group_size=group_size)
    back = qz.dequantize()
    diffs = [a - b for r, s in zip(rows, back) for a, b in zip(r, s)]
    n = len(diffs)
    # root mean squares scaled by the largest magnitude, so that squares of 1e300 do not overflow
    top = max(abs(v) for r in rows for v in r) or 1.0
    rms = top * math.sqrt(sum((d / top) ** 2 for d in diffs) / n)
    w_rms = top * math.sqrt(sum((v / top) ** 2 for r in rows for v in r) / n)
    return QuantError(max_abs=max(abs(d) for d in diffs), rms=rms, relative=rms / w_rms if w_rms else 0.0,
                      nbytes=qz.nbytes)


def llm_int8(x, w, *, threshold: float = 6.0) -> dict:
    """LLM.int8() (Dettmers+22, arXiv:2208.07339) for y = x w^T, x tokens x d_in, w d_out x d_in:
    the input columns holding any |x| > threshold (the outlier features) are multiplied in 16-bit;
    the rest in INT8 with vector-wise scales (one per token of x, one per output row of w).
    Returns the output, the outlier columns, and the bytes: stored (INT8 w + fp32 row scales) and
    the 16-bit outlier slices the multiply makes (of x and w). `threshold=inf`: no outliers, all INT8."""
    xs, ws = _matrix(x, "x"), _matrix(w, "w")
    if len(xs[0]) != len(ws[0]):
        raise ValueError(f"x has {len(xs[0])} columns and w {len(ws[0])}: both must be d_in")
    if not (isinstance(threshold, numbers.Real) and not _checks.is_bool(threshold) and threshold == math.inf):
        threshold = _checks.positive("threshold", threshold)  # an infinite one: no column is an outlier
    d_in = len(xs[0])
    outliers = [j for j in range(d_in) if any(abs(r[j]) > threshold for r in xs)]
    out_set = set(outliers)
    keep = [j for j in range(d_in) if j not in out_set]

    def cols(m, idx):
        return [[r[j] for j in idx] for r in m]

    y = [[0.0] * len(ws) for _ in xs]
    if keep:
        qx, qw = quantize(cols(xs, keep), scheme="per-row"), quantize(cols(ws, keep), scheme="per-row")
        for i, (xr, sx) in enumerate(zip(qx.q, qx.scales)):
            for k, (wr, sw) in enumerate(zip(qw.q, qw.scales)):
                y[i][k] += sum(a * b for a, b in zip(xr, wr)) * sx * sw  # int32 accumulate, then rescale
    if outliers:
        xo, wo = cols(xs, outliers), cols(ws, outliers)
        for i, xr in enumerate(xo):
            for k, wr in enumerate(wo):
                y[i][k] += sum(a * b for a, b in zip(xr, wr))
    stored = len(ws) * d_in + SCALE_BYTES * len(ws)
    return {"y": y, "outlier_columns": outliers, "stored_bytes": stored,
            "fp16_bytes": 2 * len(outliers) * (len(xs) + len(ws))}


# NF4 (Dettmers+23, QLoRA, arXiv:2305.14314): 4-bit codes in blocks of 64 with one absmax each; with
# double quantization the absmaxes are themselves 8-bit, in blocks of 256 with one fp32 scale
# each (plus one fp32 mean). bitsandbytes' Params4bit (quant_type="nf4", compress_statistics=True).
NF4_BLOCK, NF4_BLOCK2 = 64, 256


def nf4_bytes(n: int, *, double_quant: bool = True, block_size: int = NF4_BLOCK, block2: int = NF4_BLOCK2) -> int:
    """Bytes of a tensor of `n` weights in NF4: n/2 bytes of codes, and each block's absmax: fp32,
    or, double quantized, one byte with an fp32 scale per `block2` absmaxes and one fp32 offset.
    bitsandbytes also keeps, per tensor, the 16 NF4 levels (fp32) and, double quantized, the
    256-entry fp32 map the absmaxes are coded with (`QuantState.code`: 64 B and 1 KiB)."""
    n = _checks.whole("n", n, hi=1 << 48)
    double_quant = _checks.flag("double_quant", double_quant)
    block_size, block2 = _checks.whole("block_size", block_size, hi=1 << 20), _checks.whole("block2", block2, hi=1 << 20)
    blocks = -(-n // block_size)
    consts = blocks + 4 * -(-blocks // block2) + 4 + 256 * 4 if double_quant else 4 * blocks
    return -(-n // 2) + consts + 16 * 4


def nf4_bits_per_param(*, double_quant: bool = True, block_size: int = NF4_BLOCK, block2: int = NF4_BLOCK2) -> float:
    """Bits per weight in the limit of large tensors: 4 + 32/64 = 4.5 without double quantization,
    4 + 8/64 + 32/(64 x 256) = 4.127 with it (QLoRA: constants 0.5 -> 0.127 bits)."""
    double_quant = _checks.flag("double_quant", double_quant)
    block_size, block2 = _checks.whole("block_size", block_size, hi=1 << 20), _checks.whole("block2", block2, hi=1 << 20)
    c = 8 / block_size + 32 / (block_size * block2) if double_quant else 32 / block_size
    return 4 + c


# ============================================================================ a model's linear layers
ROLES: tuple[str, ...] = ("qkv", "o", "mlp_in", "mlp_out", "cross_kv", "other")


@dataclass(frozen=True)
class Linear:
    """One nn.Linear (or GPT-2's Conv1D) of a model: its module name as transformers names it,
    in and out widths, bias, and role (which input it reads, for what LoRA's adapters keep)."""

    name: str
    d_in: int
    d_out: int
    bias: bool
    role: str


def linear_layers(model: ModelSpec | str) -> list[Linear]:
    """Every linear layer of the model except the LM head (the output layer, which PEFT's
    "all-linear" and bitsandbytes leave alone), in module order."""
    s = _resolve(model)
    h, i, f = s.hidden_size, s.intermediate_size, s.family
    out: list[Linear] = []

    def mlp(p: str, names: tuple[str, ...]) -> list[Linear]:
        ins = names[:-1] if s.gated_mlp else names[:1]
        return ([Linear(p + n, h, i, s.mlp_bias, "mlp_in") for n in ins]
                + [Linear(p + names[-1], i, h, s.mlp_bias, "mlp_out")])

    if f == "gpt2":
        for n in range(s.num_layers):
            p = f"transformer.h.{n}."
            out += [Linear(p + "attn.c_attn", h, 3 * h, s.qkv_bias, "qkv"), Linear(p + "attn.c_proj", h, h, s.out_bias, "o")]
            out += mlp(p + "mlp.", ("c_fc", "c_proj"))
    elif f == "gpt_neox":
        for n in range(s.num_layers):
            p = f"gpt_neox.layers.{n}."
            out += [Linear(p + "attention.query_key_value", h, 3 * h, s.qkv_bias, "qkv"),
                    Linear(p + "attention.dense", h, h, s.out_bias, "o")]
            out += mlp(p + "mlp.", ("dense_h_to_4h", "dense_4h_to_h"))
    elif f == "opt":
        e = s.word_embed_proj_dim or h
        if e != h:
            out += [Linear("model.decoder.project_out", h, e, False, "other"), Linear("model.decoder.project_in", e, h, False, "other")]
        for n in range(s.num_layers):
            p = f"model.decoder.layers.{n}."
            out += [Linear(p + "self_attn." + x, h, h, s.qkv_bias, "qkv") for x in ("k_proj", "v_proj", "q_proj")]
            out += [Linear(p + "self_attn.out_proj", h, h, s.out_bias, "o")] + mlp(p, ("fc1", "fc2"))
    elif f == "llama":
        for n in range(s.num_layers):
            p = f"model.layers.{n}."
            out += [Linear(p + "self_attn.q_proj", h, s.q_dim, s.qkv_bias, "qkv"),
                    Linear(p + "self_attn.k_proj", h, s.kv_dim, s.qkv_bias, "qkv"),
                    Linear(p + "self_attn.v_proj", h, s.kv_dim, s.qkv_bias, "qkv"),
                    Linear(p + "self_attn.o_proj", s.q_dim, h, s.out_bias, "o")]
            out += mlp(p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
    elif f == "bert":
        for n in range(s.num_layers):
            p = f"bert.encoder.layer.{n}."
            out += [Linear(p + "attention.self." + x, h, h, s.qkv_bias, "qkv") for x in ("query", "key", "value")]
            out += [Linear(p + "attention.output.dense", h, h, s.out_bias, "o"),
                    Linear(p + "intermediate.dense", h, i, s.mlp_bias, "mlp_in"),
                    Linear(p + "output.dense", i, h, s.mlp_bias, "mlp_out")]
        out.append(Linear("cls.predictions.transform.dense", h, h, True, "other"))
    elif f == "t5":
        q = s.q_dim
        ffn = ("wi_0", "wi_1", "wo") if s.gated_mlp else ("wi", "wo")
        for stack, depth, dec in (("encoder", s.num_layers, False), ("decoder", s.num_decoder_layers, True)):
            for n in range(depth):
                p = f"{stack}.block.{n}.layer."
                out += [Linear(p + "0.SelfAttention." + x, h, q, False, "qkv") for x in ("q", "k", "v")]
                out.append(Linear(p + "0.SelfAttention.o", q, h, False, "o"))
                if dec:
                    out += [Linear(p + "1.EncDecAttention.q", h, q, False, "qkv")]
                    out += [Linear(p + "1.EncDecAttention." + x, h, q, False, "cross_kv") for x in ("k", "v")]
                    out.append(Linear(p + "1.EncDecAttention.o", q, h, False, "o"))
                out += mlp(p + ("2." if dec else "1.") + "DenseReluDense.", ffn)
    else:  # pragma: no cover - every family above
        raise ValueError(f"no linear layers known for family {f!r}")
    return out


# peft's default LoRA targets for each family (peft.utils.constants,
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: the same for every model type of a family)
DEFAULT_TARGETS = {"gpt2": ("c_attn",), "gpt_neox": ("query_key_value",), "opt": ("q_proj", "v_proj"),
                   "llama": ("q_proj", "v_proj"), "bert": ("query", "value"), "t5": ("q", "v")}


def _target_names(targets) -> "str | tuple[str, ...]":
    """"default", "all-linear", or the module names (a comma-separated string, or a list of names)."""
    if isinstance(targets, str) and targets in ("default", "all-linear"):
        return targets
    names = None
    if isinstance(targets, str):
        names = tuple(t.strip() for t in targets.split(","))
    elif isinstance(targets, Iterable) and not isinstance(targets, (bytes, dict)):
        names = tuple(targets)
    if not names or any(not isinstance(t, str) or not t.strip() for t in names):
        raise ValueError(f"targets must be 'default', 'all-linear', module names (a list, or one string with commas), "
                         f"got {_checks.show(targets)}")
    return names


def lora_targets(model: ModelSpec | str, targets: "str | tuple[str, ...] | list[str]" = "default") -> list[Linear]:
    """The linear layers LoRA adapts, chosen as peft chooses them: "default" (peft's targets for
    the model type), "all-linear" (every linear but the output layer), or module names, each
    matching a module whose name is it or ends with "." + it. A name that matches nothing is an error."""
    spec = _resolve(model)
    names = _target_names(targets)
    layers = linear_layers(spec)
    if names == "all-linear":
        return layers
    if names == "default":
        names = DEFAULT_TARGETS[spec.family]
    known = sorted({x.name.rsplit(".", 1)[-1] for x in layers})
    for t in names:
        if not any(x.name == t or x.name.endswith("." + t) for x in layers):
            raise ValueError(f"target {t!r} matches no linear layer of {spec.name}; its layers are named {', '.join(known)}")
    return [x for x in layers if any(x.name == t or x.name.endswith("." + t) for t in names)]


def lora_params(model: ModelSpec | str, *, rank: int = 8, targets="default") -> int:
    """LoRA's trainable parameters (Hu+21, arXiv:2106.09685): r x (d_in + d_out) per adapted
    matrix (A is r x d_in, B is d_out x r; no bias), as peft's `print_trainable_parameters` counts."""
    rank = _checks.whole("rank", rank, hi=1 << 20)
    return sum(rank * (x.d_in + x.d_out) for x in lora_targets(model, targets))


# ============================================================================ quantized weights
WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int8-per-tensor", "int4-g128", "nf4", "nf4-dq")


def gptq_bytes(rows: int, cols: int, *, group_size: int = 128, bits: int = 4) -> int:
    """Bytes of a rows x cols (out x in) matrix in GPTQ's and AWQ's storage: `bits`-bit codes packed,
    and per group of `group_size` input columns and output row an fp16 scale and a `bits`-bit zero
    point, packed too (AutoAWQ's `qweight`, `scales`, `qzeros`; AutoGPTQ adds an int32 group index
    per input column, `g_idx`, left out): 4 + 16/128 + 4/128 = 4.16 bits a weight at 4 bits in
    groups of 128."""
    rows, cols = _checks.whole("rows", rows, hi=1 << 40), _checks.whole("cols", cols, hi=1 << 40)
    group_size, bits = _checks.whole("group_size", group_size, hi=1 << 24), _checks.whole("bits", bits, lo=2, hi=8)
    groups = rows * -(-cols // group_size)
    return -(-rows * cols * bits // 8) + 2 * groups + -(-groups * bits // 8)


def sparse24_bytes(rows: int, cols: int, *, value_bytes: int = 2) -> int:
    """Bytes of a rows x cols matrix in 2:4 semi-structured sparsity (two of every four consecutive
    weights of a row are zero; Ampere's and later sparse tensor cores skip them): the kept half of
    the values, and 4 bits of metadata per group of four (the two kept positions, 2 bits each), as
    CUTLASS and `torch.sparse.to_sparse_semi_structured` store it."""
    rows, cols = _checks.whole("rows", rows, hi=1 << 40), _checks.whole("cols", cols, hi=1 << 40)
    if cols % 4:
        raise ValueError(f"2:4 sparsity groups a row's weights in fours: cols must divide by 4, got {cols}")
    value_bytes = _checks.one_of("value_bytes", _checks.whole("value_bytes", value_bytes, hi=4), (1, 2, 4))
    return rows * cols // 2 * value_bytes + rows * cols // 8


def weight_bytes(model: ModelSpec | str, fmt: str = "int8") -> dict[str, int]:
    """The model's weights for inference with its linear layers (not the LM head) stored in `fmt`
    and everything else (embeddings, norms, biases, the LM head) in bf16 (fp32 for "fp32"):
    int8 = LLM.int8()'s per-row INT8 with an fp32 scale per row (bitsandbytes Linear8bitLt);
    int8-per-tensor = one scale a matrix; int4-g128 = GPTQ's and AWQ's storage, 4-bit codes with
    an fp16 scale and a 4-bit zero point per group of 128 (`gptq_bytes`); nf4 / nf4-dq = QLoRA's
    NF4 without / with double quantization."""
    spec = _resolve(model)
    _checks.one_of("weight format", fmt, WEIGHT_FORMATS)
    lin = linear_layers(spec)
    matrix = sum(x.d_in * x.d_out for x in lin)
    rest = spec.params - matrix
    other = 4 if fmt == "fp32" else 2
    if fmt in ("fp32", "bf16"):
        linear = matrix * other
    elif fmt in ("nf4", "nf4-dq"):
        linear = sum(nf4_bytes(x.d_in * x.d_out, double_quant=fmt == "nf4-dq") for x in lin)
    elif fmt == "int4-g128":
        linear = sum(gptq_bytes(x.d_out, x.d_in) for x in lin)
    else:
        scheme, bits = {"int8": ("per-row", 8), "int8-per-tensor": ("per-tensor", 8)}[fmt]
        linear = sum(quant_bytes(x.d_out, x.d_in, scheme=scheme, bits=bits) for x in lin)
    return {"linear": linear, "other": rest * other, "total": linear + rest * other,
            "linear_params": matrix, "other_params": rest}


def quantized_inference(model: ModelSpec | str, *, fmt: str = "int8", batch_size: int = 1, seq_len: int = 512,
                        new_tokens: int | None = None, device: str = "cuda") -> MemoryBreakdown:
    """Inference with quantized linear weights: `estimate_inference` in bf16 (activations, KV cache
    and logits in 16-bit: the quantized layers compute in bf16) with the weights of `weight_bytes`.
    fmt "fp32" runs everything in fp32."""
    spec = _resolve(model)
    w = weight_bytes(spec, fmt)
    est = estimate_inference(spec, batch_size=batch_size, seq_len=seq_len, dtype="fp32" if fmt == "fp32" else "bf16",
                             new_tokens=new_tokens, device=device)
    return dataclasses.replace(est, parameters=w["total"], precision=fmt, label=f"{est.label} weights {fmt}")


# ============================================================================ 8-bit optimizer states
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096


def adam8bit_state_bytes(sizes, *, block_size: int = BNB_BLOCK, min_8bit_size: int = BNB_MIN_8BIT) -> int:
    """bitsandbytes' 8-bit Adam/AdamW states (`Optimizer2State.init_state`, block_wise=True) for
    parameter tensors of `sizes` elements: a tensor of at least `min_8bit_size` elements keeps m and
    v in uint8 (1 byte each) with one fp32 absmax per `block_size` values of each; a smaller one
    keeps both in fp32 (8 bytes an element). The two 256-entry fp32 quantization maps (m's signed,
    v's unsigned: 2 KiB) are one pair per optimizer, shared by every 8-bit tensor.
    The paper (arXiv:2110.02861) used blocks of 2048: that is `block_size=2048`."""
    block_size = _checks.whole("block_size", block_size, hi=1 << 24)
    min_8bit_size = _checks.whole("min_8bit_size", min_8bit_size, lo=0, hi=1 << 48)
    total = maps = 0
    for n in _checks.wholes("sizes", sizes, lo=1, hi=1 << 48, empty=True):
        if n < min_8bit_size:
            total += 8 * n
        else:
            total += 2 * n + 2 * 4 * -(-n // block_size)
            maps = 2 * 256 * 4
    return total + maps


# ============================================================================ prompt, prefix and P-tuning
# (helper G's region.) peft 0.21's prompt-learning methods: a few trainable "virtual tokens" in front
# of a frozen model. Prompt tuning (Lester+21) and P-tuning (Liu+21) prepend them to the input
# embeddings, so every activation grows from s to s + p tokens; prefix tuning (Li & Liang 21) hands
# every layer p learned keys and values (past_key_values), so only attention's K/V grow.
PROMPT_METHODS: tuple[str, ...] = ("prompt", "prefix", "p-tuning")
ENCODER_TYPES: tuple[str, ...] = ("MLP", "LSTM")


@dataclass(frozen=True, kw_only=True)
class PromptLearning:
    """The shapes peft 0.21 gives a prompt-learning adapter (`_prepare_prompt_learning_config`):
    `token_dim` (d: the embedding width; prefix tuning on a model with `num_key_value_heads`, the
    Llama family, uses a_kv x head_dim, the K/V width), `num_layers` (L: num_hidden_layers, T5's
    encoder depth), `submodules` (T: 2 for a sequence-to-sequence model, else 1),
    `encoder_hidden_size` (H: defaults to d) and `trainable` parameters."""

    method: str
    num_virtual_tokens: int
    token_dim: int
    num_layers: int
    submodules: int
    encoder_hidden_size: int
    trainable: int
    prefix_projection: bool = False  # prefix: the reparameterisation MLP
    encoder_type: str = "MLP"  # P-tuning's prompt encoder


def _lstm_params(d_in: int, hidden: int, layers: int) -> int:
    """torch.nn.LSTM(d_in, hidden, num_layers=layers, bidirectional=True): per layer and direction
    four gates, W_ih (4H x input) + W_hh (4H x H) + two biases (4H each); layers after the first
    read both directions (2H)."""
    total = 0
    for k in range(layers):
        width = d_in if k == 0 else 2 * hidden
        total += 2 * (4 * hidden * (width + hidden) + 8 * hidden)
    return total


def prompt_learning(model: ModelSpec | str, *, method: str = "prompt", num_virtual_tokens: int = 20,
                    prefix_projection: bool = False, encoder_hidden_size: int | None = None,
                    encoder_type: str = "MLP", encoder_num_layers: int = 2) -> PromptLearning:
    """Trainable parameters of peft's prompt-learning adapters, as `get_nb_trainable_parameters()`
    counts them (p = num_virtual_tokens, d, L, T, H as in `PromptLearning`):

    prompt    PromptEmbedding (Lester+21): an Embedding of T·p rows of d: T·p·d.
    prefix    PrefixEncoder (Li & Liang 21): without projection an Embedding of p rows of L·2·d
              (every layer's keys and values): p·L·2·d. With `prefix_projection` the
              reparameterisation MLP: Embedding p·d, Linear d->H (+H), Tanh, Linear H->L·2·d (+L·2·d).
    p-tuning  PromptEncoder (Liu+21): an Embedding T·p·d, then "MLP": Linear d->H, ReLU, Linear H->H,
              ReLU, Linear H->d (with biases); or "LSTM": a bidirectional LSTM of
              `encoder_num_layers` layers (d->H), then Linear 2H->2H, ReLU, Linear 2H->d.

    Known limitations: T5's second half of the prompt embedding (the decoder's p rows) is trained
    by peft's count but never used by PeftModelForSeq2SeqLM's prompt/P-tuning forward (it gets no
    gradient); prefix tuning of a T5 whose a x d_kv differs from d_model (mT5-small) fails in peft,
    and here."""
    s = _resolve(model)
    _checks.one_of("prompt-learning method", method, PROMPT_METHODS)
    p = _checks.whole("num_virtual_tokens", num_virtual_tokens, hi=1 << 20)
    prefix_projection = _checks.flag("prefix_projection", prefix_projection)
    _checks.one_of("encoder_type", encoder_type, ENCODER_TYPES)
    encoder_num_layers = _checks.whole("encoder_num_layers", encoder_num_layers, hi=64)
    d = s.kv_dim if method == "prefix" and s.family == "llama" else s.hidden_size
    if method == "prefix" and s.family == "t5" and s.q_dim != s.hidden_size:
        raise ValueError(f"{s.name}: peft's prefix tuning views d_model ({s.hidden_size}) as heads x head width, "
                         f"but its attention is {s.num_heads} x {s.head_dim} = {s.q_dim} wide; prefix tuning cannot "
                         "wrap it (use prompt tuning or P-tuning)")
    H = d if encoder_hidden_size is None else _checks.whole("encoder_hidden_size", encoder_hidden_size, hi=1 << 20)
    L, T = s.num_layers, 2 if s.family == "t5" else 1
    if method == "prompt":
        n = T * p * d
    elif method == "prefix":
        n = p * d + d * H + H + H * L * 2 * d + L * 2 * d if prefix_projection else p * L * 2 * d
    elif encoder_type == "MLP":
        n = T * p * d + (d * H + H) + (H * H + H) + (H * d + d)
    else:
        n = T * p * d + _lstm_params(d, H, encoder_num_layers) + (2 * H * 2 * H + 2 * H) + (2 * H * d + d)
    return PromptLearning(method=method, num_virtual_tokens=p, token_dim=d, num_layers=L, submodules=T,
                          encoder_hidden_size=H, trainable=n, prefix_projection=prefix_projection and method == "prefix",
                          encoder_type=encoder_type)


def prompt_params(model: ModelSpec | str, *, method: str = "prompt", num_virtual_tokens: int = 20, **options) -> int:
    """`prompt_learning(...).trainable`: the trainable parameters of prompt tuning, prefix tuning or
    P-tuning on `model` (peft's `get_nb_trainable_parameters()[0]`)."""
    return prompt_learning(model, method=method, num_virtual_tokens=num_virtual_tokens, **options).trainable


def _prompt_training(spec: ModelSpec, pl: PromptLearning, *, batch_size: int, seq_len: int, precision: str,
                     optimizer: str, optimizer_impl: str, attention: str, device: str, gpu, recompute) -> MemoryBreakdown:
    """`peft_training` for prompt tuning, prefix tuning and P-tuning (helper G's region; see there)."""
    from .activations import uses_math_attention, activation_bytes

    b, s, p, n = batch_size, seq_len, pl.num_virtual_tokens, pl.trainable
    t5, method = spec.family == "t5", pl.method
    # the virtual tokens take positions too (prefix tuning: as a KV cache's past length), as a real peft run does
    _checks.positions(spec, s + p, name=f"seq_len + {p} virtual tokens =")
    if method == "prefix" and recompute != "none":
        raise ValueError("peft refuses prefix tuning with gradient checkpointing (its prefix is a KV cache): "
                         "use recompute='none', or prompt tuning / P-tuning")
    kw = dict(precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl, attention=attention,
              device=device, gpu=gpu, recompute=recompute, trainable_params=n)
    nb = dtype_sizes(precision, device)
    ak = dict(precision=precision, attention=attention, device=device, frozen_base=True)
    n_enc, n_dec = spec.num_layers, spec.num_decoder_layers
    if method != "prefix" and not t5:
        # the prompt is part of the sequence: every block, the logits and the loss see s + p tokens
        # (peft labels the virtual tokens -100)
        phases, extra = training_phases(spec, batch_size=b, seq_len=s + p, **kw), 0
    elif method != "prefix":
        # T5 (PeftModelForSeq2SeqLM): the encoder reads p + s tokens, the decoder its s; every
        # cross-attention's k and v, and the encoder's output, are p tokens longer
        phases = training_phases(spec, batch_size=b, seq_len=s, **kw)
        longer = activation_bytes(spec, batch_size=b, seq_len=s + p, recompute=recompute, **ak)["full"]
        short = activation_bytes(spec, batch_size=b, seq_len=s, recompute=recompute, **ak)["full"]
        extra = (sum(longer[:n_enc]) - sum(short[:n_enc]) + n_dec * 2 * b * p * spec.q_dim * nb["half"]
                 + b * p * spec.hidden_size * nb["x"] + ((s + p) ** 2 - s ** 2) * nb["i64"])
    else:
        # prefix: each layer's attention (T5: the decoder's self-attention) concatenates p learned keys
        # and values to its own; autograd saves the longer k and v, and scores s x (s + p) where they
        # are materialised. The blocks before the first prefix (T5: the whole encoder, which peft
        # leaves alone) need no gradient and save nothing.
        phases = training_phases(spec, batch_size=b, seq_len=s, use_cache=not t5, **kw)
        saved = layer_saved(spec, decoder=t5, attention=attention, device=device, precision=precision, batch_size=b)
        led = dict(tokens=b * s, nbytes=nb, batch=b)
        layers = n_dec if t5 else spec.num_layers
        own = saved[:next((i for i, x in enumerate(saved) if x.name.startswith("cross")), len(saved))]  # self-attention's
        scores = ledger_bytes([x for x in own if x.per_score and not x.shared_batch], scores=b * spec.num_heads * s * p, **led) \
            if uses_math_attention(spec, attention, device, precision) else 0
        first = next((i for i, x in enumerate(saved) if x.name == "q" or x.name.startswith("c_attn out")
                      or x.name.startswith("qkv out")), 0)
        unsaved = ledger_bytes([x for x in saved[:first] if not x.for_weight], scores=0, **led)
        if t5:
            unsaved += sum(activation_bytes(spec, batch_size=b, seq_len=s, **ak)["full"][:n_enc])
        extra = layers * (2 * b * p * pl.token_dim * nb["half"] + scores) - unsaved
        if not t5 and spec.num_kv_heads < spec.num_heads:
            # grouped-query attention: the prefix makes transformers pass SDPA an explicit mask, and
            # with a mask it repeats k and v to every query head (repeat_kv), which SDPA then saves
            extra += layers * 2 * b * (s + p) * spec.q_dim * nb["half"]
        if pl.prefix_projection:  # the reparameterisation MLP keeps its two Linears' inputs (fp32)
            extra += b * p * (pl.token_dim + pl.encoder_hidden_size) * 4
    if method == "p-tuning":  # the prompt encoder runs on T·p rows per sequence and keeps its Linears' inputs
        H, d, rows = pl.encoder_hidden_size, pl.token_dim, b * pl.submodules * p
        # (fp32). Known limitation: the LSTM's own saved gates are not counted, only its head's inputs
        extra += rows * 4 * ((d + 2 * H) if pl.encoder_type == "MLP" else 4 * H)
    pb = param_bytes(precision)
    out = []
    for m in phases:
        upd = dict(parameters=spec.params * pb + n * 4, precision=precision,
                   label=f"{spec.name} {method} p={p} b={b} s={s} {precision}")
        if m.activations:
            upd["activations"] = m.activations + extra
        if m.gradients:
            upd["gradients"] = m.gradients * 4 // pb
        if pb == 2:  # peft's prompt encoder is fp32 on a 16-bit base: fp32 Adam states
            upd["optimizer_states"] = optimizer_state_bytes(optimizer, n, "fp32")
        out.append(dataclasses.replace(m, **upd))
    return max(out, key=lambda m: m.total)


# ============================================================================ LoRA / QLoRA training
METHODS: tuple[str, ...] = ("full", "lora", "lora-int8", "qlora")
_QUANT_BASE = {"lora-int8": "int8", "qlora": "nf4-dq"}  # the base's linear layers, quantized
# the inputs in `activations.layer_saved` that only a linear's weight gradient needs, by that linear's role
_SAVED_ROLE = {"attn out (o_proj input)": "o", "o_proj input": "o", "mlp input": "mlp_in", "down input": "mlp_out"}
# where in a block's ledger the layers of each role begin reading (the first tensor they save)
_ROLE_START = {"q/k/v input": "qkv", "c_attn input": "qkv", "qkv input": "qkv", "attn out": "o",
               "attn out (o_proj input)": "o", "mlp input": "mlp_in", "down input": "mlp_out"}


def peft_training(model: ModelSpec | str, *, method: str = "lora", rank: int = 8, targets="default",
                  batch_size: int, seq_len: int, precision: str = "fp32", optimizer: str = "adamw",
                  optimizer_impl: str = "foreach", attention: str = "sdpa", device: str = "cuda",
                  gpu=None, autocast: bool = True, adapter_dtype: str = "fp32",
                  recompute="none", num_virtual_tokens: int = 20, prefix_projection: bool = False,
                  encoder_hidden_size: int | None = None, encoder_type: str = "MLP",
                  encoder_num_layers: int = 2) -> MemoryBreakdown:
    """Peak memory of one fine-tuning step (PEFT: Houlsby+19; LoRA: Hu+21; QLoRA: Dettmers+23).

    full:  `estimate_training` of the whole model; with optimizer "adamw-8bit", bitsandbytes'
           states tensor by tensor (`adam8bit_state_bytes`).
    lora:  the base's K parameters frozen, N = `lora_params` adapters trained: weights K + N,
           gradients N, optimizer states for N. Activations: the frozen linears keep no input for a
           weight gradient, except where an adapter reads it (its A matrix saves its input); each
           adapter also keeps A's output (r values a token); frozen RMSNorms keep no normalised
           copy; the first block keeps nothing from before its first adapter.
    lora-int8 / qlora: lora on a base whose linear layers are LLM.int8() per-row INT8 / NF4 with
           double quantization, the other weights bf16; the step computes in bf16 (activations as
           pure bf16), adapters and their Adam states in fp32, and one linear layer's bf16 weight
           dequantized at a time. That is a step under autocast; with `autocast=False` peft casts
           each adapter's input to the adapters' fp32, so every adapter keeps its own fp32 copy
           of its input (and A's output in fp32) where autocast shares the bf16 one.
    The base's precision: "bf16" (or "fp16") holds the frozen base in 16 bits and, as peft does by
    default (`autocast_adapter_dtype=True`), the adapters in fp32 (`adapter_dtype="fp32"`; "base" keeps
    them in the base's dtype), exactly as lora-int8 and qlora hold theirs. "bf16-mixed" keeps the
    frozen base in fp32 (4 bytes a parameter): the result carries a warning saying so.
    prompt / prefix / p-tuning: peft's prompt learning (`prompt_learning`, with `num_virtual_tokens`
           p and its options): the frozen base K plus N trainable fp32 parameters. Prompt tuning and
           P-tuning run every block (T5: the encoder) on s + p tokens, and the gradient must reach
           the input, so every block keeps what it would for a frozen base; prefix tuning keeps
           each layer's K and V p tokens longer (T5: the decoder's self-attention only, and its
           encoder, which never sees the prefix, saves nothing; a grouped-query model keeps k and v
           repeated to every query head, as transformers does once the prefix brings a mask).
    recompute: a plan of `activations.recompute_plan` (QLoRA's 65 B on one 48 GB GPU used "full",
    gradient checkpointing of every block): a checkpointed block keeps its input only, and its
    adapters' tensors exist while it (its segment) is recomputed in the backward.
    """
    spec = _resolve(model)
    if isinstance(method, str) and method in PROMPT_METHODS:  # prompt / prefix / P-tuning: `prompt_learning`
        pl = prompt_learning(spec, method=method, num_virtual_tokens=num_virtual_tokens, prefix_projection=prefix_projection,
                             encoder_hidden_size=encoder_hidden_size, encoder_type=encoder_type,
                             encoder_num_layers=encoder_num_layers)
        return _prompt_training(spec, pl, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                                optimizer_impl=optimizer_impl, attention=attention, device=device, gpu=gpu, recompute=recompute)
    _checks.one_of("fine-tuning method", method, METHODS + PROMPT_METHODS)
    autocast = _checks.flag("autocast", autocast)
    rank = _checks.whole("rank", rank, hi=1 << 20)
    _target_names(targets)
    _checks.one_of("adapter dtype", adapter_dtype, ("fp32", "base"))
    kw = dict(batch_size=batch_size, seq_len=seq_len, optimizer=optimizer, optimizer_impl=optimizer_impl,
              attention=attention, device=device, gpu=gpu, recompute=recompute)
    plan = recompute_plan(recompute, spec)
    if method == "full":
        phases = training_phases(spec, precision=precision, **kw)
        if optimizer == "adamw-8bit":
            bnb = adam8bit_state_bytes(n for _, n in spec.param_tensors())
            phases = [dataclasses.replace(m, optimizer_states=bnb) for m in phases]
        return max(phases, key=lambda m: m.total)
    targets_ = lora_targets(spec, targets)
    n = lora_params(spec, rank=rank, targets=targets)
    if n >= spec.params:
        raise ValueError(f"rank {rank} gives {n:,} adapter parameters, more than {spec.name}'s own {spec.params:,}: "
                         "that is no longer parameter-efficient; choose a smaller rank")
    quant = _QUANT_BASE.get(method)
    if quant:
        _checks.one_of("precision", precision, PRECISIONS)
        precision = "bf16"  # the base computes in bf16; the adapters stay fp32
    phases = training_phases(spec, precision=precision, trainable_params=n, **kw)
    pb = param_bytes(precision)
    # the adapters' dtype: peft keeps them fp32 on a quantized or 16-bit base (autocast_adapter_dtype)
    fp32_adapters = bool(quant) or (pb == 2 and adapter_dtype == "fp32")
    ab = 4 if fp32_adapters else pb
    warning = ""
    if precision == "bf16-mixed":
        warning = (f"bf16-mixed keeps the frozen base in fp32 ({fmt_bytes(4 * (spec.params))} for {spec.name}); "
                   "load it in bf16 (precision='bf16', adapters fp32 as peft keeps them) to halve it")
    nb = dtype_sizes(precision, device)
    # an adapter keeps A's output (r a token), and one on a layer whose input only that layer's
    # weight gradient needed (o, the MLP's) keeps that input again: the ledger's for-weight tensors
    roles = {x.role for x in targets_}
    b, sq = batch_size, seq_len
    led = dict(tokens=b * sq, scores=b * spec.num_heads * sq * sq, nbytes=nb, batch=b)
    lkw = dict(attention=attention, device=device, precision=precision, batch_size=b)
    blocks = [(layer_saved(spec, **lkw), spec.num_layers)]
    if spec.family == "t5":
        blocks.append((layer_saved(spec, decoder=True, **lkw), spec.num_decoder_layers))
    reread = sum(n_blocks * ledger_bytes([x for x in saved if x.for_weight and _SAVED_ROLE.get(x.name) in roles], **led)
                 for saved, n_blocks in blocks)
    # the first block of a stack reads a frozen embedding: what it computes before its first adapter
    # needs no gradient, so autograd saves none of it
    first = min((i for i, x in enumerate(blocks[0][0]) if _ROLE_START.get(x.name) in roles), default=0)
    unsaved = len(blocks) * ledger_bytes([x for x in blocks[0][0][:first] if not x.for_weight], **led)
    if fp32_adapters and not autocast:  # each adapter's own fp32 input and A output replace the shared bf16 inputs
        shared = sum(n_blocks * ledger_bytes([x for x in saved if not x.for_weight and _ROLE_START.get(x.name) in roles
                                               and x.kind == "half"], **led) for saved, n_blocks in blocks)
        adapters = sum(b * sq * (x.d_in + rank) * 4 for x in targets_) - shared
    else:
        adapters = len(targets_) * rank * b * sq * nb["half"] + reread
    # a checkpointed block keeps no adapter tensors but while its segment is recomputed; the first
    # block of a stack saves nothing before its first adapter only when it is not checkpointed
    ck = plan.checkpointed() if plan.keep == "input" else frozenset()
    total_blocks = sum(k for _, k in blocks)
    if ck:
        window = max(b_ - a_ for a_, b_ in plan.segments)
        firsts = [0] + ([spec.num_layers] if len(blocks) > 1 else [])
        adapters = adapters * (total_blocks - len(ck) + window) / total_blocks
        unsaved = unsaved * sum(1 for f in firsts if f not in ck) / len(blocks)
    extra_act = int(adapters - unsaved)
    if quant:
        base_params = weight_bytes(spec, quant)["total"]
        dequant = 2 * max(x.d_in * x.d_out for x in linear_layers(spec))
    else:
        base_params, dequant = spec.params * pb, 0
    out = []
    for m in phases:
        upd = dict(parameters=base_params + n * ab, precision=method if quant else precision, warning=warning,
                   label=f"{spec.name} {method} r={rank} b={batch_size} s={seq_len}" + ("" if quant else f" {precision}"))
        if m.activations:
            upd["activations"] = m.activations + extra_act
        if m.gradients:  # all the adapters', or (a recomputed block's backward) those made so far
            upd["gradients"] = m.gradients * ab // pb
        if fp32_adapters:  # fp32 adapters: torch.optim keeps fp32 states (Adam: m and v)
            upd["optimizer_states"] = optimizer_state_bytes(optimizer, n, "fp32")
            step = m.phase == "optimizer.step()"
            upd["temporaries"] = (n * 4 if optimizer_impl == "foreach" and optimizer in ("adamw", "adam") else 0) \
                if step else m.temporaries + dequant
        out.append(dataclasses.replace(m, **upd))
    return max(out, key=lambda m: m.total)


# ============================================================================ distillation
def distillation(teacher: ModelSpec | str, student: ModelSpec | str, *, batch_size: int, seq_len: int,
                 precision: str = "fp32", teacher_dtype: str = "fp32", optimizer: str = "adamw",
                 device: str = "cuda") -> MemoryBreakdown:
    """One distillation step (Hinton+15; PKD, Sun+19): the teacher runs a forward without gradients
    and its soft labels train the student (KL(softmax(t/T) || softmax(s/T)), plus the hard-label
    loss). Memory: the student's training step, plus the teacher's weights (in `teacher_dtype`),
    plus, through the student's forward and backward, the teacher's probabilities (fp32, b x s x V)
    and the student's log-probabilities at temperature T that the KL term saves (fp32, b x s x V).
    The teacher's own forward (its inference peak) comes before and is rarely the peak."""
    t, s = _resolve(teacher), _resolve(student)
    if t.vocab_size != s.vocab_size:
        raise ValueError(f"teacher and student must share a vocabulary for soft labels ({t.vocab_size:,} vs {s.vocab_size:,})")
    _checks.one_of("teacher dtype", teacher_dtype, ("fp32", "bf16"))
    phases = training_phases(s, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                             device=device)
    tw = t.params * (4 if teacher_dtype == "fp32" else 2)
    soft = 2 * batch_size * seq_len * s.vocab_size * 4
    out = [dataclasses.replace(m, parameters=m.parameters + tw,
                               activations=m.activations + soft if m.activations else 0,
                               label=f"distil {t.name} -> {s.name} b={batch_size} s={seq_len}") for m in phases]
    teacher_fwd = estimate_inference(t, batch_size=batch_size, seq_len=seq_len, dtype=teacher_dtype, device=device)
    first = phases[0]
    out.append(MemoryBreakdown(parameters=first.parameters + tw, optimizer_states=first.optimizer_states,
                               activations=teacher_fwd.activations, inputs=first.inputs, other=first.other,
                               precision=precision, device=device, label=out[0].label, phase="teacher forward"))
    return max(out, key=lambda m: m.total)


# ============================================================================ pruning, sharing, factorising
def prune(model: ModelSpec | str, *, heads: int = 0, intermediate: int = 0, layers: int = 0) -> ModelSpec:
    """Structured pruning (Michel+19 heads; BMCook): remove `heads` attention heads from every
    layer, `intermediate` MLP neurons from every layer, and `layers` whole blocks (T5: from the
    encoder and the decoder each). Returns the smaller model as a `ModelSpec`, whose memory every
    vramlab function computes. With grouped-query attention, only query heads go and the number
    left must stay a multiple of the KV heads. GPT-2, GPT-NeoX, OPT and BERT tie their attention
    width to the hidden size in vramlab's specs, so only their MLP width and layers can be pruned."""
    s = _resolve(model)
    heads = _checks.whole("heads", heads, lo=0, hi=s.num_heads - 1)
    intermediate = _checks.whole("intermediate", intermediate, lo=0, hi=s.intermediate_size - 1)
    depth = min(s.num_layers, s.num_decoder_layers) if s.family == "t5" else s.num_layers
    layers = _checks.whole("layers", layers, lo=0, hi=depth - 1)
    changes: dict = {"name": f"{s.name} pruned", "intermediate_size": s.intermediate_size - intermediate,
                     "num_layers": s.num_layers - layers}
    if s.family == "t5":
        changes["num_decoder_layers"] = s.num_decoder_layers - layers
    if heads:
        if s.family not in ("llama", "t5"):
            raise ValueError(f"{s.name}: pruning heads changes the attention width, which a {s.family} spec ties to "
                             "hidden_size; prune its MLP width (intermediate) or layers instead")
        a = s.num_heads - heads
        if s.num_kv_heads == s.num_heads:
            changes.update(num_heads=a, num_kv_heads=a)
        elif a % s.num_kv_heads:
            raise ValueError(f"{s.name} has {s.num_kv_heads} KV heads: the query heads left ({a}) must be a multiple of them")
        else:
            changes["num_heads"] = a
        if s.family == "llama" and s.hidden_size % a:
            raise ValueError(f"transformers' Llama needs hidden_size ({s.hidden_size}) to be a multiple of the heads "
                             f"left ({a}); prune a number of heads that leaves a divisor")
    try:
        return dataclasses.replace(s, **changes)
    except SpecError as e:
        raise ValueError(str(e)) from None


def shared_layers_params(model: ModelSpec | str, *, groups: int = 1) -> int:
    """Cross-layer weight sharing (ALBERT, Lan+19): the blocks split into `groups` groups of
    consecutive layers that each share one block's weights (groups=1: one block for all).
    Returns the model's parameters with sharing (embeddings and head unchanged)."""
    s = _resolve(model)
    if s.family == "t5":
        raise ValueError("weight sharing here covers single-stack models (one block type); T5 has two stacks")
    groups = _checks.whole("groups", groups, hi=s.num_layers)
    g = s.param_groups()
    return g["embeddings"] + g["head"] + g["layers"] // s.num_layers * groups


def low_rank_params(model: ModelSpec | str, *, rank: int, roles: tuple[str, ...] = ("qkv", "o", "mlp_in", "mlp_out")) -> int:
    """Low-rank factorisation: every linear layer of the given roles, W (d_out x d_in), replaced
    by U (d_out x k) V (k x d_in) with k = min(rank, d_in, d_out) (a layer where that saves nothing
    is left whole). Returns the model's parameters after factorising."""
    s = _resolve(model)
    rank = _checks.whole("rank", rank, hi=1 << 20)
    if isinstance(roles, (str, bytes, dict)) or not isinstance(roles, Iterable):
        raise ValueError(f"roles must be a list of layer roles ({', '.join(ROLES)}), got {_checks.show(roles)}")
    for r in roles:
        _checks.one_of("layer role", r, ROLES)
    saved = 0
    for x in linear_layers(s):
        if x.role in roles:
            k = min(rank, x.d_in, x.d_out)
            saved += max(0, x.d_in * x.d_out - k * (x.d_in + x.d_out))
    return s.params - saved


# ============================================================================ MoEfication: experts from a dense FFN
# Zhang+22 (MoEfication, arXiv:2110.01786): each FFN's intermediate neurons split into E equal
# groups (the "experts"); a router picks k of them per token, and only those neurons are computed.
MOE_ROUTERS: tuple[str, ...] = ("linear", "mlp")
_MOE_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MoEfication:
    """A dense model's FFNs turned into `experts` groups of `neurons_per_expert` neurons, `active` of
    them computed per token (MoEfication, Zhang+22). Counts are per token and over every FFN layer
    of the model (T5: encoder and decoder) unless a name says otherwise; FLOPs are the forward's
    matmuls (2 per multiply-add), as `checkpointing.flops` counts them.

    Weights stay resident: every expert is kept (any token may pick any expert), so `params` is the
    dense model's plus the routers'. MoEfication saves compute and the FFN's activation memory, not
    weight memory (nor gradient or optimizer memory when the experts are trained).

    Known limitations: elementwise FLOPs (the activation, the gate product) and the top-k selection
    are not counted; `ffn_intermediate_values` counts one tensor for the activation (SiLU, ReLU, exact
    GELU are one kernel; GPT-2's tanh GELU in eager PyTorch makes several temporaries);
    per-token routing keeps k indices a token (int64) that a real kernel may store
    smaller; the attention core's FLOPs are at `seq_len` (full s x s scores, as `checkpointing.flops`)."""

    model: str
    experts: int
    active: int
    neurons_per_expert: int
    ffn_layers: int
    router: str
    router_params: int              # all layers' routers
    params_dense: int
    params: int                     # params_dense + router_params: all experts stay resident
    ffn_params: int                 # all FFN layers' parameters (weights and biases)
    active_ffn_params: int          # the FFN parameters one token uses: k/E of the split part + the output bias
    active_params: int              # params - ffn_params + active_ffn_params (embeddings, attention, routers)
    ffn_flops_dense: int            # a token's FFN matmul FLOPs, all layers
    ffn_flops: int                  # the k experts' plus the router's
    flops_dense: int                # a token's whole forward (blocks and head) at seq_len
    flops: int
    ffn_intermediate_values: int    # values of width-intermediate tensors a token's FFN forwards make, all layers
    ffn_intermediate_values_dense: int
    ffn_saved_bytes_dense: int      # what a training step saves of the FFNs' intermediates a token (all layers)
    ffn_saved_bytes: int            # the same with k of E experts (plus the routing indices)
    weight_bytes_dense: int         # in `dtype`
    weight_bytes: int               # + the routers: not smaller
    dtype: str

    @property
    def active_share(self) -> float:
        """k / E: the share of each FFN's neurons a token computes."""
        return self.active / self.experts


def _moe_ffn_shapes(s: ModelSpec) -> tuple[int, int, int, bool]:
    """(input matrices reading the hidden state, FFN layers, intermediate tensors a forward makes per
    neuron, bias): gated FFNs down(act(gate x) * up x) make 4 (gate, up, act, product), plain ones 2."""
    n_in = 2 if s.gated_mlp else 1
    layers = s.num_layers + (s.num_decoder_layers if s.family == "t5" else 0)
    return n_in, layers, 4 if s.gated_mlp else 2, s.mlp_bias


def moe_router_params(hidden_size: int, experts: int, *, router: str = "linear", router_hidden: int = 0,
                      router_bias: bool = False) -> int:
    """One layer's router: "linear" scores each expert from the FFN's input (h x E, + E with a bias: a
    MoE gate, or MoEfication's similarity router with the groups' centroids as weights); "mlp" is
    MoEfication's learned router, a two-layer network h -> router_hidden -> E (with biases)."""
    h = _checks.whole("hidden_size", hidden_size, hi=1 << 24)
    e = _checks.whole("experts", experts, hi=1 << 24)
    _checks.one_of("router", router, MOE_ROUTERS)
    router_bias = _checks.flag("router_bias", router_bias)
    if router == "linear":
        return h * e + (e if router_bias else 0)
    r = _checks.whole("router_hidden", router_hidden, hi=1 << 24)
    return h * r + r + r * e + e


def moefication(model: ModelSpec | str, *, experts: int, active: int, router: str = "linear", router_hidden: int = 0,
                router_bias: bool = False, dtype: str = "bf16", precision: str = "bf16-mixed", seq_len: int = 1024,
                device: str = "cuda") -> MoEfication:
    """Parameters, compute and FFN activation memory a token needs once each FFN is MoEfied
    (Zhang+22): the `intermediate_size` neurons split into `experts` equal groups, `active` (k)
    computed per token. Per FFN layer of hidden size h, i neurons, m = i / E a group, n_in input
    matrices (2 for a gated FFN, 1 otherwise):
      FFN parameters         n_in (h i + i [bias]) + i h + h [bias]   (unchanged; + the router's)
      active FFN parameters  k m (n_in (h + [1]) + h) + h [bias]
      FFN FLOPs a token      2 k m h (n_in + 1) + the router's 2 h E  (dense: 2 i h (n_in + 1))
      intermediates a token  k m x (4 gated, 2 plain) values           (dense: i x the same)
    The training-saved bytes are `activations.layer_saved`'s FFN intermediates scaled to k m
    neurons, plus the k routing indices (int64) a token; `precision` and `device` as there.
    `dtype` is the weights' storage type (fp32, bf16, fp16) for `weight_bytes`."""
    from .checkpointing import flops as _flops

    s = _resolve(model)
    i = s.intermediate_size
    experts = _checks.whole("experts", experts, hi=i)
    active = _checks.whole("active", active, hi=experts)
    if i % experts:
        raise ValueError(f"{s.name}'s FFN has {i:,} neurons, which do not split into {experts} equal experts: "
                         f"choose a divisor of {i:,}")
    _checks.one_of("dtype", dtype, tuple(_MOE_DTYPES))
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    seq_len = _checks.whole("seq_len", seq_len, hi=1 << 24)
    h, m = s.hidden_size, i // experts
    n_in, layers, n_tensors, bias = _moe_ffn_shapes(s)
    per_router = moe_router_params(h, experts, router=router, router_hidden=router_hidden, router_bias=router_bias)
    router_flops = 2 * (h * experts if router == "linear" else h * router_hidden + router_hidden * experts)
    ffn_layer = n_in * (h * i + (i if bias else 0)) + i * h + (h if bias else 0)
    active_layer = active * m * (n_in * (h + (1 if bias else 0)) + h) + (h if bias else 0)
    f = _flops(s, batch_size=1, seq_len=seq_len)
    ffn_flops_dense = layers * 2 * i * h * (n_in + 1)
    ffn_flops = layers * (2 * active * m * h * (n_in + 1) + router_flops)
    flops_dense = f["forward"] // seq_len
    # the training ledger's FFN tensors of intermediate width, dense and with k m of the i neurons
    nb = dtype_sizes(precision, device)
    saved = [x for x in layer_saved(s, precision=precision, device=device, batch_size=1)
             if x.part == "mlp" and x.width % i == 0 and x.width >= i]
    led = dict(tokens=1, scores=0, nbytes=nb, batch=1)
    dense_saved = ledger_bytes(saved, **led)
    moe_saved = ledger_bytes([dataclasses.replace(x, width=x.width // i * active * m) for x in saved], **led) + 8 * active
    params = s.params + layers * per_router
    wb = _MOE_DTYPES[dtype]
    return MoEfication(
        model=s.name, experts=experts, active=active, neurons_per_expert=m, ffn_layers=layers, router=router,
        router_params=layers * per_router, params_dense=s.params, params=params, ffn_params=layers * ffn_layer,
        active_ffn_params=layers * active_layer, active_params=params - layers * ffn_layer + layers * active_layer,
        ffn_flops_dense=ffn_flops_dense, ffn_flops=ffn_flops, flops_dense=flops_dense,
        flops=flops_dense - ffn_flops_dense + ffn_flops,
        ffn_intermediate_values=layers * active * m * n_tensors, ffn_intermediate_values_dense=layers * i * n_tensors,
        ffn_saved_bytes_dense=layers * dense_saved, ffn_saved_bytes=layers * moe_saved,
        weight_bytes_dense=s.params * wb, weight_bytes=params * wb, dtype=dtype)


def moefied_training(model: ModelSpec | str, *, experts: int, active: int, batch_size: int, seq_len: int,
                     precision: str = "bf16-mixed", router: str = "linear", router_hidden: int = 0,
                     router_bias: bool = False, device: str = "cuda", **kw) -> MemoryBreakdown:
    """One training step of the MoEfied model (all experts trained, as in MoEfication's fine-tuning):
    `estimate_training`'s peak phase with the routers' weights, gradients and optimizer states added,
    and the FFNs' saved intermediates cut to k of E experts (plus the routing indices). Parameters,
    gradients and optimizer states do not shrink: every expert is resident and trained.
    Known limitations: the router's own saved tensors (E scores a token) and the backward's transient
    FFN gradients are left as the dense model's."""
    s = _resolve(model)
    if kw.get("recompute", "none") != "none":
        raise ValueError("MoEfication with activation recompute is not modelled (which FFN tensors a checkpointed "
                         "block keeps depends on the experts it recomputes): use recompute='none'")
    mo = moefication(s, experts=experts, active=active, router=router, router_hidden=router_hidden,
                     router_bias=router_bias, precision=precision, seq_len=seq_len, device=device)
    opt = kw.get("optimizer", "adamw")
    phases = training_phases(s, batch_size=batch_size, seq_len=seq_len, precision=precision, device=device, **kw)
    pb = param_bytes(precision)
    cut = (mo.ffn_saved_bytes_dense - mo.ffn_saved_bytes) * batch_size * seq_len
    out = []
    for ph in phases:
        upd = dict(parameters=ph.parameters + mo.router_params * pb, label=f"{s.name} MoEfied E={experts} k={active}")
        if ph.gradients:
            upd["gradients"] = ph.gradients + mo.router_params * pb
        if ph.optimizer_states:
            upd["optimizer_states"] = ph.optimizer_states + optimizer_state_bytes(opt, mo.router_params, precision)
        if ph.activations:
            upd["activations"] = max(0, ph.activations - cut)
        out.append(dataclasses.replace(ph, **upd))
    return max(out, key=lambda m: m.total)
