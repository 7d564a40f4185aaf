"""Lab 1's exercise 7: a paged KV cache's admission. The check's reference (`paged_admission`)
against an independent model of the pool -- every block named by its contents, as vLLM's prefix cache hashes
a full block with the blocks before it, a partly filled block each request's own -- on random queues; the
lab's solution passes; each usual mistake fails with its own explanation."""

from __future__ import annotations

import random

import pytest

from vramlab.grading.memory import (ADMISSION_EXAMPLES, ADMISSION_MISTAKES, admission_cases, check_admission,
                                    paged_admission)

from .conftest import _function, solution

ADMIT = _function(solution("lab01_where_memory_goes", "serve-solution"), "admit")


def _pool_model(requests, *, num_blocks, block_size, shared_prefix):
    """Blocks as sets of names: a request's tokens are the system prompt's ("s", i) then its own ("r", k, i);
    a full block is named by every token up to its end (the chain vLLM hashes), a partial block is unique."""
    pool: set = set()
    running = 0
    for k, (prompt, new) in enumerate(requests):
        tokens = [("s", i) for i in range(shared_prefix)] + [("r", k, i) for i in range(prompt + new - shared_prefix)]
        names = set()
        for start in range(0, len(tokens), block_size):
            chunk = tokens[start:start + block_size]
            names.add(tuple(tokens[:start + block_size]) if len(chunk) == block_size else ("partial", k))
        if len(pool | names) > num_blocks:
            break
        pool |= names
        running += 1
    return running, len(pool)


def test_the_reference_is_the_pool_counted_block_by_block():
    assert [paged_admission(**c) for c in ADMISSION_EXAMPLES] == [(3, 24), (4, 26)]  # worked by hand in the comment
    for seed in range(20):
        for case in admission_cases(seed, 4):
            assert paged_admission(**case) == _pool_model(**case), case
    rng = random.Random(5)
    for _ in range(200):  # queues the grader does not draw: one-token requests, prompts that are all system prompt
        B = rng.choice((1, 2, 16))
        prefix = rng.randint(0, 40)
        case = dict(requests=[(prefix + rng.randint(0, 30), rng.randint(0, 20)) for _ in range(rng.randint(1, 6))],
                    num_blocks=rng.randint(0, 60), block_size=B, shared_prefix=prefix)
        assert paged_admission(**case) == _pool_model(**case), case


def test_every_grading_tells_every_mistake_apart():
    for seed in range(50):
        queues = list(ADMISSION_EXAMPLES) + admission_cases(seed, 6)
        for kw, _ in ADMISSION_MISTAKES:
            assert any(paged_admission(**c, **kw) != paged_admission(**c) for c in queues), (seed, kw)


def test_the_labs_solution_passes():
    check_admission(ADMIT)
    for seed in range(5):
        check_admission(ADMIT, cases=(), n=12, seed=seed)


@pytest.mark.parametrize("kw, match", [(kw, why[:40]) for kw, why in ADMISSION_MISTAKES])
def test_each_mistake_is_named(kw, match):
    def wrong(requests, *, num_blocks, block_size, shared_prefix=0):
        return paged_admission(requests, num_blocks=num_blocks, block_size=block_size, shared_prefix=shared_prefix,
                               **kw)

    with pytest.raises(AssertionError, match=match.replace("(", r"\(").replace(")", r"\)")):
        check_admission(wrong, seed=3)


def test_answers_of_the_wrong_kind_and_a_stub():
    with pytest.raises(AssertionError, match="return two ints"):
        check_admission(lambda r, **k: 3)
    with pytest.raises(AssertionError, match="return two ints"):
        check_admission(lambda r, **k: (3.0, 24))
    with pytest.raises(AssertionError, match=r"returned \(0, 0\), expected \(3, 24\)"):
        check_admission(lambda r, **k: (0, 0))

    def stub(requests, **kw):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check_admission(stub)
