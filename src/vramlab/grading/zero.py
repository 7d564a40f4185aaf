"""Lab 4's checks (ZeRO): the student's ZeRO-1 step and ZeRO-2 gradient partitioning, run on ranks
that reach each other only through the check's process (`run.Switchboard`), which logs every
collective a rank calls; the ranks run `programs/zero1.py` and `programs/zero2.py`. Every expected
value is computed here, from data drawn here afresh for every grading (each rank is dealt only its
own)."""

from __future__ import annotations

from typing import Any, Callable

from .parallel import as_tensor, bucket_values, check_mlp_ranks, launch_problem, tclose
from .run import answer_source, fresh_generator, run_world

# ZeRO-1: every rank holds the whole flat parameter vector (drawn from ZERO1_SEED, the same on every
# rank and here) and is dealt its own gradients (drawn here, different on every rank and step); the
# student's step must average the gradients, update only this rank's shard with AdamW (its states the
# shard's size), and all-gather the updated shards into the parameters. Point-to-point and object
# collectives raise; the switchboard logs every collective a rank calls. The check runs
# torch.optim.AdamW on one process with the averaged gradients and compares every rank's parameters
# after each step.
ZERO1_HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ZERO1_SEED = 7


def _zero1_grads(numel: int, steps: int, world: int) -> list:
    """Every rank's gradients at every step ([rank][step] -> numel floats), drawn afresh for every
    grading: each rank is dealt only its own, so the average needs the others'."""
    import torch

    g = fresh_generator()
    return [[torch.randn(numel, generator=g, dtype=torch.float64).tolist() for _ in range(steps)] for _ in range(world)]


def _zero1_expected(numel: int, steps: int, world: int, grads: list) -> list:
    """torch.optim.AdamW on one process, fed the ranks' averaged gradients: the parameters after each step."""
    import torch

    params = torch.randn(numel, generator=torch.Generator().manual_seed(ZERO1_SEED), dtype=torch.float64)
    p = torch.nn.Parameter(params.clone())
    opt = torch.optim.AdamW([p], **ZERO1_HYPER, foreach=False)
    out = []
    for k in range(steps):
        p.grad = torch.tensor([grads[r][k] for r in range(world)], dtype=torch.float64).mean(0)
        opt.step()
        out.append(p.detach().clone())
    return out


def _zero1_problem(report: Any, numel: int, world: int, expected: list) -> str | None:
    import torch

    if not isinstance(report, dict):
        return "no result (the rank did not finish)"
    if report.get("error"):
        return f"raised {str(report['error'])[:300]}"
    result = report.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("history"), list):
        return "returned nothing usable"
    calls = report.get("log") or []
    if "all_gather_into_tensor" not in calls and "all_gather" not in calls:
        return "never all-gathered: each rank must update only its shard and gather the others' updated shards"
    shard = -(-numel // world)
    if result.get("state_numel", 0) > 2 * shard + 16:
        return (f"keeps {result['state_numel']} optimizer-state values (counted over everything the rank holds "
                f"after its steps: tensors, lists of floats, arrays, however kept); ZeRO-1 keeps only its shard's m "
                f"and v (2 x {shard})")
    for k, (got, want) in enumerate(zip(result["history"], expected)):
        got = torch.tensor(got, dtype=torch.float64)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            return (f"after step {k + 1} the parameters differ from one process's AdamW on the averaged gradients "
                    f"(lr={ZERO1_HYPER['lr']}, betas={ZERO1_HYPER['betas']}, eps={ZERO1_HYPER['eps']}, "
                    f"weight_decay={ZERO1_HYPER['weight_decay']}; bias-corrected, decoupled weight decay)")
    if len(result["history"]) != len(expected):
        return "did not run every step"
    return None


def check_zero1(fn: Callable, *, cases=((2, 64, 3),), timeout: float = 60.0) -> None:
    """Run the student's `fn(params, grads, state, rank, world_size)` (one ZeRO-1 step, in place on
    `params`) for several steps on linked ranks (`run.Switchboard`) and check every rank's parameters
    after each step against torch.optim.AdamW on one process with the averaged gradients, and that the
    optimizer state it keeps is its shard's. `cases` are (ranks, elements, steps)."""
    import tempfile

    source, name = answer_source(fn)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (world, numel, steps) in enumerate(cases):
            grads = _zero1_grads(numel, steps, world)
            reports = run_world("zero1", world, {"numel": numel, "steps": steps, "seed": ZERO1_SEED}, source=source,
                                names=[name], tmp=f"{tmp}/case{i}", dealt=grads, log="names", timeout=timeout,
                                on_timeout=f"{world} ranks: no answer within {timeout:.0f} s (a rank waits for a "
                                           "collective another never calls?)")
            expected = _zero1_expected(numel, steps, world, grads)
            for rank in range(world):
                why = _zero1_problem(reports[rank], numel, world, expected)
                if why:
                    raise AssertionError(f"ZeRO-1 step on {world} ranks, {numel} parameters: rank {rank} {why}.")


# ZeRO-2's backward (Rajbhandari+20 §5.2): the MLP of the bucketed DDP check; the harness's own hooks
# log, when each gradient is ready, which other parameters still hold a gradient; after the backward
# and after finish() it logs them again and counts the bytes of every live tensor that is neither a
# parameter, the batch, nor a shard finish() returned. Only reduce_scatter_tensor (named
# reduce_scatter_single from torch 2.13) is available, logged like DDP's all-reduces.
def _zero2_step_problem(events: list, got: Any, step: dict, rank: int, buckets: list[list[int]], names: list[str],
                        world: int, cap: int) -> str | None:
    """What is wrong with one ZeRO-2 backward of one rank (see `parallel.check_mlp_ranks`), or None."""
    import torch

    local, whole = step["local"][rank], step["whole"]

    calls = [(i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("call") == "reduce_scatter"]
    numels = [sum(local[k].numel() for k in b) for b in buckets]
    chunk = [-(-n // world) for n in numels]
    if len(calls) != len(buckets):
        return (f"made {len(calls)} reduce-scatters; with a cap of {cap} bytes the parameters, in reverse order of "
                f"model.parameters() (float64: 8 bytes a value), fill {len(buckets)} buckets of {numels} values: "
                "one reduce-scatter a bucket")
    for b, (bucket, (i, e)) in enumerate(zip(buckets, calls)):
        shown = [names[k] for k in bucket]
        want = bucket_values(local, bucket, pad_to=world * chunk[b])
        vals = torch.tensor(e.get("values") or [], dtype=torch.float64)
        if e.get("out_numel") != chunk[b] or vals.numel() != want.numel():
            return (f"reduce-scattered {vals.numel()} values into {e.get('out_numel')} for bucket {b + 1} ({shown}, "
                    f"{numels[b]} values); pad the bucket's flat gradient with zeros to a multiple of {world} "
                    f"({world * chunk[b]}) and keep ceil(n / N) = {chunk[b]}")
        if not any(torch.allclose(vals, want * s, rtol=1e-9, atol=1e-12) for s in (1, 1 / world)):
            return (f"reduce-scattered something other than this rank's gradients of bucket {b + 1} ({shown}), "
                    "concatenated in the order the bucket was filled (reverse order of model.parameters()), "
                    "zero-padded at the end")
        if "SUM" not in str(e.get("op")).upper():
            return f"reduce-scattered with {e.get('op')}: sum (then divide by the number of ranks)"
        if e.get("phase") != "backward" or not e.get("async"):
            return (f"launched the reduce-scatter of bucket {b + 1} " + ("after loss.backward() returned (in "
                    f"{e.get('phase')})" if e.get("phase") != "backward" else "without async_op=True, so the backward "
                    "waited for it") + ": launch each bucket with async_op=True from the hook of its last gradient, "
                    "so that it travels while the backward goes on and its gradients can be freed at once")
        why = launch_problem(events, i, bucket, names)
        if why:
            return why
    bucket_of = {k: b for b, bucket in enumerate(buckets) for k in bucket}
    ready_so_far: set[int] = set()
    for e in events:
        if isinstance(e, dict) and "ready" in e:
            done = {b for b, bucket in enumerate(buckets) if set(bucket) <= ready_so_far}
            stale = [j for j in e.get("held") or [] if isinstance(j, int) and bucket_of.get(j) in done]
            if stale:
                return (f"still held the gradient of {names[stale[0]]} when {names[e['ready']]}'s became ready, though "
                        "its bucket had been launched: free a bucket's gradients (p.grad = None) as soon as its "
                        "reduce-scatter is launched, so that no rank ever holds all the gradients")
            ready_so_far.add(e["ready"])
    if not isinstance(got, dict):
        return "did not finish the step"
    for when in ("after_backward", "after_finish"):
        if got.get(when):
            return (f"still holds the gradients of {[names[j] for j in got[when] if isinstance(j, int)][:4]} in p.grad "
                    f"{when.replace('_', ' ')}(): ZeRO-2 frees every gradient once its bucket is launched and keeps "
                    "only its shard of the averaged gradient")
    shards = got.get("shards")
    if not isinstance(shards, list) or len(shards) != len(buckets):
        return (f"finish() returned {str(shards)[:60]}; return this rank's shards, one 1-D tensor a bucket "
                f"({len(buckets)}), in the order the buckets were filled")
    for b, bucket in enumerate(buckets):
        want = bucket_values(whole, bucket, pad_to=world * chunk[b])[rank * chunk[b]:(rank + 1) * chunk[b]]
        if not tclose(as_tensor(shards[b], want), want):
            return (f"returned a shard of bucket {b + 1} ({[names[k] for k in bucket]}) that differs from elements "
                    f"[{rank * chunk[b]}, {(rank + 1) * chunk[b]}) of the averaged gradient (one process on the whole "
                    "batch, computed here): the reduce-scatter's sum divided by the number of ranks")
    full = 8 * sum(numels)
    allowed = 8 * sum(chunk)
    extra = got.get("extra_bytes")
    if not isinstance(extra, int) or extra > allowed:
        return (f"keeps {extra} bytes of other tensors alive after finish() (all the gradients are {full} bytes, its "
                f"shards {allowed}): drop the flattened buckets once their reduce-scatter has completed")
    return None


def check_zero2(cls: Any, *, cases=((2, 1000),), timeout: float = 120.0) -> None:
    """Run the student's ZeRO-2 gradient partitioning, `cls(model, bucket_bytes)` whose `finish()`
    returns this rank's shards, on linked ranks (`run.Switchboard`) for two backward passes of a small float64
    MLP, each rank on its slice of the batch, and check on every rank: one reduce-scatter per bucket
    (buckets computed here from the sizes and the cap), each of the rank's own zero-padded bucket,
    launched asynchronously during the backward from the hook of the bucket's last gradient; a
    bucket's gradients freed once it is launched (p.grad is None; nothing gradient-sized kept after
    finish()); the returned shards equal the averaged gradient's (one process on the whole batch).
    `cases` are (ranks, cap in bytes)."""
    check_mlp_ranks("zero2", cls, cases, timeout=timeout, what="ZeRO-2", update=False, step_problem=_zero2_step_problem,
                    early="called a collective before the first backward", step="backward")
