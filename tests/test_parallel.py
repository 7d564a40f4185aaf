"""vramlab.parallel against the papers' formulas, an independent count of parameters, torch's own
DDP bucketing, and the layouts' micro-batches in flight against the schedule simulation
(tests/test_pipeline.py checks the simulation against the closed-form bubble)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

import vramlab
import vramlab.collectives
from vramlab import parallel as P
from vramlab import pipeline as PIPE
from vramlab.specs import from_config

# Korthikanti et al. 2022 (arXiv:2205.05198), Table 3: their models, all with s = 2048 and t = 8
KORTHIKANTI_MODELS = {"22B": dict(a=64, h=6144), "175B": dict(a=96, h=12288), "530B": dict(a=128, h=20480),
                      "1T": dict(a=160, h=25600)}


@pytest.mark.parametrize("name", KORTHIKANTI_MODELS)
def test_korthikanti_table2_exactly(name):
    a, h = KORTHIKANTI_MODELS[name]["a"], KORTHIKANTI_MODELS[name]["h"]
    s, b, t = 2048, 1, 8
    sbh = s * b * h
    paper = {  # Table 2, written out here from the paper
        ("none", 1, False): sbh * (34 + Fraction(5 * a * s, h)),
        ("none", t, False): sbh * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t)),
        ("none", t, True): Fraction(sbh, t) * (34 + Fraction(5 * a * s, h)),
        ("selective", t, False): sbh * (10 + Fraction(24, t)),
        ("selective", t, True): Fraction(34 * sbh, t),
        ("full", t, False): 2 * sbh,
    }
    for (recompute, tt, sp), expected in paper.items():
        got = P.korthikanti_layer_activations(s=s, b=b, h=h, a=a, t=tt, sp=sp, recompute=recompute)
        assert got == expected, (recompute, tt, sp)
    # the paper's headline: sequence parallelism + selective recompute cut activations ~5x vs TP alone
    ratio = paper[("none", t, False)] / paper[("selective", t, True)]
    assert 4.5 <= ratio <= 6.5  # 4.9x (530B) to 6.2x (22B)


def _megatron_like_gpt(L=2, h=256, a=4):
    """GPT-2's block with exact GELU (one saved tensor, as in Megatron), dropout everywhere, in pure
    16-bit with the scores materialised: the layer Korthikanti+22 count."""
    spec = vramlab.preset("gpt2")
    return dataclasses.replace(spec, name="megatron-like", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=a, head_dim=h // a,
                               intermediate_size=4 * h, activation="gelu", hidden_dropout=0.1, attention_dropout=0.1)


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_ledger_split_reproduces_korthikanti(t, sp):
    """The calculator's own ledger (the tensors PyTorch saves), split as Megatron splits it, equals
    the paper's per-layer formula plus the two layer norms' statistics (fp32 mean and rstd per token,
    which the paper leaves out)."""
    spec = _megatron_like_gpt()
    s, b = 128, 2
    got = P.layer_activation_bytes(spec, micro_batch_size=b, seq_len=s, tp=t, sp=sp, precision="bf16",
                                   attention="eager", device="cuda")
    paper = P.korthikanti_layer_activations(s=s, b=b, h=spec.hidden_size, a=spec.num_heads, t=t, sp=sp)
    norm_stats = Fraction(2 * 2 * 4 * s * b, t if sp else 1)
    assert got == paper + norm_stats


def _gpt2_rank_params_by_hand(t: int) -> int:
    h, L, V, n_pos = 768, 12, 50257, 1024
    per_layer = (4 * h  # two layer norms, replicated
                 + (h * 3 * h + 3 * h) // t  # c_attn: column-parallel, bias split
                 + h * h // t + h  # attention c_proj: row-parallel, bias replicated
                 + (h * 4 * h + 4 * h) // t  # c_fc
                 + 4 * h * h // t + h)  # mlp c_proj
    return -(-V // t) * h + n_pos * h + L * per_layer + 2 * h


@pytest.mark.parametrize("t", [1, 2, 4])
def test_tensor_parallel_parameters_per_rank(t):
    spec = vramlab.preset("gpt2")
    assert P.rank_params(spec, P.Layout(tp=t), 0) == _gpt2_rank_params_by_hand(t)
    if t == 1:
        assert P.rank_params(spec, P.Layout(), 0) == 124_439_808  # sum(p.numel()) of GPT2LMHeadModel


def test_pipeline_stages_cover_the_model_once_plus_the_tied_head():
    spec = vramlab.preset("gpt2")
    L = P.Layout(pp=4, micro_batches=4)
    per_stage = [P.rank_params(spec, L, k) for k in range(4)]
    h, V = 768, 50257
    assert sum(per_stage) == spec.params + V * h  # the last stage's copy of the tied embedding
    block = (spec.params - V * h - 1024 * h - 2 * h) // 12
    assert per_stage[1] == per_stage[2] == 3 * block
    untied = vramlab.preset("pythia-160m")
    assert sum(P.rank_params(untied, P.Layout(pp=2), k) for k in range(2)) == untied.params


def test_ddp_buckets_match_torch():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    spec = dataclasses.replace(vramlab.preset("gpt2"), num_layers=3)
    sizes = [n for _, n in spec.param_tensors()]
    tensors = [torch.empty(n, device="meta") for n in reversed(sizes)]  # the order gradients are ready
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [1 << 20, 25 << 20], [False] * len(tensors))
    expected = [sum(tensors[i].numel() * 4 for i in bucket) for bucket in indices]
    assert P.ddp_buckets([4 * n for n in sizes]) == expected


def test_ddp_overlap_hides_communication_behind_a_long_backward():
    buckets = P.ddp_buckets([4 * n for _, n in vramlab.preset("gpt2").param_tensors()])
    slow = P.ddp_overlap(buckets, n=8, backward_seconds=10.0, link="nvlink4")
    # a long backward hides every bucket but the last: the embedding's gradient (used first in the
    # forward, and tied to the head) is complete only when the backward ends
    last = vramlab.collectives.collective_time("all_reduce", 8, buckets[-1], "nvlink4")
    assert slow["exposed_s"] == pytest.approx(last) and slow["hidden_share"] == pytest.approx(1 - last / slow["communication_s"])
    fast = P.ddp_overlap(buckets, n=8, backward_seconds=0.0, link="ethernet-100g")
    assert fast["exposed_s"] == pytest.approx(fast["communication_s"]) and fast["hidden_share"] == pytest.approx(0)


def test_layout_memory_composes_with_memory():
    """One device, one stage: the layout estimate's model states are memory.model_states'."""
    spec = vramlab.preset("gpt2")
    (one,) = P.estimate_layout(spec, P.Layout(), micro_batch_size=2, seq_len=256, precision="bf16-mixed")
    states = vramlab.memory.model_states(spec, precision="bf16-mixed", optimizer="adamw")
    assert (one.parameters, one.gradients, one.optimizer_states) == (states.parameters, states.gradients,
                                                                    states.optimizer_states)
    ddp = P.estimate_layout(spec, P.Layout(dp=4), micro_batch_size=2, seq_len=256)[0]
    assert ddp.gradients == 2 * one.gradients  # DDP's bucket copy
    tp = P.estimate_layout(spec, P.Layout(tp=4), micro_batch_size=2, seq_len=256)[0]
    assert tp.total < one.total and tp.activations < one.activations


def test_1f1b_needs_less_than_gpipe_on_the_first_stage():
    kw = dict(micro_batch_size=4, seq_len=1024, precision="bf16")  # pure bf16: no autocast copies shared by all
    gpipe = P.estimate_layout("llama-3.2-1b", P.Layout(pp=4, micro_batches=16, schedule="gpipe"), **kw)
    one = P.estimate_layout("llama-3.2-1b", P.Layout(pp=4, micro_batches=16, schedule="1f1b"), **kw)
    assert one[0].activations * 4 == gpipe[0].activations  # 4 micro-batches in flight instead of 16


def test_communication_volumes():
    spec = vramlab.preset("gpt2")
    c = P.communication(spec, P.Layout(dp=8, tp=2, pp=2, micro_batches=4), micro_batch_size=2, seq_len=1024)
    assert c["tp"]["bytes"] == 2 * 1024 * 768 * 2 and c["tp"]["calls"] == 4 * 6 * 4  # 4 per block, 6 blocks, 4 micro
    assert c["dp"]["bytes"] == max(P.rank_params(spec, P.Layout(tp=2, pp=2, micro_batches=4), k) for k in (0, 1)) * 4  # AMP: fp32 grads
    assert c["pp"]["calls"] == 2 * 4  # one activation forward, one gradient back, per micro-batch
    single = P.communication(spec, P.Layout(), micro_batch_size=2, seq_len=1024)
    assert single["dp"]["seconds"] == single["tp"]["seconds"] == single["pp"]["seconds"] == 0


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=0), "tp must be"), (dict(pp=-1), "pp must be"), (dict(dp=2.5), "dp must be"),
    (dict(sp=True), "needs tp > 1"), (dict(schedule="zigzag"), "unknown schedule"),
    (dict(pp=4, micro_batches=6, schedule="interleaved", chunks=2), "multiple of pp"),
    (dict(pp=1, schedule="interleaved"), "needs pp > 1"), (dict(chunks=2), "interleaved schedule only"),
    (dict(micro_batches=True), "micro_batches must be"),
])
def test_bad_layouts_are_one_line_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        P.Layout(**kw)


def test_layouts_the_model_cannot_take():
    with pytest.raises(ValueError, match="tp=5 must divide"):
        P.rank_params("gpt2", P.Layout(tp=5), 0)
    with pytest.raises(ValueError, match="decoder-only"):
        P.estimate_layout("bert-base", P.Layout(tp=2), micro_batch_size=1, seq_len=128)
    with pytest.raises(ValueError, match="fewer than"):
        P.rank_params("gpt2", P.Layout(pp=16, micro_batches=16), 0)
    with pytest.raises(ValueError, match="stage must be"):
        P.rank_params("gpt2", P.Layout(pp=2), 2)
    with pytest.raises(ValueError, match="positions|seq_len"):
        P.estimate_layout("gpt2", P.Layout(), micro_batch_size=1, seq_len=4096)
    import numpy as np

    assert P.Layout(tp=np.int64(2)).tp == 2  # numpy integers are whole numbers too


@pytest.mark.parametrize("call, msg", [
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=-1, seq_len=128), "batch_size"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, tp=0), "tp must be"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, precision="fp8"), "precision"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, sp="yes"), "sp must be"),
    (lambda: P.korthikanti_layer_activations(s=1, b=1, h=1, a=1, t=2, sp="yes"), "sp must be"),
    (lambda: P.ddp_overlap("abc", n=2, backward_seconds=1, link="nvlink4"), "non-empty list"),
    (lambda: P.ddp_overlap([1.5], n=2, backward_seconds=1, link="nvlink4"), r"buckets\[0\] must be"),
    (lambda: P.communication("gpt2", "dp=2", micro_batch_size=1, seq_len=8), "Layout"),
    (lambda: P.rank_params("gpt2", {"tp": 2}, 0), "Layout"),
    (lambda: P.fits("gpt2", P.Layout(), "h200", micro_batch_size=0, seq_len=8), "micro_batch_size"),
    (lambda: P.fits("gpt2", P.Layout(), "h200", micro_batch_size=1, seq_len=8, device="cpu"), "GPU"),
    (lambda: P.estimate_layout("gpt2", P.Layout(tp=2), micro_batch_size=1, seq_len=8, implementation="nemo"),
     "unknown implementation 'nemo'"),
    (lambda: P.estimate_layout("gpt2", P.Layout(), micro_batch_size=1, seq_len=8, keep_gradients=1), "keep_gradients"),
    (lambda: P.Layout(dp=2, zero=2), "zero must be 0 or 1"),
    (lambda: P.Layout(zero=1), "needs dp > 1"),
], ids=["negative-batch", "tp-0", "unknown-precision", "sp-string", "korthikanti-sp-string", "buckets-string",
        "bucket-fraction", "layout-string", "layout-dict", "fits-batch-0", "fits-cpu", "tp-implementation",
        "keep-gradients-int", "zero-2", "zero-without-dp"])
def test_bad_arguments_are_one_line_value_errors(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_tensor_parallel_splits_q_k_v_of_multi_head_attention():
    """With as many query heads as h/d, q, k and v are h wide like the replicated tensors; they are
    split all the same. Replicated per token in this Llama block on the CPU in fp32: two norms' input
    and normalized output (4 x h x 4 bytes) and rsqrt (2 x 4), the q/k/v input and the MLP input
    (2 x h x 4): everything else halves at tp=2 (cf. the 8,401,912 bytes per block lab 3 measured)."""
    spec = from_config(dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                            max_position_embeddings=512, tie_word_embeddings=False), name="mha")
    kw = dict(micro_batch_size=4, seq_len=128, precision="fp32", device="cpu")
    one = P.layer_activation_bytes(spec, **kw)
    replicated = 512 * (6 * 256 * 4 + 2 * 4)
    assert P.layer_activation_bytes(spec, tp=2, **kw) == replicated + (one - replicated) // 2
    assert abs(P.layer_activation_bytes(spec, tp=2, **kw) - 8_401_912) / 8_401_912 < 0.001


def test_stage_output_kept_per_micro_batch_in_flight():
    """keep_stage_output: a non-last stage holds one b x s x h output per micro-batch in flight (GPipe,
    m = 8: eight), the last stage its logits (torch.distributed.pipelining; Megatron-LM frees both)."""
    spec = from_config(dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                            max_position_embeddings=512, tie_word_embeddings=False), name="mha")
    kw = dict(micro_batch_size=4, seq_len=128, precision="fp32", device="cpu")
    layout = P.Layout(pp=2, micro_batches=8, schedule="gpipe")
    kept = P.estimate_layout(spec, layout, **kw)
    freed = P.estimate_layout(spec, layout, keep_stage_output=False, **kw)
    assert kept[0].activations - freed[0].activations == 8 * 4 * 128 * 256 * 4
    # the last stage keeps each micro-batch's output, its logits (the loss reads them in the backward);
    # its input is torch's receive buffer, counted with the buffers, where Megatron's is a fresh tensor
    assert kept[1].activations - freed[1].activations == 8 * 4 * 128 * (512 - 256) * 4
    assert kept[1].other - freed[1].other == 8 * 4 * 128 * 256 * 4  # the activations' receive buffers
    with pytest.raises(ValueError, match="keep_stage_output"):
        P.estimate_layout(spec, layout, keep_stage_output="yes", **kw)


# ----------------------------------------------------------------------------- one device = estimate_training
@pytest.mark.parametrize("name, b, s, precision, recompute", [
    ("opt-125m", 280, 512, "bf16-mixed", "none"), ("llama-3.2-1b", 30, 512, "fp32", "none"),
    ("gpt2", 8, 1024, "bf16-mixed", "full"), ("pythia-160m", 4, 1024, "fp16-mixed", "selective"),
    ("llama-3.2-1b", 2, 2048, "bf16", "none")])
def test_one_device_layout_is_estimate_training(name, b, s, precision, recompute):
    """A 1 x 1 x 1 layout with the gradients freed between steps is the single-device estimate, phase
    for phase: it used to miss the logits gradient and the tied embedding's backward (opt-125m,
    micro-batch 280 x 512, bf16-mixed: 71.3 GiB against 124.8 GiB)."""
    kw = dict(seq_len=s, precision=precision, recompute=recompute)
    (one,) = P.estimate_layout(name, P.Layout(), micro_batch_size=b, keep_gradients=False, **kw)
    single = vramlab.estimate_training(name, batch_size=b, **kw)
    assert (one.to_dict(), one.phase) == (single.to_dict(), single.phase)
    # kept gradients (Megatron's buffer, set_to_none=False) can only add
    (kept,) = P.estimate_layout(name, P.Layout(), micro_batch_size=b, **kw)
    assert kept.total >= single.total


def test_layout_fits_is_memory_fit():
    """One definition of "fits" (fitting.device_fit): llama-3.2-1b at 1024 tokens, bf16-mixed, on an H100:
    the training calculator, a 1 x 1 x 1 layout, the checkpointing calculator's plan "none" and
    zero's one-rank check all use it. Before, a 1 x 1 x 1 layout said 23 and llama-3.2-1b fp32 at
    micro-batch 30 x 512 "fitted" an H100 where estimate_training alone is 85 GiB."""
    from vramlab import checkpointing as CK

    kw = dict(seq_len=1024, precision="bf16-mixed")
    largest = vramlab.fit("llama-3.2-1b", "h100", **kw).max_batch_size
    layout = P.fits("llama-3.2-1b", P.Layout(), "h100", micro_batch_size=1, keep_gradients=False, **kw)
    assert layout.max_batch_size == largest
    for b, ok in ((largest, True), (largest + 1, False)):
        assert CK.evaluate("llama-3.2-1b", "none", batch_size=b, gpu="h100", **kw).fit.fits is ok
        assert P.fits("llama-3.2-1b", P.Layout(), "h100", micro_batch_size=b, keep_gradients=False, **kw).fits is ok
    assert not P.fits("llama-3.2-1b", P.Layout(), "h100", micro_batch_size=30, seq_len=512, precision="fp32").fits


def test_dtensor_embedding_gradient_is_dense():
    """PyTorch's DTensor vocabulary-parallel embedding builds the full V x e gradient on every rank in
    its backward (Megatron's keeps V/t rows): the first stage's embedding backward holds it."""
    kw = dict(micro_batch_size=1, seq_len=128, precision="fp32", device="cpu", keep_gradients=False)
    spec = vramlab.preset("llama-3.2-1b")
    layout = P.Layout(tp=4, pp=2, micro_batches=2)
    meg = P.estimate_layout(spec, layout, **kw)[0]
    dt = P.estimate_layout(spec, layout, implementation="dtensor", **kw)[0]
    V, h = spec.vocab_size, spec.hidden_size
    assert dt.phase == "embedding backward (gradient accumulation)" and dt.total > meg.total
    assert dt.temporaries == V * h * 4 + V // 4 * h * 4  # the dense gradient beside the rank's shard


def test_zero1_axis_shards_the_optimizer_states():
    kw = dict(micro_batch_size=1, seq_len=2048, recompute="full")
    plain = P.estimate_layout("llama-3.1-8b", P.Layout(dp=8, tp=2), **kw)[0]
    z1 = P.estimate_layout("llama-3.1-8b", P.Layout(dp=8, tp=2, zero=1), **kw)[0]
    assert abs(z1.optimizer_states * 8 - plain.optimizer_states) <= 8 * 8  # 8 B/param of AdamW, one shard of 8
    assert z1.parameters == plain.parameters and z1.total < plain.total


def test_in_flight_closed_forms_are_the_simulation():
    for p, m in ((4, 8), (8, 4), (3, 9)):
        for schedule in ("gpipe", "1f1b"):
            assert P.in_flight(P.Layout(pp=p, micro_batches=m, schedule=schedule)) == PIPE.simulate(p, m, schedule).in_flight


def test_first_1f1b_stage_holds_about_all_layers():
    """Korthikanti+22 (section 4.2.3): under 1F1B the first stage holds p micro-batches of L/p layers,
    about L layers' activations whatever p is: without recompute, pipelining does not shrink them."""
    spec = vramlab.preset("llama-3.1-8b")
    kw = dict(micro_batch_size=1, seq_len=4096, keep_stage_output=False, precision="bf16")  # Megatron: no autocast copies
    layer = P.layer_activation_bytes(spec, micro_batch_size=1, seq_len=4096, tp=8, sp=True, precision="bf16")
    for p in (2, 4, 8):
        first = P.estimate_layout(spec, P.Layout(tp=8, sp=True, pp=p, micro_batches=4 * p), **kw)[0]
        assert P.in_flight(P.Layout(pp=p, micro_batches=4 * p))[0] == p
        assert spec.num_layers * layer <= first.activations <= 1.1 * spec.num_layers * layer


def test_planner_finds_what_fits_llama_70b_and_405b():
    """The layouts chapter 3 reports: Llama-3.1-70B does not fit 8 H100s in any dp x tp x pp layout
    (16 B/param of model states over 8 GPUs is 140 GB each), fits 64 with tensor parallelism inside
    the node; Llama-3.1-405B fits 512. Each plan's
    verdict is parallel.fits's."""
    none = P.plan_layouts("llama-3.1-70b", 8, "h100", seq_len=4096, global_batch=64)
    assert none and not any(p.fit.fits for p in none)
    plans = P.plan_layouts("llama-3.1-70b", 64, "h100", seq_len=4096, global_batch=512)
    best = plans[0]
    assert best.fit.fits and best.layout.tp > 1 and best.layout.devices == 64
    again = P.fits("llama-3.1-70b", best.layout, "h100", micro_batch_size=1, seq_len=4096, recompute=best.recompute)
    assert again.fits and again.needed == best.fit.needed
    fitting = [p for p in plans if p.fit.fits]
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in zip(fitting, fitting[1:]))
    # split over 8 GPUs or fewer (tp x pp <= 8), 16 B/param of model states leave no room, ZeRO-1 or not
    assert not any(p.fit.fits for p in plans if p.layout.tp * p.layout.pp <= 8)
    big = P.plan_layouts("llama-3.1-405b", 512, "h100", seq_len=4096, global_batch=1024)
    assert big[0].fit.fits and big[0].layout.tp > 1


@pytest.mark.parametrize("kw, msg", [(dict(gpus=0), "gpus must be"), (dict(global_batch=0), "global_batch"),
                                     (dict(mfu=1.5), "mfu"), (dict(recomputes=("sometimes",)), "recompute"),
                                     (dict(gpu="nope"), "GPU|gpu")])
def test_planner_bad_input(kw, msg):
    args = dict(gpus=8, gpu="h100", seq_len=1024, global_batch=16) | kw
    with pytest.raises(ValueError, match=msg):
        P.plan_layouts("llama-3.2-1b", **args)


def test_interleaved_schedule_holds_its_sends_to_the_end_of_the_step():
    """torch's ScheduleInterleaved1F1B waits on its sends when the step ends: each backward done adds the
    output it had sent (all but the last virtual stage) and the input gradient it sends (all but the
    first). p = 4, v = 2, m = 8, device 1 (virtual stages 1 and 5: both directions): the warm-up runs
    (4 - 1 - 1) x 2 + 4 = 8 forwards, so 9 pairs are in flight at each of the 8 steady backwards, the
    last after 7 backwards have sent 2 tensors each; every input is a receive buffer. Single-stage
    schedules wait on each send before the next: nothing pends; nor on NCCL, whose process group frees
    a completed send's tensors at its next call."""
    lay = P.Layout(pp=4, micro_batches=8, schedule="interleaved", chunks=2)
    assert P._schedule_points(lay, 1, 9, True)[0] == (9, 9, 14)
    # device 0: its chunk 0 reads the embedding (no receive buffer), chunk 1 receives from device 3
    n, got, sends = P._schedule_points(lay, 0, 11, True)[0]
    assert n == 11 and got < n and sends > 0
    assert P._schedule_points(lay, 1, 9, False) == [(9, 0, 0)]  # Megatron: frees sent outputs
    assert P._schedule_points(lay, 1, 9, True, sends_pend=False) == [(9, 9, 0)]  # NCCL: freed on completion
    assert P._schedule_points(P.Layout(pp=4, micro_batches=8, schedule="1f1b"), 2, 2, True) == [(2, 2, 0)]
    # pending sends only add: the interleaved estimate is at least the one without them
    spec = from_config(dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                            num_attention_heads=8, vocab_size=4096, max_position_embeddings=512), name="neox")
    kw = dict(micro_batch_size=4, seq_len=128, precision="fp32", device="cpu")
    torch_pp = P.estimate_layout(spec, lay, **kw)
    megatron = P.estimate_layout(spec, lay, keep_stage_output=False, **kw)
    assert all(a.total > b.total for a, b in zip(torch_pp, megatron))
