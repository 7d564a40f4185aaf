"""Mixture-of-experts models as far as their size goes: where the parameters sit, how many one
token uses, and what the KV cache holds per token. Pure Python: no torch import.

The ModelSpec fields and the exact counts live in `specs` (family "moe": Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V2/V3); this module reads them. A token goes through every dense tensor
and the num_experts_per_tok routed experts its router picks in each MoE layer, so its compute and
its activations follow `active_params`, while memory for weights, gradients and optimizer states
follows `params`. Training memory on one device is modelled below (`training_layer_saved`,
`mla_attention_saved`, `training_block_bytes`, used by `memory.estimate_training`; every family above); `specs.resolve`
refuses an MoE spec for the dense-only calculators, and takes one with `moe=True`, as this module does.

The KV cache of multi-head latent attention (DeepSeek) is the reason MLA exists: keys and values
are rebuilt from a kv_lora_rank latent plus one shared rotary key of qk_rope_head_dim, so that is
what needs caching, not 2 * heads * head_dim per layer. `kv_cache_bytes` names each layout.
"""

from __future__ import annotations

from . import checks as _checks
from . import specs as _specs
from .specs import ModelSpec
from .units import fmt_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

# What a cache entry holds per token and layer:
#   transformers: what transformers' DynamicCache holds (the installed 5.x): for MLA the latent
#                 (kv_lora_rank, after kv_a_layernorm) and the rotated shared key (qk_rope_head_dim),
#                 stored in its key and value slots as one-head tensors; else K and V of the kv heads.
#   latent:       MLA's compressed latent, kv_lora_rank + qk_rope_head_dim: what serving engines with
#                 MLA kernels cache (vLLM's and SGLang's MLA backends; DeepSeek-V2, arXiv:2405.04434).
#                 Only for MLA models; the same numbers as "transformers" in transformers 5.x.
#   expanded:     keys and values per attention head after kv_b_proj, heads * (qk_head_dim + v_head_dim):
#                 what transformers 4.x cached for DeepSeek and what a cache without MLA would hold.
KV_LAYOUTS = ("transformers", "latent", "expanded")


def param_breakdown(model: "ModelSpec | str") -> dict[str, int]:
    """Parameters by role, summing to `spec.params`: embeddings, attention (projections and their
    norms), norms (the two per layer and the final one), dense_mlp (dense layers' MLPs), router
    (each MoE layer's num_experts x hidden gate), routed_experts, shared_experts (with Qwen2-MoE's
    shared-expert gate) and head (an untied LM head)."""
    s = _specs.resolve(model, moe=True)
    if not s.is_moe:
        raise ValueError(f"{s.name} is a dense {s.model_type} model: it has no experts to break down "
                         f"(spec.param_groups() splits it)")
    h, n_moe = s.hidden_size, len(s.moe_layer_ids)
    n_dense = s.num_layers - n_moe

    def mlp(width: int) -> int:  # a gated MLP: gate and up (h -> width), down (width -> h)
        return 3 * h * width + (2 * width + h if s.mlp_bias else 0) if width else 0

    shared_width = s.num_shared_experts * (s.shared_expert_intermediate_size or s.moe_intermediate_size)
    out = {
        "embeddings": s.vocab_size * h,
        "attention": 0,  # what the layers hold besides the rest, below
        "norms": (2 * s.num_layers + 1) * h,
        "dense_mlp": n_dense * mlp(s.intermediate_size),
        "router": n_moe * s.num_experts * h,
        "routed_experts": n_moe * s.num_experts * s.expert_params,
        "shared_experts": n_moe * (mlp(shared_width) + (h if s.shared_expert_gate else 0)),
        "head": 0 if s.tie_word_embeddings else s.vocab_size * h,
    }
    out["attention"] = s.params - sum(out.values())
    return out


def active_params(model: "ModelSpec | str") -> int:
    """Parameters one token's forward uses (`ModelSpec.active_params`): all but the routed experts,
    plus num_experts_per_tok of them in each MoE layer. Embedding and head count whole, as the
    models' authors count: Mixtral-8x7B 12.9B of 46.7B, DeepSeek-V3 37.6B of 671B."""
    return _specs.resolve(model, moe=True).active_params


def kv_cache_elements_per_token(model: "ModelSpec | str", layout: str = "transformers") -> int:
    """Numbers the KV cache holds per token, all layers together, in the named layout (KV_LAYOUTS)."""
    s = _specs.resolve(model, moe=True)
    _checks.one_of("layout", layout, KV_LAYOUTS)
    if not s.is_causal_lm:
        raise ValueError(f"{s.name} is a {s.model_type} model; this counts a decoder-only model's cache "
                         f"(memory.kv_cache_bytes prices T5's)")
    if not s.is_mla:
        if layout == "latent":
            raise ValueError(f"layout 'latent' is multi-head latent attention's (DeepSeek); {s.name} caches "
                             f"K and V of its {s.num_kv_heads} kv heads: use 'transformers'")
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim
    if layout == "expanded":
        return s.num_layers * s.num_heads * (s.head_dim + s.v_head_dim)
    return s.num_layers * (s.kv_lora_rank + s.qk_rope_head_dim)


def kv_cache_bytes(model: "ModelSpec | str", *, batch_size: int, seq_len: int, dtype: str = "bf16",
                   layout: str = "transformers") -> int:
    """The KV cache of batch_size sequences of seq_len tokens: elements per token (in `layout`) x
    tokens x bytes. Full attention is assumed (a sliding-window config caches at most its window).
    DeepSeek-V3 in bf16: 70,272 bytes a token as a latent, 4,997,120 expanded (71x)."""
    s = _specs.resolve(model, moe=True)
    batch_size = _checks.whole("batch_size", batch_size)
    seq_len = _checks.positions(s, _checks.whole("seq_len", seq_len))
    _checks.one_of("dtype", dtype, tuple(DTYPE_BYTES))
    return kv_cache_elements_per_token(s, layout) * DTYPE_BYTES[dtype] * batch_size * seq_len


MAX_CAPACITY_FACTOR = 1 << 10


def expert_capacity(tokens: int, num_experts: int, top_k: int = 1, capacity_factor: float | None = 1.0, *,
                    min_capacity: int = 0) -> int:
    """Rows each expert's buffer holds when routing has a capacity (GShard, Switch; DeepSpeed's and
    Megatron-Core's token-drop mode): ceil(capacity_factor x tokens x top_k / num_experts), at least
    `min_capacity`, at most tokens (an expert sees each token at most once). Beyond it a token's
    choice is dropped (it skips that expert through the residual). capacity_factor None is dropless
    routing (transformers, Megatron's default): an expert may receive every token, so its worst case
    is `tokens`; what it receives on average is tokens x top_k / num_experts."""
    t = _checks.whole("tokens", tokens)
    n = _checks.whole("num_experts", num_experts)
    k = _checks.whole("top_k", top_k, hi=n)
    m = _checks.whole("min_capacity", min_capacity, lo=0)
    if capacity_factor is None:
        return t
    cf = _checks.number("capacity_factor", capacity_factor, lo=0, lo_open=True, hi=MAX_CAPACITY_FACTOR)
    # exact for the factor as written (0.16, not its binary neighbour): a fraction, ceil of an integer division
    from fractions import Fraction
    need = Fraction(repr(cf)) * t * k
    return min(t, max(m, -(-need.numerator // (need.denominator * n))))


def describe(model: "ModelSpec | str") -> str:
    """A few lines for a person: total and active parameters, where they sit, the KV cache per token."""
    s = _specs.resolve(model, moe=True)
    parts = param_breakdown(s)
    lines = [f"{s.name} ({s.model_type}): {s.params:,} parameters, {s.active_params:,} active per token "
             f"({s.num_experts_per_tok} of {s.num_experts} routed experts in {len(s.moe_layer_ids)} of "
             f"{s.num_layers} layers" + (f", {s.num_shared_experts} shared" if s.num_shared_experts else "") + ")"]
    lines += [f"  {k:<15} {v:>18,}" for k, v in parts.items() if v]
    layouts = ("transformers", "latent", "expanded") if s.is_mla else ("transformers",)
    for layout in layouts:
        per_token = kv_cache_bytes(s, batch_size=1, seq_len=1, layout=layout)
        lines.append(f"  KV cache per token ({layout}, bf16): {fmt_bytes(per_token)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- inference transients
# What routing weights transformers (5.x) hands the experts in, per family: Mixtral's and DeepSeek's
# routers keep them in fp32 (so each expert's weighted output is fp32 too); Qwen's and OLMoE's cast
# them to the model's dtype.
_FP32_ROUTING = ("mixtral", "deepseek_v2", "deepseek_v3")


def _routed_phases(s: ModelSpec, tokens: int, e: int) -> dict[str, int]:
    """Bytes one MoE layer's router and routed experts hold at once beyond the residual stream, by
    phase, as transformers' default experts implementation ("grouped_mm",
    integrations/moe.py::grouped_mm_experts_forward) runs them: every token is copied once per
    chosen expert (S = tokens x top-k rows), sorted by expert, through one grouped matmul for
    gate and up and one for down, weighted, put back in token order, and summed over its k rows."""
    h, n_exp, k, i = s.hidden_size, s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size
    w = 4 if s.model_type in _FP32_ROUTING else e  # the routing weights' bytes
    ew = max(e, w)  # the weighted outputs' (bf16 x fp32 -> fp32)
    rows = tokens * k
    if s.model_type in ("deepseek_v2", "deepseek_v3"):  # the router upcasts its input and logits
        router = tokens * (4 * h + 3 * 4 * n_exp)  # fp32 input, logits, scores (and V3's corrected scores)
    else:
        router = tokens * (n_exp * (e + 4))  # logits, their fp32 softmax
    chosen = rows * (w + 8)  # top-k weights and indices
    # sorted expert ids and the permutation (int64), the gathered weights, each row's token copy
    kept = chosen + rows * (8 + 8 + w + h * e)
    return {
        "router": chosen + router,
        "experts: gate and up": kept + rows * 4 * i * e,  # gate_up (2i), act(gate), act(gate) * up
        "experts: down and weights": kept + rows * (h * e + 2 * h * ew + 16),  # down, weighted, reordered
    }


def prefill_block_bytes(model: "ModelSpec | str", *, tokens: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes an MoE model's last decoder layer holds at once in a prefill of `tokens` tokens, beyond
    the weights and the KV cache, by phase (the largest is the layer's peak). The residual stream is
    four copies of the hidden state: the embeddings (kept by the model's forward), the layer's
    input, the residual after attention and its normalised copy. Attention is counted as SDPA on
    CUDA (no score matrix); the shared experts run before the routed ones in Qwen2-MoE (their output
    waits) and after them in DeepSeek (the routed output waits). Traced in transformers 5.x."""
    s = _specs.resolve(model, moe=True)
    if not s.is_moe:
        raise ValueError(f"{s.name} is a dense {s.model_type} model: memory.estimate_inference prices its blocks")
    t = _checks.whole("tokens", tokens)
    e = _checks.whole("dtype_bytes", dtype_bytes)
    h = s.hidden_size
    a = s.num_heads
    if s.is_mla:
        rope, nope, v = s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim
        q = (2 * s.q_lora_rank if s.q_lora_rank else 0) + 3 * a * s.head_dim  # q (its lora), rotated, whole
        kv = s.kv_lora_rank + rope + a * rope + a * (nope + v) + a * s.head_dim  # latent, keys built per head
        attention = t * (q + kv + a * v) * e
    else:
        attention = t * (2 * s.q_dim + 2 * s.kv_dim + s.q_dim) * e  # q, k, v, rotated q, k, output
    stream = 4 * t * h * e
    phases = {"attention": 3 * t * h * e + attention}
    shared_width = s.num_shared_experts * (s.shared_expert_intermediate_size or s.moe_intermediate_size)
    routed = _routed_phases(s, t, e)
    before = after = 0
    if shared_width and s.model_type == "qwen2_moe":
        phases["shared expert"] = stream + 3 * t * shared_width * e  # act(gate), up, their product
        before = t * h * e
    elif shared_width:
        after = t * h * e
        phases["shared experts"] = stream + after + 3 * t * shared_width * e
    for name, b in routed.items():
        phases[name] = stream + before + b
    return phases


# ----------------------------------------------------------------------------- training ledger
# What one MoE layer's MLP (router, routed experts, shared experts) saves for backward in a training
# step, tensor by tensor, derived op by op from transformers 5.23's modeling files (the families'
# TopKRouter and SparseMoeBlock) and integrations/moe.py::grouped_mm_experts_forward (the default
# experts implementation). Kinds follow `precision.dtype_sizes`: "x" the residual stream's and the
# weights' dtype (fp32 under AMP), "half" the compute dtype, "f32", "i64".
#
# Dropless (capacity_factor None, transformers): every token is copied once per chosen expert,
# S = tokens x top-k rows. grouped_mm is not autocast-enabled: it casts its input to the weights'
# dtype, so under AMP the experts run (and save) in fp32 and autocast caches no expert weight.
# Capacity (a float, GShard/Switch drop-and-pad as DeepSpeed's sharded_moe.py and Megatron-Core's
# drop-and-pad mode run it): each expert a buffer of C = expert_capacity(...) rows, padded; the
# experts run as batched matmuls (autocast: 16-bit, the expert weights' casts cached) over E x C rows.
# `vramlab.measure.moe.DropAndPadExperts` is that layer in torch.

# families whose router renormalises the top-k weights (transformers' config defaults: Mixtral
# always; norm_topk_prob defaults to False in Qwen2-MoE, Qwen3-MoE and OLMoE configs)
_NORM_TOPK = ("mixtral",)
TRAINING_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")


def check_trainable(s: ModelSpec, capacity_factor: "float | None" = None) -> "float | None":
    """One line where the training ledger cannot price `s`: a mixture-of-experts family outside
    TRAINING_FAMILIES (every MoE family `specs` knows is in it today), or a capacity_factor for a dense
    model. Returns the checked capacity_factor (None: dropless)."""
    if capacity_factor is not None:
        if not s.is_moe:
            raise ValueError(f"capacity_factor applies to a mixture of experts; {s.name} is a dense "
                             f"{s.model_type} model: leave it None")
        capacity_factor = _checks.number("capacity_factor", capacity_factor, lo=0, lo_open=True,
                                         hi=MAX_CAPACITY_FACTOR)
    if s.is_moe and s.model_type not in TRAINING_FAMILIES:
        raise ValueError(f"{s.name}: {s.model_type} training memory is not modelled yet; modelled: "
                         f"{', '.join(TRAINING_FAMILIES)}")
    return capacity_factor


def _gated_mlp_saved(width: int, *, tokens: int, nb: dict[str, int], name: str) -> dict[str, int]:
    """A gated MLP down(act(gate(x)) * up(x)) after its input: act's input (gate), act(gate) and up,
    the down projection's input; `width` each, in the compute dtype."""
    return {f"{name}: gate (act input), act(gate), up, down input": tokens * 4 * width * nb["half"]}


def _layer_args(model, layer, tokens, precision, device, capacity_factor):
    """The checked arguments of the per-layer training functions: (spec, capacity_factor, layer, tokens, bytes
    per kind)."""
    from .precision import PRECISIONS, dtype_sizes

    s = _specs.resolve(model, moe=True)
    capacity_factor = check_trainable(s, capacity_factor)
    layer = _checks.whole("layer", layer, lo=0, hi=max(s.num_layers - 1, 0))
    T = _checks.whole("tokens", tokens)
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    return s, capacity_factor, layer, T, dtype_sizes(precision, device)


def training_layer_saved(model: "ModelSpec | str", *, layer: int, tokens: int, precision: str = "fp32",
                         device: str = "cuda", capacity_factor: "float | None" = None) -> dict[str, int]:
    """Bytes the MLP part of decoder layer `layer` saves for backward over `tokens` tokens, by tensor
    (the attention part and the two norms are `activations.layer_saved`'s). A dense layer (DeepSeek's
    first layers, Qwen's mlp_only_layers) saves its gated MLP; an MoE layer its router (input,
    fp32 softmax, top-k indices, Mixtral's renormalisation), its routed experts (dropless:
    `capacity_factor` None; else drop-and-pad buffers of `expert_capacity` rows per expert) and its
    shared experts (Qwen2-MoE: a gated MLP and a sigmoid gate). Integer bytes.

    DeepSeek-V2 (transformers' DeepseekV2TopkRouter): an fp32 softmax, then top-k ("greedy") or, with
    n_group > 1, "group_limited_greedy" (each group's max, the top topk_group groups, the other groups'
    experts masked to 0 before the top-k); routed_scaling_factor multiplies by a number (nothing saved),
    no renormalisation; the weights stay fp32. DeepSeek-V3: sigmoid scores, group top-2 sums, renormalised.

    Validated against trace-mode steps of the transformers models (tests/test_moe_training.py: the
    activations within 0.3 % in fp32 and bf16-mixed, all six families, dropless and capacity 1.0/1.25;
    DeepSeek-V2 greedy and group-limited, top-3 and top-6, within 0.15 %).

    Known limitations: the load-balancing loss is left out: transformers 5.23 computes it only with
    config.output_router_logits (False in every family's config; DeepSeek has none), layer by layer
    (`load_balancing_loss_func`: each layer's softmax, T x E, and its top-k indices saved: T x (4E + 8k)
    bytes per MoE layer, < 0.1 % of a layer's activations for the presets). Where the step's peak
    falls inside the last block's backward (small vocabularies) the estimate keeps every saved tensor
    of that block while its gradients flow, as for dense blocks: up to ~5 % over the trace there.
    Pure bf16: the Llama twin's norms keep their 2-byte inputs, not the fp32 copies transformers makes;
    for DeepSeek (MLA) `activations` adds those copies ((2L + 1) x tokens x h x 2 bytes: V2 within 1 % of
    the trace, tests/test_moe_training.py); for the other families they are left out (Mixtral within 1 %)."""
    s, capacity_factor, li, T, nb = _layer_args(model, layer, tokens, precision, device, capacity_factor)
    h = s.hidden_size
    amp = precision in ("bf16-mixed", "fp16-mixed")  # autocast casts each linear's input
    if not s.is_moe or li not in s.moe_layer_ids:
        out = {"mlp input": T * h * (2 * nb["half"] if amp else nb["x"])}  # gate and up cast their own copies
        out.update(_gated_mlp_saved(s.intermediate_size, tokens=T, nb=nb, name="dense MLP"))
        return out
    E, k, i = s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size
    w = 4 if s.model_type in _FP32_ROUTING else nb["half"]  # routing weights: fp32, or the logits' dtype
    shared = s.num_shared_experts * (s.shared_expert_intermediate_size or s.moe_intermediate_size)
    # the post-attention norm's output, read by the router and the shared experts: one fp32 tensor
    # without autocast; under autocast each linear saves its own 16-bit cast
    readers = 1 + (2 + (1 if s.shared_expert_gate else 0) if shared else 0)
    out = {"router and shared experts' input": T * h * (readers * nb["half"] if amp else nb["x"]),
           "router softmax (fp32)": T * E * 4,
           "top-k indices": T * k * 8}
    G, tg = s.num_expert_groups, s.topk_expert_groups
    if s.model_type in ("deepseek_v2", "deepseek_v3") and precision in ("bf16", "fp16"):
        # the router runs in fp32 (`F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))`):
        # under pure 16 bits a copy of its input and of its weight, which the linear saves (E x h: 0.1 % of it)
        out["router's fp32 copies of its input and weight (pure 16-bit)"] = (T + E) * h * 4
    if s.model_type == "deepseek_v3":
        # sigmoid scores (not softmax); the group-limited choice: each group's top-2 and the top groups'
        # indices, the mask of allowed experts; norm_topk_prob (True by default): the sum and the weights
        del out["router softmax (fp32)"]
        out["router sigmoid (fp32)"] = T * E * 4
        out["group top-2 and top-group indices, expert mask"] = T * (G * 2 * 8 + tg * 8 + E)
        out["top-k weights and their sum (renormalised)"] = T * (k + 1) * 4
    elif s.model_type == "deepseek_v2" and G > 1:
        # topk_method "group_limited_greedy" (transformers' DeepseekV2TopkRouter): each group's max
        # (its argmax saved, G int64), the top groups' indices (topk_group int64), the bool mask of the
        # experts outside them (masked_fill); "greedy" (n_group 1) is the plain softmax top-k above.
        # routed_scaling_factor multiplies by a Python number: nothing saved; no renormalisation
        out["group max and top-group indices, expert mask"] = T * (G * 8 + tg * 8 + E)
    if s.model_type in _NORM_TOPK:
        out["top-k weights and their sum (renormalised)"] = T * (k + 1) * 4
    if capacity_factor is None:
        S = T * k
        # int64 indices saved by the gathers: perm // k (each row's token), perm, the inverse permutation.
        # DeepSeek-V3's traces hold two of the three (measured in trace mode; why is not traced yet); V2's all three
        n_idx = 2 if s.model_type == "deepseek_v3" else 3
        out.update({
            "permutation, token of each row, inverse permutation (int64)": n_idx * S * 8,
            "each row's token copy (grouped gate_up input)": S * h * nb["x"],
            "grouped gate_up output (act input, up), act(gate), down input": S * 4 * i * nb["x"],
            "down output and sorted routing weights (weighting)": S * (h * nb["x"] + w),
        })
    else:
        C = expert_capacity(T, E, k, capacity_factor)
        out.update({
            "token of each buffer slot (int64)": E * C * 8,
            "expert buffers (E x C x h, bmm input)": E * C * h * nb["half"],
            "buffers' gate_up output, act(gate), down input": E * C * 4 * i * nb["half"],
            "slot of each choice (int64)": T * k * 8,
            "gathered expert outputs and routing weights (weighting)": T * k * (h * nb["half"] + w),
        })
    if shared:
        out.update(_gated_mlp_saved(shared, tokens=T, nb=nb, name="shared experts"))
        if s.shared_expert_gate:  # sigmoid(Linear(h, 1)) * shared_out: the sigmoid's output and shared_out
            out["shared gate's sigmoid and the shared output"] = T * (nb["half"] + h * nb["half"])
    return out


def mla_attention_saved(model: "ModelSpec | str", *, tokens: int, precision: str = "fp32",
                        device: str = "cuda") -> dict[str, int]:
    """Bytes DeepSeek's multi-head latent attention saves for backward over `tokens` tokens, by
    tensor, between its two norms (transformers 5.23 `DeepseekV2Attention` and `DeepseekV3Attention`
    with SDPA's fused kernel):
    the projections' input; q's low-rank path (q_a's output and its RMSNorm); kv_a's output (the latent
    and the shared rotary key) and its RMSNorm; kv_b's input; q and k (heads x qk_head_dim, made by
    torch.cat and a copy), kv_b's output (the values' storage, heads x (nope + v)); the log-sum-exp,
    the output and o_proj's contiguous input (heads x v). Under autocast the norms' inputs are fp32
    copies and each linear saves its own 16-bit cast.

    The rotary part saves nothing per layer in either: V3's cos/sin products save the model's shared
    cos and sin; V2's complex rotation (`apply_rotary_emb`: `view_as_complex` of q_pe and k_pe, times
    the polar `freqs_cis`) saves only `freqs_cis` (the model's, s x rope/2 complex64, once), and its fp32
    upcasts of q_pe/k_pe under 16 bits are temporaries (traced: the same saved tensors as V3's).

    Known limitations: SDPA's fused kernel assumed (CPU flash takes only equal q/k and v head widths;
    a CPU trace of v_head_dim != head_dim runs the math path and saves the scores)."""
    from .precision import PRECISIONS, dtype_sizes
    s = _specs.resolve(model, moe=True)
    if not s.is_mla:
        raise ValueError(f"{s.name} has no multi-head latent attention (kv_lora_rank 0)")
    T = _checks.whole("tokens", tokens)
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    nb = dtype_sizes(precision, device)
    half, amp = nb["half"], precision in ("bf16-mixed", "fp16-mixed")
    h, a, r, rope = s.hidden_size, s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim
    nope, v, qk = s.head_dim - rope, s.v_head_dim, s.head_dim
    fp32 = precision == "fp32"

    def norm(width: int, kept_input: int) -> int:  # RMSNorm: input (its fp32 copy), normalized, rsqrt; next linear's input
        return T * (kept_input * 4 + width * half + 4 + width * half)

    out = {"q / kv_a projections' input": T * h * (2 * half if amp else nb["x"])}
    if s.q_lora_rank:
        out["q_a output, q_a_layernorm, q_b input"] = norm(s.q_lora_rank, s.q_lora_rank)
    # in fp32 the norm keeps kv_a's whole output (its input is a view of it); else a fp32 copy of the latent
    out["kv_a output (latent, rotary key), kv_a_layernorm, kv_b input"] = norm(r, r + rope if fp32 else r)
    out["q, k (torch.cat / copy), kv_b output (v's storage)"] = T * a * (2 * qk + nope + v) * half
    out["attention output, o_proj input, log-sum-exp"] = T * a * (2 * v * half + 4)
    return out


def training_block_bytes(model: "ModelSpec | str", *, layer: int, tokens: int, precision: str = "fp32",
                         device: str = "cuda", capacity_factor: "float | None" = None) -> int:
    """The most the MLP part of layer `layer` holds at once in its backward beyond what it saved,
    the larger of two phases: the experts' own (the gradients of their widest intermediates: the
    gated MLP's backward holds three row x width tensors at once on CUDA, two on the CPU, as
    `activations` models dense blocks, over the routed rows, S = tokens x top-k dropless or E x C
    buffers with a capacity, plus the gradient of the rows' token copies, rows x h), and the routing
    weights' product's, before it (3 x tokens x top-k x h in the weighted output's dtype, fp32 where
    the weights are: the larger one where the experts are narrower than the model, DeepSeek-V2-Lite's
    1408 < 2048 in pure bf16). DeepSeek's shared experts, added last, run their backward first and free
    what they saved before the routed experts' begins. Traced on DeepSeek-V2 top-6 (full recompute:
    a recomputed block's backward is the step's peak; pure bf16 within 1 % of the trace, where the
    experts' phase alone left it 15 % under).

    Known limitations: in that regime under fp32 and bf16-mixed the step estimate is 3-4 % over the
    trace, from the recompute walk (`memory.estimate_training`), not this ledger: it counts the
    blocks' gradients made so far as equal shares of all blocks' (dense first layers are smaller than
    MoE ones: +1.1 % there) and ~1.8 % more activations alive than traced."""
    s, capacity_factor, layer, T, nb = _layer_args(model, layer, tokens, precision, device, capacity_factor)
    n = 3 if device == "cuda" else 2
    if not s.is_moe or layer not in s.moe_layer_ids:
        return n * T * s.intermediate_size * nb["half"]
    E, k, i, h = s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size, s.hidden_size
    if capacity_factor is None:
        rows, e = T * k, nb["x"]
    else:
        rows, e = E * expert_capacity(T, E, k, capacity_factor), nb["half"]
    width = n * rows * i * e + rows * h * e
    # the weighting's backward, before the experts' (traced: DeepSeek-V2 top-6, pure bf16): the rows'
    # gradient (T*k x h, in the weighted output's dtype: fp32 where the routing weights are) is a copy of
    # the summed expand, then put back in expert order (index's backward: zeros and index_put, out of
    # place) and multiplied by the weights and by the experts' outputs: three rows x h tensors at once
    w = 4 if s.model_type in _FP32_ROUTING else nb["half"]
    weighting = 3 * T * k * h * max(e, w)
    shared = s.num_shared_experts * (s.shared_expert_intermediate_size or s.moe_intermediate_size)
    if shared and s.model_type in ("deepseek_v2", "deepseek_v3"):
        # DeepSeek adds the shared experts' output after the routed one: their backward runs first (its
        # own widths' gradients, everything still saved) and frees what they saved before the routed
        # experts' backward begins (traced: the block's activations fall by that much first)
        freed = sum(_gated_mlp_saved(shared, tokens=T, nb=nb, name="shared").values())
        return max(n * T * shared * nb["half"], width - freed, weighting - freed)
    return max(width, weighting)


__all__ = ["DTYPE_BYTES", "KV_LAYOUTS", "MAX_CAPACITY_FACTOR", "active_params", "describe", "expert_capacity", "kv_cache_bytes", "kv_cache_elements_per_token",
           "param_breakdown", "prefill_block_bytes",
           "TRAINING_FAMILIES", "check_trainable", "training_layer_saved", "training_block_bytes",
           "mla_attention_saved"]
