"""vramlab.measure.fp8: torch's float8 casts against the pure model, and what each scaling recipe does to a
tensor's values (current against delayed scaling, per tensor against 1x128 tiles, e4m3 against e5m2)."""

import math
import time

import pytest

torch = pytest.importorskip("torch")

from vramlab import precision as P  # noqa: E402
from vramlab.measure import fp8 as F  # noqa: E402

FMTS = ("fp8-e4m3", "fp8-e5m2")


# ----------------------------------------------------------------------------- torch's cast and the pure model

@pytest.mark.parametrize("fmt", FMTS)
def test_torch_cast_agrees_with_round_to_on_a_sweep(fmt):
    """Every value of the format, every midpoint (ties to even) and its neighbours, subnormals, random values
    over the whole range and beyond it, both signs, zeros, inf and NaN: no value differs."""
    a = F.agreement_with_pure(fmt)
    assert a["mismatches"] == 0, a["examples"]
    assert a["values"] > 4096 + 500
    xs = F.probe_values(fmt)
    f = P.fmt(fmt)
    assert f.smallest_subnormal in xs and f.smallest_subnormal / 2 in xs and f.max in xs  # the sweep's edges
    assert any(0 < abs(x) < f.smallest_normal for x in xs) and any(abs(x) > f.max for x in xs if math.isfinite(x))


def test_what_torch_does_beyond_the_range():
    """e4m3fn has no infinity: torch's cast saturates overflow and inf to +-448 (older releases gave NaN); e5m2
    overflows to inf from max + half an ulp (61440) on, which round_to does too. NaN stays NaN in both."""
    e4, e5 = F.agreement_with_pure("fp8-e4m3"), F.agreement_with_pure("fp8-e5m2")
    assert e4["inf"] == 448.0 and e4["twice_max"] == 448.0 and math.isnan(e4["nan"])
    assert e5["inf"] == math.inf and e5["twice_max"] == math.inf and math.isnan(e5["nan"])
    assert torch.tensor([61440.0, 61439.0]).to(torch.float8_e5m2).float().tolist() == [math.inf, 57344.0]
    assert (P.round_to(61440.0, "fp8-e5m2"), P.round_to(61439.0, "fp8-e5m2")) == (math.inf, 57344.0)
    # subnormals: e4m3's smallest is 2^-9; half of it ties to even (0), a little more rounds up
    tiny = 2.0**-9
    got = torch.tensor([tiny, tiny / 2, tiny / 2 * 1.01, tiny * 1.5]).to(torch.float8_e4m3fn).float().tolist()
    assert got == [tiny, 0.0, tiny, 2 * tiny] == [P.round_to(v, "fp8-e4m3") for v in (tiny, tiny / 2, tiny / 2 * 1.01, tiny * 1.5)]


# ----------------------------------------------------------------------------- one cast

def test_cast_stats_counts_what_it_says():
    x = torch.tensor([1.0, 2.0, 448.0, 1e-6, 0.0, -3.0])
    s = F.cast_stats(x, "fp8-e4m3", scale=1.0)
    assert s["amax"] == 448.0 and s["scale"] == 1.0
    assert s["underflow"] == pytest.approx(1 / 5)  # 1e-6 flushes (< 2^-10); the zero is not counted
    assert s["saturated"] == 0.0
    s2 = F.cast_stats(x, "fp8-e4m3", scale=2.0)  # 896 is beyond 464 (448 + half its ulp of 32): clamped
    assert s2["saturated"] == pytest.approx(1 / 6)
    cur = F.cast_stats(x, "fp8-e4m3")
    assert cur["scale"] == 1.0 and F.cast_stats(x, "fp8-e4m3", margin=1)["scale"] == 0.5
    assert F.amax_scale(0.0) == 1.0 and F.amax_scale(2.0, "fp8-e5m2") == 57344.0 / 2


def test_current_scaling_error_is_the_formats_precision():
    """With its own amax, a cast's relative error is bounded by half the format's epsilon (normals)."""
    x = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    for fmt in FMTS:
        s = F.cast_stats(x, fmt)
        assert s["saturated"] == 0.0
        assert s["mean_rel_error"] < P.fmt(fmt).eps / 2
        back = F.quantise(x, fmt, scale=s["scale"]).float() / s["scale"]
        big = x.abs() > x.abs().max() / 2**10  # far from the subnormals
        assert float(((back - x).abs() / x.abs())[big].max()) <= P.fmt(fmt).eps / 2 + 1e-7


def test_refuses_what_it_cannot_cast():
    with pytest.raises(ValueError, match="fmt"):
        F.cast_stats(torch.ones(3), "fp16")
    with pytest.raises(ValueError, match="history"):
        F.scaling_demo(histories=(0,))
    with pytest.raises(ValueError, match="multiple"):
        F.tile_scales(torch.ones(2, 100))


# ----------------------------------------------------------------------------- current against delayed scaling

def test_delayed_scaling_saturates_on_the_spike_and_dynamic_does_not():
    t0 = time.perf_counter()
    d = F.scaling_demo()
    assert time.perf_counter() - t0 < 1.0
    spike = max(range(len(d["amax"])), key=d["amax"].__getitem__)
    assert spike == 14 and d["amax"][spike] > 50 * d["amax"][spike - 1]
    dyn, h1, h16 = (d["recipes"][k] for k in ("dynamic", "delayed H=1", "delayed H=16"))
    assert max(dyn["saturated"]) == 0.0  # the current amax never overflows
    assert max(dyn["mean_rel_error"]) < P.fmt("fp8-e4m3").eps / 2 + 0.01
    for h in (h1, h16):
        assert h["saturated"][spike] > 0.5 and h["rel_error"][spike] > 0.5  # the stale scale clips the spike
        assert sum(v > 0 for v in h["saturated"][1:9]) >= 6  # growing 1.5x a step: last step's amax is too small
    # after the spike: H=1 recovers at once, H=16 keeps the spike's scale for 16 steps (more values flushed)
    after = range(spike + 2, spike + 16)
    assert all(h16["scale"][t] == pytest.approx(d["recipes"]["dynamic"]["scale"][spike]) for t in after)
    assert sum(h16["underflow"][t] for t in after) > 10 * max(sum(h1["underflow"][t] for t in after), 1e-4)
    assert all(h16["mean_rel_error"][t] > dyn["mean_rel_error"][t] for t in after)
    assert h16["scale"][spike + 17] > 10 * h16["scale"][spike + 1]  # the spike leaves the history
    assert all(len(v) == len(d["steps"]) for r in d["recipes"].values() for v in r.values())


def test_a_margin_absorbs_steady_growth():
    """A margin of 1 (a scale half as large) leaves a binade of headroom: 1.5x growth no longer saturates."""
    d = F.scaling_demo(histories=(1,), margin=1)
    sat = d["recipes"]["delayed H=1"]["saturated"]
    assert max(sat[:14]) < 0.001 and sat[14] > 0.5


# ----------------------------------------------------------------------------- per tensor against 1x128 tiles

def test_tiles_keep_the_small_values_an_outlier_flushes():
    rows = F.block_scaling_demo()
    by = {r["ratio"]: r for r in rows}
    big = by[1e5]
    assert big["per_tensor"]["underflow"] > 0.3  # one scale for all: ordinary values fall below the subnormals
    assert big["tiled"]["underflow"] < big["per_tensor"]["underflow"] / 5
    assert big["tiled_clean"]["underflow"] == 0.0  # tiles without an outlier lose nothing
    assert big["tiled_clean"]["mean_rel_error"] < P.fmt("fp8-e4m3").eps / 2
    assert big["tiles_with_outlier"] == 2 / 8
    assert by[10.0]["per_tensor"]["underflow"] < 1e-3  # a small ratio costs nothing
    flushed = [r["per_tensor"]["underflow"] for r in rows]
    assert flushed == sorted(flushed)
    x = F.outlier_activations(tokens=2, width=256, outlier_channels=(5,), ratio=1e3)
    s = F.tile_scales(x)
    assert s.shape == x.shape and float(s[0, 0]) == pytest.approx(448 / float(x[0, :128].abs().max()))


# ----------------------------------------------------------------------------- e4m3 against e5m2

def test_e4m3_is_more_precise_e5m2_has_more_range():
    rows = F.formats_demo()
    narrow, wide = rows[0], rows[-1]
    assert narrow["fp8-e4m3"]["mean_rel_error"] < narrow["fp8-e5m2"]["mean_rel_error"] / 1.5
    assert narrow["fp8-e4m3"]["underflow"] == 0.0
    assert wide["fp8-e4m3"]["underflow"] > 0.3 and wide["fp8-e5m2"]["underflow"] < 0.05
    assert F.binades("fp8-e4m3")["with_subnormals"] == pytest.approx(math.log2(448 / 2**-9))
    assert F.binades("fp8-e5m2")["normal"] == pytest.approx(math.log2(57344 / 2**-14))


def test_everything_is_seeded():
    assert F.scaling_demo() == F.scaling_demo()
    assert F.block_scaling_demo(ratios=(1e3,)) == F.block_scaling_demo(ratios=(1e3,))
    assert F.formats_demo(spreads=(3.0,)) == F.formats_demo(spreads=(3.0,))
