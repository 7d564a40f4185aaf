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
computed by the same estimators (`_suggest`), and the ones that fit are listed with what each gives.
Exit codes: 0 success, 2 bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from .. import activations, checks, fitting, memory, specs
from .. import checkpointing as CK
from .. import collectives as COLL
from .. import compression as COMP
from .. import offload as OFF
from .. import parallel as PAR
from .. import precision as P
from .. import serving as SERVE
from .. import zero as Z
from ..units import fmt_bytes
from . import explain as _explain
from . import from_config
from .tables import Cell, Table

INFER_DTYPES: tuple[str, ...] = tuple(memory.INFER_BYTES)
OFFLOAD_SCHEMES: tuple[str, ...] = ("save-on-cpu", "zero-offload", "fsdp2-cpu")
LORA_METHODS: tuple[str, ...] = ("lora", "qlora", "lora-int8", "full", "prompt", "prefix", "p-tuning")
PROMPT_METHODS: tuple[str, ...] = ("prompt", "prefix", "p-tuning")
# a ZeRO rank's recipe (zero.RECIPES) for each --precision: DeepSpeed and FSDP keep fp32 master weights
# and Adam's fp32 moments beside a 16-bit model; pure bf16 (bf16 optimizer states) is not one of theirs
ZERO_RECIPE = {"fp32": "fp32-adam", "bf16-mixed": "mixed-adam", "fp16-mixed": "mixed-adam",
               "bf16-fp32-states": "mixed-adam", "fp16-fp32-master": "mixed-adam"}
# the base's precision of each fine-tuning method, as the compression calculator chooses it
LORA_PRECISION = {"full": "bf16-mixed", "lora": "bf16", "lora-int8": "bf16", "qlora": "bf16", "prompt": "bf16",
                  "prefix": "bf16", "p-tuning": "bf16"}
MAX_GPUS = 1024  # the most GPUs a lever tries (the plan command's own --gpus may be more)


def _count(name: str, value, *, lo: int = 1) -> int:
    """checks.whole, saying "non-negative" where 0 is allowed (the flags' help says so)."""
    try:
        return checks.whole(name, value, lo=lo)
    except ValueError:
        if lo == 0 and isinstance(value, int) and value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value}") from None
        raise


_COUNT = checks.argtype(_count, int)
_COUNT_0 = checks.argtype(_count, int, lo=0)


def _model_source(p: argparse.ArgumentParser, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help=f"a preset: {', '.join(specs.preset_names())}")
    src.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (or a folder holding one)")


def _sizes(p: argparse.ArgumentParser, batch_help: str = "sequences per step") -> None:
    p.add_argument("--batch-size", type=_COUNT, required=True, help=batch_help)
    p.add_argument("--seq-len", type=_COUNT, required=True, help="tokens per sequence")


def _gpu_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--gpu", required=required, help=f"one of: {', '.join(specs.GPUS)} (or a unique part of a name)")


class Parser(checks.Parser):
    """`checks.Parser` with a `check(parser, namespace)`, where one is set, run after the parse, where argparse
    checks the required arguments (before it refuses unrecognized ones): for what argparse cannot say itself,
    as estimate's two forms."""

    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if self.check is not None:
            self.check(self, ns)
        return ns, extras


def _estimate_form(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """`vramlab estimate` has two forms: `train|infer` with a model and the sizes (required, in argparse's words),
    or `--from FILE` with what fills in what the file does not say (from_config.READS), nothing else."""
    if ns.from_file is not None:
        for a in p._actions:
            if a.dest not in from_config.READS and not isinstance(a, argparse._HelpAction) \
                    and getattr(ns, a.dest, a.default) != a.default:
                p.error(f"argument --from: not allowed with argument {argparse._get_action_name(a)}")
        return
    missing = [argparse._get_action_name(a) for a in p._actions
               if a.dest in ("mode", "batch_size", "seq_len") and getattr(ns, a.dest) is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    if ns.model is None and ns.hf_config is None:
        p.error("one of the arguments --model --hf-config is required")
    if ns.format is not None:
        p.error("argument --format: only with --from FILE (the file's format)")


def build_parser() -> argparse.ArgumentParser:
    """The `vramlab` command line: every error is one line and exit status 2 (`checks.Parser`)."""
    p = checks.Parser(prog="vramlab", description="Where GPU memory goes: does a training or inference step fit, "
                                                  "and what to change when it does not.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands = {}
    est = commands["estimate"] = sub.add_parser(
        "estimate", help="the peak memory of a training step (one GPU, or one rank with --zero/--fsdp2), "
                         "an inference prefill or generate(); or of the training configuration you have (--from FILE)")
    est.check = _estimate_form
    est.add_argument("mode", nargs="?", choices=("train", "infer"), help="required without --from")
    _model_source(est, required=False)
    est.add_argument("--batch-size", type=_COUNT, default=None, help="sequences per step (with --zero/--fsdp2: per rank, "
                     "the micro-batch); required without --from")
    est.add_argument("--seq-len", type=_COUNT, default=None, help="tokens per sequence; required without --from")
    est.add_argument("--precision", default=None, metavar="P",
                     help=f"train: {' | '.join(P.PRECISIONS)} (default fp32); infer: {' | '.join(INFER_DTYPES)} "
                          "(default bf16)")
    est.add_argument("--optimizer", default=None, choices=memory.ALL_OPTIMIZERS, metavar="OPT",
                     help=f"train only (default adamw): {', '.join(memory.ALL_OPTIMIZERS)}")
    est.add_argument("--optimizer-in-backward", action="store_true", default=None,
                     help="train: step each parameter as its gradient is made, then free the gradient "
                          "(register_post_accumulate_grad_hook)")
    est.add_argument("--galore-rank", type=_COUNT, default=None, metavar="R",
                     help="train, with --optimizer galore-adamw: the projections' rank (default 128)")
    est.add_argument("--optimizer-impl", default=None, choices=memory.OPTIMIZER_IMPLS,
                     help="train only (default foreach; fused with --zero/--fsdp2, as DeepSpeed's Adam)")
    est.add_argument("--attention", default="sdpa", choices=activations.ATTENTIONS)
    est.add_argument("--recompute", default=None, metavar="PLAN",
                     help=f"train only (default none): {', '.join(activations.RECOMPUTES)}, every-K, first-N or segments-K")
    est.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="whose kernels run (default cuda)")
    est.add_argument("--accumulation-steps", type=_COUNT, default=None, metavar="K",
                     help="train: micro-batches per optimizer step (gradient accumulation; --batch-size is the "
                          "micro-batch; default 1)")
    est.add_argument("--loss", default=None, choices=memory.LOSSES,
                     help="train: the loss's implementation (default whole; chunked: torchtune's chunked cross-entropy; "
                          "fused: Liger's fused linear cross-entropy)")
    est.add_argument("--loss-chunk-tokens", type=_COUNT, default=None, metavar="N",
                     help="train, with --loss chunked or fused: tokens a chunk (default: torchtune's 8 chunks, Liger's rule)")
    est.add_argument("--capacity-factor", type=float, default=None, metavar="F",
                     help="train, a mixture of experts: each expert's buffer holds F x tokens x top-k / experts rows, "
                          "the rest dropped (GShard, DeepSpeed, Megatron's drop-and-pad; default: dropless, as transformers)")
    est.add_argument("--new-tokens", type=checks.argtype(_count, int, lo=0), default=None,
                     help="infer: model.generate() with this many new tokens (default: one prefill, all logits)")
    _gpu_arg(est, required=False)
    est.add_argument("--expandable-segments", action="store_true",
                     help="with --gpu: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)")
    est.add_argument("--zero", type=int, choices=Z.STAGES, default=None,
                     help="train: one data-parallel rank under DeepSpeed ZeRO stage 0-3 (zero.estimate_rank)")
    est.add_argument("--fsdp2", action="store_true", help="train: one rank under FSDP2's fully_shard (ZeRO-3 sharding)")
    est.add_argument("--gpus", type=_COUNT, default=None, help="with --zero/--fsdp2: data-parallel ranks (default 1)")
    est.add_argument("--recipe", default=None, choices=tuple(Z.RECIPES),
                     help="with --zero/--fsdp2, instead of --precision: bytes per parameter as zero.RECIPES "
                          "(default: from --precision, fp32 -> fp32-adam, 16-bit -> mixed-adam)")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    from_config.add_file_options(est.add_argument_group(
        "the training configuration you have", "--from FILE reads the settings from the file: a DeepSpeed, "
        "Trainer, accelerate, Axolotl, torchtune or torchtitan config; --model, --gpus, --batch-size, --seq-len "
        "and --gpu fill in what it does not say (nothing else applies)"), required=False)

    plan = commands["plan"] = sub.add_parser("plan", help="dp x tp x pp (x ZeRO-1) layouts of N GPUs that fit, fastest first")
    _model_source(plan)
    plan.add_argument("--gpus", type=_COUNT, required=True, help="GPUs in all")
    _gpu_arg(plan)
    plan.add_argument("--seq-len", type=_COUNT, required=True, help="tokens per sequence")
    plan.add_argument("--global-batch", type=_COUNT, default=512, help="sequences per optimizer step (default 512)")
    plan.add_argument("--micro-batch-size", type=_COUNT, default=1, help="sequences per micro-batch (default 1)")
    plan.add_argument("--gpus-per-node", type=_COUNT, default=8, help="tensor parallelism stays within a node (default 8)")
    plan.add_argument("--precision", default="bf16-mixed", choices=P.PRECISIONS, help="default bf16-mixed")
    plan.add_argument("--top", type=_COUNT, default=10, metavar="K", help="show K layouts (default 10)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    lora = commands["lora"] = sub.add_parser("lora", help="fine-tuning memory: full, LoRA, LoRA on INT8, QLoRA, "
                                                           "prompt, prefix and P-tuning")
    _model_source(lora)
    lora.add_argument("--method", default="lora", choices=LORA_METHODS, help="default lora")
    _sizes(lora)
    lora.add_argument("--rank", type=_COUNT, default=16, help="LoRA rank (default 16)")
    lora.add_argument("--virtual-tokens", type=_COUNT, default=None, metavar="P",
                      help="prompt, prefix, p-tuning: peft's num_virtual_tokens (default 20)")
    lora.add_argument("--prefix-projection", action="store_true",
                      help="prefix: the reparameterisation MLP (peft's prefix_projection=True)")
    lora.add_argument("--targets", default="default", choices=("default", "all-linear"),
                      help="default: peft's default target modules for the architecture")
    lora.add_argument("--precision", default=None, choices=P.PRECISIONS,
                      help="the base's (default: bf16 for LoRA, bf16-mixed for full; qlora and lora-int8 compute in bf16)")
    lora.add_argument("--optimizer", default="adamw", choices=memory.OPTIMIZERS, help="default adamw")
    lora.add_argument("--recompute", default="none", metavar="PLAN",
                      help="gradient checkpointing (default none): full, every-K, first-N, ...")
    _gpu_arg(lora)
    lora.add_argument("--json", action="store_true", help="print one JSON object")

    off = commands["offload"] = sub.add_parser("offload", help="host memory instead of the GPU's: save_on_cpu, "
                                                                 "ZeRO-Offload, FSDP2's CPUOffloadPolicy")
    _model_source(off)
    off.add_argument("--scheme", required=True, choices=OFFLOAD_SCHEMES)
    _sizes(off)
    _gpu_arg(off)
    off.add_argument("--json", action="store_true", help="print one JSON object")

    ck = commands["checkpoint"] = sub.add_parser("checkpoint", help="activation checkpointing: every plan's peak and "
                                                                     "recompute, the least recompute that fits")
    _model_source(ck)
    _sizes(ck)
    _gpu_arg(ck)
    ck.add_argument("--precision", default="bf16-mixed", choices=P.PRECISIONS, help="default bf16-mixed")
    ck.add_argument("--optimizer", default="adamw", choices=memory.OPTIMIZERS, help="default adamw")
    ck.add_argument("--attention", default="sdpa", choices=activations.ATTENTIONS)
    ck.add_argument("--plan", default=None, metavar="PLAN",
                    help="also show this plan (every-K, first-N, segments-K, ...) and its breakdown")
    ck.add_argument("--json", action="store_true", help="print one JSON object")

    cx = commands["context"] = sub.add_parser("context", help="context parallelism: one rank of ring attention or "
                                                               "Ulysses at long context, against every CP size")
    _model_source(cx)
    cx.add_argument("--seq-len", type=_COUNT, required=True, help="tokens per sequence (the whole sequence, all ranks)")
    cx.add_argument("--batch-size", type=_COUNT, default=1, help="sequences per step (default 1)")
    cx.add_argument("--cp", type=_COUNT, required=True, help="ranks the sequence is split over")
    cx.add_argument("--method", default="ring", choices=PAR.CP_METHODS,
                    help="ring attention (K/V blocks passed round a ring) or Ulysses (all-to-all over heads); default ring")
    cx.add_argument("--contiguous", action="store_true",
                    help="ring: contiguous shards instead of zig-zag chunks (the causal load imbalance)")
    cx.add_argument("--precision", default="bf16-mixed", choices=P.PRECISIONS, help="default bf16-mixed")
    cx.add_argument("--optimizer", default="adamw", choices=memory.OPTIMIZERS, help="default adamw")
    cx.add_argument("--recompute", default="none", choices=PAR.CP_RECOMPUTE,
                    help="full: every block checkpointed (its attention and its K/V transfers run again); default none")
    cx.add_argument("--loss", default="whole", choices=memory.LOSSES,
                    help="the loss on the rank's tokens: whole, chunked (torchtune's) or fused (Liger's); default whole")
    cx.add_argument("--fsdp", action="store_true",
                    help="FSDP2 over the CP ranks: the model states sharded too (torchtitan's dp_shard x cp); "
                         "fp32 or bf16-mixed, AdamW")
    _gpu_arg(cx)
    cx.add_argument("--link", default="nvlink4", choices=tuple(COLL.LINKS), help="between the CP ranks (default nvlink4)")
    cx.add_argument("--json", action="store_true", help="print one JSON object")

    xp = commands["experts"] = sub.add_parser("experts", help="expert parallelism: one rank's experts, states, dispatch "
                                                              "buffers and all-to-alls, against every EP size")
    xp.add_argument("--model", required=True, help=f"a mixture-of-experts preset: {', '.join(specs.moe_preset_names())}")
    xp.add_argument("--ep", type=_COUNT, required=True, help="ranks each MoE layer's routed experts are split over")
    xp.add_argument("--dp", type=_COUNT, required=True, help="data-parallel ranks in all (ep divides it; with --tp/--pp, "
                    "ep x etp divides tp x dp)")
    xp.add_argument("--tp", type=_COUNT, default=1, help="tensor-parallel ranks (default 1): with --pp/--etp, one rank's "
                    "states under Megatron-Core's parallel folding, per pipeline stage")
    xp.add_argument("--pp", type=_COUNT, default=1, help="pipeline stages (default 1)")
    xp.add_argument("--etp", type=_COUNT, default=1, help="ranks each routed expert is split over (default 1)")
    _sizes(xp, "sequences a rank a step")
    xp.add_argument("--capacity-factor", type=float, default=None, metavar="F",
                    help="each expert's buffer holds F x tokens x top-k / experts rows, the rest dropped (default: dropless)")
    xp.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                    help="ZeRO stage over the dense (dp) and the expert (dp/ep) groups (default 0)")
    xp.add_argument("--precision", default="bf16-mixed", choices=P.PRECISIONS, help="default bf16-mixed")
    xp.add_argument("--link", default="nvlink4", choices=tuple(COLL.LINKS), help="between the EP ranks (default nvlink4)")
    xp.add_argument("--json", action="store_true", help="print one JSON object")

    sv = commands["serve"] = sub.add_parser("serve", help="serving with a paged KV cache (vLLM's accounting): the pool, "
                                                          "blocks, concurrent requests, tokens/s bounds")
    _model_source(sv)
    _gpu_arg(sv)
    sv.add_argument("--prompt-len", type=_COUNT, required=True, help="prompt tokens a request")
    sv.add_argument("--output-len", type=_COUNT_0, required=True, help="tokens generated a request")
    sv.add_argument("--utilization", type=float, default=0.9, metavar="F",
                    help="vLLM's gpu_memory_utilization: the share of the GPU the engine may take (default 0.9)")
    sv.add_argument("--dtype", default="bf16", choices=tuple(SERVE.WEIGHT_DTYPES), help="the weights' (default bf16)")
    sv.add_argument("--kv-dtype", default=None, choices=tuple(SERVE.KV_DTYPES),
                    help="the KV cache's (default: the weights' 16-bit dtype)")
    sv.add_argument("--block-size", type=_COUNT, default=16, help="tokens a KV block (vLLM's default 16)")
    sv.add_argument("--tp", type=_COUNT, default=1, help="tensor-parallel GPUs: the weights and KV heads split (default 1)")
    sv.add_argument("--shared-prefix", type=_COUNT_0, default=0, metavar="TOKENS",
                    help="a system prompt at the start of every prompt: its full blocks are held once (prefix caching)")
    sv.add_argument("--n", type=_COUNT, default=1, help="sequences a request (parallel sampling or beams: the prompt's "
                                                        "full blocks shared among them; default 1)")
    sv.add_argument("--draft-model", default=None, metavar="PRESET", help="speculative decoding's draft model (a preset)")
    sv.add_argument("--speculative-tokens", type=_COUNT_0, default=0, metavar="K", help="tokens the draft proposes a step")
    sv.add_argument("--activation-peak-gib", type=float, default=0.0, metavar="GIB",
                    help="the profile run's activation peak vLLM measures at start-up (default 0: not known here)")
    sv.add_argument("--max-num-seqs", type=_COUNT, default=256, help="vLLM's max_num_seqs (default 256): sequences a "
                                                                     "step at most, and the verify logits' rows")
    sv.add_argument("--json", action="store_true", help="print one JSON object")

    commands["explain"] = _explain.add_parser(sub)
    commands["presets"] = sub.add_parser("presets", help="list the built-in models")
    commands["gpus"] = sub.add_parser("gpus", help="list the GPU catalogue")
    p.commands = commands
    return p


_PARSER: argparse.ArgumentParser | None = None


def _parser() -> argparse.ArgumentParser:
    global _PARSER
    if _PARSER is None:
        _PARSER = build_parser()
    return _PARSER


# ----------------------------------------------------------------------------- the command line of a namespace

def _options(command: str):
    return [a for a in _parser().commands[command]._actions if not isinstance(a, argparse._HelpAction)]


def _flag_tokens(a: argparse.Action, v) -> list[str]:
    if not a.option_strings:
        return [str(v)]
    name = max(a.option_strings, key=len)
    if isinstance(a, argparse._StoreTrueAction):
        return [name] if v else []
    return [] if v is None or v == a.default else [name, str(v)]


def argv_of(ns: argparse.Namespace) -> list[str]:
    """The command line (without `vramlab` and --json) that parses to `ns`."""
    out = [ns.command]
    for a in _options(ns.command):
        if a.dest != "json":
            out += _flag_tokens(a, getattr(ns, a.dest, a.default))
    return out


def _changed_flags(old: argparse.Namespace, new: argparse.Namespace) -> str:
    """What `new` sets differently from `old`, as flags (a flag set back to its default: '--zero -')."""
    if old.command != new.command:
        return "vramlab " + " ".join(argv_of(new))
    out, dropped = [], []
    for a in _options(new.command):
        v, w = getattr(old, a.dest, a.default), getattr(new, a.dest, a.default)
        if a.dest != "json" and v != w:
            tokens = _flag_tokens(a, w)
            out += tokens
            dropped += [] if tokens else [max(a.option_strings, key=len)]
    return " ".join(out + ([f"(without {', '.join(dropped)})"] if dropped else []))


def _defaults(command: str, **values) -> argparse.Namespace:
    ns = argparse.Namespace(command=command, **{a.dest: a.default for a in _options(command)})
    for k, v in values.items():
        setattr(ns, k, v)
    return ns


# ----------------------------------------------------------------------------- one answer per command

@dataclass(frozen=True)
class Answer:
    """Does it fit: bytes needed on the fullest GPU (`fitting.device_fit`) of what is usable, and the
    largest batch (`of` says which) that fits, where searched."""

    fits: bool
    needed: int
    available: int
    largest: int | None = None
    of: str = "batch size"
    capped: bool = False
    note: str = ""

    def short(self) -> str:
        s = f"{fmt_bytes(self.needed)}, {'fits' if self.fits else 'does NOT fit'}"
        if self.largest:
            s += f", {self.of} ≤ {self.largest:,}" + ("+" if self.capped else "")
        return s + (f"; {self.note}" if self.note else "")

    def to_dict(self) -> dict:
        return {"fits": self.fits, "needed_bytes": self.needed, "usable_bytes": self.available,
                "largest": self.largest, "largest_of": self.of, "note": self.note}


_SPECS: dict = {}


def _spec(ns) -> specs.ModelSpec:
    key = (ns.model, ns.hf_config)
    if key not in _SPECS:
        _SPECS[key] = specs.preset(ns.model) if ns.model else specs.from_config(ns.hf_config)
    return _SPECS[key]


def _gpu(ns) -> specs.GPUSpec | None:
    return specs.gpu(ns.gpu) if ns.gpu is not None else None


def _is_sharded(ns) -> bool:
    return ns.command == "estimate" and (ns.zero is not None or ns.fsdp2)


def _galore(ns) -> dict:
    """--galore-rank, which only GaLore takes."""
    if ns.galore_rank is None:
        return {}
    if ns.optimizer != "galore-adamw":
        raise ValueError("--galore-rank is GaLore's projection rank: give --optimizer galore-adamw too")
    return {"galore_rank": ns.galore_rank}


def _estimate_options(ns) -> tuple[dict, argparse.Namespace]:
    """estimate's options for the library, after every check that spans flags."""
    spec, gpu = _spec(ns), _gpu(ns)
    only = {"train": ("optimizer", "optimizer_impl", "recompute", "zero", "gpus", "recipe", "accumulation_steps", "loss",
                      "loss_chunk_tokens", "capacity_factor", "optimizer_in_backward", "galore_rank"),
            "infer": ("new_tokens",)}
    for mode, flags in only.items():
        given = [f for f in flags if getattr(ns, f) is not None] + (["fsdp2"] if mode == "train" and ns.fsdp2 else [])
        if mode != ns.mode and given:
            raise ValueError(f"--{given[0].replace('_', '-')} does not apply to 'estimate {ns.mode}' "
                             f"(it is for 'estimate {mode}')")
    if gpu and ns.device != "cuda":
        raise ValueError("--gpu checks the fit on a GPU: leave --device at cuda")
    if ns.expandable_segments and not gpu:
        raise ValueError("--expandable-segments changes the fit on a GPU: give --gpu too")
    if ns.mode == "infer":
        if ns.new_tokens is not None:
            checks.has_decoder(spec, "--new-tokens (generation; leave it out for a prefill)")
        return dict(seq_len=ns.seq_len, dtype=ns.precision or "bf16", attention=ns.attention,
                    new_tokens=ns.new_tokens, device=ns.device), ns
    if not _is_sharded(ns):
        for f in ("gpus", "recipe"):
            if getattr(ns, f) is not None:
                raise ValueError(f"--{f} is for one rank of many: give --zero 0-3 or --fsdp2 too "
                                 "(tensor and pipeline parallelism: `vramlab plan`)")
        return dict(seq_len=ns.seq_len, precision=ns.precision or "fp32", optimizer=ns.optimizer or "adamw",
                    optimizer_impl=ns.optimizer_impl or "foreach", attention=ns.attention,
                    recompute=ns.recompute or "none", device=ns.device,
                    accumulation_steps=ns.accumulation_steps or 1, loss=ns.loss or "whole",
                    loss_chunk_tokens=ns.loss_chunk_tokens, capacity_factor=ns.capacity_factor,
                    optimizer_in_backward=bool(ns.optimizer_in_backward), **_galore(ns)), ns
    if ns.loss is not None or ns.loss_chunk_tokens is not None:
        raise ValueError("--loss prices one GPU's step: leave it out with --zero/--fsdp2 (zero.estimate_rank models the "
                         "whole loss)")
    if ns.capacity_factor is not None or spec.is_moe:
        raise ValueError("a mixture of experts is priced on one GPU (`estimate train`) or split over ranks by expert "
                         "parallelism (parallel.expert_parallel); ZeRO and FSDP ranks are modelled for dense models")
    if ns.fsdp2 and ns.zero not in (None, 3):
        raise ValueError(f"--fsdp2 shards like ZeRO-3: leave --zero out (or give --zero 3), not --zero {ns.zero}")
    if ns.recompute is not None:
        raise ValueError("--recompute does not apply with --zero/--fsdp2: zero.estimate_rank models no activation "
                         "checkpointing (layouts that recompute: `vramlab plan`)")
    if ns.optimizer not in (None, "adam", "adamw"):
        raise ValueError(f"--optimizer {ns.optimizer}: ZeRO and FSDP are estimated with Adam(W) only")
    if ns.optimizer_in_backward or ns.galore_rank is not None:
        raise ValueError(f"--{'optimizer-in-backward' if ns.optimizer_in_backward else 'galore-rank'} is modelled on "
                         "one GPU: leave out --zero/--fsdp2")
    if ns.device != "cuda":
        raise ValueError("--zero/--fsdp2 estimate a GPU rank: leave --device at cuda")
    if ns.recipe is not None and ns.precision is not None:
        raise ValueError("give --precision or --recipe with --zero/--fsdp2, not both (--recipe says the bytes per "
                         "parameter directly)")
    recipe = ns.recipe
    if recipe is None:
        precision = ns.precision or "fp32"
        if precision not in ZERO_RECIPE:
            checks.one_of("precision", precision, P.PRECISIONS)
            raise ValueError(f"--precision {precision} (bf16 optimizer states) is not a ZeRO recipe: DeepSpeed and "
                             "FSDP keep fp32 master weights and Adam states; use --precision bf16-mixed")
        recipe = ZERO_RECIPE[precision]
    return dict(recipe=recipe, implementation="fsdp2" if ns.fsdp2 else "deepspeed", attention=ns.attention,
                optimizer_impl=ns.optimizer_impl or "fused", accumulation_steps=ns.accumulation_steps or 1), ns


def _stage(ns) -> int:
    return 3 if ns.fsdp2 else ns.zero


def _answer_estimate(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    spec, gpu = _spec(ns), _gpu(ns)
    if gpu is None:
        raise ValueError("give --gpu to check the fit")
    options, _ = _estimate_options(ns)
    if _is_sharded(ns):
        f = Z.fits(spec, ns.gpus or 1, _stage(ns), gpu, micro_batch_size=ns.batch_size, seq_len=ns.seq_len,
                   expandable_segments=ns.expandable_segments, max_search=1 << 12 if search else 1, **options)
        f = dataclasses.replace(f, batch_size=ns.batch_size)
        of = "micro-batch"
    else:
        fit_options = {k: v for k, v in options.items() if k != "device"}
        f = fitting.fit(spec, gpu, batch_size=ns.batch_size, mode=ns.mode, expandable_segments=ns.expandable_segments,
                        max_search=1 << 16 if search else 1, **fit_options)
        of = "batch size"
    return Answer(f.fits, f.needed, f.available, f.max_batch_size if search else None, of, f.capped), f


def _largest(fits: Callable[[int], bool], start: int, search: bool, limit: int = 1 << 12) -> tuple[int | None, bool]:
    if not search:
        return None, False
    lo = fitting.largest_true(fits, start=start, limit=limit)
    return lo, lo >= limit


def _prompt_options(ns) -> dict:
    """peft_training's prompt-learning options, refusing the flags that belong to another method."""
    if ns.method in PROMPT_METHODS:
        if ns.prefix_projection and ns.method != "prefix":
            raise ValueError(f"--prefix-projection is prefix tuning's reparameterisation MLP, not {ns.method}'s")
        return dict(num_virtual_tokens=ns.virtual_tokens or 20, prefix_projection=ns.prefix_projection)
    if ns.virtual_tokens is not None or ns.prefix_projection:
        raise ValueError(f"--virtual-tokens and --prefix-projection are for prompt, prefix and p-tuning, not {ns.method}")
    return {}


def _lora_precision(ns) -> str:
    if ns.method in ("qlora", "lora-int8") and ns.precision not in (None, "bf16"):
        raise ValueError(f"--precision {ns.precision} does not apply to {ns.method}: its quantized base computes in "
                         "bf16 (adapters fp32); leave --precision out")
    return ns.precision or LORA_PRECISION[ns.method]


def _lora_fit(ns, batch_size: int) -> tuple[memory.MemoryBreakdown, fitting.Fit]:
    """As the compression calculator: `peft_training` against `fitting.device_fit` (fragmentation as
    bf16 AMP's, or fp32's for an fp32 step)."""
    spec, g, precision = _spec(ns), _gpu(ns), _lora_precision(ns)
    peak = COMP.peft_training(spec, method=ns.method, rank=ns.rank, targets=ns.targets, batch_size=batch_size,
                              seq_len=ns.seq_len, precision=precision, optimizer=ns.optimizer, recompute=ns.recompute,
                              gpu=g, **_prompt_options(ns))
    frag = fitting.fragmentation_bytes(spec, batch_size=batch_size, seq_len=ns.seq_len, mode="train",
                                       precision="fp32" if precision == "fp32" else "bf16-mixed")
    return peak, fitting.device_fit(peak, g, largest_tensor=frag)


def _answer_lora(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    _, f = _lora_fit(ns, ns.batch_size)
    lo, capped = _largest(lambda b: _lora_fit(ns, b)[1].fits, ns.batch_size, search)
    return Answer(f.fits, f.needed, f.available, lo, "batch size", capped), dataclasses.replace(
        f, max_batch_size=lo, capped=capped, batch_size=ns.batch_size)


def _offload_rows(spec, g, batch_size: int, seq_len: int, schemes=("none",) + OFFLOAD_SCHEMES) -> dict:
    """As the offload calculator: scheme -> (GPU peak, host bytes, bytes over PCIe, step seconds)."""
    kw = dict(batch_size=batch_size, seq_len=seq_len)
    gpu_s = CK.evaluate(spec, "none", precision="bf16-mixed", gpu=g, **kw).step_seconds  # at CK.MFU
    rows = {}
    if {"none", "save-on-cpu"} & set(schemes):
        act = OFF.activation_offload(spec, precision="bf16-mixed", gpu=g, baseline_seconds=gpu_s, **kw)
        rows["none"] = (act.baseline_peak, 0, 0, gpu_s)
        rows["save-on-cpu"] = (act.gpu_peak, act.host_bytes, 2 * act.moved_bytes, act.step_seconds)
    for s in ("zero-offload", "fsdp2-cpu"):
        if s in schemes:
            m = OFF.model_offload(spec, scheme=s, gpu=g, gpu_seconds=gpu_s, **kw)
            rows[s] = (m.gpu_peak, m.host_bytes, m.moved_bytes, m.step_seconds)
    return {s: rows[s] for s in schemes}


def _offload_fit(ns, batch_size: int, scheme: str | None = None) -> fitting.Fit:
    spec, g = _spec(ns), _gpu(ns)
    peak = _offload_rows(spec, g, batch_size, ns.seq_len, (scheme or ns.scheme,))[scheme or ns.scheme][0]
    frag = fitting.fragmentation_bytes(spec, precision="bf16-mixed", batch_size=batch_size, seq_len=ns.seq_len)
    return fitting.device_fit(peak, g, largest_tensor=frag)


def _answer_offload(ns, search: bool = True) -> tuple[Answer, fitting.Fit]:
    f = _offload_fit(ns, ns.batch_size)
    lo, capped = _largest(lambda b: _offload_fit(ns, b).fits, ns.batch_size, search)
    return Answer(f.fits, f.needed, f.available, lo, "batch size", capped), dataclasses.replace(
        f, max_batch_size=lo, capped=capped, batch_size=ns.batch_size)


def _ck_kw(ns, batch_size: int) -> dict:
    return dict(batch_size=batch_size, seq_len=ns.seq_len, precision=ns.precision, optimizer=ns.optimizer,
                attention=ns.attention, gpu=_gpu(ns))


def _some_plan_fits(spec, kw: dict) -> bool:
    """Whether a plan fits, quickly: checkpointing every block, on the GPU or offloaded, keeps the least
    (a plan that fits beside them is what `cheapest_plan` then finds)."""
    return any(CK.evaluate(spec, p, **kw).fit.fits for p in ("full", "offload"))


def _answer_checkpoint(ns, search: bool = True) -> tuple[Answer, CK.PlanResult | None]:
    spec = _spec(ns)
    if not search:
        if not _some_plan_fits(spec, _ck_kw(ns, ns.batch_size)):
            r = CK.evaluate(spec, "full", **_ck_kw(ns, ns.batch_size))
            return Answer(False, r.fit.needed, r.fit.available, None, "batch size"), None
    best = CK.cheapest_plan(spec, None, **_ck_kw(ns, ns.batch_size))
    lo, capped = _largest(lambda b: _some_plan_fits(spec, _ck_kw(ns, b)), ns.batch_size, search)
    while search and not capped and CK.cheapest_plan(spec, None, **_ck_kw(ns, lo + 1)) is not None:
        lo += 1  # a plan between the two found room for one more sequence
    if best is not None:
        return Answer(True, best.fit.needed, best.fit.available, lo, "batch size", capped,
                      note=f"recompute {best.plan.name}"), best
    weighed = CK.PLANS if search else ("full",)
    least = min((CK.evaluate(spec, p, **_ck_kw(ns, ns.batch_size)) for p in weighed), key=lambda r: r.fit.needed)
    return Answer(False, least.fit.needed, least.fit.available, lo, "batch size", capped,
                  note=f"least memory: recompute {least.plan.name}"), None


def _plans(ns, recomputes=PAR.RECOMPUTE) -> list[PAR.LayoutPlan]:
    plans = PAR.plan_layouts(_spec(ns), ns.gpus, _gpu(ns), seq_len=ns.seq_len, global_batch=ns.global_batch,
                             micro_batch_size=ns.micro_batch_size, gpus_per_node=ns.gpus_per_node,
                             precision=ns.precision, recomputes=recomputes)
    if not plans:
        raise ValueError(f"no dp x tp x pp layout of {ns.gpus} GPUs: tp must divide the heads and the MLP width "
                         f"(at most --gpus-per-node {ns.gpus_per_node}), and dp x micro-batch size must divide "
                         f"--global-batch {ns.global_batch}")
    return plans


def _answer_plan(ns, search: bool = True) -> tuple[Answer, list]:
    # the least memory a layout can have is under full recompute: screening weighs that plan alone
    plans = _plans(ns, PAR.RECOMPUTE if search else ("full",))
    ok = [x for x in plans if x.fit.fits]
    top = ok[0] if ok else plans[0]
    note = (f"fastest: {top.name}, {top.tokens_per_s:,.0f} tokens/s" if ok and search
            else f"{top.name}" + ("" if ok else " needs the least"))
    return Answer(bool(ok), top.fit.needed, top.fit.available, None, "", note=note), plans


CP_SWEEP = (1, 2, 4, 8, 16, 32, 64)  # the CP sizes the context command sets beside the one asked for


def _cp_rank(ns, cp: int, batch_size: int | None = None) -> tuple[dict, fitting.Fit]:
    """One CP rank and its fit (`parallel.context_fit`)."""
    return PAR.context_fit(_spec(ns), _gpu(ns), cp=cp, method=ns.method,
                           batch_size=ns.batch_size if batch_size is None else batch_size, seq_len=ns.seq_len,
                           precision=ns.precision, optimizer=ns.optimizer, zigzag=not ns.contiguous, link=ns.link,
                           recompute=ns.recompute, loss=ns.loss, shard_states=ns.fsdp)


def _answer_context(ns, search: bool = True) -> tuple[Answer, tuple[dict, fitting.Fit]]:
    here = _cp_rank(ns, ns.cp)
    fit = here[1]
    lo, capped = _largest(lambda b: _cp_rank(ns, ns.cp, b)[1].fits, ns.batch_size, search)
    return Answer(fit.fits, fit.needed, fit.available, lo, "batch size", capped,
                  note=f"{ns.method}, {here[0]['tokens_per_rank']:,} tokens a rank"), here


ANSWERS: dict[str, Callable] = {"estimate": _answer_estimate, "lora": _answer_lora, "offload": _answer_offload,
                                "checkpoint": _answer_checkpoint, "plan": _answer_plan, "context": _answer_context}


def answer(ns, search: bool = True) -> Answer:
    """Does the configuration `ns` (a parsed command line) fit? With `search`, the largest batch too."""
    return ANSWERS[ns.command](ns, search)[0]


# ----------------------------------------------------------------------------- the next levers

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
        return _defaults(change["command"], **{k: v for k, v in change.items() if k != "command"})
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
    if ns.command == "estimate" and _is_sharded(ns):
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
        spec = _spec(ns)
        plans = []
        try:
            best = CK.cheapest_plan(spec, None, batch_size=ns.batch_size, seq_len=ns.seq_len,
                                    precision=ns.precision or "fp32", optimizer=ns.optimizer or "adamw",
                                    attention=ns.attention, gpu=_gpu(ns))
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
        L.append(Lever(tuple({"method": m, "contiguous": False} for m in PAR.CP_METHODS if m != ns.method)))
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
        flags = _changed_flags(ns, new)
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


def _answer_out(ns, out: dict, here: Answer, *, fits, per: str = "") -> int:
    """Every subcommand ends here: the next levers when it does not fit (printed, and kept in `out`), then
    `--json`'s one object."""
    if not fits:
        out["suggestions"] = _print_suggestions(ns, here, per)
    if ns.json:
        print(json.dumps(out, indent=2))
    return 0


def _print_suggestions(ns, here: Answer, per: str = "") -> list[dict]:
    sugg, found = _suggest(ns, here)
    if not ns.json:
        print()
        print(_suggestion_table(ns, here, sugg, found, per))
    return [s.to_dict() for s in sugg]


# ----------------------------------------------------------------------------- the commands

def _fit_json(f: fitting.Fit) -> dict:
    return {"name": f.gpu.name, "usable_bytes": f.available, "fits": f.fits, "needed_bytes": f.needed,
            "reserve_bytes": f.reserve,
            "reserve": {"estimate_margin_bytes": f.margin, "fragmentation_bytes": f.fragmentation,
                        "cuda_context_bytes": f.context},
            "expandable_segments": f.expandable_segments, "max_batch_size": f.max_batch_size}


def _estimate(ns) -> int:
    if ns.from_file is not None:  # the training configuration the user has
        return from_config.answer_from(ns)
    spec, gpu = _spec(ns), _gpu(ns)
    options, _ = _estimate_options(ns)
    if _is_sharded(ns):
        return _estimate_rank(ns, spec, gpu, options)
    if ns.mode == "train":
        est = memory.estimate_training(spec, batch_size=ns.batch_size, gpu=gpu, **options)
    else:
        est = memory.estimate_inference(spec, batch_size=ns.batch_size, gpu=gpu, **options)
    here = verdict = None
    if gpu:
        here, verdict = _answer_estimate(ns)
    out = {"model": spec.name, "model_type": spec.model_type, "mode": ns.mode, "params": spec.params,
           "batch_size": ns.batch_size, "seq_len": ns.seq_len, "options": options,
           "total_bytes": est.total, "breakdown": est.to_dict(), "peak_phase": est.phase}
    longest = None
    if verdict:  # the other question a GPU answers: the longest sequence at this batch size
        longest = fitting.longest_sequence(spec, gpu, batch_size=ns.batch_size, mode=ns.mode,
                                           expandable_segments=ns.expandable_segments,
                                           **{k: v for k, v in options.items() if k not in ("seq_len", "device")})
    if not ns.json:
        print(f"{spec.name}: {spec.params:,} parameters ({spec.model_type})")
        print(est.table())
        if verdict:
            print(verdict)
            print(verdict.explain())
            print(longest)
    if verdict:
        out["gpu"] = _fit_json(verdict)
        out["gpu"]["longest_seq_len"] = longest.seq_len
        out["gpu"]["longest_seq_len_capped_by_positions"] = longest.capped
        if not verdict.fits:
            out["suggestions"] = _print_suggestions(ns, here)
    if ns.json:
        print(json.dumps(out, indent=2))
    return 0


def _estimate_rank(ns, spec, gpu, options: dict) -> int:
    n, stage = ns.gpus or 1, _stage(ns)
    setup = "FSDP2" if ns.fsdp2 else f"ZeRO-{stage}"
    kw = dict(micro_batch_size=ns.batch_size, seq_len=ns.seq_len, gpu=gpu, **options)
    est = Z.estimate_rank(spec, n, stage, **kw)
    desc = (f"{setup} ({'FSDP2' if ns.fsdp2 else 'DeepSpeed'}), {n} rank{'s' if n > 1 else ''}, recipe "
            f"{options['recipe']} ({'+'.join(map(str, Z.RECIPES[options['recipe']]))} bytes per parameter), "
            f"micro-batch {ns.batch_size} x {ns.seq_len}")
    out = {"model": spec.name, "model_type": spec.model_type, "mode": "train", "params": spec.params,
           "setup": setup, "ranks": n, "micro_batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "options": {**options, "stage": stage}, "total_bytes": est.total, "breakdown": est.to_dict(),
           "peak_phase": est.phase}
    if not ns.json:
        print(f"{spec.name}: {spec.params:,} parameters ({spec.model_type}); {desc}")
        print(est.table(title=f"one rank's peak: {est.label}"))
    if gpu is None:
        if ns.json:
            print(json.dumps(out, indent=2))
        return 0
    here, verdict = _answer_estimate(ns)
    others = {k: v for k, v in options.items() if k != "implementation"}
    rows, setups = [], []
    for name, s, impl in [(f"ZeRO-{s}", s, "deepspeed") for s in Z.STAGES] + [("FSDP2", 3, "fsdp2")]:
        try:
            f = Z.fits(spec, n, s, gpu, micro_batch_size=ns.batch_size, seq_len=ns.seq_len,
                       expandable_segments=ns.expandable_segments, implementation=impl, **others)
        except ValueError:
            continue
        mine = name == setup
        cell = (lambda t: Cell(t, "strong")) if mine else str
        rows.append([cell(name), fmt_bytes(f.estimate), fmt_bytes(f.needed),
                     Cell("yes", "good") if f.fits else Cell("NO", "bad"), f"{f.max_batch_size:,}"])
        setups.append({"setup": name, "estimate_bytes": f.estimate, "needed_bytes": f.needed, "fits": f.fits,
                       "max_micro_batch_size": f.max_batch_size})
    out["gpu"] = {**_fit_json(verdict), "max_micro_batch_size": verdict.max_batch_size}
    out["setups"] = setups
    largest = f"{verdict.max_batch_size:,}" + (" or more" if verdict.capped else "")
    yes = (f"{'YES' if verdict.fits else 'NO'}: {spec.name} with {setup} on {n} x {gpu.name} "
           f"{'fits' if verdict.fits else 'does NOT fit'} ({fmt_bytes(verdict.needed)} needed a rank, "
           f"{fmt_bytes(verdict.available)} usable); largest micro-batch that fits: {largest}")
    out["answer"] = yes
    if not ns.json:
        print(Table(["setup", "one rank's peak", "needs", "fits", "largest micro-batch"], rows,
                    caption=f"every setup on {n} x {gpu.name}, micro-batch {ns.batch_size} x {ns.seq_len}, "
                            f"{options['recipe']}",
                    notes=["needs: the peak + 3 % margin + fragmentation + CUDA context (fitting.device_fit)"]))
        print()
        print(yes)
        print(verdict.explain())
    return _answer_out(ns, out, here, fits=verdict.fits, per=" a rank")


def _plan(ns) -> int:
    spec = _spec(ns)
    here, plans = _answer_plan(ns)
    ok = [x for x in plans if x.fit.fits]
    shown = (ok or plans)[:ns.top]

    def row(x: PAR.LayoutPlan) -> list:
        return [x.name, fmt_bytes(x.peak.total), fmt_bytes(x.fit.needed),
                Cell("yes", "good") if x.fit.fits else Cell("NO", "bad"), f"{x.tokens_per_s:,.0f}",
                f"{float(x.bubble):.1%}", f"+{x.recompute_fraction:.0%}"]
    g = _gpu(ns)
    caption = (f"{spec.name} on {ns.gpus} x {g.name}: {len(ok)} of {len(plans)} layouts fit ({ns.global_batch} "
               f"sequences of {ns.seq_len} tokens a step, micro-batch {ns.micro_batch_size}, {ns.precision}, "
               f"AdamW fused, 1F1B)" + ("" if ok else "; the closest:"))
    table = Table(["layout", "fullest GPU", "needs", "fits", "tokens/s", "bubble", "recompute"],
                  [row(x) for x in shown], caption=caption,
                  notes=["time: a roofline at 40 % of the GPU's 16-bit peak, the bubble (p-1)/m, tensor-parallel "
                         "all-reduces on NVLink and the pipeline's sends exposed; data-parallel all-reduce hidden"])
    out = {"model": spec.name, "gpus": ns.gpus, "gpu": g.name, "seq_len": ns.seq_len, "global_batch": ns.global_batch,
           "micro_batch_size": ns.micro_batch_size, "precision": ns.precision, "fits": bool(ok),
           "layouts_fitting": len(ok), "layouts": len(plans),
           "shown": [{"layout": x.name, "dp": x.layout.dp, "tp": x.layout.tp, "pp": x.layout.pp, "sp": x.layout.sp,
                      "zero": x.layout.zero, "recompute": x.recompute, "peak_bytes": x.peak.total,
                      "needed_bytes": x.fit.needed, "usable_bytes": x.fit.available, "fits": x.fit.fits,
                      "tokens_per_s": x.tokens_per_s, "step_seconds": x.step_seconds, "bubble": float(x.bubble),
                      "recompute_fraction": x.recompute_fraction} for x in shown]}
    if not ns.json:
        print(table)
        if ok:
            print()
            print(ok[0].peak.table(title=f"fastest that fits: {ok[0].name}; its fullest GPU, {ok[0].peak.label}"))
            print(ok[0].fit)
    return _answer_out(ns, out, here, fits=ok, per=" on the fullest GPU")


def _lora(ns) -> int:
    spec = _spec(ns)
    here, verdict = _answer_lora(ns)
    peak, _ = _lora_fit(ns, ns.batch_size)
    precision = _lora_precision(ns)
    if ns.method in PROMPT_METHODS:
        pl = COMP.prompt_learning(spec, method=ns.method, **_prompt_options(ns))
        n = pl.trainable
        trainable = (f"trainable: {n:,} of {spec.params + n:,} parameters ({100 * n / (spec.params + n):.3f} %; "
                     f"{ns.method} with {ns.virtual_tokens or 20} virtual tokens, as peft counts)")
    else:
        n = COMP.lora_params(spec, rank=ns.rank, targets=ns.targets) if ns.method != "full" else spec.params
        trainable = (f"trainable: {n:,} of {spec.params:,} parameters ({100 * n / spec.params:.3f} %; LoRA r={ns.rank} "
                     f"on {len(COMP.lora_targets(spec, ns.targets))} matrices, as peft counts)" if ns.method != "full"
                     else f"trainable: all {spec.params:,} parameters")
    out = {"model": spec.name, "method": ns.method, "rank": ns.rank, "targets": ns.targets, "precision": precision,
           "optimizer": ns.optimizer, "recompute": ns.recompute, "batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "trainable_params": n, "params": spec.params, "total_bytes": peak.total, "breakdown": peak.to_dict(),
           "peak_phase": peak.phase, "gpu": _fit_json(verdict)}
    if ns.method in PROMPT_METHODS:
        out.update(_prompt_options(ns))
        del out["rank"], out["targets"]
    if peak.warning:
        out["warning"] = peak.warning
    if not ns.json:
        print(peak.table(title=f"{ns.method}: {peak.label}"))
        if peak.warning:
            print(f"note: {peak.warning}")
        print(trainable)
        print(verdict)
        print(verdict.explain())
    return _answer_out(ns, out, here, fits=verdict.fits)


def _offload(ns) -> int:
    spec, g = _spec(ns), _gpu(ns)
    here, verdict = _answer_offload(ns)
    rows = _offload_rows(spec, g, ns.batch_size, ns.seq_len)
    frag = fitting.fragmentation_bytes(spec, precision="bf16-mixed", batch_size=ns.batch_size, seq_len=ns.seq_len)
    fits = {s: fitting.device_fit(r[0], g, largest_tensor=frag) for s, r in rows.items()}
    table = Table(["scheme", "GPU peak", "needs", "host memory", "over PCIe", "step", "fits"],
                  [[Cell(s, "strong") if s == ns.scheme else s, fmt_bytes(b.total), fmt_bytes(fits[s].needed),
                    fmt_bytes(h), fmt_bytes(m), f"{1e3 * t:,.0f} ms", Cell("yes", "good") if fits[s].fits else Cell("NO", "bad")]
                   for s, (b, h, m, t) in rows.items()],
                  caption=f"{spec.name}, {ns.batch_size} x {ns.seq_len}, bf16, on {g.name}: each offload scheme",
                  notes=[f"host link: PCIe {OFF.pcie_generation(g)}.0 x16, {OFF.host_link_GBps(g):.1f} GB/s each way "
                         f"(nominal), copies at {OFF.SAVE_ON_CPU_EFFICIENCY:.2f} of it; the step without offload at "
                         f"{100 * CK.MFU:.0f} % of the GPU's peak FLOP/s"])
    mine = rows[ns.scheme]
    out = {"model": spec.name, "scheme": ns.scheme, "batch_size": ns.batch_size, "seq_len": ns.seq_len,
           "gpu_peak_bytes": mine[0].total, "breakdown": mine[0].to_dict(), "host_bytes": mine[1],
           "moved_bytes": mine[2], "step_seconds": mine[3], "gpu": _fit_json(verdict),
           "schemes": {s: {"gpu_peak_bytes": b.total, "host_bytes": h, "moved_bytes": m, "step_seconds": t,
                           "needed_bytes": fits[s].needed, "fits": fits[s].fits} for s, (b, h, m, t) in rows.items()}}
    if not ns.json:
        print(table)
        print()
        print(mine[0].table(title=f"{ns.scheme}: {mine[0].label}"))
        print(verdict)
        print(verdict.explain())
    return _answer_out(ns, out, here, fits=verdict.fits)


def _checkpoint(ns) -> int:
    spec, g = _spec(ns), _gpu(ns)
    here, best = _answer_checkpoint(ns)
    kw = _ck_kw(ns, ns.batch_size)
    plans = list(CK.PLANS)
    if best is not None and best.plan.name not in plans:
        plans.append(best.plan.name)
    if ns.plan is not None:
        mine = CK.evaluate(spec, ns.plan, **kw)  # checks the plan
        if mine.plan.name not in plans:
            plans.append(mine.plan.name)
    results = {p: CK.evaluate(spec, p, **kw) for p in plans}
    rows = [[Cell(p, "strong") if best is not None and p == best.plan.name else p, fmt_bytes(r.peak.total),
             fmt_bytes(r.fit.needed), Cell("yes", "good") if r.fit.fits else Cell("NO", "bad"),
             f"+{100 * r.recompute_fraction:.1f} %", f"{1e3 * r.step_seconds:,.0f} ms", r.peak.phase]
            for p, r in results.items()]
    table = Table(["plan", "peak", "needs", "fits", "recompute", "step", "peak during"], rows,
                  caption=f"{spec.name}, batch {ns.batch_size} x {ns.seq_len}, {ns.precision}, on {g.name}: every plan",
                  notes=[f"recompute: extra FLOPs over the step's; step: FLOPs at {100 * CK.MFU:.0f} % of the GPU's "
                         "peak FLOP/s (offload: plus the copies)"], align="lrrcrrl")
    line = (f"least recompute that fits: {best.plan.name} ({fmt_bytes(best.peak.total)}, +"
            f"{100 * best.recompute_fraction:.1f} % FLOPs); largest batch size that fits with some plan: "
            f"{here.largest:,}" if best is not None else "no plan fits")
    out = {"model": spec.name, "batch_size": ns.batch_size, "seq_len": ns.seq_len, "precision": ns.precision,
           "gpu": g.name, "usable_bytes": g.usable_bytes, "fits": best is not None,
           "cheapest": None if best is None else {"plan": best.plan.name, "peak_bytes": best.peak.total,
                                                  "needed_bytes": best.fit.needed,
                                                  "recompute_fraction": best.recompute_fraction},
           "max_batch_size": here.largest,
           "plans": {p: {"peak_bytes": r.peak.total, "needed_bytes": r.fit.needed, "fits": r.fit.fits,
                         "recompute_fraction": r.recompute_fraction, "step_seconds": r.step_seconds,
                         "peak_phase": r.peak.phase} for p, r in results.items()}}
    if not ns.json:
        print(table)
        print()
        if ns.plan is not None:
            r = results[mine.plan.name]
            print(r.peak.table(title=f"plan {r.plan.name}: peak at {r.peak.phase}"))
            print(r.fit)
            print(r.fit.explain())
        print(line)
    return _answer_out(ns, out, here, fits=best is not None)


def _context(ns) -> int:
    spec, g = _spec(ns), _gpu(ns)
    here, (mine, fit) = _answer_context(ns)
    rows, sweep = [], {}
    for n in sorted(set(CP_SWEEP) | {ns.cp}):
        try:
            r, f = (mine, fit) if n == ns.cp else _cp_rank(ns, n)
        except ValueError:  # this size does not split the heads or the sequence: left out of the sweep
            continue
        c, a = r["comm_seconds_per_layer"], r["attention_seconds_per_layer"]
        sweep[n] = {"tokens_per_rank": r["tokens_per_rank"], "peak_bytes": r["peak"], "blocks_saved_bytes": r["blocks_saved"],
                    "needed_bytes": f.needed, "fits": f.fits,
                    "sent_per_layer_bytes": sum(r["sent_per_layer"].values()),
                    "comm_seconds_per_layer": sum(c.values()),
                    "attention_seconds_per_layer": sum(a.values()), "verdict": r["verdict"]}
        s = sweep[n]
        rows.append([Cell(str(n), "strong") if n == ns.cp else str(n), f"{s['tokens_per_rank']:,}",
                     fmt_bytes(s["blocks_saved_bytes"]), fmt_bytes(s["peak_bytes"]), fmt_bytes(s["needed_bytes"]),
                     Cell("yes", "good") if s["fits"] else Cell("NO", "bad"), fmt_bytes(s["sent_per_layer_bytes"]),
                     f"{1e3 * s['comm_seconds_per_layer']:.2f} / {1e3 * s['attention_seconds_per_layer']:.2f} ms",
                     "—" if n == 1 else s["verdict"]])
    shards = "contiguous shards" if not mine["zigzag"] else "zig-zag chunks"
    table = Table(["cp", "tokens a rank", "blocks save", "peak", "needs", "fits", "sent a layer",
                   "comm / attention a layer", "communication"], rows,
                  caption=f"{spec.name}, {ns.batch_size} x {ns.seq_len:,} tokens, {ns.precision}, "
                          + (f"recompute {ns.recompute}, " if ns.recompute != "none" else "")
                          + (f"{ns.loss} loss, " if ns.loss != "whole" else "") + f"{ns.method}"
                          + (f" ({shards})" if ns.method == "ring" else "")
                          + (", FSDP2 over the CP ranks" if ns.fsdp else "") + f", on {g.name}: one rank at each CP size",
                  notes=[f"comm / attention: forward + backward (+ the recomputed forward) seconds a layer, the transfers "
                         f"on {ns.link} (alpha-beta), "
                         f"attention at 40 % of {g.name}'s peak FLOP/s; hidden: the ring's transfers run under its "
                         "attention; Ulysses' all-to-alls are exposed by construction"], align="rrrrrcrrl")
    out = {"model": spec.name, "method": ns.method, "cp": ns.cp, "zigzag": mine["zigzag"], "recompute": ns.recompute,
           "loss": ns.loss, "fsdp": ns.fsdp, "states_bytes": mine["states"], "batch_size": ns.batch_size,
           "seq_len": ns.seq_len, "precision": ns.precision, "link": ns.link, "tokens_per_rank": mine["tokens_per_rank"],
           "peak_bytes": mine["peak"], "peak_phase": mine["peak_phase"], "blocks_saved_bytes": mine["blocks_saved"],
           "in_flight_bytes": {"forward": mine["in_flight_forward"], "backward": mine["in_flight_backward"]},
           "sent_per_layer_bytes": mine["sent_per_layer"], "messages_per_layer": mine["messages_per_layer"],
           "comm_seconds_per_layer": mine["comm_seconds_per_layer"],
           "attention_seconds_per_layer": mine["attention_seconds_per_layer"],
           "exposed_seconds_per_layer": mine["exposed_seconds_per_layer"], "verdict": mine["verdict"],
           "gpu": _fit_json(dataclasses.replace(fit, max_batch_size=here.largest)),
           "sweep": {str(n): s for n, s in sweep.items()}}
    if not ns.json:
        print(table)
        print()
        print(f"cp {ns.cp}: the rank's peak {fmt_bytes(mine['peak'])} ({mine['peak_phase']}); in flight inside "
              f"attention: forward {fmt_bytes(mine['in_flight_forward'])}, backward {fmt_bytes(mine['in_flight_backward'])}")
        print(fit)
        print(fit.explain())
        print(f"largest batch size that fits at cp {ns.cp}: {here.largest:,}" + ("+" if here.capped else ""))
    return _answer_out(ns, out, here, fits=fit.fits)


EP_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _experts(ns) -> int:
    """`parallel.expert_parallel` at --ep and at every other EP size that divides the experts and the ranks.
    No fit verdict: the states and bytes are exact, a real model's activations depend on its kernels."""
    if ns.model not in specs.moe_preset_names():
        raise ValueError(f"--model {ns.model!r}: expert parallelism needs a mixture of experts; presets: "
                         f"{', '.join(specs.moe_preset_names())}")
    spec = specs.preset(ns.model)
    if (ns.tp, ns.pp, ns.etp) != (1, 1, 1):
        return _experts_layout(ns, spec)
    kw = dict(dp=ns.dp, batch_size=ns.batch_size, seq_len=ns.seq_len, capacity_factor=ns.capacity_factor,
              zero_stage=ns.zero, precision=ns.precision, link=ns.link)
    mine = PAR.expert_parallel(spec, ep=ns.ep, **kw)
    sweep = {}
    for n in sorted(set(EP_SWEEP) | {ns.ep}):
        try:
            r = mine if n == ns.ep else PAR.expert_parallel(spec, ep=n, **kw)
        except ValueError:  # does not divide the experts or the ranks
            continue
        states = {k: sum(r[c][k] for c in ("parameters", "gradients", "optimizer_states")) for k in ("dense", "experts")}
        sweep[n] = {"experts_per_rank": r["experts_per_rank"], "dense_states_bytes": states["dense"],
                    "expert_states_bytes": states["experts"], "states_bytes": r["states"],
                    "dispatch_bytes": r["dispatch_bytes"], "sent_per_layer_bytes": r["sent_per_layer"],
                    "a2a_seconds_per_layer": r["a2a_seconds_per_layer"], "grad_allreduce_bytes": r["grad_allreduce_bytes"]}
    rows = [[Cell(str(n), "strong") if n == ns.ep else str(n), f"{s['experts_per_rank']:,}", fmt_bytes(s["dense_states_bytes"]),
             fmt_bytes(s["expert_states_bytes"]), fmt_bytes(s["states_bytes"]), fmt_bytes(s["dispatch_bytes"]["received_worst"]),
             fmt_bytes(sum(s["sent_per_layer_bytes"].values())), f"{1e3 * sum(s['a2a_seconds_per_layer'].values()):.2f} ms"]
            for n, s in sweep.items()]
    routing = "dropless" if ns.capacity_factor is None else f"capacity factor {ns.capacity_factor:g}"
    table = Table(["ep", "experts a rank", "dense states", "expert states", "states", "receive buffer (worst)",
                   "all-to-all a layer", "its time"], rows,
                  caption=f"{spec.name} on {ns.dp} ranks, {ns.batch_size} x {ns.seq_len:,} tokens a rank, {routing}, "
                          f"{ns.precision} AdamW, ZeRO-{ns.zero}: one rank at each EP size",
                  notes=["parallel.expert_parallel: states exact (dense over dp, experts over dp/ep under ZeRO); buffers "
                         "and all-to-all bytes (dispatch and combine, forward and backward) per MoE layer; time on "
                         f"{ns.link} (alpha-beta). A step's activations depend on the kernels: `estimate train` prices "
                         "one device's"], align="rrrrrrrr")
    out = {"model": spec.name, "ep": ns.ep, "dp": ns.dp, "edp": mine["edp"], "batch_size": ns.batch_size,
           "seq_len": ns.seq_len, "capacity_factor": ns.capacity_factor, "capacity": mine["capacity"], "zero": ns.zero,
           "precision": ns.precision, "link": ns.link, "experts_per_rank": mine["experts_per_rank"],
           "parameters_bytes": mine["parameters"], "gradients_bytes": mine["gradients"],
           "optimizer_states_bytes": mine["optimizer_states"], "states_bytes": mine["states"],
           "dispatch_rows": mine["dispatch_rows"], "dispatch_bytes": mine["dispatch_bytes"],
           "sent_per_layer_bytes": mine["sent_per_layer"], "a2a_seconds_per_layer": mine["a2a_seconds_per_layer"],
           "grad_allreduce_bytes": mine["grad_allreduce_bytes"], "sweep": {str(n): s for n, s in sweep.items()}}
    if ns.json:
        print(json.dumps(out, indent=2))
    else:
        print(table)
    return 0


def _experts_layout(ns, spec) -> int:
    """`parallel.moe_layout_states`: one rank's states on every pipeline stage of tp x pp x dp devices with the
    experts folded over ep x etp (states only: the dispatch and activations under TP are not modelled)."""
    r = PAR.moe_layout_states(spec, tp=ns.tp, pp=ns.pp, ep=ns.ep, etp=ns.etp, dp=ns.dp, zero_stage=ns.zero,
                              precision=ns.precision)
    rows = []
    for s in r["stages"]:
        part = {k: sum(s[c][k] for c in ("parameters", "gradients", "optimizer_states")) for k in ("dense", "experts")}
        rows.append([Cell(str(s["stage"]), "strong") if s["stage"] == r["busiest_stage"] else str(s["stage"]),
                     f"{s['layers'].start}-{s['layers'].stop - 1}", f"{s['param_counts']['dense']:,}",
                     f"{s['param_counts']['experts']:,}", fmt_bytes(part["dense"]), fmt_bytes(part["experts"]),
                     fmt_bytes(s["states"])])
    table = Table(["stage", "blocks", "dense parameters", "expert parameters", "dense states", "expert states", "states"],
                  rows, caption=f"{spec.name} on tp {ns.tp} x pp {ns.pp} x dp {ns.dp} = {r['devices']:,} GPUs, experts over "
                                f"ep {ns.ep} x etp {ns.etp} (each on edp = {r['edp']} ranks), {ns.precision} AdamW, "
                                f"ZeRO-{ns.zero}: one rank of each stage",
                  notes=["parallel.moe_layout_states (Megatron-Core's parallel folding): the rank's tensors exact; states "
                         "only -- the dispatch and the activations with tensor parallelism are not modelled (without "
                         "--tp/--pp/--etp the command prices one rank's dispatch and all-to-alls)"], align="rrrrrrr")
    if ns.json:
        print(json.dumps({"model": spec.name, "tp": ns.tp, "pp": ns.pp, "ep": ns.ep, "etp": ns.etp, "dp": ns.dp,
                          "edp": r["edp"], "devices": r["devices"], "zero": ns.zero, "precision": ns.precision,
                          "states_bytes": r["states"], "busiest_stage": r["busiest_stage"],
                          "stages": [{"stage": s["stage"], "blocks": [s["layers"].start, s["layers"].stop],
                                      "param_counts": s["param_counts"], "parameters_bytes": s["parameters"],
                                      "gradients_bytes": s["gradients"], "optimizer_states_bytes": s["optimizer_states"],
                                      "states_bytes": s["states"]} for s in r["stages"]]}, indent=2))
    else:
        print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `vramlab` with `argv` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    if argv is not None and (isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence)
                             or not all(isinstance(a, str) for a in argv)):
        raise ValueError(f"argv must be a list of strings (or None for sys.argv), got {argv!r:.60}")
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:  # `vramlab presets | head -1`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _profile_peak(ns) -> int:
    """--activation-peak-gib in bytes."""
    gib = checks.number("--activation-peak-gib", ns.activation_peak_gib, lo=0, hi=1 << 20, what="GiB, 0 or more")
    return int(gib * 2**30)


def _serve_plan(ns, spec, g, kv_dtype=None):
    return SERVE.serving_plan(spec, gpu=g, prompt_len=ns.prompt_len, output_len=ns.output_len,
                              gpu_memory_utilization=ns.utilization, dtype=ns.dtype,
                              kv_dtype=kv_dtype or ns.kv_dtype, block_size=ns.block_size, tp=ns.tp,
                              shared_prefix_len=ns.shared_prefix, n_samples=ns.n,
                              activation_peak_bytes=_profile_peak(ns), draft_model=ns.draft_model,
                              num_speculative_tokens=ns.speculative_tokens, max_num_seqs=ns.max_num_seqs)


def _serve(ns) -> int:
    """`serving.serving_plan`: vLLM's pool and its start-up concurrency line, the requests that fit with the
    sharing asked for, the same at every KV dtype, and `serving.throughput_bounds` at that concurrency."""
    spec = specs.preset(ns.model) if ns.model else specs.from_config(ns.hf_config)
    g = specs.gpu(ns.gpu)
    plan = _serve_plan(ns, spec, g)
    seqs = max(1, min(plan.max_sequences, ns.max_num_seqs))
    tput = SERVE.throughput_bounds(spec, gpu=g, batch_size=seqs, context_len=plan.tokens_per_request,
                                   prompt_len=ns.prompt_len, dtype=ns.dtype, kv_dtype=plan.block.kv_dtype)
    budget = int(g.usable_bytes * ns.utilization)
    rows = [["the engine's share", f"{ns.utilization:g} x {fmt_bytes(g.usable_bytes)}", fmt_bytes(budget)],
            ["weights", f"{spec.params:,} parameters in {ns.dtype}" + (f", over tp {ns.tp}" if ns.tp > 1 else ""),
             fmt_bytes(plan.weights_bytes)]]
    if plan.draft_model:
        rows.append(["draft model's weights", plan.draft_model, fmt_bytes(plan.draft_weights_bytes)])
        rows.append(["verify logits (fp32)", f"{ns.max_num_seqs} sequences x {ns.speculative_tokens + 1} positions",
                     fmt_bytes(plan.verify_logits_bytes)])
    rows += [["activations (profile run)", "given" if ns.activation_peak_gib else "not known here: 0",
              fmt_bytes(_profile_peak(ns))],
             ["outside torch (CUDA context)", g.name, fmt_bytes(g.context_bytes)],  # serving_plan's non-torch memory
             [Cell("KV cache pool", "strong"), "", Cell(fmt_bytes(plan.available_kv_bytes), "strong")],
             ["a block", f"{plan.block.block_size} tokens x {spec.num_layers} layers, {plan.block.kv_dtype}"
              + (" + the draft's" if plan.draft_model else ""),
              fmt_bytes(plan.block.bytes_per_block + plan.draft_page_bytes)],
             ["blocks in the pool", "", f"{plan.num_blocks:,}"],
             ["blocks a request", f"{plan.tokens_per_request:,} tokens, {plan.last_block_waste} slots of the last empty",
              f"{plan.blocks_per_request:,}"],
             [Cell("concurrency", "strong"), "blocks in the pool / blocks a request",
              Cell(f"{plan.max_concurrency:.2f}x", "strong")],
             ["requests at once" + (" (sharing)" if ns.shared_prefix or ns.n > 1 else ""),
              "; ".join(([f"{plan.shared_prefix_blocks} prefix blocks held once"] if ns.shared_prefix else [])
                        + ([f"{ns.n} sequences a request, the prompt's full blocks shared"] if ns.n > 1 else [])),
              f"{plan.max_requests:,}"],
             ["decode bound", f"{seqs} sequences, weights + KV read a step ({g.bandwidth_GBps:.0f} GB/s)",
              f"{tput['decode_tokens_per_s']:,.0f} tokens/s"],
             ["prefill bound", f"{ns.prompt_len:,} tokens at the data sheet's peak", f"{tput['prefill_tokens_per_s']:,.0f} tokens/s"]]
    table = Table(["", "what", "bytes / count"], rows,
                  caption=f"{spec.name} served on {g.name} (vLLM's accounting: vramlab.serving.serving_plan)",
                  notes=["exact arithmetic where the engine's is (blocks, bytes a block, the pool less what is given); the "
                         "profile run's activation peak and CUDA graphs are measured by vLLM at start-up: pass "
                         "--activation-peak-gib; tokens/s are upper bounds from the data sheet"], align="llr")
    by_dtype = {}
    for kv in SERVE.KV_DTYPES:
        try:
            x = plan if kv == plan.block.kv_dtype else _serve_plan(ns, spec, g, kv)
        except ValueError:
            continue
        by_dtype[kv] = {"bytes_per_block": x.block.bytes_per_block, "num_blocks": x.num_blocks,
                        "max_concurrency": x.max_concurrency, "max_requests": x.max_requests}
    kv_table = Table(["KV dtype", "a block", "blocks", "concurrency (vLLM's line)", "requests at once"],
                     [[Cell(k, "strong") if k == plan.block.kv_dtype else k, fmt_bytes(v["bytes_per_block"]),
                       f"{v['num_blocks']:,}", f"{v['max_concurrency']:.2f}x", f"{v['max_requests']:,}"]
                      for k, v in by_dtype.items()],
                     caption="the same deployment with the KV cache in each dtype (int8 keeps an fp32 scale per token "
                             "and head; fp8 one per layer, outside the pool)", align="lrrrr")
    if ns.json:
        print(json.dumps({**plan.to_dict(), "throughput": tput, "by_kv_dtype": by_dtype}, indent=2, default=str))
    else:
        print(table)
        print(f"vLLM would log: {plan.log_line()}")
        print()
        print(kv_table)
    return 0


COMMANDS: dict[str, Callable] = {"estimate": _estimate, "plan": _plan, "lora": _lora, "offload": _offload,
                                 "checkpoint": _checkpoint, "context": _context, "experts": _experts, "serve": _serve,
                                 "explain": _explain.answer}


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
