"""vramlab.present.explain: `vramlab explain SNAPSHOT`'s table, verdicts, --json and one-line errors, on the
snapshots tests/test_snapshot.py builds to PyTorch's format."""

import json
import re

from tests.test_snapshot import MiB, training_oom
from vramlab import checks
from vramlab.present import explain as X


def _cli(argv):
    p = checks.Parser(prog="vramlab")
    sub = p.add_subparsers(dest="command", required=True, parser_class=checks.Parser)
    X.add_parser(sub)
    return X.answer(p.parse_args(argv))


def test_cli_table_and_verdicts(tmp_path, capsys):
    f = tmp_path / "oom.pickle"
    f.write_bytes(training_oom().bytes())
    assert _cli(["explain", str(f), "--model", "gpt2", "--batch-size", "8", "--seq-len", "512",
                 "--precision", "fp32", "--device-total-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^category\s+snapshot \(GiB\)\s+estimate \(GiB\)\s+difference \(GiB\)", out, re.M)
    assert re.search(r"^parameters\s+0\.156\s", out, re.M)
    assert "not expected by the estimate" in out and "expandable_segments" in out and "batch size 8" in out


def test_cli_json_and_estimate_file(tmp_path, capsys):
    f = tmp_path / "oom.pickle"
    f.write_bytes(training_oom().bytes())
    est = tmp_path / "est.json"
    est.write_text(json.dumps({"breakdown": {"parameters": 160 * MiB, "activations": 100 * MiB}, "batch_size": 8}))
    assert _cli(["explain", str(f), "--estimate", str(est), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["by_category"]["activations"] == 500 * MiB and d["batch_size"] == 8
    assert [u["category"] for u in d["unexpected"]][:2] == ["activations", "optimizer_states"]  # +400, +320 MiB


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "x.pickle"
    bad.write_bytes(b"\x80\x04not")
    assert X.main(["explain", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramlab: error: not a memory snapshot") and err.count("\n") == 1
    assert X.main(["explain", str(bad), "--model", "gpt2"]) == 2  # --model needs --batch-size and --seq-len
    assert "--batch-size" in capsys.readouterr().err


def test_cli_gpu_from_the_catalogue_names_memory_beyond_the_context(tmp_path, capsys):
    f = tmp_path / "oom.pickle"
    f.write_bytes(training_oom().bytes())
    assert _cli(["explain", str(f), "--gpu", "T4"]) == 0
    out = capsys.readouterr().out
    assert "outside the allocator (CUDA context, libraries)" in out and "beyond the CUDA context" in out
    assert X.main([str(f), "--gpu", "no-such-gpu"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_estimate_is_taken_at_the_phase_the_oom_came_in(tmp_path, capsys):
    """The failed request came from a forward frame: compared with the forward's end, not the step's peak."""
    from vramlab import memory

    f = tmp_path / "oom.pickle"
    f.write_bytes(training_oom().bytes())
    assert _cli(["explain", str(f), "--model", "gpt2", "--batch-size", "8", "--seq-len", "512", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    phases = memory.training_phases("gpt2", batch_size=8, seq_len=512, precision="fp32")
    assert d["estimate"] == phases[0].to_dict() and "forward end" in d["estimate_source"]
    assert phases[0].total < max(p.total for p in phases)  # the forward's end is not the peak here
