"""`vramlab`'s arguments: every subcommand's options (one function each), the parser (built once), and the way
back from a parsed namespace to its command line (`argv_of`, `changed_flags`: how the levers print what to change).
"""

from __future__ import annotations

import argparse
from typing import Callable

from .. import activations, checks, memory, specs
from .. import optimizers
from .. import precision as P
from .. import serving as SERVE
from .. import zero as Z
from . import explain as _explain
from . import from_config
from .calc_base import Calculator
from .calc_checkpointing import CHECKPOINTING
from .calc_compression import COMPRESSION
from .calc_memory import SERVING, TRAINING
from .calc_parallel import CONTEXT, EXPERTS

INFER_DTYPES: tuple[str, ...] = tuple(memory.INFER_BYTES)
OFFLOAD_SCHEMES: tuple[str, ...] = ("save-on-cpu", "zero-offload", "fsdp2-cpu")
LORA_METHODS: tuple[str, ...] = ("lora", "qlora", "lora-int8", "full", "prompt", "prefix", "p-tuning")
PROMPT_METHODS: tuple[str, ...] = ("prompt", "prefix", "p-tuning")


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


def declared(calc: Calculator, name: str) -> dict:
    """The default and choices of `calc`'s input `name` (its declaration in present/calc_*), as argparse takes them:
    a flag that takes the values a page's control takes is declared once, there."""
    i = next(i for i in calc.inputs if i.name == name)
    if i.kind != "choice":
        raise TypeError(f"{calc.name}'s {name} is a {i.kind} input, not a choice")
    return {"default": i.default, "choices": i.choices}


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


def add_estimate(sub) -> argparse.ArgumentParser:
    """`vramlab estimate`: one GPU's step, one ZeRO/FSDP rank, inference; or --from FILE (chapters 1, 4)."""
    est = sub.add_parser(
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
    est.add_argument("--optimizer", default=None, choices=optimizers.NAMES, metavar="OPT",
                     help=f"train only (default adamw): {', '.join(optimizers.NAMES)}")
    est.add_argument("--optimizer-in-backward", action="store_true", default=None,
                     help="train: step each parameter as its gradient is made, then free the gradient "
                          "(register_post_accumulate_grad_hook)")
    est.add_argument("--galore-rank", type=_COUNT, default=None, metavar="R",
                     help="train, with --optimizer galore-adamw: the projections' rank (default 128)")
    est.add_argument("--optimizer-impl", default=None, choices=memory.OPTIMIZER_IMPLS,
                     help="train only (default foreach; fused with --zero/--fsdp2, as DeepSpeed's Adam)")
    est.add_argument("--attention", **declared(TRAINING, "attention"))
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
    return est


def add_plan(sub) -> argparse.ArgumentParser:
    """`vramlab plan`: dp x tp x pp layouts of N GPUs (chapter 3)."""
    plan = sub.add_parser("plan", help="dp x tp x pp (x ZeRO-1) layouts of N GPUs that fit, fastest first")
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
    return plan


def add_lora(sub) -> argparse.ArgumentParser:
    """`vramlab lora`: fine-tuning: full, LoRA, QLoRA, prompt learning (chapter 8)."""
    lora = sub.add_parser("lora", help="fine-tuning memory: full, LoRA, LoRA on INT8, QLoRA, "
                                                           "prompt, prefix and P-tuning")
    _model_source(lora)
    lora.add_argument("--method", default="lora", choices=LORA_METHODS, help="default lora")
    _sizes(lora)
    lora.add_argument("--rank", type=_COUNT, default=16, help="LoRA rank (default 16)")
    lora.add_argument("--virtual-tokens", type=_COUNT, default=None, metavar="P",
                      help="prompt, prefix, p-tuning: peft's num_virtual_tokens (default 20)")
    lora.add_argument("--prefix-projection", action="store_true",
                      help="prefix: the reparameterisation MLP (peft's prefix_projection=True)")
    lora.add_argument("--targets", **declared(COMPRESSION, "targets"),
                      help="default: peft's default target modules for the architecture")
    lora.add_argument("--precision", default=None, choices=P.PRECISIONS,
                      help="the base's (default: bf16 for LoRA, bf16-mixed for full; qlora and lora-int8 compute in bf16)")
    lora.add_argument("--optimizer", default="adamw", choices=optimizers.SHARDED, help="default adamw")
    lora.add_argument("--recompute", default="none", metavar="PLAN",
                      help="gradient checkpointing (default none): full, every-K, first-N, ...")
    _gpu_arg(lora)
    lora.add_argument("--json", action="store_true", help="print one JSON object")
    return lora


def add_offload(sub) -> argparse.ArgumentParser:
    """`vramlab offload`: host memory instead of the GPU's (chapter 6)."""
    off = sub.add_parser("offload", help="host memory instead of the GPU's: save_on_cpu, "
                                                                 "ZeRO-Offload, FSDP2's CPUOffloadPolicy")
    _model_source(off)
    off.add_argument("--scheme", required=True, choices=OFFLOAD_SCHEMES)
    _sizes(off)
    _gpu_arg(off)
    off.add_argument("--json", action="store_true", help="print one JSON object")
    return off


def add_checkpoint(sub) -> argparse.ArgumentParser:
    """`vramlab checkpoint`: activation checkpointing's plans (chapter 7)."""
    ck = sub.add_parser("checkpoint", help="activation checkpointing: every plan's peak and "
                                                                     "recompute, the least recompute that fits")
    _model_source(ck)
    _sizes(ck)
    _gpu_arg(ck)
    ck.add_argument("--precision", **declared(CHECKPOINTING, "precision"), help="default %(default)s")
    ck.add_argument("--optimizer", default="adamw", choices=optimizers.SHARDED, help="default adamw")
    ck.add_argument("--attention", default="sdpa", choices=activations.ATTENTIONS)
    ck.add_argument("--plan", default=None, metavar="PLAN",
                    help="also show this plan (every-K, first-N, segments-K, ...) and its breakdown")
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    return ck


def add_context(sub) -> argparse.ArgumentParser:
    """`vramlab context`: context parallelism (chapter 3)."""
    cx = sub.add_parser("context", help="context parallelism: one rank of ring attention or "
                                                               "Ulysses at long context, against every CP size")
    _model_source(cx)
    cx.add_argument("--seq-len", type=_COUNT, required=True, help="tokens per sequence (the whole sequence, all ranks)")
    cx.add_argument("--batch-size", type=_COUNT, default=1, help="sequences per step (default 1)")
    cx.add_argument("--cp", type=_COUNT, required=True, help="ranks the sequence is split over")
    cx.add_argument("--method", **declared(CONTEXT, "method"),
                    help="ring attention (K/V blocks passed round a ring) or Ulysses (all-to-all over heads); "
                         "default %(default)s")
    cx.add_argument("--contiguous", action="store_true",
                    help="ring: contiguous shards instead of zig-zag chunks (the causal load imbalance)")
    cx.add_argument("--precision", **declared(CONTEXT, "precision"), help="default %(default)s")
    cx.add_argument("--optimizer", default="adamw", choices=optimizers.SHARDED, help="default adamw")
    cx.add_argument("--recompute", **declared(CONTEXT, "recompute"),
                    help="full: every block checkpointed (its attention and its K/V transfers run again); "
                         "default %(default)s")
    cx.add_argument("--loss", **declared(CONTEXT, "loss"),
                    help="the loss on the rank's tokens: whole, chunked (torchtune's) or fused (Liger's); "
                         "default %(default)s")
    cx.add_argument("--fsdp", action="store_true",
                    help="FSDP2 over the CP ranks: the model states sharded too (torchtitan's dp_shard x cp); "
                         "fp32 or bf16-mixed, AdamW")
    _gpu_arg(cx)
    cx.add_argument("--link", **declared(CONTEXT, "link"), help="between the CP ranks (default %(default)s)")
    cx.add_argument("--json", action="store_true", help="print one JSON object")
    return cx


def add_experts(sub) -> argparse.ArgumentParser:
    """`vramlab experts`: expert parallelism (chapter 3)."""
    xp = sub.add_parser("experts", help="expert parallelism: one rank's experts, states, dispatch "
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
    xp.add_argument("--link", **declared(EXPERTS, "link"), help="between the EP ranks (default %(default)s)")
    xp.add_argument("--json", action="store_true", help="print one JSON object")
    return xp


def add_serve(sub) -> argparse.ArgumentParser:
    """`vramlab serve`: serving with a paged KV cache (chapter 1)."""
    sv = sub.add_parser("serve", help="serving with a paged KV cache (vLLM's accounting): the pool, "
                                                          "blocks, concurrent requests, tokens/s bounds")
    _model_source(sv)
    _gpu_arg(sv)
    sv.add_argument("--prompt-len", type=_COUNT, required=True, help="prompt tokens a request")
    sv.add_argument("--output-len", type=_COUNT_0, required=True, help="tokens generated a request")
    sv.add_argument("--utilization", type=float, default=0.9, metavar="F",
                    help="vLLM's gpu_memory_utilization: the share of the GPU the engine may take (default 0.9)")
    sv.add_argument("--dtype", **declared(SERVING, "dtype"), help="the weights' (default %(default)s)")
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
    return sv


SUBCOMMANDS: dict[str, Callable] = {"estimate": add_estimate, "plan": add_plan, "lora": add_lora, "offload": add_offload,
                                    "checkpoint": add_checkpoint, "context": add_context, "experts": add_experts,
                                    "serve": add_serve}


def build_parser() -> argparse.ArgumentParser:
    """The `vramlab` command line: every error is one line and exit status 2 (`checks.Parser`)."""
    p = checks.Parser(prog="vramlab", description="Where GPU memory goes: does a training or inference step fit, "
                                                  "and what to change when it does not.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands = {name: add(sub) for name, add in SUBCOMMANDS.items()}
    commands["explain"] = _explain.add_parser(sub)
    commands["presets"] = sub.add_parser("presets", help="list the built-in models")
    commands["gpus"] = sub.add_parser("gpus", help="list the GPU catalogue")
    p.commands = commands
    return p


_PARSER: argparse.ArgumentParser | None = None


def parser() -> argparse.ArgumentParser:
    global _PARSER
    if _PARSER is None:
        _PARSER = build_parser()
    return _PARSER


# ----------------------------------------------------------------------------- the command line of a namespace

def command_actions(command: str):
    return [a for a in parser().commands[command]._actions if not isinstance(a, argparse._HelpAction)]


def flag_tokens(a: argparse.Action, v) -> list[str]:
    if not a.option_strings:
        return [str(v)]
    name = max(a.option_strings, key=len)
    if isinstance(a, argparse._StoreTrueAction):
        return [name] if v else []
    return [] if v is None or v == a.default else [name, str(v)]


def argv_of(ns: argparse.Namespace) -> list[str]:
    """The command line (without `vramlab` and --json) that parses to `ns`."""
    out = [ns.command]
    for a in command_actions(ns.command):
        if a.dest != "json":
            out += flag_tokens(a, getattr(ns, a.dest, a.default))
    return out


def changed_flags(old: argparse.Namespace, new: argparse.Namespace) -> str:
    """What `new` sets differently from `old`, as flags (a flag set back to its default: '--zero -')."""
    if old.command != new.command:
        return "vramlab " + " ".join(argv_of(new))
    out, dropped = [], []
    for a in command_actions(new.command):
        v, w = getattr(old, a.dest, a.default), getattr(new, a.dest, a.default)
        if a.dest != "json" and v != w:
            tokens = flag_tokens(a, w)
            out += tokens
            dropped += [] if tokens else [max(a.option_strings, key=len)]
    return " ".join(out + ([f"(without {', '.join(dropped)})"] if dropped else []))


def defaults(command: str, **values) -> argparse.Namespace:
    ns = argparse.Namespace(command=command, **{a.dest: a.default for a in command_actions(command)})
    for k, v in values.items():
        setattr(ns, k, v)
    return ns
