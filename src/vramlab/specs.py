"""What a model and a GPU are, as far as memory is concerned. Pure Python: no torch import.

A `ModelSpec` names every weight tensor a transformers model of a supported family holds, so that
`spec.params` equals `sum(p.numel() for p in model.parameters())` of the real model exactly (each
family's tensors and counts are in `vramlab.weights`; this module holds the specs, the config parsing,
the presets and the GPUs).
Families: GPT-2, GPT-NeoX, OPT, Llama / Mistral / Qwen2 (grouped-query attention, gated MLP),
BERT (masked-LM head) and T5 / mT5 (encoder-decoder); mixture-of-experts decoders (Mixtral, Qwen2-
and Qwen3-MoE, OLMoE, DeepSeek-V2/V3 with multi-head latent attention) as the family "moe", whose
`active_params` counts what one token's forward uses. `resolve` refuses an MoE spec (the
parallel, ZeRO and fitting calculators do not model one yet), and `preset_names` lists the dense
presets only (`moe_preset_names` the others); `vramlab.moe` prices an MoE model's parameters, KV
cache and saved tensors, and `memory.estimate_training` its one-device training step.

Build one with `from_config` (a transformers config object, a config dict, or a `config.json` path)
or `preset("gpt2")`. What-if questions: `dataclasses.replace(spec, num_layers=48)`.
`gpu("a100-80gb")` looks up the GPU catalogue.
"""

from __future__ import annotations

import json
import math
import numbers as _numbers
import os
import re
import stat
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from typing import Any, Literal, Mapping

from . import checks as _checks
from . import weights
from .units import GB, GiB, MiB

Family = Literal["gpt2", "gpt_neox", "opt", "llama", "bert", "t5", "moe"]
QKNorm = Literal["", "head", "proj"]
Norm = Literal["layernorm", "rmsnorm"]

# transformers model_type -> the family whose layer layout it shares
MODEL_TYPES: dict[str, Family] = {
    "gpt2": "gpt2",
    "gpt_neox": "gpt_neox",
    "opt": "opt",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "bert": "bert",
    "t5": "t5",
    "mt5": "t5",
    # mixture of experts: one family, its variants told apart by the fields below (and model_type)
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "olmoe": "moe",
    "deepseek_v2": "moe",
    "deepseek_v3": "moe",
}
MOE_MODEL_TYPES = tuple(t for t, f in MODEL_TYPES.items() if f == "moe")
# every layer of these is a mixture of experts whose expert width is the config's intermediate_size
_ALL_MOE_TYPES = ("mixtral", "olmoe")
_MLA_TYPES = ("deepseek_v2", "deepseek_v3")
MOE_NOT_MODELLED = ("a mixture of experts is not modelled yet by this calculator (it prices dense models; a mixture of "
                    "experts: memory.estimate_training on one device, expert_parallel.expert_parallel over ranks)")


class SpecError(ValueError):
    """A model or GPU description that vramlab cannot use; the message says what is wrong."""


def _real(value) -> "float | None":
    """A finite real number (numpy's too) as a float; None for anything else (a bool, NaN, a string)."""
    if _checks.is_bool(value) or not isinstance(value, _numbers.Real):
        return None
    try:
        v = float(value)
    except (OverflowError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _spec_check(check, *args, **kwargs):
    """A `checks` function whose ValueError is a SpecError (what this module raises)."""
    try:
        return check(*args, **kwargs)
    except SpecError:
        raise
    except ValueError as e:
        raise SpecError(str(e)) from None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Every shape that decides a transformer's memory. Sizes are counts (not bytes).

    num_layers is the decoder depth of a decoder-only model, the encoder depth of BERT and T5;
    num_decoder_layers is T5's decoder depth (0 elsewhere). head_dim * num_heads may differ from
    hidden_size (T5's d_kv, Llama's explicit head_dim).
    """

    name: str
    model_type: str
    vocab_size: int  # V
    hidden_size: int  # h
    num_layers: int  # L
    num_heads: int  # a
    num_kv_heads: int  # grouped-query attention: a_kv <= a
    head_dim: int
    intermediate_size: int  # MLP width (each of gate/up for a gated MLP)
    max_position_embeddings: int  # learned position table size, or context length for RoPE
    activation: str
    gated_mlp: bool = False
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm: Norm = "layernorm"
    norm_bias: bool = True  # LayerNorm with a bias (RMSNorm has none)
    norm_affine: bool = True  # OPT's layer_norm_elementwise_affine=False drops norm weights
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # family-specific extras (0 / defaults where the family has none)
    num_decoder_layers: int = 0  # T5
    relative_attention_num_buckets: int = 0  # T5
    type_vocab_size: int = 0  # BERT
    word_embed_proj_dim: int = 0  # OPT (0 = hidden_size)
    final_norm: bool = True  # OPT can drop its final LayerNorm
    parallel_residual: bool = False  # GPT-NeoX
    rotary_fraction: float = 0.0  # GPT-NeoX partial rotary; 1.0 for Llama-style
    # mixture of experts (family "moe"; the defaults describe a dense model and must stay so there)
    num_experts: int = 0  # routed experts in each MoE layer
    num_experts_per_tok: int = 0  # top-k: routed experts each token goes through
    moe_intermediate_size: int = 0  # each routed expert's gated-MLP width
    num_shared_experts: int = 0  # experts every token goes through (one MLP, num x width wide)
    shared_expert_intermediate_size: int = 0  # each shared expert's width (0: moe_intermediate_size)
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(h, 1)) scales the shared expert
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace: leading layers with a dense MLP
    moe_layer_step: int = 1  # Qwen's decoder_sparse_step: layer i is MoE when (i + 1) % step == 0
    dense_layer_ids: tuple[int, ...] = ()  # Qwen's mlp_only_layers: layers kept dense
    num_expert_groups: int = 1  # DeepSeek's n_group (device-limited routing)
    topk_expert_groups: int = 1  # DeepSeek's topk_group: groups a token may route to
    qk_norm: QKNorm = ""  # RMSNorm on q and k: per head (Qwen3-MoE) or over the projection (OLMoE)
    # multi-head latent attention (DeepSeek-V2/V3; 0 = ordinary attention). head_dim is then the
    # query/key head width, qk_nope_head_dim + qk_rope_head_dim
    q_lora_rank: int = 0  # queries through a rank-q_lora_rank bottleneck (0: one q_proj)
    kv_lora_rank: int = 0  # the compressed latent keys and values are made from
    qk_rope_head_dim: int = 0  # the rotary part of each query/key head (one key part shared by all heads)
    v_head_dim: int = 0  # each value head's width

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or self.model_type not in MODEL_TYPES:
            raise SpecError(f"unsupported model_type {_checks.show(self.model_type)}; supported: {', '.join(MODEL_TYPES)}")
        bounds = {"vocab_size": (1, MAX_WIDTH), "hidden_size": (1, MAX_WIDTH), "num_layers": (1, MAX_LAYERS),
                  "num_heads": (1, MAX_WIDTH), "num_kv_heads": (1, MAX_WIDTH), "head_dim": (1, MAX_WIDTH),
                  "intermediate_size": (1, MAX_WIDTH), "max_position_embeddings": (1, MAX_POSITIONS),
                  "num_decoder_layers": (0, MAX_LAYERS), "relative_attention_num_buckets": (0, MAX_WIDTH),
                  "type_vocab_size": (0, MAX_WIDTH), "word_embed_proj_dim": (0, MAX_WIDTH)}
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: numpy's numbers stored as Python's)
        for field, (lo, hi) in bounds.items():
            value = _checks.index(getattr(self, field))
            if value is None or not lo <= value <= hi:
                what = "a positive integer" if lo == 1 else "a non-negative integer"
                raise SpecError(f"{field} must be {what} up to {hi:,}, got {_checks.show(getattr(self, field))}")
            put(field, value)
        for field in ("gated_mlp", "tie_word_embeddings", "qkv_bias", "out_bias", "mlp_bias", "norm_bias",
                      "norm_affine", "final_norm", "parallel_residual"):
            put(field, _spec_check(_checks.flag, field, getattr(self, field)))
        for field, upper_ok in (("hidden_dropout", False), ("attention_dropout", False), ("rotary_fraction", True)):
            v = _real(getattr(self, field))
            if v is None or not (0 <= v <= 1) or (v == 1 and not upper_ok):
                raise SpecError(f"{field} must be a number in [0, 1{']' if upper_ok else ')'}, "
                                f"got {_checks.show(getattr(self, field))}")
            put(field, v)
        for field in ("name", "activation"):
            if not isinstance(getattr(self, field), str):
                raise SpecError(f"{field} must be text, got {_checks.show(getattr(self, field))}")
        if not isinstance(self.norm, str) or self.norm not in ("layernorm", "rmsnorm"):
            raise SpecError(f"unknown norm {_checks.show(self.norm)}; choose from layernorm, rmsnorm")
        if self.family in ("gpt2", "gpt_neox", "opt", "bert"):
            if self.num_heads * self.head_dim != self.hidden_size or self.num_kv_heads != self.num_heads:
                raise SpecError(f"{self.model_type}: num_heads x head_dim must equal hidden_size and every head has "
                                f"its own k, v (got {self.num_heads} x {self.head_dim} vs {self.hidden_size}, "
                                f"num_kv_heads {self.num_kv_heads}); replace them together")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.family == "t5" and self.num_decoder_layers <= 0:
            raise SpecError("a T5 model needs num_decoder_layers > 0")
        _check_moe(self, put)

    @property
    def family(self) -> Family:
        return MODEL_TYPES[self.model_type]

    @property
    def is_moe(self) -> bool:
        """A mixture of experts: some layers route each token to num_experts_per_tok of num_experts MLPs."""
        return self.family == "moe"

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): keys and values are made from a small latent."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:  # MLA: the part of each query/key head without rotary embedding
        return self.head_dim - self.qk_rope_head_dim

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (the others have a dense MLP of
        intermediate_size): after DeepSeek's first dense layers, every moe_layer_step-th layer
        that Qwen's mlp_only_layers does not keep dense. Empty for a dense model."""
        if not self.is_moe:
            return ()
        dense = set(self.dense_layer_ids)
        return tuple(i for i in range(self.first_dense_layers, self.num_layers)
                     if (i + 1) % self.moe_layer_step == 0 and i not in dense)

    @property
    def expert_params(self) -> int:
        """One routed expert's parameters: a gated MLP of moe_intermediate_size, without bias (0 if dense)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: everything but the routed experts, plus the
        num_experts_per_tok experts the router picks in each MoE layer (shared experts, routers,
        attention, dense layers, embeddings and head count whole, as the models' authors count
        "activated parameters"). Equals `params` for a dense model."""
        idle = (self.num_experts - self.num_experts_per_tok) * self.expert_params
        return self.params - len(self.moe_layer_ids) * idle

    @property
    def is_encoder_decoder(self) -> bool:
        return self.family == "t5"

    @property
    def is_causal_lm(self) -> bool:
        return self.family not in ("bert", "t5")

    @property
    def q_dim(self) -> int:  # width of the query projection, a * d
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # width of each of the key and value projections, a_kv * d
        return self.num_kv_heads * self.head_dim

    @property
    def params(self) -> int:
        """Exact parameter count, as `sum(p.numel() for p in model.parameters())` reports it
        (tied tensors counted once)."""
        return sum(self.param_groups().values())

    def param_groups(self) -> dict[str, int]:
        """Parameter counts by role: embeddings, layers (all blocks), head (norms and LM head)."""
        return weights.param_groups(self)

    def param_tensors(self) -> list[tuple[str, int]]:
        """Every parameter tensor as (name, numel), in `model.named_parameters()` order (tied
        tensors once). The order matters to a for-loop optimizer's temporaries."""
        return [(n, math.prod(shape)) for n, shape in self.param_shapes()]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter tensor as (name, shape), in `param_tensors` order. A linear layer's weight is
        (out, in) as `nn.Linear` holds it; GPT-2's Conv1D holds the transpose (in, out), and is listed
        (out, in) here too: the optimizers that look at shapes (Adafactor's factored moments, GaLore's
        projections) depend on the two dimensions, not on their order."""
        return weights.param_shapes(self)

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers config dict that builds this model (inverse of `from_config`)."""
        return _TO_HF[self.family](self)


# Bounds on what a config may say (well beyond any real model; they keep the calculators finite and fast)
MAX_WIDTH = 1 << 24  # hidden sizes, vocabularies, MLP widths, heads
MAX_LAYERS = 10_000
MAX_POSITIONS = 1 << 26


# ----------------------------------------------------------------------------- mixture of experts

_MOE_COUNTS = {  # field: (lo, hi) for a mixture of experts; a dense model keeps every one at its default
    "num_experts": (1, MAX_WIDTH), "num_experts_per_tok": (1, MAX_WIDTH),
    "moe_intermediate_size": (1, MAX_WIDTH), "num_shared_experts": (0, MAX_WIDTH),
    "shared_expert_intermediate_size": (0, MAX_WIDTH), "first_dense_layers": (0, MAX_LAYERS),
    "moe_layer_step": (1, MAX_LAYERS), "num_expert_groups": (1, MAX_WIDTH), "topk_expert_groups": (1, MAX_WIDTH),
    "q_lora_rank": (0, MAX_WIDTH), "kv_lora_rank": (0, MAX_WIDTH), "qk_rope_head_dim": (0, MAX_WIDTH),
    "v_head_dim": (0, MAX_WIDTH)}
_MOE_FIELDS = (*_MOE_COUNTS, "shared_expert_gate", "dense_layer_ids", "qk_norm")
_MOE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ModelSpec) if f.name in _MOE_FIELDS}
_NO_MLA = {"q_lora_rank": 0, "kv_lora_rank": 0, "qk_rope_head_dim": 0, "v_head_dim": 0}
_UNGROUPED = {"num_expert_groups": 1, "topk_expert_groups": 1}
_EVERY_LAYER = {"first_dense_layers": 0, "moe_layer_step": 1, "dense_layer_ids": ()}
_NO_SHARED = {"num_shared_experts": 0, "shared_expert_intermediate_size": 0, "shared_expert_gate": False}
# What each model type's transformers code builds whatever its config says: a spec that says otherwise
# describes a model no config of that type can build (and `to_hf_config` could not write).
_MOE_FIXED: dict[str, dict[str, Any]] = {
    "mixtral": {**_NO_MLA, **_UNGROUPED, **_EVERY_LAYER, **_NO_SHARED, "qk_norm": "", "qkv_bias": False,
                "out_bias": False, "mlp_bias": False},
    "olmoe": {**_NO_MLA, **_UNGROUPED, **_EVERY_LAYER, **_NO_SHARED, "qk_norm": "proj", "mlp_bias": False},
    "qwen2_moe": {**_NO_MLA, **_UNGROUPED, "first_dense_layers": 0, "num_shared_experts": 1,
                  "shared_expert_gate": True, "qk_norm": "", "out_bias": False, "mlp_bias": False},
    "qwen3_moe": {**_NO_MLA, **_UNGROUPED, **_NO_SHARED, "first_dense_layers": 0, "qk_norm": "head",
                  "mlp_bias": False},
    "deepseek_v2": {"moe_layer_step": 1, "dense_layer_ids": (), "shared_expert_intermediate_size": 0,
                    "shared_expert_gate": False, "qk_norm": ""},
    "deepseek_v3": {"moe_layer_step": 1, "dense_layer_ids": (), "shared_expert_intermediate_size": 0,
                    "shared_expert_gate": False, "qk_norm": "", "mlp_bias": False},
}


def _check_moe(s: "ModelSpec", put) -> None:
    """The mixture-of-experts and latent-attention fields: whole numbers in range, and only what
    the model type's transformers code can build (a dense model keeps every one at its default)."""
    for field, (lo, hi) in _MOE_COUNTS.items():
        v, lo = _checks.index(getattr(s, field)), min(lo, _MOE_DEFAULTS[field])  # a dense model's 0s are fine
        if v is None or not lo <= v <= hi:
            raise SpecError(f"{field} must be a whole number from {lo} to {hi:,}, "
                            f"got {_checks.show(getattr(s, field))}")
        put(field, v)
    put("shared_expert_gate", _spec_check(_checks.flag, "shared_expert_gate", s.shared_expert_gate))
    ids = s.dense_layer_ids
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise SpecError(f"dense_layer_ids must be a list of layer indices, got {_checks.show(ids)}")
    put("dense_layer_ids", tuple(sorted(set(_spec_check(_checks.wholes, "dense_layer_ids", ids, lo=0,
                                                           hi=MAX_LAYERS, empty=True)))))
    if not isinstance(s.qk_norm, str) or s.qk_norm not in ("", "head", "proj"):
        raise SpecError(f"unknown qk_norm {_checks.show(s.qk_norm)}; choose from '' (none), head, proj")
    if not s.is_moe:
        for field, default in _MOE_DEFAULTS.items():
            if getattr(s, field) != default:
                raise SpecError(f"{field} describes a mixture of experts, which a {s.model_type} model is not "
                                f"(model types with experts: {', '.join(MOE_MODEL_TYPES)})")
        return
    for field, (lo, _) in _MOE_COUNTS.items():
        if field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") and getattr(s, field) < lo:
            raise SpecError(f"a {s.model_type} model needs {field} >= {lo}, got {getattr(s, field)}")
    if s.num_experts_per_tok > s.num_experts:
        raise SpecError(f"num_experts_per_tok ({s.num_experts_per_tok}) cannot exceed num_experts ({s.num_experts})")
    fixed = {**_MOE_FIXED[s.model_type], "gated_mlp": True, "norm": "rmsnorm", "norm_bias": False,
             "norm_affine": True, "final_norm": True, "parallel_residual": False}
    if s.model_type in ("olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):  # one attention_bias switch
        fixed.setdefault("out_bias", s.qkv_bias)
    for field, want in fixed.items():
        if getattr(s, field) != want:
            raise SpecError(f"a {s.model_type} model always has {field}={want!r}, got {getattr(s, field)!r}")
    if s.model_type in _ALL_MOE_TYPES and s.moe_intermediate_size != s.intermediate_size:
        raise SpecError(f"every {s.model_type} layer is a mixture of experts of the config's intermediate_size: "
                        f"moe_intermediate_size ({s.moe_intermediate_size}) must equal intermediate_size "
                        f"({s.intermediate_size}); replace them together")
    if s.model_type == "olmoe" and s.num_heads * s.head_dim != s.hidden_size:
        raise SpecError(f"olmoe: num_heads x head_dim must equal hidden_size (its q_norm is hidden_size wide), "
                        f"got {s.num_heads} x {s.head_dim} vs {s.hidden_size}")
    if s.model_type == "qwen2_moe" and s.shared_expert_intermediate_size < 1:
        raise SpecError("a qwen2_moe model needs shared_expert_intermediate_size >= 1")
    if s.model_type in _MLA_TYPES:
        if s.num_shared_experts < 1:
            raise SpecError(f"a {s.model_type} model needs num_shared_experts >= 1")
        if s.kv_lora_rank < 1 or s.qk_rope_head_dim < 1 or s.v_head_dim < 1:
            raise SpecError(f"{s.model_type} uses multi-head latent attention: kv_lora_rank, qk_rope_head_dim and "
                            f"v_head_dim must be positive, got {s.kv_lora_rank}, {s.qk_rope_head_dim}, {s.v_head_dim}")
        if s.head_dim <= s.qk_rope_head_dim:
            raise SpecError(f"head_dim ({s.head_dim}) is qk_nope_head_dim + qk_rope_head_dim and must exceed "
                            f"qk_rope_head_dim ({s.qk_rope_head_dim})")
        if s.num_experts % s.num_expert_groups or s.topk_expert_groups > s.num_expert_groups:
            raise SpecError(f"num_expert_groups ({s.num_expert_groups}) must divide num_experts ({s.num_experts}) "
                            f"and be at least topk_expert_groups ({s.topk_expert_groups})")


# ----------------------------------------------------------------------------- config parsing

_LAYER_KEYS = {"n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers"}
_POSITION_KEYS = {"n_positions", "max_position_embeddings"}
_ZERO_OK = {"type_vocab_size", "first_k_dense_replace"}  # counts that may be 0
_FRACTION_KEYS = {"partial_rotary_factor", "rotary_pct"}  # (0, 1]; other float fields are dropout probabilities [0, 1)


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """cfg[key] (or `default` when absent or null), checked against the type and range of the
    default: whole numbers for sizes (bounded), true/false for switches, probabilities for dropout,
    text for names. A bad value raises SpecError naming the field and the value."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise SpecError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        hi = MAX_LAYERS if key in _LAYER_KEYS else MAX_POSITIONS if key in _POSITION_KEYS else MAX_WIDTH
        lo = 0 if key in _ZERO_OK else 1
        v = _checks.index(value)  # numpy's integers too (a config dict built in Python)
        if v is None or not lo <= v <= hi:
            raise SpecError(f"{key}: expected a whole number from {lo} to {hi:,}, got {_checks.show(value)}")
        return v
    if isinstance(default, float):
        v = _real(value)
        if key in _FRACTION_KEYS:
            if not (v is not None and 0 < v <= 1):
                raise SpecError(f"{key}: expected a fraction in (0, 1], got {_checks.show(value)}")
        elif not (v is not None and 0 <= v < 1):
            raise SpecError(f"{key}: expected a probability in [0, 1), got {_checks.show(value)}")
        return v
    if isinstance(default, str):
        if not isinstance(value, str) or not value or len(value) > 100:
            raise SpecError(f"{key}: expected a name, got {value!r}")
        return value
    return value


def _opt_int(cfg: Mapping[str, Any], key: str) -> int | None:
    """An optional size: absent/null gives None, anything else must be a valid size."""
    return None if cfg.get(key) is None else _get(cfg, key, 1)


def _from_gpt2(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    h, a = _get(cfg, "n_embd", 768), _get(cfg, "n_head", 12)
    _divides(h, a, "n_embd", "n_head")
    return ModelSpec(
        name=name, model_type="gpt2", vocab_size=_get(cfg, "vocab_size", 50257), hidden_size=h,
        num_layers=_get(cfg, "n_layer", 12), num_heads=a, num_kv_heads=a, head_dim=h // a,
        intermediate_size=_get(cfg, "n_inner", 4 * h), max_position_embeddings=_get(cfg, "n_positions", 1024),
        activation=_get(cfg, "activation_function", "gelu_new"),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", True),
        qkv_bias=True, out_bias=True, mlp_bias=True,
        hidden_dropout=_get(cfg, "resid_pdrop", 0.1), attention_dropout=_get(cfg, "attn_pdrop", 0.1))


def _from_gpt_neox(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    h, a = _get(cfg, "hidden_size", 6144), _get(cfg, "num_attention_heads", 64)
    _divides(h, a, "hidden_size", "num_attention_heads")
    bias = _get(cfg, "attention_bias", True)
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise SpecError(f"rope_parameters: expected an object, got {rope!r}")
    return ModelSpec(
        name=name, model_type="gpt_neox", vocab_size=_get(cfg, "vocab_size", 50432), hidden_size=h,
        num_layers=_get(cfg, "num_hidden_layers", 44), num_heads=a, num_kv_heads=a, head_dim=h // a,
        intermediate_size=_get(cfg, "intermediate_size", 24576),
        max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
        activation=_get(cfg, "hidden_act", "gelu"), tie_word_embeddings=_get(cfg, "tie_word_embeddings", False),
        qkv_bias=bias, out_bias=bias, mlp_bias=True,
        hidden_dropout=_get(cfg, "hidden_dropout", 0.0), attention_dropout=_get(cfg, "attention_dropout", 0.0),
        parallel_residual=_get(cfg, "use_parallel_residual", True),
        rotary_fraction=_get(rope, "partial_rotary_factor", _get(cfg, "rotary_pct", 0.25)))


def _from_opt(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    h, a = _get(cfg, "hidden_size", 768), _get(cfg, "num_attention_heads", 12)
    _divides(h, a, "hidden_size", "num_attention_heads")
    bias = _get(cfg, "enable_bias", True)
    return ModelSpec(
        name=name, model_type="opt", vocab_size=_get(cfg, "vocab_size", 50272), hidden_size=h,
        num_layers=_get(cfg, "num_hidden_layers", 12), num_heads=a, num_kv_heads=a, head_dim=h // a,
        intermediate_size=_get(cfg, "ffn_dim", 3072), max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
        activation=_get(cfg, "activation_function", "relu"), tie_word_embeddings=_get(cfg, "tie_word_embeddings", True),
        qkv_bias=bias, out_bias=bias, mlp_bias=bias, norm_affine=_get(cfg, "layer_norm_elementwise_affine", True),
        hidden_dropout=_get(cfg, "dropout", 0.1), attention_dropout=_get(cfg, "attention_dropout", 0.0),
        word_embed_proj_dim=_get(cfg, "word_embed_proj_dim", h),
        final_norm=_get(cfg, "do_layer_norm_before", True) and not _get(cfg, "_remove_final_layer_norm", False))


def _from_llama(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    mt = cfg["model_type"]
    h, a = _get(cfg, "hidden_size", 4096), _get(cfg, "num_attention_heads", 32)
    kv = _get(cfg, "num_key_value_heads", 8 if mt == "mistral" else a)
    head_dim = _opt_int(cfg, "head_dim")
    if head_dim is None:
        _divides(h, a, "hidden_size", "num_attention_heads")
        head_dim = h // a
    if mt == "qwen2":  # Qwen2: q, k, v always carry a bias, o never does
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif mt == "mistral":
        qkv_bias = out_bias = mlp_bias = False
    else:
        qkv_bias = out_bias = _get(cfg, "attention_bias", False)
        mlp_bias = _get(cfg, "mlp_bias", False)
    defaults = {"llama": (32000, 11008, 2048), "mistral": (32000, 14336, 131072), "qwen2": (151936, 22016, 32768)}[mt]
    return ModelSpec(
        name=name, model_type=mt, vocab_size=_get(cfg, "vocab_size", defaults[0]), hidden_size=h,
        num_layers=_get(cfg, "num_hidden_layers", 32), num_heads=a, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=_get(cfg, "intermediate_size", defaults[1]),
        max_position_embeddings=_get(cfg, "max_position_embeddings", defaults[2]),
        activation=_get(cfg, "hidden_act", "silu"), gated_mlp=True,
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", False),
        qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias, norm="rmsnorm", norm_bias=False,
        attention_dropout=_get(cfg, "attention_dropout", 0.0), rotary_fraction=1.0)


def _from_bert(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    h, a = _get(cfg, "hidden_size", 768), _get(cfg, "num_attention_heads", 12)
    _divides(h, a, "hidden_size", "num_attention_heads")
    return ModelSpec(
        name=name, model_type="bert", vocab_size=_get(cfg, "vocab_size", 30522), hidden_size=h,
        num_layers=_get(cfg, "num_hidden_layers", 12), num_heads=a, num_kv_heads=a, head_dim=h // a,
        intermediate_size=_get(cfg, "intermediate_size", 3072),
        max_position_embeddings=_get(cfg, "max_position_embeddings", 512), activation=_get(cfg, "hidden_act", "gelu"),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", True), qkv_bias=True, out_bias=True, mlp_bias=True,
        hidden_dropout=_get(cfg, "hidden_dropout_prob", 0.1),
        attention_dropout=_get(cfg, "attention_probs_dropout_prob", 0.1),
        type_vocab_size=_get(cfg, "type_vocab_size", 2))


def _from_t5(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    mt = cfg["model_type"]
    proj = _get(cfg, "feed_forward_proj", "gated-gelu" if mt == "mt5" else "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise SpecError(f"feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
    gated = parts[0] == "gated"
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    n_layers = _get(cfg, "num_layers", 8 if mt == "mt5" else 6)
    return ModelSpec(
        name=name, model_type=mt, vocab_size=_get(cfg, "vocab_size", 250112 if mt == "mt5" else 32128),
        hidden_size=_get(cfg, "d_model", 512), num_layers=n_layers,
        num_decoder_layers=_get(cfg, "num_decoder_layers", n_layers),
        num_heads=_get(cfg, "num_heads", 6 if mt == "mt5" else 8), num_kv_heads=_get(cfg, "num_heads", 6 if mt == "mt5" else 8),
        head_dim=_get(cfg, "d_kv", 64), intermediate_size=_get(cfg, "d_ff", 1024 if mt == "mt5" else 2048),
        max_position_embeddings=_get(cfg, "n_positions", 512), activation=act, gated_mlp=gated,
        # transformers 5.x ties T5/mT5's LM head to the embedding whatever `tie_word_embeddings` says
        # (it only switches output scaling). The published mT5 and T5 v1.1 checkpoints have an untied
        # head: vramlab's own key `untied_lm_head` (used by the mt5 presets) describes those.
        tie_word_embeddings=not _get(cfg, "untied_lm_head", False),
        norm="rmsnorm", norm_bias=False, hidden_dropout=_get(cfg, "dropout_rate", 0.1), attention_dropout=_get(cfg, "dropout_rate", 0.1),
        relative_attention_num_buckets=_get(cfg, "relative_attention_num_buckets", 32))


# transformers' defaults for what a mixture-of-experts config may leave out:
# (vocab, hidden, MLP width, layers, heads, kv heads (None: heads), positions, experts, top-k)
_MOE_CONFIG_DEFAULTS = {
    "mixtral": (32000, 4096, 14336, 32, 32, 8, 131072, 8, 2),
    "qwen2_moe": (151936, 2048, 5632, 24, 16, 16, 32768, 60, 4),
    "qwen3_moe": (151936, 2048, 6144, 24, 32, 4, 32768, 128, 8),
    "olmoe": (50304, 2048, 2048, 16, 16, None, 4096, 64, 8),
    "deepseek_v2": (102400, 4096, 11008, 32, 32, None, 2048, 64, None),
    "deepseek_v3": (129280, 7168, 18432, 61, 128, 128, 4096, 256, 8),
}
# the key naming the routed experts, as each model's published config.json spells it, then its aliases
_EXPERT_KEYS = {"mixtral": ("num_local_experts", "num_experts"), "qwen2_moe": ("num_experts",),
                "qwen3_moe": ("num_experts", "num_local_experts"), "olmoe": ("num_experts", "num_local_experts"),
                "deepseek_v2": ("n_routed_experts", "num_experts"),
                "deepseek_v3": ("n_routed_experts", "num_local_experts")}


def _from_moe(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 and DeepSeek-V3, read as transformers 5.x
    builds them (its defaults fill what the config leaves out)."""
    mt = cfg["model_type"]
    V, H, I, L, A, KV, P, E, K = _MOE_CONFIG_DEFAULTS[mt]
    h, a = _get(cfg, "hidden_size", H), _get(cfg, "num_attention_heads", A)
    experts = next((_get(cfg, k, E) for k in _EXPERT_KEYS[mt] if cfg.get(k) is not None), E)
    if K is None and cfg.get("num_experts_per_tok") is None:  # DeepSeek-V2's default is None: no routing
        raise SpecError(f"num_experts_per_tok: a {mt} config must say how many experts each token uses")
    top_k = _get(cfg, "num_experts_per_tok", K)
    width = _get(cfg, "intermediate_size", I)
    kw: dict[str, Any] = dict(
        name=name, model_type=mt, vocab_size=_get(cfg, "vocab_size", V), hidden_size=h,
        num_layers=_get(cfg, "num_hidden_layers", L), num_heads=a,
        num_kv_heads=_get(cfg, "num_key_value_heads", KV or a), intermediate_size=width,
        max_position_embeddings=_get(cfg, "max_position_embeddings", P), activation=_get(cfg, "hidden_act", "silu"),
        gated_mlp=True, tie_word_embeddings=_get(cfg, "tie_word_embeddings", False),
        norm="rmsnorm", norm_bias=False, attention_dropout=_get(cfg, "attention_dropout", 0.0), rotary_fraction=1.0,
        num_experts=experts, num_experts_per_tok=top_k)
    bias = _get(cfg, "attention_bias", False)
    if mt in _MLA_TYPES:
        v2 = mt == "deepseek_v2"
        nope, rope = _get(cfg, "qk_nope_head_dim", 128), _get(cfg, "qk_rope_head_dim", 64)
        grouped = not v2 or _get(cfg, "topk_method", "greedy") == "group_limited_greedy"
        # kv_b_proj makes keys and values for every head: num_key_value_heads shapes no tensor (the
        # published configs set it to num_attention_heads)
        kw.update(head_dim=nope + rope, qk_rope_head_dim=rope, v_head_dim=_get(cfg, "v_head_dim", 128), num_kv_heads=a,
                  kv_lora_rank=_get(cfg, "kv_lora_rank", 512),
                  # null means no query compression; absent means transformers' default rank
                  q_lora_rank=0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None
                  else _get(cfg, "q_lora_rank", 1536),
                  moe_intermediate_size=_get(cfg, "moe_intermediate_size", 1407 if v2 else 2048),
                  num_shared_experts=_get(cfg, "n_shared_experts", 2 if v2 else 1),
                  first_dense_layers=_get(cfg, "first_k_dense_replace", 0 if v2 else 3),
                  num_expert_groups=_get(cfg, "n_group", 1 if v2 else 8) if grouped else 1,
                  topk_expert_groups=_get(cfg, "topk_group", 1 if v2 else 4) if grouped else 1,
                  qkv_bias=bias, out_bias=bias, mlp_bias=_get(cfg, "mlp_bias", False) if v2 else False)
        return ModelSpec(**kw)
    head_dim = _opt_int(cfg, "head_dim")
    if head_dim is None:
        _divides(h, a, "hidden_size", "num_attention_heads")
        head_dim = h // a
    kw["head_dim"] = head_dim
    if mt in _ALL_MOE_TYPES:
        kw.update(moe_intermediate_size=width, qk_norm="proj" if mt == "olmoe" else "",
                  qkv_bias=bias and mt == "olmoe", out_bias=bias and mt == "olmoe")
        return ModelSpec(**kw)
    only = cfg.get("mlp_only_layers") or []
    if isinstance(only, (str, bytes, Mapping)) or not isinstance(only, (list, tuple)):
        raise SpecError(f"mlp_only_layers: expected a list of layer indices, got {_checks.show(only)}")
    kw.update(moe_intermediate_size=_get(cfg, "moe_intermediate_size", 1408 if mt == "qwen2_moe" else 768),
              moe_layer_step=_get(cfg, "decoder_sparse_step", 1), dense_layer_ids=tuple(only))
    if mt == "qwen2_moe":  # q, k, v carry a bias (qkv_bias), o never does; one gated shared expert
        kw.update(qkv_bias=_get(cfg, "qkv_bias", True), num_shared_experts=1, shared_expert_gate=True,
                  shared_expert_intermediate_size=_get(cfg, "shared_expert_intermediate_size", 5632))
    else:
        kw.update(qkv_bias=bias, out_bias=bias, qk_norm="head")
    return ModelSpec(**kw)


_PARSERS = {"gpt2": _from_gpt2, "gpt_neox": _from_gpt_neox, "opt": _from_opt, "llama": _from_llama,
            "bert": _from_bert, "t5": _from_t5, "moe": _from_moe}


def _divides(h: int, a: int, h_name: str, a_name: str) -> None:
    if not isinstance(h, int) or not isinstance(a, int) or h <= 0 or a <= 0:
        raise SpecError(f"{h_name} and {a_name} must be positive integers, got {h!r} and {a!r}")
    if h % a:
        raise SpecError(f"{a_name} ({a}) must divide {h_name} ({h}): each head gets {h_name}/{a_name} dimensions")


# ----------------------------------------------------------------------------- back to transformers

def _hf_common(s: ModelSpec) -> dict[str, Any]:
    return {"model_type": s.model_type, "vocab_size": s.vocab_size, "tie_word_embeddings": s.tie_word_embeddings}


def _hf_standard(s: ModelSpec) -> dict[str, Any]:
    """The keys that NeoX, OPT, Llama and BERT configs name alike."""
    return {**_hf_common(s), "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads, "max_position_embeddings": s.max_position_embeddings}


def _to_gpt2(s: ModelSpec) -> dict[str, Any]:
    return {**_hf_common(s), "n_embd": s.hidden_size, "n_layer": s.num_layers, "n_head": s.num_heads,
            "n_inner": s.intermediate_size, "n_positions": s.max_position_embeddings,
            "activation_function": s.activation, "resid_pdrop": s.hidden_dropout, "embd_pdrop": s.hidden_dropout,
            "attn_pdrop": s.attention_dropout}


def _to_gpt_neox(s: ModelSpec) -> dict[str, Any]:
    return {**_hf_standard(s), "intermediate_size": s.intermediate_size, "hidden_act": s.activation,
            "attention_bias": s.qkv_bias, "hidden_dropout": s.hidden_dropout,
            "attention_dropout": s.attention_dropout, "use_parallel_residual": s.parallel_residual,
            "rotary_pct": s.rotary_fraction}


def _to_opt(s: ModelSpec) -> dict[str, Any]:
    return {**_hf_standard(s), "ffn_dim": s.intermediate_size, "activation_function": s.activation,
            "enable_bias": s.qkv_bias, "layer_norm_elementwise_affine": s.norm_affine,
            "word_embed_proj_dim": s.word_embed_proj_dim or s.hidden_size, "dropout": s.hidden_dropout,
            "attention_dropout": s.attention_dropout, "do_layer_norm_before": True,
            "_remove_final_layer_norm": not s.final_norm}


def _to_llama(s: ModelSpec) -> dict[str, Any]:
    d = {**_hf_standard(s), "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
         "intermediate_size": s.intermediate_size, "hidden_act": s.activation, "attention_dropout": s.attention_dropout}
    if s.model_type == "llama":
        d.update(attention_bias=s.qkv_bias, mlp_bias=s.mlp_bias)
    return d


def _to_bert(s: ModelSpec) -> dict[str, Any]:
    return {**_hf_standard(s), "intermediate_size": s.intermediate_size, "type_vocab_size": s.type_vocab_size,
            "hidden_act": s.activation, "hidden_dropout_prob": s.hidden_dropout,
            "attention_probs_dropout_prob": s.attention_dropout}


def _to_t5(s: ModelSpec) -> dict[str, Any]:
    act = "gelu" if s.activation == "gelu_new" and s.gated_mlp else s.activation
    return {**_hf_common(s), "untied_lm_head": not s.tie_word_embeddings, "decoder_start_token_id": 0,
            "pad_token_id": 0, "d_model": s.hidden_size, "num_layers": s.num_layers,
            "num_decoder_layers": s.num_decoder_layers, "num_heads": s.num_heads, "d_kv": s.head_dim,
            "d_ff": s.intermediate_size, "feed_forward_proj": ("gated-" if s.gated_mlp else "") + act,
            "relative_attention_num_buckets": s.relative_attention_num_buckets, "dropout_rate": s.hidden_dropout}


def _to_moe(s: ModelSpec) -> dict[str, Any]:
    mt = s.model_type
    d = {**_hf_standard(s), "num_key_value_heads": s.num_kv_heads, "intermediate_size": s.intermediate_size,
         "hidden_act": s.activation, "attention_dropout": s.attention_dropout,
         _EXPERT_KEYS[mt][0]: s.num_experts, "num_experts_per_tok": s.num_experts_per_tok}
    if mt in _MLA_TYPES:
        d.update(moe_intermediate_size=s.moe_intermediate_size, n_shared_experts=s.num_shared_experts,
                 first_k_dense_replace=s.first_dense_layers, kv_lora_rank=s.kv_lora_rank,
                 q_lora_rank=s.q_lora_rank or None, qk_nope_head_dim=s.qk_nope_head_dim,
                 qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim, n_group=s.num_expert_groups,
                 topk_group=s.topk_expert_groups, attention_bias=s.qkv_bias)
        if mt == "deepseek_v2":
            d.update(mlp_bias=s.mlp_bias, topk_method="group_limited_greedy" if s.num_expert_groups > 1 else "greedy")
        return d
    d["head_dim"] = s.head_dim
    if mt == "mixtral":
        return d
    if mt == "olmoe":
        return {**d, "attention_bias": s.qkv_bias}
    d.update(moe_intermediate_size=s.moe_intermediate_size, decoder_sparse_step=s.moe_layer_step,
             mlp_only_layers=list(s.dense_layer_ids))
    if mt == "qwen2_moe":
        return {**d, "qkv_bias": s.qkv_bias, "shared_expert_intermediate_size": s.shared_expert_intermediate_size}
    return {**d, "attention_bias": s.qkv_bias}


_TO_HF = {"gpt2": _to_gpt2, "gpt_neox": _to_gpt_neox, "opt": _to_opt, "llama": _to_llama,
          "bert": _to_bert, "t5": _to_t5, "moe": _to_moe}


# ----------------------------------------------------------------------------- public constructors

def from_config(config: Any, *, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a transformers config object, a config dict, or a path to a `config.json`.

    Raises SpecError (a ValueError) for an unreadable file, an unsupported model_type or
    inconsistent sizes, with a message that says which.
    """
    where = "config"
    if name is not None:
        _spec_check(_checks.text, "name", name)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        where = path
        cfg = read_json(path)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    elif isinstance(config, Mapping):
        cfg = dict(config)
    elif hasattr(config, "to_dict"):
        cfg = config.to_dict()
    else:
        raise SpecError(f"expected a transformers config, a dict or a config.json path, got {type(config).__name__}")
    if not isinstance(cfg, Mapping):
        raise SpecError(f"{where}: a model config must be a JSON object")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise SpecError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    label = name or cfg.get("_name_or_path") or model_type
    if not isinstance(label, str):
        label = model_type
    try:
        return _PARSERS[MODEL_TYPES[model_type]](cfg, label)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    except (TypeError, AttributeError, ValueError) as e:  # a list where a name belongs, and the like
        raise SpecError(f"{where}: malformed {model_type} config: {e}") from None


MAX_CONFIG_BYTES = 1 << 20  # a transformers config.json is a few KB


def read_json(path: str) -> Any:
    """A config file: regular files only (a FIFO or a device would hang or never end), at most
    MAX_CONFIG_BYTES, valid JSON of sane depth; every failure is one SpecError naming the file."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SpecError(f"cannot read config {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"cannot read config {path!r}: not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise SpecError(f"cannot read config {path!r}: {st.st_size:,} bytes is too large for a config "
                        f"(at most {MAX_CONFIG_BYTES:,})")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read config {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path!r} is not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except SpecError as e:
        raise SpecError(f"{path!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path!r} is not valid JSON: {e.msg} (line {e.lineno})") from None
    except RecursionError:
        raise SpecError(f"{path!r} is nested too deeply to be a model config") from None


def _no_constant(name: str) -> Any:
    raise SpecError(f"{name} is not a number JSON allows (a config must use finite numbers)")


def _preset_dir():
    return resources.files("vramlab") / "presets"


@cache
def _preset_types() -> dict[str, str]:
    """Every stored preset's name and model_type (read once)."""
    out = {}
    for p in _preset_dir().iterdir():
        if p.name.endswith(".json"):
            out[p.name[:-5]] = json.loads(p.read_text(encoding="utf-8")).get("model_type")
    return out


@cache
def preset_names() -> tuple[str, ...]:
    """The dense presets: every calculator answers for each of them. The mixture-of-experts presets,
    whose training memory the calculators do not model yet, are `moe_preset_names()`."""
    return tuple(sorted(n for n, t in _preset_types().items() if MODEL_TYPES.get(t) != "moe"))


@cache
def moe_preset_names() -> tuple[str, ...]:
    """The mixture-of-experts presets (Mixtral, Qwen-MoE, OLMoE, DeepSeek): `preset` builds them and
    `vramlab.moe` prices them; `resolve`, and so the calculators built on it (parallel layouts, ZeRO,
    fitting), refuses them; `memory.estimate_training` takes them."""
    return tuple(sorted(n for n, t in _preset_types().items() if MODEL_TYPES.get(t) == "moe"))


def preset(name: str) -> ModelSpec:
    """A built-in model (configs stored in the package; nothing is downloaded)."""
    known = ", ".join(preset_names() + moe_preset_names())
    if not isinstance(name, str):
        raise SpecError(f"a model preset is named by a string ({known}), got {_checks.show(name)}")
    key = name.strip().lower()
    if key not in _preset_types():
        raise SpecError(f"unknown model preset {name!r}; known: {known}")
    cfg = json.loads((_preset_dir() / f"{key}.json").read_text(encoding="utf-8"))
    return from_config(cfg, name=key)


def resolve(model: "ModelSpec | str", *, moe: bool = False) -> ModelSpec:
    """A model as every calculator takes it, the one resolver: a `ModelSpec` as it is, a string as a preset's
    name (the mixture-of-experts presets too). `moe` is the calculator's policy for a mixture of experts: True
    where it models one (one device's training and inference, `moe`, expert parallelism, serving), False
    where it prices dense models only: then a mixture of experts is refused with one line."""
    if isinstance(model, str):
        model = preset(model)
    elif not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a ModelSpec or a preset name, got {_checks.show(model)}")
    if model.is_moe and not moe:
        raise ValueError(f"{model.name}: {MOE_NOT_MODELLED}; vramlab.moe counts its parameters and KV cache")
    return model


# ----------------------------------------------------------------------------- GPUs

# What a process's CUDA context and libraries (cuBLAS, cuDNN kernels, handles) take outside
# PyTorch's allocator: device use minus max_memory_reserved, measured on an H100 (driver 580, CUDA
# 13, torch 2.11) after a training step. The default for GPUs where nobody has measured it: newer
# drivers load modules lazily, older stacks take more (Hugging Face measured 1343 MB on a V100).
DEFAULT_CONTEXT_BYTES = 787_283_968
MAX_GPU_BYTES = 1 << 50  # a PiB: beyond any device, small enough that no product of it overflows a float
# nvidia-smi's total minus what cudaMemGetInfo calls total, on the H100: the driver keeps it
DEFAULT_DRIVER_HOLD_FRACTION = 1 - 85_017_493_504 / (81559 * MiB)


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """A GPU's memory and speed. memory_bytes is nvidia-smi's 'Total'; marketing GB are decimal
    and larger. What a process can use is less: `usable_bytes` (cudaMemGetInfo's total, where
    measured) less `context_bytes` (the CUDA context and libraries, outside PyTorch's allocator)."""

    name: str
    memory_bytes: int
    bandwidth_GBps: float  # HBM/GDDR bandwidth, vendor figure, decimal GB/s
    peak_tflops_fp32: float  # dense, no tensor cores
    peak_tflops_16: float  # dense fp16/bf16 tensor-core peak, fp32 accumulate (vendor figure)
    interconnect: str  # host link (and NVLink, if any)
    host_link_GBps: float  # PCIe x16 per direction, decimal GB/s
    architecture: str
    measured_usable_bytes: int | None = None  # torch.cuda.mem_get_info()[1] on this card
    measured_context_bytes: int | None = None  # device use - max_memory_reserved, on this card
    peak_tops_int8: float = 0.0  # dense INT8 (tensor cores; Pascal's DP4A: 4x fp32), vendor figure; 0: unknown

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: numpy's numbers stored as Python's)
        for k in ("name", "interconnect", "architecture"):
            _spec_check(_checks.text, k, getattr(self, k))
        put("memory_bytes", _spec_check(_checks.whole, "memory_bytes", self.memory_bytes, hi=MAX_GPU_BYTES))
        for k in ("bandwidth_GBps", "peak_tflops_fp32", "peak_tflops_16", "host_link_GBps", "peak_tops_int8"):
            put(k, _spec_check(_checks.number, k, getattr(self, k), lo=0, hi=1e9))  # 0: unknown
        if self.measured_usable_bytes is not None:
            put("measured_usable_bytes", _spec_check(_checks.whole, "measured_usable_bytes", self.measured_usable_bytes,
                                                     hi=self.memory_bytes))
        if self.measured_context_bytes is not None:
            put("measured_context_bytes", _spec_check(_checks.whole, "measured_context_bytes",
                                                      self.measured_context_bytes, lo=0, hi=self.memory_bytes))

    @property
    def usable_bytes(self) -> int:
        """cudaMemGetInfo's total: measured, or nvidia-smi's total less the driver's hold (the H100's)."""
        if self.measured_usable_bytes is not None:
            return self.measured_usable_bytes
        return int(self.memory_bytes * (1 - DEFAULT_DRIVER_HOLD_FRACTION))

    @property
    def context_bytes(self) -> int:
        """The CUDA context and libraries: measured, or DEFAULT_CONTEXT_BYTES."""
        return DEFAULT_CONTEXT_BYTES if self.measured_context_bytes is None else self.measured_context_bytes

    @property
    def cublas_workspace_bytes(self) -> int:
        """One cuBLAS handle's workspace, which PyTorch allocates through its caching allocator
        (ATen/cuda/CublasHandlePool.cpp, default CUBLAS_WORKSPACE_CONFIG): 32 MiB on Hopper and
        Blackwell, :4096:2:16:8 = 8 MiB + 128 KiB before. Measured on an H100: 32 MiB per handle."""
        if self.architecture in ("Hopper", "Blackwell", "unknown"):
            return 4096 * 8 * 1024
        return 4096 * 1024 * 2 + 16 * 1024 * 8


def _g(name, mem_mib, bw, f32, f16, link, link_bw, arch, **measured):
    return GPUSpec(name=name, memory_bytes=mem_mib * MiB, bandwidth_GBps=bw, peak_tflops_fp32=f32,
                   peak_tflops_16=f16, interconnect=link, host_link_GBps=link_bw, architecture=arch, **measured)


# Vendor data sheets (NVIDIA); memory as reported by nvidia-smi on each card. Measured fields:
# benchmarks/results/h100/ (H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch 2.11).
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    _g("gtx-1060-6gb", 6144, 192, 4.4, 0.07, "PCIe 3.0 x16", 15.75, "Pascal", peak_tops_int8=17.6),
    _g("t4", 15360, 320, 8.1, 65, "PCIe 3.0 x16", 15.75, "Turing", peak_tops_int8=130),
    _g("rtx-3090", 24576, 936, 35.6, 71, "PCIe 4.0 x16, NVLink 112.5 GB/s", 31.5, "Ampere", peak_tops_int8=284),
    _g("rtx-4090", 24564, 1008, 82.6, 165.2, "PCIe 4.0 x16", 31.5, "Ada", peak_tops_int8=660.6),
    _g("a100-40gb", 40960, 1555, 19.5, 312, "PCIe 4.0 x16, NVLink 600 GB/s", 31.5, "Ampere", peak_tops_int8=624),
    _g("a100-80gb", 81920, 2039, 19.5, 312, "PCIe 4.0 x16, NVLink 600 GB/s", 31.5, "Ampere", peak_tops_int8=624),
    _g("h100-80gb", 81559, 3350, 67, 989, "PCIe 5.0 x16, NVLink 900 GB/s", 63, "Hopper",
       measured_usable_bytes=85_017_493_504, measured_context_bytes=DEFAULT_CONTEXT_BYTES, peak_tops_int8=1979),
    _g("h200", 143771, 4800, 67, 989, "PCIe 5.0 x16, NVLink 900 GB/s", 63, "Hopper", peak_tops_int8=1979),
)}
_GPU_ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "gtx-1060": "gtx-1060-6gb", "gtx1060": "gtx-1060-6gb",
                "3090": "rtx-3090", "4090": "rtx-4090", "rtx3090": "rtx-3090", "rtx4090": "rtx-4090",
                "a100-40": "a100-40gb", "a100-80": "a100-80gb", "h200-141gb": "h200"}


def gpu(name: "str | GPUSpec") -> GPUSpec:
    """Look up a GPU by catalogue name ('t4', 'a100-80gb', 'h100', ...), case-insensitive; a GPUSpec
    (a preset or `custom_gpu`) is returned as it is, so every function taking `gpu` takes either."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"a GPU is a GPUSpec or named by a catalogue name ({', '.join(GPUS)}), got {name!r} "
                        "(for a GPU known only by its memory, use vramlab.specs.custom_gpu(bytes))")
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise SpecError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


# what torch.cuda.get_device_name() says, matched in order (lower case, spaces and dashes ignored)
_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb"),
    ("rtx4090", "rtx-4090"), ("rtx3090", "rtx-3090"), ("t4", "t4"), ("gtx1060", "gtx-1060-6gb"))


def gpu_for_device(device_name: str, memory_bytes: "int | None" = None) -> "GPUSpec | None":
    """The catalogue's entry for a device as torch names it ("Tesla T4", "NVIDIA A100-SXM4-40GB",
    "NVIDIA H100 80GB HBM3"...), or None when the catalogue has none (then say so, rather than
    predicting for another GPU). An A100 without its size in the name is told by `memory_bytes`."""
    if not isinstance(device_name, str):
        raise SpecError(f"device_name must be a string (torch.cuda.get_device_name()), got {_checks.show(device_name)}")
    if memory_bytes is not None:
        memory_bytes = _spec_check(_checks.whole, "memory_bytes", memory_bytes, hi=MAX_GPU_BYTES)
    key = re.sub(r"[\s_\-]", "", device_name.lower())
    for needle, name in _DEVICE_NAMES:
        if needle == "t4" and not re.search(r"(^|tesla|nvidia)t4($|\W)", key):
            continue
        if needle in key:
            small = memory_bytes is not None and memory_bytes < 60 * GiB
            if name == "a100-80gb" and ("40gb" in key or ("80gb" not in key and small)):
                return GPUS["a100-40gb"]
            return GPUS[name]
    return None


def custom_gpu(memory: int, *, name: str = "custom", context_bytes: int | None = None) -> GPUSpec:
    """A GPU known only by its memory in bytes: what cudaMemGetInfo reports as total (speed fields
    zero). `context_bytes`: what the CUDA context takes outside PyTorch's allocator, if measured."""
    n = _checks.index(memory)
    if n is None or not 1 <= n <= MAX_GPU_BYTES:
        raise SpecError(f"memory must be a positive number of bytes (a whole number up to {MAX_GPU_BYTES:,}: "
                        f"GPU memory), got {_checks.show(memory)}")
    memory = n
    _spec_check(_checks.text, "name", name)
    if context_bytes is not None:
        c = _checks.index(context_bytes)
        if c is None or not 0 <= c < memory:
            raise SpecError(f"context_bytes must be a whole number of bytes from 0 to the GPU's memory "
                            f"({memory:,}), got {_checks.show(context_bytes)}")
        context_bytes = c
    return GPUSpec(name=name, memory_bytes=int(memory), bandwidth_GBps=0.0, peak_tflops_fp32=0.0,
                   peak_tflops_16=0.0, interconnect="unknown", host_link_GBps=0.0, architecture="unknown",
                   measured_usable_bytes=int(memory), measured_context_bytes=context_bytes)


__all__ = ["ModelSpec", "GPUSpec", "SpecError", "from_config", "preset", "preset_names", "moe_preset_names", "gpu",
           "custom_gpu", "gpu_for_device", "GPUS", "MODEL_TYPES", "MOE_MODEL_TYPES", "GB", "GiB"]
