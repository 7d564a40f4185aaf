"""`vramlab explain SNAPSHOT`: where an out-of-memory run's bytes went (`vramlab.snapshot.explain`), beside the
estimate for the same setup, and whether it would fit with expandable segments or a smaller batch.

    vramlab explain oom.pickle --model gpt2 --batch-size 8 --seq-len 1024 --precision bf16-mixed --gpu H100
    vramlab explain oom.pickle --estimate est.json      # est.json: `vramlab estimate ... --json`'s output
    python -m vramlab.present.explain oom.pickle ...    # the same without cli.py

The snapshot is the pickle `torch.cuda.memory._dump_snapshot()` writes after
`torch.cuda.memory._record_memory_history()`; it is read without running any code from it. Prints a table
(category, bytes in GiB, estimate, difference), the allocator's share of the reserved bytes, then the
verdicts. Exit codes: 0 success, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .. import checks, memory, specs
from .. import optimizers
from .. import precision as P
from .. import snapshot as S
from ..units import GiB
from .tables import Cell, Table

_COUNT = checks.argtype(checks.whole, int)
_GIB = checks.argtype(checks.number, float, lo=0, lo_open=True, hi=1 << 20)
_GIB_0 = checks.argtype(checks.number, float, lo=0, hi=1 << 20)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The `explain` subcommand on `subparsers` (cli.build_parser's); returns it."""
    p = subparsers.add_parser("explain", help="explain an out-of-memory error from a torch.cuda.memory snapshot: "
                                              "every allocated byte by category, beside the estimate")
    p.add_argument("snapshot", metavar="SNAPSHOT", help="the pickle torch.cuda.memory._dump_snapshot() wrote")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--estimate", metavar="JSON", help="`vramlab estimate ... --json`'s output (or a JSON object "
                                                         "of categories to bytes)")
    src.add_argument("--model", help=f"estimate the same setup: a preset ({', '.join(specs.preset_names())})")
    src.add_argument("--hf-config", metavar="PATH", help="estimate the same setup: a transformers config.json")
    p.add_argument("--batch-size", type=_COUNT, default=None, help="the run's sequences a step (the batch answer "
                                                                    "scales activations from it)")
    p.add_argument("--seq-len", type=_COUNT, default=None, help="tokens a sequence (with --model/--hf-config)")
    p.add_argument("--precision", default="fp32", choices=P.PRECISIONS, help="with --model (default fp32)")
    p.add_argument("--optimizer", default="adamw", choices=optimizers.SHARDED, help="with --model (default adamw)")
    p.add_argument("--gpu", default=None, help=f"the GPU it ran on: {', '.join(specs.GPUS)} (its total and CUDA "
                                               "context from the catalogue)")
    p.add_argument("--device-total-gib", type=_GIB, default=None, metavar="GIB",
                   help="the device's total memory (torch.cuda.mem_get_info()[1]), instead of --gpu")
    p.add_argument("--context-gib", type=_GIB_0, default=None, metavar="GIB",
                   help="the CUDA context and libraries outside the allocator (needed without an OOM in the trace)")
    p.add_argument("--device", type=checks.argtype(checks.whole, int, lo=0, hi=1 << 16), default=None,
                   help="the GPU index, when the snapshot holds several")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _estimate(ns, snap: S.Snapshot) -> tuple[object, str]:
    """The estimate to compare with and a line saying which: a JSON file, or memory.training_phases for
    --model/--hf-config at the phase the OOM happened in (the peak without an OOM); (None, "") if neither."""
    if ns.estimate:
        try:
            with open(ns.estimate, encoding="utf-8") as f:
                return json.load(f), f"estimate: {ns.estimate}"
        except OSError as e:
            raise ValueError(f"cannot read --estimate {ns.estimate!r}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--estimate {ns.estimate!r} is not JSON: {e.msg} (line {e.lineno})") from None
    if not (ns.model or ns.hf_config):
        return None, ""
    spec = specs.preset(ns.model) if ns.model else specs.from_config(ns.hf_config)
    phases = memory.training_phases(spec, batch_size=ns.batch_size, seq_len=ns.seq_len, precision=ns.precision,
                                    optimizer=ns.optimizer)
    est, where = S.phase_to_compare(snap, phases)
    why = f"the OOM came in the {where}" if where else "the step's peak"
    return est, f"estimate: {spec.name}, memory.training_phases at '{est.phase}' ({why})"


def _device(ns) -> tuple[int | None, int | None]:
    total = None if ns.device_total_gib is None else int(ns.device_total_gib * GiB)
    context = None if ns.context_gib is None else int(ns.context_gib * GiB)
    if ns.gpu is not None:
        g = specs.gpu(ns.gpu)
        total = g.usable_bytes if total is None else total
        context = g.context_bytes if context is None else context
    return total, context


def _gib(n: int | None) -> str:
    """GiB with 3 decimals; a difference smaller than that shows as 0.000, never -0.000."""
    return "" if n is None else f"{n / GiB + 0.0:.3f}".replace("-0.000", "0.000")


def table(e: S.Explanation) -> Table:
    """category | GiB (snapshot) | estimate | difference, the unexpected rows marked."""
    bad = {c for c, _, _ in e.unexpected}
    rows = []
    for c, s, est in e.rows():
        name = Cell(c.replace("_", " "), "bad") if c in bad else c.replace("_", " ")
        rows.append([name, _gib(s), _gib(est) if e.estimate is not None else "",
                     _gib(s - (est or 0)) if e.estimate is not None else ""])
    total = sum(e.estimate.values()) if e.estimate is not None else None
    rows.append([Cell("allocated", "strong"), _gib(e.allocated), _gib(total),
                 _gib(e.allocated - total) if total is not None else ""])
    rows.append(["reserved - allocated", _gib(e.cached_free), "", ""])
    return Table(["category", "snapshot (GiB)", "estimate (GiB)", "difference (GiB)"], rows, align="lrrr",
                 caption="allocated bytes by the stack that allocated them (vramlab.snapshot.RULES)")


def answer(ns) -> int:
    """Run `vramlab explain` for the parsed `ns`: print the table and verdicts (or --json); 0 on success.
    A ValueError carries the one line to print (cli._main and `main` print it, exit 2)."""
    missing = [f for f, v in (("--batch-size", ns.batch_size), ("--seq-len", ns.seq_len)) if v is None]
    if (ns.model or ns.hf_config) and missing:  # flags first, then the file
        raise ValueError(f"--model/--hf-config needs {' and '.join(missing)} to estimate the same setup")
    snap = S.load_snapshot(ns.snapshot, device=ns.device)
    est, which = _estimate(ns, snap)
    total, context = _device(ns)
    e = S.explain(snap, estimate=est, device_total=total, context_bytes=context, batch_size=ns.batch_size)
    if ns.json:
        print(json.dumps({**e.to_dict(), "estimate_source": which}, indent=2))
        return 0
    print(table(e))
    if which:
        print(which)
    for line in e.allocator_lines() + e.verdicts() + list(e.notes):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vramlab.present.explain` (argv without the command name), or argv starting with "explain"."""
    p = checks.Parser(prog="vramlab")
    sub = p.add_subparsers(dest="command", required=True, parser_class=checks.Parser)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "explain":
        argv = ["explain"] + argv
    ns = p.parse_args(argv)
    try:
        return answer(ns)
    except (ValueError, KeyError) as err:
        msg = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        print(f"vramlab: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
