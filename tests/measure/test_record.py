"""vramlab.measure.record: what every measurement records (provenance), the mode it runs in, and a
lab command's results file."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from vramlab.measure import record  # noqa: E402


def test_provenance_names_the_versions_and_no_gpu_on_the_cpu():
    info = record.provenance("cpu")
    assert info["torch"] == torch.__version__ and info["date"].endswith("+00:00") and "python" in info
    assert "gpu" not in info  # a CPU run never claims a GPU


def test_modes():
    assert record.resolve_mode("trace") == "trace" and record.resolve_mode("cpu") == "cpu"
    assert record.resolve_mode("auto") == ("cuda" if torch.cuda.is_available() else "trace")
    with pytest.raises(ValueError, match="unknown mode"):
        record.resolve_mode("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            record.resolve_mode("cuda")


def test_results_file_records_the_command_line(tmp_path, capsys):
    out = tmp_path / "new" / "r.json"
    assert record.write_results({"x": 1}, "vramlab.measure.zero", ["--nproc", "2"], out) == 0
    saved = json.loads(out.read_text())
    assert saved == {"x": 1, "command": "python -m vramlab.measure.zero --nproc 2"}
    assert record.write_results({"y": 2}, "vramlab.measure.zero", [], None) == 0  # no file: printed
    assert json.loads(capsys.readouterr().out)["y"] == 2
