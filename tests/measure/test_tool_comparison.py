"""The tool comparison (vramlab.measure.tool_comparison): the stored file is what the tools compute
today, the tools are the real ones (accelerate's and DeepSpeed's functions called live), the
Playbook widget reproduces the closed form its text prints, errors are signed against the
measurement, and nothing is fetched from the Hub."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from vramlab.measure import tool_comparison as tc
from vramlab.specs import preset

STORED = tc.OUT


@pytest.fixture(scope="module")
def stored():
    assert STORED.is_file(), f"{STORED} is missing: run `python -m vramlab.measure.tool_comparison`"
    return json.loads(STORED.read_text())


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_stored_file_covers_the_selected_runs_with_provenance(stored):
    kept, left = tc.select_runs()
    assert [e["run"] for e in stored["runs"]] == [r["run"] for r in kept]
    assert [x["run"] for x in stored["left_out"]] == [r["run"] for r in left]
    assert len(kept) + len(left) == 15 + 30  # every training row of the two stored files, kept or explained
    assert all(x["reason"] for x in stored["left_out"])
    assert not any(tc.run_spec(r).family == "t5" for r in kept)
    assert stored["measured_provenance"]["gpu"].startswith("NVIDIA H100")
    assert stored["provenance"]["torch"] and stored["command"].startswith(tc.PROG)
    assert set(stored["versions"]) >= {"accelerate", "deepspeed", "transformers", "torch"}
    assert set(stored["tools"]) == set(tc.TOOLS) and all(stored["tools"][t]["leaves_out"] for t in tc.TOOLS)


def test_measured_bytes_are_the_stored_allocator_peaks(stored):
    """Each entry's measurement is the H100 row's max_memory_allocated, unchanged."""
    rows = {}
    for src in tc.SOURCES:
        for r in tc._rows(tc.H100, src):
            if not r.get("alloc_conf"):  # the expandable-segments repeat is left out
                rows[f"{src.split('_h100')[0]}: {r['case']}"] = r
    for e in stored["runs"]:
        assert e["measured"]["peak_allocated"] == rows[e["run"]]["peak_allocated"]


def test_parameter_counts_match_the_gpu_runs(stored):
    """The parameters every tool was given: the pure ModelSpec count, and the GPU run's own count."""
    gpu_params = {r["run"]: r["params_measured"] for r in tc.select_runs()[0] if "params_measured" in r}
    assert len(gpu_params) >= 10
    for e in stored["runs"]:
        assert e["params"] == tc.run_spec(e).params
        if e["run"] in gpu_params:
            assert e["params"] == gpu_params[e["run"]], e["run"]


def test_errors_are_signed_against_the_measurement(stored):
    assert tc.signed_error(110, 100) == pytest.approx(0.10)
    assert tc.signed_error(90, 100) == pytest.approx(-0.10)
    assert tc.signed_error(None, 100) is None
    for e in stored["runs"]:
        m = e["measured"]["peak_allocated"]
        for tool in tc.TOOLS:
            ans = e["tools"][tool]
            if ans["bytes"] is None:
                assert ans["error"] is None and ans["reason"]
                continue
            assert isinstance(ans["bytes"], int)
            assert ans["error"] == pytest.approx((ans["bytes"] - m) / m, rel=1e-12)
            assert (ans["error"] < 0) == (ans["bytes"] < m)


def test_summary_is_median_and_worst_signed_error(stored):
    assert stored["summary"] == tc.summarize(stored["runs"])
    fake = [{"run": r, "tools": {t: {"error": x} for t in tc.TOOLS}} for r, x in (("a", 0.1), ("b", -0.3), ("c", 0.2))]
    s = tc.summarize(fake)["vramlab"]
    assert s == {"answered": 3, "median_abs_error": pytest.approx(0.2), "worst_error": -0.3, "worst_run": "b"}
    for tool in tc.TOOLS:
        errs = [e["tools"][tool]["error"] for e in stored["runs"] if e["tools"][tool]["error"] is not None]
        assert stored["summary"][tool]["median_abs_error"] == pytest.approx(statistics.median(map(abs, errs)))


def test_rule_of_thumb_recomputed(stored):
    for e in stored["runs"]:
        want = tc.rule_of_thumb(e["params"], e["options"]["precision"])["bytes"]
        assert e["tools"]["rule_of_thumb"]["bytes"] == want
    # weights x 4 + 20 %: fp32 and AMP hold an fp32 model (4 bytes), pure bf16 a 2-byte one
    assert tc.rule_of_thumb(1_000_000, "fp32")["bytes"] == 19_200_000
    assert tc.rule_of_thumb(1_000_000, "bf16-mixed")["bytes"] == 19_200_000
    assert tc.rule_of_thumb(1_000_000, "bf16")["bytes"] == 9_600_000


def test_playbook_recomputed(stored):
    for e in stored["runs"]:
        o = e["options"]
        pb = tc.playbook_for(tc.run_spec(e), batch_size=o["batch_size"], seq_len=o["seq_len"],
                             precision=o["precision"], recompute=o.get("recompute", "none"))
        assert e["tools"]["playbook"]["bytes"] == pb["bytes"], e["run"]


def test_playbook_widget_reproduces_the_playbooks_closed_form():
    """Independent of the code: the Playbook (and Korthikanti+22 eq. 2) prints s b h (34 + 5 a s / h)
    bytes per layer for 16-bit activations with a GELU MLP of width 4h, and its parameter count
    h (v + s) + L (12 h^2 + 13 h) + 2 h is GPT-2's exactly when s is GPT-2's 1,024 positions."""
    a, b, h, s, v = 12, 3, 768, 512, 50257
    one = tc.playbook_widget(a=a, b=b, h=h, h_ff=4 * h, L=1, s=s, v=v, ff_activation="gelu")
    two = tc.playbook_widget(a=a, b=b, h=h, h_ff=4 * h, L=2, s=s, v=v, ff_activation="gelu")
    assert two["activations"] - one["activations"] == s * b * h * 34 + 5 * a * s * s * b
    gpt2 = preset("gpt2")
    p = tc.playbook_widget(a=12, b=1, h=768, h_ff=3072, L=12, s=1024, v=gpt2.vocab_size, mixed=False)
    assert p["params_counted"] == gpt2.params
    assert (p["parameters"], p["gradients"], p["optimizer_states"]) == (4 * gpt2.params, 4 * gpt2.params, 8 * gpt2.params)
    mixed = tc.playbook_widget(a=12, b=1, h=768, h_ff=3072, L=12, s=1024, v=gpt2.vocab_size, mixed=True)
    assert (mixed["parameters"] + mixed["gradients"] + mixed["optimizer_states"]) == 16 * gpt2.params  # 2 + 2 + 12
    full = tc.playbook_widget(a=a, b=b, h=h, h_ff=4 * h, L=4, s=s, v=v, recomputation="full")
    assert full["activations"] == s * b * h * 2 * 4 + s * b * h * 5 + s * b * v * 4  # layer inputs + the tail


def test_deepspeed_called_live(stored):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for e in stored["runs"]:
        P, big = e["params"], e["tools"]["deepspeed_zero3"]["largest_layer_params"]
        assert e["tools"]["deepspeed_zero2"]["bytes"] == estimate_zero2_model_states_mem_needs(P, 1, 1, False)[1]
        assert e["tools"]["deepspeed_zero3"]["bytes"] == estimate_zero3_model_states_mem_needs(
            P, big, 1, 1, cpu_offload=False, cpu_offload_params=False)[1]
        # its documented multipliers on one GPU: 2 (16-bit params) + 18 (grads, fp32 copy, Adam)
        assert e["tools"]["deepspeed_zero2"]["bytes"] == 20 * P


def test_deepspeed_largest_layer_on_a_small_model(stored):
    """The largest layer DeepSpeed's stage3.model_to_params finds: GPT-2's token embedding."""
    pytest.importorskip("deepspeed")
    e = next(e for e in stored["runs"] if e["model"] == "gpt2")
    spec = preset("gpt2")
    assert e["tools"]["deepspeed_zero3"]["largest_layer_params"] == spec.vocab_size * spec.hidden_size
    assert tc.model_counts.__wrapped__(spec)["largest_layer_params"] == spec.vocab_size * spec.hidden_size


def test_accelerate_called_live_on_gpt2_without_the_hub(stored, monkeypatch):
    """accelerate's own gather_data on GPT-2 small: the stored numbers, its arithmetic (float32: the
    'step' term, 4 x the fp32 size; float16: 2 x), and no Hub call on the way."""
    pytest.importorskip("accelerate")
    from accelerate.commands import estimate

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(estimate, "model_info", no_hub)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "model_info", no_hub)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    spec = preset("gpt2")
    rows = tc.accelerate_rows.__wrapped__(spec)
    fp32 = 4 * spec.params  # GPT-2's AutoModel: every parameter, tied head counted once, no buffers
    assert rows["float32"]["total_size"] == fp32 and rows["float32"]["training"] == 4 * fp32
    assert rows["float16"]["total_size"] == fp32 // 2 and rows["float16"]["training"] == 2 * fp32
    assert rows["float32"]["training"] == max(estimate.estimate_training_usage(fp32, "float32").values())
    for e in stored["runs"]:
        if e["model"] == "gpt2" and not e["overrides"]:
            row = rows["float32" if e["options"]["precision"] == "fp32" else "float16"]
            assert e["tools"]["accelerate"]["bytes"] == row["training"], e["run"]


def test_vramlab_column_is_current(stored):
    """The stored vramlab numbers are today's estimate (within 1 %: regenerate the file otherwise)."""
    from vramlab.memory import estimate_training

    for e in stored["runs"][::4]:
        now = estimate_training(tc.run_spec(e), device="cuda", gpu="h100", **e["options"]).total
        assert math.isclose(e["tools"]["vramlab"]["bytes"], now, rel_tol=0.01), (
            f"{e['run']}: stored {e['tools']['vramlab']['bytes']:,} vs {now:,}: rerun {tc.PROG}")


@pytest.mark.parametrize("call, match", [
    (lambda: tc.rule_of_thumb(1000, "fp8"), "precision"),
    (lambda: tc.rule_of_thumb(0, "fp32"), "params"),
    (lambda: tc.playbook_widget(a=1, b=1, h=8, h_ff=32, L=1, s=4, v=10, recomputation="some"), "recomputation"),
    (lambda: tc.playbook_widget(a=1, b=1, h=8, h_ff=32, L=1, s=4, v=10, ff_activation="silu"), "ff_activation"),
    (lambda: tc.playbook_for(preset("t5-small"), batch_size=1, seq_len=8, precision="fp32"), "one dense"),
    (lambda: tc.playbook_for(preset("gpt2"), batch_size=1, seq_len=8, precision="fp32", recompute="sqrt"), "recompute"),
    (lambda: tc.parse_case("??? b=1"), "case"),
])
def test_bad_input_is_one_clear_line(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_main_refuses_a_bad_out_path(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as info:
        tc.main(["--out", str(tmp_path / "afile" / "x.json")])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err
