"""`vramlab.measure.serving`: transformers' PagedAttentionCache measured on the CPU, one small
configuration each way (a num_blocks budget, a memory budget, prefix sharing, quantized pages), against
`vramlab.serving`; and the command refuses a bad --out in one line before any work."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramlab import serving, specs  # noqa: E402
from vramlab.measure import serving as servlab  # noqa: E402

GQA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
           vocab_size=256, max_position_embeddings=1024)


def _block(page_size, dtype="fp16"):
    spec = specs.from_config({"model_type": "llama", **GQA}, name="gqa")
    return serving.kv_block(spec, block_size=page_size, kv_dtype=dtype)


def test_pool_from_num_blocks():
    m = servlab.measure_pool("llama", GQA, page_size=8, num_blocks=17, dtype="fp16", tokens=30)
    pool = serving.transformers_pool(_block(8), num_blocks=17)
    assert m["storage_bytes"] == pool.storage_bytes and m["num_sectors"] == pool.num_sectors
    assert m["pages_per_request"] == {"full_attention": 4} and m["admitted"] == pool.admitted(30) == 4


def test_pool_from_memory_budget():
    m = servlab.measure_pool_from_memory("llama", GQA, page_size=16, available_bytes=16 << 20, dtype="fp32",
                                         max_batch_tokens=256)
    spec = specs.from_config({"model_type": "llama", **GQA}, name="gqa")
    pool = serving.transformers_pool_from_memory(spec, available_bytes=16 << 20, block_size=16, dtype="fp32",
                                                 max_batch_tokens=256)
    assert (m["storage_bytes"], m["num_sectors"], m["max_batch_tokens"]) == (
        pool.storage_bytes, pool.num_sectors, pool.max_batch_tokens)


def test_prefix_sharing_and_kv_quant():
    m = servlab.measure_prefix_sharing(num_sequences=3, shared_prefix_len=40, own_tokens=9, page_size=16)
    assert m["blocks_held"] == serving.shared_blocks(block_size=16, num_sequences=3, shared_prefix_len=40,
                                                     own_tokens=9)["with_sharing"] == 2 + 3 * 2
    q = servlab.measure_kv_quant(block_size=8, num_kv_heads=2, head_dim=16)
    assert q["fp8"] == 2 * 8 * 2 * 16 and q["int8"] == 2 * 8 * 2 * 16 + 2 * 8 * 2 * 4


@pytest.mark.slow
def test_command_refuses_bad_out_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.serving", "--out", str(tmp_path / "afile" / "x.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a folder" in r.stderr
