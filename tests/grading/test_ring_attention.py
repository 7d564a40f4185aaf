"""vramlab.grading.parallel's ring attention check (lab 3, exercise 4): the lab's solution passes on 2,
3 and 4 linked ranks; each usual mistake fails with one line that names it; the stub says it is not
implemented. Answers are the lab's solution cell, edited, handed over as the grader hands them."""

from __future__ import annotations

import pytest
import torch

from vramlab.grading import parallel as GP

from .conftest import answer, edited, solution

RING_ATTN = solution("lab03_parallelism", "ex4-solution")
SEND = "reqs = [dist.isend(kv, (rank + 1) % world_size), dist.irecv(nxt, (rank - 1) % world_size)]"


def _check(source: str, worlds=(2,)) -> None:
    GP.check_ring_attention(answer(source, "ring_attention"), worlds=worlds)


@pytest.mark.slow
def test_the_solution_passes_on_2_3_and_4_ranks():
    _check(RING_ATTN, worlds=(2, 3, 4))


def test_the_reference_and_the_exact_merge_agree_with_one_process():
    """The block-by-block reference with the right masks and merge is one process's causal attention;
    each mistake's variant differs from it (on random data)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = GP.causal_attention(q, k, v)
    assert torch.allclose(want, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    for world in (2, 3, 4):
        assert torch.allclose(torch.cat(GP.ring_attention_blocks(q, k, v, world), -2), want, rtol=1e-12, atol=1e-14)
        for variant, _ in GP._RING_ATTN_MISTAKES:
            assert not torch.allclose(torch.cat(GP.ring_attention_blocks(q, k, v, world, **variant), -2), want)


def _wrong(name: str, source: str, message: str, worlds=(3,)):
    return pytest.param(source, message, worlds, id=name)


NO_RESCALE = edited(RING_ATTN, "rescale = torch.exp(row_max - new_max)", "rescale = torch.ones_like(row_max)")
WRONG = [
    _wrong("own-unmasked", edited(RING_ATTN, "if src == rank:", "if False:"), "own block without the causal mask"),
    _wrong("earlier-masked", edited(RING_ATTN, "if src == rank:", "if src <= rank:"),
           "masks the earlier ranks' blocks too"),
    _wrong("later-used", edited(RING_ATTN, "if src <= rank:", "if True:"), "uses the blocks of later ranks"),
    # the running maximum kept but the output so far never rescaled: on 2 or 3 ranks the own block holds
    # every row's maximum once in a few hundred draws (and that answer is then right), on 4 practically never
    _wrong("no-rescale", NO_RESCALE, "without rescaling by the running maximum", worlds=(4,)),
    _wrong("own-max", edited(NO_RESCALE, "new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))",
                             "new_max = scores.amax(-1, keepdim=True)"), "without rescaling by the running maximum"),
    _wrong("deadlock", edited(RING_ATTN, SEND, "dist.send(kv, (rank + 1) % world_size)\n"
                                               "            dist.recv(nxt, (rank - 1) % world_size)"),
           r"every rank waits, none can go on \(a deadlock\).*blocking dist.send"),
    _wrong("all-gather", RING_ATTN + "\n\ndef ring_attention(q, k, v, rank, world_size):\n"
                                     "    ks = [torch.empty_like(k) for _ in range(world_size)]\n"
                                     "    dist.all_gather(ks, k)\n    return q\n",
           "dist.all_gather is not available here: a collective would hand every rank the whole sequence"),
    _wrong("one-step-too-many", edited(RING_ATTN, "if step < world_size - 1:", "if True:"),
           r"sent \d+ values in \d+ messages; a ring's rank sends world_size - 1 = 2 K/V blocks"),
    _wrong("wrong-direction", edited(RING_ATTN, SEND, SEND.replace("isend(kv, (rank + 1)", "isend(kv, (rank - 1)")
                                     .replace("irecv(nxt, (rank - 1)", "irecv(nxt, (rank + 1)")),
           r"rank 0 sent to rank\(s\) \[2\]: a ring sends every block to its successor"),
    _wrong("float32", edited(RING_ATTN, "return out / row_sum", "return (out / row_sum).float()"),
           "returned float32 values"),
]


@pytest.mark.slow
@pytest.mark.parametrize("source, message, worlds", WRONG)
def test_wrong_answers_fail_with_one_line_that_names_the_mistake(source, message, worlds):
    with pytest.raises(AssertionError, match=message) as err:
        _check(source, worlds=worlds)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)


@pytest.mark.slow
def test_the_stub_says_it_is_not_implemented():
    stub = "def ring_attention(q, k, v, rank, world_size):\n    raise NotImplementedError()\n"
    with pytest.raises(NotImplementedError):
        _check(stub)
