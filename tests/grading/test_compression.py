"""vramlab.grading.compression: lab 8's checks compute their references from the inputs they draw.
The lab's solutions pass; plausible mistakes fail (one scale for the whole matrix; a 2:4 mask that
keeps the smallest values)."""

from __future__ import annotations

import pytest

from vramlab.grading.compression import check_mask_2_4, check_row_int8

from .conftest import _function, solution

LAB = "lab08_compression"
INT8 = solution(LAB, "ex1-solution")
MASK = _function(solution(LAB, "ex5-solution"), "mask_2_4")


def _int8(source):
    return [_function(source, n) for n in ("quantize_rows", "dequantize_rows", "row_int8_bytes")]


def test_the_solutions_pass():
    check_row_int8(*_int8(INT8), seed=2, n=6)
    check_mask_2_4(MASK, seed=2, n=6)


def test_a_mask_that_keeps_the_smallest_values_fails():
    def smallest(w):
        out = []
        for row in w:
            mask = []
            for i in range(0, len(row), 4):
                group = row[i:i + 4]
                keep = sorted(range(len(group)), key=lambda j: abs(group[j]))[:2]
                mask += [1 if j in keep else 0 for j in range(len(group))]
            out.append(mask)
        return out

    with pytest.raises(AssertionError):
        check_mask_2_4(smallest, seed=2, n=6)


def test_int8_bytes_without_the_scales_fail():
    q, dq, nbytes = _int8(INT8)
    with pytest.raises(AssertionError):
        check_row_int8(q, dq, lambda rows, cols: rows * cols, seed=2, n=6)


# ---------------------------------------------------------------------------- MoEfication (moe-*)
def _moe_answer(choose):
    """A MoEfied FFN whose experts are `choose(scores_of_token, k, E)`."""
    def fn(x, W1, b1, W2, groups, k, scores):
        out = []
        for xt, st in zip(x, scores):
            y = [0.0] * len(W2)
            for e in choose(st, k, len(groups)):
                for j in groups[e]:
                    a = max(0.0, sum(w * v for w, v in zip(W1[j], xt)) + b1[j])
                    for r in range(len(W2)):
                        y[r] += W2[r][j] * a
            out.append(y)
        return out
    return fn


def test_the_moe_solution_passes_and_all_experts_are_the_dense_ffn():
    from vramlab.grading.compression import check_moe_ffn, moe_cases, moe_reference

    moe = _function(solution(LAB, "moe-solution"), "moe_ffn")
    check_moe_ffn(moe, seed=2, n=6)
    check_moe_ffn(moe, seed=61, n=16, ties=True)  # the hidden cases: ties, uneven groups
    for x, w1, b1, w2, groups, k, scores in moe_cases(5, 6):
        dense = [[sum(w2[r][j] * max(0.0, sum(a * b for a, b in zip(w1[j], xt)) + b1[j]) for j in range(len(w1)))
                  for r in range(len(w2))] for xt in x]
        got = moe_reference(x, w1, b1, w2, groups, len(groups), scores)
        assert all(abs(a - b) <= 1e-9 * (1 + abs(b)) for ra, rb in zip(got, dense) for a, b in zip(ra, rb))


@pytest.mark.parametrize("choose, ties, says", [
    (lambda s, k, E: range(E), False, "every neuron"),
    (lambda s, k, E: sorted(range(E), key=lambda e: (s[e], e))[:k], False, "lowest scores"),
    (lambda s, k, E: sorted(range(E), key=lambda e: (-s[e], -e))[:k], True, "lower expert index"),
    (lambda s, k, E: range(k), False, "not the first k"),
])
def test_moe_mistakes_fail_with_their_reason(choose, ties, says):
    from vramlab.grading.compression import check_moe_ffn

    with pytest.raises(AssertionError, match=says):
        check_moe_ffn(_moe_answer(choose), seed=61 if ties else 3, n=16, ties=ties)


# ---------------------------------------------------------------------------- prefix tuning (prefix-*)
def _prefix_answer(mask: str = "all", through_proj: bool = False, detach: bool = False):
    """A prefix_attention built on the reference with one plausible mistake."""
    import torch

    from vramlab.grading.compression import prefix_reference

    def fn(x, Wq, Wk, Wv, Wo, Pk, Pv, heads, grad_out):
        t = [torch.tensor(v, dtype=torch.float64) for v in (x, Wq, Wk, Wv, Wo)]
        pk, pv = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (Pk, Pv))
        out = prefix_reference(*t, pk.detach() if detach else pk, pv.detach() if detach else pv, heads,
                               prefix_mask=mask, through_proj=through_proj)
        if detach:
            return out.tolist(), torch.zeros_like(pk).tolist(), torch.zeros_like(pv).tolist()
        (out * torch.tensor(grad_out, dtype=torch.float64)).sum().backward()
        return out.tolist(), pk.grad.tolist(), pv.grad.tolist()
    return fn


def test_the_prefix_solution_passes_and_its_count_is_peft_s():
    from vramlab import compression as C
    from vramlab.grading.compression import check_prefix_attention, check_prefix_count, prefix_count_reference

    src = solution(LAB, "prefix-solution")
    check_prefix_attention(_function(src, "prefix_attention"), seed=2, n=6)
    check_prefix_attention(_function(src, "prefix_attention"), seed=37, n=12)  # the hidden cases
    check_prefix_count(_function(src, "prefix_trainable"), [(12, 20, 768, None), (24, 30, 1024, 512)])
    # the check's own formula is peft's count (tests/test_prompt_tuning.py holds that against peft)
    for p, proj in ((20, False), (5, True)):
        kw = dict(prefix_projection=True, encoder_hidden_size=512) if proj else {}
        assert prefix_count_reference(12, p, 768, 512 if proj else None) == \
            C.prompt_params("mt5-base", method="prefix", num_virtual_tokens=p, **kw)


@pytest.mark.parametrize("answer, says", [
    (_prefix_answer(mask="top-left"), "shift the causal mask by p"),
    (_prefix_answer(mask="none"), "must stay causal"),
    (_prefix_answer(through_proj=True), "do not pass it through Wk"),
    (_prefix_answer(detach=True), "does the gradient reach the prefix"),
])
def test_prefix_mistakes_fail_with_their_reason(answer, says):
    from vramlab.grading.compression import check_prefix_attention

    with pytest.raises(AssertionError, match=says):
        check_prefix_attention(answer, seed=3, n=8)


@pytest.mark.parametrize("count, says", [
    (lambda L, p, d, H: p * L * 2 * d, "embedding and a two-layer MLP"),
    (lambda L, p, d, H: p * L * d if H is None else 0, "keys \\*and\\* values"),
    (lambda L, p, d, H: p * L * 2 * d if H is None else p * d + d * H + H * L * 2 * d, "weights and biases"),
])
def test_prefix_count_mistakes_fail(count, says):
    from vramlab.grading.compression import check_prefix_count

    with pytest.raises(AssertionError, match=says):
        check_prefix_count(count, [(12, 20, 768, None), (2, 5, 64, 32)])
