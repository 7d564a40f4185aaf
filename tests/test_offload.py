"""vramlab.offload against the H100's save_on_cpu measurements (benchmarks/results/h100/offload_h100.jsonl),
the PCIe specification's rates, and schedules whose answers follow from arithmetic alone."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from vramlab import offload as O
from vramlab import specs

ROOT = Path(__file__).resolve().parents[1]
CASES = {"llama-3.2-1b b=4 s=2048 bf16": ("llama-3.2-1b", 4, 2048), "gpt2 b=16 s=1024 bf16": ("gpt2", 16, 1024)}


def _h100():
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "results" / "h100" / "offload_h100.jsonl").read_text().splitlines()]
    base = {r["case"]: r for r in rows if r["probe"] == "baseline"}
    return [(r, base[r["case"]]) for r in rows if r["probe"] == "save_on_cpu"]


def test_offload_is_pure_python(assert_pure_python):
    assert_pure_python("import vramlab.offload as o; o.activation_offload('gpt2', batch_size=1, seq_len=64); "
                       "o.smallest_resident([1, 2, 3], [1, 1, 1], link_GBps=1)")


@pytest.mark.parametrize("gpu, gen, gbps", [("h100", 5, 63.0), ("a100-80gb", 4, 31.5), ("gtx-1060", 3, 15.76)])
def test_host_link_is_the_pcie_rate(gpu, gen, gbps):
    """PCI-SIG: 8, 16, 32 GT/s per lane with 128b/130b coding, x16: 15.75, 31.5, 63.0 GB/s each way."""
    g = __import__("vramlab").specs.gpu(gpu)
    assert O.pcie_generation(g) == gen
    lane_gts = {3: 8, 4: 16, 5: 32}[gen]
    assert O.host_link_GBps(gpu) == pytest.approx(lane_gts * 128 / 130 / 8 * 16, rel=2e-3)
    assert O.host_link_GBps(gpu) == pytest.approx(gbps, rel=2e-3)
    assert O.host_link_GBps(gpu, pinned=False) < O.host_link_GBps(gpu)


def test_save_on_cpu_gpu_peak_against_the_h100():
    """The GPU's peak under save_on_cpu(pin_memory=True), both stored cases, within 5 % of
    torch.cuda.max_memory_allocated(); the baseline's within 5 % too (what offload removes)."""
    for off, base in _h100():
        name, b, s = CASES[off["case"]]
        got = O.activation_offload(name, batch_size=b, seq_len=s, precision="bf16-mixed", gpu="h100")
        assert abs(got.gpu_peak.total - off["peak_allocated"]) <= 0.05 * off["peak_allocated"], (name, got.gpu_peak.total)
        assert abs(got.baseline_peak.total - base["peak_allocated"]) <= 0.05 * base["peak_allocated"]


def test_save_on_cpu_step_time_against_the_h100():
    """Step time = the measured baseline step + both copies at SAVE_ON_CPU_EFFICIENCY of PCIe 5.0 x16.
    The efficiency was calibrated on llama-3.2-1b, so that case checks only the arithmetic (5 %);
    GPT-2 was not used to calibrate it and must come within 25 %."""
    for off, base in _h100():
        name, b, s = CASES[off["case"]]
        baseline = sum(base["step_seconds"]) / len(base["step_seconds"])
        measured = sum(off["step_seconds"]) / len(off["step_seconds"])
        got = O.activation_offload(name, batch_size=b, seq_len=s, gpu="h100", baseline_seconds=baseline)
        assert abs(got.step_seconds - measured) <= (0.05 if name.startswith("llama") else 0.25) * measured, (name, got.step_seconds)
        # the naive estimate (nominal rate, one way) misses most of the cost: the reason for the calibration
        naive = baseline + O.transfer_seconds(got.moved_bytes, "h100")
        assert naive < 0.75 * measured


def test_host_bytes_against_the_h100_host():
    """Host memory under save_on_cpu: every saved tensor in a pinned block rounded up to a power of
    two. GPT-2 (whose saved tensors are 3/2 x 2^k and 9/8 x 2^k bytes, so the rounding matters)
    within 5 % of the measured growth of the process's max RSS over the baseline run's; Llama
    (tensors already powers of two) is a lower bound: 23 % under, a gap this model does not explain
    (not traced on the host). Without the rounding GPT-2 would be 38 % under."""
    for off, base in _h100():
        name, b, s = CASES[off["case"]]
        got = O.activation_offload(name, batch_size=b, seq_len=s, gpu="h100")
        grown = (off["host_max_rss_kib"] - base["host_max_rss_kib"]) * 1024
        assert got.host_bytes >= got.moved_bytes and got.host_bytes < grown, (name, got.host_bytes, grown)
        if name == "gpt2":
            assert abs(got.host_bytes - grown) <= 0.05 * grown
            assert got.moved_bytes < 0.65 * grown  # what the rounding adds
        else:
            assert got.host_bytes > 0.7 * grown


@pytest.mark.parametrize("n, block", [(1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192), (3 << 20, 4 << 20)])
def test_pinned_block_is_the_next_power_of_two(n, block):
    assert O.pinned_block(n) == block


def _fsdp_probe():
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "results" / "h100" / "offload_h100.jsonl").read_text().splitlines()]
    return ({r["probe"]: r for r in rows if r["case"].startswith("llama")})


def test_fsdp2_cpu_offload_against_the_h100():
    """FSDP2 with CPUOffloadPolicy on one rank (llama-3.2-1b, 4 x 2048, bf16 compute): GPU peak within
    5 % of max_memory_allocated. Time: the CPU Adam rate was calibrated on this probe, so the step
    time checks only the arithmetic (5 %); the copies' share uses save_on_cpu's efficiency, which was
    not."""
    probe = _fsdp_probe()
    fsdp, base = probe["fsdp-offload"], probe["baseline"]
    gpu_s = sum(base["step_seconds"]) / 2
    got = O.model_offload("llama-3.2-1b", scheme="fsdp2-cpu", batch_size=4, seq_len=2048, gpu="h100", gpu_seconds=gpu_s)
    assert abs(got.gpu_peak.total - fsdp["peak_allocated"]) <= 0.05 * fsdp["peak_allocated"], got.gpu_peak.total
    measured = sum(fsdp["step_seconds"]) / 2
    assert abs(got.step_seconds - measured) <= 0.05 * measured
    # what moved: 12 bytes a parameter less the root's second copy (an independent count of the tensors)
    from vramlab import specs
    spec = specs.preset("llama-3.2-1b")
    psi = sum(n for _, n in spec.param_tensors())
    root = sum(n for name, n in spec.param_tensors() if ".layers." not in f".{name}")
    assert got.moved_bytes == 12 * psi - 4 * root and got.host_bytes == 16 * psi
    # the model states are gone from the GPU: below the no-offload baseline by more than them
    assert got.gpu_peak.optimizer_states == 0 and base["peak_allocated"] - got.gpu_peak.total > 12 * psi


def test_zero_offload_keeps_the_16_bit_parameters_on_the_gpu():
    """ZeRO-Offload: the GPU keeps 2 bytes a parameter and the bucket; 16 bytes a parameter go to host
    memory; 6 bytes a parameter cross PCIe as DeepSpeed 0.19 copies (fp32 gradients down, 16-bit
    parameters up), 4 in Ren et al. 2021 (DeepSpeed's, measured: the next test)."""
    from vramlab import specs
    psi = sum(n for _, n in specs.preset("gpt2").param_tensors())
    z = O.model_offload("gpt2", scheme="zero-offload", batch_size=8, seq_len=1024, reduce_bucket=10**6)
    assert z.gpu_peak.parameters == 2 * psi and z.gpu_peak.optimizer_states == 0
    assert z.host_bytes == 16 * psi and z.moved_bytes == 6 * psi
    paper = O.model_offload("gpt2", scheme="zero-offload", batch_size=8, seq_len=1024, copies="paper")
    assert paper.moved_bytes == 4 * psi
    big = O.model_offload("gpt2", scheme="zero-offload", batch_size=8, seq_len=1024, reduce_bucket=2 * 10**6)
    assert big.gpu_peak.total - z.gpu_peak.total == 2 * 10**6  # a bf16 bucket of 1e6 more elements
    # ZeRO-Offload steps with DeepSpeed's host step (measured), FSDP2 with torch's AdamW
    assert z.cpu_seconds == pytest.approx(psi * O.DS_CPU_ADAM_SECONDS_PER_PARAM) and z.step_seconds is None
    fs = O.model_offload("gpt2", scheme="fsdp2-cpu", batch_size=8, seq_len=1024)
    assert fs.cpu_seconds == pytest.approx(psi * O.CPU_ADAM_SECONDS_PER_PARAM)


def test_zero_offload_hides_the_gradient_copies_behind_the_backward():
    """The gradients go down while the backward runs (ZeRO-Offload's overlap), so a step
    whose backward outlasts them pays only the CPU step and the parameters' upload; the one-step
    delayed update overlaps those with the next step's GPU work. The times are the transfer model's
    (bytes over the link at the calibrated efficiency), composed as the schedule says."""
    psi = specs.preset("llama-3.2-1b").params
    kw = dict(scheme="zero-offload", batch_size=4, seq_len=2048, gpu="h100")
    down = O.transfer_seconds(4 * psi, "h100", efficiency=O.SAVE_ON_CPU_EFFICIENCY)
    up = O.transfer_seconds(2 * psi, "h100", efficiency=O.SAVE_ON_CPU_EFFICIENCY)
    long = O.model_offload("llama-3.2-1b", gpu_seconds=3 * down, **kw)  # backward 2 x down: hides it
    assert long.exposed_seconds == pytest.approx(up)
    assert long.step_seconds == pytest.approx(3 * down + long.cpu_seconds + up)
    short = O.model_offload("llama-3.2-1b", gpu_seconds=0.75 * down, **kw)  # backward 0.5 x down
    assert short.step_seconds == pytest.approx(0.75 * down + 0.5 * down + short.cpu_seconds + up)
    dpu = O.model_offload("llama-3.2-1b", gpu_seconds=3 * down, delayed_update=True, **kw)
    assert dpu.step_seconds == pytest.approx(max(3 * down, dpu.cpu_seconds + up))
    assert dpu.step_seconds < long.step_seconds
    # the old model: every copy in fp32, not overlapped, torch's CPU Adam: about twice as long
    old = 3 * down + O.transfer_seconds(8 * psi, "h100", efficiency=O.SAVE_ON_CPU_EFFICIENCY) \
        + psi * O.CPU_ADAM_SECONDS_PER_PARAM
    assert long.step_seconds < 0.75 * old
    for bad, match in ((dict(copies="fp8"), "copies must be one of"), (dict(delayed_update="yes"), "delayed_update"),
                       (dict(scheme="fsdp2-cpu", copies="paper"), "describe ZeRO-Offload")):
        with pytest.raises(ValueError, match=match):
            O.model_offload("gpt2", **{**kw, **bad})


def test_equal_layers_smallest_resident_is_arithmetic():
    """10 equal layers, each copy taking twice its compute: the copies of a pass fit in the pass only
    when at most half the layers are streamed (5 x 2 units = 10 units of compute), so 5 stay resident;
    with copies shorter than compute every layer can stream."""
    run = O.smallest_resident([1e9] * 10, [0.01] * 10, link_GBps=50)
    assert len(run.streamed) == 5 and run.seconds == pytest.approx(0.1)
    assert run.gpu_bytes == 5e9 + 2e9 and run.host_bytes == 5e9
    assert len(O.smallest_resident([1e9] * 10, [0.03] * 10, link_GBps=50).streamed) == 10
    six = O.stream_layers([1e9] * 10, [0.01] * 10, streamed=O.spaced(10, 6), link_GBps=50)
    assert not six.hidden and six.seconds >= 6 * 0.02 - 1e-12  # the copy stream is the bottleneck


def test_stream_layers_bounds_and_order_on_uneven_layers():
    """Uneven layers, random streamed sets: a pass takes at least its compute and at least its copies,
    at most both end to end; each layer computes after its predecessor and after its own copy."""
    rnd = random.Random(3)
    for _ in range(200):
        n = rnd.randint(1, 9)
        sizes = [rnd.uniform(0.1, 3) * 1e9 for _ in range(n)]
        secs = [rnd.uniform(0.001, 0.05) for _ in range(n)]
        streamed = [i for i in range(n) if rnd.random() < 0.5]
        bw = rnd.uniform(5, 60)
        run = O.stream_layers(sizes, secs, streamed=streamed, link_GBps=bw, buffers=rnd.randint(1, 3))
        copies = sum(sizes[i] for i in streamed) / (bw * 1e9)
        assert run.seconds >= max(sum(secs), copies) - 1e-9
        assert run.seconds <= sum(secs) + copies + 1e-9
        computes = [e for e in run.events if e[0] == "compute"]
        copied = {e[1]: e[3] for e in run.events if e[0] == "copy"}
        for a, c in zip(computes, computes[1:]):
            assert c[2] >= a[3] - 1e-12
        for kind, i, start, _ in computes:
            assert i not in copied or start >= copied[i] - 1e-12


def test_smallest_resident_against_every_choice():
    """On small uneven models smallest_resident streams as many layers as the best of every choice of
    streamed set (checked here by this test's own enumeration) and no other hiding set of that size
    needs less GPU memory. BMInf's spaced choice alone is not enough: it streamed 2 where 4 hide."""
    rnd = random.Random(5)
    for _ in range(20):
        n = rnd.randint(2, 7)
        sizes = [rnd.uniform(0.5, 2) * 1e9 for _ in range(n)]
        secs = [rnd.uniform(0.01, 0.04) for _ in range(n)]
        got = O.smallest_resident(sizes, secs, link_GBps=50)
        best = max(len(c) for k in range(n + 1) for c in itertools.combinations(range(n), k)
                   if O.stream_layers(sizes, secs, streamed=c, link_GBps=50).hidden)
        assert got.hidden and len(got.streamed) == best
        least = min(O.stream_layers(sizes, secs, streamed=c, link_GBps=50).gpu_bytes
                    for c in itertools.combinations(range(n), best)
                    if O.stream_layers(sizes, secs, streamed=c, link_GBps=50).hidden)
        assert got.gpu_bytes == least


@pytest.mark.parametrize("call, match", [
    (lambda: O.host_link_GBps("h100", lanes=3), "lanes"),
    (lambda: O.transfer_seconds(-1, "h100"), "nbytes"),
    (lambda: O.transfer_seconds(1, "h100", efficiency=0), "efficiency"),
    (lambda: O.stream_layers([1, 2], [1], streamed=[0], link_GBps=1), "2 layers"),
    (lambda: O.stream_layers([1, 2], [1, 1], streamed=[5], link_GBps=1), "indices"),
    (lambda: O.stream_layers([1, -2], [1, 1], streamed=[], link_GBps=1), "layer_bytes"),
    (lambda: O.stream_layers([1, 2], [1, 1], streamed=[], link_GBps=0), "link_GBps"),
    (lambda: O.stream_layers([1, 2], [1, 1], streamed=[], link_GBps=1, buffers=0), "buffers"),
    (lambda: O.stream_layers([1, 2], [1, 1], streamed=[], link_GBps=1, passes=0), "passes"),
    (lambda: O.transfer_seconds(1, "h100", efficiency="fast"), "efficiency"),
    (lambda: O.spaced(3, 4), "cannot stream"),
    (lambda: O.activation_offload("gpt2", batch_size=1, seq_len=8, baseline_seconds=-1), "baseline_seconds"),
    (lambda: O.model_offload("gpt2", scheme="nvme", batch_size=1, seq_len=8), "scheme"),
    (lambda: O.model_offload("gpt2", scheme="zero-offload", batch_size=1, seq_len=8, gpu_seconds="1"), "gpu_seconds"),
    (lambda: O.model_offload("gpt2", scheme="zero-offload", batch_size=1, seq_len=8, reduce_bucket=-1), "reduce_bucket"),
    (lambda: O.model_offload("gpt2", scheme="fsdp2-cpu", batch_size=0, seq_len=8), "batch"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fewest_resident_is_not_least_memory():
    """The buffers are as large as the largest streamed layer, so streaming more can need
    more GPU memory. Layers of 10, 1, 1, 1 GB, 1 s each, 10 GB/s: every copy hides, so the fewest
    resident is none, in two 10 GB buffers (20 GB, above the 13 GB of all resident); least_memory
    streams the three small ones (10 GB resident + two 1 GB buffers). Checked against this test's own
    enumeration of every streamed set on random uneven stacks."""
    sizes, secs = [10e9, 1e9, 1e9, 1e9], [1.0] * 4
    few = O.smallest_resident(sizes, secs, link_GBps=10)
    least = O.least_memory(sizes, secs, link_GBps=10)
    assert few.streamed == (0, 1, 2, 3) and few.gpu_bytes == 20e9 > sum(sizes)
    assert least.streamed == (1, 2, 3) and least.gpu_bytes == 12e9 and least.hidden
    rnd = random.Random(8)
    for _ in range(25):
        n = rnd.randint(1, 7)
        sizes = [rnd.choice([0.5, 1, 2, 8]) * 1e9 for _ in range(n)]
        secs = [rnd.uniform(0.01, 0.2) for _ in range(n)]
        bw, buffers = rnd.uniform(5, 60), rnd.randint(1, 3)
        runs = [O.stream_layers(sizes, secs, streamed=c, link_GBps=bw, buffers=buffers)
                for k in range(n + 1) for c in itertools.combinations(range(n), k)]
        want = min(r.gpu_bytes for r in runs if r.hidden)
        got = O.least_memory(sizes, secs, link_GBps=bw, buffers=buffers)
        assert got.hidden and got.gpu_bytes == want
        assert got.gpu_bytes <= O.smallest_resident(sizes, secs, link_GBps=bw, buffers=buffers).gpu_bytes


def test_thousands_of_equal_layers_are_arithmetic():
    """2,000 equal layers (the search used to simulate every count from all streamed down: over 25 s):
    copies twice the compute hide when at most half stream; shorter copies let every layer stream."""
    half = O.smallest_resident([1e9] * 2000, [0.01] * 2000, link_GBps=50)
    assert len(half.streamed) == 1000 and half.hidden and half.gpu_bytes == 1000e9 + 2e9
    assert O.least_memory([1e9] * 2000, [0.01] * 2000, link_GBps=50).gpu_bytes == half.gpu_bytes
    assert len(O.smallest_resident([1e9] * 2000, [0.03] * 2000, link_GBps=50).streamed) == 2000
    with pytest.raises(ValueError, match="link_GBps"):
        O.least_memory([1e9], [0.01], link_GBps=0)


def test_bminf_prefill_multiplies_in_int8():
    """BMInf runs its INT8 weights through INT8 matmuls (DP4A on a GTX 1060: four int8
    multiply-adds where fp32 does one); the prefill was timed at the fp32 peak, about 4x too slow.
    A compute-bound 512-token pass takes 2 x params x tokens at the INT8 rate; 16-bit weights keep
    the faster of the fp32 and 16-bit peaks."""
    from vramlab.specs import gpu

    ten = O.ten_b_model()
    block, _ = O.zero_units(ten)
    g = gpu("gtx-1060")
    int8 = O.stream_model(ten, g, tokens=512, weight_bytes=1)
    assert int8.layer_seconds == pytest.approx(2 * block * 512 / (4 * 4.4e12 * O.STREAM_MFU))
    half = O.stream_model(ten, g, tokens=512, weight_bytes=2)
    assert half.layer_seconds == pytest.approx(2 * block * 512 / (4.4e12 * O.STREAM_MFU))


def test_stream_layers_times_only_the_buffers_it_makes():
    """One streamed layer and three buffers: only one buffer is made (and counted in the memory), so
    a pass's copy cannot start before the previous pass's use of that buffer has computed: copy (1 s,
    from the end of the last pass) then the layer (0.1 s). The schedule timed three buffers (copies
    back to back: 1.0 s a pass) while counting one in the memory."""
    r = O.stream_layers([10**8, 10**8, 10**9], [0.4, 0.4, 0.1], streamed=[2], link_GBps=1.0, buffers=3, passes=3)
    assert r.seconds == pytest.approx(1.1) and r.gpu_bytes == 2 * 10**8 + 10**9


def test_zero_offload_gpu_peak_holds_the_gradient_in_flight_and_its_fp32_cast():
    """DeepSpeed 0.19's ZeRO-Offload copies each gradient down as `.float()` on the GPU
    (stage_1_and_2.py) and clears it (clear_grad_attribute), one parameter at a time: the GPU holds the
    gradient in flight and its fp32 cast beside the bucket, never the model's gradients. Where the
    logits' gradient decides the peak (the H100 runs: next test) the cast adds nothing; where the
    batch is small, Llama 3.1 8B's untied head (128256 x 4096) decides it in the head's backward: its
    bf16 gradient and its fp32 cast (3 GB together)."""
    head = 128256 * 4096
    small = O.model_offload("llama-3.1-8b", scheme="zero-offload", batch_size=1, seq_len=256)
    paper = O.model_offload("llama-3.1-8b", scheme="zero-offload", batch_size=1, seq_len=256, copies="paper")
    assert small.gpu_peak.phase.startswith("LM head backward") and small.gpu_peak.gradients == 2 * head
    assert small.gpu_peak.total - paper.gpu_peak.total == 4 * head
    # the model's 16 GB of bf16 gradients are never all on the GPU (memory.training_phases holds them)
    assert max(O.model_offload("llama-3.1-8b", scheme="zero-offload", batch_size=b, seq_len=s).gpu_peak.gradients
               for b, s in ((1, 256), (1, 2048), (4, 2048))) <= 2 * head
    big = O.model_offload("llama-3.1-8b", scheme="zero-offload", batch_size=4, seq_len=2048)
    big_paper = O.model_offload("llama-3.1-8b", scheme="zero-offload", batch_size=4, seq_len=2048, copies="paper")
    assert big.gpu_peak.phase.startswith("backward start") and big.gpu_peak.total == big_paper.gpu_peak.total


ZO_RUNS = sorted((ROOT / "benchmarks" / "results" / "offload" / "gpu").glob("zo_*.json"))


def test_zero_offload_matches_deepspeed_on_an_h100():
    """DeepSpeed 0.19 stage 2 with `offload_optimizer: cpu` (DeepSpeedCPUAdam) on an H100, one
    rank, bf16, three models that are not the lab's (benchmarks/offload_gpu_validation.py): a bucket
    smaller than the model and than its largest tensor (gpt2-medium), an untied head (pythia-1b),
    DeepSpeed's default bucket (llama-3.2-1b). The bytes each way are CUDA's memcpy records in
    torch.profiler's trace of one step: 4 a parameter down (fp32 gradients), 2 up (bf16 parameters),
    to the byte but a few scalars; the peak is the allocator's. The host step's time was calibrated
    on llama-3.2-1b: the other two are the check."""
    assert len(ZO_RUNS) == 3
    for f in ZO_RUNS:
        r = json.loads(f.read_text())
        assert r["provenance"]["gpu"].startswith("NVIDIA H100") and r["optimizer"] == "DeepSpeedCPUAdam"
        got = O.model_offload(r["model"], scheme="zero-offload", batch_size=r["batch_size"], seq_len=r["seq_len"],
                              reduce_bucket=r["reduce_bucket"])
        psi = specs.preset(r["model"]).params
        assert psi == r["params"]
        assert r["dtoh_bytes"] == pytest.approx(4 * psi, rel=1e-5) and r["htod_bytes"] == pytest.approx(2 * psi, rel=1e-5)
        assert got.moved_bytes == pytest.approx(r["dtoh_bytes"] + r["htod_bytes"], rel=1e-5)
        assert O.model_offload(r["model"], scheme="zero-offload", batch_size=r["batch_size"], seq_len=r["seq_len"],
                               copies="paper").moved_bytes == 4 * psi  # the paper's, not DeepSpeed's
        assert got.gpu_peak.total == pytest.approx(r["peak_allocated"], rel=0.02), f.name
        if r["model"] != "llama-3.2-1b":  # the calibration case
            host = sum(s["step"] for s in r["steps"]) / len(r["steps"])
            t_up = O.transfer_seconds(2 * psi, "h100", efficiency=O.SAVE_ON_CPU_EFFICIENCY)
            assert got.cpu_seconds + t_up == pytest.approx(host, rel=0.15), f.name


def test_deepspeed_cpu_adam_against_torch_on_the_h100_host():
    """The stored host measurement: DeepSpeedCPUAdam 5.1 to 6.5 times torch's for-loop AdamW, as Ren
    et al. 2021 measured (5.6 on the H100 host's 16 cores); the engine's host step (norm, Adam, cast)
    costs more a parameter than Adam alone."""
    r = json.loads((ROOT / "benchmarks" / "results" / "offload" / "gpu" / "cpu_adam.json").read_text())
    ratio = r["torch_adamw_s_per_param"] / r["deepspeed_cpu_adam_s_per_param"]
    assert 5.1 <= ratio <= 6.5 and r["provenance"]["cpu_count"] == 16
    assert r["deepspeed_cpu_adam_s_per_param"] < O.DS_CPU_ADAM_SECONDS_PER_PARAM




def test_h100_lab_run_streams_as_the_schedule_predicts():
    """Lab 6's instructor version on an H100 (labs/results/h100/): the students' loop streams
    over PCIe from pinned memory on a side CUDA stream; every configuration's pass within 5 % of
    `stream_layers`, recomputed here from the run's measured per-layer times and link rate, and its
    output equal to the all-resident run's. The fewest resident layers that hide the copies hold
    fewer bytes than all resident and take no longer than all resident (within 5 %)."""
    lab = json.loads((ROOT / "labs" / "results" / "h100" / "lab06_offload_h100.json").read_text())
    st = lab["streaming"]
    assert st["mode"] == "cuda" and lab["provenance"]["gpu"].startswith("NVIDIA H100")
    for c in st["configs"]:
        pred = O.stream_layers(st["layer_bytes"], st["layer_seconds"], streamed=c["streamed"],
                               link_GBps=st["link_GBps"], buffers=st["buffers"], passes=st["passes"])
        assert pred.seconds == pytest.approx(c["measured_seconds"], rel=0.05), c["streamed"]
        assert c["matches_all_resident"]
    rows = {tuple(c["streamed"]): c for c in st["configs"]}
    best = rows[tuple(st["smallest_resident"]["streamed"])]
    assert best["gpu_bytes"] < rows[()]["gpu_bytes"] and best["measured_seconds"] <= 1.05 * rows[()]["measured_seconds"]
    # and streaming every layer does not hide: the copies are longer than the compute
    assert rows[tuple(range(len(st["widths"])))]["measured_seconds"] > 1.3 * rows[()]["measured_seconds"]


# ----------------------------------------------------------------------------- pinned DataLoader, ZeRO-Infinity
def test_loader_and_infinity_are_pure_python(assert_pure_python):
    assert_pure_python("import vramlab.offload as o; o.loader_memory([100], num_workers=2); "
                       "o.needed_placement('gpt2', host_ram_bytes=2**35, batch_size=1, seq_len=64); "
                       "o.disk_streaming([10, 20], activation_bytes=1)")


def test_loader_memory_counts_power_of_two_blocks_per_tensor():
    # an ImageNet batch: 256 images of 3 x 224 x 224 fp32 and 256 int64 labels
    sizes = [256 * 3 * 224 * 224 * 4, 256 * 8]
    r = O.loader_memory(sizes, num_workers=8, prefetch_factor=2, gpu="h100", step_seconds=0.25)
    assert r.batches_in_flight == 16 and r.pinned_batches == 17
    assert r.pinned_bytes == 17 * (2**28 + 2**11)  # 154,140,672 B round up to 256 MiB; 2,048 B stay
    assert r.pageable_copy_seconds == pytest.approx(r.copy_seconds / O.PAGEABLE_FRACTION)
    assert r.step_share == pytest.approx(r.copy_seconds / 0.25)
    off = O.loader_memory(sizes, num_workers=8, pin_memory=False)
    assert off.pinned_bytes == 0 and off.copy_seconds == r.pageable_copy_seconds
    assert O.loader_memory(sizes, num_workers=0).batches_in_flight == 0


@pytest.mark.parametrize("call, needle", [
    (lambda: O.loader_memory([10], num_workers=0, prefetch_factor=2), "prefetch_factor"),
    (lambda: O.loader_memory([10], num_workers=-1), "num_workers"),
    (lambda: O.loader_memory("10", num_workers=1), "batch_tensor_bytes"),
    (lambda: O.loader_memory([10], num_workers=1, step_seconds=0), "step_seconds"),
    (lambda: O.infinity("gpt2", params="disk", optimizer="cpu", batch_size=1, seq_len=8), "params"),
    (lambda: O.infinity("gpt2", params="nvme", optimizer="cpu", batch_size=1, seq_len=8), "at least as far"),
    (lambda: O.infinity("gpt2", params="gpu", optimizer="nvme", batch_size=1, seq_len=8, nvme_GBps=0), "nvme_GBps"),
    (lambda: O.needed_placement("gpt2", host_ram_bytes=-1, batch_size=1, seq_len=8), "host_ram_bytes"),
    (lambda: O.deepspeed_config({"params": "nvme"}), "placement"),
    (lambda: O.deepspeed_config(O.infinity("gpt2", params="gpu", optimizer="nvme", batch_size=1, seq_len=8),
                                nvme_path="nvme"), "nvme_path"),
    (lambda: O.disk_streaming([], activation_bytes=1), "layer_bytes"),
    (lambda: O.disk_streaming([1], activation_bytes=1, buffers=0), "buffers"),
])
def test_new_entry_points_refuse_nonsense_in_one_line(call, needle):
    with pytest.raises(ValueError, match=needle) as e:
        call()
    assert "\n" not in str(e.value)


def test_infinity_tiers_hold_the_papers_sixteen_bytes_and_move_what_each_link_carries():
    kw = dict(batch_size=1, seq_len=1024, recompute=True)
    psi = specs.preset("mistral-7b").params
    r = {p: O.infinity("mistral-7b", params=p[0], optimizer=p[1], **kw) for p in O.PLACEMENTS}
    assert r["gpu", "cpu"].host_bytes == 16 * psi and r["gpu", "cpu"].pcie_bytes == sum(O.ZERO_OFFLOAD_COPIES["deepspeed"]) * psi  # as model_offload
    assert r["cpu", "cpu"].host_bytes == 18 * psi and r["cpu", "cpu"].pcie_bytes == 8 * psi
    assert r["gpu", "nvme"].nvme_bytes == 16 * psi and r["gpu", "nvme"].nvme_read_bytes == 16 * psi
    assert r["nvme", "nvme"].nvme_bytes == 16 * psi + 2 * (psi - O.DS_MAX_IN_CPU)
    # the GPU keeps less as parameters leave it; the host less as the optimizer leaves it
    assert r["gpu", "gpu"].gpu_bytes > r["gpu", "cpu"].gpu_bytes > r["cpu", "cpu"].gpu_bytes == r["nvme", "nvme"].gpu_bytes
    assert r["cpu", "cpu"].host_bytes > r["cpu", "nvme"].host_bytes > r["nvme", "nvme"].host_bytes
    # per step the NVMe traffic does not depend on the batch: more tokens hide it behind compute
    big = O.infinity("mistral-7b", params="gpu", optimizer="nvme", batch_size=64, seq_len=1024)
    assert big.nvme_seconds == r["gpu", "nvme"].nvme_seconds and big.compute_seconds == pytest.approx(64 * r["gpu", "nvme"].compute_seconds)


def test_needed_placement_goes_down_the_tiers_as_host_memory_shrinks():
    kw = dict(batch_size=1, seq_len=2048, gpu="h100")
    GiB = 2**30
    seen = [O.needed_placement("llama-3.1-70b", host_ram_bytes=ram * GiB, **kw) for ram in (2048, 512, 64, 8)]
    assert [(r.params, r.optimizer) if r else None for r in seen] == [("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme"), None]
    assert O.needed_placement("gpt2", host_ram_bytes=0, batch_size=1, seq_len=1024, gpu="h100").label == "params gpu, optimizer gpu"
    for r in filter(None, seen):  # what it chose fits what it was given
        assert r.gpu_bytes <= specs.gpu("h100").usable_bytes - specs.gpu("h100").context_bytes


def test_disk_streaming_arithmetic():
    r = O.disk_streaming([4, 8, 2], activation_bytes=3, buffers=2, disk_GBps=1e-9)
    assert (r.resident_bytes, r.activation_bytes, r.gradient_bytes, r.peak_bytes) == (16, 9, 8, 33)
    assert (r.read_bytes, r.write_bytes, r.read_seconds) == (28, 14, pytest.approx(28.0))
    assert O.disk_streaming([4, 8], activation_bytes=0, buffers=5).resident_bytes == 16
