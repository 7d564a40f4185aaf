"""The serving model: `vramlab.serving`'s paged KV cache, pool and concurrency,
worked by hand; then against transformers' own continuous-batching cache (`PagedAttentionCache`) as
measured on the CPU and stored in benchmarks/results/serving/cpu.json (`python -m
vramlab.measure.serving`): its cache tensor's storage bytes, sectors, blocks, pages per request and
the requests it admits, for GQA, MQA, MHA, sliding-window and hybrid configs; KV quantization bytes
against torch's float8/int8 storage; and one small live `generate_batch` run."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from vramlab import serving, specs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serving" / "cpu.json"
H100_TOTAL = 85_017_493_504  # cudaMemGetInfo total on the H100 (specs.GPUS["h100-80gb"].measured_usable_bytes)


# ------------------------------------------------------------------ blocks, by hand
def test_llama_8b_block_by_hand():
    # Llama-3.1-8B: 32 layers, 8 kv heads of 128 -> K and V per token and layer 2*8*128 = 2048 elements
    b = serving.kv_block("llama-3.1-8b", block_size=16, kv_dtype="bf16")
    assert b.page_bytes == 2048 * 2 * 16 == 65_536
    assert b.bytes_per_block == 32 * 65_536 == 2 * 1024 * 1024
    assert b.bytes_per_token == 131_072  # 128 KiB a token, the figure everyone quotes for Llama-3-8B
    assert b.blocks_per_sequence(1001) == 63 and b.last_block_waste(1001) == 63 * 16 - 1001 == 7
    assert b.last_block_waste(1008) == 0


def test_kv_dtypes_and_scales():
    fp8 = serving.kv_block("llama-3.1-8b", kv_dtype="fp8")
    int8 = serving.kv_block("llama-3.1-8b", kv_dtype="int8")
    fp32 = serving.kv_block("llama-3.1-8b", kv_dtype="fp32")
    assert fp8.page_bytes == 32_768 and fp8.scale_bytes == 0  # per-tensor scales live outside the pool
    assert int8.scale_bytes == 2 * 16 * 8 * 4 == 1024  # fp32 per (token, kv head) for K and V
    assert int8.page_bytes == 32_768 + 1024
    assert fp32.page_bytes == 131_072


def test_mqa_mla_and_tp():
    # MQA: one kv head; tp cannot split it (replicated), a GQA model's heads split
    base = specs.preset("llama-3.1-8b")
    mqa = dataclasses.replace(base, num_kv_heads=1, name="mqa")
    assert serving.kv_block(mqa).page_bytes == 2 * 128 * 2 * 16
    assert serving.kv_block(mqa, tp=4).page_bytes == 2 * 128 * 2 * 16
    assert serving.kv_block(base, tp=4).page_bytes == 65_536 // 4
    assert serving.kv_block(base, tp=16).page_bytes == 65_536 // 8  # 8 kv heads over 16 ranks: one each
    # DeepSeek-V3's MLA: one latent of kv_lora_rank 512 + rope 64 per token and layer
    mla = serving.kv_block("deepseek-v3", kv_dtype="bf16")
    assert mla.page_bytes == (512 + 64) * 2 * 16 and mla.full_layers == 61
    assert serving.kv_block("deepseek-v3", kv_dtype="int8").scale_bytes == 1 * 16 * 4  # one latent "head"
    assert serving.kv_block("deepseek-v3", layout="expanded").page_bytes == 128 * (192 + 128) * 2 * 16


def test_sliding_window_caps_pages():
    b = serving.kv_block("mistral-7b", block_size=16, sliding_window=4096)
    assert b.sliding_layers == 32 and b.full_layers == 0
    assert b.pages_per_sequence(10_000) == (625, 256)  # full would be 625; the window keeps 4096/16
    assert b.sequence_bytes(10_000) == 256 * 32 * b.page_bytes
    hybrid = serving.kv_block("mistral-7b", sliding_window=4096, sliding_layers=24)
    assert (hybrid.full_layers, hybrid.sliding_layers) == (8, 24)
    assert hybrid.sequence_bytes(10_000) == hybrid.page_bytes * (625 * 8 + 256 * 24)


# ------------------------------------------------------------------ the pool and vLLM's concurrency
def test_plan_llama_8b_h100_by_hand():
    p = serving.serving_plan("llama-3.1-8b", gpu="h100", prompt_len=1000, output_len=1000)
    weights = specs.preset("llama-3.1-8b").params * 2
    assert p.weights_bytes == weights == 16_060_522_496
    avail = int(H100_TOTAL * 0.9) - weights - specs.DEFAULT_CONTEXT_BYTES
    assert p.available_kv_bytes == avail == 59_667_937_689
    assert p.num_blocks == avail // (2 * 1024 * 1024) == 28_451
    assert p.blocks_per_request == 2000 // 16 == 125
    assert p.max_concurrency == pytest.approx(28_451 / 125)
    assert p.log_line() == "Maximum concurrency for 2,000 tokens per request: 227.61x"
    assert p.max_sequences == 227
    d = p.to_dict()
    assert d["bytes_per_block"] == 2 * 1024 * 1024 and "block" not in d


def test_speculative_decoding_by_hand():
    """A Llama-3.2-1B draft proposing 4 tokens for Llama-3.1-8B: its bf16 weights leave the pool, its 16 layers'
    K and V (8 kv heads of 64) join every 16-token block, and the target verifies 5 positions of up to 256
    sequences in fp32 logits over its 128,256-token vocabulary."""
    p = serving.serving_plan("llama-3.1-8b", gpu="h100", prompt_len=1000, output_len=1000,
                             draft_model="llama-3.2-1b", num_speculative_tokens=4)
    draft_weights = specs.preset("llama-3.2-1b").params * 2
    draft_block = 16 * 2 * 8 * 64 * 2 * 16  # layers x K,V x heads x dim x bf16 x tokens
    verify = 256 * 5 * 128_256 * 4
    assert (p.draft_weights_bytes, p.draft_page_bytes, p.verify_logits_bytes) == (draft_weights, draft_block, verify)
    avail = int(H100_TOTAL * 0.9) - 16_060_522_496 - draft_weights - verify - specs.DEFAULT_CONTEXT_BYTES
    assert p.available_kv_bytes == avail and p.num_blocks == avail // (2 * 1024 * 1024 + draft_block)
    assert p.blocks_per_request == 125 and p.draft_model == "llama-3.2-1b"
    plain = serving.serving_plan("llama-3.1-8b", gpu="h100", prompt_len=1000, output_len=1000)
    assert p.max_sequences < plain.max_sequences
    for kw, says in ((dict(draft_model="llama-3.2-1b"), "num_speculative_tokens must be at least 1"),
                     (dict(num_speculative_tokens=3), "needs a draft_model"),
                     (dict(draft_model="gpt2", num_speculative_tokens=3), "share the target's tokenizer")):
        with pytest.raises(ValueError, match=says):
            serving.serving_plan("llama-3.1-8b", prompt_len=100, output_len=100, **kw)


def test_plan_reserves_and_dtype():
    base = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000)
    less = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000,
                                activation_peak_bytes=2 << 30, cuda_graph_bytes=1 << 30, non_torch_bytes=0)
    assert base.available_kv_bytes - less.available_kv_bytes == (3 << 30) - specs.DEFAULT_CONTEXT_BYTES
    fp8 = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000, kv_dtype="fp8")
    assert fp8.num_blocks == fp8.available_kv_bytes // (1024 * 1024)
    assert fp8.num_blocks >= 2 * base.num_blocks
    tp2 = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000, tp=2)
    assert tp2.weights_bytes == base.weights_bytes // 2 and tp2.block.page_bytes == 32_768


def test_prefix_and_parallel_sampling_share_full_blocks():
    r = serving.shared_blocks(block_size=16, num_sequences=10, shared_prefix_len=100, own_tokens=50)
    # each sequence: ceil(150/16) = 10 blocks; the prefix's 6 full blocks held once, its partial 7th copied
    assert r == {"without_sharing": 100, "with_sharing": 6 + 10 * 4, "saved": 54}
    assert serving.shared_blocks(block_size=16, num_sequences=3, shared_prefix_len=0, own_tokens=16)["saved"] == 0
    plain = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000)
    shared = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000, shared_prefix_len=800)
    assert shared.shared_prefix_blocks == 50
    total = plain.available_kv_bytes // (2 * 1024 * 1024)
    assert shared.max_sequences == (total - 50) // (125 - 50) > plain.max_sequences
    # 4 samples of one request share its prompt's 62 full blocks: 62 + 4 x (125 - 62) blocks a request
    sampled = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000, n_samples=4)
    assert sampled.max_requests == total // (62 + 4 * 63) and sampled.max_sequences == 4 * sampled.max_requests
    assert sampled.max_sequences > plain.max_sequences
    both = serving.serving_plan("llama-3.1-8b", prompt_len=1000, output_len=1000, n_samples=4, shared_prefix_len=800)
    assert both.max_requests == (total - 50) // ((62 - 50) + 4 * 63)


def test_vllm_sliding_window_admission():
    # SlidingWindowSpec: cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block) + 1
    b = serving.kv_block("mistral-7b", sliding_window=4096)
    assert serving.vllm_blocks_per_request(b, 11_000) == 688 + 1
    assert serving.vllm_blocks_per_request(b, 32_768) == (4095 + 8192 + 15) // 16 + 1
    assert serving.vllm_blocks_per_request(b, 32_768, max_num_batched_tokens=2048) == (4095 + 2048 + 15) // 16 + 1
    full = serving.kv_block("mistral-7b")
    assert serving.vllm_blocks_per_request(full, 11_000) == 688
    # hybrid: groups of min(8, 24) = 8 layers: one full group, three sliding ones
    h = serving.kv_block("mistral-7b", sliding_window=1024, sliding_layers=24)
    assert serving.vllm_blocks_per_request(h, 32_768) == 2048 + 3 * ((1023 + 8192 + 15) // 16 + 1)


def test_throughput_bounds_by_hand():
    s = specs.preset("llama-3.1-8b")
    r = serving.throughput_bounds(s, gpu="h100", batch_size=32, context_len=2000)
    read = s.params * 2 + 32 * 2000 * 131_072
    assert r["decode_bytes_per_step"] == read
    assert r["decode_tokens_per_s"] == pytest.approx(32 * 3350e9 / read)
    flops = 2 * s.params + 2 * 32 * 4096 * 2000
    assert r["prefill_flops_per_token"] == flops
    assert r["prefill_tokens_per_s"] == pytest.approx(989e12 / flops)
    one = serving.throughput_bounds(s, gpu="h100", batch_size=1, context_len=2000)
    assert one["decode_tokens_per_s"] < r["decode_tokens_per_s"]  # batching amortises the weights


# ------------------------------------------------------------------ transformers' sector arithmetic, by hand
def test_transformers_pool_by_hand():
    spec = specs.from_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128,
                              "vocab_size": 256}, name="tiny")
    b = serving.kv_block(spec, block_size=16, kv_dtype="fp16")
    assert b.page_bytes == 2 * 2 * 8 * 2 * 16 == 1024
    pool = serving.transformers_pool(b, num_blocks=40)
    assert pool.bytes_per_sector == 3072  # lcm(3 x 1024, 128)
    assert (pool.num_sectors, pool.num_blocks) == (40, 40)
    assert pool.storage_bytes == (40 + 2) * 3072
    assert pool.admitted(100) == 40 // 7 == 5


# ------------------------------------------------------------------ bad input: one line, naming the argument
@pytest.mark.parametrize("call, word", [
    (lambda: serving.kv_block("llama-3.1-8b", block_size=0), "block_size"),
    (lambda: serving.kv_block("llama-3.1-8b", kv_dtype="int4"), "kv_dtype"),
    (lambda: serving.kv_block("llama-3.1-8b", tp=3), "tp"),
    (lambda: serving.kv_block("llama-3.1-8b", tp=12), "tp"),
    (lambda: serving.kv_block("llama-3.1-8b", sliding_layers=3), "sliding_window"),
    (lambda: serving.kv_block("bert-base"), "decoder-only"),
    (lambda: serving.serving_plan("llama-3.1-8b", prompt_len=0, output_len=1), "prompt_len"),
    (lambda: serving.serving_plan("llama-3.1-8b", prompt_len=10, output_len=1, gpu_memory_utilization=1.5),
     "gpu_memory_utilization"),
    (lambda: serving.serving_plan("llama-3.1-8b", prompt_len=10, output_len=1, shared_prefix_len=11),
     "shared_prefix_len"),
    (lambda: serving.serving_plan("llama-3.1-8b", prompt_len=200_000, output_len=1), "positions"),
    (lambda: serving.serving_plan("llama-3.1-70b", gpu="t4", prompt_len=10, output_len=1), "no memory left"),
    (lambda: serving.serving_plan("llama-3.1-8b", gpu="nope", prompt_len=10, output_len=1), "unknown GPU"),
    (lambda: serving.shared_blocks(block_size=16, num_sequences=1, shared_prefix_len=0, own_tokens=0), "own_tokens"),
    (lambda: serving.transformers_pool("x", num_blocks=1), "KVBlock"),
    (lambda: serving.throughput_bounds("llama-3.1-8b", context_len=True), "context_len"),
])
def test_bad_input_is_one_line(call, word):
    with pytest.raises(ValueError) as e:
        call()
    assert word in str(e.value) and "\n" not in str(e.value)


def test_pure_module_imports_no_torch():
    tree = ast.parse((ROOT / "src" / "vramlab" / "serving.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"torch", "numpy", "matplotlib"}


# ------------------------------------------------------------------ against the stored measurement
def _stored():
    return json.loads(RESULTS.read_text())


def test_stored_file_has_provenance():
    prov = _stored()["provenance"]
    assert prov["device"] == "cpu" and prov["transformers"] and prov["torch"] and prov["date"]
    assert prov["command"].startswith("python -m vramlab.measure.serving")


def test_stored_pools_match_calculator_exactly():
    pools = _stored()["pools"]
    kinds = {(p["measured"]["sliding_layers"] > 0, p["measured"]["config"].get("num_key_value_heads")) for p in pools}
    assert len(pools) >= 10 and len(kinds) >= 4  # GQA, MQA, MHA, sliding, hybrid
    for p in pools:
        m = p["measured"]
        spec = specs.from_config({"model_type": m["model_type"], **m["config"]}, name=p["name"])
        block = serving.kv_block(spec, block_size=m["page_size"], kv_dtype=m["dtype"],
                                 sliding_window=p["sliding_window"],
                                 sliding_layers=m["sliding_layers"] if p["sliding_window"] else None)
        pool = serving.transformers_pool(block, num_blocks=m["num_blocks_asked"])
        assert pool.storage_bytes == m["storage_bytes"], p["name"]  # the cache tensor's real storage
        assert (pool.bytes_per_sector, pool.num_sectors, pool.num_blocks) == (
            m["bytes_per_sector"], m["num_sectors"], m["num_blocks"]), p["name"]
        full, sliding = block.pages_per_sequence(m["tokens"])
        assert m["pages_per_request"].get("full_attention", full) == full, p["name"]
        assert m["pages_per_request"].get("sliding_attention", sliding) == sliding, p["name"]
        assert pool.admitted(m["tokens"]) == m["admitted"], p["name"]


def test_stored_kv_quant_bytes_exact():
    base = specs.preset("llama-3.1-8b")
    for q in _stored()["kv_quant"]:
        one = dataclasses.replace(base, name="one-layer", num_layers=1, num_kv_heads=q["num_kv_heads"],
                                  head_dim=q["head_dim"], num_heads=q["num_kv_heads"])
        for dtype in ("fp32", "bf16", "fp16", "fp8", "int8"):
            if dtype in q:
                assert serving.kv_block(one, block_size=q["block_size"], kv_dtype=dtype).page_bytes == q[dtype], dtype
        assert serving.kv_block(one, block_size=q["block_size"], kv_dtype="int8").scale_bytes == q["int8_scale_bytes"]


def test_stored_live_runs_admit_and_preempt_as_predicted():
    """generate_batch admits as many requests as the pool holds at their prompt's length; when the
    pool cannot hold that many at prompt + output (`predicted_sustained` smaller), it preempts."""
    live = _stored()["live"]
    for run in live.values():
        assert run["finished"] == run["requests"]  # every request completed (queued, never dropped)
        assert run["max_active"] == run["predicted_admitted"] < run["requests"]
    assert live["fits"]["predicted_sustained"] == live["fits"]["predicted_admitted"]
    assert live["fits"]["preempted"] == 0
    assert live["preempts"]["predicted_sustained"] < live["preempts"]["predicted_admitted"]
    assert live["preempts"]["preempted"] > 0


def test_one_small_live_run():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from vramlab.measure.serving import measure_live

    r = measure_live(page_size=8, num_blocks=10, prompt_len=20, new_tokens=4, requests=5, seed=1)
    # ceil(24 / 8) = 3 blocks a request: 3 fit in 10 blocks, the other 2 wait and still finish
    assert r["predicted_admitted"] == r["predicted_sustained"] == 3
    assert r["max_active"] == 3 and r["finished"] == 5 and r["preempted"] == 0


def test_stored_memory_budget_pools_match_exactly():
    """transformers sizes its pool from a memory budget with its own activation/IO/mask reserve:
    reproduced byte for byte (no profile run is involved, so exact rather than within 5 %)."""
    pools = _stored()["budget_pools"]
    assert len(pools) >= 10 and any(p["measured"]["flash"] for p in pools)
    for p in pools:
        m = p["measured"]
        spec = specs.from_config({"model_type": m["model_type"], **m["config"]}, name=p["name"])
        pool = serving.transformers_pool_from_memory(
            spec, available_bytes=m["available_bytes"], block_size=m["page_size"], dtype=m["dtype"],
            sliding_window=p["sliding_window"], sliding_layers=m["sliding_layers"] if p["sliding_window"] else None,
            max_batch_tokens=m["max_batch_tokens_asked"], flash=m["flash"], logits_to_keep=m["logits_to_keep"])
        assert (pool.storage_bytes, pool.num_sectors, pool.num_blocks, pool.max_batch_tokens) == (
            m["storage_bytes"], m["num_sectors"], m["num_blocks"], m["max_batch_tokens"]), p["name"]
        # what it set aside plus the cache tensor fills the budget (to within the sectors' rounding)
        slack = m["available_bytes"] - (pool.storage_bytes + pool.reserved_bytes)
        assert 0 <= slack <= m["available_bytes"] // 100, p["name"]


def test_memory_budget_too_small_is_one_line():
    with pytest.raises(ValueError) as e:
        serving.transformers_pool_from_memory("llama-3.2-1b", available_bytes=1 << 20)
    assert "available_bytes" in str(e.value) and "\n" not in str(e.value)


def test_stored_prefix_sharing_matches_exactly():
    """Prefix sharing in transformers' cache (hash of full blocks, de-duplicated after each forward):
    the blocks held equal `shared_blocks`' count, the shared prefix's full blocks once."""
    cases = _stored()["prefix_sharing"]
    assert len(cases) >= 4 and any(c["predicted"]["saved"] == 0 for c in cases)
    for c in cases:
        assert c["blocks_held"] == c["predicted"]["with_sharing"], c
        assert c["predicted"] == serving.shared_blocks(block_size=c["page_size"], num_sequences=c["num_sequences"],
                                                       shared_prefix_len=c["shared_prefix_len"],
                                                       own_tokens=c["own_tokens"])
