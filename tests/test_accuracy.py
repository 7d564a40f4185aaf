"""The estimator against traced peaks (FakeTensorMode + MemTracker on the CPU): the issue's target
is every fp32 case within 5 % and the median within 2 %. The expected values are measurements of
real transformers models, never the estimator's own output."""

import importlib.util
import random
import statistics
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramlab import estimate_training, from_config  # noqa: E402
from vramlab.measure.memory import measure_training  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "estimator_accuracy", Path(__file__).resolve().parents[1] / "benchmarks" / "estimator_accuracy.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
def test_ci_subset_within_target():
    rows = [bench.run_case(*bench.CASES[i], mode="trace") for i in bench.CI_SUBSET]
    assert len({r["model"].split("-")[0] for r in rows}) >= 5  # families covered
    errors = {r["case"]: r["error_pct"] for r in rows}
    assert all(abs(e) <= 5 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= 2, errors


def _unseen(seed):
    """Small configs of shapes the estimator was never tuned on, one per family."""
    r = random.Random(1000 + seed)
    a = r.choice([2, 4, 6])
    h = a * r.choice([16, 24, 32])
    kv = r.choice([k for k in (1, 2, a) if a % k == 0])
    L, V, I = r.randint(1, 3), r.randint(500, 3000), r.choice([64, 160, 256, 384])
    p = r.choice([0.0, 0.1])
    return [
        transformers.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_inner=I, resid_pdrop=p,
                                embd_pdrop=p, attn_pdrop=p, activation_function=r.choice(["gelu_new", "relu", "gelu"])),
        transformers.GPTNeoXConfig(hidden_size=h, num_attention_heads=a, num_hidden_layers=L, vocab_size=V,
                                   intermediate_size=I, use_parallel_residual=r.random() < 0.5),
        transformers.OPTConfig(hidden_size=h, num_attention_heads=a, num_hidden_layers=L, vocab_size=V, ffn_dim=I,
                               dropout=p),
        transformers.LlamaConfig(hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, num_hidden_layers=L,
                                 vocab_size=V, intermediate_size=I, tie_word_embeddings=r.random() < 0.5),
        transformers.BertConfig(hidden_size=h, num_attention_heads=a, num_hidden_layers=L, vocab_size=V,
                                intermediate_size=I, hidden_dropout_prob=p, attention_probs_dropout_prob=p),
        transformers.T5Config(d_model=h, d_kv=r.choice([16, 32]), num_heads=a, num_layers=L, d_ff=I, vocab_size=V,
                              feed_forward_proj=r.choice(["relu", "gated-gelu"]), dropout_rate=p),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_unseen_configs_fp32(seed):
    r = random.Random(seed)
    for cfg in _unseen(seed):
        spec = from_config(cfg)
        kw = dict(batch_size=r.choice([1, 2, 4, 8]), seq_len=r.choice([32, 64, 128, 256]),
                  attention=r.choice(["eager", "sdpa"]), optimizer_impl=r.choice(["foreach", "for-loop", "fused"]),
                  optimizer=r.choice(["adamw", "adamw", "sgd", "sgd-momentum"]))
        measured = measure_training(spec, mode="trace", **kw).total
        est = estimate_training(spec, device="cpu", **kw).total
        assert abs(est - measured) / measured <= 0.05, (cfg.model_type, kw, est, measured)
