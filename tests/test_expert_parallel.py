"""Expert parallelism (H2): `expert_parallel.expert_parallel`'s calculator, and the all-to-all dispatch run on gloo ranks
(`python -m vramlab.measure.parallel ep`) against it: stored campaign + two live runs."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from vramlab import moe
from vramlab import expert_parallel as EP

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "expert_parallel" / "cpu.json"


def _runs():
    return json.loads(RESULTS.read_text())["runs"]


def _spec(name):
    from vramlab.measure.expert_parallel import ep_model_spec

    return ep_model_spec(name)


def _check_run(result):
    """States exact, peak within 5 %, bytes sent as counted, training equal to one process."""
    from vramlab.measure.expert_parallel import ep_prediction

    spec = _spec(result["model_name"])
    moe_layers = len(spec.moe_layer_ids)
    cf = result["capacity_factor"]
    for r in result["per_rank"]:
        pred = ep_prediction(spec, ep=result["ep"], dp=result["ranks"], batch_size=result["micro_batch_size"],
                             seq_len=result["seq_len"], capacity_factor=cf,
                             received_rows=tuple(r["received_rows"]), kept_rows=tuple(r["kept_rows"]),
                             home_rows=tuple(r["home_rows"]), zero=result["zero"], rank=r["rank"])
        where = (f"{result['model_name']} ep {result['ep']} dp {result['ranks']} cf {cf} zero {result['zero']} "
                 f"rank {r['rank']}")
        # parameters, gradients, optimizer states: the ranks' real storages, byte for byte
        assert r["states"]["parameters"] == pred["parameters"], where
        assert r["states"]["optimizer_states"] == pred["optimizer_states"], where
        assert r["states"]["gradients"] == sum(pred["gradients"].values()), where
        # the peak of a steady-state step
        err = (pred["peak"] - r["memory"]["peak"]) / r["memory"]["peak"]
        assert abs(err) <= 0.05, f"{where}: predicted {pred['peak']:,} measured {r['memory']['peak']:,} ({err:+.1%})"
        # two all-to-alls per MoE layer forward and two backward
        assert r["a2a_calls"] == {"forward": 2 * moe_layers, "backward": 2 * moe_layers}, where
        T, k, h = result["micro_batch_size"] * result["seq_len"], spec.num_experts_per_tok, spec.hidden_size
        # the bytes the all-to-alls sent to other ranks, counted at each call, against the calculator (exact: given
        # the run's routing when dropless, from E x C alone with a capacity)
        assert r["sent_total"] == pred["sent_total"], where
        if cf is not None:  # fixed E x C buffers: the bytes are exact
            assert r["sent_per_layer"] == pred["sent_per_layer"], where
            C = moe.expert_capacity(T, spec.num_experts, k, cf)
            assert pred["sent_per_layer"]["forward"] == 2 * spec.num_experts * C * h * 4 * (result["ep"] - 1) // result["ep"]
            assert r["received_rows"] == [spec.num_experts * C] * moe_layers
        else:  # dropless: what leaves depends on the router; never more than every choice
            assert 0 < r["sent_per_layer"]["forward"] <= 2 * T * k * h * 4, where
            assert pred["dispatch_rows"]["sent"] == T * k
            # the balanced router's expectation (no routing given): (ep-1)/ep of T k rows each way
            plain = ep_prediction(spec, ep=result["ep"], dp=result["ranks"], batch_size=result["micro_batch_size"],
                                  seq_len=result["seq_len"])
            assert plain["sent_per_layer"]["forward"] == 2 * T * k * h * 4 * (result["ep"] - 1) // result["ep"]
        assert r["param_max_rel_diff"] < 1e-5, f"{where}: trained parameters differ from one process's"
    # the EP group's received rows: everything its ranks sent, dropless
    if cf is None:
        ep = result["ep"]
        for g in range(result["ranks"] // ep):
            got = [sum(result["per_rank"][g * ep + j]["received_rows"][layer] for j in range(ep))
                   for layer in range(moe_layers)]
            assert got == [ep * T * k] * moe_layers


# --------------------------------------------------------------- stored campaign

def test_the_campaign_covers_what_it_must():
    runs = _runs()
    assert len(runs) >= 6
    cfgs = [r["config"] for r in runs]
    assert {c["ep"] for c in cfgs} >= {2, 4}
    assert any(c["ep"] == 2 and c["dp"] == 4 for c in cfgs)  # edp = 2
    assert {c.get("capacity_factor") for c in cfgs} >= {None, 1.0, 1.5}
    ks = {_spec(c["model"]).num_experts_per_tok for c in cfgs}
    assert ks >= {1, 2}
    per_rank = {_spec(c["model"]).num_experts // c["ep"] for c in cfgs}
    assert 1 in per_rank and max(per_rank) > 1
    assert any(_spec(c["model"]).num_shared_experts for c in cfgs)
    assert any(_spec(c["model"]).moe_layer_ids[0] > 0 for c in cfgs)  # a dense first layer
    assert any(c.get("zero") and c["dp"] > c["ep"] for c in cfgs)  # ZeRO-1 with edp > 1
    assert len({(c["micro_batch"], c["seq"]) for c in cfgs}) > 2
    assert "provenance" in json.loads(RESULTS.read_text())


@pytest.mark.parametrize("index", range(10))
def test_stored_run_against_the_calculator(index):
    runs = _runs()
    if index >= len(runs):
        pytest.skip("fewer stored runs")
    _check_run(runs[index]["result"])


# --------------------------------------------------------------- live, on gloo ranks

@pytest.fixture(scope="module")
def live():
    from vramlab.measure.expert_parallel import run_ep

    return [run_ep(dict(model="ep-mixtral", ep=2, dp=2, micro_batch=1, seq=64, capacity_factor=1.0), timeout=300),
            run_ep(dict(model="ep-qwen2", ep=2, dp=2, micro_batch=2, seq=64, zero=1), timeout=300)]


@pytest.mark.slow
def test_live_runs_against_the_calculator(live):
    from vramlab.measure.expert_parallel import ep_prediction

    for result in live:
        _check_run(result)
        spec = _spec(result["model_name"])
        layers = len(spec.moe_layer_ids)
        for r in result["per_rank"]:
            pred = ep_prediction(spec, ep=result["ep"], dp=result["ranks"], batch_size=result["micro_batch_size"],
                                 seq_len=result["seq_len"], capacity_factor=result["capacity_factor"])
            seen = r["memory"]["collectives_seen"]  # the ledger's count at each c10d call
            # the gradients' all-reduces: dense and expert gradients once each per step
            assert seen["c10d.allreduce_.default"]["input_bytes"] == sum(pred["grad_allreduce_bytes"].values())
            # four all-to-alls per MoE layer, and dropless one more (the counts) before each dispatch
            dropless = result["capacity_factor"] is None
            assert seen["c10d.alltoall_base_.default"]["calls"] == (5 if dropless else 4) * layers


# --------------------------------------------------------------- the calculator

def test_states_split_dense_whole_experts_by_ep():
    spec = _spec("ep-mixtral8")
    one = EP.expert_parallel(spec, ep=1, dp=4, batch_size=1, seq_len=16, precision="fp32")
    four = EP.expert_parallel(spec, ep=4, dp=4, batch_size=1, seq_len=16, precision="fp32")
    assert four["param_counts"]["dense"] == one["param_counts"]["dense"]
    assert 4 * four["param_counts"]["experts"] == one["param_counts"]["experts"]
    assert sum(one["param_counts"].values()) == spec.params
    parts = moe.param_breakdown(spec)
    assert one["param_counts"]["experts"] == parts["routed_experts"]


def test_zero_shards_dense_over_dp_and_experts_over_edp():
    spec = _spec("ep-mixtral")
    z0 = EP.expert_parallel(spec, ep=2, dp=4, batch_size=1, seq_len=16, precision="fp32", zero_stage=0)
    z1 = EP.expert_parallel(spec, ep=2, dp=4, batch_size=1, seq_len=16, precision="fp32", zero_stage=1)
    z2 = EP.expert_parallel(spec, ep=2, dp=4, batch_size=1, seq_len=16, precision="fp32", zero_stage=2)
    nd, ne = z0["param_counts"]["dense"], z0["param_counts"]["experts"]
    steps_d = z0["optimizer_states"]["dense"] - 8 * nd  # AdamW's fp32 step counts, one per tensor
    steps_e = z0["optimizer_states"]["experts"] - 8 * ne
    assert z1["optimizer_states"] == {"dense": 8 * -(-nd // 4) + steps_d, "experts": 8 * -(-ne // 2) + steps_e}
    assert z1["gradients"] == z0["gradients"]
    assert z2["gradients"] == {"dense": -(-nd // 4) * 4, "experts": -(-ne // 2) * 4}


def test_dispatch_rows():
    spec = _spec("ep-mixtral")  # 4 experts, top-2
    d = EP.expert_parallel(spec, ep=2, dp=2, batch_size=2, seq_len=64, precision="fp32")
    assert d["dispatch_rows"] == {"sent": 256, "received_expected": 256, "received_worst": 2 * 128 * 2}
    c = EP.expert_parallel(spec, ep=2, dp=2, batch_size=2, seq_len=64, precision="fp32", capacity_factor=1.5)
    C = moe.expert_capacity(128, 4, 2, 1.5)
    assert c["capacity"] == C and c["dispatch_rows"]["sent"] == 4 * C == c["dispatch_rows"]["received_expected"]
    assert c["sent_per_layer"]["forward"] == 2 * 4 * C * 64 * 4 // 2
    assert EP.expert_parallel(spec, ep=1, dp=2, batch_size=2, seq_len=64)["sent_per_layer"]["forward"] == 0


def test_greedy_shard_is_zero_redundancy_optimizers_partition():
    # torch/distributed/optim/zero_redundancy_optimizer.py `_partition_parameters`: largest first, to the emptiest rank
    sizes = [5, 9, 9, 1, 3, 7]
    shards = [EP._greedy_shard(sizes, 3, r) for r in range(3)]
    assert shards == [[9, 3], [9, 1], [7, 5]]  # 9, 9, 7 to ranks 0, 1, 2; 5 to rank 2 (7); 3 to 0; 1 to 1
    assert sorted(sum(shards, [])) == sorted(sizes)


def test_zero_greedy_states_cover_the_model_once():
    spec = _spec("ep-qwen2")
    ranks = [EP.expert_parallel(spec, ep=2, dp=4, batch_size=1, seq_len=16, precision="fp32", zero_stage=1,
                               zero_partition="greedy", rank=r) for r in range(4)]
    full = EP.expert_parallel(spec, ep=2, dp=4, batch_size=1, seq_len=16, precision="fp32")
    assert sum(r["optimizer_states"]["dense"] for r in ranks) == full["optimizer_states"]["dense"]
    # the experts' states: each edp group (ranks 0, 2 hold one half of the experts, 1, 3 the other) covers them once
    assert sum(ranks[r]["optimizer_states"]["experts"] for r in (0, 2)) == full["optimizer_states"]["experts"]


@pytest.mark.parametrize("kw, words", [
    (dict(ep=3, dp=4), "ep must divide dp"),
    (dict(ep=8, dp=8), "ep must divide"),
    (dict(ep=2, dp=2, capacity_factor=0), "capacity_factor"),
    (dict(ep=2, dp=2, capacity_factor=-1.0), "capacity_factor"),
    (dict(ep=0, dp=2), "ep"),
    (dict(ep=2, dp=2, zero_stage=3), "zero_stage"),
    (dict(ep=2, dp=2, precision="fp64"), "precision"),
    (dict(ep=2, dp=2, received_rows=(1,)), "received_rows"),
    (dict(ep=2, dp=2, rank=2), "rank"),
    (dict(ep=2, dp=2, zero_partition="random"), "zero_partition"),
])
def test_bad_input_is_one_line(kw, words):
    with pytest.raises(ValueError) as e:
        EP.expert_parallel(_spec("ep-mixtral"), batch_size=1, seq_len=16, **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="dense model"):
        EP.expert_parallel("gpt2", ep=1, dp=1, batch_size=1, seq_len=16)


def test_real_size_mixtral_and_deepseek_v3_at_ep8():
    # Mixtral-8x7B (Jiang et al. 2024, arXiv:2401.04088): 47B parameters (46.7B), 8 experts: at ep 8 a rank
    # holds one expert per layer (45.1B / 8) and the 1.6B dense ones
    m = EP.expert_parallel("mixtral-8x7b", ep=8, dp=8, batch_size=1, seq_len=4096)
    assert m["experts_per_rank"] == 1
    assert round(m["param_counts"]["experts"] * 8 / 1e9, 1) == 45.1
    assert round(sum(m["param_counts"].values()) / 1e9, 2) == 7.24
    assert 0.96 < m["expert_share"] < 0.97
    # DeepSeek-V3 (arXiv:2412.19437): 671B parameters, 256 routed experts in 58 MoE layers: at ep 8, 32 per
    # rank; the routed experts are 97.4 % of the model, so a rank holds 1/8 of them beside 17.1B dense ones
    d = EP.expert_parallel("deepseek-v3", ep=8, dp=8, batch_size=1, seq_len=4096)
    assert d["experts_per_rank"] == 32
    assert round((d["param_counts"]["experts"] * 8 + d["param_counts"]["dense"]) / 1e9) == 671
    assert round(d["param_counts"]["dense"] / 1e9, 1) == 17.1
    assert Fraction(97, 100) < d["expert_share"] < Fraction(98, 100)


@pytest.mark.parametrize("argv, says", [
    (["--ep", "3", "--dp", "4"], "ep must divide dp"),
    (["--capacity-factor", "0"], "--capacity-factor"),
    (["--model", "gpt2"], "--model"),
])
def test_the_command_refuses_bad_input_in_one_line(argv, says, capsys):
    from vramlab.measure.parallel import main

    with pytest.raises(SystemExit) as e:
        main(["ep", *argv])
    assert e.value.code == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()][-1]
    assert line.startswith("python -m vramlab.measure.parallel ep: error: ") and says in line, line
