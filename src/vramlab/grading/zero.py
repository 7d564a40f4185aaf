"""Lab 4's checks (ZeRO): the student's ZeRO-1 step, ZeRO-2 gradient partitioning and gradient
accumulation under DDP's no_sync, run on ranks that reach each other only through the check's process
(`run.Switchboard`), which logs every collective a rank calls; the ranks run `programs/zero1.py`,
`programs/zero2.py` and `programs/ddp_accum.py`. Every expected value is computed here, from data
drawn here afresh for every grading (each rank is dealt only its own)."""

from __future__ import annotations

from typing import Any, Callable

from ..units import fmt_bytes
from .parallel import (as_tensor, bucket_values, check_mlp_ranks, launch_problem, mlp_grads, rank_problem, split_steps,
                       tclose)
from .run import answer_source, cell_source, fresh_generator, run_linked, run_world

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


# Gradient accumulation under DDP's no_sync (PyTorch DDP, Li+20 §3.2.4; chapter 4): each rank runs k
# micro-batches of its own, the first k - 1 without communicating, and all-reduces the accumulated
# gradients once, so that every rank ends with the gradient of the global batch's mean loss (all ranks
# x k micro-batches). The ranks run `programs/ddp_accum.py`: the MLP of `common.mlp_model` built from a
# seed drawn here, its .grad filled with noise first (what the previous step left), each rank dealt its
# own micro-batches, drawn here afresh for every grading. Only all_reduce is available; the switchboard
# logs the values each rank all-reduces, and the harness notes the order of the forwards and backwards.
ACCUM_DIMS = (6, 12, 12, 3)  # Linear(6, 12), Tanh, Linear(12, 12), Tanh, Linear(12, 3)
ACCUM_ROWS = 4  # rows a micro-batch

# what a wrong answer's gradients equal, as multiples of the right one (k micro-batches, N ranks)
ACCUM_SCALES = (
    (lambda k, n: k, "are {k} times the global batch's mean-loss gradient: each micro-batch's loss is a mean over "
                     "its own rows, so divide it by k = {k} before its backward (or the accumulated gradients "
                     "afterwards)"),
    (lambda k, n: n, "are {n} times the global batch's mean-loss gradient, as if averaged over the {k} micro-batches "
                     "only: the all-reduce sums over the ranks, so divide its result by world_size = {n}"),
    (lambda k, n: k * n, "are k x world_size = {kn} times the global batch's mean-loss gradient: divide by k = {k} for "
                         "the micro-batches and by world_size = {n} after the all-reduce's sum"),
)


def _accum_params(seed: int) -> list:
    """The MLP's parameters as `programs/common.py`'s mlp_model draws them from `seed` (weight, bias,
    layer by layer): the same on every rank and here."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for i, o in zip(ACCUM_DIMS[:-1], ACCUM_DIMS[1:]):
        params += [torch.randn(o, i, generator=g, dtype=torch.float64) * 0.4,
                   torch.randn(o, generator=g, dtype=torch.float64) * 0.1]
    return params


def _accum_grads(params: list, x, y):
    """The flat gradient of the mean squared error of the MLP on (x, y) (the harness's loss_fn)."""
    import torch

    return torch.cat([g.reshape(-1) for g in mlp_grads(params, x, y)])


def _accum_reference(seed: int, world: int, k: int) -> dict:
    """One case's micro-batches, drawn here afresh ("dealt": [rank] -> k (x, y) pairs), every
    micro-batch's own gradient ("micro": [rank][i], flat), the global batch's mean-loss gradient (the
    mean of them all: the micro-batches are equal) and the noise the harness put in .grad first."""
    import torch

    params = _accum_params(seed)
    gen = fresh_generator()
    dealt, micro = [], []
    for _ in range(world):
        xs = [torch.randn(ACCUM_ROWS, ACCUM_DIMS[0], generator=gen, dtype=torch.float64) for _ in range(k)]
        ys = [torch.randn(ACCUM_ROWS, ACCUM_DIMS[-1], generator=gen, dtype=torch.float64) for _ in range(k)]
        dealt.append([[x.tolist(), y.tolist()] for x, y in zip(xs, ys)])
        micro.append([_accum_grads(params, x, y) for x, y in zip(xs, ys)])
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.cat([torch.randn(p.shape, generator=g, dtype=torch.float64).reshape(-1) for p in params])
    whole = torch.stack([m for r in micro for m in r]).mean(0)
    names = [f"{2 * j}.{w}" for j in range(len(ACCUM_DIMS) - 1) for w in ("weight", "bias")]
    return {"dealt": dealt, "micro": micro, "whole": whole, "noise": noise, "names": names,
            "sizes": [p.numel() for p in params]}


def _accum_order_problem(order: Any, k: int) -> str | None:
    """What is wrong with the order of one rank's forwards and backwards (the harness's notes), or None."""
    if not isinstance(order, list):
        return "reported no forwards"
    rows = [e[1] for e in order if isinstance(e, list) and e[:1] == ["F"]]
    if len(rows) == 1 and k > 1 and rows[0] == k * ACCUM_ROWS:
        return (f"ran the model once, on all {k} micro-batches' {k * ACCUM_ROWS} rows: accumulation runs each "
                "micro-batch's forward and backward in turn, so that only one micro-batch's activations are alive")
    if rows != [ACCUM_ROWS] * k:
        return (f"ran forwards on {rows} rows; expected {k} forwards of {ACCUM_ROWS} rows, one a micro-batch, each "
                "micro-batch once")
    tokens = [e[0] for e in order if isinstance(e, list) and e]
    if tokens == ["F"] * k + ["B"]:
        return (f"ran one backward for all {k} micro-batches (their losses summed first): that keeps every "
                "micro-batch's activations alive until the end; run each micro-batch's backward before the next "
                "one's forward")
    if tokens != ["F", "B"] * k:
        return (f"ran the forwards (F) and backwards (B) in the order {''.join(tokens)[:40]}; expected each "
                "micro-batch's forward then its backward, in turn (" + "FB" * k + ")")
    return None


def _accum_value_problem(got, ref: dict, world: int, k: int) -> str:
    """Why the (agreeing) ranks' gradients differ from the global batch's, from the mistakes they equal."""
    import torch

    whole, noise, micro = ref["whole"], ref["noise"], ref["micro"]

    def close(want) -> bool:
        return torch.allclose(got, want, rtol=1e-9, atol=1e-12)

    if close(whole + noise):
        return ("also hold what .grad held before the step (what the previous step left): clear it once, before "
                "the first micro-batch (p.grad = None, or model.zero_grad()); backward adds into whatever is there")
    if k == world and close(k * whole):
        return (f"are {k} times the global batch's mean-loss gradient: divide each micro-batch's loss by k = {k} "
                f"(it is a mean over its own rows) and the all-reduce's sum by world_size = {world}; with "
                f"k = world_size = {k} one of the two is missing")
    for scale, why in ACCUM_SCALES:
        if close(scale(k, world) * whole):
            return why.format(k=k, n=world, kn=k * world)
    last = torch.stack([r[-1] for r in micro]).mean(0)
    if any(close(last * s) for s in (1, 1 / k, world, world / k)):
        return ("are the last micro-batch's only: clearing .grad between micro-batches (zero_grad inside the loop) "
                "throws the earlier ones away; clear once, before the first micro-batch, and let backward add each "
                "micro-batch's gradients into .grad")
    diff = float((got - whole).abs().max())
    return (f"differ from the global batch's mean-loss gradient (all {world} ranks x {k} "
            f"micro-batches, computed here on one process; largest difference {diff:.3g})")


def _accum_rank_grads(report: Any, c: int, k: int, ref: dict, name: str) -> tuple[str | None, Any]:
    """One rank's case `c`: (what is wrong, None), or (None, its gradients, flat) where it ran each
    micro-batch's forward and backward in turn and left a gradient in every .grad."""
    why = rank_problem(report)
    if why:
        return why, None
    if any(isinstance(e, dict) and "call" in e for e in split_steps(report.get("log"))[0]):
        return f"called a collective before {name} ran", None
    results = report.get("result")
    got = results[c] if isinstance(results, list) and c < len(results) else None
    if not isinstance(got, dict):
        return "reported nothing for this case", None
    why = _accum_order_problem(got.get("order"), k)
    if why:
        return why, None
    listed = got.get("grads")
    if not isinstance(listed, list) or len(listed) != len(ref["sizes"]):
        return "reported no gradients", None
    missing = [ref["names"][j] for j, v in enumerate(listed) if v is None]
    if missing:
        return (f"left no gradient in .grad of {missing[0]}: every parameter's .grad must hold the averaged gradient "
                "afterwards"), None
    flat = as_tensor([v for g in listed if isinstance(g, list) for v in g], ref["whole"])
    return ("left gradients of the wrong shape in .grad", None) if flat is None else (None, flat)


def _accum_traffic_problem(report: dict, c: int, k: int, n_values: int) -> str | None:
    """What is wrong with what one rank all-reduced in case `c`: every gradient once, however split."""
    events = split_steps(report.get("log"))
    calls = [e for e in (events[c + 1] if c + 1 < len(events) else []) if isinstance(e, dict)
             and e.get("call") == "all_reduce"]
    sent = sum(len(e.get("values") or []) for e in calls)
    if sent == n_values:
        return None
    if k > 1 and sent == k * n_values:
        return (f"sent {k} times the bytes DDP's no_sync sends: it all-reduced {sent} values ({fmt_bytes(8 * sent)} "
                f"in float64) in one step, where one all-reduce of the {n_values} gradients "
                f"({fmt_bytes(8 * n_values)}) is enough. Under no_sync micro-batches 1..{k - 1} only accumulate in "
                ".grad; the sum is all-reduced once, after the last")
    return (f"all-reduced {sent} values in {len(calls)} call(s) in one step; DDP with no_sync all-reduces every "
            f"gradient exactly once a step: {n_values} values ({fmt_bytes(8 * n_values)} in float64), flat or "
            "parameter by parameter")


def check_accumulate_ddp(fn: Callable, *, cases=((2, 3),), timeout: float = 60.0) -> None:
    """Run the student's `fn(model, micro_batches, loss_fn, rank, world_size)` (one optimizer step's
    gradients with k micro-batches a rank, as DDP's no_sync makes them) on linked ranks
    (`run.Switchboard`), each rank dealt its own k micro-batches (drawn here afresh), and check: each
    micro-batch's forward then its backward, in turn; every rank's `.grad` afterwards equal on every rank
    and to the gradient of the global batch's mean loss (computed here on one process, float64), with
    the usual mistakes named (the 1/k or 1/world_size scaling missing, .grad cleared between
    micro-batches or not cleared first); and the traffic: one all-reduce's worth of every gradient per
    step, however split, not one a micro-batch. `cases` are (ranks, micro-batches a rank)."""
    import tempfile

    import torch

    source = cell_source(fn)
    by_world: dict[int, list[int]] = {}
    for world, k in cases:
        by_world.setdefault(world, []).append(k)
    with tempfile.TemporaryDirectory() as tmp:
        for world, ks in by_world.items():
            seed = int(torch.randint(0, 2**31 - 2, (1,), generator=fresh_generator()))
            refs = [_accum_reference(seed, world, k) for k in ks]
            reports = run_linked("ddp_accum", world, {"dims": list(ACCUM_DIMS), "seed": seed, "ks": ks}, source=source,
                                 names=[fn.__name__], tmp=tmp, timeout=timeout, what="DDP gradient accumulation",
                                 dealt=[[ref["dealt"][r] for ref in refs] for r in range(world)])
            for c, (k, ref) in enumerate(zip(ks, refs)):
                what = f"DDP gradient accumulation on {world} ranks, {k} micro-batches of {ACCUM_ROWS} rows a rank"
                grads = []
                for rank, report in enumerate(reports):
                    why, flat = _accum_rank_grads(report, c, k, ref, fn.__name__)
                    if why:
                        raise AssertionError(f"{what}: rank {rank} {why}.")
                    grads.append(flat)
                apart = [r for r in range(1, world) if not tclose(grads[r], grads[0])]
                if apart:
                    own = any(all(tclose(grads[r], torch.stack(ref["micro"][r]).mean(0) * s) for r in range(world))
                              for s in (1, k, 1 / world, k / world))
                    raise AssertionError(
                        f"{what}: the ranks disagree after the step: rank {apart[0]}'s gradients differ from rank 0's"
                        + (" (each holds the gradient of its own micro-batches only)" if own else "")
                        + ". All-reduce (sum) the accumulated gradients once, after the last micro-batch's backward, "
                          "and divide by world_size, so that every rank holds the global batch's gradient.")
                for rank, report in enumerate(reports):
                    why = _accum_traffic_problem(report, c, k, sum(ref["sizes"]))
                    if why:
                        raise AssertionError(f"{what}: rank {rank} {why}.")
                if not tclose(grads[0], ref["whole"]):
                    why = _accum_value_problem(grads[0], ref, world, k)
                    raise AssertionError(f"{what}: the ranks' gradients {why}.")
