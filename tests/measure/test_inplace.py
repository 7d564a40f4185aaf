"""`vramlab.measure.inplace`: the two independent counts (saved-tensor hooks, live storages) on cases
whose bytes are known by hand, and the module switch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vramlab.inplace import MLPBlock  # noqa: E402
from vramlab.measure import inplace as ip  # noqa: E402


def test_live_bytes_sees_allocations_and_frees():
    torch.set_num_threads(1)
    x = torch.randn(4, 8)  # 128 bytes, alive before: not counted
    with ip.LiveBytes(existing=[x]) as live:
        y = x * 2  # 128
        z = y + 1  # 128: peak 256
        del y  # freed: 128 left
        w = z.view(32)  # a view: no new storage
    assert live.peak == 256 and live.now == 128
    del z, w


def test_saved_bytes_counts_storages_once_and_skips_parameters():
    torch.set_num_threads(1)
    lin = torch.nn.Linear(8, 16)
    x = torch.randn(3, 8, requires_grad=True)
    # relu saves its output (3 x 16 fp32); the linear its input (3 x 8) and the weight (a parameter)
    _, saved = ip.saved_bytes(lambda: torch.relu(lin(x)), exclude=list(lin.parameters()))
    assert saved == 3 * 16 * 4 + 3 * 8 * 4


def test_hooks_hide_autograd_refusal_so_it_is_checked_without_them():
    x = torch.randn(3, 8, requires_grad=True) * 1

    def bad():
        y = torch.relu(x)
        return y.mul_(2)  # overwrites relu's saved output

    assert "modified by an inplace operation" in ip.backward_refusal(bad)
    assert ip.backward_refusal(lambda: torch.relu(x) * 2) is None


def test_module_refuses_an_inplace_gelu_and_switches_real_modules():
    with pytest.raises(ValueError, match="no in-place GELU"):
        ip.MLPBlockModule(MLPBlock(hidden_size=4, intermediate_size=8, activation="gelu"), ("activation",))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.GELU())
    assert ip.set_inplace(model, dropouts=False) == ["1"]
    assert ip.set_inplace(model) == ["1", "2"] and model[2].inplace


def test_probe_measures_every_allowed_choice_as_predicted_on_this_machine():
    """The probe the GPU campaign runs on CUDA, here on the CPU's kernels at a small size: the measured
    saved bytes and forward peak equal `mlp_block_memory(device="cpu")` for every row."""
    rows = ip.probe("cpu", batch_size=1, seq_len=8, precisions=("fp32",))
    assert len(rows) == 10
    for r in rows:
        assert r["measured"] == r["predicted"], r


def test_cuda_probe_without_a_gpu_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the campaign runs the probe")
    assert ip.main(["--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip() == "vramlab.measure.inplace: --device cuda needs a CUDA GPU"
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gpu_campaign", root / "benchmarks" / "gpu_campaign.py")
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    assert "inplace" in campaign.STEPS
