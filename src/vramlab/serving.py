"""Serving: how an inference engine spends the GPU -- a paged KV cache, its pool, and how many
sequences fit at once. Pure Python: no torch import.

A paged KV cache (vLLM, Kwon+23, arXiv:2309.06180) stores each sequence's keys and values in
fixed-size *blocks* of `block_size` tokens; a sequence of n tokens holds ceil(n / block_size)
blocks, and its last block wastes `blocks x block_size - n` token slots. One block id covers every
layer: a block of a full-attention model is block_size x (K and V of every layer) bytes.

The pool (vLLM v1, `vllm/v1/worker/gpu_worker.py` `Worker.determine_available_memory`):

    available = gpu_memory_utilization x total - weights - the profile run's activation peak
                - non-torch memory (CUDA context, NCCL, cuBLAS) [- CUDA graphs, where estimated]
    num_blocks = available // bytes_per_block            (`vllm/v1/core/kv_cache_utils.py`)
    max concurrency = num_blocks / cdiv(max_model_len, block_size)

the last being the figure vLLM logs at start-up, "Maximum concurrency for N tokens per request:
X.XXx" (`kv_cache_utils.get_max_concurrency_for_kv_cache_config`: per-request blocks are
cdiv(spec.max_memory_usage_bytes, page_size_bytes) summed over KV-cache groups; a sliding-window
group needs cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1 blocks,
`kv_cache_interface.SlidingWindowSpec`).

transformers 5.x's continuous batching (`generation/continuous_batching/cache.py`,
`PagedAttentionCache`) pages the same way but groups its blocks into *sectors* of
lcm(bytes of each attention type's block, 128) bytes and allocates two never-used trash sectors in
front of the pool: `transformers_pool` (a num_blocks budget) and `transformers_pool_from_memory`
(a memory budget, with its activation/IO/attention-mask reserve) reproduce that arithmetic
exactly, and `vramlab.measure.serving` checks both against the cache's real tensor storage, with
the requests it admits and the blocks prefix sharing saves.

KV dtypes and the scales kept (`KV_DTYPES`):
  fp32/bf16/fp16: no scale.
  fp8 (e4m3/e5m2): one byte an element; vLLM keeps a per-tensor k_scale and v_scale per layer as
      attributes of the attention layer, outside the block pool: nothing is added per block.
  int8: one byte an element plus a float32 scale per token and kv head for K and for V, as
      vLLM's per-token-head KV quantization reserves in the page
      (`AttentionSpec.page_size_bytes`: 2 x block_size x num_kv_heads x scale bytes per layer).

Known limitations: the activation peak of the profile run and the CUDA-graph reserve are inputs
(vLLM measures them); vLLM's hybrid (sliding + full) grouping is modelled with groups of
min(full, sliding) layers, as `_get_kv_cache_groups_uniform_page_size` forms them when the counts
divide; LoRA and multimodal caches are not modelled here; speculative decoding's draft model as
`serving_plan` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import checks as _checks
from . import moe as _moe
from . import specs as _specs
from .specs import GPUSpec, ModelSpec

# bytes of one cached element, and of the scales kept beside an int8 cache (see the module docstring)
KV_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
WEIGHT_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
INT8_SCALE_BYTES = 4  # float32 scale per (token, kv head) for K and for V
TRANSFORMERS_PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size default (transformers 5.23)
SECTOR_ALIGNMENT = 128  # bytes: cache.py, lcm(..., 128)
TRASH_SECTORS = 2  # cache.py: two never-allocated sectors before the data sectors


def _model(model) -> ModelSpec:
    s = _specs.resolve(model, moe=True)
    if not s.is_causal_lm:
        raise ValueError(f"{s.name} is a {s.model_type} model; serving is modelled for decoder-only models")
    return s


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_kv(dtype: str) -> str:
    """The KV cache's dtype when none is given: the model's, or bf16 under 8-bit weights (vLLM's "auto")."""
    return dtype if dtype in ("fp32", "bf16", "fp16") else "bf16"


@dataclass(frozen=True, kw_only=True)
class KVBlock:
    """One paged KV-cache block: block_size tokens of every layer. Sizes in bytes.

    page_bytes: one layer's page (K and V, or MLA's latent, for block_size tokens; an int8 cache's
    scales included). full_layers + sliding_layers = the model's layers; sliding layers keep at most
    sliding_window tokens."""

    model: str
    block_size: int  # tokens
    kv_dtype: str
    page_bytes: int  # one layer, block_size tokens
    scale_bytes: int  # of page_bytes: the int8 scales (0 otherwise)
    full_layers: int
    sliding_layers: int
    sliding_window: int | None  # tokens

    @property
    def bytes_per_block(self) -> int:
        """A block of every layer: what one block id costs in a pool of one layer group (vLLM's
        uniform case, transformers' num_blocks unit)."""
        return self.page_bytes * (self.full_layers + self.sliding_layers)

    @property
    def bytes_per_token(self) -> int:
        """All layers' cache for one token (full attention)."""
        return self.bytes_per_block // self.block_size

    def blocks_per_sequence(self, tokens: int) -> int:
        """Blocks one sequence of `tokens` holds in its full-attention layers: ceil(tokens /
        block_size) (sliding layers: `pages_per_sequence`)."""
        return self.pages_per_sequence(tokens)[0]

    def pages_per_sequence(self, tokens: int) -> tuple[int, int]:
        """(pages per full-attention layer, pages per sliding layer) for a sequence of `tokens`."""
        tokens = _checks.whole("tokens", tokens)
        full = _cdiv(tokens, self.block_size)
        sliding = _cdiv(min(tokens, self.sliding_window), self.block_size) if self.sliding_window else full
        return full, sliding

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes a sequence of `tokens` holds in the pool (whole pages, all layers)."""
        full, sliding = self.pages_per_sequence(tokens)
        return self.page_bytes * (full * self.full_layers + sliding * self.sliding_layers)

    def last_block_waste(self, tokens: int) -> int:
        """Token slots left empty in the sequence's last full-attention block."""
        return self.pages_per_sequence(tokens)[0] * self.block_size - tokens


def kv_block(model: "ModelSpec | str", *, block_size: int = 16, kv_dtype: str = "bf16",
             sliding_window: int | None = None, sliding_layers: int | None = None, tp: int = 1,
             layout: str = "transformers") -> KVBlock:
    """The paged KV block of `model`: bytes of one layer's page of `block_size` tokens.

    Per token and layer: K and V of num_kv_heads x head_dim (GQA/MQA: only the kv heads; vLLM and
    transformers both store them unrepeated), or MLA's latent kv_lora_rank + qk_rope_head_dim
    (`moe.kv_cache_elements_per_token`; `layout` as there). `tp` splits the kv heads over tensor-
    parallel ranks (one rank's page; MQA's single head is replicated). `sliding_window`: tokens a
    sliding layer keeps; `sliding_layers`: how many layers slide (default: all, as transformers
    assumes for a config with a sliding_window and no layer_types)."""
    s = _model(model)
    block_size = _checks.whole("block_size", block_size, hi=1 << 20)
    _checks.one_of("kv_dtype", kv_dtype, tuple(KV_DTYPES))
    tp = _checks.whole("tp", tp, hi=1 << 16)
    L = s.num_layers
    if sliding_window is not None:
        sliding_window = _checks.whole("sliding_window", sliding_window)
        sliding_layers = L if sliding_layers is None else _checks.whole("sliding_layers", sliding_layers, lo=0, hi=L)
    elif sliding_layers:
        raise ValueError("sliding_layers needs a sliding_window (tokens a sliding layer keeps)")
    else:
        sliding_layers = 0
    per_layer = _moe.kv_cache_elements_per_token(s, layout) // L  # elements per token and layer
    heads = 1 if (s.is_mla and layout != "expanded") else s.num_kv_heads
    if tp > 1 and heads > 1:  # vLLM: each rank holds num_kv_heads // tp heads, or one replicated head
        if heads % tp and tp % heads:
            raise ValueError(f"tp={tp} must divide the {heads} kv heads of {s.name} or be a multiple of them")
        per_layer = per_layer * max(1, heads // tp) // heads
        heads = max(1, heads // tp)
    tensors = 1 if (s.is_mla and layout != "expanded") else 2  # K and V, or one latent
    scale = tensors * heads * INT8_SCALE_BYTES * block_size if kv_dtype == "int8" else 0
    page = per_layer * KV_DTYPES[kv_dtype] * block_size + scale
    return KVBlock(model=s.name, block_size=block_size, kv_dtype=kv_dtype, page_bytes=page, scale_bytes=scale,
                   full_layers=L - sliding_layers, sliding_layers=sliding_layers, sliding_window=sliding_window)


def available_kv_bytes(gpu: "GPUSpec | str", *, weights_bytes: int, gpu_memory_utilization: float = 0.9,
                       activation_peak_bytes: int = 0, cuda_graph_bytes: int = 0,
                       non_torch_bytes: int | None = None) -> int:
    """Bytes left for the KV cache, as vLLM v1 sizes them (`gpu_worker.determine_available_memory`):
    gpu_memory_utilization x total (cudaMemGetInfo's total: `GPUSpec.usable_bytes`) less the weights,
    the profile run's activation peak (torch's peak increase over the weights), the memory outside
    torch's allocator (CUDA context, cuBLAS/NCCL: default `GPUSpec.context_bytes`) and the CUDA
    graphs' reserve. Raises when nothing is left (vLLM: "No available memory for the cache blocks")."""
    g = _specs.gpu(gpu)
    u = _checks.fraction("gpu_memory_utilization", gpu_memory_utilization)
    w = _checks.whole("weights_bytes", weights_bytes, lo=0, hi=_checks.MAX_BYTES)
    a = _checks.whole("activation_peak_bytes", activation_peak_bytes, lo=0, hi=_checks.MAX_BYTES)
    c = _checks.whole("cuda_graph_bytes", cuda_graph_bytes, lo=0, hi=_checks.MAX_BYTES)
    n = g.context_bytes if non_torch_bytes is None else _checks.whole("non_torch_bytes", non_torch_bytes, lo=0,
                                                                      hi=_checks.MAX_BYTES)
    left = int(g.usable_bytes * u) - w - a - c - n
    if left <= 0:
        raise ValueError(f"no memory left for the KV cache on {g.name}: {u:g} x {g.usable_bytes:,} B - weights "
                         f"{w:,} - activations {a:,} - CUDA graphs {c:,} - non-torch {n:,} = {left:,} B; raise "
                         f"gpu_memory_utilization, quantize the weights or use more GPUs")
    return left


@dataclass(frozen=True, kw_only=True)
class ServingPlan:
    """What a paged-KV engine (vLLM's accounting) fits on one GPU. Bytes are integers."""

    model: str
    gpu: str
    block: KVBlock
    weights_bytes: int
    available_kv_bytes: int  # the pool: see available_kv_bytes
    num_blocks: int  # available // (bytes per block id)
    tokens_per_request: int  # prompt + output (vLLM's max_model_len in its log line)
    blocks_per_request: int  # block ids one request at that length holds (all KV groups)
    last_block_waste: int  # token slots empty in its last full-attention block
    max_concurrency: float  # num_blocks / blocks_per_request: vLLM's "Maximum concurrency ... X.XXx"
    shared_prefix_blocks: int  # full blocks of the prefix common to all requests, held once
    max_requests: int  # whole requests (of n_samples sequences each) that fit with the sharing asked for
    max_sequences: int  # max_requests x n_samples
    draft_model: str | None = None  # speculative decoding's draft (None: no speculation)
    draft_weights_bytes: int = 0  # the draft's weights, beside the target's
    draft_page_bytes: int = 0  # the draft's KV bytes in every block id (its layers, block_size tokens)
    verify_logits_bytes: int = 0  # the verify pass's fp32 logits: max_num_seqs x (k + 1) rows of the vocabulary

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "block"}
        out.update(bytes_per_block=self.block.bytes_per_block, page_bytes=self.block.page_bytes,
                   block_size=self.block.block_size, kv_dtype=self.block.kv_dtype)
        return out

    def log_line(self) -> str:
        """vLLM's start-up line for this plan."""
        return (f"Maximum concurrency for {self.tokens_per_request:,} tokens per request: "
                f"{self.max_concurrency:.2f}x")


def _vllm_groups(block: KVBlock) -> tuple[int, list[int]]:
    """vLLM's KV-cache groups: (layers per group, the sizes' list of one entry per group's type)
    -- a uniform model is one group of every layer; a hybrid one is split into groups of
    min(full, sliding) layers of one type each (kv_cache_utils._get_kv_cache_groups_uniform_page_size)."""
    if not block.sliding_layers or not block.full_layers:
        return block.full_layers + block.sliding_layers, [1 if block.sliding_layers else 0]
    g = min(block.full_layers, block.sliding_layers)
    return g, [0] * _cdiv(block.full_layers, g) + [1] * _cdiv(block.sliding_layers, g)


def vllm_blocks_per_request(block: KVBlock, tokens: int, *, max_num_batched_tokens: int = 8192) -> int:
    """Block ids one request of `tokens` (vLLM's max_model_len) needs, summed over KV groups: a full
    group cdiv(tokens, block_size); a sliding group cdiv(min(window - 1 + max_num_batched_tokens,
    tokens), block_size) + 1 (`SlidingWindowSpec.max_memory_usage_bytes`)."""
    tokens = _checks.whole("tokens", tokens)
    m = _checks.whole("max_num_batched_tokens", max_num_batched_tokens)
    full = _cdiv(tokens, block.block_size)
    slide = _cdiv(min(block.sliding_window - 1 + m, tokens), block.block_size) + 1 if block.sliding_window else full
    _, kinds = _vllm_groups(block)
    return sum(slide if k else full for k in kinds)


def serving_plan(model: "ModelSpec | str", *, gpu: "GPUSpec | str" = "h100", prompt_len: int, output_len: int,
                 gpu_memory_utilization: float = 0.9, dtype: str = "bf16", kv_dtype: str | None = None,
                 block_size: int = 16, sliding_window: int | None = None, sliding_layers: int | None = None,
                 tp: int = 1, activation_peak_bytes: int = 0, cuda_graph_bytes: int = 0,
                 non_torch_bytes: int | None = None, shared_prefix_len: int = 0, n_samples: int = 1,
                 max_num_batched_tokens: int = 8192, draft_model: "ModelSpec | str | None" = None,
                 num_speculative_tokens: int = 0, max_num_seqs: int = 256) -> ServingPlan:
    """How many requests of prompt_len + output_len tokens a paged-KV engine serves at once.

    Weights: params x bytes of `dtype` (split over `tp`). The pool: `available_kv_bytes`. Blocks:
    num_blocks = pool // (page_bytes x layers per KV group). max_concurrency: vLLM's logged figure,
    num_blocks / blocks one request of prompt_len + output_len holds (its max_model_len).
    max_requests counts whole requests with sharing: a prefix of shared_prefix_len tokens common to
    every request keeps its floor(shared/block_size) full blocks once (prefix caching shares full
    blocks only; the partial one is each sequence's own); n_samples > 1 (parallel sampling, beams)
    shares the request's prompt's full blocks among its samples the same way, each sample owning its
    partial prompt block and its output: a request holds (P//bs - shared//bs) + n x (ceil((P+O)/bs)
    - P//bs) blocks. max_sequences = max_requests x n_samples.

    Speculative decoding (`draft_model`, `num_speculative_tokens` k; Leviathan et al. 2023, vLLM's
    "draft_model" method): the draft's weights (same dtype, same tp) come out of the pool, and its layers'
    KV pages join every block id (vLLM allocates the draft's attention layers in the same KV-cache config,
    so a block costs the target's and the draft's bytes); the target verifies k + 1 positions a sequence
    a step, so the sampler's fp32 logits grow to max_num_seqs x (k + 1) x V (vLLM's profile run makes
    them in its dummy sampler run; counted here beside `activation_peak_bytes`, as an estimate). Each
    sequence's block count is unchanged: the k draft tokens' slots fit its blocks' lookahead, ignored.

    Known limitations: activation_peak_bytes and cuda_graph_bytes are what vLLM measures at start-up
    (pass them; 0 by default); a sliding-window model's vLLM admission reserve is used for
    max_concurrency, while max_sequences counts the window-capped pages (the steady state); EAGLE/MTP
    heads (a layer or two sharing the target's embeddings) are priced as a whole draft model."""
    s = _model(model)
    g = _specs.gpu(gpu)
    prompt_len = _checks.whole("prompt_len", prompt_len)
    output_len = _checks.whole("output_len", output_len, lo=0)
    tokens = _checks.positions(s, prompt_len + output_len, name="prompt_len + output_len")
    _checks.one_of("dtype", dtype, tuple(WEIGHT_DTYPES))
    kv_dtype = _default_kv(dtype) if kv_dtype is None else kv_dtype
    shared = _checks.whole("shared_prefix_len", shared_prefix_len, lo=0, hi=prompt_len)
    n = _checks.whole("n_samples", n_samples, hi=1 << 16)
    blk = kv_block(s, block_size=block_size, kv_dtype=kv_dtype, sliding_window=sliding_window,
                   sliding_layers=sliding_layers, tp=tp)
    weights = _cdiv(s.params * WEIGHT_DTYPES[dtype], tp)
    draft, d_weights, d_page, verify = None, 0, 0, 0
    k = _checks.whole("num_speculative_tokens", num_speculative_tokens, lo=0, hi=64)
    seqs = _checks.whole("max_num_seqs", max_num_seqs, hi=1 << 20)
    if draft_model is not None:
        draft = _model(draft_model)
        if draft.vocab_size != s.vocab_size:
            raise ValueError(f"draft_model {draft.name} has a vocabulary of {draft.vocab_size:,}, {s.name} of "
                             f"{s.vocab_size:,}: a draft must share the target's tokenizer")
        if not k:
            raise ValueError("num_speculative_tokens must be at least 1 with a draft_model (tokens the draft "
                             "proposes a step)")
        if sliding_window is not None:
            raise ValueError("speculative decoding is modelled for full-attention models (no sliding_window)")
        dblk = kv_block(draft, block_size=blk.block_size, kv_dtype=kv_dtype, tp=tp)
        d_weights, d_page = _cdiv(draft.params * WEIGHT_DTYPES[dtype], tp), dblk.bytes_per_block
        verify = seqs * (k + 1) * s.vocab_size * 4
    elif k:
        raise ValueError("num_speculative_tokens needs a draft_model (the model that proposes them)")
    avail = available_kv_bytes(g, weights_bytes=weights + d_weights, gpu_memory_utilization=gpu_memory_utilization,
                               activation_peak_bytes=activation_peak_bytes + verify, cuda_graph_bytes=cuda_graph_bytes,
                               non_torch_bytes=non_torch_bytes)
    group_layers, _ = _vllm_groups(blk)
    num_blocks = avail // (blk.page_bytes * group_layers + d_page)
    per_request = vllm_blocks_per_request(blk, tokens, max_num_batched_tokens=max_num_batched_tokens)
    if num_blocks < per_request:
        raise ValueError(f"{s.name} on {g.name}: the pool holds {num_blocks:,} blocks, one request of {tokens:,} "
                         f"tokens needs {per_request:,} (vLLM refuses to start: lower max_model_len)")
    # sharing, in whole-model blocks: the common prefix's full blocks once for all requests; a request's
    # own prompt's full blocks once for its n samples; every sequence its partial and output blocks
    bs = blk.block_size
    own = blk.blocks_per_sequence(tokens)
    common = shared // bs
    p_full = prompt_len // bs if n > 1 else common
    if sliding_window is not None:  # a sliding layer's ring buffer overwrites its pages: no sharing modelled
        common = 0
        requests = avail // (n * blk.sequence_bytes(tokens))
    else:
        held = (p_full - common) + n * (own - p_full)  # blocks one request holds besides the common prefix
        requests = max(0, (avail // (blk.bytes_per_block + d_page) - common) // held)
    return ServingPlan(model=s.name, gpu=g.name, block=blk, weights_bytes=weights, available_kv_bytes=avail,
                       num_blocks=num_blocks, tokens_per_request=tokens, blocks_per_request=per_request,
                       last_block_waste=blk.last_block_waste(tokens), max_concurrency=num_blocks / per_request,
                       shared_prefix_blocks=common, max_requests=requests, max_sequences=requests * n,
                       draft_model=draft.name if draft else None, draft_weights_bytes=d_weights,
                       draft_page_bytes=d_page, verify_logits_bytes=verify)


def shared_blocks(*, block_size: int, num_sequences: int, shared_prefix_len: int, own_tokens: int) -> dict:
    """Blocks `num_sequences` sequences hold when the first shared_prefix_len tokens are common
    (a system prompt; or a request's prompt shared by its n samples/beams) and each then has
    own_tokens of its own. Full shared blocks are held once (vLLM's prefix caching hashes full
    blocks only); the shared prefix's partial block is copied into every sequence.
    Returns {'without_sharing', 'with_sharing', 'saved'} in blocks."""
    bs = _checks.whole("block_size", block_size, hi=1 << 20)
    n = _checks.whole("num_sequences", num_sequences)
    p = _checks.whole("shared_prefix_len", shared_prefix_len, lo=0)
    o = _checks.whole("own_tokens", own_tokens, lo=0)
    if p + o == 0:
        raise ValueError("shared_prefix_len + own_tokens must be at least 1 token")
    each = _cdiv(p + o, bs)
    full = p // bs
    without, with_ = n * each, full + n * (each - full)
    return {"without_sharing": without, "with_sharing": with_, "saved": without - with_}


# ------------------------------------------------------------------ transformers' continuous batching
@dataclass(frozen=True, kw_only=True)
class TransformersPool:
    """transformers 5.x `PagedAttentionCache` sized by `num_blocks` (ContinuousBatchingConfig):
    the sector geometry, the cache tensor's bytes, and whole-model blocks. Bytes are integers."""

    block: KVBlock
    bytes_per_sector: int  # lcm(bytes of each attention type's block, 128)
    num_sectors: int  # data sectors
    storage_bytes: int  # the cache tensor: (num_sectors + 2 trash sectors) x bytes_per_sector
    num_blocks: int  # helper attribute: data bytes // (num_hidden_layers x full page bytes)
    max_batch_tokens: int = 0  # tokens one forward may carry (sized from memory only)
    reserved_bytes: int = 0  # what the memory sizing set aside beside the cache: activations, IO, masks

    def blocks_per_sector(self) -> dict[str, int]:
        return {k: self.bytes_per_sector // b for k, b in _tf_group_bytes(self.block).items()}

    def admitted(self, tokens: int, *, requests: int = 1 << 20) -> int:
        """How many identical requests of `tokens` (prompt + tokens written so far) the cache admits
        one after another before `can_store_request_tokens` says no (cache.py: a request takes whole
        sectors for the blocks its allocator lacks; free blocks left in an allocator's sectors go to
        the next request)."""
        tokens = _checks.whole("tokens", tokens)
        requests = _checks.whole("requests", requests)
        full, sliding = self.block.pages_per_sequence(tokens)
        need = {"full_attention": full, "sliding_attention": sliding}
        per_sector = self.blocks_per_sector()
        free_sectors, free_blocks = self.num_sectors, dict.fromkeys(per_sector, 0)
        for k in range(requests):
            new = {t: max(0, _cdiv(need[t] - free_blocks[t], per_sector[t])) for t in per_sector}
            if sum(new.values()) > free_sectors:
                return k
            free_sectors -= sum(new.values())
            for t in per_sector:
                free_blocks[t] += new[t] * per_sector[t] - need[t]
        return requests


def _tf_group_bytes(block: KVBlock) -> dict[str, int]:
    out = {}
    if block.full_layers:
        out["full_attention"] = block.page_bytes * block.full_layers
    if block.sliding_layers:
        out["sliding_attention"] = block.page_bytes * block.sliding_layers
    return out


def transformers_pool(block: KVBlock, *, num_blocks: int) -> TransformersPool:
    """The pool transformers' `PagedAttentionCache` allocates for `num_blocks` whole-model blocks of
    block.block_size tokens (its `page_size`): sectors = max(1, ceil(num_blocks x layers x page /
    sector)), plus two trash sectors (`PagedAttentionMemoryHandler.num_sectors_from_config`)."""
    if not isinstance(block, KVBlock):
        raise ValueError(f"block must be a KVBlock (serving.kv_block(...)), got {_checks.show(block)}")
    num_blocks = _checks.whole("num_blocks", num_blocks)
    if block.kv_dtype == "int8":
        raise ValueError("transformers' paged cache stores the model's dtype (no int8 pages); use fp32/bf16/fp16")
    sector = math.lcm(*_tf_group_bytes(block).values(), SECTOR_ALIGNMENT)
    layers = block.full_layers + block.sliding_layers
    per_block = layers * block.page_bytes  # FullAttentionCacheAllocator.get_bytes_per_page x num_hidden_layers
    sectors = max(1, _cdiv(num_blocks * per_block, sector))
    return TransformersPool(block=block, bytes_per_sector=sector, num_sectors=sectors,
                            storage_bytes=(sectors + TRASH_SECTORS) * sector,
                            num_blocks=sectors * sector // per_block)


TRANSFORMERS_MAX_BATCH_TOKENS = 8192  # PagedAttentionMemoryHandler._default_max_batch_tokens
TRANSFORMERS_MAX_BLOCKS_PER_REQUEST = 32  # ContinuousBatchingConfig.fallback_max_blocks_per_request


def transformers_pool_from_memory(model: "ModelSpec | str", *, available_bytes: int,
                                  block_size: int = TRANSFORMERS_PAGE_SIZE,
                                  dtype: str = "bf16", sliding_window: int | None = None,
                                  sliding_layers: int | None = None, max_batch_tokens: int | None = None,
                                  flash: bool = False, logits_to_keep: bool = False,
                                  max_requests_per_batch: int | None = None,
                                  max_blocks_per_request: int = TRANSFORMERS_MAX_BLOCKS_PER_REQUEST
                                  ) -> TransformersPool:
    """The pool transformers 5.x's `PagedAttentionMemoryHandler` carves out of `available_bytes`
    (its get_available_memory: (total - max(allocated, reserved)) x max_memory_percent), with no
    num_blocks given. Its arithmetic, reproduced (cache.py `infer_max_batch_tokens_and_num_sectors`):

      M = max_batch_tokens (8192 by default)
      per batch token: max(LM-head peak h x a + V x 4, attention peak a x (h + heads x d + 2 kv d +
        kv_at_peak x d)) + int32/int64 IO rows; kv_at_peak = 2 kv (flash) or 2 heads + kv (eager/sdpa
        repeat K and V to every head)
      per cache sector: its bytes + tokens_per_sector x (kv_at_peak x d x a + 8 per KV group)
      sectors = (available - 2 trash sectors - M x per batch token) // per sector, less the sectors
        that pay for the attention masks [M, sectors x tokens_per_sector + M] (none under flash)

    No profile run: its activation reserve is this formula, so the numbers are exact, not within 5 %.
    `dtype`: the model's (cache and activations). Async batching and logprobs are off, as default."""
    s = _model(model)
    available = _checks.whole("available_bytes", available_bytes, hi=_checks.MAX_BYTES)
    _checks.one_of("dtype", dtype, ("fp32", "bf16", "fp16"))
    M = TRANSFORMERS_MAX_BATCH_TOKENS if max_batch_tokens is None else _checks.whole("max_batch_tokens",
                                                                                      max_batch_tokens)
    flash, logits_to_keep = _checks.flag("flash", flash), _checks.flag("logits_to_keep", logits_to_keep)
    rows_cap = 1024 if max_requests_per_batch is None else _checks.whole("max_requests_per_batch",
                                                                         max_requests_per_batch)
    mbpr = _checks.whole("max_blocks_per_request", max_blocks_per_request, lo=0)
    if s.is_mla:
        raise ValueError(f"{s.name}: transformers' paged cache stores K and V per kv head; MLA is not modelled here")
    block = kv_block(s, block_size=block_size, kv_dtype=dtype, sliding_window=sliding_window,
                     sliding_layers=sliding_layers)
    groups = _tf_group_bytes(block)
    sector = math.lcm(*groups.values(), SECTOR_ALIGNMENT)
    tokens_per_sector = max(sector // b * block.block_size for b in groups.values())
    a, h, V, d = KV_DTYPES[dtype], s.hidden_size, s.vocab_size, s.head_dim
    kv, heads, n_groups = s.num_kv_heads, s.num_heads, len(groups)
    kv_peak = 2 * kv if flash else 2 * heads + kv
    masks = 0 if flash else (2 if block.sliding_layers else 1)
    lm_head = h * a + V * 4
    attention = a * (h + heads * d + 2 * kv * d + kv_peak * d)
    io = 7 * 4 + 4 + n_groups * mbpr * 4 + n_groups * 8 + n_groups * 8  # bulk input, output ids, block table, indices
    per_token = max(0 if logits_to_keep else lm_head, attention) + io
    per_sector = sector + tokens_per_sector * (kv_peak * d * a + n_groups * 8)
    fixed = TRASH_SECTORS * sector + (rows_cap * lm_head if logits_to_keep else 0)

    def mask_bytes(n: int) -> int:
        return masks * a * M * (n * tokens_per_sector + M)

    n = (available - fixed - M * per_token) // per_sector
    n -= _cdiv(mask_bytes(n), per_sector + mask_bytes(n + 1) - mask_bytes(n))
    if n <= 0:
        raise ValueError(f"available_bytes {available:,} leaves no cache sector of {sector:,} B after "
                         f"{M:,} batch tokens x {per_token:,} B: give more memory or a smaller max_batch_tokens")
    reserved = fixed - TRASH_SECTORS * sector + M * per_token + n * (per_sector - sector) + mask_bytes(n)
    per_block = (block.full_layers + block.sliding_layers) * block.page_bytes
    return TransformersPool(block=block, bytes_per_sector=sector, num_sectors=n,
                            storage_bytes=(n + TRASH_SECTORS) * sector, num_blocks=n * sector // per_block,
                            max_batch_tokens=M, reserved_bytes=reserved)


# ------------------------------------------------------------------ speed bounds (roofline)
def throughput_bounds(model: "ModelSpec | str", *, gpu: "GPUSpec | str" = "h100", batch_size: int = 1,
                      context_len: int, prompt_len: int | None = None, dtype: str = "bf16",
                      kv_dtype: str | None = None) -> dict:
    """Upper bounds on tokens/s from the GPU's data sheet (Scaling Book, "All about transformer
    inference"; Pope+22, arXiv:2211.05102).

    decode: every step reads all weights and each sequence's KV cache once:
      step >= (weights + batch_size x context_len x kv bytes per token) / bandwidth; tokens/s <=
      batch_size / step. prefill: compute-bound, 2 x params FLOPs a token plus causal attention's
      2 x 2 x L x (a x d) x s^2 / 2 a sequence: tokens/s <= peak / FLOPs per token.
    Returns a dict of floats (seconds, tokens/s) and ints (bytes, FLOPs).

    Known limitations: peak data-sheet figures (real kernels reach ~60-80 %); MoE reads only the
    active experts' weights at batch 1, all of them at large batches: weights are taken whole."""
    s = _model(model)
    g = _specs.gpu(gpu)
    b = _checks.whole("batch_size", batch_size)
    ctx = _checks.positions(s, _checks.whole("context_len", context_len), name="context_len")
    p = ctx if prompt_len is None else _checks.positions(s, _checks.whole("prompt_len", prompt_len), name="prompt_len")
    _checks.one_of("dtype", dtype, tuple(WEIGHT_DTYPES))
    kv_dtype = _default_kv(dtype) if kv_dtype is None else kv_dtype
    _checks.one_of("kv_dtype", kv_dtype, tuple(KV_DTYPES))
    if not g.bandwidth_GBps or not g.peak_tflops_16:
        raise ValueError(f"{g.name} has no bandwidth or peak TFLOP/s in the catalogue; pick a catalogue GPU")
    weights = s.params * WEIGHT_DTYPES[dtype]
    kv_tok = _moe.kv_cache_elements_per_token(s) * KV_DTYPES[kv_dtype]
    read = weights + b * ctx * kv_tok
    step = read / (g.bandwidth_GBps * 1e9)
    flops_tok = 2 * s.params + 2 * s.num_layers * s.q_dim * p  # attention: 4 L a d s^2 / 2 over s tokens
    peak = (g.peak_tops_int8 if dtype in ("int8", "fp8") and g.peak_tops_int8 else g.peak_tflops_16) * 1e12
    return {"decode_bytes_per_step": read, "decode_step_s": step, "decode_tokens_per_s": b / step,
            "prefill_flops_per_token": flops_tok, "prefill_tokens_per_s": peak / flops_tok,
            "prefill_s": p * flops_tok / peak}


__all__ = ["KV_DTYPES", "KVBlock", "ServingPlan", "TransformersPool", "available_kv_bytes", "kv_block",
           "serving_plan", "shared_blocks", "throughput_bounds", "transformers_pool", "transformers_pool_from_memory",
           "vllm_blocks_per_request"]
