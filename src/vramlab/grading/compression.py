"""Lab 8's checks (compression): per-row INT8, a LoRA layer (against peft's), the distillation loss,
2:4 sparsity, LLM.int8()'s decomposition and QLoRA's bytes, each computed here."""

from __future__ import annotations

from typing import Any, Callable

from .memory import check_int


def _int8_cases(seed: int, n: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(n):
        rows, cols = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        w = torch.randn(rows, cols, generator=g) * float(torch.rand(1, generator=g)) * 0.1
        if rows > 2:
            w[int(torch.randint(0, rows, (1,), generator=g))] *= 50  # an outlier row
            w[int(torch.randint(0, rows, (1,), generator=g))] = 0  # an all-zero row
        cases.append(w)
    return cases


def check_row_int8(quantize_rows: Callable, dequantize_rows: Callable, row_int8_bytes: Callable, *, seed: int = 0,
                   n: int = 8) -> None:
    """Per-row absmax INT8 on plain lists: integer codes in [-127, 127] with 127 reached in every
    non-zero row, one scale a row, every weight back within half a step of its row's scale, and
    the storage (int8 codes and fp32 scales) exact to the byte."""
    for w in _int8_cases(seed, n):
        rows, cols = w.shape
        wl = w.tolist()
        out = quantize_rows(wl)
        assert isinstance(out, (list, tuple)) and len(out) == 2, "quantize_rows must return (q, scales)"
        q, s = out
        assert isinstance(q, (list, tuple)) and len(q) == rows and all(len(r) == cols for r in q), \
            f"q must have the shape of w ({rows} rows of {cols})"
        assert all(isinstance(v, int) and not isinstance(v, bool) for r in q for v in r), "q must hold Python ints"
        assert isinstance(s, (list, tuple)) and len(s) == rows, f"scales: one a row ({rows}), got {len(s) if isinstance(s, (list, tuple)) else s!r}"
        scales = _vector_answer(s, rows, "scales")
        assert max(abs(v) for r in q for v in r) <= 127, "codes must lie in [-127, 127] (symmetric: -128 is never used)"
        for i, (r, row) in enumerate(zip(q, wl)):
            top = max(abs(v) for v in row)
            if not top:  # an all-zero row: any finite scale, every code 0
                assert not any(r), f"row {i} is all zeros: its codes must be 0"
                continue
            # the reference, from the weights themselves (never from the answer's scales)
            ref = top / 127
            assert abs(scales[i] - ref) <= 1e-6 * ref, \
                f"row {i}'s scale is {scales[i]:.6g}; absmax gives its largest |weight| / 127 = {ref:.6g}"
            assert max(abs(v) for v in r) == 127, "each non-zero row's largest weight must map to +-127 (absmax)"
            assert all(abs(v - x / ref) <= 0.5 + 1e-6 for v, x in zip(r, row)), \
                f"row {i}'s codes are not its weights / scale, rounded to the nearest integer"
        back = _matrix_answer(dequantize_rows(q, s), rows, cols, "dequantize_rows")
        for i, (row, b) in enumerate(zip(wl, back)):
            step = max(abs(v) for v in row) / 127  # the reference step, not the answer's
            worst = max(abs(x - y) for x, y in zip(row, b)) - step / 2
            assert worst <= 1e-6 * max(abs(x) for x in row) + 1e-12, \
                f"row {i} of a {rows} x {cols} matrix comes back {worst:.3g} further than half its step: round, do not truncate"
        check_int(row_int8_bytes(rows, cols), rows * cols + 4 * rows, what=f"bytes of a {rows} x {cols} matrix in per-row INT8",
                  hint="one byte a weight and one fp32 scale a row", unit="bytes")


def _matrix_answer(got: Any, rows: int, cols: int, what: str) -> list[list[float]]:
    """An answer's matrix (a list of rows of numbers) as floats, or AssertionError saying what is wrong."""
    if not isinstance(got, (list, tuple)) or len(got) != rows:
        raise AssertionError(f"{what}: return a list of {rows} rows, got {type(got).__name__}"
                             + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))
    if any(not isinstance(row, (list, tuple)) or len(row) != cols for row in got):
        raise AssertionError(f"{what}: every row must hold {cols} numbers")
    return [_vector_answer(row, cols, what) for row in got]


def _vector_answer(got: Any, n: int, what: str) -> list[float]:
    """An answer's list of n finite numbers as floats, or AssertionError saying what is wrong."""
    import math

    if not isinstance(got, (list, tuple)) or len(got) != n:
        raise AssertionError(f"{what}: return a list of {n} numbers")
    try:
        vals = [float(v) for v in got]
    except (TypeError, ValueError):
        raise AssertionError(f"{what}: must hold numbers (plain floats; call .tolist() on a tensor)") from None
    if not all(math.isfinite(v) for v in vals):
        raise AssertionError(f"{what}: a value is inf or nan")
    return vals


def _far(a: list[list[float]], b: list[list[float]], tol: float) -> float:
    """The largest |a - b| over the largest |b| (0 when both are zero)."""
    top = max((abs(v) for r in b for v in r), default=0.0) or 1.0
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0) / top - tol


def _lora_peft(W, bias, A, B, alpha: float):
    """The reference: peft's LoRA layer wrapped around a torch Linear holding W (and bias), its adapter
    set to A and B (fp64 throughout, dropout 0)."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model

    d_out, d_in, r = len(W), len(W[0]), len(A)

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(d_in, d_out, bias=bias is not None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(One(), LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=0.0))
    model = model.double()
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor(W, dtype=torch.float64))
        if bias is not None:
            layer.base_layer.bias.copy_(torch.tensor(bias, dtype=torch.float64))
        layer.lora_A["default"].weight.copy_(torch.tensor(A, dtype=torch.float64))
        layer.lora_B["default"].weight.copy_(torch.tensor(B, dtype=torch.float64))
    return layer


def lora_cases(seed: int, n: int):
    """(W, bias or None, A, B, alpha, x): small layers of every shape, ranks 1 to 16, B not zero."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(n):
        d_in, d_out = (int(v) for v in torch.randint(2, 40, (2,), generator=g))
        r = [1, 2, 4, 8, 16][k % 5]
        alpha = [16.0, 8.0, 2.0 * r, 32.0, float(r)][(k + seed) % 5]
        w = (torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5).tolist()
        bias = None if k % 3 == 2 else torch.randn(d_out, generator=g, dtype=torch.float64).tolist()
        a = (torch.randn(r, d_in, generator=g, dtype=torch.float64) * 0.3).tolist()
        b = (torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.3).tolist()
        x = torch.randn(int(torch.randint(1, 6, (1,), generator=g)), d_in, generator=g, dtype=torch.float64).tolist()
        cases.append((w, bias, a, b, alpha, x))
    return cases


def check_lora_layer(lora_init: Callable, lora_forward: Callable, lora_merge: Callable, *, seed: int = 0,
                     n: int = 6) -> None:
    """A LoRA linear layer in plain lists, against peft's (`peft.tuners.lora.Linear`, fp64): its
    initialisation (A as torch.nn.Linear draws a weight, B zero: the layer starts as the frozen one),
    its forward x W^T + b + (alpha / r) x A^T B^T for given W, A, B, and its merged weight."""
    import math
    import statistics

    import torch

    # initialisation: shapes, B zero, A within nn.Linear's bound and spread like it, different seeds differ
    for d_in, d_out, r in ((256, 64, 16), (96, 200, 8), (7, 3, 2)):
        got = lora_init(d_in, d_out, r, 1)
        if not isinstance(got, (list, tuple)) or len(got) != 2:
            raise AssertionError("lora_init must return (A, B)")
        A = _matrix_answer(got[0], r, d_in, f"lora_init({d_in}, {d_out}, {r}): A (r x d_in)")
        B = _matrix_answer(got[1], d_out, r, f"lora_init({d_in}, {d_out}, {r}): B (d_out x r)")
        if any(v != 0 for row in B for v in row):
            raise AssertionError("B must start at zero: then B A = 0 and the adapted layer starts as exactly the "
                                 "frozen one (LoRA, section 4.1; peft's default)")
        bound = 1 / math.sqrt(d_in)
        vals = [v for row in A for v in row]
        if max(abs(v) for v in vals) > bound * (1 + 1e-6):
            raise AssertionError(f"A (d_in = {d_in}) has a value of {max(abs(v) for v in vals):.4g}, outside the bound "
                                 f"torch.nn.Linear draws its weight within for that fan-in")
        if len(vals) >= 1000:
            std, want = statistics.pstdev(vals), bound / math.sqrt(3)
            if not 0.9 * want <= std <= 1.1 * want:
                raise AssertionError(f"A's values spread with standard deviation {std:.4g}; torch.nn.Linear's initial "
                                     f"weights of fan-in {d_in} spread with {want:.4g} (uniform within the bound)")
        again = lora_init(d_in, d_out, r, 2)
        if isinstance(again, (list, tuple)) and len(again) == 2 and _matrix_answer(again[0], r, d_in, "A") == A and d_in * r > 4:
            raise AssertionError("lora_init with another seed gave the same A: draw it at random (from the seed)")
    for w, bias, a, b, alpha, x in lora_cases(seed, n):
        layer = _lora_peft(w, bias, a, b, alpha)
        r, d_out, d_in = len(a), len(w), len(w[0])
        where = f"d_in {d_in}, d_out {d_out}, r {r}, alpha {alpha:g}, {'a bias' if bias else 'no bias'}"
        with torch.no_grad():
            want = layer(torch.tensor(x, dtype=torch.float64)).tolist()
        got = _matrix_answer(lora_forward(x, w, bias, a, b, alpha), len(x), d_out, f"lora_forward ({where})")
        if _far(got, want, 1e-5) > 0:
            unscaled = (torch.tensor(x) @ torch.tensor(w).T + (torch.tensor(bias) if bias else 0)
                        + torch.tensor(x) @ torch.tensor(a).T @ torch.tensor(b).T).tolist()
            hint = (" — the adapter's output must be scaled by alpha / r" if alpha != r and _far(got, unscaled, 1e-5) <= 0
                    else "")
            raise AssertionError(f"lora_forward differs from peft's LoRA layer ({where}){hint}")
        with torch.no_grad():
            layer.merge()
            merged = layer.base_layer.weight.tolist()
        got = _matrix_answer(lora_merge(w, a, b, alpha), d_out, d_in, f"lora_merge ({where})")
        if _far(got, merged, 1e-5) > 0:
            raise AssertionError(f"lora_merge's weight differs from peft's merged weight ({where}): the merged layer "
                                 "must compute what the adapted one did, with no adapter")


def _log_softmax(row: list[float]) -> list[float]:
    import math

    top = max(row)
    z = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - z for v in row]


def _distill_reference(s, t, labels, T, alpha):
    import math

    soft = hard = 0.0
    for srow, trow, y in zip(s, t, labels):
        ls, lt = _log_softmax([v / T for v in srow]), _log_softmax([v / T for v in trow])
        soft += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt))
        hard -= _log_softmax(srow)[y]
    n = len(s)
    return {"loss": alpha * T * T * soft / n + (1 - alpha) * hard / n, "soft": soft / n, "hard": hard / n}


def distill_cases(seed: int, n: int):
    """(student logits, teacher logits, labels, T, alpha): tokens x vocabulary, one case with logits
    in the hundreds (a softmax computed naively overflows)."""
    import random

    rng = random.Random(seed)
    cases = []
    for k in range(n):
        tokens, vocab = rng.randint(1, 6), rng.randint(2, 30)
        scale = 300.0 if k == 1 else rng.choice((1.0, 3.0))
        s = [[rng.gauss(0, scale) for _ in range(vocab)] for _ in range(tokens)]
        t = [[rng.gauss(0, scale) for _ in range(vocab)] for _ in range(tokens)]
        cases.append((s, t, [rng.randrange(vocab) for _ in range(tokens)], [1.0, 2.0, 4.0, 0.5, 8.0][k % 5],
                      [0.5, 0.9, 1.0, 0.0, 0.3][(k + seed) % 5]))
    return cases


def check_distill_loss(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(student_logits, teacher_logits, labels, T, alpha)`: Hinton et al.'s loss, the mean over
    tokens of alpha T^2 KL(teacher_T || student_T) + (1 - alpha) cross-entropy(student, label),
    computed here in plain Python (log-softmax with the maximum subtracted)."""
    import math

    for s, t, labels, T, alpha in distill_cases(seed, n):
        ref = _distill_reference(s, t, labels, T, alpha)
        where = f"{len(s)} tokens, {len(s[0])}-word vocabulary, T = {T:g}, alpha = {alpha:g}"
        got = fn([list(r) for r in s], [list(r) for r in t], list(labels), T, alpha)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"return the loss, a float ({where}); got {got!r}") from None
        if not math.isfinite(got):
            raise AssertionError(f"the loss is {got} ({where}, logits up to {max(abs(v) for r in s for v in r):.0f}): "
                                 "subtract each row's maximum before exponentiating")
        if abs(got - ref["loss"]) <= 1e-7 * max(1.0, abs(ref["loss"])):
            continue
        hint = ""
        if alpha and T != 1 and abs(got - (alpha * ref["soft"] + (1 - alpha) * ref["hard"])) <= 1e-7 * max(1.0, abs(got)):
            hint = ": the softened term is scaled by T^2, so that its gradients keep their size whichever T is chosen"
        else:
            rev = sum(sum(math.exp(a) * (a - b) for a, b in zip(_log_softmax([v / T for v in sr]), _log_softmax([v / T for v in tr])))
                      for sr, tr in zip(s, t)) / len(s)
            if alpha and abs(got - (alpha * T * T * rev + (1 - alpha) * ref["hard"])) <= 1e-7 * max(1.0, abs(got)):
                hint = ": the KL divergence is the teacher's distribution against the student's, KL(p_teacher || p_student)"
        raise AssertionError(f"loss {got:.6g}, expected {ref['loss']:.6g} ({where}){hint}")


def mask24_cases(seed: int, n: int):
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        rows, cols = rng.randint(1, 5), 4 * rng.randint(1, 6)
        cases.append([[rng.gauss(0, 1) * (30 if rng.random() < 0.05 else 1) for _ in range(cols)] for _ in range(rows)])
    return cases


def check_mask_2_4(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(w)` returns a mask (1 keep, 0 prune) of w's shape with exactly two of every four consecutive
    weights of a row kept: the two of largest magnitude."""
    for w in mask24_cases(seed, n):
        rows, cols = len(w), len(w[0])
        got = fn([list(r) for r in w])
        mask = _matrix_answer(got, rows, cols, f"the mask of a {rows} x {cols} matrix")
        if any(v not in (0.0, 1.0) for r in mask for v in r):
            raise AssertionError("the mask holds 1 (keep) and 0 (prune) only")
        for i, (wr, mr) in enumerate(zip(w, mask)):
            for g in range(0, cols, 4):
                kept = [j for j in range(g, g + 4) if mr[j]]
                if len(kept) != 2:
                    raise AssertionError(f"row {i}, weights {g}..{g + 3}: {len(kept)} kept; 2:4 keeps exactly two of "
                                         "every four (the sparse tensor cores' format)")
                dropped = [j for j in range(g, g + 4) if j not in kept]
                if min(abs(wr[j]) for j in kept) < max(abs(wr[j]) for j in dropped):
                    hint = (" (by magnitude: a large negative weight matters as much as a large positive one)"
                            if min(wr[j] for j in kept) >= max(wr[j] for j in dropped) else "")
                    raise AssertionError(f"row {i}, weights {g}..{g + 3} = {[round(wr[j], 3) for j in range(g, g + 4)]}: "
                                         f"you keep {[round(wr[j], 3) for j in kept]}, not the two largest{hint}")


def llm_int8_cases(seed: int, n: int):
    """(x, w, threshold): activations with a few outlier feature columns (as LLM.int8() found in
    every large model's hidden states), weights without; some cases with none over the threshold."""
    import random

    rng = random.Random(seed)
    cases = []
    for k in range(n):
        tokens, d_in, d_out = rng.randint(1, 6), rng.randint(4, 40), rng.randint(1, 12)
        x = [[rng.gauss(0, 1) for _ in range(d_in)] for _ in range(tokens)]
        if k % 4 != 3:
            for j in rng.sample(range(d_in), rng.randint(1, min(3, d_in - 1))):
                for row in x:
                    if rng.random() < 0.7:
                        row[j] = rng.choice((-1, 1)) * rng.uniform(15, 60)
        w = [[rng.gauss(0, 0.05) for _ in range(d_in)] for _ in range(d_out)]
        cases.append((x, w, 6.0))
    return cases


def check_int8_decomposition(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(x, w, threshold)` returns y = x w^T as LLM.int8() computes it: the input features (columns
    of x) with any |x| > threshold multiplied in full precision, the rest in INT8 with vector-wise
    absmax scales (one per row of x, one per row of w), integer products rescaled. Checked against
    the same computed here (`compression.llm_int8`), and told apart from all-INT8 and from no INT8."""
    from ..compression import llm_int8

    for x, w, threshold in llm_int8_cases(seed, n):
        where = f"x {len(x)} x {len(x[0])}, w {len(w)} x {len(w[0])}, threshold {threshold:g}"
        ref = llm_int8(x, w, threshold=threshold)
        got = _matrix_answer(fn([list(r) for r in x], [list(r) for r in w], threshold), len(x), len(w), f"y ({where})")
        if _far(got, ref["y"], 1e-5) <= 0:
            continue
        exact = [[sum(a * b for a, b in zip(xr, wr)) for wr in w] for xr in x]
        plain = llm_int8(x, w, threshold=float("inf"))["y"]
        outl = ref["outlier_columns"]
        if outl and _far(got, plain, 1e-5) <= 0:
            hint = (f"you quantized every column; columns {outl} hold |x| > {threshold:g} and must be multiplied in full "
                    "precision (their scale would crush every other value of the token to a few levels)")
        elif _far(got, exact, 1e-9) <= 0:
            hint = "that is the exact product: the columns under the threshold must go through INT8"
        else:
            hint = ("one absmax scale per row of x over the non-outlier columns, one per row of w over the same "
                    "columns, codes rounded to the nearest integer in [-127, 127]")
        raise AssertionError(f"y differs from LLM.int8()'s ({where}; outlier columns {outl}): {hint}")


def qlora_reference(linear_shapes, other_params: int, r: int) -> int:
    from ..compression import nf4_bytes

    return sum(nf4_bytes(o * i) + 16 * r * (o + i) for o, i in linear_shapes) + 2 * other_params


def check_qlora_bytes(fn: Callable, cases) -> None:
    """`fn(linear_shapes, other_params, r)`: QLoRA's resident bytes: every linear layer in bitsandbytes'
    NF4 with double quantization (as Params4bit stores it), the rest in bf16, and LoRA on every linear
    layer with fp32 adapters, their gradients and Adam's two moments."""
    from ..compression import nf4_bytes

    for shapes, other, r, what in cases:
        want = qlora_reference(shapes, other, r)
        got = fn([tuple(s) for s in shapes], other, r)
        lin = [o * i for o, i in shapes]
        hint = ""
        if isinstance(got, int) and not isinstance(got, bool) and got != want:
            off = got - want
            plain = sum(nf4_bytes(k, double_quant=False) - nf4_bytes(k) for k in lin)
            if off == plain:
                hint = "double quantization: the block absmaxes are themselves stored in 8 bits"
            elif off == -sum(1024 + 64 + 4 for _ in lin):
                hint = ("every quantized tensor also keeps its lookup tables (the 16 NF4 levels and the 256-entry map "
                        "of the 8-bit absmaxes, fp32) and the absmaxes' fp32 mean")
            elif off % len(shapes) == 0 and abs(off) < 4096 * len(shapes):
                hint = "count whole blocks: a tensor whose size is not a multiple of 64 still fills its last block"
            elif abs(off) == 8 * r * sum(o + i for o, i in shapes) or abs(off) == 4 * r * sum(o + i for o, i in shapes):
                hint = "each adapter value trains: fp32 weight, fp32 gradient and Adam's two fp32 moments"
        check_int(got, want, what=f"QLoRA r={r}, {what}", hint=hint, unit="bytes")



# ---------------------------------------------------------------------------- MoEfication (moe-*)
def moe_cases(seed: int, n: int, *, ties: bool = False):
    """(x, W1, b1, W2, groups, k, scores): a ReLU FFN y = W2 relu(W1 x + b1) of random shape, its
    neurons split into E groups (shuffled indices; equal sizes, or with `ties` uneven ones), k from 1
    to E (one case k = E), and router scores tokens x E; with `ties`, scores with repeated values
    (a tie between the k-th and the (k+1)-th group, and all-equal rows)."""
    import random

    rng = random.Random(seed)
    cases = []
    for c in range(n):
        d, tokens = rng.randint(1, 9), rng.randint(1, 6)
        experts = rng.randint(1, 6)
        if ties and c % 2:
            sizes = [rng.randint(1, 5) for _ in range(experts)]  # odd shapes: uneven groups
        else:
            sizes = [rng.randint(1, 4)] * experts
        neurons = sum(sizes)
        order = list(range(neurons))
        rng.shuffle(order)
        groups, at = [], 0
        for s in sizes:
            groups.append(sorted(order[at:at + s]))
            at += s
        k = experts if c == 0 else rng.randint(1, experts)
        x = [[rng.gauss(0, 1) for _ in range(d)] for _ in range(tokens)]
        w1 = [[rng.gauss(0, 1) for _ in range(d)] for _ in range(neurons)]
        b1 = [rng.gauss(0, 0.5) for _ in range(neurons)]
        w2 = [[rng.gauss(0, 1) for _ in range(neurons)] for _ in range(d)]
        scores = [[rng.gauss(0, 1) for _ in range(experts)] for _ in range(tokens)]
        if ties:
            for row in scores:
                if rng.random() < 0.3:
                    row[:] = [0.5] * experts  # every expert ties: the lowest indices win
                else:
                    a, b = rng.sample(range(experts), 2) if experts > 1 else (0, 0)
                    row[b] = row[a]
        cases.append((x, w1, b1, w2, groups, k, scores))
    return cases


def moe_topk(scores: list[float], k: int) -> list[int]:
    """The k experts a token uses: the highest scores, a tie going to the lower expert index."""
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k]


def moe_reference(x, w1, b1, w2, groups, k, scores, *, chosen=None) -> list[list[float]]:
    """y = sum over the neurons j of each token's top-k groups of W2[:, j] relu(W1[j] . x + b1[j])."""
    out = []
    for t, xt in enumerate(x):
        use = chosen[t] if chosen is not None else moe_topk(scores[t], k)
        y = [0.0] * len(w2)
        for e in use:
            for j in groups[e]:
                a = max(0.0, sum(w * v for w, v in zip(w1[j], xt)) + b1[j])
                for r in range(len(w2)):
                    y[r] += w2[r][j] * a
        out.append(y)
    return out


def check_moe_ffn(fn: Callable, *, seed: int = 0, n: int = 8, ties: bool = False) -> None:
    """`fn(x, W1, b1, W2, groups, k, scores)`: a MoEfied ReLU FFN (Zhang+22) on plain lists, each token's
    output computed from the neurons of its k highest-scoring groups only (ties: the lower index),
    against the same computed here; k = E must give the dense FFN."""
    for x, w1, b1, w2, groups, k, scores in moe_cases(seed, n, ties=ties):
        E = len(groups)
        where = (f"{len(x)} tokens, d = {len(x[0])}, {sum(map(len, groups))} neurons in {E} groups "
                 f"of {sorted({len(g) for g in groups})}, k = {k}")
        want = moe_reference(x, w1, b1, w2, groups, k, scores)
        got = _matrix_answer(fn([list(r) for r in x], [list(r) for r in w1], list(b1), [list(r) for r in w2],
                                [list(g) for g in groups], k, [list(r) for r in scores]), len(x), len(w2),
                             f"the output ({where})")
        if _far(got, want, 1e-7) <= 0:
            continue
        everyone = [list(range(E))] * len(x)
        dense = moe_reference(x, w1, b1, w2, groups, k, scores, chosen=everyone)
        lowest = [sorted(range(E), key=lambda e: (s[e], e))[:k] for s in scores]
        high_last = [sorted(range(E), key=lambda e: (-s[e], -e))[:k] for s in scores]
        batch = [sorted(range(E), key=lambda e: (-sum(s[e] for s in scores), e))[:k]] * len(x)
        first = [list(range(k))] * len(x)
        hint = ""
        if k < E and _far(got, dense, 1e-7) <= 0:
            hint = "you computed every neuron (the dense FFN): only the k groups with the highest scores count"
        elif _far(got, moe_reference(x, w1, b1, w2, groups, k, scores, chosen=lowest), 1e-7) <= 0:
            hint = "you kept the k lowest scores: the router's highest scores choose the experts"
        elif _far(got, moe_reference(x, w1, b1, w2, groups, k, scores, chosen=high_last), 1e-7) <= 0 \
                or _moe_other_tie(got, x, w1, b1, w2, groups, k, scores):
            hint = "equal scores: the tie goes to the lower expert index (a stable sort by descending score)"
        elif _far(got, moe_reference(x, w1, b1, w2, groups, k, scores, chosen=first), 1e-7) <= 0:
            hint = "the groups to use are the top-k by score, not the first k"
        elif len(x) > 1 and _far(got, moe_reference(x, w1, b1, w2, groups, k, scores, chosen=batch), 1e-7) <= 0:
            hint = "each token chooses its own k experts from its own row of scores, not one choice for the batch"
        elif k == E:
            hint = "with k = E every group is used: the output must be the dense FFN's, W2 relu(W1 x + b1)"
        else:
            hint = ("an expert is a group of neurons (indices into W1's rows, b1 and W2's columns): "
                    "relu(W1[j] . x + b1[j]) for each neuron j of the chosen groups, times W2's column j, summed")
        raise AssertionError(f"the MoEfied FFN's output differs from the reference ({where}): {hint}")


def _moe_other_tie(got, x, w1, b1, w2, groups, k, scores) -> bool:
    """Whether every token's output is that of *some* k highest-scoring groups (a tie broken another
    way than by the lower index)."""
    import itertools

    for t, s in enumerate(scores):
        kth = sorted(s, reverse=True)[k - 1]
        sure = [e for e in range(len(s)) if s[e] > kth]
        tied = [e for e in range(len(s)) if s[e] == kth]
        ok = False
        for pick in itertools.combinations(tied, k - len(sure)):
            ref = moe_reference([x[t]], w1, b1, w2, groups, k, [s], chosen=[sure + list(pick)])
            if _far([got[t]], ref, 1e-7) <= 0:
                ok = True
                break
        if not ok:
            return False
    return True


# ---------------------------------------------------------------------------- prefix tuning (prefix-*)
def prefix_reference(x, Wq, Wk, Wv, Wo, Pk, Pv, heads: int, *, prefix_mask: str = "all", through_proj: bool = False):
    """Causal self-attention of one sequence x (s x d, torch) with a learned prefix (Li & Liang 21;
    peft's PrefixTuning hands it as past_key_values): k = [Pk; x Wk^T], v = [Pv; x Wv^T]; query i
    sees every prefix position and the tokens 0..i. `prefix_mask` / `through_proj` build the
    plausible mistakes the check names."""
    import math

    import torch

    s, d = x.shape
    p, dh = Pk.shape[0], d // heads
    pk, pv = (Pk @ Wk.T, Pv @ Wv.T) if through_proj else (Pk, Pv)
    q = (x @ Wq.T).view(s, heads, dh).transpose(0, 1)
    k = torch.cat([pk, x @ Wk.T]).view(p + s, heads, dh).transpose(0, 1)
    v = torch.cat([pv, x @ Wv.T]).view(p + s, heads, dh).transpose(0, 1)
    i, j = torch.arange(s).view(s, 1), torch.arange(p + s).view(1, p + s)
    seen = {"all": (j < p) | (j - p <= i), "top-left": j <= i, "none": torch.ones(s, p + s, dtype=torch.bool)}[prefix_mask]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(dh)).masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, d) @ Wo.T


def prefix_cases(seed: int, n: int):
    """(x, Wq, Wk, Wv, Wo, Pk, Pv, heads, grad_out) as fp64 tensors: widths 2 to 48, 1 to 4 heads,
    2 to 8 tokens, 1 to 9 prefix tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        heads = [1, 2, 4, 3][k % 4]
        d = heads * int(torch.randint(2, 13, (1,), generator=g))
        s, p = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 10, (1,), generator=g))
        r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        out.append((r(s, d), *(r(d, d) / d ** 0.5 for _ in range(4)), r(p, d), r(p, d), heads, r(s, d)))
    return out


def prefix_count_reference(num_layers: int, num_virtual_tokens: int, kv_width: int, hidden: int | None) -> int:
    """peft's PrefixEncoder: an Embedding of p rows of L·2·d; with a hidden size H, the
    reparameterisation: Embedding p·d, Linear d->H, Tanh, Linear H->L·2·d (biases)."""
    L, p, d = num_layers, num_virtual_tokens, kv_width
    if hidden is None:
        return p * L * 2 * d
    return p * d + d * hidden + hidden + hidden * L * 2 * d + L * 2 * d


def check_prefix_attention(fn: Callable, *, seed: int = 0, n: int = 8) -> None:
    """`fn(x, Wq, Wk, Wv, Wo, Pk, Pv, heads, grad_out)` (lists) returns (out, dPk, dPv): the layer's
    output and the prefix's gradients for the upstream gradient `grad_out`, against
    `prefix_reference` and torch's autograd through it."""
    import torch

    for x, Wq, Wk, Wv, Wo, Pk, Pv, heads, gout in prefix_cases(seed, n):
        s, d = x.shape
        p = Pk.shape[0]
        where = f"{s} tokens, width {d}, {heads} heads, {p} prefix tokens"
        got = fn(*(t.tolist() for t in (x, Wq, Wk, Wv, Wo, Pk, Pv)), heads, gout.tolist())
        if not isinstance(got, (list, tuple)) or len(got) != 3:
            raise AssertionError(f"prefix_attention must return (out, dPk, dPv) ({where})")
        out = torch.tensor(_matrix_answer(got[0], s, d, f"prefix_attention's out ({where})"), dtype=torch.float64)
        rk, rv = Pk.clone().requires_grad_(True), Pv.clone().requires_grad_(True)
        want = prefix_reference(x, Wq, Wk, Wv, Wo, rk, rv, heads)
        if not torch.allclose(out, want.detach(), rtol=1e-6, atol=1e-8):
            hint = "it differs from the reference"
            for mask, proj, why in (("top-left", False, "every query must see all p prefix positions, then the tokens up "
                                     "to itself: shift the causal mask by p (key j is token j - p)"),
                                    ("none", False, "the tokens must stay causal: token i may not see the tokens after it"),
                                    ("all", True, "the prefix *is* the keys and values: do not pass it through Wk, Wv")):
                if torch.allclose(out, prefix_reference(x, Wq, Wk, Wv, Wo, Pk, Pv, heads, prefix_mask=mask,
                                                        through_proj=proj), rtol=1e-6, atol=1e-8):
                    hint = why
                    break
            raise AssertionError(f"prefix_attention's out ({where}): {hint}")
        (want * gout).sum().backward()
        for name, i, ref in (("dPk", 1, rk.grad), ("dPv", 2, rv.grad)):
            mine = torch.tensor(_matrix_answer(got[i], p, d, f"prefix_attention's {name} ({where})"), dtype=torch.float64)
            if not torch.allclose(mine, ref, rtol=1e-5, atol=1e-8):
                zero = " (all zero: does the gradient reach the prefix?)" if not mine.abs().max() else ""
                raise AssertionError(f"prefix_attention's {name} ({where}) differs from the gradient of sum(out * grad_out) "
                                     f"with respect to the prefix{zero}")


def check_prefix_count(fn: Callable, cases) -> None:
    """`fn(num_layers, num_virtual_tokens, kv_width, hidden)` against `prefix_count_reference`."""
    for L, p, d, H in cases:
        want = prefix_count_reference(L, p, d, H)
        got = fn(L, p, d, H)
        if H is not None and got == prefix_count_reference(L, p, d, None):
            hint = "with a hidden size the prefix comes from an embedding and a two-layer MLP: count their parameters"
        elif H is None and got == p * L * d:
            hint = "every layer gets keys *and* values"
        else:
            hint = "count every parameter peft's PrefixEncoder trains, weights and biases"
        check_int(got, want, what=f"prefix_trainable(num_layers={L}, p={p}, kv_width={d}, hidden={H})", hint=hint,
                  unit="parameters")


# ============================================================================ Adafactor
def _adafactor_cases(seed: int, n: int):
    import random

    rnd = random.Random(seed)
    cases = []
    for k in range(n):
        rows, cols = rnd.randint(1, 9), rnd.randint(1, 9)
        if k % 3 == 0:  # g^2 of rank one: the factored estimate is exact there (Shazeer & Stern 2018, sec. 3)
            a = [rnd.uniform(0.1, 2.0) for _ in range(rows)]
            b = [rnd.uniform(0.1, 2.0) for _ in range(cols)]
            grad = [[(ai * bj) ** 0.5 * rnd.choice((-1, 1)) for bj in b] for ai in a]
        else:
            grad = [[rnd.gauss(0, 1) * (50 if rnd.random() < 0.05 else 1) for _ in range(cols)] for _ in range(rows)]
        row = [rnd.uniform(0.0, 1.0) for _ in range(rows)] if k % 2 else [0.0] * rows
        col = [rnd.uniform(0.0, 1.0) for _ in range(cols)] if k % 2 else [0.0] * cols
        if k % 2 and rnd.random() < 0.5:
            row[0] = 0.0
        cases.append((grad, row, col, rnd.choice((0.0, 0.5, 0.9, 0.999))))
    return cases


def check_adafactor(adafactor_update: Callable, adafactor_estimate: Callable, adafactor_state_values: Callable,
                    *, seed: int = 0, n: int = 9, shapes: list | None = None) -> None:
    """Adafactor's factored second moment on plain lists. The references are computed here from the inputs:
    the running row and column means of g^2 (beta2 * old + (1 - beta2) * mean), the rank-one estimate
    R C^T / mean(R), exact whenever g^2 is of rank one, and the number of values a model's state holds."""
    for grad, row, col, beta2 in _adafactor_cases(seed, n):
        rows, cols = len(grad), len(grad[0])
        sq = [[g * g for g in r] for r in grad]
        ref_row = [beta2 * row[i] + (1 - beta2) * sum(sq[i]) / cols for i in range(rows)]
        ref_col = [beta2 * col[j] + (1 - beta2) * sum(sq[i][j] for i in range(rows)) / rows for j in range(cols)]
        out = adafactor_update([r[:] for r in grad], row[:], col[:], beta2)
        assert isinstance(out, (list, tuple)) and len(out) == 2, "adafactor_update must return (row, col)"
        got_row, got_col = _vector_answer(out[0], rows, "row"), _vector_answer(out[1], cols, "col")
        for what, got, ref in (("row", got_row, ref_row), ("col", got_col, ref_col)):
            bad = [i for i, (x, y) in enumerate(zip(got, ref)) if abs(x - y) > 1e-9 * max(1.0, abs(y))]
            assert not bad, (f"a {rows} x {cols} gradient, beta2 = {beta2}: {what}[{bad[0]}] is {got[bad[0]]:.6g}, "
                             f"the running mean of g^2 along the {'row' if what == 'row' else 'column'} gives "
                             f"{ref[bad[0]]:.6g}")
        mean_r = sum(ref_row) / rows
        est = _matrix_answer(adafactor_estimate(ref_row[:], ref_col[:]), rows, cols, "adafactor_estimate")
        for i in range(rows):
            for j in range(cols):
                want = ref_row[i] * ref_col[j] / mean_r if mean_r else 0.0
                assert abs(est[i][j] - want) <= 1e-9 * max(1.0, abs(want)), \
                    f"estimate[{i}][{j}] is {est[i][j]:.6g}; the factored second moment there is {want:.6g}"
        if beta2 == 0.0 and _rank_one(sq):  # no history: the estimate gives g^2 back exactly
            assert all(abs(est[i][j] - sq[i][j]) <= 1e-9 * max(1.0, sq[i][j]) for i in range(rows) for j in range(cols)), \
                "g^2 is of rank one here, where the factored estimate must equal g^2 exactly"
    import random

    rnd = random.Random(seed + 1)
    cases = shapes or [[(rnd.randint(1, 300),) if rnd.random() < 0.3 else
                        tuple(rnd.randint(1, 64) for _ in range(rnd.choice((2, 2, 3, 4)))) for _ in range(rnd.randint(1, 6))]
                       for _ in range(n)]
    for model in cases:
        want = 0
        for s in model:
            total = 1
            for d in s:
                total *= d
            want += total if len(s) < 2 else total // s[-1] + total // s[-2]
        check_int(adafactor_state_values([tuple(s) for s in model]), want,
                  what=f"values of Adafactor's second moment for tensors of shapes {[tuple(s) for s in model]}",
                  hint="torch.optim.Adafactor factors over the last two dimensions; a vector keeps its full v")


def _rank_one(m: list[list[float]]) -> bool:
    rows, cols = len(m), len(m[0])
    return all(abs(m[i][j] * m[0][0] - m[i][0] * m[0][j]) <= 1e-9 * max(1.0, abs(m[i][j] * m[0][0]))
               for i in range(rows) for j in range(cols))
