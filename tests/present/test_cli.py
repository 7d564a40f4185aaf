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
    assert g2["expandable_segments"] and g2["reserve"]["fragmentation_bytes"] == 2 * 2**20
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
