import json
import subprocess
import sys

import pytest

from vramlab import preset
from vramlab.present.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "vramlab", *args], capture_output=True, text=True)


def test_json_output(capsys):
    assert main(["estimate", "train", "--model", "gpt2", "--batch-size", "8", "--seq-len", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 124_439_808
    assert isinstance(out["total_bytes"], int) and out["total_bytes"] == sum(out["breakdown"].values())
    assert set(out["breakdown"]) >= {"parameters", "gradients", "optimizer_states", "activations"}


def test_table_and_fit_verdict(capsys):
    assert main(["estimate", "train", "--model", "gpt2", "--batch-size", "64", "--seq-len", "1024",
                 "--gpu", "t4"]) == 0
    out = capsys.readouterr().out
    assert "GiB" in out and "does NOT fit on t4" in out and "largest batch size that fits" in out


def test_infer_and_hf_config(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["estimate", "infer", "--hf-config", str(tmp_path / "config.json"), "--batch-size", "2",
                 "--seq-len", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["breakdown"]["kv_cache"] == 2 * 2 * 2 * 32 * 128 * 2 * 2  # 2 L kv d s b bytes


@pytest.mark.parametrize("args, needle", [
    (["--model", "gpt2", "--batch-size", "0", "--seq-len", "8"], "positive integer"),
    (["--model", "gpt2", "--batch-size", "-3", "--seq-len", "8"], "positive integer"),
    (["--model", "gpt5", "--batch-size", "1", "--seq-len", "8"], "unknown model preset"),
    (["--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--gpu", "voodoo"], "unknown GPU"),
    (["--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--precision", "fp7"], "unknown precision"),
    (["--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--optimizer", "lion"], "invalid choice"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = run("estimate", "train", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_bad_configs_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"model_type": "gpt2", "n_embd": 100, "n_head": 12}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "mamba"}))
    for path, needle in [(bad, "not valid JSON"), (heads, "must divide"), (other, "unsupported model_type"),
                         (tmp_path / "nope.json", "cannot read")]:
        r = run("estimate", "train", "--hf-config", str(path), "--batch-size", "1", "--seq-len", "8")
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_console_script_and_lists():
    import shutil

    exe = shutil.which("vramlab", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "the vramlab console script is installed beside the interpreter"
    r = subprocess.run([exe, "presets"], capture_output=True, text=True)
    assert r.returncode == 0 and "llama-3.1-70b" in r.stdout and f"{preset('gpt2').params:,}" in r.stdout
    assert "h100-80gb" in run("gpus").stdout


def test_gpu_fit_shows_its_reserve(capsys):
    """--gpu prints what stands between the estimate and an OOM, term by term (and in --json)."""
    args = ["estimate", "train", "--model", "gpt2", "--batch-size", "104", "--seq-len", "512",
            "--precision", "bf16-mixed", "--gpu", "h100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for term in ("estimate margin (3%)", "fragmentation", "CUDA context and libraries", "79.18 GiB usable"):
        assert term in out, term
    assert main(args + ["--json"]) == 0
    g = json.loads(capsys.readouterr().out)["gpu"]
    r = g["reserve"]
    assert g["reserve_bytes"] == r["estimate_margin_bytes"] + r["fragmentation_bytes"] + r["cuda_context_bytes"]
    assert r["fragmentation_bytes"] == 104 * 512 * 50257 * 2  # the freed bf16 logits (half the fp32 gradient asked for next)
    assert main(args + ["--json", "--expandable-segments"]) == 0
    g2 = json.loads(capsys.readouterr().out)["gpu"]
    assert g2["expandable_segments"] and g2["reserve"]["fragmentation_bytes"] == (20 + 2) * 2**20  # a large and a small page
    assert g2["max_batch_size"] > g["max_batch_size"]


def test_generate_estimate(capsys):
    assert main(["estimate", "infer", "--model", "llama-3.2-1b", "--batch-size", "16", "--seq-len", "1024",
                 "--new-tokens", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_phase"].startswith("generate") and out["options"]["new_tokens"] == 128
    # the prompt's cache: 2 L a_kv d s b bytes = 2 * 16 * 8 * 64 * 1024 * 16 * 2
    assert out["breakdown"]["kv_cache"] == 2 * 16 * 8 * 64 * 1024 * 16 * 2


@pytest.mark.parametrize("args, needle", [
    (["train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--expandable-segments"], "give --gpu"),
    (["train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--new-tokens", "4"], "for 'estimate infer'"),
    (["infer", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--new-tokens", "-1"], "non-negative"),
    (["train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--gpu", "t4", "--device", "cpu"], "leave --device"),
])
def test_bad_gpu_options_one_line_exit_2(args, needle):
    r = run("estimate", *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_sequence_longer_than_the_model_reads_is_refused():
    r = run("estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "99999")
    assert r.returncode == 2 and "gpt2 reads at most 1,024 positions" in r.stderr and "Traceback" not in r.stderr
    ok = run("estimate", "train", "--model", "t5-small", "--batch-size", "1", "--seq-len", "4096")
    assert ok.returncode == 0  # T5's relative positions have no such limit


# ----------------------------------------------------------------------------- every chapter's subcommand
from vramlab import checkpointing as CK, compression as COMP, parallel as PAR, specs, zero as Z  # noqa: E402


def _json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


ZERO_70B = ["estimate", "train", "--model", "llama-3.1-70b", "--zero", "3", "--gpus", "8", "--gpu", "h100",
            "--batch-size", "1", "--seq-len", "4096", "--precision", "bf16-mixed"]


def test_zero_answers_70b_on_8_h100s(capsys):
    """The README's question, against zero.fits called directly with the same arguments."""
    out = _json(capsys, *ZERO_70B)
    f = Z.fits("llama-3.1-70b", 8, 3, "h100", micro_batch_size=1, seq_len=4096, recipe="mixed-adam",
               optimizer_impl="fused")
    assert out["gpu"]["fits"] is f.fits and out["gpu"]["needed_bytes"] == f.needed
    assert out["gpu"]["max_micro_batch_size"] == f.max_batch_size
    assert out["total_bytes"] == Z.estimate_rank("llama-3.1-70b", 8, 3, micro_batch_size=1, seq_len=4096,
                                                 recipe="mixed-adam", gpu=specs.gpu("h100")).total
    assert {s["setup"] for s in out["setups"]} == {"ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"}
    assert main(ZERO_70B) == 0
    text = capsys.readouterr().out
    assert ("YES:" if f.fits else "NO:") in text and "largest micro-batch that fits" in text
    assert "needed at batch size 1" in text


def test_fsdp2_is_zero3_sharding(capsys):
    out = _json(capsys, "estimate", "train", "--model", "llama-3.1-8b", "--fsdp2", "--gpus", "8", "--gpu", "h100",
                "--batch-size", "1", "--seq-len", "2048", "--precision", "bf16-mixed")
    f = Z.fits("llama-3.1-8b", 8, 3, "h100", micro_batch_size=1, seq_len=2048, recipe="mixed-adam",
               implementation="fsdp2", optimizer_impl="fused")
    assert out["setup"] == "FSDP2" and out["gpu"]["needed_bytes"] == f.needed and out["gpu"]["fits"] is f.fits


def test_plan_answers_as_plan_layouts(capsys):
    out = _json(capsys, "plan", "--model", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100", "--seq-len", "4096",
                "--top", "3")
    plans = PAR.plan_layouts("llama-3.1-70b", 64, "h100", seq_len=4096, global_batch=512)
    ok = [x for x in plans if x.fit.fits]
    assert out["layouts"] == len(plans) and out["layouts_fitting"] == len(ok) and len(out["shown"]) == 3
    assert [s["layout"] for s in out["shown"]] == [x.name for x in ok[:3]]
    assert out["shown"][0]["needed_bytes"] == ok[0].fit.needed


def test_lora_answers_as_peft_training(capsys):
    out = _json(capsys, "lora", "--model", "llama-3.1-8b", "--method", "qlora", "--batch-size", "1",
                "--seq-len", "2048", "--gpu", "h100")
    peak = COMP.peft_training("llama-3.1-8b", method="qlora", rank=16, batch_size=1, seq_len=2048, precision="bf16",
                              gpu=specs.gpu("h100"))
    assert out["total_bytes"] == peak.total and out["gpu"]["fits"]
    assert out["trainable_params"] == COMP.lora_params("llama-3.1-8b", rank=16)


def test_offload_answers_as_model_offload(capsys):
    out = _json(capsys, "offload", "--model", "llama-3.2-1b", "--scheme", "zero-offload", "--batch-size", "4",
                "--seq-len", "2048", "--gpu", "h100")
    g = specs.gpu("h100")
    s = CK.evaluate("llama-3.2-1b", "none", precision="bf16-mixed", gpu=g, batch_size=4, seq_len=2048).step_seconds
    m = __import__("vramlab.offload", fromlist=["x"]).model_offload("llama-3.2-1b", scheme="zero-offload", gpu=g,
                                                                    gpu_seconds=s, batch_size=4, seq_len=2048)
    assert out["gpu_peak_bytes"] == m.gpu_peak.total and out["host_bytes"] == m.host_bytes
    assert set(out["schemes"]) == {"none", "save-on-cpu", "zero-offload", "fsdp2-cpu"}


def test_checkpoint_answers_as_cheapest_plan(capsys):
    out = _json(capsys, "checkpoint", "--model", "llama-3.2-1b", "--gpu", "h100", "--batch-size", "16",
                "--seq-len", "2048")
    best = CK.cheapest_plan("llama-3.2-1b", None, batch_size=16, seq_len=2048, gpu="h100")
    assert out["cheapest"]["plan"] == best.plan.name and out["cheapest"]["peak_bytes"] == best.peak.total
    assert set(out["plans"]) >= set(CK.PLANS)
    b = out["max_batch_size"]
    assert CK.cheapest_plan("llama-3.2-1b", None, batch_size=b, seq_len=2048, gpu="h100") is not None
    assert CK.cheapest_plan("llama-3.2-1b", None, batch_size=b + 1, seq_len=2048, gpu="h100") is None


README_8B = ["estimate", "train", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "4096",
             "--precision", "bf16-mixed", "--recompute", "full", "--gpu", "h100"]




@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    README_8B, ZERO_70B,
    ["plan", "--model", "llama-3.1-70b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096"],
    ["lora", "--model", "llama-3.1-70b", "--batch-size", "1", "--seq-len", "4096", "--gpu", "h100"],
    ["offload", "--model", "llama-3.1-8b", "--scheme", "save-on-cpu", "--batch-size", "4", "--seq-len", "4096",
     "--gpu", "h100"],
    ["checkpoint", "--model", "llama-3.1-8b", "--gpu", "h100", "--batch-size", "4", "--seq-len", "4096"],
    ["estimate", "infer", "--model", "llama-3.1-70b", "--batch-size", "8", "--seq-len", "8192", "--gpu", "h100",
     "--precision", "fp32"],
    ["context", "--model", "llama-3.2-1b", "--seq-len", "131072", "--cp", "4", "--gpu", "h100"],
])
def test_suggestions_are_real(argv, capsys):
    out = _json(capsys, *argv)
    assert out["suggestions"], "a configuration that does not fit gets levers"
    for s in out["suggestions"]:
        got = _json(capsys, *s["argv"][1:])
        if s["argv"][1] == "plan":
            assert got["fits"] is s["fits"]
            if s["fits"]:
                assert got["shown"][0]["needed_bytes"] == s["needed_bytes"]
            continue
        if s["argv"][1] == "checkpoint":
            assert got["fits"] is s["fits"] and got["max_batch_size"] == (s["largest"] or 0)
            if s["fits"]:
                assert got["cheapest"]["needed_bytes"] == s["needed_bytes"]
            continue
        g = got["gpu"]
        assert g["fits"] is s["fits"] and g["needed_bytes"] == s["needed_bytes"], s["try"]
        assert g["max_batch_size"] == s["largest"], s["try"]


def test_readme_example_ends_with_suggestions(capsys):
    assert main(README_8B) == 0
    text = capsys.readouterr().out
    tail = text[text.index("largest batch size that fits: 0"):]
    assert "next levers" in tail and "--zero 3 --gpus" in tail and "--precision bf16" in tail


def test_precision_help_lists_every_recipe():
    from vramlab.present.cli import build_parser
    est = build_parser().commands["estimate"]
    help_ = next(a.help for a in est._actions if a.dest == "precision")
    from vramlab.precision import PRECISIONS
    assert all(p in help_ for p in PRECISIONS)


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (ZERO_70B[:-2] + ["--precision", "bf16"], "not a ZeRO recipe"),
    (ZERO_70B + ["--recompute", "full"], "--recompute does not apply"),
    (ZERO_70B + ["--recipe", "fp32-adam"], "not both"),
    (ZERO_70B[:4] + ["--gpus", "8", "--batch-size", "1", "--seq-len", "8"], "give --zero"),
    (ZERO_70B[:5] + ["2"] + ZERO_70B[6:] + ["--fsdp2"], "--fsdp2 shards like ZeRO-3"),
    (["estimate", "train", "--model", "gpt2", "--zero", "5", "--batch-size", "1", "--seq-len", "8"], "invalid choice"),
    (["estimate", "train", "--model", "gpt2", "--zero", "x", "--batch-size", "1", "--seq-len", "8"], "invalid int"),
    (["estimate", "infer", "--model", "gpt2", "--zero", "3", "--batch-size", "1", "--seq-len", "8"], "for 'estimate train'"),
    (ZERO_70B[:6] + ["--gpus", "0"] + ZERO_70B[8:], "positive integer"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100"], "required"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096", "--top", "0"], "positive"),
    (["plan", "--model", "t5-small", "--gpus", "8", "--gpu", "h100", "--seq-len", "512"], "decoder-only"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "voodoo", "--seq-len", "512"], "unknown GPU"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "67", "--gpu", "h100", "--seq-len", "512", "--global-batch", "7"],
     "no dp x tp x pp layout"),
    (["lora", "--model", "llama-3.1-8b", "--method", "dora", "--batch-size", "1", "--seq-len", "8", "--gpu", "h100"],
     "invalid choice"),
    (["lora", "--model", "llama-3.1-8b", "--method", "qlora", "--precision", "fp32", "--batch-size", "1",
      "--seq-len", "8", "--gpu", "h100"], "does not apply to qlora"),
    (["lora", "--model", "llama-3.1-8b", "--recompute", "most", "--batch-size", "1", "--seq-len", "8", "--gpu", "h100"],
     "recompute"),
    (["lora", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "8"], "required"),
    (["offload", "--model", "llama-3.1-8b", "--scheme", "nvme", "--batch-size", "1", "--seq-len", "8", "--gpu", "h100"],
     "invalid choice"),
    (["offload", "--model", "gpt5", "--scheme", "zero-offload", "--batch-size", "1", "--seq-len", "8", "--gpu", "h100"],
     "unknown model preset"),
    (["offload", "--model", "llama-3.1-8b", "--scheme", "zero-offload", "--batch-size", "-1", "--seq-len", "8",
      "--gpu", "h100"], "positive integer"),
    (["checkpoint", "--model", "llama-3.1-8b", "--gpu", "h100", "--batch-size", "1", "--seq-len", "8", "--plan", "every-0"],
     "every"),
    (["checkpoint", "--model", "gpt2", "--gpu", "h100", "--batch-size", "1", "--seq-len", "99999"], "1,024 positions"),
    (["checkpoint", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "8"], "required"),
])
def test_subcommands_bad_input_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stdout[-300:]
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_accumulation_steps_answers_as_estimate_training(capsys):
    from vramlab import estimate_training, zero

    assert main(["estimate", "train", "--model", "gpt2", "--batch-size", "4", "--seq-len", "512", "--precision",
                 "bf16-mixed", "--accumulation-steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_bytes"] == estimate_training("gpt2", batch_size=4, seq_len=512, precision="bf16-mixed",
                                                   accumulation_steps=4).total
    assert out["total_bytes"] > estimate_training("gpt2", batch_size=4, seq_len=512, precision="bf16-mixed").total
    assert main(["estimate", "train", "--model", "gpt2", "--batch-size", "4", "--seq-len", "512", "--precision",
                 "bf16-mixed", "--zero", "2", "--gpus", "4", "--accumulation-steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = zero.estimate_rank("gpt2", 4, 2, micro_batch_size=4, seq_len=512, accumulation_steps=4)
    assert out["total_bytes"] == want.total


@pytest.mark.parametrize("method, extra", [("prompt", []), ("prefix", ["--prefix-projection"]),
                                           ("p-tuning", ["--virtual-tokens", "8"])])
def test_prompt_learning_answers_as_peft_training(method, extra, capsys):
    from vramlab import compression as COMP

    assert main(["lora", "--model", "mt5-base", "--method", method, "--batch-size", "8", "--seq-len", "128",
                 "--gpu", "h100", "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    p = 8 if "--virtual-tokens" in extra else 20
    kw = dict(num_virtual_tokens=p, prefix_projection="--prefix-projection" in extra)
    assert out["total_bytes"] == COMP.peft_training("mt5-base", method=method, batch_size=8, seq_len=128,
                                                    precision="bf16", gpu="h100", **kw).total
    assert out["trainable_params"] == COMP.prompt_learning("mt5-base", method=method, **kw).trainable
    assert out["num_virtual_tokens"] == p and "rank" not in out


@pytest.mark.parametrize("args, needle", [
    (["estimate", "infer", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--accumulation-steps", "2"],
     "--accumulation-steps does not apply to 'estimate infer'"),
    (["lora", "--model", "gpt2", "--method", "prompt", "--prefix-projection", "--batch-size", "1", "--seq-len", "8",
      "--gpu", "t4"], "--prefix-projection is prefix tuning's"),
    (["lora", "--model", "gpt2", "--method", "lora", "--virtual-tokens", "4", "--batch-size", "1", "--seq-len", "8",
      "--gpu", "t4"], "are for prompt, prefix and p-tuning"),
    (["lora", "--model", "gpt2", "--method", "prompt", "--virtual-tokens", "2000", "--batch-size", "1", "--seq-len",
      "8", "--gpu", "t4"], "virtual tokens"),
])
def test_new_flags_bad_input_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_estimate_with_a_gpu_says_the_longest_sequence_as_fitting_does(capsys):
    from vramlab import fitting

    assert main(["estimate", "train", "--model", "llama-3.2-1b", "--batch-size", "2", "--seq-len", "4096",
                 "--precision", "bf16-mixed", "--recompute", "full", "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = fitting.longest_sequence("llama-3.2-1b", "h100", batch_size=2, precision="bf16-mixed", recompute="full")
    assert out["gpu"]["longest_seq_len"] == want.seq_len > 4096 and not out["gpu"]["longest_seq_len_capped_by_positions"]
    assert main(["estimate", "train", "--model", "llama-3.2-1b", "--batch-size", "2", "--seq-len", "4096",
                 "--precision", "bf16-mixed", "--recompute", "full", "--gpu", "h100"]) == 0
    assert f"longest sequence that fits on h100-80gb at batch size 2: {want.seq_len:,} tokens" in capsys.readouterr().out


def test_presets_lists_the_mixture_of_experts_with_their_active_parameters():
    from vramlab import moe, specs

    r = run("presets")
    assert r.returncode == 0
    for name in specs.moe_preset_names():
        assert f"{moe.active_params(specs.preset(name)):>15,d} active a token" in r.stdout, name
    ok = run("estimate", "train", "--model", "deepseek-v2-lite", "--batch-size", "1", "--seq-len", "8")
    assert ok.returncode == 0 and "total" in ok.stdout, ok.stderr
    from vramlab import estimate_training

    train = run("estimate", "train", "--model", "mixtral-8x7b", "--batch-size", "1", "--seq-len", "4096", "--precision",
                "bf16-mixed", "--capacity-factor", "1.25", "--json")
    assert train.returncode == 0, train.stderr
    assert json.loads(train.stdout)["total_bytes"] == estimate_training(
        "mixtral-8x7b", batch_size=1, seq_len=4096, precision="bf16-mixed", capacity_factor=1.25).total
    ok = run("estimate", "infer", "--model", "mixtral-8x7b", "--batch-size", "1", "--seq-len", "4096", "--json")
    from vramlab import estimate_inference

    assert ok.returncode == 0 and json.loads(ok.stdout)["total_bytes"] == estimate_inference(
        "mixtral-8x7b", batch_size=1, seq_len=4096).total


def test_loss_flag_and_its_lever(capsys):
    from vramlab import estimate_training

    args = ["estimate", "train", "--model", "llama-3.2-1b", "--batch-size", "1", "--seq-len", "65536", "--precision",
            "bf16-mixed", "--recompute", "full", "--gpu", "h100"]
    assert main([*args, "--loss", "fused", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_bytes"] == estimate_training("llama-3.2-1b", batch_size=1, seq_len=65536, precision="bf16-mixed",
                                                   recompute="full", gpu="h100", loss="fused").total
    assert main([*args, "--json"]) == 0  # the whole loss does not fit: the fused loss is the first lever
    argvs = [s["argv"] for s in json.loads(capsys.readouterr().out)["suggestions"]]
    assert any("--loss" in a and "fused" in a for a in argvs), argvs
    r = run("estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "16", "--zero", "2", "--loss",
            "chunked")
    assert r.returncode == 2 and "--loss prices one GPU's step" in r.stderr


CONTEXT_1B = ["context", "--model", "llama-3.2-1b", "--seq-len", "131072", "--cp", "8", "--gpu", "h100"]


def test_context_answers_as_context_parallel(capsys):
    """`vramlab context` is `context_parallel.context_parallel` at the asked CP size and at every other one that
    splits the sequence (and, for Ulysses, the heads); the fit is `fitting.device_fit` of the rank's peak at
    its s/cp tokens, and the largest batch the one where one more sequence does not fit."""
    from vramlab import context_parallel, fitting

    out = _json(capsys, *CONTEXT_1B)
    r = context_parallel.context_parallel("llama-3.2-1b", cp=8, batch_size=1, seq_len=131072, gpu="h100")
    assert out["peak_bytes"] == r["peak"] and out["tokens_per_rank"] == 16384 and out["zigzag"] is True
    assert out["sent_per_layer_bytes"] == r["sent_per_layer"] and out["verdict"] == r["verdict"]
    assert set(out["sweep"]) == {"1", "2", "4", "8", "16", "32", "64"}
    for n, s in out["sweep"].items():
        x = context_parallel.context_parallel("llama-3.2-1b", cp=int(n), batch_size=1, seq_len=131072, gpu="h100")
        assert s["peak_bytes"] == x["peak"] and s["tokens_per_rank"] == 131072 // int(n)
    assert out["sweep"]["1"]["fits"] is False and out["sweep"]["16"]["fits"] is True  # CP is what makes 128 k fit
    b = out["gpu"]["max_batch_size"]

    def fits(batch):
        x = context_parallel.context_parallel("llama-3.2-1b", cp=8, batch_size=batch, seq_len=131072, gpu="h100")
        return fitting.device_fit(x["peak"], "h100", largest_tensor=fitting.fragmentation_bytes(
            "llama-3.2-1b", batch_size=batch, seq_len=16384, precision="bf16-mixed")).fits
    assert b == 0 and not fits(1) or fits(b) and not fits(b + 1)
    uly = _json(capsys, "context", "--model", "llama-3.2-1b", "--seq-len", "131072", "--cp", "8", "--method", "ulysses",
                "--gpu", "h100")
    assert set(uly["sweep"]) == {"1", "2", "4", "8"} and uly["verdict"] == "exposed"  # 8 kv heads: cp <= 8


def test_context_is_the_lever_for_a_sequence_too_long_for_one_gpu(capsys):
    """A 1B model at 128 k tokens fits no single H100 even with full recompute and the fused loss;
    splitting the sequence over 8 ranks does, and the suggestion says so with the command to run."""
    out = _json(capsys, "estimate", "train", "--model", "llama-3.2-1b", "--batch-size", "1", "--seq-len", "131072",
                "--precision", "bf16-mixed", "--gpu", "h100")
    assert out["gpu"]["fits"] is False
    ctx = [s for s in out["suggestions"] if s["argv"][1] == "context"]
    assert ctx and ctx[0]["fits"], out["suggestions"]
    again = _json(capsys, *ctx[0]["argv"][1:])
    assert again["gpu"]["fits"] and again["gpu"]["needed_bytes"] == ctx[0]["needed_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--seq-len", "1000", "--cp", "8"], "multiple of 16"),
    (["--seq-len", "4096", "--cp", "3", "--method", "ulysses"], "must divide"),
    (["--seq-len", "4096", "--cp", "0"], "positive integer"),
    (["--seq-len", "4096", "--cp", "2", "--method", "zigzag"], "invalid choice"),
    (["--seq-len", "999999999", "--cp", "2"], "positions"),
])
def test_context_bad_input_one_line_exit_2(args, needle):
    r = run("context", "--model", "llama-3.2-1b", "--gpu", "h100", *args)
    assert r.returncode == 2, r.stdout[-300:]
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run("context", "--model", "bert-base", "--gpu", "h100", "--seq-len", "512", "--cp", "2")
    assert r.returncode == 2 and "causal decoders" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_context_with_recompute_and_the_fused_loss(capsys):
    """--recompute full and --loss fused are `context_parallel`'s; at 128 k tokens they are the first levers
    (the logits' gradient and the blocks' saved tensors before more ranks)."""
    from vramlab import context_parallel

    out = _json(capsys, "context", "--model", "llama-3.2-1b", "--seq-len", "131072", "--cp", "2", "--recompute", "full",
                "--loss", "fused", "--gpu", "h100")
    r, fit = context_parallel.context_fit("llama-3.2-1b", "h100", cp=2, batch_size=1, seq_len=131072, recompute="full",
                                  loss="fused", precision="bf16-mixed")
    assert out["peak_bytes"] == r["peak"] and out["gpu"]["fits"] is fit.fits is True
    assert out["sent_per_layer_bytes"]["recompute"] == out["sent_per_layer_bytes"]["forward"] > 0
    plain = _json(capsys, "context", "--model", "llama-3.2-1b", "--seq-len", "131072", "--cp", "2", "--gpu", "h100")
    tries = [s["try"] for s in plain["suggestions"]]
    assert any("--loss" in t for t in tries) or any("--recompute full" in t for t in tries), tries
    bad = run("context", "--model", "llama-3.2-1b", "--seq-len", "4096", "--cp", "2", "--recompute", "selective",
              "--gpu", "h100")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_experts_answers_as_expert_parallel(capsys):
    """`vramlab experts` is `expert_parallel.expert_parallel` at --ep and at every EP size that divides the experts
    and the ranks; bad input is one line."""
    from vramlab import expert_parallel

    out = _json(capsys, "experts", "--model", "qwen3-30b-a3b", "--ep", "8", "--dp", "16", "--batch-size", "2",
                "--seq-len", "4096", "--capacity-factor", "1.25", "--zero", "1")
    want = expert_parallel.expert_parallel("qwen3-30b-a3b", ep=8, dp=16, batch_size=2, seq_len=4096, capacity_factor=1.25,
                                    zero_stage=1)
    assert out["states_bytes"] == want["states"] and out["experts_per_rank"] == 16 and out["edp"] == 2
    assert out["sent_per_layer_bytes"] == want["sent_per_layer"] and out["capacity"] == want["capacity"]
    assert set(out["sweep"]) == {"1", "2", "4", "8", "16"}  # 128 experts, 16 ranks
    assert out["sweep"]["16"]["expert_states_bytes"] < out["sweep"]["1"]["expert_states_bytes"]
    for args, says in ((["--model", "gpt2", "--ep", "2", "--dp", "2"], "needs a mixture of experts"),
                       (["--model", "mixtral-8x7b", "--ep", "16", "--dp", "16"], "8 routed experts"),
                       (["--model", "mixtral-8x7b", "--ep", "2", "--dp", "3"], "ep must divide dp"),
                       (["--model", "mixtral-8x7b", "--ep", "2", "--dp", "2", "--zero", "3"], "invalid choice")):
        r = run("experts", *args, "--batch-size", "1", "--seq-len", "8")
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_experts_with_tensor_and_pipeline_parallelism_prints_every_stage(capsys):
    """`vramlab experts --tp/--pp/--etp` is `expert_parallel.moe_layout_states`: one rank's states on every stage."""
    from vramlab import expert_parallel

    out = _json(capsys, "experts", "--model", "deepseek-v3", "--pp", "16", "--ep", "64", "--dp", "128", "--zero", "1",
                "--batch-size", "1", "--seq-len", "4096")
    want = expert_parallel.moe_layout_states("deepseek-v3", pp=16, ep=64, dp=128, zero_stage=1)
    assert out["devices"] == 2048 and out["edp"] == 2 and len(out["stages"]) == 16
    assert out["states_bytes"] == want["states"] and [s["states_bytes"] for s in out["stages"]] == \
        [s["states"] for s in want["stages"]]
    r = run("experts", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "8", "--dp", "2", "--batch-size", "1",
            "--seq-len", "8")
    assert r.returncode == 2 and "etp x ep must divide tp x dp" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_serve_is_the_serving_plan(capsys):
    """`vramlab serve` is `serving.serving_plan` (vLLM's pool, blocks and start-up line) and the same at every KV
    dtype; a deployment whose weights do not fit is one line."""
    from vramlab import serving

    out = _json(capsys, "serve", "--model", "llama-3.1-8b", "--gpu", "h100", "--prompt-len", "1000", "--output-len",
                "1000", "--shared-prefix", "200", "--n", "2")
    want = serving.serving_plan("llama-3.1-8b", gpu="h100", prompt_len=1000, output_len=1000, shared_prefix_len=200,
                                n_samples=2)
    assert out["num_blocks"] == want.num_blocks and out["max_requests"] == want.max_requests
    assert out["available_kv_bytes"] == want.available_kv_bytes and out["blocks_per_request"] == 125
    assert out["by_kv_dtype"]["fp8"]["num_blocks"] > out["by_kv_dtype"]["int8"]["num_blocks"] > \
        out["by_kv_dtype"]["bf16"]["num_blocks"]
    assert out["throughput"]["decode_tokens_per_s"] > 0
    text = run("serve", "--model", "llama-3.1-8b", "--gpu", "h100", "--prompt-len", "1000", "--output-len", "1000")
    assert text.returncode == 0 and "Maximum concurrency for 2,000 tokens per request: 227.61x" in text.stdout
    for args, says in ((["--model", "llama-3.1-70b"], "no memory left for the KV cache"),
                       (["--model", "llama-3.1-8b", "--draft-model", "gpt2", "--speculative-tokens", "2"], "tokenizer"),
                       (["--model", "llama-3.1-8b", "--utilization", "1.5"], "gpu_memory_utilization")):
        r = run("serve", *args, "--gpu", "h100", "--prompt-len", "100", "--output-len", "100")
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _oldest_python():
    """An interpreter of the lowest Python that pyproject.toml allows, if this machine has one (pyenv's included)."""
    import glob
    import os
    import re
    import shutil
    from pathlib import Path

    floor = re.search(r'requires-python = ">=(\d+)\.(\d+)"',
                      (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()).groups()
    want = ".".join(floor)
    home = os.path.expanduser("~/.pyenv/versions")
    for exe in [shutil.which(f"python{want}"), *sorted(glob.glob(f"{home}/{want}.*/bin/python"))]:
        if exe and subprocess.run([exe, "-c", f"import sys; assert sys.version_info[:2] == {tuple(map(int, floor))}"],
                                  capture_output=True).returncode == 0:
            return exe, want
    return None, want


def test_the_command_line_runs_on_the_lowest_python_allowed(tmp_path):
    """pyproject.toml allows Python 3.10, which has no tomllib: the CLI (pure Python) starts and estimates there,
    and a TOML config is one line that says what it needs."""
    from pathlib import Path

    exe, want = _oldest_python()
    if exe is None:
        pytest.skip(f"no Python {want} on this machine")
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from vramlab.present.cli import main; "
            "raise SystemExit(main(sys.argv[2:]))")
    r = subprocess.run([exe, "-I", "-c", code, src, "estimate", "train", "--model", "gpt2", "--batch-size", "2",
                        "--seq-len", "128"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "total" in r.stdout, r.stderr
    for args, says in [(["--help"], "estimate"), (["estimate", "--help"], "--from FILE"), (["gpus"], "h100"),
                       (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096"], "fits")]:
        r = subprocess.run([exe, "-I", "-c", code, src, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and says in r.stdout, (args, r.stderr)
    ds = tmp_path / "ds_config.json"  # a JSON config needs no tomllib
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}))
    r = subprocess.run([exe, "-I", "-c", code, src, "estimate", "--from", str(ds), "--model", "gpt2", "--seq-len", "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "zero_optimization.stage" in r.stdout, r.stderr
    toml = tmp_path / "train.toml"  # reading TOML says what it needs, in one line
    toml.write_text('[model]\nname = "llama3"\n')
    r = subprocess.run([exe, "-I", "-c", code, src, "estimate", "--from", str(toml)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("vramlab: error: reading a TOML config needs Python 3.11 or later "
                                                      "(this is Python 3.10)"), r.stderr
