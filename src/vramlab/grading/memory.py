"""Lab 1's checks (where memory goes): an integer answer against the expected count, why a GPT-2
parameter count is off, a gradient-accumulation loop against one full-batch backward, and a simplified
caching allocator's reserved bytes against `vramlab.allocator`'s replay of the same events."""

from __future__ import annotations

from typing import Any, Callable

from ..units import fmt_bytes


def check_int(actual: Any, expected: int, *, what: str, hint: str = "", unit: str = "") -> None:
    """`actual` must be an int equal to `expected`."""
    if isinstance(actual, bool) or not isinstance(actual, int):
        kind = getattr(actual, "__vramlab_type__", None) or type(actual).__name__  # the grader's view of an answer's object
        raise AssertionError(f"{what}: return an int (a count of {unit or 'items'}), got {kind} {actual!r}")
    if actual != expected:
        off = actual - expected
        shown = (lambda n: fmt_bytes(n)) if unit == "bytes" else (lambda n: f"{n:,}")
        msg = f"{what}: got {shown(actual)}, expected {shown(expected)} (off by {off:+,})."
        raise AssertionError(msg + (f" Hint: {hint}" if hint else ""))


def diagnose_param_count(fn: Callable[..., int], cfg: dict[str, Any], expected: int) -> str:
    """Why a GPT-2 parameter count is off, from the size of the error."""
    got = fn(**cfg)
    if not isinstance(got, int):
        return ""
    h, V, L = cfg["n_embd"], cfg["vocab_size"], cfg["n_layer"]
    off = got - expected
    inner = cfg.get("n_inner") or 4 * h
    if off == V * h:
        return "you counted the LM head separately, but GPT-2 ties it to the token embedding (one tensor)."
    if off == -cfg["n_positions"] * h:
        return "you forgot the learned position embedding (n_positions x n_embd)."
    if off == -L * 4 * h or off == -(L * 4 + 2) * h:
        return "layer norms have a weight and a bias each: 2 per block (4h) plus the final one (2h)."
    if off % L == 0 and abs(off // L) in (3 * h + h + inner + h, h + inner):
        return "every Conv1D/Linear in GPT-2 has a bias vector too."
    if off % L == 0 and abs(off // L) == 2 * h * (inner - 4 * h):
        return "use n_inner for the MLP width when it is given (4 * n_embd only when it is None)."
    return "count block by block: 2 layer norms, c_attn (h x 3h + 3h), c_proj (h x h + h), c_fc and c_proj of the MLP."



# ----------------------------------------------------------------------------- gradient accumulation

def _accum_case(seed: int, n: int, m: int) -> dict:
    return {"seed": seed, "d": 6, "h": 10, "c": 4, "n": n, "micro_batch_size": m}


ACCUM_CASES = ((12, 4), (16, 2))  # divisible: every micro-batch the same size
ACCUM_REMAINDER = ((10, 4), (7, 3), (5, 5), (3, 8))  # a smaller last micro-batch; k = 1; a micro-batch above the batch


def _flat(grads) -> list[float]:
    return [v for g in grads for v in g]


def check_accumulate(fn: Callable, *, cases=ACCUM_CASES, timeout: float = 120.0) -> None:
    """`fn(model, loss_fn, inputs, targets, micro_batch_size)` runs the batch in micro-batches of at most
    `micro_batch_size` rows and leaves in every `.grad` what one backward of `loss_fn` (a mean over rows)
    on the whole batch leaves, starting from no gradient; it returns the number of micro-batches. Run on
    a small MLP in a process of its own (`programs/accum.py`); the reference is computed here, from the
    same seed, by one full-batch backward."""
    import torch

    from .run import fresh_generator, run_program

    seed = int(torch.randint(0, 2**31 - 2, (1,), generator=fresh_generator()))
    specs = [_accum_case(seed + i, n, m) for i, (n, m) in enumerate(cases)]
    reports = run_program("accum", fn, specs, what="accumulation run", timeout=timeout,
                          on_timeout=f"the accumulation run gave no answer within {timeout:.0f} s")
    for case, rep in zip(specs, reports):
        n, m = case["n"], case["micro_batch_size"]
        k = -(-n // m)
        what = f"a batch of {n} rows in micro-batches of {m}"
        if rep.get("error"):
            if rep["error"].startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{what}: {rep['error']}")
            raise AssertionError(f"{what}: {rep['error']}")
        rows = rep["rows"]
        if rows == [n] and k > 1:
            raise AssertionError(f"{what}: the model ran once, on all {n} rows: split the batch (inputs[i:i + {m}]) and "
                                 "run each micro-batch's forward and backward in turn")
        if any(r > m for r in rows) or sum(rows) != n or len(rows) != k:
            raise AssertionError(f"{what}: the model's forward calls saw {rows} rows; expected {k} calls of at most {m} "
                                 f"rows covering the {n} rows once")
        if rep["returned"] != k:
            raise AssertionError(f"{what}: returned {rep['returned']}, expected the number of micro-batches, {k}")
        model, inputs, targets = _accum_build(case)
        _accum_loss(model(inputs), targets).backward()
        ref = [p.grad.reshape(-1) for p in model.parameters()]
        if any(g is None for g in rep["grads"]):
            raise AssertionError(f"{what}: a parameter has no gradient (.grad is None): run backward() on every "
                                 "micro-batch's loss")
        got = [torch.tensor(g, dtype=torch.float64) for g in rep["grads"]]
        if all(torch.allclose(a, b, rtol=1e-7, atol=1e-10) for a, b in zip(got, ref)):
            continue
        hint = _accum_hint(case, got, ref)
        raise AssertionError(f"{what}: the gradients differ from one backward on the whole batch (largest difference "
                             f"{max(float((a - b).abs().max()) for a, b in zip(got, ref)):.3g}). {hint}")


def _accum_build(case):
    """The case's model, inputs and targets, as `programs/accum.py`'s `build` makes them in the answer's
    process (the programs are copied beside the answer, never imported; tests hold the two equal)."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    d, h, c, n = case["d"], case["h"], case["c"], case["n"]
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, c)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    inputs = torch.randn(n, d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, c, (n,), generator=g)
    return model, inputs, targets


def _accum_loss(logits, targets):
    """The mean over rows: what the full batch's loss is (`programs/accum.py`'s `loss_fn`)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets)


def _accum_hint(case: dict, got, ref) -> str:
    """Why the accumulated gradients are off, from the wrong answers they equal."""
    import torch

    n, m = case["n"], case["micro_batch_size"]
    k = -(-n // m)

    def close(other) -> bool:
        return all(torch.allclose(a, b, rtol=1e-7, atol=1e-10) for a, b in zip(got, other))

    g = torch.Generator().manual_seed(case["seed"] + 1)
    model, inputs, targets = _accum_build(case)
    noise = [torch.randn(p.shape, generator=g, dtype=torch.float64).reshape(-1) for p in model.parameters()]
    if close([a + b for a, b in zip(ref, noise)]):
        return ("The gradients already in .grad were kept: clear them first (p.grad = None, or "
                "model.zero_grad(set_to_none=True)); backward adds into whatever is there.")
    if close([a * k for a in ref]):
        return (f"They are {k}x too large: each micro-batch's loss is a mean over its rows, so scale it by its share "
                "of the batch (1/k when the micro-batches are equal) before backward.")

    def weighted(scale) -> list:
        model, inputs, targets = _accum_build(case)
        for i in range(0, n, m):
            x, y = inputs[i:i + m], targets[i:i + m]
            (_accum_loss(model(x), y) * scale(x.shape[0])).backward()
        return [p.grad.reshape(-1) for p in model.parameters()]

    if n % m and close(weighted(lambda rows: 1 / k)):
        return (f"The last micro-batch has only {n - (k - 1) * m} rows: scaling every loss by 1/k over-weights its "
                "rows. Scale each micro-batch's mean loss by its rows / the batch's rows.")
    return "Each micro-batch: forward, its mean loss times (its rows / all rows), backward; autograd adds the gradients."


# ----------------------------------------------------------------------------- the caching allocator
# The student's reserved_after(events) replays ("alloc", id, nbytes) / ("free", id) events through a
# caching allocator with the default rules of PyTorch's CUDA allocator (no expandable segments, no
# max_split_size, memory never released) and returns the bytes reserved at the end. The expected
# value is vramlab.allocator.replay's (the model validated against the H100); `simple_reserved`, a
# second implementation with switches, names the rule a wrong answer broke.

_MiB = 1 << 20


def simple_reserved(events, *, rounding: bool = True, reuse: bool = True, split: str = "rule", merge: bool = True,
                    fit: str = "best", pools: bool = True, segments: str = "rule") -> int:
    """Bytes reserved after `events` under the lab's rules, each of which can be broken on purpose:
    `rounding` (to 512 B), `reuse` (of cached free blocks), `split` ("rule", "never", "always"),
    `merge` (of a freed block with free neighbours), `fit` ("best", "first": lowest address),
    `pools` (separate small and large pools), `segments` ("rule"; "exact": a large request's segment
    is the request rounded up to 2 MiB, never 20 MiB)."""
    segs: list[list[list]] = []  # per segment (in the order made): blocks [offset, size, free] by offset
    small_of: list[bool] = []
    live: dict = {}
    for e in events:
        if e[0] == "free":
            s, blk = live.pop(e[1])
            blocks = segs[s]
            blk[2] = True
            i = next(k for k, b in enumerate(blocks) if b is blk)
            if merge and i + 1 < len(blocks) and blocks[i + 1][2]:
                blk[1] += blocks.pop(i + 1)[1]
            if merge and i > 0 and blocks[i - 1][2]:
                blocks[i - 1][1] += blocks.pop(i)[1]
            continue
        n = e[2]
        size = 512 * max(1, -(-n // 512)) if rounding else max(1, n)
        small = size <= _MiB
        pool = small if pools else True
        best = None
        if reuse:
            for s, blocks in enumerate(segs):
                if (small_of[s] if pools else True) != pool:
                    continue
                for b in blocks:
                    if b[2] and b[1] >= size:
                        key = (b[1], s, b[0]) if fit == "best" else (s, b[0])
                        if best is None or key < best[0]:
                            best = (key, s, b)
        if best is None:
            if small:
                seg = 2 * _MiB
            elif size < 10 * _MiB and segments == "rule":
                seg = 20 * _MiB
            else:
                seg = 2 * _MiB * -(-size // (2 * _MiB))
            segs.append([[0, seg, True]])
            small_of.append(small)
            best = (None, len(segs) - 1, segs[-1][0])
        _, s, b = best
        rest = b[1] - size
        if split == "never":
            cut = False
        elif split == "always" or small:  # the request's pool (the block's, unless pools=False)
            cut = rest >= 512 if split == "rule" else rest > 0
        else:
            cut = rest > _MiB
        if cut:
            blocks = segs[s]
            i = next(k for k, x in enumerate(blocks) if x is b)
            blocks.insert(i + 1, [b[0] + size, rest, True])
            b[1] = size
        b[2] = False
        live[e[1]] = (s, b)
    return sum(b[1] for blocks in segs for b in blocks)


def allocator_cases(seed: int, n: int = 6) -> list[list[tuple]]:
    """Random programs: allocations of small (<= 1 MiB), middle (1-10 MiB) and large (10-48 MiB)
    requests, many of a few recurring sizes (as a training step repeats its tensors), interleaved
    with frees of live ones."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        def draw() -> int:
            r = rng.random()
            if r < 0.4:
                return rng.randint(1, 4096) if rng.random() < 0.5 else rng.randint(4096, _MiB)
            if r < 0.75:
                return rng.randint(_MiB + 1, 10 * _MiB)
            return rng.randint(10 * _MiB - 2048, 48 * _MiB)
        palette = [draw() for _ in range(rng.randint(3, 8))]
        events: list[tuple] = []
        live: list[int] = []
        for k in range(rng.randint(30, 150)):
            if live and rng.random() < 0.45:
                events.append(("free", live.pop(rng.randrange(len(live)))))
            else:
                events.append(("alloc", k, rng.choice(palette) if rng.random() < 0.7 else draw()))
                live.append(k)
        cases.append(events)
    return cases


# the chapter's example: 40 MiB freed, then 20 MiB (split from the cached segment) and 30 MiB (a new one)
ALLOC_EXAMPLES = ([("alloc", "a", 40 * _MiB), ("free", "a"), ("alloc", "b", 20 * _MiB), ("alloc", "c", 30 * _MiB)],)
# one program per rule, each of which a broken rule gets wrong (tests/grading/test_memory.py shows which)
ALLOC_TRAPS = (
    [("alloc", 0, 4 * _MiB), ("free", 0), ("alloc", 1, 4 * _MiB)],  # reuse
    [("alloc", "x", 10 * _MiB - 100)],  # the 10 MiB rule is on the rounded size
    [("alloc", i, 699_001) for i in range(3)],  # rounded to 699,392 B, only two fit in a 2 MiB segment
    [("alloc", 0, 1024), ("alloc", 1, 1024), ("alloc", 2, 4 * _MiB), ("alloc", 3, 4 * _MiB)],  # split, 20 MiB segments
    [("alloc", "A", 8 * _MiB), ("alloc", "B", 12 * _MiB), ("free", "A"), ("alloc", "C", 15 * _MiB // 2),
     ("free", "B"), ("alloc", "D", 25 * _MiB // 2)],  # a remainder of 0.5 MiB is not split off
    [("alloc", 0, 8 * _MiB), ("alloc", 1, 12 * _MiB), ("free", 0), ("free", 1), ("alloc", 2, 16 * _MiB)],  # merge
    [("alloc", "p", 4 * _MiB), ("alloc", "q", 16 * _MiB), ("alloc", "a", 10 * _MiB), ("free", "q"), ("free", "a"),
     ("alloc", "c", 4 * _MiB), ("alloc", "d", 12 * _MiB), ("alloc", "e", 10 * _MiB)],  # best fit, not first fit
    [("alloc", 0, 4 * _MiB), ("free", 0), ("alloc", 1, 1024)],  # pools
)

ALLOC_MISTAKES = (
    (dict(reuse=False), "no reuse: every alloc made a new segment. A freed block stays cached in its pool and serves "
                        "the next request it fits."),
    (dict(rounding=False), "forgot rounding: every request is first rounded up to a multiple of 512 bytes, and the "
                           "pool, the segment size and the fit all use the rounded size."),
    (dict(split="never"), "split rule: a block was never split, so each request took a whole cached block or "
                          "segment. Split it when the rest is worth keeping (>= 512 B in the small pool, > 1 MiB in "
                          "the large pool)."),
    (dict(split="always"), "split rule: in the large pool a block is split only when more than 1 MiB would be left; "
                           "a smaller rest stays part of the allocated block."),
    (dict(merge=False), "no merging: a freed block merges with the free blocks just before and after it in its "
                        "segment, so a later, larger request can use them together."),
    (dict(fit="first"), "best fit: take the smallest free block of the pool that is large enough, not the first one."),
    (dict(pools=False), "pools: a request of at most 1 MiB (rounded) is served only from the small pool, a larger one "
                        "only from the large pool; a free block of one pool never serves the other."),
    (dict(segments="exact"), "segment size: a large-pool request under 10 MiB that no free block fits makes a 20 MiB "
                             "segment (the rest is cached for later requests); only from 10 MiB up is the segment "
                             "the request rounded up to 2 MiB."),
)


def _show_events(events) -> str:
    if len(events) <= 8:
        return repr(list(events))
    return f"{len(events)} events, from {events[0]!r} to {events[-1]!r}"


def check_reserved_after(fn: Callable, *, cases=ALLOC_EXAMPLES, n: int = 6, seed: int | None = None) -> None:
    """`fn(events)` must return the bytes the caching allocator holds after `events` (lists of
    ("alloc", id, nbytes) and ("free", id)), as `vramlab.allocator.replay` computes them with the
    default settings: on `cases`, then on `n` random programs drawn from `seed` (from the OS when
    None, afresh for every grading). A wrong answer is matched against the answers that break one
    rule (`ALLOC_MISTAKES`) to say which."""
    import secrets

    from ..allocator import replay

    if seed is None:
        seed = secrets.randbits(62)
    programs = [list(c) for c in cases] + allocator_cases(seed, n)
    got = []
    for events in programs:
        r = fn([tuple(e) for e in events])
        if isinstance(r, bool) or not isinstance(r, int):
            kind = getattr(r, "__vramlab_type__", None) or type(r).__name__
            raise AssertionError(f"reserved_after: return an int (bytes), got {kind} {r!r} for {_show_events(events)}")
        got.append(r)
    expected = [replay(events).peak_reserved for events in programs]
    if got == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
    where = (f"reserved_after({_show_events(programs[i])}) returned {fmt_bytes(got[i])} ({got[i]:,} B), expected "
             f"{fmt_bytes(expected[i])} ({expected[i]:,} B)")
    for kw, why in ALLOC_MISTAKES:
        if all(simple_reserved(events, **kw) == g for events, g in zip(programs, got)):
            raise AssertionError(f"{where}. {why}")
    raise AssertionError(f"{where}. Check each rule in turn on this program: rounding, the pool, best fit, the "
                         "split, the new segment's size, merging on free.")
