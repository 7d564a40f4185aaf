"""Lab 6's checks (offload): the streamed pass's time and memory, the fewest resident layers, and the
student's streaming loop and link measurement, each run in a process of its own against a copy
engine on a virtual clock (`programs/stream.py`, `programs/link_rate.py`)."""

from __future__ import annotations

from typing import Callable

from .run import run_program


def stream_cases(seed: int, n: int = 8) -> list[tuple[list[int], list[float], float, int]]:
    """Random stacks of uneven layers (bytes, compute seconds), a link and a buffer count, where the
    copies are sometimes hidden and sometimes not: (layer_bytes, layer_seconds, link_GBps, buffers)."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        layers = rng.randint(2, 8)
        sizes = [rng.choice((1, 2, 3, 4, 6, 8)) * 10**8 for _ in range(layers)]
        secs = [round(rng.uniform(0.5, 8.0), 3) * 1e-3 for _ in range(layers)]
        cases.append((sizes, secs, rng.choice((12.0, 25.0, 50.0)), rng.choice((1, 2, 3))))
    return cases


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-12) + 1e-15


def check_stream_pass(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(layer_bytes, layer_seconds, streamed, link_GBps, buffers)` must return (seconds of the
    third pass, device bytes) as `vramlab.offload.stream_layers` computes them, for every case of
    `stream_cases` and several choices of streamed layers (uneven layers, one to three buffers)."""
    import random

    from ..offload import stream_layers

    rng = random.Random(seed + 1)
    for sizes, secs, link, buffers in stream_cases(seed, n):
        choices = [(), tuple(range(len(sizes)))] + [tuple(sorted(rng.sample(range(len(sizes)), rng.randint(1, len(sizes)))))
                                                     for _ in range(2)]
        for streamed in choices:
            want = stream_layers(sizes, secs, streamed=streamed, link_GBps=link, buffers=buffers, passes=3)
            where = f"layer_bytes={sizes}, layer_seconds={secs}, streamed={list(streamed)}, link {link} GB/s, {buffers} buffers"
            got = fn(list(sizes), list(secs), list(streamed), link, buffers)
            try:
                seconds, nbytes = got
                seconds = float(seconds)
            except (TypeError, ValueError):
                raise AssertionError(f"return (seconds, device_bytes), got {got!r}") from None
            if not _close(seconds, want.seconds):
                hint = (" (that is the first pass: the copies of the next pass may start while this one still runs)"
                        if _close(seconds, stream_layers(sizes, secs, streamed=streamed, link_GBps=link, buffers=buffers,
                                                         passes=1).seconds) else "")
                raise AssertionError(f"the third pass takes {want.seconds * 1e3:.4f} ms, you said {seconds * 1e3:.4f} ms "
                                     f"({where}){hint}")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes != want.gpu_bytes:
                raise AssertionError(f"device memory is {want.gpu_bytes:,} bytes, you said {nbytes!r} ({where}): the "
                                     "resident layers plus min(buffers, streamed) buffers as large as the largest "
                                     "streamed layer")


def check_fewest_resident(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(layer_bytes, layer_seconds, link_GBps, buffers)` must return the fewest resident layers
    whose streamed layers' copies hide behind compute (`vramlab.offload.smallest_resident`, which
    tries every choice of streamed layers)."""
    from ..offload import smallest_resident

    for sizes, secs, link, buffers in stream_cases(seed, n):
        want = len(sizes) - len(smallest_resident(sizes, secs, link_GBps=link, buffers=buffers).streamed)
        got = fn(list(sizes), list(secs), link, buffers)
        where = f"layer_bytes={sizes}, layer_seconds={secs}, link {link} GB/s, {buffers} buffers"
        if isinstance(got, bool) or not isinstance(got, int):
            raise AssertionError(f"return a count of layers (an int), got {got!r}")
        if got != want:
            raise AssertionError(f"{want} resident layers hide the copies, you said {got} ({where})"
                                 + (": try every choice of streamed layers, not only evenly spaced ones"
                                    if got > want else ": with that few, some copy makes a layer wait"))


# ----------------------------------------------------------------------------- the streaming loop
# The student's stream_forward runs in a process of its own against a copy engine on a virtual clock
# (`programs/stream.py`): a copy issued when the compute has reached time t starts at max(t, the end
# of the copy before it) and lasts its bytes over the link's rate; link.wait(ticket) moves the compute
# to the copy's end; run_layer(i, ...) moves it by layer i's seconds. Every misuse a real copy engine
# would turn into wrong numbers or a stall is caught where it happens: a layer run on weights whose
# copy it never waited for, a buffer refilled before its layer ran, a buffer that is not the link's.
# The report: each pass's start and end on the virtual clock, the buffers made, the output.
def check_stream_forward(fn: Callable, *, seed: int = 0, n: int = 6, timeout: float = 120.0) -> None:
    """`fn(x, weights, streamed, link, *, run_layer, buffers, passes)` (lab 6's streaming loop) run on
    stacks of `stream_cases` against a copy engine on a virtual clock (a process of its own): the
    output of every pass, the buffers it makes (min(buffers, streamed) as large as the largest
    streamed layer), no layer run on a copy it did not wait for or on a buffer being refilled, and
    the overlap measured: the third pass's time on the virtual clock equals exercise 2's schedule
    (`vramlab.offload.stream_layers`), so the copies of the next layers run while this one computes."""
    import random

    from ..offload import stream_layers

    rng = random.Random(seed + 2)
    cases = []
    for sizes, secs, link, buffers in stream_cases(seed, n):
        for streamed in ([], list(range(len(sizes))), sorted(rng.sample(range(len(sizes)), rng.randint(1, len(sizes))))):
            cases.append({"sizes": sizes, "secs": secs, "streamed": streamed, "link": link, "buffers": buffers, "passes": 3})
    reports = run_program("stream", fn, cases, what="streaming run", timeout=timeout,
                               on_timeout=f"no answer within {timeout:.0f} s: does the loop end?")
    for case, rep in zip(cases, reports):
        where = (f"{len(case['sizes'])} layers of {[s // 10**8 for s in case['sizes']]} x 100 MB, streamed {case['streamed']}, "
                 f"{case['buffers']} buffer{'s' if case['buffers'] > 1 else ''}, {case['link']:g} GB/s")
        if rep.get("error"):
            raise AssertionError(f"{where}: {rep['error']}")
        if rep.get("misuse"):
            raise AssertionError(f"{where}: {rep['misuse']}")
        if rep["calls"] != 3 * len(case["sizes"]) or not rep["matches"]:
            raise AssertionError(f"{where}: three passes must run every layer in order and return x after the last "
                                 f"({rep['calls']} layer runs, output {'right' if rep['matches'] else 'wrong'})")
        want_buffers = min(case["buffers"], len(case["streamed"]))
        largest = max((case["sizes"][i] // 10**6 for i in case["streamed"]), default=0)
        if len(rep["buffers"]) != want_buffers or any(b != largest for b in rep["buffers"]):
            raise AssertionError(f"{where}: made buffers of {rep['buffers']} values; the schedule holds {want_buffers} "
                                 f"of {largest} (the largest streamed layer)")
        want = stream_layers(case["sizes"], case["secs"], streamed=case["streamed"], link_GBps=case["link"],
                             buffers=case["buffers"], passes=3).seconds
        got = rep["marks"][2] - rep["marks"][1]
        if not _close(got, want):
            hint = (" — slower: start the next copy as soon as a buffer is free (right after the layer that used it "
                    "runs), including the next pass's, and the first ones before the first layer" if got > want else "")
            raise AssertionError(f"{where}: the third pass took {got * 1e3:.3f} ms on the copy engine's clock; the "
                                 f"schedule's overlap gives {want * 1e3:.3f} ms{hint}")


# ----------------------------------------------------------------------------- measuring the link
# The student's link_GBps(link, host) runs in a process of its own against a copy engine on a virtual
# clock (`programs/link_rate.py`): link.copy(buffer, host) queues a copy that lasts its bytes over the
# link's rate (the first one also pays a one-time setup, as a driver's first copy does, and one later
# copy is slowed threefold, as by other traffic); link.wait(ticket) moves the compute's clock to the
# copy's end; link.clock() reads that clock. A clock read before waiting has not moved.
def link_cases(seed: int, n: int = 6) -> list[dict]:
    """Host tensors (elements, dtype) and links (GB/s, the first copy's setup, which copy is slowed)."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        numel = rng.choice((1, 2, 3, 5, 8)) * 10 ** rng.randint(5, 6)
        dtype = rng.choice(("float32", "bfloat16"))
        rate = rng.choice((6.0, 12.0, 25.0, 50.0, 55.0))
        one = numel * (4 if dtype == "float32" else 2) / (rate * 1e9)
        cases.append({"numel": numel, "dtype": dtype, "GBps": rate, "setup": round(rng.uniform(3, 10), 2) * one,
                      "slow": rng.choice((2, 3))})
    return cases


def check_link_GBps(fn: Callable, *, seed: int = 0, n: int = 6, timeout: float = 120.0) -> None:
    """`fn(link, host)` (lab 6's link measurement) run against copy engines on a virtual clock (a
    process of its own): it must return the link's rate in GB/s (bytes a second / 1e9) to within one
    part in a million, although the first copy pays a one-time setup and one later copy is slowed:
    copies waited for before the clock is read, a warm-up, several timed copies and their median."""
    cases = link_cases(seed, n)
    reports = run_program("link_rate", fn, cases, what="measurement", timeout=timeout,
                               on_timeout=f"no answer within {timeout:.0f} s: does the measurement end?")
    for case, rep in zip(cases, reports):
        size = case["numel"] * (4 if case["dtype"] == "float32" else 2)
        where = f"a {case['GBps']:g} GB/s link, {case['numel']:,} {case['dtype']} values ({size / 1e6:g} MB)"
        if rep.get("error"):
            raise AssertionError(f"{where}: {rep['error']}")
        if rep.get("misuse"):
            raise AssertionError(f"{where}: {rep['misuse']}")
        if rep.get("zero") or (rep.get("waits") == 0 and rep.get("copies")):
            raise AssertionError(f"{where}: the clock did not move: a copy runs on the copy engine while the compute "
                                 "goes on; read link.clock() after link.wait(ticket)")
        got, want = rep["got"], case["GBps"]
        if abs(got - want) <= 1e-6 * want:
            continue
        if abs(got - want * 1e9) <= 1e-6 * want * 1e9:
            hint = ": in GB/s, bytes a second / 1e9"
        elif any(abs(got * f - want) <= 1e-6 * want for f in (2, 4)):
            hint = ": count bytes (numel x element_size()), not values"
        elif rep["copies"] < 3:
            hint = f" from {rep['copies']} cop{'y' if rep['copies'] == 1 else 'ies'}: time several"
        elif got < want:
            hint = (": slower than the link: the first copy pays a one-time setup and another copy was slowed; "
                    "time several copies after a warm-up and take the median")
        else:
            hint = ""
        raise AssertionError(f"{where}: measured {got:.6g} GB/s, the link runs at {want:g} GB/s{hint}")


# ----------------------------------------------------------------------------- a forward from disk
# The student's forward_from_disk(f, manifest, x, *, run_layer, align, buffer) runs in a process of its
# own (`programs/disk.py`) on a model stored in one file as ZeRO-Infinity's NVMe swapper stores
# tensors: one after another, each starting at a multiple of `align` (O_DIRECT's block), zeros in
# between, mixed dtypes and shapes given by the manifest. The harness writes the file from the case's
# seed and hands the answer a file object that logs every read; the reference is computed here.
DISK_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
DISK_SLACK = 256 << 10  # bytes the answer may hold besides the buffer: x, a few small objects
DISK_MODULUS = 1009.0  # programs/disk.py's run_layer keeps x's values whole numbers below this


def disk_cases(seed: int, n: int = 4) -> list[dict]:
    """Random models on disk: 3 to 6 layers, matrices (out, in) and vectors (in,) of odd sizes (so no
    layer's bytes are a multiple of the alignment and every offset shows whether it was aligned),
    fp16, bf16 and fp32 (both widths in each model), an alignment, and the seed of their values."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        count = rng.randint(3, 6)
        kinds = ["matrix", "matrix"] + [rng.choice(("matrix", "matrix", "vector")) for _ in range(count - 2)]
        rng.shuffle(kinds)
        dtypes = [rng.choice(("float16", "bfloat16")), "float32"] + [rng.choice(tuple(DISK_DTYPES)) for _ in range(count - 2)]
        rng.shuffle(dtypes)
        width = d = 2 * rng.randint(256, 512) + 1
        layers = []
        for i, (kind, dtype) in enumerate(zip(kinds, dtypes)):
            if kind == "matrix":
                out = 2 * rng.randint(256, 512) + 1
                layers.append([f"blocks.{i}.weight", [out, d], dtype])
                d = out
            else:
                layers.append([f"blocks.{i}.scale", [d], dtype])
        cases.append({"seed": rng.getrandbits(62), "align": rng.choice((512, 1024, 4096)), "rows": rng.randint(2, 4),
                      "width": width, "layers": layers, "slack": DISK_SLACK})
    return cases


def disk_layout(case: dict) -> tuple[list[tuple[int, int]], int]:
    """Each layer's (offset, bytes) in the case's file, and the file's size: every layer starts at the
    next multiple of the alignment after the one before."""
    spans, offset, align = [], 0, case["align"]
    for _, shape, dtype in case["layers"]:
        nbytes = DISK_DTYPES[dtype]
        for s in shape:
            nbytes *= s
        spans.append((offset, nbytes))
        offset += -(-nbytes // align) * align
    return spans, offset


def disk_build(case: dict):
    """The case's input and weights, as `programs/disk.py`'s `build` draws them in the answer's process
    (the programs are copied beside the answer, never imported; tests hold the two equal)."""
    import torch

    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randint(-8, 9, (case["rows"], case["width"]), generator=g).double()
    weights = [torch.randint(-16, 17, tuple(shape), generator=g).to(dtypes[dtype]) for _, shape, dtype in case["layers"]]
    return x, weights


def disk_reference(case: dict):
    """The forward over the case's layers in memory (`programs/disk.py`'s run_layer: a matrix
    multiplies, a vector scales, the result kept below DISK_MODULUS): whole numbers, exact in float64."""
    import torch

    x, weights = disk_build(case)
    for w in weights:
        y = x @ w.double().T if w.dim() == 2 else x * w.double() + 1
        x = torch.remainder(y, DISK_MODULUS)
    return x


def check_forward_from_disk(fn: Callable, *, seed: int | None = None, n: int = 4, timeout: float = 120.0) -> None:
    """`fn(f, manifest, x, *, run_layer, align, buffer)` (lab 6's forward from disk) on `n` models of
    `disk_cases` drawn from `seed` (from the OS when None, afresh for every grading), each in a file
    of its own read through a logging file object, in a process of its own: each layer read once
    from its aligned offset (its padding may come with it) into the one buffer, nothing held besides
    it but DISK_SLACK bytes, every weight of the manifest's dtype and shape, and the output exactly
    the reference computed here."""
    import secrets

    import torch

    from ..units import fmt_bytes

    if seed is None:
        seed = secrets.randbits(62)
    cases = disk_cases(seed, n)
    reports = run_program("disk", fn, cases, what="forward from disk", timeout=timeout,
                          on_timeout=f"no answer within {timeout:.0f} s: does the loop end?")
    for case, rep in zip(cases, reports):
        spans, size = disk_layout(case)
        layers = case["layers"]
        buffer = max(-(-nbytes // case["align"]) * case["align"] for _, nbytes in spans)
        where = (f"{len(layers)} layers ({', '.join(f'{dt} {tuple(shape)}' for _, shape, dt in layers)}), "
                 f"align={case['align']}")
        if set(rep) == {"error"}:  # the harness itself could not run the case
            raise AssertionError(f"{where}: {rep['error']}")
        if rep["misuse"]:
            raise AssertionError(f"{where}: {rep['misuse']}")
        if rep["held"] > case["slack"]:
            weights = sum(nbytes for _, nbytes in spans)
            hint = ("that is every layer at once: read a layer into the buffer, run it, then read the next"
                    if rep["held"] >= weights else
                    "f.read(n) makes new bytes: f.readinto(memoryview(buffer)[:n]) fills the buffer instead"
                    if rep["used_read"] else
                    "run each layer on a view of the buffer (torch.frombuffer), not on a copy of it")
            raise AssertionError(f"{where}: your code held {fmt_bytes(rep['held'])} {rep['where']}, besides the one "
                                 f"buffer of {fmt_bytes(buffer)} (the model is {fmt_bytes(size)}; at most "
                                 f"{fmt_bytes(case['slack'], digits=0)} more is allowed): {hint}")
        if rep["problem"]:
            raise AssertionError(f"{where}: {rep['problem']}")
        if rep["error"]:
            if rep["error"].startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{where}: {rep['error']}")
            raise AssertionError(f"{where}: {rep['error']}")
        if rep["calls"] != len(layers):
            raise AssertionError(f"{where}: {rep['calls']} of the {len(layers)} layers ran: run every layer in order "
                                 "and return x after the last")
        want = disk_reference(case)
        got = rep["out"]
        if got is None:
            kind = "None" if rep["out_kind"] == "NoneType" else f"a {rep['out_kind']}"
            raise AssertionError(f"{where}: returned {kind}, not x after the last layer: return what the last run_layer "
                                 "returned")
        if not torch.equal(torch.tensor(got, dtype=torch.float64), want):
            raise AssertionError(f"{where}: returned a tensor that is not x after the last layer: return what the last "
                                 "run_layer returned")
