"""The next levers: when a `vramlab` command's configuration does not fit, the changes a user would try, least
change first (`Lever`), each answered by the same estimators (`cli_answers.answer`), and the ones that fit printed
with what each gives (`answer_out`, which every subcommand ends with).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from .. import checkpointing as CK
from .. import memory
from .. import parallel as PAR
from .. import zero as Z
from .. import context_parallel as CP
from ..units import fmt_bytes
from .cli_answers import CP_SWEEP, ZERO_RECIPE, Answer, answer, gpu_of, is_sharded, model_spec
from .cli_args import OFFLOAD_SCHEMES, argv_of, changed_flags, defaults
from .tables import Cell, Table

MAX_GPUS = 1024  # the most GPUs a lever tries (the plan command's own --gpus may be more)


@dataclass(frozen=True)
class Lever:
    """Changes to try, least change first: the lever's answer is the first that fits. `monotone`:
    once one fits every later one does (more GPUs, a shorter sequence), so they are bisected."""

    changes: tuple[dict, ...]
    monotone: bool = False


@dataclass(frozen=True)
class Suggestion:
    flags: str  # what to change, as flags (or a whole command line for another subcommand)
    argv: list[str]  # the whole command line that gives `result`
    result: Answer

    def to_dict(self) -> dict:
        return {"try": self.flags, "argv": self.argv, **self.result.to_dict()}


def _apply(ns, change: dict) -> argparse.Namespace:
    if "command" in change and change["command"] != ns.command:
        return defaults(change["command"], **{k: v for k, v in change.items() if k != "command"})
    return argparse.Namespace(**{**vars(ns), **change})


_SCREENED: dict[tuple, Answer | None] = {}


def _screen(ns) -> Answer | None:
    """The answer without the batch search, or None where the change does not apply (bad input).
    Remembered by command line: two levers in either order reach the same one."""
    key = tuple(argv_of(ns))
    if key not in _SCREENED:
        try:
            _SCREENED[key] = answer(ns, search=False)
        except (ValueError, KeyError):
            _SCREENED[key] = None
    return _SCREENED[key]


def _resolve(lever: Lever, ns, inner: Lever | None = None) -> tuple[argparse.Namespace, Answer] | None:
    """The first change of `lever` (applied to `ns`) that fits, where `inner` is given with that
    lever's own answer on top of each change; where none does, the one needing the least."""
    tried = {}

    def at(i: int):
        if i not in tried:
            new = _apply(ns, lever.changes[i])
            tried[i] = _resolve(inner, new) if inner is not None else (new, _screen(new))
            tried[i] = tried[i] or (new, None)
        return tried[i]

    n = len(lever.changes)
    if lever.monotone and n > 3:
        lo, hi = 0, n - 1  # the first that fits, by bisection (a change that does not apply counts as not fitting)
        if not (at(hi)[1] and at(hi)[1].fits):
            lo = n
        while lo < hi:
            mid = (lo + hi) // 2
            a = at(mid)[1]
            lo, hi = (lo, mid) if a and a.fits else (mid + 1, hi)
        if lo < n:
            return at(lo)
    else:
        for i in range(n):
            if at(i)[1] and at(i)[1].fits:
                return at(i)
    found = [t for t in tried.values() if t[1]]
    return min(found, key=lambda t: t[1].needed) if found else None


def _seq_lens(s: int) -> tuple[dict, ...]:
    """Shorter sequences, longest first: multiples of 128, then powers of two."""
    below = list(range((s - 1) // 128 * 128, 127, -128)) if s > 128 else [k for k in (64, 32, 16, 8, 4, 2, 1) if k < s]
    return tuple({"seq_len": k} for k in below)


def _doublings(n: int, key: str = "gpus", **extra) -> tuple[dict, ...]:
    out, k = [], 2 * n
    while k <= MAX_GPUS:
        out.append({key: k, **extra})
        k *= 2
    return tuple(out)


def _levers(ns, here: Answer) -> list[Lever]:
    """What to try when `ns` does not fit, in the order a user would rather change things."""
    L: list[Lever] = []
    if here.largest:
        L.append(Lever(({"batch_size": here.largest},)))
    if ns.command != "plan" and ns.batch_size > 1:  # smaller batches, for a change that needs one beside it
        halves, b = [], ns.batch_size // 2
        while b >= 1:
            halves.append({"batch_size": b})
            b //= 2
        L.append(Lever(tuple(halves), monotone=True))
    if ns.command == "estimate" and ns.mode == "infer":
        smaller = [d for d in ("bf16", "int8") if memory.INFER_BYTES[d] < memory.INFER_BYTES[ns.precision or "bf16"]]
        L += [Lever(({"attention": "sdpa"},))] if ns.attention == "eager" else []
        L += [Lever(({"expandable_segments": True},))] if not ns.expandable_segments else []
        L += [Lever(tuple({"precision": d} for d in smaller))] if smaller else []
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        return L
    if ns.command == "estimate" and is_sharded(ns):
        if ns.attention == "eager":
            L.append(Lever(({"attention": "sdpa"},)))
        if not ns.expandable_segments:
            L.append(Lever(({"expandable_segments": True},)))
        if ns.precision == "fp32" or (ns.precision is None and ns.recipe in (None, "fp32-adam")):
            L.append(Lever(({"precision": "bf16-mixed", "recipe": None},)))
        if not ns.fsdp2:
            L.append(Lever(tuple({"zero": s} for s in Z.STAGES if s > ns.zero) + ({"zero": None, "fsdp2": True},)))
        L.append(Lever(_doublings(ns.gpus or 1), monotone=True))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        n = ns.gpus or 1
        # tensor and pipeline parallelism with recompute, on as many GPUs or a few times more (each a planner's
        # search: the fewest GPUs first)
        L.append(Lever(tuple({"command": "plan", "model": ns.model, "hf_config": ns.hf_config, "gpu": ns.gpu,
                               "gpus": k, "seq_len": ns.seq_len, "micro_batch_size": ns.batch_size,
                               "global_batch": ns.batch_size * k} for k in (n, 2 * n, 4 * n, 8 * n))))
        return L
    if ns.command == "plan":
        if ns.micro_batch_size > 1:
            L.append(Lever(({"micro_batch_size": 1},)))
        L.append(Lever(tuple({"gpus": ns.gpus * k} for k in (2, 4, 8, 16))))  # the fewest GPUs first
        halves, s = [], ns.seq_len // 2
        while s >= 1 and len(halves) < 8:
            halves.append({"seq_len": s})
            s //= 2
        L.append(Lever(tuple(halves), monotone=True))
        return L
    same = dict(model=ns.model, hf_config=ns.hf_config, gpu=ns.gpu, batch_size=ns.batch_size, seq_len=ns.seq_len)
    if ns.command == "estimate":  # training on one GPU
        spec = model_spec(ns)
        plans = []
        try:
            best = CK.cheapest_plan(spec, None, batch_size=ns.batch_size, seq_len=ns.seq_len,
                                    precision=ns.precision or "fp32", optimizer=ns.optimizer or "adamw",
                                    attention=ns.attention, gpu=gpu_of(ns))
            plans = [best.plan.name] if best is not None else []
        except ValueError:
            pass
        plans += ["full"] if "full" not in plans else []
        plans = [p for p in plans if p != (ns.recompute or "none")]
        if plans:
            L.append(Lever(tuple({"recompute": p} for p in plans)))
        if ns.attention == "eager":
            L.append(Lever(({"attention": "sdpa"},)))
        if not ns.expandable_segments:
            L.append(Lever(({"expandable_segments": True},)))
        if (ns.optimizer_impl or "foreach") != "fused":
            L.append(Lever(({"optimizer_impl": "fused"},)))
        if spec.is_causal_lm and (ns.loss or "whole") != "fused":  # the logits, b·s·V in fp32: chunk or fuse the loss
            L.append(Lever(tuple({"loss": x, "loss_chunk_tokens": None} for x in ("chunked", "fused")
                                 if x != ns.loss)))
        order = ("bf16-mixed", "bf16-fp32-states", "bf16")
        p = ns.precision or "fp32"
        lighter = order if p == "fp32" else order[order.index(p) + 1:] if p in order else \
            ("bf16",) if p in ("fp16-mixed", "fp16-fp32-master") else ()
        if lighter:
            L.append(Lever(tuple({"precision": q} for q in lighter)))
        if (ns.optimizer or "adamw") in ("adam", "adamw"):
            L.append(Lever(({"optimizer": "adamw-8bit"},)))
            zero_p = p if p in ZERO_RECIPE else "bf16-mixed"
            L.append(Lever(tuple({"zero": 3, "gpus": k, "recompute": None, "optimizer_impl": None, "loss": None,
                                  "loss_chunk_tokens": None, "precision": zero_p}
                                 for k in (2, 4, 8, 16, 32, 64, 128, 256)), monotone=True))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        if spec.is_causal_lm and spec.family in PAR.DECODER_FAMILIES:  # split the sequence over GPUs
            L.append(Lever(tuple({"command": "context", "cp": k, "precision": ns.precision or "fp32",
                                  "recompute": "full" if (ns.recompute or "none") != "none" else "none",
                                  "loss": ns.loss or "whole", **same} for k in CP_SWEEP[1:]), monotone=True))
        L.append(Lever(({"command": "lora", "method": "qlora", "recompute": ns.recompute or "none", **same},)))
        L.append(Lever(tuple({"command": "offload", "scheme": s, **same} for s in OFFLOAD_SCHEMES)))
        return L
    if ns.command == "lora":
        heavy_first = ("full", "lora", "lora-int8", "qlora")
        lighter = heavy_first[heavy_first.index(ns.method) + 1:] if ns.method in heavy_first else ()
        if ns.recompute != "full":
            L.append(Lever(({"recompute": "full"},)))
        if ns.method == "full" and ns.optimizer in ("adam", "adamw"):
            L.append(Lever(({"optimizer": "adamw-8bit"},)))
        if lighter:
            L.append(Lever(tuple({"method": m, "precision": None} for m in lighter)))
        if ns.targets != "default":
            L.append(Lever(({"targets": "default"},)))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        return L
    if ns.command == "offload":
        L.append(Lever(tuple({"scheme": s} for s in OFFLOAD_SCHEMES if s != ns.scheme)))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        L.append(Lever(({"command": "lora", "method": "qlora", "recompute": "full", **same},)))
        return L
    if ns.command == "context":
        # the logits' gradient (b x s/cp x V in fp32) and the blocks' saved tensors before more ranks: the loss
        # chunked or fused, full recompute, or both, the least change first
        cheap = [c for c in ({"loss": "chunked"}, {"loss": "fused"}, {"recompute": "full"},
                             {"loss": "chunked", "recompute": "full"}, {"loss": "fused", "recompute": "full"})
                 if any(getattr(ns, k) != v for k, v in c.items())
                 and not (ns.loss == "fused" and c.get("loss") == "chunked")]
        if cheap:
            L.append(Lever(tuple(cheap)))
        if not ns.fsdp and ns.precision in ("fp32", "bf16-mixed") and ns.optimizer in ("adam", "adamw"):
            L.append(Lever(({"fsdp": True},)))  # the states sharded over the CP ranks as well
        L.append(Lever(_doublings(ns.cp, "cp"), monotone=True))
        L.append(Lever(tuple({"method": m, "contiguous": False} for m in CP.CP_METHODS if m != ns.method)))
        if ns.precision == "fp32":
            L.append(Lever(({"precision": "bf16-mixed"},)))
        if ns.optimizer in ("adam", "adamw") and not ns.fsdp:
            L.append(Lever(({"optimizer": "adamw-8bit"},)))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        return L
    if ns.command == "checkpoint":
        order = ("bf16-mixed", "bf16-fp32-states", "bf16")
        lighter = order if ns.precision == "fp32" else order[order.index(ns.precision) + 1:] \
            if ns.precision in order else ("bf16",)
        if lighter:
            L.append(Lever(tuple({"precision": q} for q in lighter)))
        if ns.optimizer in ("adam", "adamw"):
            L.append(Lever(({"optimizer": "adamw-8bit"},)))
        L.append(Lever(_seq_lens(ns.seq_len), monotone=True))
        L.append(Lever(({"command": "offload", "scheme": "save-on-cpu", **same},)))
        return L
    raise AssertionError(ns.command)  # pragma: no cover


SHOWN = 6


def _suggest(ns, here: Answer) -> tuple[list[Suggestion], bool]:
    """The levers that fit (each recomputed with its batch search), or, where no single change does,
    pairs of changes that do; failing that the closest single changes. Returns (suggestions, fit)."""
    singles = []
    for lever in _levers(ns, here):
        r = _resolve(lever, ns)
        if r is not None:
            singles.append(r)
    fitting_ = [s for s in singles if s[1].fits]
    found = bool(fitting_)
    if not any(s[0].command == ns.command for s in fitting_):  # no flag of this command fits alone: two at once
        levers = [lv for lv in _levers(ns, here) if lv.changes and lv.changes[0].get("command", ns.command) == ns.command]
        pairs = []
        for a in levers:
            for b in levers:
                if a is b or "seq_len" in a.changes[0] or set(a.changes[0]) & set(b.changes[0]):
                    continue  # the longest sequence is searched inside, never outside
                r = _resolve(a, ns, inner=b)
                if r is not None and r[1].fits:
                    pairs.append(r)
        found = found or bool(pairs)
        fitting_ = pairs + fitting_ if found else sorted(singles, key=lambda s: s[1].needed)[:3]
    out, seen = [], set()
    for new, _ in fitting_:
        flags = changed_flags(ns, new)
        if flags in seen:
            continue
        seen.add(flags)
        try:
            result = answer(new, search=True)
        except (ValueError, KeyError):
            continue
        out.append(Suggestion(flags, ["vramlab"] + argv_of(new), result))
        if len(out) == SHOWN:
            break
    return out, found


def _suggestion_table(ns, here: Answer, suggestions: list[Suggestion], found: bool, per: str = "") -> Table:
    head = (f"does NOT fit (needs {fmt_bytes(here.needed)}{per} of {fmt_bytes(here.available)} usable): "
            + ("next levers, each computed by the same estimators" if found else
               "nothing tried fits; the closest"))
    columns = ["try", "needs", "fits", f"largest {here.of or 'batch'}", "note"]
    rows = [[s.flags, fmt_bytes(s.result.needed), Cell("yes", "good") if s.result.fits else Cell("NO", "bad"),
             "—" if s.result.largest is None else f"{s.result.largest:,}{'+' if s.result.capped else ''}",
             s.result.note or ""] for s in suggestions]
    keep = [j for j in range(len(columns)) if j < 3 or any(r[j] not in ("", "—") for r in rows)]
    return Table([columns[j] for j in keep], [[r[j] for j in keep] for r in rows], caption=head,
                 align="".join("lrcrl"[j] for j in keep))


def answer_out(ns, out: dict, here: Answer, *, fits, per: str = "") -> int:
    """Every subcommand ends here: the next levers when it does not fit (printed, and kept in `out`), then
    `--json`'s one object."""
    if not fits:
        out["suggestions"] = print_suggestions(ns, here, per)
    if ns.json:
        print(json.dumps(out, indent=2))
    return 0


def print_suggestions(ns, here: Answer, per: str = "") -> list[dict]:
    sugg, found = _suggest(ns, here)
    if not ns.json:
        print()
        print(_suggestion_table(ns, here, sugg, found, per))
    return [s.to_dict() for s in sugg]
