"""What torch.compile keeps for backward (chapter 7): `checkpointing.compiled_block_saved` /
`compiled_activations` (the min-cut partitioner's default cut and the activation-memory budget's
bound) and `checkpointing.loss_bytes` (whole and chunked cross-entropy), held against independent
measurements: saved_tensors_hooks on real blocks run eagerly and through inductor (the stored CPU
run, `python -m vramlab.measure.checkpointing compile`, and one small compile live), live tensors
for the loss."""

import dataclasses
import json
from pathlib import Path

import pytest

from vramlab import activations as A
from vramlab import checkpointing as C
from vramlab.specs import from_config, preset

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "results" / "checkpointing" / "compile_cpu.json"


def _stored():
    return json.loads(STORED.read_text())


def _spec_of(row):
    from vramlab.measure.checkpointing import compile_spec

    return compile_spec({"gpt2 (no dropout)": "gpt2", "llama-small": "llama-small"}.get(row["model"], row["model"]))


# --------------------------------------------------------------- the estimator against the stored CPU-inductor run

def test_the_stored_run_has_provenance_and_four_families():
    res = _stored()
    assert res["mode"] == "cpu-inductor" and res["provenance"]["torch"] and res["command"].startswith("python -m")
    assert {r["family"] for r in res["blocks"]} == {"gpt2", "llama", "gpt_neox", "opt"}


@pytest.mark.parametrize("row", _stored()["blocks"] if STORED.exists() else [], ids=lambda r: r["model"])
def test_compiled_default_cut_is_predicted_to_the_byte(row):
    pytest.importorskip("torch")
    spec = _spec_of(row)
    est = C.compiled_activations(spec, batch_size=row["batch_size"], seq_len=row["seq_len"])
    default = next(c for c in row["compiled"] if c["memory_budget"] == 1.0)
    assert default["backward_ok"]
    assert est["compiled"] == default["measured"], (spec.name, est["saved"], default["shapes"])
    assert est["eager"] == row["eager_sdpa"]["measured"]  # the ledger's block, the same hooks
    assert est["compiled"] <= est["eager"]  # the partitioner never keeps more than eager autograd


@pytest.mark.parametrize("row", _stored()["blocks"] if STORED.exists() else [], ids=lambda r: r["model"])
def test_the_budget_bounds_what_the_partitioner_keeps(row):
    pytest.importorskip("torch")
    spec = _spec_of(row)
    for c in row["compiled"]:
        est = C.compiled_activations(spec, batch_size=row["batch_size"], seq_len=row["seq_len"],
                                     memory_budget=c["memory_budget"])
        assert c["backward_ok"]
        if c["memory_budget"] == 0.0:  # only the region's input: full checkpointing of the block
            assert c["measured"] == est["minimum"] == est["budget"]
        else:  # the knapsack keeps at most the budget (its DP is quantized: 1 % slack)
            assert est["minimum"] <= c["measured"] <= 1.01 * est["budget"], (spec.name, c["memory_budget"])


@pytest.mark.parametrize("row", _stored()["blocks"] if STORED.exists() else [], ids=lambda r: r["model"])
def test_fused_attention_keeps_no_scores_and_eager_attention_does(row):
    spec = _spec_of(row)
    b, s = row["batch_size"], row["seq_len"]
    for attention in ("sdpa", "eager"):
        pred = A.activation_bytes(spec, batch_size=b, seq_len=s, attention=attention, device="cpu")["full"][0]
        assert pred == row[f"eager_{attention}"]["measured"], (spec.name, attention)
    # the measured difference is the ledger's: eager attention keeps (b, a, s, s) probabilities, SDPA none
    assert any(x.per_score for x in A.layer_saved(spec, attention="eager", device="cpu"))
    assert not any(x.per_score for x in A.layer_saved(spec, attention="sdpa", device="cpu"))


# --------------------------------------------------------------- the estimator's own behaviour

def test_the_ledger_follows_the_blocks_structure():
    gpt2 = dataclasses.replace(preset("gpt2"), attention_dropout=0.0, hidden_dropout=0.0)
    h, i, a = gpt2.hidden_size, gpt2.intermediate_size, gpt2.num_heads
    assert sum(x.width for x in C.compiled_block_saved(gpt2)) == 8 * h + 2 * i + a + 4
    est = C.compiled_activations(gpt2, batch_size=2, seq_len=128)
    assert est["compiled_layers"] == gpt2.num_layers * est["compiled"] and est["minimum"] == 2 * 128 * h * 4
    half = C.compiled_activations(gpt2, batch_size=2, seq_len=128, memory_budget=0.5)["budget"]
    assert est["minimum"] < half < est["compiled"]


@pytest.mark.parametrize("kw, match", [
    (dict(model="gpt2"), "dropout"), (dict(model="bert-base"), "decoder-only"),
    (dict(model="llama-3.2-1b", memory_budget=1.5), "memory_budget"),
    (dict(model="llama-3.2-1b", memory_budget=-0.1), "memory_budget"),
    (dict(model="llama-3.2-1b", batch_size=0), "batch_size")])
def test_bad_input_is_one_clear_error(kw, match):
    kw = {"batch_size": 1, "seq_len": 64, **kw}
    with pytest.raises(ValueError, match=match):
        C.compiled_activations(kw.pop("model"), **kw)


def test_loss_bytes_refuses_bad_sizes():
    with pytest.raises(ValueError, match="chunk_tokens"):
        C.loss_bytes(tokens=8, hidden_size=4, vocab_size=16, chunk_tokens=0)
    with pytest.raises(ValueError, match="vocab_size"):
        C.loss_bytes(tokens=8, hidden_size=4, vocab_size=-1)


# --------------------------------------------------------------- live measurements (small: seconds, one compile)

@pytest.mark.parametrize("tokens, hidden, vocab, chunk", [(384, 48, 3000, None), (384, 48, 3000, 96),
                                                          (200, 16, 5000, 64), (200, 16, 5000, 1000)])
def test_chunked_cross_entropy_against_live_tensors(tokens, hidden, vocab, chunk):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from vramlab.measure.checkpointing import cross_entropy_bytes

    m = cross_entropy_bytes(tokens=tokens, hidden_size=hidden, vocab_size=vocab, chunk_tokens=chunk)
    est = C.loss_bytes(tokens=tokens, hidden_size=hidden, vocab_size=vocab, chunk_tokens=chunk)
    assert m["max_grad_diff"] < 1e-5  # the chunked loss is the loss
    assert abs(m["saved"] - est["saved"]) <= 64  # (nll_loss keeps a scalar total weight)
    assert abs(m["peak"] - est["peak"]) <= 0.03 * est["peak"], (m, est)


@pytest.mark.slow
def test_one_small_block_compiled_live_matches_the_estimate():
    """A block with shapes no stored run has (Llama-style, GQA 4:1, gated SiLU MLP): one inductor compile."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from vramlab.measure.checkpointing import block_saved_bytes

    spec = from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 1,
                        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128,
                        "max_position_embeddings": 128, "tie_word_embeddings": True, "hidden_act": "silu"},
                       name="tiny-gqa")
    m = block_saved_bytes(spec, batch_size=2, seq_len=32, compiled=True)
    assert m["backward_ok"]
    assert m["bytes"] == C.compiled_activations(spec, batch_size=2, seq_len=32)["compiled"], m["shapes"]


@pytest.mark.parametrize("argv, says", [(["--models", "gpt5"], "unknown model"), (["--models", ""], "--models"),
                                        (["--seq-len", "0"], "--seq-len"), (["--bogus"], "unrecognized")])
def test_the_command_refuses_in_one_line_before_any_compile(argv, says, capsys):
    pytest.importorskip("torch")
    from vramlab.measure.checkpointing import compile_main

    assert compile_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m vramlab.measure.checkpointing compile: error: ") and says in err[0]


@pytest.mark.slow
def test_the_compile_run_on_cuda_is_a_campaign_step_and_refuses_without_a_gpu():
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the campaign runs it")
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.checkpointing", "compile", "--device", "cuda"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--device cuda needs a CUDA GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gpu_campaign", root / "benchmarks" / "gpu_campaign.py")
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    assert "compile" in campaign.STEPS
