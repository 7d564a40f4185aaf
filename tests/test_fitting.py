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
