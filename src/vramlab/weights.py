"""The weights of each model family, tensor by tensor: `param_groups(spec)` counts a `specs.ModelSpec`'s
parameters by role (embeddings, layers, head) and `param_shapes(spec)` lists every parameter tensor
as (name, shape) in `model.named_parameters()` order, each mirroring the modules of the transformers
5.x implementation of its family (GPT-2, GPT-NeoX, OPT, Llama, BERT, T5, and the mixtures of experts).
`ModelSpec.params`, `param_groups`, `param_tensors` and `param_shapes` read them. Pure Python: the
functions read a spec's fields only (this module imports nothing of vramlab: `specs` imports it).
"""

from __future__ import annotations

# `ModelSpec` below is vramlab.specs.ModelSpec, named in annotations only (specs imports this module)


# ----------------------------------------------------------------------------- parameter counts
# Each counter mirrors the modules of the transformers 5.x implementation, tensor by tensor.

def _linear(d_in: int, d_out: int, bias: bool) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _norm(s: ModelSpec, width: int) -> int:
    if not s.norm_affine:
        return 0
    return width * (2 if s.norm == "layernorm" and s.norm_bias else 1)


def _mlp(s: ModelSpec) -> int:
    h, i, b = s.hidden_size, s.intermediate_size, s.mlp_bias
    n_in = 2 if s.gated_mlp else 1  # gate and up, or a single fc
    return n_in * _linear(h, i, b) + _linear(i, h, b)


def _attention(s: ModelSpec, *, fused_qkv: bool = False) -> int:
    h = s.hidden_size
    if fused_qkv:  # GPT-2 c_attn / NeoX query_key_value: one h x 3h matrix
        return _linear(h, 3 * h, s.qkv_bias) + _linear(h, h, s.out_bias)
    return (_linear(h, s.q_dim, s.qkv_bias) + 2 * _linear(h, s.kv_dim, s.qkv_bias)
            + _linear(s.q_dim, h, s.out_bias))


def _lm_head(s: ModelSpec, d: int) -> int:
    return 0 if s.tie_word_embeddings else s.vocab_size * d


def _count_gpt2(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    block = 2 * _norm(s, h) + _attention(s, fused_qkv=True) + _mlp(s)
    return {"embeddings": s.vocab_size * h + s.max_position_embeddings * h,  # wte, wpe
            "layers": s.num_layers * block,
            "head": _norm(s, h) + _lm_head(s, h)}  # ln_f, lm_head


def _count_gpt_neox(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    block = 2 * _norm(s, h) + _attention(s, fused_qkv=True) + _mlp(s)
    return {"embeddings": s.vocab_size * h, "layers": s.num_layers * block,
            "head": _norm(s, h) + _lm_head(s, h)}


def _count_opt(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    e = s.word_embed_proj_dim or h
    proj = 2 * e * h if e != h else 0  # project_in, project_out (no bias)
    block = 2 * _norm(s, h) + _attention(s) + _mlp(s)
    return {"embeddings": s.vocab_size * e + (s.max_position_embeddings + 2) * h + proj,  # +2: OPT offset
            "layers": s.num_layers * block,
            "head": (_norm(s, h) if s.final_norm else 0) + _lm_head(s, e)}


def _count_llama(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    block = 2 * _norm(s, h) + _attention(s) + _mlp(s)
    return {"embeddings": s.vocab_size * h, "layers": s.num_layers * block,
            "head": _norm(s, h) + _lm_head(s, h)}


def _count_bert(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    emb = (s.vocab_size + s.max_position_embeddings + s.type_vocab_size) * h + _norm(s, h)
    block = _attention(s) + _mlp(s) + 2 * _norm(s, h)
    # masked-LM head: transform dense + LayerNorm, decoder (tied to word embeddings) + its bias (V)
    head = _linear(h, h, True) + _norm(s, h) + _lm_head(s, h) + s.vocab_size
    return {"embeddings": emb, "layers": s.num_layers * block, "head": head}


def _count_t5(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    attn = _attention(s)  # q, k, v, o without bias; inner width a * d_kv
    rel = s.relative_attention_num_buckets * s.num_heads  # in the first block of each stack
    enc_block = attn + _mlp(s) + 2 * _norm(s, h)
    dec_block = 2 * attn + _mlp(s) + 3 * _norm(s, h)  # self-attn, cross-attn, FF
    layers = s.num_layers * enc_block + s.num_decoder_layers * dec_block + 2 * rel
    return {"embeddings": s.vocab_size * h, "layers": layers,
            "head": 2 * _norm(s, h) + _lm_head(s, h)}  # encoder and decoder final norms


def _moe_attention(s: ModelSpec) -> int:
    """An MoE model's attention: grouped-query (with Qwen3's per-head or OLMoE's whole-projection
    q/k norms) or DeepSeek's multi-head latent attention."""
    h, a = s.hidden_size, s.num_heads
    if not s.is_mla:
        norms = {"": 0, "head": 2 * s.head_dim, "proj": s.q_dim + s.kv_dim}[s.qk_norm]
        return _attention(s) + norms
    if s.q_lora_rank:  # q_a_proj (bias: attention_bias), q_a_layernorm, q_b_proj
        q = _linear(h, s.q_lora_rank, s.qkv_bias) + s.q_lora_rank + s.q_lora_rank * a * s.head_dim
    else:
        q = h * a * s.head_dim  # q_proj, never a bias
    kv = (_linear(h, s.kv_lora_rank + s.qk_rope_head_dim, s.qkv_bias) + s.kv_lora_rank  # kv_a_proj_with_mqa, its norm
          + s.kv_lora_rank * a * (s.qk_nope_head_dim + s.v_head_dim))  # kv_b_proj
    return q + kv + _linear(a * s.v_head_dim, h, s.out_bias)


def _shared_width(s: ModelSpec) -> int:
    """The shared experts' MLP width: they run as one MLP (DeepSeek: n_shared x moe_intermediate_size)."""
    return s.num_shared_experts * (s.shared_expert_intermediate_size or s.moe_intermediate_size)


def _moe_mlp(s: ModelSpec) -> int:
    """An MoE layer's MLP: the router (num_experts x h, no bias), the routed experts (fused gate_up
    and down tensors, no bias), the shared experts and Qwen2-MoE's shared-expert gate."""
    h, w = s.hidden_size, _shared_width(s)
    shared = (2 * _linear(h, w, s.mlp_bias) + _linear(w, h, s.mlp_bias)) if w else 0
    return s.num_experts * h + s.num_experts * s.expert_params + shared + (h if s.shared_expert_gate else 0)


def _count_moe(s: ModelSpec) -> dict[str, int]:
    h = s.hidden_size
    n_moe = len(s.moe_layer_ids)
    common = _moe_attention(s) + 2 * _norm(s, h)
    layers = s.num_layers * common + n_moe * _moe_mlp(s) + (s.num_layers - n_moe) * _mlp(s)
    return {"embeddings": s.vocab_size * h, "layers": layers, "head": _norm(s, h) + _lm_head(s, h)}


COUNTERS = {"gpt2": _count_gpt2, "gpt_neox": _count_gpt_neox, "opt": _count_opt,
            "llama": _count_llama, "bert": _count_bert, "t5": _count_t5, "moe": _count_moe}


# ----------------------------------------------------------------------------- tensors, in order
Shape = tuple[int, ...]
# the mixtures of experts whose MoE layer registers its experts before its router
_EXPERTS_FIRST = ("qwen3_moe", "deepseek_v2", "deepseek_v3")


def _lin(name: str, d_in: int, d_out: int, bias: bool) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (d_out, d_in))] + ([(f"{name}.bias", (d_out,))] if bias else [])


def _nrm(s: ModelSpec, name: str, width: int) -> list[tuple[str, Shape]]:
    if not s.norm_affine:
        return []
    return [(f"{name}.weight", (width,))] + ([(f"{name}.bias", (width,))] if s.norm == "layernorm" and s.norm_bias else [])


def _mlp_tensors(s: ModelSpec, names: tuple[str, ...]) -> list[tuple[str, Shape]]:
    h, i, b = s.hidden_size, s.intermediate_size, s.mlp_bias
    ins = names[:-1] if s.gated_mlp else names[:1]
    return [t for n in ins for t in _lin(n, h, i, b)] + _lin(names[-1], i, h, b)


def _head_tensor(s: ModelSpec, d: int) -> list[tuple[str, Shape]]:
    return [] if s.tie_word_embeddings else [("lm_head.weight", (s.vocab_size, d))]


def _t_gpt2(s: ModelSpec) -> list[tuple[str, Shape]]:
    h = s.hidden_size
    out = [("wte.weight", (s.vocab_size, h)), ("wpe.weight", (s.max_position_embeddings, h))]
    for i in range(s.num_layers):
        p = f"h.{i}."
        out += (_nrm(s, p + "ln_1", h) + _lin(p + "attn.c_attn", h, 3 * h, s.qkv_bias) + _lin(p + "attn.c_proj", h, h, s.out_bias)
                + _nrm(s, p + "ln_2", h) + _mlp_tensors(s, (p + "mlp.c_fc", p + "mlp.c_proj")))
    return out + _nrm(s, "ln_f", h) + _head_tensor(s, h)


def _t_gpt_neox(s: ModelSpec) -> list[tuple[str, Shape]]:
    h = s.hidden_size
    out = [("embed_in.weight", (s.vocab_size, h))]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += (_nrm(s, p + "input_layernorm", h) + _nrm(s, p + "post_attention_layernorm", h)
                + _lin(p + "attention.query_key_value", h, 3 * h, s.qkv_bias) + _lin(p + "attention.dense", h, h, s.out_bias)
                + _mlp_tensors(s, (p + "mlp.dense_h_to_4h", p + "mlp.dense_4h_to_h")))
    return out + _nrm(s, "final_layer_norm", h) + _head_tensor(s, h)


def _t_opt(s: ModelSpec) -> list[tuple[str, Shape]]:
    h = s.hidden_size
    e = s.word_embed_proj_dim or h
    out = [("embed_tokens.weight", (s.vocab_size, e)), ("embed_positions.weight", (s.max_position_embeddings + 2, h))]
    if e != h:
        out += [("project_out.weight", (e, h)), ("project_in.weight", (h, e))]
    if s.final_norm:
        out += _nrm(s, "final_layer_norm", h)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += [t for n in ("k_proj", "v_proj", "q_proj") for t in _lin(p + "self_attn." + n, h, h, s.qkv_bias)]
        out += (_lin(p + "self_attn.out_proj", h, h, s.out_bias) + _nrm(s, p + "self_attn_layer_norm", h)
                + _mlp_tensors(s, (p + "fc1", p + "fc2")) + _nrm(s, p + "final_layer_norm", h))
    return out + _head_tensor(s, e)


def _t_llama(s: ModelSpec) -> list[tuple[str, Shape]]:
    h = s.hidden_size
    out = [("embed_tokens.weight", (s.vocab_size, h))]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += (_lin(p + "self_attn.q_proj", h, s.q_dim, s.qkv_bias) + _lin(p + "self_attn.k_proj", h, s.kv_dim, s.qkv_bias)
                + _lin(p + "self_attn.v_proj", h, s.kv_dim, s.qkv_bias) + _lin(p + "self_attn.o_proj", s.q_dim, h, s.out_bias)
                + _mlp_tensors(s, (p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj"))
                + _nrm(s, p + "input_layernorm", h) + _nrm(s, p + "post_attention_layernorm", h))
    return out + _nrm(s, "norm", h) + _head_tensor(s, h)


def _t_bert(s: ModelSpec) -> list[tuple[str, Shape]]:
    h = s.hidden_size
    out = [("word_embeddings.weight", (s.vocab_size, h)), ("position_embeddings.weight", (s.max_position_embeddings, h)),
           ("token_type_embeddings.weight", (s.type_vocab_size, h))] + _nrm(s, "embeddings.LayerNorm", h)
    for i in range(s.num_layers):
        p = f"layer.{i}."
        out += [t for n in ("query", "key", "value") for t in _lin(p + "attention.self." + n, h, h, s.qkv_bias)]
        out += (_lin(p + "attention.output.dense", h, h, s.out_bias) + _nrm(s, p + "attention.output.LayerNorm", h)
                + _mlp_tensors(s, (p + "intermediate.dense", p + "output.dense")) + _nrm(s, p + "output.LayerNorm", h))
    head = [("cls.predictions.bias", (s.vocab_size,))] + _lin("cls.predictions.transform.dense", h, h, True)
    head += _nrm(s, "cls.predictions.transform.LayerNorm", h)
    return out + head + ([] if s.tie_word_embeddings else [("cls.predictions.decoder.weight", (s.vocab_size, h))])


def _t_t5(s: ModelSpec) -> list[tuple[str, Shape]]:
    h, q = s.hidden_size, s.q_dim
    ffn = ("DenseReluDense.wi_0", "DenseReluDense.wi_1", "DenseReluDense.wo") if s.gated_mlp else \
        ("DenseReluDense.wi", "DenseReluDense.wo")

    def attn(p: str, rel: bool) -> list[tuple[str, Shape]]:
        t = [(f"{p}.{n}.weight", (q, h)) for n in ("q", "k", "v")] + [(f"{p}.o.weight", (h, q))]
        return t + ([(f"{p}.relative_attention_bias.weight", (s.relative_attention_num_buckets, s.num_heads))] if rel else [])

    out = [("shared.weight", (s.vocab_size, h))]
    for stack, n, dec in (("encoder", s.num_layers, False), ("decoder", s.num_decoder_layers, True)):
        for i in range(n):
            p = f"{stack}.block.{i}.layer."
            out += attn(p + "0.SelfAttention", i == 0) + _nrm(s, p + "0.layer_norm", h)
            if dec:
                out += attn(p + "1.EncDecAttention", False) + _nrm(s, p + "1.layer_norm", h)
            f = p + ("2." if dec else "1.")
            out += _mlp_tensors(s, tuple(f + x for x in ffn)) + _nrm(s, f + "layer_norm", h)
        out += _nrm(s, f"{stack}.final_layer_norm", h)
    return out + _head_tensor(s, h)


def _t_moe(s: ModelSpec) -> list[tuple[str, Shape]]:
    h, a, E = s.hidden_size, s.num_heads, s.num_experts
    moe_layers = set(s.moe_layer_ids)
    out = [("embed_tokens.weight", (s.vocab_size, h))]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        at = p + "self_attn."
        if s.is_mla:
            if s.q_lora_rank:
                out += (_lin(at + "q_a_proj", h, s.q_lora_rank, s.qkv_bias) + [(at + "q_a_layernorm.weight", (s.q_lora_rank,))]
                        + _lin(at + "q_b_proj", s.q_lora_rank, a * s.head_dim, False))
            else:
                out += _lin(at + "q_proj", h, a * s.head_dim, False)
            out += (_lin(at + "kv_a_proj_with_mqa", h, s.kv_lora_rank + s.qk_rope_head_dim, s.qkv_bias)
                    + [(at + "kv_a_layernorm.weight", (s.kv_lora_rank,))]
                    + _lin(at + "kv_b_proj", s.kv_lora_rank, a * (s.qk_nope_head_dim + s.v_head_dim), False)
                    + _lin(at + "o_proj", a * s.v_head_dim, h, s.out_bias))
        else:
            out += (_lin(at + "q_proj", h, s.q_dim, s.qkv_bias) + _lin(at + "k_proj", h, s.kv_dim, s.qkv_bias)
                    + _lin(at + "v_proj", h, s.kv_dim, s.qkv_bias) + _lin(at + "o_proj", s.q_dim, h, s.out_bias))
            if s.qk_norm:
                q, k = (s.head_dim, s.head_dim) if s.qk_norm == "head" else (s.q_dim, s.kv_dim)
                out += [(at + "q_norm.weight", (q,)), (at + "k_norm.weight", (k,))]
        m = p + "mlp."
        if i in moe_layers:
            router = [(m + "gate.weight", (E, h))]
            experts = [(m + "experts.gate_up_proj", (E, 2 * s.moe_intermediate_size, h)),
                       (m + "experts.down_proj", (E, h, s.moe_intermediate_size))]
            # registration order: Mixtral, OLMoE and Qwen2-MoE make the router first; Qwen3-MoE and DeepSeek the experts
            out += experts + router if s.model_type in _EXPERTS_FIRST else router + experts
            if s.num_shared_experts:
                w, shared = _shared_width(s), m + ("shared_experts." if s.is_mla else "shared_expert.")
                out += (_lin(shared + "gate_proj", h, w, s.mlp_bias) + _lin(shared + "up_proj", h, w, s.mlp_bias)
                        + _lin(shared + "down_proj", w, h, s.mlp_bias))
            if s.shared_expert_gate:
                out += [(m + "shared_expert_gate.weight", (1, h))]
        else:
            out += _mlp_tensors(s, (m + "gate_proj", m + "up_proj", m + "down_proj"))
        out += _nrm(s, p + "input_layernorm", h) + _nrm(s, p + "post_attention_layernorm", h)
    return out + _nrm(s, "norm", h) + _head_tensor(s, h)


TENSORS = {"gpt2": _t_gpt2, "gpt_neox": _t_gpt_neox, "opt": _t_opt, "llama": _t_llama, "bert": _t_bert, "t5": _t_t5,
           "moe": _t_moe}


def param_groups(s: ModelSpec) -> dict[str, int]:
    """Parameter counts by role: embeddings, layers (all blocks), head (norms and LM head)."""
    return COUNTERS[s.family](s)


def param_shapes(s: ModelSpec) -> list[tuple[str, Shape]]:
    """Every parameter tensor as (name, shape), in `model.named_parameters()` order (tied tensors once)."""
    return TENSORS[s.family](s)
