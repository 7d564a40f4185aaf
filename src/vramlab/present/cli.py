"""`vramlab`: every chapter's calculator on the command line.

    vramlab estimate train|infer ...   one GPU; or one rank with --zero 0-3 / --fsdp2 --gpus N (chapters 1, 4)
    vramlab estimate --from FILE       the training configuration you have: DeepSpeed, Trainer, accelerate,
                                       Axolotl, torchtune, torchtitan (present/from_config.py)
    vramlab explain SNAPSHOT           where an OOM's bytes went (torch.cuda.memory._snapshot()), beside the estimate
    vramlab plan ...                   dp x tp x pp (x ZeRO-1) layouts of N GPUs that fit, fastest first (chapter 3)
    vramlab offload ...                save_on_cpu, ZeRO-Offload, FSDP2's CPU offload (chapter 6)
    vramlab checkpoint ...             every recompute plan's peak and cost, the cheapest that fits (chapter 7)
    vramlab context ...                context parallelism: one rank of ring attention or Ulysses (chapter 3)
    vramlab experts ...                expert parallelism: one rank's experts, states and all-to-alls (chapter 3)
    vramlab lora ...                   full fine-tuning, LoRA, LoRA on INT8, QLoRA (chapter 8)
    vramlab presets | gpus

Each calls the library as the chapter's live calculator does (`vramlab.present.calculators`), so the
page and the command line agree. When something does not fit, the next levers are tried, each
computed by the same estimators (`cli_levers`), and the ones that fit are listed with what each gives.
Exit codes: 0 success, 2 bad input (one line on stderr, never a traceback).

The parts: `cli_args` (every subcommand's options, the parser), `cli_answers` (does it fit, per subcommand),
`cli_levers` (what to try when it does not) and `cli_commands` (what each subcommand prints); this module runs
them (`main`) and lists the presets and GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import memory, specs
from ..units import fmt_bytes
from .cli_args import build_parser, parser  # noqa: F401 (build_parser: the parser, as this module always gave it)
from .cli_commands import COMMANDS


def main(argv: Sequence[str] | None = None) -> int:
    """Run `vramlab` with `argv` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    if argv is not None and (isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence)
                             or not all(isinstance(a, str) for a in argv)):
        raise ValueError(f"argv must be a list of strings (or None for sys.argv), got {argv!r:.60}")
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:  # `vramlab presets | head -1`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(args: argparse.Namespace) -> int:
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        if args.command == "presets":
            for name in specs.preset_names():
                s = specs.preset(name)
                print(f"{name:16s}{s.model_type:10s}{s.params:>16,d} params  ({fmt_bytes(memory.checkpoint_bytes(s))} in fp32)")
            from .. import moe

            print("mixture of experts (`estimate infer`, `estimate train` on one GPU with --capacity-factor, "
                  "`experts` over GPUs, `serve`):")
            for name in specs.moe_preset_names():
                s = specs.preset(name)
                print(f"{name:18s}{s.model_type:12s}{s.params:>16,d} params, {moe.active_params(s):>15,d} active a token")
            return 0
        for g in specs.GPUS.values():
            print(f"{g.name:14s}{fmt_bytes(g.memory_bytes):>12}  {g.bandwidth_GBps:>6.0f} GB/s  {g.architecture}")
        return 0
    except (ValueError, KeyError) as e:  # SpecError is a ValueError
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"vramlab: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
