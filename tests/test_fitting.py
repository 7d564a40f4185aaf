"""vramlab.fitting: one definition of "fits", and the search for the largest batch that does."""

import pytest

import vramlab
from vramlab import estimate_training, fit, gpu, preset


def test_fit_and_largest_batch():
    spec = preset("gpt2")
    t4 = gpu("t4")
    r = fit(spec, t4, batch_size=4, seq_len=1024, precision="bf16-mixed")
    assert r.max_batch_size >= 1
    need = lambda b: fit(spec, t4, batch_size=b, seq_len=1024, precision="bf16-mixed").needed
    assert need(r.max_batch_size) <= t4.usable_bytes < need(r.max_batch_size + 1)  # the search finds the boundary
    # the terms: the estimate at batch 4 (T4: 8 MiB + 128 KiB cuBLAS workspaces), 3 %, the freed bf16 logits, the context
    est = estimate_training(spec, batch_size=4, seq_len=1024, precision="bf16-mixed", gpu=t4)
    assert r.estimate == est.total and r.margin == int(0.03 * est.total)
    assert r.fragmentation == 4 * 1024 * 50257 * 2 and r.needed == r.estimate + r.reserve
    assert t4.usable_bytes < t4.memory_bytes  # cudaMemGetInfo's total is below nvidia-smi's
    assert fit("llama-3.1-70b", "t4", seq_len=128).max_batch_size == 0
    assert "does NOT fit" in str(fit("llama-3.1-70b", "t4", seq_len=128))


@pytest.mark.parametrize("truth", [0, 1, 2, 7, 97, 104, 1000, 65536])
@pytest.mark.parametrize("start", [1, 16, 97, 120, 5000])
def test_largest_true_finds_the_boundary_with_few_probes(truth, start):
    from vramlab.fitting import largest_true

    calls = []

    def fits(n):
        calls.append(n)
        assert 1 <= n <= 65536, n
        return n <= truth

    assert largest_true(fits, start=start, limit=65536) == truth
    assert len(calls) <= 2 * 17 + 2  # galloping + bisection: logarithmic


def test_largest_batch_search_never_reports_its_cap_as_the_answer():
    f = vramlab.fit("gpt2", "h200", seq_len=8, max_search=500)
    assert f.capped and "more than 500" in str(f)
    assert not vramlab.fit("gpt2", "t4", seq_len=1024).capped


def test_explain_says_which_batch_its_terms_are_for():
    """fit() searches the largest batch but its terms are the asked batch's: explain() says both."""
    from vramlab.fitting import device_fit, fit

    f = fit("gpt2", "t4", batch_size=1, seq_len=1024, precision="bf16-mixed")
    head, *terms = f.explain().splitlines()
    assert f.batch_size == 1 and f.max_batch_size > 1
    assert head.strip() == f"needed at batch size 1 (the largest that fits is {f.max_batch_size}):"
    assert len(terms) == 5 and terms[-1].split()[:1] == ["="]
    at_max = fit("gpt2", "t4", batch_size=f.max_batch_size, seq_len=1024, precision="bf16-mixed")
    assert f"at batch size {f.max_batch_size} " in at_max.explain() and at_max.needed > f.needed
    plain = device_fit(10**9, "t4", largest_tensor=0)  # no batch known, none searched
    assert plain.explain().splitlines()[0].strip() == "needed at the batch size asked:"


# ----------------------------------------------------------------------------- gradient accumulation

def _needed(model, gpu_, m, n, **kw):
    """device_fit's terms at micro-batch m of a global batch n, from the estimate itself."""
    from vramlab.fitting import device_fit, fragmentation_bytes

    est = estimate_training(model, batch_size=m, accumulation_steps=-(-n // m), gpu=gpu_, **kw)
    return device_fit(est, gpu_, largest_tensor=fragmentation_bytes(model, batch_size=m, **kw)).fits


@pytest.mark.parametrize("model,gpu_name,n,kw", [
    ("gpt2", "t4", 96, dict(seq_len=1024, precision="bf16-mixed")),
    ("gpt2-medium", "rtx-3090", 60, dict(seq_len=512, precision="bf16-mixed")),
    ("llama-3.2-1b", "a100-40gb", 32, dict(seq_len=2048, precision="bf16-mixed", recompute="full")),
])
def test_largest_micro_batch_is_the_largest_divisor_that_fits(model, gpu_name, n, kw):
    from vramlab.fitting import largest_micro_batch

    r = largest_micro_batch(model, gpu_name, global_batch=n, **kw)
    m = r.micro_batch_size
    assert m >= 1 and n % m == 0 and r.accumulation_steps == n // m and r.last_micro_batch == m
    assert _needed(model, gpu(gpu_name), m, n, **kw) and r.fit.fits and r.fit.batch_size == m
    assert not any(_needed(model, gpu(gpu_name), d, n, **kw) for d in range(m + 1, n + 1) if n % d == 0)


def test_largest_micro_batch_with_a_remainder():
    from vramlab.fitting import largest_micro_batch

    kw = dict(seq_len=1024, precision="bf16-mixed")
    prime = largest_micro_batch("gpt2", "t4", global_batch=97, **kw)  # divisors 1 and 97 only
    assert prime.micro_batch_size == 1 and prime.accumulation_steps == 97
    r = largest_micro_batch("gpt2", "t4", global_batch=97, divisor=False, **kw)
    m, k = r.micro_batch_size, r.accumulation_steps
    assert m > 1 and k == -(-97 // m) and r.last_micro_batch == 97 - (k - 1) * m and 1 <= r.last_micro_batch <= m
    assert _needed("gpt2", gpu("t4"), m, 97, **kw) and not _needed("gpt2", gpu("t4"), m + 1, 97, **kw)
    assert f"{k} micro-batch(es) of {m} (the last of {r.last_micro_batch})" in str(r)


def test_largest_micro_batch_accounts_for_the_held_gradients():
    """With k > 1 every gradient stays under the later micro-batches: a micro-batch that fits alone
    (k = 1) may not fit with accumulation. A 1.3 B-parameter OPT on a 24 GB card: fp32 gradients are 5 GiB."""
    from vramlab.fitting import largest_micro_batch

    kw = dict(seq_len=512, precision="bf16-mixed", optimizer="sgd")
    alone = fit("opt-1.3b", "rtx-3090", **kw).max_batch_size
    r = largest_micro_batch("opt-1.3b", "rtx-3090", global_batch=4 * alone, **kw)
    held = fit("opt-1.3b", "rtx-3090", accumulation_steps=4, **kw).max_batch_size  # any k > 1 holds them
    assert alone >= 1 and 1 <= held < alone and r.micro_batch_size <= held


def test_largest_micro_batch_none_fits_and_bad_input():
    from vramlab.fitting import largest_micro_batch

    r = largest_micro_batch("llama-3.1-70b", "t4", global_batch=8, seq_len=128)
    assert r.micro_batch_size == 0 and r.accumulation_steps == 0 and not r.fit.fits and "not even" in str(r)
    for kw, match in [(dict(global_batch=0), "global_batch"), (dict(global_batch=2.5), "global_batch"),
                      (dict(global_batch=8, batch_size=2), "chooses batch_size"),
                      (dict(global_batch=8, accumulation_steps=2), "chooses accumulation_steps"),
                      (dict(global_batch=8, divisor="yes"), "divisor"), (dict(global_batch=8, seq_len=None), "seq_len"),
                      (dict(global_batch=8, colour=1), "does not take colour")]:
        with pytest.raises(ValueError, match=match):
            largest_micro_batch("gpt2", "t4", **{"seq_len": 128, **kw})
    with pytest.raises(ValueError, match="seq_len must be given"):
        largest_micro_batch("gpt2", "t4", global_batch=8)


@pytest.mark.parametrize("model, gpu, kw", [
    ("llama-3.2-1b", "h100-80gb", dict(precision="bf16-mixed", recompute="full")),
    ("llama-3.2-3b", "h100-80gb", dict(precision="bf16", recompute="full", batch_size=2)),
    ("t5-small", "t4", dict(precision="bf16-mixed")),
    ("llama-3.2-1b", "a100-40gb", dict(precision="bf16-mixed", attention="eager")),  # the s² scores
    ("mistral-7b", "h100-80gb", dict(mode="infer", batch_size=8)),
])
def test_longest_sequence_is_the_boundary_of_fit(model, gpu, kw):
    """The longest sequence fits by `fit`'s own verdict (its largest batch is at least the batch asked)
    and one token more does not: the search never answers past the estimator's boundary."""
    from vramlab.fitting import longest_sequence

    r = longest_sequence(model, gpu, **kw)
    b, mode = kw.get("batch_size", 1), kw.get("mode", "train")
    opts = {k: v for k, v in kw.items() if k not in ("batch_size", "mode")}
    assert 0 < r.seq_len < r.limit and not r.capped
    assert fit(model, gpu, batch_size=b, mode=mode, seq_len=r.seq_len, **opts).max_batch_size >= b
    assert fit(model, gpu, batch_size=b, mode=mode, seq_len=r.seq_len + 1, **opts).max_batch_size < b


def test_longest_sequence_capped_by_positions_and_none_fits():
    from vramlab.fitting import longest_sequence

    r = longest_sequence("gpt2", "h100-80gb", precision="bf16-mixed")
    assert r.capped and r.seq_len == r.limit == 1024 and "positions stop it" in str(r)
    none = longest_sequence("llama-3.1-8b", "t4", precision="bf16-mixed")
    assert none.seq_len == 0 and "not even one token" in str(none)
    with pytest.raises(ValueError, match="chooses seq_len itself"):
        longest_sequence("gpt2", "t4", seq_len=8)
    with pytest.raises(ValueError, match="does not take"):
        longest_sequence("gpt2", "t4", colour="red")


def test_a_mixture_of_experts_fits_for_inference_and_training():
    from vramlab.fitting import longest_sequence

    f = fit("mixtral-8x7b", "h200", batch_size=1, mode="infer", seq_len=4096)
    assert f.fits and f.max_batch_size >= 1
    nxt = fit("mixtral-8x7b", "h200", batch_size=f.max_batch_size + 1, mode="infer", seq_len=4096)
    assert not nxt.fits
    assert longest_sequence("mixtral-8x7b", "h200", mode="infer").seq_len > 0
    # training (estimate_training's MoE ledger): the same fit, searched with it, DeepSeek-V2's included
    t = fit("olmoe-1b-7b", "h200", batch_size=1, seq_len=2048, precision="bf16-mixed", recompute="full",
            capacity_factor=1.25)
    assert t.fits and not fit("olmoe-1b-7b", "h200", batch_size=t.max_batch_size + 1, seq_len=2048,
                              precision="bf16-mixed", recompute="full", capacity_factor=1.25).fits
    assert not fit("mixtral-8x7b", "h200", seq_len=4096, precision="bf16-mixed").fits  # 16 bytes a parameter
    assert fit("deepseek-v2-lite", "h200", seq_len=4096, precision="bf16-mixed").max_batch_size >= 0
