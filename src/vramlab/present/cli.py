"""`vramlab estimate train|infer ...`: the memory calculator on the command line.

Exit codes: 0 success, 2 bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .. import activations, checks, fitting, memory, specs
from ..units import fmt_bytes


def _count(name: str, value, *, lo: int = 1) -> int:
    """checks.whole, saying "non-negative" where 0 is allowed (the flags' help says so)."""
    try:
        return checks.whole(name, value, lo=lo)
    except ValueError:
        if lo == 0 and isinstance(value, int) and value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value}") from None
        raise


def build_parser() -> argparse.ArgumentParser:
    """The `vramlab` command line: every error is one line and exit status 2 (`checks.Parser`)."""
    p = checks.Parser(prog="vramlab", description="Where GPU memory goes: estimate training and inference memory.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=checks.Parser)
    est = sub.add_parser("estimate", help="estimate the peak memory of a training step, an inference prefill or generate()")
    est.add_argument("mode", choices=("train", "infer"))
    src = est.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"a preset: {', '.join(specs.preset_names())}")
    src.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (or a folder holding one)")
    est.add_argument("--batch-size", type=checks.argtype(_count, int), required=True, help="sequences per step")
    est.add_argument("--seq-len", type=checks.argtype(_count, int), required=True, help="tokens per sequence")
    est.add_argument("--precision", default=None,
                     help="train: fp32 | bf16-mixed | fp16-mixed | bf16 (default fp32); infer: fp32 | bf16 | fp16 | int8 (default bf16)")
    est.add_argument("--optimizer", default=None, choices=memory.OPTIMIZERS, help="train only (default adamw)")
    est.add_argument("--optimizer-impl", default=None, choices=memory.OPTIMIZER_IMPLS, help="train only (default foreach)")
    est.add_argument("--attention", default="sdpa", choices=activations.ATTENTIONS)
    est.add_argument("--recompute", default=None, metavar="PLAN",
                     help=f"train only (default none): {', '.join(activations.RECOMPUTES)}, every-K, first-N or segments-K")
    est.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="whose kernels run (default cuda)")
    est.add_argument("--new-tokens", type=checks.argtype(_count, int, lo=0), default=None,
                     help="infer: model.generate() with this many new tokens (default: one prefill, all logits)")
    est.add_argument("--gpu", help=f"check the fit on: {', '.join(specs.GPUS)} (shows the reserve it assumes)")
    est.add_argument("--expandable-segments", action="store_true",
                     help="with --gpu: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("presets", help="list the built-in models")
    sub.add_parser("gpus", help="list the GPU catalogue")
    return p


def _estimate(args: argparse.Namespace) -> int:
    spec = specs.preset(args.model) if args.model else specs.from_config(args.hf_config)
    gpu = specs.gpu(args.gpu) if args.gpu is not None else None
    only = {"train": ("optimizer", "optimizer_impl", "recompute"), "infer": ("new_tokens",)}
    for mode, flags in only.items():
        given = [f for f in flags if getattr(args, f) is not None]
        if mode != args.mode and given:
            raise ValueError(f"--{given[0].replace('_', '-')} does not apply to 'estimate {args.mode}' "
                             f"(it is for 'estimate {mode}')")
    if gpu and args.device != "cuda":
        raise ValueError("--gpu checks the fit on a GPU: leave --device at cuda")
    if args.expandable_segments and not gpu:
        raise ValueError("--expandable-segments changes the fit on a GPU: give --gpu too")
    if args.mode == "infer" and args.new_tokens is not None:
        checks.has_decoder(spec, "--new-tokens (generation; leave it out for a prefill)")
    if args.mode == "train":
        options = dict(seq_len=args.seq_len, precision=args.precision or "fp32", optimizer=args.optimizer or "adamw",
                       optimizer_impl=args.optimizer_impl or "foreach", attention=args.attention,
                       recompute=args.recompute or "none", device=args.device)
        est = memory.estimate_training(spec, batch_size=args.batch_size, gpu=gpu, **options)
    else:
        options = dict(seq_len=args.seq_len, dtype=args.precision or "bf16", attention=args.attention,
                       new_tokens=args.new_tokens, device=args.device)
        est = memory.estimate_inference(spec, batch_size=args.batch_size, gpu=gpu, **options)
    verdict = None
    if gpu:
        fit_options = {k: v for k, v in options.items() if k != "device"}
        verdict = fitting.fit(spec, gpu, batch_size=args.batch_size, mode=args.mode,
                             expandable_segments=args.expandable_segments, **fit_options)
    if args.json:
        out = {"model": spec.name, "model_type": spec.model_type, "mode": args.mode, "params": spec.params,
               "batch_size": args.batch_size, "seq_len": args.seq_len, "options": options,
               "total_bytes": est.total, "breakdown": est.to_dict(), "peak_phase": est.phase}
        if verdict:
            out["gpu"] = {"name": verdict.gpu.name, "usable_bytes": verdict.available, "fits": verdict.fits,
                          "needed_bytes": verdict.needed, "reserve_bytes": verdict.reserve,
                          "reserve": {"estimate_margin_bytes": verdict.margin,
                                      "fragmentation_bytes": verdict.fragmentation,
                                      "cuda_context_bytes": verdict.context},
                          "expandable_segments": verdict.expandable_segments,
                          "max_batch_size": verdict.max_batch_size}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{spec.name}: {spec.params:,} parameters ({spec.model_type})")
    print(est.table())
    if verdict:
        print(verdict)
        print(verdict.explain())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `vramlab` with `argv` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    if argv is not None and (isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence)
                             or not all(isinstance(a, str) for a in argv)):
        raise ValueError(f"argv must be a list of strings (or None for sys.argv), got {argv!r:.60}")
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:  # `vramlab presets | head -1`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(args: argparse.Namespace) -> int:
    try:
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "presets":
            for name in specs.preset_names():
                s = specs.preset(name)
                print(f"{name:16s}{s.model_type:10s}{s.params:>16,d} params  ({fmt_bytes(memory.checkpoint_bytes(s))} in fp32)")
            return 0
        for g in specs.GPUS.values():
            print(f"{g.name:14s}{fmt_bytes(g.memory_bytes):>12}  {g.bandwidth_GBps:>6.0f} GB/s  {g.architecture}")
        return 0
    except (ValueError, KeyError) as e:  # SpecError is a ValueError
        print(f"vramlab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
