"""`vramlab estimate --from FILE` (present/from_config.py) and its hook in `vramlab`'s command line: the
settings' sources printed, the same bytes as the library call, one line for bad input. The examples and fixtures
are tests/test_configs.py's."""

import json

from vramlab import specs
from vramlab import zero as Z
from vramlab.present import cli, from_config
from tests.test_configs import H, hf_cache, model, read  # noqa: F401 (fixtures)
from tests.test_configs_deepspeed import ACCELERATE_ZERO2
from tests.test_configs_hf import AXOLOTL_LORA_1B


def test_cli_prints_sources_and_the_estimate(tmp_path, model, capsys):
    path = tmp_path / "zero_stage2_config.json"
    path.write_text(ACCELERATE_ZERO2)
    assert from_config.main(["--from", str(path), "--model", model, "--seq-len", "512", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "zero_optimization.stage" in out and "vramlab.zero.estimate_rank(" in out and "not counted" in out
    total = Z.estimate_rank(specs.from_config(model), 2, 2, micro_batch_size=8, seq_len=512, recipe="mixed-adam",
                            implementation="deepspeed", optimizer_impl="foreach", reduce_bucket=H * H).total
    assert from_config.main(["--from", str(path), "--model", model, "--seq-len", "512", "--gpus", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["total_bytes"] == total and got["sources"]["zero_stage"] == "zero_optimization.stage"
    assert from_config.main(["--from", str(path), "--model", model, "--seq-len", "512", "--gpu", "h100"]) == 0
    assert "fits" in capsys.readouterr().out


def test_cli_reads_yaml(tmp_path, hf_cache, capsys):
    path = tmp_path / "lora-1b.yml"
    path.write_text(AXOLOTL_LORA_1B)
    assert from_config.main(["--from", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["format"] == "axolotl" and got["sources"]["lora_rank"] == "lora_r"
    assert got["total_bytes"] == read(str(path)).estimate().total


def test_cli_errors_are_one_line(tmp_path, model, capsys):
    ds = json.loads(ACCELERATE_ZERO2)
    ds["unknown_knob"] = 1
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert from_config.main(["--from", str(path), "--model", model, "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown_knob" in err
    assert from_config.main(["--from", str(tmp_path / "missing.yaml"), "--model", model]) == 2
    assert "no such file" in capsys.readouterr().err
    assert from_config.wants(["estimate", "--from", "x.yaml"]) and from_config.wants(["estimate", "--from=x.yaml"])
    assert not from_config.wants(["estimate", "train", "--model", "gpt2"])




def test_vramlab_estimate_from_goes_through_the_hook(tmp_path, model, capsys):
    # `vramlab estimate --from FILE` reaches from_config; `vramlab estimate train ...` does not
    path = tmp_path / "zero_stage2_config.json"
    path.write_text(ACCELERATE_ZERO2)
    assert cli.main(["estimate", "--from", str(path), "--model", model, "--seq-len", "512", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sources"]["zero_stage"] == "zero_optimization.stage"
    assert cli.main(["estimate", f"--from={tmp_path / 'missing.json'}", "--model", model]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert cli.main(["estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "64"]) == 0


def test_from_is_an_option_of_estimate(tmp_path, capsys):
    # `--from` is parsed with estimate's other options: what it does not read is refused in one line, and
    # without it estimate's required arguments are required as before
    import pytest

    path = tmp_path / "ds.json"
    path.write_text(ACCELERATE_ZERO2)
    for argv, says in [(["estimate", "--from", str(path), "--precision", "bf16"],
                        "argument --from: not allowed with argument --precision"),
                       (["estimate", "train", "--from", str(path)], "argument --from: not allowed with argument mode"),
                       (["estimate", "--model", "gpt2"], "the following arguments are required: mode, --batch-size, --seq-len"),
                       (["estimate", "train", "--batch-size", "1", "--seq-len", "8"],
                        "one of the arguments --model --hf-config is required"),
                       (["estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--format",
                         "deepspeed"], "--format: only with --from FILE")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1, (argv, err)
    assert "--from FILE" in cli.build_parser().commands["estimate"].format_help()
