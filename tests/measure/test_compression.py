"""`vramlab.measure.compression`: the compression chapter's measurement command."""

from __future__ import annotations

import json

import torch

import pytest

pytest.importorskip("torch")

from vramlab import compression as C  # noqa: E402
from vramlab.measure import compression as complab  # noqa: E402
from .conftest import CUDA, refused  # noqa: E402


# --------------------------------------------------------------- the command refuses bad arguments before any work

PROBE = {"method": "full", "targets": "-", "optimizer": "adamw", "batch_size": 8, "seq_len": 128, "mode": "cpu"}
COMPLAB = [
    (["--probe", "{not json"], "--probe must be a JSON object"), (["--probe", ""], "--probe must be a JSON object"),
    (["--probe", "[1, 2]"], "--probe must be a JSON object"), (["--probe", '{"method": "full"}'], "--probe needs"),
    (["--probe", json.dumps({**PROBE, "seq_len": 1000})], "reads at most 256 positions"),
    (["--probe", json.dumps({**PROBE, "batch_size": 0})], "--probe batch_size"),
    (["--probe", json.dumps({**PROBE, "batch_size": True})], "--probe batch_size"),
    (["--probe", json.dumps({**PROBE, "method": "dora"})], "--probe method"),
    (["--probe", json.dumps({**PROBE, "mode": "gpu"})], "--probe mode"),
    (["--probe", json.dumps({**PROBE, "autocast": "yes"})], "--probe autocast"),
    (["--probe", json.dumps({**PROBE, "recompute": "selective"})], "not measured"),
    (["--probe", json.dumps({**PROBE, "bogus": 1})], "unknown argument bogus"),
    (["--steps", "0"], "--steps"), (["--steps", "-1"], "--steps"), (["--steps", "2.5"], "--steps"),
    (["--mode", "gpu"], "--mode"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, says", COMPLAB, ids=[" ".join(a)[:40] or "(none)" for a, _ in COMPLAB])
def test_complab_refuses_in_one_line_before_any_measurement(argv, says, capsys):
    line = refused(complab.main, argv, capsys)
    assert line.startswith("python -m vramlab.measure.compression: error: ") and says in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_complab_out_is_checked_before_the_lab(afile, tmp_path, capsys):
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(complab.main, ["--out", str(out)], capsys)


@pytest.mark.usefixtures("nothing_starts")
def test_complab_valid_arguments_still_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(complab, "run", lambda mode, steps, progress: {"mode": mode, "steps": steps})
    monkeypatch.setattr(complab, "_probe", lambda cfg: {"measured_bytes": 1, "cfg": cfg})
    out = tmp_path / "new" / "c.json"
    assert complab.main(["--steps", "3", "--mode", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 3
    assert complab.main(["--probe", json.dumps(PROBE)]) == 0
    assert json.loads(capsys.readouterr().out)["cfg"] == PROBE


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.skipif(CUDA, reason="this machine has a GPU")
def test_complab_refuses_cuda_without_a_gpu(capsys):
    assert "needs a CUDA GPU" in refused(complab.main, ["--mode", "cuda"], capsys)


def test_lab8_int8_matmul_is_llm_int8():
    """complab's torch INT8 matmul (what lab 8 runs its model with) computes what the pure-Python
    `compression.llm_int8` does, on activations with outlier columns; W8A8 is the same with none
    kept in full precision, and differs from it there."""
    from vramlab.measure.compression import Int8Matmul

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g, dtype=torch.float64)
    x[:, [3, 17]] *= 40
    lin = torch.nn.Linear(24, 7, bias=False).double()
    ref = C.llm_int8(x.tolist(), lin.weight.tolist(), threshold=6.0)
    for scheme, want in (("llm.int8", ref["y"]), ("w8a8", C.llm_int8(x.tolist(), lin.weight.tolist(), threshold=1e9)["y"])):
        m = Int8Matmul(lin, scheme)
        with torch.no_grad():
            got = m(x)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9), scheme
    assert ref["outlier_columns"] == [3, 17]
    exact = (x @ lin.weight.T).detach()
    with torch.no_grad():
        assert (Int8Matmul(lin, "w8a8")(x) - exact).abs().max() > 10 * (Int8Matmul(lin, "llm.int8")(x) - exact).abs().max()
