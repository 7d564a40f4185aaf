"""Measure transformers' own paged KV cache (continuous batching) on the CPU, for `vramlab.serving`.

`measure_pool` builds transformers' `PagedAttentionCache` (generation/continuous_batching/cache.py)
for a small model config (random sizes, no weights: the cache only reads the config) with a
`num_blocks` budget, and reads what it really allocated: the cache tensor's storage bytes, the
sector geometry, blocks per sequence (the block table one request gets) and how many identical
requests `can_store_request_tokens` admits before the pool is full. `measure_live` runs
`generate_batch` on a tiny randomly initialised model and records the most requests active at
once. `measure_kv_quant` stores one KV block in float8 and int8 (+ float32 scales) with torch and
reads the storage bytes. Each function returns a dict; `python -m vramlab.measure.serving` writes
benchmarks/results/serving/cpu.json with provenance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .. import checks as _checks
from .. import serving as _serving
from .. import specs as _specs
from .record import provenance

# Small configs: (name, model_type, kwargs for AutoConfig.for_model, sliding window, sliding layers)
CONFIGS = (
    ("llama-gqa", "llama", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=256, vocab_size=512, max_position_embeddings=4096), None),
    ("llama-mqa", "llama", dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=1,
                                intermediate_size=192, vocab_size=512, max_position_embeddings=4096), None),
    ("llama-mha-hd80", "llama", dict(hidden_size=160, num_hidden_layers=5, num_attention_heads=2,
                                     num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                     max_position_embeddings=4096), None),
    ("gpt2-mha", "gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=4096), None),
    ("mistral-sliding", "mistral", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                       max_position_embeddings=4096, sliding_window=100), 100),
    ("qwen2-hybrid", "qwen2", dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                   max_position_embeddings=4096, use_sliding_window=True, sliding_window=64,
                                   max_window_layers=2), 64),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _config(model_type: str, kwargs: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


def _sliding_layers(cfg) -> int:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return cfg.num_hidden_layers if getattr(cfg, "sliding_window", None) is not None else 0
    return sum(t == "sliding_attention" for t in types)


def _cache(cfg, *, page_size: int, num_blocks: int, dtype, sharing: bool = False):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=64,
                                  max_memory_percent=0.5, allow_block_sharing=sharing)
    return PagedAttentionCache(cfg, cb, "cpu", DistributedHelper(None, None), dtype=dtype)


def measure_pool(model_type: str, config_kwargs: dict, *, page_size: int, num_blocks: int, dtype: str = "fp16",
                 tokens: int) -> dict:
    """One PagedAttentionCache on the CPU: its cache tensor's storage bytes, sectors, whole-model
    blocks, the pages one request of `tokens` holds per attention type, and how many such requests
    it admits (fresh requests, each writing `tokens` at once, until `can_store_request_tokens`
    refuses)."""
    from transformers.generation.continuous_batching.requests import RequestState

    cfg = _config(model_type, config_kwargs)
    cache = _cache(cfg, page_size=page_size, num_blocks=num_blocks, dtype=DTYPES[dtype])
    first = None
    admitted = 0
    while admitted < 100_000:
        st = RequestState(request_id=f"r{admitted}", initial_tokens=[1] * tokens)
        if not cache.can_store_request_tokens(st, tokens):
            break
        if first is None:
            first = {name: len(a.block_table[st.request_id]) for name, a in cache.cache_allocators.items()}
        admitted += 1
    return {
        "model_type": model_type, "config": config_kwargs, "page_size": page_size, "num_blocks_asked": num_blocks,
        "dtype": dtype, "tokens": tokens, "sliding_layers": _sliding_layers(cfg),
        "storage_bytes": cache.cache_tensor.untyped_storage().nbytes(),
        "bytes_per_sector": cache.bytes_per_sector, "num_sectors": cache.num_sectors, "num_blocks": cache.num_blocks,
        "pages_per_request": first or {}, "admitted": admitted,
        "bytes_per_block": {name: a.bytes_per_block for name, a in cache.cache_allocators.items()},
    }


def measure_pool_from_memory(model_type: str, config_kwargs: dict, *, page_size: int, available_bytes: int,
                             dtype: str = "fp16", max_batch_tokens: int | None = None, flash: bool = False,
                             logits_to_keep: bool = False) -> dict:
    """A PagedAttentionCache sized from a memory budget (no num_blocks): the device query it makes
    (`get_device_and_memory_breakdown`, psutil on a CPU) is replaced by a fixed `available_bytes`
    total with nothing allocated and max_memory_percent 1, so the sizing is repeatable; what it then
    allocates is read from the cache tensor's storage. `flash`: the config asks for flash attention
    (its sizing then reserves no masks; nothing runs, so flash-attn need not be installed);
    `logits_to_keep`: the model slices hidden states before the LM head."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as _cache_mod
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    cfg = _config(model_type, config_kwargs)
    if flash:
        cfg._attn_implementation = "flash_attention_2"
    cb = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=max_batch_tokens, max_memory_percent=1.0,
                                  allow_block_sharing=False)
    original = _cache_mod.get_device_and_memory_breakdown
    _cache_mod.get_device_and_memory_breakdown = lambda: (torch.device("cpu"), available_bytes, 0, 0)
    try:
        cache = _cache_mod.PagedAttentionCache(cfg, cb, "cpu", DistributedHelper(None, None), dtype=DTYPES[dtype],
                                               model_supports_logits_to_keep=logits_to_keep)
    finally:
        _cache_mod.get_device_and_memory_breakdown = original
    return {"model_type": model_type, "config": config_kwargs, "page_size": page_size, "dtype": dtype,
            "available_bytes": available_bytes, "max_batch_tokens_asked": max_batch_tokens, "flash": flash,
            "logits_to_keep": logits_to_keep,
            "sliding_layers": _sliding_layers(cfg), "storage_bytes": cache.cache_tensor.untyped_storage().nbytes(),
            "num_sectors": cache.num_sectors, "num_blocks": cache.num_blocks,
            "max_batch_tokens": cache.max_batch_tokens}


def measure_prefix_sharing(*, num_sequences: int, shared_prefix_len: int, own_tokens: int, page_size: int = 16) -> dict:
    """Blocks transformers' cache holds for `num_sequences` prompts that share their first
    shared_prefix_len tokens, prefix sharing on: each request is admitted as the scheduler does
    (`search_prefix_match`, then `can_store_request_tokens` for the rest), then its completed blocks
    are hashed (`mark_complete_blocks`, which de-duplicates). Blocks held = the pool's used bytes /
    bytes per block."""
    from transformers.generation.continuous_batching.requests import RequestState

    cfg = _config("llama", dict(CONFIGS[0][2]))
    cache = _cache(cfg, page_size=page_size, num_blocks=4 * num_sequences * (shared_prefix_len + own_tokens),
                   dtype=torch.float16, sharing=True)
    prefix = list(range(1, shared_prefix_len + 1))
    matched = []
    for i in range(num_sequences):
        tokens = prefix + [1000 + i * own_tokens + j for j in range(own_tokens)]
        st = RequestState(request_id=f"r{i}", initial_tokens=tokens)
        hit = cache.search_prefix_match(st.request_id, tokens)
        st.position_offset = hit
        assert cache.can_store_request_tokens(st, len(tokens) - hit)
        complete = cache.count_new_complete_blocks(st, len(tokens) - hit)
        st.position_offset = len(tokens)
        cache.mark_complete_blocks(st, complete)
        matched.append(hit)
    allocator = cache.cache_allocators["full_attention"]
    used = cache.num_sectors * cache.bytes_per_sector - int(cache.compute_free_capacity(relative=False))
    return {"num_sequences": num_sequences, "shared_prefix_len": shared_prefix_len, "own_tokens": own_tokens,
            "page_size": page_size, "blocks_held": used // allocator.bytes_per_block, "matched_tokens": matched}


def predict_pool(model_type: str, config_kwargs: dict, *, page_size: int, num_blocks: int, dtype: str = "fp16",
                 tokens: int, sliding_window: int | None) -> dict:
    """The calculator's numbers for the same cache (vramlab.serving, from the config's ModelSpec)."""
    cfg = _config(model_type, config_kwargs)
    spec = _specs.from_config(cfg.to_dict(), name=model_type)
    block = _serving.kv_block(spec, block_size=page_size, kv_dtype=dtype, sliding_window=sliding_window,
                              sliding_layers=_sliding_layers(cfg) if sliding_window else None)
    pool = _serving.transformers_pool(block, num_blocks=num_blocks)
    full, sliding = block.pages_per_sequence(tokens)
    pages = {}
    if block.full_layers:
        pages["full_attention"] = full
    if block.sliding_layers:
        pages["sliding_attention"] = sliding
    return {"storage_bytes": pool.storage_bytes, "bytes_per_sector": pool.bytes_per_sector,
            "num_sectors": pool.num_sectors, "num_blocks": pool.num_blocks, "pages_per_request": pages,
            "admitted": pool.admitted(tokens)}


def measure_live(*, page_size: int = 16, num_blocks: int = 12, prompt_len: int = 40, new_tokens: int = 8,
                 requests: int = 8, seed: int = 0) -> dict:
    """`generate_batch` on a tiny random Llama (GQA) on the CPU: the most requests active at once
    (scheduler.active_requests after each scheduling step), how many times a running request was
    preempted (offloaded to CPU or soft reset: `OffloadingManager.offload_requests`' victims) and
    whether every request finished. Prompts are distinct random tokens and block sharing is off, so
    nothing is shared. Predicted beside it: requests admitted at the prompt's length, and requests
    the pool sustains at prompt + new tokens (preemption is expected when the first exceeds it)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import offloading_manager as _offl
    from transformers.generation.continuous_batching import scheduler as _sched

    cfg = _config("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=256, max_position_embeddings=512))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=4096,
                                  max_memory_percent=0.5, allow_block_sharing=False)
    seen: list[int] = []
    victims: list[int] = []
    originals = {cls: cls.schedule_batch for cls in (_sched.FIFOScheduler, _sched.PrefillFirstScheduler)}
    offload = _offl.OffloadingManager.offload_requests

    def counting_offload(self):
        before = set(self.scheduler.active_requests)
        out = offload(self)
        victims.append(len(before - set(self.scheduler.active_requests)))  # offloaded or soft reset
        return out

    def wrap(fn):
        def schedule_batch(self, *a, **k):
            out = fn(self, *a, **k)
            seen.append(len(self.active_requests))
            return out
        return schedule_batch

    try:
        for cls, fn in originals.items():
            cls.schedule_batch = wrap(fn)
        _offl.OffloadingManager.offload_requests = counting_offload
        with torch.no_grad():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    finally:
        for cls, fn in originals.items():
            cls.schedule_batch = fn
        _offl.OffloadingManager.offload_requests = offload
    done = sum(len(v.generated_tokens) == new_tokens for v in out.values())
    spec = _specs.from_config(cfg.to_dict(), name="llama-live")
    pool = _serving.transformers_pool(_serving.kv_block(spec, block_size=page_size, kv_dtype="fp32"),
                                      num_blocks=num_blocks)
    return {"predicted_admitted": pool.admitted(prompt_len, requests=requests),
            "predicted_sustained": pool.admitted(prompt_len + new_tokens, requests=requests),
            "preempted": sum(victims), "page_size": page_size, "num_blocks": num_blocks, "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "requests": requests, "max_active": max(seen) if seen else 0, "steps": len(seen), "finished": done}


def measure_kv_quant(*, block_size: int = 16, num_kv_heads: int = 8, head_dim: int = 128) -> dict:
    """Storage bytes of one layer's K and V page of `block_size` tokens, as torch stores them:
    bf16, float8_e4m3fn (vLLM's fp8 cache: a per-tensor scale outside the page) and int8 with a
    float32 scale per token and kv head for K and V."""
    shape = (2, block_size, num_kv_heads, head_dim)
    x = torch.randn(shape)
    out = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
           "bf16": x.to(torch.bfloat16).untyped_storage().nbytes(),
           "fp16": x.to(torch.float16).untyped_storage().nbytes(),
           "fp32": x.untyped_storage().nbytes()}
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8"] = x.to(torch.float8_e4m3fn).untyped_storage().nbytes()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127  # (2, block, heads, 1) float32
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    out["int8"] = q.untyped_storage().nbytes() + scale.contiguous().untyped_storage().nbytes()
    out["int8_scale_bytes"] = scale.contiguous().untyped_storage().nbytes()
    return out


def run_all() -> dict:
    """Every configuration at two pool sizes and dtypes, the KV-quantization bytes and one live run."""
    pools = []
    for name, mt, kw, window in CONFIGS:
        for page_size, num_blocks, dtype, tokens in ((16, 40, "fp16", 100), (32, 23, "fp32", 250)):
            m = measure_pool(mt, kw, page_size=page_size, num_blocks=num_blocks, dtype=dtype, tokens=tokens)
            p = predict_pool(mt, kw, page_size=page_size, num_blocks=num_blocks, dtype=dtype, tokens=tokens,
                             sliding_window=window)
            pools.append({"name": name, "sliding_window": window, "measured": m, "predicted": p})
    budgets = []
    for name, mt, kw, window in CONFIGS:
        for page_size, avail, dtype, m_tokens, flash in ((16, 256 << 20, "fp16", 2048, False),
                                                         (64, 96 << 20, "fp32", 512, False),
                                                         (32, 64 << 20, "bf16", None, True)):
            m = measure_pool_from_memory(mt, kw, page_size=page_size, available_bytes=avail, dtype=dtype,
                                         max_batch_tokens=m_tokens, flash=flash, logits_to_keep=flash)
            spec = _specs.from_config(_config(mt, kw).to_dict(), name=name)
            p = _serving.transformers_pool_from_memory(
                spec, available_bytes=avail, block_size=page_size, dtype=dtype, sliding_window=window,
                sliding_layers=m["sliding_layers"] if window else None, max_batch_tokens=m_tokens, flash=flash,
                logits_to_keep=flash)
            budgets.append({"name": name, "sliding_window": window, "measured": m,
                            "predicted": {"storage_bytes": p.storage_bytes, "num_sectors": p.num_sectors,
                                          "num_blocks": p.num_blocks, "max_batch_tokens": p.max_batch_tokens,
                                          "reserved_bytes": p.reserved_bytes}})
    sharing = []
    for n, p_len, own, ps in ((6, 100, 50, 16), (4, 64, 7, 16), (5, 250, 30, 32), (3, 10, 40, 16)):
        m = measure_prefix_sharing(num_sequences=n, shared_prefix_len=p_len, own_tokens=own, page_size=ps)
        m["predicted"] = _serving.shared_blocks(block_size=ps, num_sequences=n, shared_prefix_len=p_len,
                                                own_tokens=own)
        sharing.append(m)
    quant = [measure_kv_quant(), measure_kv_quant(block_size=32, num_kv_heads=1, head_dim=64)]
    return {"pools": pools, "budget_pools": budgets, "prefix_sharing": sharing, "kv_quant": quant,
            "live": {"fits": measure_live(), "preempts": measure_live(new_tokens=30, requests=6)}}


PROG = "python -m vramlab.measure.serving"


def main(argv: list[str] | None = None) -> int:
    ap = _checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serving/cpu.json"),
                    help="results file (JSON; its folder is made)")
    args = ap.parse_args(argv)
    _checks.output_path(PROG, args.out, make_folder=True)
    argv = sys.argv[1:] if argv is None else argv
    result = {"provenance": {**provenance("cpu"), "device": "cpu", "command": " ".join([PROG, *argv])},
              **run_all()}
    path = args.out
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    bad = [p["name"] for p in result["pools"]
           for k in ("storage_bytes", "num_sectors", "num_blocks", "admitted", "pages_per_request")
           if p["measured"][k] != p["predicted"][k]]
    bad += [p["name"] + " (budget)" for p in result["budget_pools"]
            for k in ("storage_bytes", "num_sectors", "num_blocks", "max_batch_tokens")
            if p["measured"][k] != p["predicted"][k]]
    print(f"wrote {path}: {len(result['pools'])} pools, {len(bad)} mismatches {sorted(set(bad))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
