"""vramlab.measure.optimizers: the storage counter on hand-made objects (a tensor subclass counted by
its inner tensors, a storage shared between parameters once, views once, an object's tensors,
tensors outside `state`), the libraries' own buffers checked live without stepping (torchao's step
compiles), the optimizer fused into the backward pass really frees every gradient, and the stored
benchmark has its provenance and every optimizer. No torch.compile here; no times asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vramlab.measure import optimizers as opt_lab  # noqa: E402
from vramlab.measure.optimizers import StorageCounter, count_state, fuse_into_backward, storage_total  # noqa: E402

from .conftest import refused, tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "optimizers" / "cpu.json"


class Packed(torch.Tensor):
    """A hand-made wrapper subclass like torchao's optimizer states: an outer shape, inner tensors
    `codes` and `qmap` named by __tensor_flatten__."""

    @staticmethod
    def __new__(cls, codes, qmap, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes, qmap, shape):
        self.codes, self.qmap = codes, qmap

    def __tensor_flatten__(self):
        return ["codes", "qmap"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Packed(inner["codes"], inner["qmap"], outer_size)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


class Projector:
    """An object in the state holding a tensor (GaLore's projector keeps `ortho_matrix`)."""

    def __init__(self, m):
        self.ortho_matrix, self.rank = m, 4


def _optimizer(*params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_subclass_counts_its_inner_tensors_and_a_shared_map_once():
    p1, p2 = torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(600))
    qmap = torch.zeros(256)  # one map shared by both parameters' states
    opt = _optimizer(p1, p2)
    opt.state[p1] = {"step": torch.tensor(1.0), "exp_avg": Packed(torch.zeros(1000, dtype=torch.uint8), qmap, (1000,))}
    opt.state[p2] = {"step": 3, "exp_avg": Packed(torch.zeros(600, dtype=torch.uint8), qmap, (600,))}
    out = count_state(opt, [("a", p1), ("b", p2)])
    assert out["total"] == 4 + 1000 + 1024 + 600  # the map once, the int step nothing
    a, b = out["tensors"]
    assert a["state"] == {"step": 4, "exp_avg.codes": 1000, "exp_avg.qmap": 1024}
    assert b["state"] == {"exp_avg.codes": 600, "exp_avg.qmap": 0}  # counted with a
    assert b["view_bytes"]["exp_avg.qmap"] == 1024
    assert out["shared"] == [{"first": "a:exp_avg.qmap", "bytes": 1024, "references": 2}]
    assert a["kinds"]["exp_avg"].startswith("Packed float32")


def test_views_count_their_whole_storage_once_and_objects_their_tensors():
    base = torch.zeros(100, 10)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = _optimizer(p)
    opt.state[p] = {"m": base[:10], "v": base[10:20], "projector": Projector(base[:, :2])}
    out = count_state(opt, [("w", p)])
    assert out["total"] == 4000  # three views of one 100 x 10 fp32 storage
    assert out["tensors"][0]["state"] == {"m": 4000, "v": 0, "projector.ortho_matrix": 0}
    assert out["tensors"][0]["view_bytes"] == {"m": 400, "v": 400, "projector.ortho_matrix": 800}
    assert storage_total([base[:1], base[5:]], Projector(base.T)) == 4000
    assert storage_total(Projector(torch.zeros(8, dtype=torch.bfloat16)), 7, "x", None) == 16


def test_tensors_outside_the_state_count_once():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = _optimizer(p)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # torchao keeps its learning rate as a tensor
    shared = torch.zeros(256)
    opt.state[p] = {"qmap1": shared}
    opt.name2qmap = {"dynamic": shared, "udynamic": torch.zeros(256)}  # bitsandbytes' maps
    out = count_state(opt, [("w", p)])
    assert out["in_state"] == 1024
    assert out["outside_state"] == {"param_groups[0].lr": 4, "name2qmap.dynamic": 0, "name2qmap.udynamic": 1024}
    assert out["total"] == 1024 + 4 + 1024


def test_counter_keys_storages_not_tensors():
    c = StorageCounter()
    t = torch.zeros(64)
    assert c.add(t, "x") == 256 and c.add(t.view(8, 8), "y") == 0 and c.add(t[3:], "z") == 0
    assert c.add(torch.zeros(64), "w") == 256 and c.total == 512
    assert c.shared() == [{"first": "x", "bytes": 256, "references": 3}]


def test_torchao_buffers_live_without_a_step():
    """torchao's own buffer constructor (`_new_buffer`, what its step calls first): quantized only for
    >= 4096 values that divide into blocks (256 for 8-bit and fp8, 128 for 4-bit), else zeros_like(p)."""
    ao = pytest.importorskip("torchao.optim")
    for n, quantized in ((65536, True), (4352, True), (4096 + 128, False), (4000, False)):
        p = torch.nn.Parameter(torch.zeros(n))
        b8 = ao.AdamW8bit([p])._new_buffer(p, signed=True)
        b4 = ao.AdamW4bit([p])._new_buffer(p, signed=False)
        bf = ao.AdamWFp8([p])._new_buffer(p, signed=True)
        if quantized:  # codes, a fp32 scale per block, a fp32 map per state (256 entries; 16 for 4-bit)
            assert storage_total(b8) == n + n // 256 * 4 + 256 * 4
            assert storage_total(bf) == n + n // 256 * 4
            assert type(b8).__name__ == "OptimState8bit" and type(bf).__name__ == "OptimStateFp8"
        else:
            assert type(b8) is torch.Tensor and storage_total(b8) == storage_total(bf) == 4 * n
        if n % 128 == 0 and n >= 4096:
            assert storage_total(b4) == n // 2 + n // 128 * 4 + 16 * 4
        else:
            assert storage_total(b4) == 4 * n


def test_bitsandbytes_8bit_shares_its_maps_live():
    bnb = pytest.importorskip("bitsandbytes")
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (5000, 4096, 100))
    opt = bnb.optim.AdamW8bit([a, b, c])
    for p in (a, b, c):
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    out = count_state(opt, [("a", a), ("b", b), ("c", c)])
    ta, tb, tc = out["tensors"]
    assert ta["state"] == {"state1": 5000, "qmap1": 1024, "state2": 5000, "qmap2": 1024, "absmax1": 80, "absmax2": 80}
    assert tb["state"]["qmap1"] == tb["state"]["qmap2"] == 0 and tb["state"]["absmax1"] == 64
    assert tc["state"] == {"state1": 400, "state2": 400}  # under 4096 values: two fp32 buffers
    assert {s["references"] for s in out["shared"]} == {3}  # two map storages: both states, name2qmap


def test_galore_split_follows_the_attention_and_mlp_weights():
    from vramlab.measure.models import build_model

    gpt2 = build_model(tiny("gpt2"), device="meta")
    projected, script = opt_lab.galore_split(gpt2)
    assert projected and all(".attn." in n or ".mlp." in n for n in projected)
    assert all(n.endswith(".weight") for n in projected) and script == []  # GPT-2's Conv1D is no nn.Linear
    moe = build_model(opt_lab.small_moe(), device="meta")
    projected, script = opt_lab.galore_split(moe)
    assert not any("gate.weight" in n and "proj" not in n for n in projected)  # routers stay plain
    assert not any("experts" in n for n in projected)  # 3-D expert tensors stay plain
    assert any("shared_expert_gate" in n for n in script)  # the script's own rule would take it


def test_the_optimizer_in_backward_frees_every_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    before = [p.detach().clone() for p in model.parameters()]
    steps = []
    optimizers, handles = fuse_into_backward(model, lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
                                             on_step=lambda name, first: first and steps.append(name))
    model(torch.randn(4, 8)).pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert sorted(steps) == sorted(n for n, _ in model.named_parameters())
    assert all(set(o.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p, o in optimizers.items())
    for h in handles:
        h.remove()


@pytest.mark.slow
def test_in_backward_peak_traced_on_a_tiny_model():
    spec = tiny("llama-3.2-1b", vocab_size=256, num_kv_heads=2)
    normal = opt_lab.measure_step_peak(spec, batch_size=1, seq_len=16, loop="normal", mode="trace")
    fused = opt_lab.measure_step_peak(spec, batch_size=1, seq_len=16, loop="in-backward", mode="trace")
    assert normal["grads_left"] == fused["grads_left"] == 0
    assert fused["categories"]["optimizer_states"] == normal["categories"]["optimizer_states"] > 0
    assert fused["peak"] < normal["peak"]  # few tokens: the step phase (all gradients at once) is the peak
    assert normal["peak_phase"] == "optimizer.step" and "optimizer.step" not in fused["phase_peaks"]
    assert "in-backward step" in fused["phase_peaks"]


def test_the_command_refuses_unknown_names(capsys):
    err = refused(opt_lab.main, ["--only", "states,nope"], capsys)
    assert "nope" in err and err.startswith(opt_lab.PROG)


@pytest.mark.skipif(not RESULTS.exists(), reason="the benchmark has not been run")
def test_the_stored_benchmark_has_provenance_and_every_optimizer():
    res = json.loads(RESULTS.read_text())
    prov = res["provenance"]
    assert {"date", "torch", "transformers", "python", "platform"} <= set(prov)
    assert set(prov["versions"]) == {"torch", "transformers", "bitsandbytes", "torchao", "galore-torch"}
    assert res["command"].startswith(opt_lab.PROG)
    assert set(res["models"]) >= set(opt_lab.MODELS)
    rows = res["states"]
    for model in opt_lab.MODELS:
        n_tensors = res["models"][model]["param_tensors"]
        for dtype in opt_lab.DTYPES:
            got = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
            assert {r["optimizer"] for r in got} == set(opt_lab.OPTIMIZERS), (model, dtype)
            assert {r.get("rank") for r in got if r["optimizer"] == "galore-adamw"} == set(opt_lab.GALORE_RANKS)
            for r in got:
                if "skipped" in r:
                    assert r["optimizer"] in opt_lab.NEEDS_CUDA and r["skipped"], r
                    continue
                assert len(r["tensors"]) == n_tensors
                assert r["total"] == sum(t["bytes"] for t in r["tensors"]) + sum(r["outside_state"].values())
    reference = {(r["model"], r["dtype"]): r["total"] for r in rows if r["optimizer"] == "adamw"}
    for (model, dtype), total in reference.items():  # torch AdamW: two states of the parameter's dtype + step
        n, k = res["models"][model]["params"], res["models"][model]["param_tensors"]
        assert total == 2 * n * (4 if dtype == "fp32" else 2) + 4 * k
    cases = {(c["model"], c["batch_size"], c["seq_len"], c["precision"], c["mode"]) for c in res["in_backward"]}
    assert {("gpt2", 2, 512, "fp32", "trace"), ("llama-3.2-1b", 1, 1024, "bf16", "trace"),
            ("llama-gqa-200", 4, 128, "fp32", "trace"), ("gpt2-small-256", 2, 128, "fp32", "cpu")} <= cases
    for c in res["in_backward"]:
        assert c["in-backward"]["peak"] <= c["normal"]["peak"] and c["in-backward"]["grads_left"] == 0
    assert {r["optimizer"] for r in res["peaks"]} == set(opt_lab.OTHER_PEAKS)
    assert {r["optimizer"] for r in res["step_time_cpu"]} == set(opt_lab.OPTIMIZERS) - set(opt_lab.NEEDS_CUDA)
