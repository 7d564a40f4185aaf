"""Lab 1's checks (where memory goes): an integer answer against the expected count, why a GPT-2
parameter count is off, a gradient-accumulation loop against one full-batch backward, and a simplified
caching allocator's reserved bytes against `vramlab.allocator`'s replay of the same events."""

from __future__ import annotations

from typing import Any, Callable

from ..units import fmt_bytes


def _kind(answer: Any) -> str:
    """The type of an answer's value as the student wrote it (the grader sees a `sandbox.Remote` object's)."""
    return getattr(answer, "__vramlab_type__", None) or type(answer).__name__


def _named_mistake(mistakes, model: Callable, cases, answers) -> str | None:
    """The explanation of the first mistake in `mistakes` ((keyword arguments of `model`, explanation) pairs)
    whose answers `model(case, **kw)` equal all of `answers`; None when no single mistake explains them."""
    for kw, why in mistakes:
        if all(model(case, **kw) == a for case, a in zip(cases, answers)):
            return why
    return None


def check_int(actual: Any, expected: int, *, what: str, hint: str = "", unit: str = "") -> None:
    """`actual` must be an int equal to `expected`."""
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise AssertionError(f"{what}: return an int (a count of {unit or 'items'}), got {_kind(actual)} {actual!r}")
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
            raise AssertionError(f"reserved_after: return an int (bytes), got {_kind(r)} {r!r} for {_show_events(events)}")
        got.append(r)
    expected = [replay(events).peak_reserved for events in programs]
    if got == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
    where = (f"reserved_after({_show_events(programs[i])}) returned {fmt_bytes(got[i])} ({got[i]:,} B), expected "
             f"{fmt_bytes(expected[i])} ({expected[i]:,} B)")
    why = _named_mistake(ALLOC_MISTAKES, simple_reserved, programs, got)
    if why:
        raise AssertionError(f"{where}. {why}")
    raise AssertionError(f"{where}. Check each rule in turn on this program: rounding, the pool, best fit, the "
                         "split, the new segment's size, merging on free.")


# ----------------------------------------------------------------------------- in-place operations
# The student's mlp_forward(x, w1, b1, w2, b2, *, act, drop1, drop2) is the residual MLP sublayer
# x + drop2 * fc2(drop1 * act(fc1(x))) in training mode (fc = F.linear; the dropouts' scaled keep masks
# given, so that the answer and the reference draw nothing), with every in-place op autograd allows.
# Its values and gradients are checked against plain out-of-place torch, its forward counted as
# `vramlab.measure.inplace` counts (COUNTING: the source of its LiveBytes and saved_bytes, run here and sent
# to the answer's process, which cannot import vramlab) against the check's own in-place-where-allowed forward.

INPLACE_ACTS = ("relu", "gelu", "silu")
_DROP_P = (0.1, 0.2, 0.25, 0.5)


def inplace_cases(seed: int, n: int = 3) -> list[dict]:
    """`n` cases drawn from `seed`: the first three are the three activations (in a random order) with
    both dropouts on; the others a random activation, each dropout on or off; every one its own sizes
    (tokens, hidden, inner = 2-4 x hidden), float32 or bfloat16, and seed for its tensors."""
    import random

    rng = random.Random(seed)
    acts = list(INPLACE_ACTS)
    rng.shuffle(acts)
    cases = []
    for k in range(n):
        first = k < len(acts)
        h = rng.choice((16, 24, 32, 48))
        cases.append({"act": acts[k] if first else rng.choice(INPLACE_ACTS),
                      "p1": rng.choice(_DROP_P) if first or rng.random() < 0.6 else 0.0,
                      "p2": rng.choice(_DROP_P) if first or rng.random() < 0.6 else 0.0,
                      "tokens": rng.randint(4, 40), "hidden": h, "inner": h * rng.choice((2, 3, 4)),
                      "dtype": rng.choice(("float32", "float32", "bfloat16")), "seed": rng.randrange(2**31)})
    return cases


def _inplace_build(case):
    """The case's x, [w1, b1, w2, b2], [drop1, drop2] and output gradient, as `programs/inplace.py`'s
    `build` draws them in the answer's process (the programs are copied beside the answer, never
    imported; tests hold the two equal)."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    t, h, i = case["tokens"], case["hidden"], case["inner"]

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    def mask(shape, p):
        keep = torch.rand(*shape, generator=g, dtype=torch.float64) >= p
        return (keep.double() / (1 - p)).to(dtype) if p > 0 else None

    x = draw(t, h)
    params = [draw(i, h, scale=h ** -0.5), draw(i, scale=0.1), draw(h, i, scale=i ** -0.5), draw(h, scale=0.1)]
    drops = [mask((t, i), case["p1"]), mask((t, h), case["p2"])]
    return x, params, drops, draw(t, h)


# How the in-place check counts a forward: `vramlab.measure.inplace`'s LiveBytes and saved_bytes, as
# source (the grading package never imports vramlab.measure, and the answer's process cannot import
# vramlab at all: the same text runs here and there; tests/grading/test_inplace_exercise.py holds its
# counts equal to measure.inplace's).
COUNTING = """
class LiveBytes(TorchDispatchMode):
    \"\"\"Bytes of the storages kernels create while the mode is on, alive at once: now, peak. Storages
    alive before (the `existing` tensors) are not counted.\"\"\"

    def __init__(self, existing=()):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live = {}
        self.now = self.peak = 0

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.known and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)
        return out


def saved_bytes(fn, *, exclude=()):
    \"\"\"Run fn(); its result and the bytes of the distinct storages autograd saved for backward (those
    of `exclude`, the parameters, left out).\"\"\"
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())
"""


def counting() -> tuple[type, Callable]:
    """(LiveBytes, saved_bytes) from COUNTING, for this process."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    ns = {"torch": torch, "weakref": weakref, "TorchDispatchMode": TorchDispatchMode, "tree_leaves": tree_leaves}
    exec(compile(COUNTING, "<counting>", "exec"), ns)  # noqa: S102
    return ns["LiveBytes"], ns["saved_bytes"]


def op_log(live_bytes: type) -> type:
    """`live_bytes` (COUNTING's LiveBytes) that also logs every kernel: its name and the
    bytes of the storages it created that are still alive after it (0 for an in-place kernel). The
    same class counts the check's forward here and, from this source, the answer's in its process."""

    class OpLog(live_bytes):
        def __init__(self, existing=()):
            super().__init__(existing)
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = set(self.live)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.ops.append([func.overloadpacket.__name__, sum(n for k, n in self.live.items() if k not in before)])
            return out

    return OpLog


def _inplace_reference(x, w1, b1, w2, b2, *, act, drop1=None, drop2=None):
    """The check's own forward, in place wherever autograd allows it: what the answer's is held to."""
    import torch.nn.functional as F

    h = F.linear(x, w1, b1)
    h = F.gelu(h) if act == "gelu" else getattr(F, act)(h, inplace=True)  # no in-place GELU in torch
    if drop1 is not None:
        h = h * drop1 if act == "relu" else h.mul_(drop1)  # relu saved its output: leave it as it is
    h = F.linear(h, w2, b2)
    if drop2 is not None:
        h.mul_(drop2)
    return h.add_(x)


def _inplace_plain(case):
    """The reference values, out of place in plain torch: the output and the gradients of x, w1, b1, w2,
    b2 for the case's output gradient."""
    import torch.nn.functional as F

    x, params, (d1, d2), grad_out = _inplace_build(case)
    for t in (x, *params):
        t.requires_grad_(True)
    w1, b1, w2, b2 = params
    a = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[case["act"]](F.linear(x, w1, b1))
    y = F.linear(a * d1 if d1 is not None else a, w2, b2)
    out = (y * d2 if d2 is not None else y) + x
    out.backward(grad_out)
    return out.detach().double(), [t.grad.double() for t in (x, *params)]


def _inplace_counted(case, counting) -> dict:
    """The check's own in-place forward counted as the answer's is (`counting`: the per-kernel logging
    LiveBytes and saved_bytes): saved, peak and the kernels' log."""
    tracker_cls, saved_bytes = counting
    x0, params, drops, _ = _inplace_build(case)
    for t in (x0, *params):
        t.requires_grad_(True)
    x = x0.clone()
    masks = [d for d in drops if d is not None]
    tracker = tracker_cls(existing=[x, *params, *masks])
    with tracker:
        out, saved = saved_bytes(lambda: _inplace_reference(x, *params, act=case["act"], drop1=drops[0],
                                                            drop2=drops[1]), exclude=[*params, *masks])
    del out
    return {"saved": saved, "peak": tracker.peak, "ops": tracker.ops}


def _inplace_what(case: dict) -> str:
    drops = ", ".join(f"{k} p={case[p]:g}" if case[p] else f"{k} None" for k, p in (("drop1", "p1"), ("drop2", "p2")))
    return (f"mlp_forward(act={case['act']!r}, {drops}) on x {case['tokens']} x {case['hidden']} {case['dtype']}, "
            f"inner {case['inner']}")


_SAVES_OUTPUT = ("relu", "threshold", "sigmoid", "tanh")  # their backward reads their output


def _inplace_refusal(case: dict, msg: str) -> str:
    """Which in-place write autograd refuses and why, from its message: the shape of the tensor
    overwritten, and the op that made it."""
    import re

    if msg == "detached":
        return ("the output does not require grad: it is not connected to x and the weights (no .detach(), no "
                "torch.no_grad() around the forward)")
    said = f"autograd refuses the backward ({msg})"
    m = re.search(r"\[torch\.\w+ \[([\d, ]*)\]\], which is output \d+ of (\w+)", msg)
    if not m:
        return f"{said}: an op may write in place only into a tensor no earlier op saved for its backward"
    shape = tuple(int(v) for v in m.group(1).split(",") if v.strip())
    made_by = re.sub(r"Backward\d*$", "", m.group(2)).lower()
    t, h, i = case["tokens"], case["hidden"], case["inner"]
    if shape == (t, h):  # of the block's x-sized tensors only x is saved (by fc1)
        return (f"{said}: the residual sum was written into the block's input x (x.add_ / x +=), which fc1 "
                "(F.linear) saved for w1's gradient; write it into the branch's output instead (h.add_(x))")
    if made_by in _SAVES_OUTPUT:
        op = "relu" if made_by == "threshold" else made_by
        by = " (the dropout's h.mul_(drop1))" if shape == (t, i) and case["p1"] else ""
        return (f"{said}: an in-place op{by} overwrote {op}'s output, which {op} saved for its backward (its "
                f"derivative is read off its output); run the op after {op} out of place")
    saver = {"addmm": f"{case['act']}, which saved it as its input", "mul": "fc2, which saved it as its input (for "
             "w2's gradient)"}.get(made_by, "a later op, which saved it for its backward")
    return (f"{said}: an in-place op overwrote the {'x'.join(map(str, shape))} output of {made_by}, read by {saver}; "
            "an op may write in place only into a tensor no earlier op saved")


def _inplace_memory(case: dict, got: dict, ref: dict) -> str | None:
    """Why the answer's forward holds more than the in-place-where-allowed one, or None: the in-place op
    it ran out of place and the bytes that frees, else the extra kernels, the peak or the saved bytes."""
    from collections import Counter

    import torch

    nb = torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()
    t, h, i = case["tokens"], case["hidden"], case["inner"]
    big, small = t * i * nb, t * h * nb  # fc1-sized and x-sized outputs
    alloc = lambda ops: sum(n for _, n in ops)  # noqa: E731
    extra = Counter((k, n) for k, n in got["ops"] if n) - Counter((k, n) for k, n in ref["ops"] if n)
    if alloc(got["ops"]) > alloc(ref["ops"]):
        act = case["act"]
        sites = []
        if act == "relu":
            sites.append((("relu", big), "the activation could run in place (F.relu(h, inplace=True): relu saves its "
                                         "output, and nothing saved fc1's output)"))
        if case["p1"] and act != "relu":
            sites.append((("mul", big), f"the first dropout could run in place (h.mul_(drop1): {act} saved its "
                                        "input, not its output, and the multiply saves only the mask)"))
        if case["p2"]:
            sites.append((("mul", small), "the second dropout could run in place (h.mul_(drop2): nothing saved "
                                          "fc2's output, and the multiply saves only the mask)"))
        sites.append((("add", small), "the residual add could run in place (h.add_(x): the sum written into the "
                                      "branch's output, which nothing saved; x itself was saved by fc1)"))
        for key, why in sites:
            if extra[key]:
                return f"{why}: it would free {fmt_bytes(key[1])}, the output it allocates ({key[1]:,} B)"
        names = {k for k, _ in extra}
        if names & {"mm", "matmul", "bmm"}:
            return ("compute fc1 and fc2 with F.linear(h, w, b), one kernel: h @ w.T + b allocates the product and "
                    "then the sum")
        shown = ", ".join(f"aten.{k} {fmt_bytes(n)}" for (k, n) in extra.elements())
        return (f"the forward allocated {fmt_bytes(alloc(got['ops']))}, the in-place-where-allowed forward "
                f"{fmt_bytes(alloc(ref['ops']))}; the extra kernels: {shown}")
    if got["peak"] > ref["peak"]:
        return (f"the forward's peak was {fmt_bytes(got['peak'])} alive at once, {fmt_bytes(ref['peak'])} in the "
                "in-place-where-allowed forward: let what nothing saved die at once (one name, rebound: h = ...)")
    if got["saved"] > ref["saved"]:
        return (f"autograd saved {fmt_bytes(got['saved'])} for backward, {fmt_bytes(ref['saved'])} in the "
                "in-place-where-allowed forward: an op saved a tensor it need not")
    return None


def check_inplace_mlp(fn: Callable, *, seed: int | None = None, n: int = 3, timeout: float = 120.0) -> None:
    """`fn(x, w1, b1, w2, b2, *, act, drop1, drop2)` returns the residual MLP sublayer's output
    x + drop2 * fc2(drop1 * act(fc1(x))) (fc1 = F.linear(., w1, b1), fc2 = F.linear(., w2, b2); a mask
    None: no dropout) using every in-place op autograd allows and none it refuses. Run on `n` cases drawn
    from `seed` (from the OS when None, afresh for every grading) in a process of its own
    (`programs/inplace.py`): its output and gradients must match plain out-of-place torch, computed here;
    its forward, counted as `vramlab.measure.inplace` counts, may save, allocate and hold at its peak no
    more than the check's own in-place-where-allowed forward, counted the same way here."""
    import inspect
    import secrets

    import torch

    from .run import run_program

    if seed is None:
        seed = secrets.randbits(62)
    source = COUNTING + "\n\n" + inspect.getsource(op_log)
    cases = inplace_cases(seed, n)
    live_bytes, saved = counting()
    ours = (op_log(live_bytes), saved)
    reports = run_program("inplace", fn, [dict(c, counting=source) for c in cases], what="in-place forward",
                          timeout=timeout, on_timeout=f"the forward gave no answer within {timeout:.0f} s")
    for case, rep in zip(cases, reports):
        what = _inplace_what(case)
        if rep.get("error"):
            err = rep["error"]
            if err.startswith("NotImplementedError"):  # the stub: say so as the other exercises do
                raise NotImplementedError(f"{what}: {err}")
            hint = ""
            if "gelu" in err and "inplace" in err:
                hint = " (torch has no in-place GELU: F.gelu(h) out of place)"
            elif "leaf Variable" in err:
                hint = " (the weights and biases are leaves that require grad: never write into them)"
            raise AssertionError(f"{what}: {err}{hint}")
        if rep["refused"]:
            raise AssertionError(f"{what}: {_inplace_refusal(case, rep['refused'])}")
        out, grads = _inplace_plain(case)
        tol = dict(rtol=2e-2, atol=2e-2) if case["dtype"] == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
        got = torch.tensor(rep["out"], dtype=torch.float64).reshape(out.shape)
        if not torch.allclose(got, out, **tol):
            raise AssertionError(f"{what}: the output differs from x + drop2 * fc2(drop1 * act(fc1(x))) by up to "
                                 f"{float((got - out).abs().max()):.3g}")
        for name, g, ref in zip(("x", "w1", "b1", "w2", "b2"), rep["grads"], grads):
            if g is None:
                raise AssertionError(f"{what}: {name} has no gradient: the output must depend on it through autograd")
            g = torch.tensor(g, dtype=torch.float64).reshape(ref.shape)
            if not torch.allclose(g, ref, **tol):
                raise AssertionError(
                    f"{what}: the output is right but the gradient of {name} is wrong (off by up to "
                    f"{float((g - ref).abs().max()):.3g}): a write autograd did not see (through .data, or into a "
                    "tensor an op had saved) left the backward computing from overwritten values or missing an op; "
                    "write in place only where autograd allows it, on the tensors themselves")
        why = _inplace_memory(case, rep, _inplace_counted(case, ours))
        if why:
            raise AssertionError(f"{what}: {why}")


# ----------------------------------------------------------------------------- a paged KV cache's admission
# The student's admit(requests, *, num_blocks, block_size, shared_prefix) serves a queue of requests,
# (prompt tokens, new tokens) each in arrival order, from a pool of num_blocks KV-cache blocks of block_size
# tokens (vLLM's PagedAttention, Kwon et al. 2023): a request holds ceil((prompt + new) / block_size) blocks
# for its whole life; the first shared_prefix tokens of every prompt are one system prompt whose FULL blocks
# are cached once and shared (vLLM's prefix caching hashes full blocks only: a partly filled block is each
# request's own); requests are admitted first come, first served -- the first that does not fit waits, and so
# does everything behind it (vLLM's scheduler stops at it). It returns (requests running, blocks in use).

def paged_admission(requests, *, num_blocks: int, block_size: int, shared_prefix: int = 0, ceil: bool = True,
                    output: bool = True, share: str = "full", fcfs: bool = True,
                    first_pays: bool = True) -> tuple[int, int]:
    """The reference (defaults), or one usual mistake: `ceil` False rounds the blocks down; `output` False
    forgets the new tokens; `share` "none" counts the system prompt in every request, "partial" shares its
    partly filled last block too; `fcfs` False skips a request that does not fit and admits later ones;
    `first_pays` False never counts the shared blocks at all."""
    full = shared_prefix // block_size if share == "full" else \
        (-(-shared_prefix // block_size) if share == "partial" else 0)
    running = used = 0
    paid = False
    for prompt, new in requests:
        tokens = prompt + (new if output else 0)
        blocks = -(-tokens // block_size) if ceil else tokens // block_size
        need = blocks - (full if (paid or not first_pays) else 0)
        if used + need > num_blocks:
            if fcfs:
                break
            continue
        used += need
        running += 1
        paid = True
    return running, used


ADMISSION_MISTAKES = (
    (dict(ceil=False), "a request's last block is allocated whole even when it is partly filled: round its blocks "
                       "up (ceil), not down."),
    (dict(output=False), "a request holds blocks for its new tokens as well as its prompt: both are in the cache by "
                         "the end of its generation."),
    (dict(share="none"), "the system prompt's full blocks are cached once and shared: count them for the first "
                         "request admitted only."),
    (dict(share="partial"), "only FULL blocks of the system prompt are shared: its last, partly filled block also "
                            "holds each request's own tokens, so every request has its own copy of it."),
    (dict(fcfs=False), "first come, first served: when a request does not fit, it waits and so does every request "
                       "behind it (the scheduler stops there); a later, smaller request does not jump the queue."),
    (dict(first_pays=False), "the shared blocks are in the pool once: the first request admitted pays for them."),
)

# the vLLM paper's setting, by hand: 16-token blocks, 4 requests of 100 + 28 tokens (8 blocks each), a pool of
# 30 blocks: three run (24 blocks); with a 40-token system prompt (2 full blocks shared) all four (8 + 3 x 6 = 26)
ADMISSION_EXAMPLES = (
    dict(requests=[(100, 28)] * 4, num_blocks=30, block_size=16, shared_prefix=0),
    dict(requests=[(100, 28)] * 4, num_blocks=30, block_size=16, shared_prefix=40),
)


def admission_cases(seed: int, n: int = 6) -> list[dict]:
    """`n` random queues, each one on which every mistake of `ADMISSION_MISTAKES` answers differently from the
    reference (redrawn until it does, or the set as a whole covers every mistake)."""
    import random

    rng = random.Random(seed)
    cases: list[dict] = []
    caught: set[int] = set()
    while len(cases) < n or len(caught) < len(ADMISSION_MISTAKES):
        B = rng.choice((8, 16, 32))
        prefix = rng.choice((0, rng.randint(1, 3) * B + rng.randint(1, B - 1), rng.randint(1, 4) * B))
        reqs = [(prefix + rng.randint(1, 6 * B), rng.randint(1, 4 * B)) for _ in range(rng.randint(3, 9))]
        total = sum(-(-(p + o) // B) for p, o in reqs)
        case = dict(requests=reqs, num_blocks=rng.randint(total // 3, max(total // 3 + 1, total - 1)), block_size=B,
                    shared_prefix=prefix)
        ref = paged_admission(**case)
        shows = {i for i, (kw, _) in enumerate(ADMISSION_MISTAKES) if paged_admission(**case, **kw) != ref}
        # a case that shows a mistake not caught yet, or any case once all are caught, until there are n
        if shows - caught or (len(cases) < n and len(caught) == len(ADMISSION_MISTAKES)):
            cases.append(case)
            caught |= shows
    return cases


def check_admission(fn: Callable, *, cases=ADMISSION_EXAMPLES, n: int = 6, seed: int | None = None) -> list[tuple]:
    """`fn(requests, *, num_blocks, block_size, shared_prefix)` must return (requests running, blocks in use)
    as `paged_admission` computes them: on `cases`, then on `n` random queues drawn from `seed` (from the OS when
    None: afresh for every grading) that together tell every usual mistake apart. A wrong answer is matched
    against the mistakes (`ADMISSION_MISTAKES`) to say which. Returns the answers."""
    import secrets

    if seed is None:
        seed = secrets.randbits(62)
    queues = [dict(c) for c in cases] + admission_cases(seed, n)
    got = []
    for case in queues:
        what = (f"admit({_show_queue(case['requests'])}, num_blocks={case['num_blocks']}, "
                f"block_size={case['block_size']}, shared_prefix={case['shared_prefix']})")
        r = fn([tuple(x) for x in case["requests"]], num_blocks=case["num_blocks"], block_size=case["block_size"],
               shared_prefix=case["shared_prefix"])
        try:
            r = tuple(r)
        except TypeError:
            r = None
        if r is None or len(r) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in r):
            raise AssertionError(f"{what}: return two ints (requests running, blocks in use), got {_kind(r)} {r!r:.80}")
        got.append((what, r, paged_admission(**case)))
    for what, r, ref in got:
        if r != ref:
            wrong = f"{what} returned {r}, expected {ref}"
            why = _named_mistake(ADMISSION_MISTAKES, lambda case, **kw: paged_admission(**case, **kw), queues,
                                 [g for _, g, _ in got])
            if why:
                raise AssertionError(f"{wrong}. {why}")
            raise AssertionError(f"{wrong}. Check each rule on this queue: blocks a request holds, the shared "
                                 "system prompt, the order of admission.")
    return [r for _, r, _ in got]


def _show_queue(requests) -> str:
    return repr(list(requests)) if len(requests) <= 5 else f"[{len(requests)} requests: {requests[0]!r}, ...]"


