"""Lab 2's check (collectives): the student's ring all-reduce, run on ranks that can reach each other
only through the check's process (`run.Switchboard`), where the ready-made collectives raise.
dist.send/isend/recv/irecv go through the link to the process that called check_ring_all_reduce (the
grader, or the student's kernel when they check themselves), which delivers them and logs what each
rank sent; it computes the expected sum itself and checks the result and the traffic: 2(n-1)
messages to one neighbour, each the partial sum a ring would hold at that step. The ranks run
`programs/ring.py`."""

from __future__ import annotations

from typing import Any, Callable

from .run import answer_source, fresh_generator, run_world


def _ring_inputs(world: int, numel: int) -> list[list[float]]:
    """Each rank's numbers: random integers (exact in float64 whatever the order of the additions),
    drawn afresh for every grading, so that no rank can know another's without receiving it."""
    import torch

    return torch.randint(-2**20, 2**20 + 1, (world, numel), generator=fresh_generator()).double().tolist()


def _ring_problem(report: Any, rank: int, world: int, numel: int, inputs: list[list[float]]) -> str | None:
    """What is wrong with one rank's result and traffic, or None. Expected values computed here from
    the numbers dealt to the ranks: the sum over ranks, and each message a partial sum over the set of
    ranks a ring has added at that step, on some contiguous stretch of indices."""
    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    got = report.get("result")
    expected = [sum(col) for col in zip(*inputs)]
    if not isinstance(got, list) or len(got) != numel:
        return f"returned {len(got) if isinstance(got, list) else 'no'} elements, expected {numel}"
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if bad:
        return (f"wrong result at positions {bad[:5]}: got {got[:6]}..., expected {expected[:6]}... (the sum of "
                "every rank's tensor)")
    sent = report.get("log")
    steps = 2 * (world - 1)
    if not isinstance(sent, list) or len(sent) != steps:
        return (f"sent {len(sent) if isinstance(sent, list) else 0} messages with dist.send/isend; a ring sends "
                f"2(n-1) = {steps}, one chunk per step")
    peers = {m[0] for m in sent if isinstance(m, list) and len(m) == 2}
    if len(peers) != 1 or next(iter(peers)) not in ((rank + 1) % world, (rank - 1) % world):
        return f"sent to ranks {sorted(peers, key=str)}: a ring sends every message to one neighbour"
    direction = 1 if next(iter(peers)) == (rank + 1) % world else -1
    biggest = -(-numel // world)
    for step, (_, values) in enumerate(sent):
        if not isinstance(values, list) or len(values) > biggest:
            return f"message {step + 1} holds {len(values) if isinstance(values, list) else '?'} elements: a ring sends chunks of at most ceil(N/n) = {biggest}"
        ranks = {(rank - direction * j) % world for j in range(min(step, world - 1) + 1)} if step < world - 1 else set(range(world))
        partial = [sum(inputs[r][i] for r in ranks) for i in range(numel)]
        if values and not any(values == partial[k:k + len(values)] for k in range(numel - len(values) + 1)):
            phase = "reduce-scatter" if step < world - 1 else "all-gather"
            return (f"message {step + 1} ({phase}) is not the partial sum of ranks {sorted(ranks)} that a ring "
                    "holds at that step")
    return None


def check_ring_all_reduce(fn: Callable, *, cases=((2, 8), (3, 10)), timeout: float = 60.0) -> None:
    """Run the student's `fn(tensor, rank, world_size)` on 2 and 3 ranks (processes of this machine,
    linked through this one: `run.Switchboard`), with the ready-made collectives unavailable, and check
    each rank's result against the sum computed here and its traffic against a ring's. `cases` are
    (ranks, elements); element counts that the rank count does not divide are the usual bug."""
    import tempfile

    source, name = answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (world, numel) in enumerate(cases):
            inputs = _ring_inputs(world, numel)
            reports = run_world("ring", world, numel, source=source, names=[name], tmp=f"{tmp}/case{i}", dealt=inputs,
                                log="ring", timeout=timeout, on_timeout=(
                                    f"{world} ranks, {numel} elements: no answer within {timeout:.0f} s. A blocking "
                                    "send waits for its matching recv: post the receive with dist.irecv (or alternate "
                                    "the order by rank parity) before waiting on the send."))
            problems = []
            for rank in range(world):
                why = _ring_problem(reports[rank], rank, world, numel, inputs)
                if why:
                    problems.append(f"rank {rank}: {why}")
            if problems:
                hint = (" Hint: when the rank count does not divide the length, split with torch.tensor_split"
                        " (chunks of unequal size) and send each chunk's own size." if numel % world else
                        " Hint: n-1 reduce-scatter steps (send chunk (rank - step), add what arrives), then n-1"
                        " all-gather steps (forward the completed chunk), each to rank + 1, from rank - 1.")
                raise AssertionError(f"ring all-reduce on {world} ranks, {numel} elements: {problems[0]}.{hint}")

