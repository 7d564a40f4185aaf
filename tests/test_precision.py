"""Formats against torch.finfo; rounding, update survival and loss scales against doing the
operation in that dtype; the dynamic loss scaler against torch.amp.GradScaler."""

import math
import random

import pytest

from vramlab import precision as P

torch = pytest.importorskip("torch")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", DTYPES)
def test_format_table_matches_finfo(name):
    f, fi = P.FORMATS[name], torch.finfo(DTYPES[name])
    assert f.bits == fi.bits
    assert f.max == fi.max
    assert f.smallest_normal == fi.smallest_normal
    assert f.eps == fi.eps
    assert f.smallest_subnormal == 2.0 ** (math.log2(fi.smallest_normal) - f.mantissa_bits)
    assert torch.tensor(f.smallest_subnormal, dtype=torch.float64).to(DTYPES[name]).item() == f.smallest_subnormal
    assert torch.tensor(f.smallest_subnormal / 4, dtype=torch.float64).to(DTYPES[name]).item() == 0


def test_tf32_and_int8():
    tf32, fp32 = P.FORMATS["tf32"], P.FORMATS["fp32"]
    assert tf32.smallest_normal == fp32.smallest_normal and math.isclose(tf32.max, fp32.max, rel_tol=1e-3)
    # fp32's range, fp16's precision
    assert P.FORMATS["tf32"].eps == P.FORMATS["fp16"].eps
    assert P.FORMATS["int8"].max == torch.iinfo(torch.int8).max


def _samples(rng, f):
    lo, hi = math.log2(f.smallest_subnormal) - 1, math.log2(f.max)
    return [rng.choice([-1, 1]) * 2 ** rng.uniform(lo, hi) for _ in range(3000)]


@pytest.mark.parametrize("name", DTYPES)
def test_rounding_matches_casts(name):
    f, d = P.FORMATS[name], DTYPES[name]
    rng = random.Random(0)
    xs = _samples(rng, f) + [f.max, f.smallest_normal, f.smallest_subnormal, f.smallest_subnormal / 2 * 1.001]
    # training casts fp32 tensors: start from fp32 values (torch casts fp64 via fp32, rounding twice)
    xs = [P.round_to(x, "fp32") for x in xs]
    got = [P.round_to(x, f) for x in xs]
    ref = torch.tensor(xs, dtype=torch.float32).to(d).to(torch.float64).tolist()
    assert got == ref


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_update_survival_agrees_with_arithmetic(name):
    d = DTYPES[name]
    rng = random.Random(1)
    for _ in range(2000):
        w = rng.uniform(-2, 2)
        lr, g = 10 ** rng.uniform(-6, -2), rng.choice([-1, 1]) * 10 ** rng.uniform(-6, 1)
        wt = torch.tensor(w, dtype=torch.float64).to(d)
        ut = torch.tensor(lr * g, dtype=torch.float64).to(d)
        assert P.update_survives(w, lr, g, name) == bool(wt - ut != wt), (w, lr, g)
    # the seeds' story: a typical small update vanishes in fp16 and bf16, survives in fp32
    assert not P.update_survives(1.0, 1e-4, 1e-3, "fp16") and not P.update_survives(1.0, 1e-4, 1e-3, "bf16")
    assert P.update_survives(1.0, 1e-4, 1e-3, "fp32")


def test_min_loss_scale_agrees_with_casting():
    rng = random.Random(2)
    for _ in range(300):
        g = 10 ** rng.uniform(-12, -3)
        s = P.min_loss_scale(g)
        cast = lambda v: torch.tensor(v, dtype=torch.float64).to(torch.float16).item()  # noqa: E731
        assert cast(g * s) != 0 and (s == 1 or cast(g * s / 2) == 0)
        assert s & (s - 1) == 0  # a power of two
    assert P.min_loss_scale(1e-3) == 1
    with pytest.raises(ValueError):
        P.min_loss_scale(0.0)


def test_dynamic_scaler_matches_gradscaler():
    rng = random.Random(3)
    flags = [rng.random() < 0.3 for _ in range(40)]
    ours = P.DynamicLossScaler(scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    for inf in flags:
        opt.zero_grad()
        loss = (p * (float("inf") if inf else 1.0)).sum()
        theirs.scale(loss).backward()
        before = p.detach().clone()
        theirs.step(opt)
        theirs.update()
        took = ours.update(inf)
        assert took == (not torch.equal(before, p.detach()) or not inf)
        assert ours.scale == theirs.get_scale()
    assert ours.skipped_steps == sum(flags)


def test_recipes():
    assert P.RECIPES["zero-paper"].total == 16 and P.RECIPES["amp-fp16"].total == 16
    assert P.RECIPES["pure-bf16-fp32-states"].total == 12 and P.RECIPES["pure-bf16"].total == 8
    with pytest.raises(ValueError):
        P.fmt("fp4")


@pytest.mark.parametrize("recipe, precision", [
    ("fp32", "fp32"), ("amp-fp16", "fp16-mixed"), ("amp-bf16", "bf16-mixed"), ("pure-bf16", "bf16"),
    ("pure-bf16-fp32-states", "bf16-fp32-states"), ("zero-paper", "fp16-fp32-master")])
def test_recipe_ledgers_agree_with_the_estimator(recipe, precision):
    """Chapter 5's ledger (precision.RECIPES) and chapter 1's (memory.model_states) are typed separately:
    they must give the same model-state bytes per parameter."""
    from vramlab.memory import model_states
    from vramlab.specs import preset

    spec = preset("gpt2")
    st = model_states(spec, precision=precision, optimizer="adamw")
    r = P.RECIPES[recipe]
    assert (st.parameters, st.gradients, st.optimizer_states) == (
        r.weights * spec.params, r.gradients * spec.params, (r.master_weights + r.optimizer_states) * spec.params)


def test_round_to_matches_torch_casts_including_overflow():
    """e4m3fn has no infinity: torch saturates to +-448 (was: inf); e5m2 and fp16 overflow to inf."""
    torch = pytest.importorskip("torch")
    from vramlab.precision import round_to

    dtypes = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2, "fp16": torch.float16,
              "bf16": torch.bfloat16}
    for name, dt in dtypes.items():
        for v in (500.0, -500.0, 1e5, 460.0, 70000.0, 3e-8, 1e-3, 0.1, float("inf"), float("-inf")):
            expected = torch.tensor(v).to(dt).float().item()
            assert round_to(v, name) == expected, (name, v, round_to(v, name), expected)


@pytest.mark.parametrize("call", ["min_loss_scale(float('nan'))", "min_loss_scale(float('inf'))", "round_to('x', 'fp16')",
                                  "round_to(1.0, 'fp7')", "min_loss_scale(True)"])
def test_precision_rejects_what_it_cannot_answer(call):
    from vramlab.precision import min_loss_scale, round_to  # noqa: F401

    with pytest.raises(ValueError):
        eval(call)
