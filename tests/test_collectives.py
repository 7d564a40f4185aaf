"""The collectives' cost model against nccl-tests' definitions, an independent simulation of the
ring algorithm, and a real gloo run."""

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest

from vramlab import collectives as C


def test_busbw_factors_match_nccl_tests():
    # nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n; reducescatter, allgather, alltoall (n-1)/n;
    # broadcast, reduce 1
    for n in (1, 2, 3, 4, 8, 16, 64):
        assert C.busbw_factor("all_reduce", n) == Fraction(2 * (n - 1), n)
        for op in ("reduce_scatter", "all_gather", "all_to_all"):
            assert C.busbw_factor(op, n) == Fraction(n - 1, n)
        assert C.busbw_factor("broadcast", n) == C.busbw_factor("reduce", n) == 1
    assert C.busbw_factor("all_reduce", 8) == Fraction(7, 4)
    assert C.busbw("all_reduce", 8, 8 * 10**9, 1.0) == pytest.approx(14e9)


def _simulate_ring_all_reduce(n, values):
    """Ring all-reduce on n ranks, chunk by chunk: reduce-scatter then all-gather.
    Returns each rank's result and the number of chunk messages each rank sent."""
    data = [list(v) for v in values]  # data[r][c]: rank r's copy of chunk c
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter
        msgs = [(r, (r - step) % n, data[r][(r - step) % n]) for r in range(n)]
        for r, c, v in msgs:
            data[(r + 1) % n][c] += v
            sent[r] += 1
    for step in range(n - 1):  # all-gather: rank r owns the full sum of chunk (r + 1) % n
        msgs = [(r, (r + 1 - step) % n, data[r][(r + 1 - step) % n]) for r in range(n)]
        for r, c, v in msgs:
            data[(r + 1) % n][c] = v
            sent[r] += 1
    return data, sent


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_model_matches_simulation(n):
    values = [[10 * r + c for c in range(n)] for r in range(n)]
    data, sent = _simulate_ring_all_reduce(n, values)
    expected = [sum(values[r][c] for r in range(n)) for c in range(n)]
    assert all(d == expected for d in data)  # the simulation is a correct all-reduce
    S = 1_000_000 * n
    assert all(s == 2 * (n - 1) for s in sent)  # 2(n-1) messages of S/n each
    assert C.bytes_sent_per_rank("all_reduce", n, S) == pytest.approx(2 * (n - 1) * S / n)
    lk = C.Link(name="x", bandwidth_GBps=10, latency_us=7)
    assert C.collective_time("all_reduce", n, S, lk) == pytest.approx(sent[0] * (7e-6 + (S / n) / 10e9))


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for name, lk in C.LINKS.items():
        for n in (2, 8, 64):
            S = 256 << 20
            rs_ag = C.collective_time("reduce_scatter", n, S, lk) + C.collective_time("all_gather", n, S, lk)
            assert C.collective_time("all_reduce", n, S, lk) == pytest.approx(rs_ag), name


def test_latency_and_bandwidth_regimes():
    lk = C.link("nvlink4")
    small = C.collective_time("all_reduce", 8, 1024, lk)
    assert small == pytest.approx(14 * lk.alpha_s, rel=0.01)  # latency-bound
    big = C.collective_time("all_reduce", 8, 1 << 30, lk)
    assert big == pytest.approx(2 * 7 / 8 * (1 << 30) / lk.bytes_per_s, rel=0.02)  # bandwidth-bound: latency < 2 %


def test_fit_recovers_the_model():
    lk = C.Link(name="true", bandwidth_GBps=3.0, latency_us=40.0)
    sizes = [1 << k for k in range(10, 25, 2)]
    times = [C.collective_time("all_reduce", 4, s, lk) for s in sizes]
    fitted = C.fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fitted.bandwidth_GBps == pytest.approx(3.0) and fitted.latency_us == pytest.approx(40.0)


@pytest.mark.parametrize("error", ["relative", "absolute"])
def test_fit_matches_weighted_polyfit(error):
    """Independent check: numpy's weighted least-squares line (w = 1/t weights residuals relatively)."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    sizes = [4096 << 2 * k for k in range(8)]
    lk = C.Link(name="true", bandwidth_GBps=2.0, latency_us=150.0)
    times = [C.collective_time("all_reduce", 2, s, lk) * f for s, f in zip(sizes, rng.uniform(0.8, 1.25, 8))]
    slope, intercept = np.polyfit(sizes, times, 1, w=[1 / t for t in times] if error == "relative" else None)
    fitted = C.fit_alpha_beta("all_reduce", 2, sizes, times, error=error)
    assert fitted.bandwidth_GBps == pytest.approx(1.0 / slope / 1e9)  # c_beta = 2(n-1)/n = 1 for n = 2
    assert fitted.latency_us == pytest.approx(intercept / 2 * 1e6)  # c_alpha = 2(n-1) = 2


def test_relative_fit_keeps_the_latency_term():
    """With noise of a few percent on every point, the ordinary line's intercept is decided by the largest
    sizes' noise; the relative fit still predicts the small (latency-bound) sizes."""
    lk = C.Link(name="true", bandwidth_GBps=2.0, latency_us=150.0)
    sizes = [4096 << 2 * k for k in range(8)]
    wobble = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.96]  # the 64 MiB point 4 % fast
    times = [C.collective_time("all_reduce", 2, s, lk) * w for s, w in zip(sizes, wobble)]
    for error, worst in (("relative", 0.05), ("absolute", None)):
        fitted = C.fit_alpha_beta("all_reduce", 2, sizes, times, error=error)
        err = abs(C.collective_time("all_reduce", 2, sizes[0], fitted) - times[0]) / times[0]
        if worst is not None:
            assert err < worst, (error, err)
        else:
            assert err > 0.10, (error, err)  # 4 % of 33 ms is 1.3 ms: the line tilts and the intercept moves


def test_parameter_server_vs_all_reduce():
    psi = 1_000_000_000
    lk = C.link("ethernet-100g")
    ar = [C.data_parallel_sync(psi, n, lk)["seconds"] for n in (2, 8, 64)]
    ps = [C.data_parallel_sync(psi, n, lk, scheme="parameter_server")["seconds"] for n in (2, 8, 64)]
    assert ar[-1] < 2 * 4 * psi / lk.bytes_per_s * 1.01  # ring: bounded by 2 S / B whatever n is
    assert ps[-1] / ps[0] == pytest.approx(32, rel=0.01)  # the server's link: linear in n
    assert ps[-1] > 10 * ar[-1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown collective"):
        C.busbw_factor("all_sum", 4)
    with pytest.raises(ValueError, match="positive integer"):
        C.collective_time("all_reduce", 0, 10, "nvlink4")
    with pytest.raises(ValueError, match="unknown link"):
        C.link("carrier-pigeon")
    with pytest.raises(ValueError, match="relative' or 'absolute"):
        C.fit_alpha_beta("all_reduce", 2, [1, 2], [1.0, 2.0], error="squared")
    with pytest.raises(ValueError, match="positive"):
        C.fit_alpha_beta("all_reduce", 2, [1, 2], [1.0, 0.0])


def _commbench(tmp_path, *args, port):
    out = tmp_path / f"bench{port}.json"
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.collectives", "--nproc", "2", *args, "--out", str(out),
                        "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r, json.loads(out.read_text())


@pytest.mark.slow
def test_commbench_gloo_two_ranks(tmp_path):
    pytest.importorskip("torch")
    r, res = _commbench(tmp_path, "--sizes", "4096,65536,1048576", "--warmup", "1", "--iters", "3", "--runs", "2",
                        "--warmup-s", "0.1", port=29533)
    assert "all_reduce_perf" in r.stdout and "busbw" in r.stdout and "op median" in r.stdout
    assert "6/6 timed runs done" in r.stderr  # progress
    assert [row["size"] for row in res["rows"]] == [4096, 65536, 1048576] and res["order"] == "interleaved"
    for row in res["rows"]:
        ops = row["op_times_us"]
        assert len(ops) == 6 and min(ops) > 0  # runs x iters single operations
        run_means = [sum(ops[k:k + 3]) / 3 for k in (0, 3)]
        assert row["time_us"] == pytest.approx(sorted(run_means)[0] / 2 + sorted(run_means)[1] / 2, rel=1e-3)
        assert min(ops) <= row["op_median_us"] <= row["op_p90_us"] <= max(ops)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 1.0)  # 2(n-1)/n = 1 for n = 2


def _held_out_errors(rows):
    # fit on every other size and on the largest; predict the sizes between them (interpolation only)
    fit = [i % 2 == 0 or i == len(rows) - 1 for i in range(len(rows))]
    train, held = [r for r, f in zip(rows, fit) if f], [r for r, f in zip(rows, fit) if not f]
    lk = C.fit_alpha_beta("all_reduce", 2, [r["size"] for r in train], [r["op_median_us"] * 1e-6 for r in train])
    return [(C.collective_time("all_reduce", 2, r["size"], lk) * 1e6 - r["op_median_us"]) / r["op_median_us"]
            for r in held]


@pytest.mark.slow
def test_gloo_alpha_beta_fits_a_live_benchmark(tmp_path):
    """A live 4 KiB .. 256 KiB x 4^k gloo all-reduce benchmark on this machine fits: alpha >= 0, a finite positive
    bandwidth, predictions that grow with the size, a finite error for every held-out size (printed). How close the
    held-out predictions come is the machine's quietness, not the model's behaviour (a busy 2-core machine put
    them -57 %/+34 % off where a quiet one is within 25 %): the lab's 25 % criterion is checked on the stored
    measurement, refitted independently (tests/test_labs.py::test_lab2_stored_gloo_run_meets_the_25_percent_criterion)."""
    pytest.importorskip("torch")
    sizes = ",".join(str(4 << 10 << 2 * k) for k in range(8))
    _, res = _commbench(tmp_path, "--sizes", sizes, port=29534)
    rows = res["rows"]
    lk = C.fit_alpha_beta("all_reduce", 2, [r["size"] for r in rows], [r["op_median_us"] * 1e-6 for r in rows])
    assert lk.latency_us >= 0 and 0 < lk.bandwidth_GBps < math.inf
    pred = [C.collective_time("all_reduce", 2, r["size"], lk) for r in rows]
    assert pred == sorted(pred)
    errors = _held_out_errors(rows)
    assert len(errors) == 3 and all(math.isfinite(e) for e in errors)
    print("held-out errors on this machine now:", [f"{100 * e:+.0f}%" for e in errors])


def test_before_after_semantics():
    b, a = C.before_after("all_reduce", 3)
    assert a == [["Σ0", "Σ1", "Σ2"]] * 3 and b[1] == ["b0", "b1", "b2"]
    b, a = C.before_after("reduce_scatter", 3)
    assert a[1] == ["", "Σ1", ""]
    b, a = C.before_after("all_gather", 3)
    assert b[2] == ["", "", "c2"] and a[0] == ["a0", "b1", "c2"]
    b, a = C.before_after("all_to_all", 3)
    assert a[0] == ["a0", "b0", "c0"]  # rank 0 receives every rank's chunk 0


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_steps_end_in_all_reduce(n):
    steps = C.ring_all_reduce_steps(n)
    assert len(steps) == 1 + 2 * (n - 1)  # n-1 reduce-scatter + n-1 all-gather steps
    assert steps[-1][1] == [[f"Σ{c}" for c in range(n)]] * n
    after_rs = steps[n - 1][1]
    assert sum(cell.startswith("Σ") for row in after_rs for cell in row) == n  # one full sum per rank


def test_sharded_parameter_server_moves_what_the_ring_moves():
    """Li et al. 2014 / BytePS: shards beside every worker carry 2(n-1)/n S per link, as the ring
    all-reduce does (nccl-tests' busbw factor), in 2 latency steps instead of 2(n-1)."""
    from vramlab.collectives import data_parallel_sync

    S, n = 10**9, 8
    ring = data_parallel_sync(S // 4, n, "ethernet-100g", scheme="all_reduce")
    shard = data_parallel_sync(S // 4, n, "ethernet-100g", scheme="sharded_parameter_server")
    single = data_parallel_sync(S // 4, n, "ethernet-100g", scheme="parameter_server")
    assert shard["bytes_busiest_link"] == ring["bytes_busiest_link"] == 2 * (n - 1) / n * S
    assert single["bytes_busiest_link"] == 2 * n * S
    assert shard["seconds"] < single["seconds"] / 4


# ----------------------------------------------------------------------------- commbench that ends
