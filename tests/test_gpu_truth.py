"""The estimator against measurements on a real H100 (benchmarks/results/h100/, provenance in its
README). Runs on the CPU: the expected values are allocator peaks measured on the GPU, so every
test here can fail when the estimator drifts."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from vramlab import estimate_inference, estimate_training, fit, gpu, preset
from vramlab.fitting import largest_tensor_bytes
from vramlab.measure.tool_comparison import parse_case  # the stored cases' names, read as the comparison reads them

H100 = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "h100"
TOLERANCE = 0.03  # every stored case within 3 % of max_memory_allocated


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (H100 / name).read_text().splitlines() if line.strip()]


ALL_TRAIN = [(r["case"], r["peak_allocated"]) for r in rows("benchmark_cases_h100.jsonl")]
ALL_TRAIN += [(r["case"], r["peak_allocated"]) for r in rows("presets_train_h100.jsonl") if not r["alloc_conf"]]


def older_t5(case: str, transformers: str) -> bool:
    """A T5-family case measured under transformers < 5.23, whose T5 passes its self-attention's mask
    (the relative-position bias) as a strided view: SDPA's math path on CUDA. The estimator models the
    pinned transformers (5.23: the memory-efficient kernel); those rows are checked by
    test_t5_under_older_transformers_keeps_more_than_the_estimate instead."""
    return preset(parse_case(case)[0]).family == "t5" and _version(transformers) < (5, 23)


def _version(text: str) -> tuple[int, int]:
    """'5.17.0' -> (5, 17): compared as numbers, not as strings."""
    return tuple(int(x) for x in text.split(".")[:2])


REGRESSION_TRANSFORMERS = json.loads((H100 / "provenance.json").read_text())["transformers"]
TRAIN = [(c, m) for c, m in ALL_TRAIN if not older_t5(c, REGRESSION_TRANSFORMERS)]


def test_the_regression_set_is_complete():
    assert len(ALL_TRAIN) == 30 + 14 and len(TRAIN) == len(ALL_TRAIN) - 4  # T5-small x 3, mT5-small (5.17)
    prov = json.loads((H100 / "provenance.json").read_text())
    assert prov["gpu"].startswith("NVIDIA H100") and prov["torch"] and prov["date"]
    assert all((H100 / f).is_file() for f in prov["files"])
    assert {r["probe"] for r in rows("presets_infer_h100.jsonl")} == {"infer"}


@pytest.mark.parametrize("case, measured", TRAIN, ids=[c for c, _ in TRAIN])
def test_training_estimate_within_3_percent_of_the_h100_allocator(case, measured):
    name, over, opts = parse_case(case)
    spec = dataclasses.replace(preset(name), **over)
    est = estimate_training(spec, device="cuda", gpu="h100", **opts)
    err = (est.total - measured) / measured
    assert abs(err) <= TOLERANCE, f"{case}: estimate {est.total:,} vs measured {measured:,} ({100 * err:+.2f} %)"


def test_expandable_segments_do_not_change_allocated_bytes():
    """The allocator setting changes reserved, not allocated: the same estimate holds for both."""
    by_conf = {r["alloc_conf"]: r["peak_allocated"] for r in rows("presets_train_h100.jsonl")
               if r["case"].startswith("gpt2 b=8 s=1024 bf16-mixed")}
    est = estimate_training("gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed").total
    for measured in by_conf.values():
        assert abs(est - measured) / measured <= TOLERANCE


@pytest.mark.parametrize("row", rows("presets_infer_h100.jsonl"), ids=lambda r: r["case"])
def test_prefill_estimate_within_3_percent(row):
    name, b, prompt = re.match(r"(\S+) b=(\d+) prompt=(\d+)", row["case"]).groups()
    est = estimate_inference(name, batch_size=int(b), seq_len=int(prompt), dtype="bf16")
    assert abs(est.total - row["prefill_peak"]) / row["prefill_peak"] <= TOLERANCE


def test_generate_keeps_one_logits_row_and_is_within_3_percent_for_llama():
    row = next(r for r in rows("presets_infer_h100.jsonl") if r["case"].startswith("llama-3.2-1b"))
    est = estimate_inference("llama-3.2-1b", batch_size=16, seq_len=1024, new_tokens=128)
    prefill = estimate_inference("llama-3.2-1b", batch_size=16, seq_len=1024)
    assert abs(est.total - row["peak_allocated"]) / row["peak_allocated"] <= TOLERANCE
    assert est.total < 0.55 * prefill.total  # the all-logits forward is not what generate() holds


def test_generate_gpt2_oddity_is_still_over_not_under():
    """The stored GPT-2 generate peak sits below weights + prompt cache (see the README's 'Known
    oddity'): the estimate must at least never be below it (an under-estimate would OOM)."""
    row = next(r for r in rows("presets_infer_h100.jsonl") if r["case"].startswith("gpt2"))
    est = estimate_inference("gpt2", batch_size=32, seq_len=512, new_tokens=128)
    assert est.total >= row["peak_allocated"]
    assert est.kv_cache == row["estimated_kv"]  # the prompt's cache, counted independently on the GPU side


def _seed(case_prefix: str) -> dict:
    return next(r for r in rows("seeds_mt5_h100.jsonl") if r["case"].startswith(case_prefix))


def test_mt5_base_seeds_within_3_percent():
    """The source article's mT5-base experiments: full fp32 fine-tune, LoRA r=8 on q,v, inference."""
    spec = preset("mt5-base")
    full, lora, infer = _seed("mt5-base full-ft"), _seed("mt5-base lora"), _seed("mt5-base infer")
    assert spec.params == full["params"] == 582_401_280
    cases = [(estimate_training(spec, batch_size=32, seq_len=10), full),
             (estimate_training(spec, batch_size=32, seq_len=10, trainable_params=lora["trainable"]), lora),
             (estimate_inference(spec, batch_size=1, seq_len=10, dtype="fp32"), infer)]
    for est, row in cases:
        assert abs(est.total - row["peak_allocated"]) / row["peak_allocated"] <= TOLERANCE, row["case"]


def _boundary(conf: str) -> tuple[int, int]:
    probes = [r for r in rows("maxbatch_gpt2_h100.jsonl") if r["alloc_conf"] == conf]
    fits = max(r["batch"] for r in probes if r["fits"])
    fails = min(r["batch"] for r in probes if not r["fits"])
    return fits, fails


@pytest.mark.parametrize("expandable", [False, True])
def test_fit_never_exceeds_the_measured_largest_batch_and_reaches_95_percent(expandable):
    """The bisection on the H100: `fit`'s largest batch is never above the measured one and at least
    95 % of it (it was 97 of 104 when fragmentation was a whole block of the fp32 logits)."""
    fits, fails = _boundary("expandable_segments:True" if expandable else "")
    assert (fits, fails) == ((112, 120) if expandable else (104, 112))
    answer = fit("gpt2", "h100-80gb", seq_len=512, precision="bf16-mixed", expandable_segments=expandable).max_batch_size
    assert 0.95 * fits <= answer <= fits


def test_max_batch_estimates_track_the_measured_sweep():
    for r in rows("maxbatch_gpt2_h100.jsonl"):
        if r["fits"]:
            est = estimate_training("gpt2", batch_size=r["batch"], seq_len=512, precision="bf16-mixed").total
            assert abs(est - r["peak_allocated"]) / r["peak_allocated"] <= 0.01, r


def test_fit_reserve_is_what_the_h100_showed_between_allocated_and_oom():
    """Fragmentation under bf16 AMP is the freed 16-bit logits' block (half the fp32 logits, which the
    OOM at batch 112 asked for: "Tried to allocate 10.74 GiB"): on every fitting run of the sweep,
    reserved minus allocated at the peak is 80-100 % of it; the context term is device use minus
    reserved on the same run."""
    f = fit("gpt2", "h100", batch_size=112, seq_len=512, precision="bf16-mixed")
    assert round(largest_tensor_bytes("gpt2", batch_size=112, seq_len=512) / 2**30, 2) == 10.74
    assert f.fragmentation == largest_tensor_bytes("gpt2", batch_size=112, seq_len=512) // 2
    for r in rows("maxbatch_gpt2_h100.jsonl"):
        if r["fits"] and not r["alloc_conf"]:
            half_logits = r["batch"] * 512 * 50257 * 2
            assert 0.8 * half_logits <= r["peak_reserved"] - r["peak_allocated"] <= half_logits, r["batch"]
    r = next(r for r in rows("presets_train_h100.jsonl") if not r["alloc_conf"])
    assert f.context == r["device_in_use"] - r["peak_reserved"]
    assert f.available == next(x for x in rows("maxbatch_gpt2_h100.jsonl") if "total" in x)["total"]
    assert not f.fits and f.reserve == f.margin + f.fragmentation + f.context


def test_cuda_workspaces_are_the_h100s():
    """Two cuBLAS workspaces (forward thread, autograd's thread), 32 MiB each on Hopper."""
    o = rows("overheads_h100.jsonl")[0]
    assert gpu("h100").cublas_workspace_bytes == o["matmul_float32_workspace_allocated"]
    cuda = estimate_training("gpt2", batch_size=1, seq_len=8)
    cpu = estimate_training("gpt2", batch_size=1, seq_len=8, device="cpu")
    assert cuda.other - cpu.other == 2 * o["matmul_float32_workspace_allocated"]
    assert gpu("t4").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8  # PyTorch's pre-Hopper default


# --------------------------------------------------------------------------- the campaign's own run
CAMPAIGN = H100.parent / "estimator_accuracy_cuda.json"


def _campaign_cases(*, older: bool = False) -> list[dict]:
    """The campaign's cases the estimator is held to, or with `older` its T5 cases measured under an
    older transformers (see older_t5)."""
    data = json.loads(CAMPAIGN.read_text())
    return [r for r in data["cases"] if older_t5(r["case"], data["provenance"]["transformers"]) == older]


def test_the_campaign_run_is_a_cuda_measurement_with_provenance():
    """benchmarks/gpu_campaign.py's accuracy step, run on an H100: all 33 cases (the three full-recompute
    cases too, which crashed under memory-history recording in the first run), each with the allocator's peak."""
    data = json.loads(CAMPAIGN.read_text())
    prov = data["provenance"]
    assert data["mode"] == "cuda" and prov["gpu"].startswith("NVIDIA H100") and prov["driver"] and prov["cuda"]
    assert len(data["cases"]) == 33 and all(c["measured_bytes"] > 0 for c in data["cases"])
    assert len(_campaign_cases()) == 33 - 3  # its T5 cases ran under the image's transformers 5.17


@pytest.mark.parametrize("row", _campaign_cases(), ids=lambda r: r["case"])
def test_campaign_cases_against_the_current_estimator(row):
    """Every case recomputed with today's estimator against its measured max_memory_allocated: within 3 %,
    except llama-3.2-1b[3 layers] b2 s512 bf16-mixed, which this run measured 320,807,424 B (3.6 %) above
    the first H100 run (8,969,816,064 B, same torch 2.11 and driver): the one case whose peak moved between
    two runs, with four cases sharing the GPU in this one; kept within 4 % and named so that a change shows."""
    name, over, opts = parse_case(row["case"])
    spec = dataclasses.replace(preset(name), **over)
    est = estimate_training(spec, device="cuda", gpu="h100", **opts)
    err = (est.total - row["measured_bytes"]) / row["measured_bytes"]
    tolerance = 0.04 if row["case"] == "llama-3.2-1b[num_layers=3] b=2 s=512 precision=bf16-mixed" else TOLERANCE
    assert abs(err) <= tolerance, f"{row['case']}: estimate {est.total:,} vs measured {row['measured_bytes']:,} ({100 * err:+.2f} %)"


def test_campaign_largest_batch_is_never_above_the_measured_one():
    """The campaign's bisection (one process per probe) against fit(): fit never says a batch that OOMed."""
    data = json.loads((H100.parent / "gpu_campaign.json").read_text())
    assert data["provenance"]["gpu"].startswith("NVIDIA H100")
    for row in data["maxbatch"]:
        expandable = row["alloc_conf"] == "expandable_segments:True"
        answer = fit("gpt2", "h100", seq_len=512, precision="bf16-mixed", expandable_segments=expandable).max_batch_size
        ooms = [int(b) for b, peak in row["probes"].items() if peak is None]  # None: out of memory
        assert row["measured_max_batch"] not in ooms and min(ooms) == row["measured_max_batch"] + 1
        assert answer <= row["measured_max_batch"], (row["alloc_conf"], answer, row["measured_max_batch"])


# ----------------------------------------------------------------------- T5 under two transformers versions
T5_VERSIONS = json.loads((H100 / "t5_transformers_versions.json").read_text())


def _t5_spec(row: dict):
    from vramlab.measure.zero import model_spec

    spec = model_spec("mt5-base") if row["spec"].startswith("vramlab.measure.zero") else preset(row["model"])
    return dataclasses.replace(spec, **row["overrides"])


def _t5_estimate(row: dict) -> int:
    return estimate_training(_t5_spec(row), device="cuda", gpu="h100", optimizer_impl=row["optimizer_impl"],
                             **row["options"]).total


@pytest.mark.parametrize("row", T5_VERSIONS["peaks"]["5.23.0"],
                         ids=lambda r: f"{r['model']} {' '.join(f'{k}={v}' for k, v in r['options'].items())}")
def test_t5_training_under_the_pinned_transformers_within_3_percent(row):
    """T5-small, mT5-small (2 + 2 blocks) and mT5-base, fp32, pure bf16 and bf16 autocast, 256 to 2,048
    tokens, under transformers 5.23 (requirements.txt's pin, carried onto the H100 image): its
    self-attention's mask is contiguous and the memory-efficient kernel takes it, keeping one
    (1, heads, s, s) mask a block where the math path kept b x heads x s x s probabilities."""
    est, measured = _t5_estimate(row), row["peak_allocated"]
    assert abs(est / measured - 1) <= TOLERANCE, f"{row}: estimate {est:,} vs {measured:,} ({100 * (est / measured - 1):+.1f} %)"


def test_the_sdpa_probe_shows_the_kernel_each_version_runs():
    """The probe's record of which aten op SDPA dispatched to: 5.17 passes a mask whose last stride is
    not 1 and runs the math path (_safe_softmax) in both self-attentions; 5.23's contiguous mask runs
    the memory-efficient kernel; the cross-attention (no gradient on its zero bias) is fused in both."""
    for probe in T5_VERSIONS["sdpa_probe"]:
        new = _version(probe["transformers"]) >= (5, 23)
        for which in ("encoder self", "decoder self"):
            call = probe["calls"][which]
            assert call["mask"]["grad"]
            assert (call["mask"]["stride"][-1] == 1) == new, (probe["name"], which)
            assert ("_scaled_dot_product_efficient_attention" in call["ops"]) == new, (probe["name"], which)
            assert ("_safe_softmax" in call["ops"]) == (not new), (probe["name"], which)
        assert "_safe_softmax" not in probe["calls"]["decoder cross"]["ops"]


def test_t5_under_older_transformers_keeps_more_than_the_estimate():
    """Every T5 training peak measured under transformers 5.17 (the regression set, the campaign, the
    version probe) is above today's estimate, which models 5.23: the math path keeps b x heads x s x s
    probabilities in every self-attention where the fused kernel keeps one (1, heads, s, s) mask, so
    the excess grows with the batch and the square of the sequence: +0.8 % for mT5-small at 4 x 256
    (its 250 k-word logits dominate), +11 to +15 % for T5-small at 4 x 256, +55 % at 16 x 512. Where
    both versions ran the same configuration, 5.17's peak is the higher (FSDP2 ranks too)."""
    older = [(c, m) for c, m in ALL_TRAIN if older_t5(c, REGRESSION_TRANSFORMERS)]
    older += [(r["case"], r["measured_bytes"]) for r in _campaign_cases(older=True)]
    for case, measured in older:
        name, over, opts = parse_case(case)
        est = estimate_training(dataclasses.replace(preset(name), **over), device="cuda", gpu="h100", **opts).total
        assert measured > est, (case, est, measured)
    assert len(older) == 4 + 3
    new = {json.dumps([r["model"], r["overrides"], r["options"]]): r["peak_allocated"] for r in T5_VERSIONS["peaks"]["5.23.0"]}
    for row in T5_VERSIONS["peaks"]["5.17.0"]:
        assert row["peak_allocated"] > max(_t5_estimate(row), new[json.dumps([row["model"], row["overrides"], row["options"]])])
    for case, ranks in T5_VERSIONS["fsdp2_ranks"].items():
        assert ranks["5.17.0"]["peak_allocated"] > ranks["5.23.0"]["peak_allocated"], case
