"""Context parallelism: `context_parallel.context_parallel`'s calculator, and ring attention and Ulysses
run on gloo ranks (`python -m vramlab.measure.parallel cp`) against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramlab import activations as act
from vramlab import context_parallel as CP
from vramlab import parallel as P
from vramlab.specs import from_config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "context_parallel" / "cpu.json"

LAB = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
GQA = dict(LAB, num_key_value_heads=2, num_hidden_layers=8, intermediate_size=768, vocab_size=6144,
           tie_word_embeddings=True)


@pytest.fixture(scope="module")
def lab():
    return from_config(LAB, name="llama-lab3")


@pytest.fixture(scope="module")
def gqa():
    return from_config(GQA, name="llama-gqa-val")


def cp(spec, **kw):
    kw = {"batch_size": 2, "seq_len": 256, "precision": "fp32", "device": "cpu", **kw}
    return CP.context_parallel(spec, **kw)


# --------------------------------------------------------------- the calculator

@pytest.mark.parametrize("method", CP.CP_METHODS)
def test_one_rank_is_the_plain_ledger_and_the_plain_estimate(lab, method):
    got = cp(lab, cp=1, method=method)
    plain = act.activation_bytes(lab, batch_size=2, seq_len=256, precision="fp32", device="cpu")
    assert got["activations"] == plain["layers"] + plain["outside"] + plain["weight_copies"]
    assert got["saved_per_layer"] == plain["one_layer"]
    assert got["in_flight_forward"] == got["in_flight_backward"] == 0
    assert got["sent_per_layer"] == {"forward": 0, "backward": 0, "recompute": 0}
    one = P.estimate_layout(lab, P.Layout(), micro_batch_size=2, seq_len=256, precision="fp32", device="cpu")[0]
    assert got["peak"] == one.total and got["verdict"] == "hidden"


@pytest.mark.parametrize("n", [2, 4])
def test_a_ring_rank_saves_what_one_device_saves_for_its_tokens(lab, gqa, n):
    for spec in (lab, gqa):
        got = cp(spec, cp=n, method="ring")
        plain = act.activation_bytes(spec, batch_size=2, seq_len=256 // n, precision="fp32", device="cpu")
        assert got["activations"] == plain["layers"] + plain["outside"] + plain["weight_copies"]
        assert got["tokens_per_rank"] == 256 // n


def test_ulysses_also_keeps_the_all_to_all_output(lab):
    ring, uly = cp(lab, cp=2, method="ring"), cp(lab, cp=2, method="ulysses")
    assert uly["saved_per_layer"] - ring["saved_per_layer"] == 2 * 128 * lab.q_dim * 4


def test_traffic_per_layer(gqa):
    b, s, kvd, n = 2, 256, gqa.kv_dim, 4
    block = b * (s // n) * kvd * 4  # one rank's k (or v) in fp32
    ring = cp(gqa, cp=n, method="ring")
    assert ring["sent_per_layer"] == {"forward": (n - 1) * 2 * block, "backward": (n - 1) * 2 * block + n * 2 * block,
                                      "recompute": 0}
    uly = cp(gqa, cp=2, method="ulysses")
    q = b * (s // 2) * gqa.q_dim * 4
    assert uly["sent_per_layer"]["forward"] == uly["sent_per_layer"]["backward"] == (2 * q + 2 * b * (s // 2) * kvd * 4) // 2


def test_zigzag_balances_causal_attention(lab):
    zz, flat = cp(lab, cp=4, method="ring"), cp(lab, cp=4, method="ring", zigzag=False)
    # the busiest contiguous rank does 2 - 1/cp times the mean; zig-zag gives every rank the mean
    ratio = flat["attention_seconds_per_layer"]["forward"] / zz["attention_seconds_per_layer"]["forward"]
    assert ratio == pytest.approx(2 - 1 / 4)
    whole = 2 * 2 * 256 * 256 * lab.q_dim / 4 / (67e12 * 0.4)  # causal: half of 4 b s^2 q_dim over 4 ranks; H100 fp32
    assert zz["attention_seconds_per_layer"]["forward"] == pytest.approx(whole)


def test_the_ring_hides_behind_long_attention_and_ulysses_never_does():
    """An 8B-like block (4096 wide, 32 heads, 8 KV heads): at 32k tokens over NVLink each K/V block's
    transfer (tens of microseconds) hides under a step's attention (milliseconds); at 4k tokens over
    100 GbE it does not. Ulysses' all-to-alls sit between the projections and attention: exposed."""
    big = from_config(dict(LAB, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                           num_key_value_heads=8, num_hidden_layers=2, max_position_embeddings=32768), name="llama-8b-ish")
    long = CP.context_parallel(big, cp=4, method="ring", batch_size=1, seq_len=32768, link="nvlink4")
    short = CP.context_parallel(big, cp=4, method="ring", batch_size=1, seq_len=4096, link="ethernet-100g")
    assert long["verdict"] == "hidden" and long["exposed_seconds_per_layer"] == {"forward": 0.0, "backward": 0.0,
                                                                                   "recompute": 0.0}
    assert short["verdict"] == "exposed" and short["exposed_seconds_per_layer"]["forward"] > 0
    assert CP.context_parallel(big, cp=4, method="ulysses", batch_size=1, seq_len=32768)["verdict"] == "exposed"


def test_cp_positions_partition_the_sequence():
    for n in (1, 2, 4):
        held = [CP.cp_positions(32, n, r) for r in range(n)]
        assert sorted(sum(held, [])) == list(range(32))
        c = 32 // (2 * n)
        assert held[0][:c] == list(range(c)) and held[0][c:] == list(range(32 - c, 32))
    assert CP.cp_positions(8, 2, 1, zigzag=False) == [4, 5, 6, 7]


@pytest.mark.parametrize("kw, says", [
    (dict(cp=4, method="ulysses"), "cp 4 must divide the 8 query heads and the 2 key/value heads"),
    (dict(cp=3, method="ring"), "multiple of 6"),
    (dict(cp=2, method="ring", seq_len=250), "2 x cp = 4 zig-zag chunks"),
    (dict(cp=2, method="ring", precision="fp32", device="cuda"), "math path"),
    (dict(cp=2, method="tree"), "method"),
    (dict(cp=0, method="ring"), "cp"),
    (dict(cp=2, method="ring", seq_len=1024), "reads at most 512 positions"),
])
def test_what_does_not_apply_is_refused_in_one_line(gqa, kw, says):
    with pytest.raises(ValueError) as e:
        cp(gqa, **kw)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ulysses_with_cp_dividing_the_heads_is_accepted(gqa):
    assert cp(gqa, cp=2, method="ulysses")["cp"] == 2


def test_encoders_are_refused():
    bert = from_config(dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=100, max_position_embeddings=64), name="bert-tiny")
    with pytest.raises(ValueError, match="causal decoders"):
        CP.context_parallel(bert, cp=2, batch_size=1, seq_len=64)


# --------------------------------------------------------------- the stored campaign

def _check_row(row, recompute="none"):
    # every rank's peak and CP's attention moments within 5 % either side, with and without full recompute.
    # (Before the ledger's fix the one-device ledger over-counted a re-run block's backward -- cp-val +14 % in
    # one process -- and this bound was -5/+12 % under recompute, +6 % for FSDP2 on cp-val; the runs now sit
    # within -4 ... +1 %: the recomputed moments were traced tensor by tensor on the gloo ranks)
    lo, hi = -0.05, 0.05
    assert lo < row["error"] < hi, row
    for moment in ("attention_forward", "attention_backward"):  # inside CP's attention (Ulysses: its forward)
        if f"{moment}_error" in row:
            assert lo < row[f"{moment}_error"] < hi, (moment, row)
    assert row["sent_forward"] == row["predicted_sent_forward"] and row["sent_backward"] == row["predicted_sent_backward"], row
    assert row.get("sent_recompute", 0) == row.get("predicted_sent_recompute", 0), row  # the re-run forward's K/V
    assert row["logits_max_rel_diff"] < 1e-4 and row["grad_max_rel_diff"] < 1e-4, row
    if "states_measured" in row:  # --fsdp: the shards' storage exactly, FSDP2's gradients those of one process
        assert row["states_measured"] == row["states_predicted"], row
        assert row["fsdp_grad_max_rel_diff"] < 1e-4, row


def test_stored_campaign_every_rank_within_5_percent_and_traffic_exact():
    data = json.loads(RESULTS.read_text())
    assert data["provenance"]["torch"]
    runs = data["runs"]
    seen = {(r["config"]["method"], r["config"]["nproc"], r["config"]["model"]) for r in runs}
    assert {m for m, _, _ in seen} == {"ring", "ulysses"} and {n for _, n, _ in seen} == {2, 4}
    assert {m for _, _, m in seen} >= {"lab", "llama-gqa-val"}  # MHA and GQA
    assert len({(r["config"]["micro_batch"], r["config"]["seq"]) for r in runs}) >= 2
    assert {r["config"].get("recompute", "none") for r in runs} == {"none", "full"}
    assert {r["config"].get("loss", "whole") for r in runs} == {"whole", "chunked", "fused"}
    for run in runs:
        res = run["result"]
        assert len(res["rows"]) == run["config"]["nproc"] == res["ranks"]
        for row in res["rows"]:
            _check_row(row, run["config"].get("recompute", "none"))
        if run["config"].get("recompute") == "full":  # the re-run forward sent its K/V (or all-to-alls) again
            assert all(row["sent_recompute"] == row["sent_forward"] > 0 for row in res["rows"])
        # the rows were computed when the campaign ran: the calculator still says the same
        from vramlab.measure.context_parallel import cp_rows  # noqa: PLC0415 (imports torch only where installed)
        assert [r["predicted"] for r in cp_rows(res)] == [r["predicted"] for r in res["rows"]]


def test_stored_campaign_covers_fsdp_over_the_cp_ranks():
    """FSDP2 over the CP ranks (`--fsdp`): both methods, 2 and 4 ranks, with and without full recompute, a model
    other than the lab's; every rank within the bounds above, its shards exact (checked in `_check_row`)."""
    runs = [r for r in json.loads(RESULTS.read_text())["runs"] if r["config"].get("fsdp")]
    assert {r["config"]["method"] for r in runs} == {"ring", "ulysses"}
    assert {r["config"]["nproc"] for r in runs} == {2, 4}
    assert {r["config"].get("recompute", "none") for r in runs} == {"none", "full"}
    assert {r["config"]["model"] for r in runs} - {"lab"}
    for run in runs:
        assert run["result"]["fsdp"] and all("states_measured" in row for row in run["result"]["rows"])


# --------------------------------------------------------------- gloo ranks (each well under a minute)

CASES = [
    dict(model="lab", method="ring", nproc=2, micro_batch=2, seq=128),
    dict(model="llama-gqa-val", method="ulysses", nproc=2, micro_batch=2, seq=128),
    dict(model="lab", method="ring", nproc=2, micro_batch=1, seq=128, zigzag=False),
    dict(model="lab", method="ring", nproc=4, micro_batch=1, seq=128),
    dict(model="cp-val", method="ring", nproc=2, micro_batch=1, seq=256, recompute="full", loss="fused"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", CASES, ids=lambda c: f"{c['model']}-{c['method']}-{c['nproc']}"
                         + ("" if c.get("zigzag", True) else "-contiguous"))
def test_gloo_ranks_match_one_process_and_the_calculator(config):
    pytest.importorskip("torch")
    from vramlab.measure.context_parallel import run_cp

    res = run_cp(config, timeout=120)
    assert res["ranks"] == config["nproc"] == len(res["rows"])
    for row in res["rows"]:
        _check_row(row, config.get("recompute", "none"))


@pytest.mark.slow
def test_one_gloo_run_of_fsdp_over_the_cp_ranks():
    """One small live run (two gloo ranks, ring, the states sharded by FSDP2): its peak within 5 % of the
    calculator's, its shards exact, its gradients those of one process on the whole sequence."""
    pytest.importorskip("torch")
    from vramlab.measure.context_parallel import run_cp

    res = run_cp(dict(model="cp-val", method="ring", nproc=2, micro_batch=1, seq=256, fsdp=True), timeout=120)
    assert res["fsdp"] and len(res["rows"]) == 2
    for row in res["rows"]:
        _check_row(row)
    # FSDP2's collectives settled before it went on (gloo's worker let go of their buffers): without it this
    # run's peak was 4 or 8 % higher one time in four (measure.context_parallel's `_settle`)
    assert [r["gloo_unsettled"] for r in res["per_rank"]] == [0, 0]


def test_the_command_refuses_in_one_line(capsys):
    pytest.importorskip("torch")
    from vramlab.measure import parallel as parlab

    for argv, says in ((["cp", "--method", "ulysses", "--nproc", "4", "--model", "llama-gqa-val"], "key/value heads"),
                       (["cp", "--nproc", "3"], "multiple of 6"), (["cp", "--model", "opt-val"], "--model"),
                       (["cp", "--method", "tree"], "--method")):
        with pytest.raises(SystemExit):
            parlab.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and err[0].startswith("python -m vramlab.measure.parallel cp: error:"), err


def test_the_moments_inside_attention_add_the_blocks_in_flight(lab):
    """The forward moment inside the last block's attention holds CP's blocks on top of what the block
    saved so far; one device (cp=1) has no such moments."""
    one, two = cp(lab, cp=1, method="ring"), cp(lab, cp=2, method="ring")
    assert "attention forward of the last block" not in one["moments"]
    kv = 2 * 128 * lab.kv_dim * 4
    assert two["in_flight_forward"] >= 2 * 2 * kv  # the current and the next K/V blocks
    assert two["peak"] == max(two["moments"].values())
    assert two["activation_peak"] == two["activations"] + max(two["in_flight_forward"], two["in_flight_backward"])


def test_recompute_and_the_loss_are_one_devices_at_cp_1(lab, gqa):
    """At cp = 1 a rank is one device: full recompute and the chunked or fused loss give the same peak as
    `memory.training_phases` with gradients kept between steps (the CP rank's all-reduced gradients)."""
    from vramlab import memory

    for spec in (lab, gqa):
        for recompute in CP.CP_RECOMPUTE:
            for loss in ("whole", "chunked", "fused"):
                got = cp(spec, cp=1, recompute=recompute, loss=loss)
                want = max(memory.training_phases(spec, batch_size=2, seq_len=256, precision="fp32", device="cpu",
                                                  recompute=recompute, loss=loss,
                                                  share=act.DeviceShare(keep_gradients=True)), key=lambda m: m.total)
                assert got["peak"] == want.total and got["peak_phase"] == want.phase, (recompute, loss)


def test_full_recompute_sends_the_forward_again_and_keeps_block_inputs(gqa):
    none, full = cp(gqa, cp=4, method="ring"), cp(gqa, cp=4, method="ring", recompute="full")
    assert full["sent_per_layer"]["recompute"] == full["sent_per_layer"]["forward"] == none["sent_per_layer"]["forward"]
    assert full["messages_per_layer"]["recompute"] == none["messages_per_layer"]["forward"]
    assert none["sent_per_layer"]["recompute"] == 0
    plain = act.activation_bytes(gqa, batch_size=2, seq_len=64, precision="fp32", device="cpu", recompute="full")
    assert full["activations"] == plain["layers"] + plain["outside"] + plain["weight_copies"] < none["activations"]
    assert "attention forward of the recomputed last block" in full["moments"]
    assert full["peak"] < none["peak"]
    uly = cp(gqa, cp=2, method="ulysses", recompute="full")
    assert uly["sent_per_layer"]["recompute"] == uly["sent_per_layer"]["forward"] > 0


def test_the_fused_loss_moves_a_long_context_peak_off_the_logits():
    """Llama 3.2 1B at 128 k tokens over 8 ranks: the whole loss peaks at the logits' gradient (b x s/cp x V
    in fp32); the fused loss never holds it, and with full recompute the rank fits an H100 where it did not."""
    from vramlab import fitting

    kw = dict(cp=8, batch_size=1, seq_len=131072, gpu="h100")
    whole, fused = CP.context_parallel("llama-3.2-1b", **kw), CP.context_parallel("llama-3.2-1b", loss="fused", **kw)
    both = CP.context_parallel("llama-3.2-1b", loss="fused", recompute="full", **kw)
    # (the fused rank's peak: its loss's forward, or the last block's backward, where the tied head's gradient
    # waits for the embedding's beside the kept gradients; never the logits' gradient)
    assert "logits gradient" in whole["peak_phase"] and "logits gradient" not in fused["peak_phase"]
    assert both["peak"] < fused["peak"] < whole["peak"]
    frag = fitting.fragmentation_bytes("llama-3.2-1b", batch_size=1, seq_len=16384, precision="bf16-mixed")
    fit = lambda r: fitting.device_fit(r["peak"], "h100", largest_tensor=frag).fits  # noqa: E731
    assert not fit(whole) and fit(both)


@pytest.mark.parametrize("kw, says", [(dict(recompute="selective"), "recompute must be one of none, full"),
                                      (dict(loss="tiled"), "loss"), (dict(loss="whole", loss_chunk_tokens=64), "whole")])
def test_recompute_and_loss_refusals_are_one_line(gqa, kw, says):
    with pytest.raises(ValueError) as e:
        cp(gqa, cp=2, **kw)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# --------------------------------------------------------------- FSDP2 over the CP ranks (shard_states)

def test_shard_states_divides_the_states_over_the_cp_ranks(lab, gqa):
    """With shard_states each rank keeps its FSDP2 shards between steps (each tensor's ceil(numel / cp), fp32, and
    Adam's two moments and step count), no gradients; without it the states are whole on every rank, as before."""
    for spec in (lab, gqa):
        for n in (1, 2, 4):
            plain, default = cp(spec, cp=n, method="ring"), cp(spec, cp=n, method="ring", shard_states=False)
            assert plain == default and not plain["shard_states"]
            assert plain["states"]["parameters"] == plain["states"]["gradients"] == 4 * spec.params
            sharded = cp(spec, cp=n, method="ring", shard_states=True)
            shard = sum(-(-x // n) for _, x in spec.param_tensors())
            assert sharded["states"] == {"parameters": 4 * shard, "gradients": 0,
                                         "optimizer_states": 8 * shard + 4 * len(spec.param_tensors())}
            assert sharded["peak"] == max(sharded["moments"].values()) < plain["peak"]
            # CP's own terms do not change: activations, in-flight bytes and traffic are the rank's tokens'
            for key in ("activations", "in_flight_forward", "in_flight_backward", "sent_per_layer"):
                assert sharded[key] == plain[key], key
    # FSDP2's collectives replace DDP's all-reduce: 3 Psi-ish per step against 2 Psi
    assert cp(gqa, cp=4, shard_states=True)["state_sync"]["bytes_sent_per_rank"] > \
        cp(gqa, cp=4)["state_sync"]["bytes_sent_per_rank"] > 0


def test_shard_states_composes_zero_fsdp2_phases_with_cps_moments(lab):
    """The step's phases are `zero.rank_phases(implementation='fsdp2')`'s at s/cp tokens, shifted only to the
    shards' storage bytes, beside CP's two attention moments."""
    from vramlab import zero

    r = cp(lab, cp=2, method="ring", shard_states=True)
    phases = zero.rank_phases(lab, 2, 3, micro_batch_size=2, seq_len=128, recipe="fp32-adam", implementation="fsdp2",
                              device="cpu", optimizer_impl="foreach")
    between = zero.model_states(lab, 2, 3, recipe="fp32-adam", implementation="fsdp2")
    delta = r["states"]["parameters"] + r["states"]["optimizer_states"] - between.total
    unit = zero.zero_units(lab)[0] * 4  # the last block's flat all-gather output, kept until the root's post-forward
    for ph in phases:
        assert r["moments"][ph.phase] == ph.total + delta + (unit if ph.phase.startswith("forward") else 0), ph.phase
    assert {"attention forward of the last block", "attention backward of the last block"} <= set(r["moments"])


def test_llama_8b_at_128k_fits_an_h100_only_with_the_states_sharded():
    """Llama 3.1 8B at 128 k tokens, fused loss and full recompute: with the 16 B/param states whole on every CP
    rank no cp size fits an H100 (chapter 3's "none fits"); sharded over the CP ranks some cp does. And no verdict
    says "fits" where the estimator's own peak exceeds the GPU."""
    from vramlab.specs import gpu

    kw = dict(batch_size=1, seq_len=131072, precision="bf16-mixed", loss="fused", recompute="full")
    cap = gpu("h100").memory_bytes
    fits = {}
    for shard in (False, True):
        for n in (1, 2, 4, 8, 16, 32, 64):
            r, f = CP.context_fit("llama-3.1-8b", "h100", cp=n, shard_states=shard, **kw)
            fits[shard, n] = f.fits
            if f.fits:
                assert r["peak"] <= cap, (shard, n)
    assert not any(v for (shard, _), v in fits.items() if not shard)
    smallest = min(n for (shard, n), v in fits.items() if shard and v)
    assert smallest <= 8 and all(fits[True, n] for n in (8, 16, 32, 64) if n >= smallest)


@pytest.mark.parametrize("kw, says", [(dict(precision="fp16-mixed"), "precision must be fp32 or bf16-mixed"),
                                      (dict(optimizer="sgd"), "optimizer must be adam or adamw"),
                                      (dict(shard_states="yes"), "shard_states")])
def test_shard_states_refusals_are_one_line(gqa, kw, says):
    with pytest.raises(ValueError) as e:
        cp(gqa, cp=2, **{"shard_states": True, **kw})
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_zero_rank_phases_keeps_recompute_and_the_loss_to_fsdp2(gqa):
    """The keyword-only options `context_parallel` needs leave `zero.rank_phases` as it was by default, and are
    refused in one line where no run measured them (DeepSpeed)."""
    from vramlab import zero

    base = dict(micro_batch_size=2, seq_len=128, recipe="fp32-adam", device="cpu")
    assert zero.rank_phases(gqa, 2, 3, implementation="fsdp2", **base) == \
        zero.rank_phases(gqa, 2, 3, implementation="fsdp2", recompute="none", loss="whole", **base)
    with pytest.raises(ValueError) as e:
        zero.rank_phases(gqa, 2, 2, implementation="deepspeed", recompute="full", **base)
    assert "implementation='fsdp2' only" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        zero.rank_phases(gqa, 2, 3, implementation="fsdp2", recompute="selective", **base)
    assert "recompute" in str(e.value) and "\n" not in str(e.value)
