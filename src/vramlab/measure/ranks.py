"""The rank machinery the parallelism experiments share (`vramlab.measure.parallel`, `.pipeline`,
`.context_parallel`, `.expert_parallel`): lab 3's models and how each family is split (`MODELS`,
`FAMILIES`), the pieces of a rank's training step (the same seeded weights and token batches on every
rank, bf16 autocast, activation recomputation, AdamW kept in its steady state, the next-token loss), one
rank's life (`run_rank`: the process group, the ledger around the experiment, the results gathered on
rank 0) and a run in a subprocess (`run_in_subprocess`, `campaign`). Imports torch inside its functions.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..specs import ModelSpec, from_config
from . import ledger

# The lab's model: Llama's architecture (nn.Linear everywhere, so DTensor's plans apply), small
# enough for two CPU processes, with activations dominating as in real training, and a small
# vocabulary so that the pipeline's last stage computes about what the others do.
LAB_CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=512,
                  tie_word_embeddings=False)


# Validation models: other families than lab 3's, each all nn.Linear (DTensor's plans apply; GPT-2's
# Conv1D does not), 8 layers (p = 4 stages x v = 2 chunks), a vocabulary large enough for the
# embedding and head to matter, a rank's step in about a second on one CPU core. No dropout.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "lab": ("llama-lab3", LAB_CONFIG),
    # OPT: learned positions, LayerNorm with bias, ReLU MLP (fc1/fc2 in the block), tied embeddings
    "opt-val": ("opt-val", dict(model_type="opt", hidden_size=256, ffn_dim=1024, num_hidden_layers=8,
                                num_attention_heads=8, vocab_size=8192, max_position_embeddings=512,
                                word_embed_proj_dim=256, do_layer_norm_before=True, enable_bias=True,
                                activation_function="relu", tie_word_embeddings=True, dropout=0.0,
                                attention_dropout=0.0, layerdrop=0.0)),
    # GPT-NeoX / Pythia: fused query_key_value (laid out head by head, so column-wise = by heads),
    # parallel residual, partial rotary, untied head (lm_head in transformers 5; embed_out before)
    "neox-val": ("neox-val", dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024,
                                  num_hidden_layers=8, num_attention_heads=8, vocab_size=4096,
                                  max_position_embeddings=512, rotary_pct=0.25, use_parallel_residual=True,
                                  hidden_act="gelu", tie_word_embeddings=False, hidden_dropout=0.0,
                                  attention_dropout=0.0)),
    # Llama 3.2-like: grouped-query attention 8 query heads / 2 key-value heads, tied embeddings
    "llama-gqa-val": ("llama-gqa-val", dict(model_type="llama", hidden_size=256, intermediate_size=768,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                            vocab_size=6144, max_position_embeddings=512,
                                            tie_word_embeddings=True)),
}


# Where each family keeps its parts (transformers 5.x module names) and how tensor parallelism splits
# it: `col` column-wise (by heads / MLP width), `row` row-wise (one all-reduce each); `attn`/`mlp` the
# modules whose input sequence parallelism gathers (`attn_kw`: the block passes it as hidden_states=).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(embed="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head",
                  rotary="model.rotary_emb", col=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj"),
                  row=("self_attn.o_proj", "mlp.down_proj"), attn="self_attn", attn_kw=True, mlp="mlp",
                  block_norms=("input_layernorm", "post_attention_layernorm"), sp=True),
    "gpt_neox": dict(embed="gpt_neox.embed_in", layers="gpt_neox.layers", norm="gpt_neox.final_layer_norm",
                     head="lm_head", rotary="gpt_neox.rotary_emb",
                     col=("attention.query_key_value", "mlp.dense_h_to_4h"),
                     row=("attention.dense", "mlp.dense_4h_to_h"), attn="attention", attn_kw=False, mlp="mlp",
                     block_norms=("input_layernorm", "post_attention_layernorm"), sp=True),
    # OPT: no sequence parallelism (its block flattens (b, s, h) to (b*s, h) before the MLP, which a
    # sequence-sharded DTensor cannot take without a gather, and its learned positions are added as a
    # plain tensor)
    "opt": dict(embed="model.decoder.embed_tokens", layers="model.decoder.layers",
                norm="model.decoder.final_layer_norm", head="lm_head", rotary=None, positions="model.decoder.embed_positions",
                col=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
                row=("self_attn.out_proj", "fc2"), attn="self_attn", attn_kw=True, mlp=None,
                block_norms=("self_attn_layer_norm", "final_layer_norm"), sp=False),
}


def model_spec(name: str = "lab") -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    label, cfg = MODELS[name]
    return from_config(cfg, name=label)


def lab_model() -> ModelSpec:
    return model_spec("lab")


class ParlabError(RuntimeError):
    """A rank could not finish: the message says which and why, in one line."""


# ----------------------------------------------------------------------------- helpers (torch)

def rank_device(backend: str, rank: int):
    import torch

    if backend == "nccl":
        dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
        return dev
    torch.set_num_threads(1)  # one compute thread per rank, each on its own core when there are enough
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ.get("WORLD_SIZE", "1")):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return torch.device("cpu")


def seeded_model(spec: ModelSpec, dev):
    import torch

    from .models import build_model

    torch.manual_seed(0)  # the same weights on every rank
    return build_model(spec, attention="sdpa", device=dev)


def token_batch(spec: ModelSpec, rows: int, seq: int, dev, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (rows, seq), generator=g).to(dev)


def submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def family_plan(spec: ModelSpec) -> dict[str, Any]:
    if spec.family not in FAMILIES:
        raise ParlabError(f"{spec.name}: family {spec.family} has no parallel plan here (known: {', '.join(FAMILIES)})")
    return FAMILIES[spec.family]


def autocast(precision: str, dev):
    """bf16 autocast around forward passes and the loss (`precision="bf16"`), nothing for fp32."""
    import torch

    if precision == "bf16":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_recompute(model, spec: ModelSpec, how: str) -> None:
    """Activation recomputation, non-reentrant `torch.utils.checkpoint`: `full` checkpoints every block
    (only its input is kept; the block runs again in the backward), `selective` only the attention core
    (transformers' sdpa attention function: GQA's key/value expansion where transformers does it, the SDPA
    kernel and what it saves, its output and log-sum-exp), as Megatron-LM's selective recomputation does.

    early_stop=False: with early stopping (torch's default) the recomputation stops at the last tensor the
    backward needs, and under DTensor tensor parallelism a block that ends in two row-parallel all-reduces
    (GPT-NeoX's parallel residual) leaves one issued, never-waited functional all-reduce per block behind,
    whose output is never freed: b s h bytes per block and step, growing without bound (measured with
    the ledger; absent without early stopping)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if how == "full":
        for layer in submodule(model, family_plan(spec)["layers"]):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, early_stop=False)
    elif how == "selective":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        core = ALL_ATTENTION_FUNCTIONS["sdpa"]
        if getattr(core, "_vramlab_selective", False):
            return

        def selective(module, query, key, value, attention_mask, *args, **kwargs):
            return checkpoint(core, module, query, key, value, attention_mask, *args, use_reentrant=False,
                              early_stop=False, **kwargs)

        selective._vramlab_selective = True
        AttentionInterface.register("sdpa", selective)  # this process only (one process per rank)


def predicted_dict(b) -> dict[str, int]:
    return {"parameters": b.parameters, "gradients": b.gradients, "optimizer_states": b.optimizer_states,
            "activations": b.activations, "temporaries": b.temporaries, "total": b.total, "phase": b.phase}


def with_total(d: dict[str, int]) -> dict[str, int]:
    return {**d, "total": sum(d.values())}


def adamw(params, foreach: bool = True):
    """AdamW (lr 1e-4), foreach by default (lab 3's setting) or one parameter at a time; with foreach, split
    parameters (DTensors) in a group of their own: a foreach kernel cannot mix them with plain tensors
    (the replicated norms)."""
    import torch
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4, foreach=foreach)


def steady(opt, params) -> None:
    """Create the optimizer's states (one step on zero gradients) and keep the gradients allocated."""
    import torch

    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    zero_grads(opt)


def zero_grads(opt) -> None:
    """zero_grad(set_to_none=False) one tensor at a time (its foreach kernel cannot mix DTensors and tensors):
    the gradients stay allocated."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.zero_()


def lm_loss(logits, labels):
    """The next-token loss as transformers computes it (`ForCausalLMLoss`): the labels shifted left and
    padded with -100 (ignored), the logits flattened as a view. Slicing the logits instead
    (`logits[:, :-1]`) would copy them, one b x s x V tensor that no real training loop holds."""
    import torch.nn.functional as F

    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def shard_bytes(params) -> int:
    """Bytes of this rank's parameters (a DTensor's local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params)


def run_info(spec: ModelSpec, args, layout: dict[str, int]) -> dict[str, Any]:
    """What a run measured, exactly: the model and the step's settings. `param_count` is the whole model's
    (spec.params, equal to the built model's parameter count, tied weights once)."""
    return {"model_name": args.model, "model_config": MODELS[args.model][1], "hf_config": spec.to_hf_config(),
            "param_count": spec.params, "layout": layout,
            "precision": "bf16 autocast (CPU), fp32 parameters, gradients and states" if args.precision == "bf16"
            else "fp32", "optimizer": {"name": "AdamW", "lr": 1e-4, "foreach": args.foreach},
            "attention": "sdpa", "gradients_kept_between_steps": True, "zero_grad": "set_to_none=False",
            "recompute": args.recompute, "sequence_parallel": bool(args.sp),
            **({"checkpoint": "torch.utils.checkpoint, use_reentrant=False, early_stop=False"}
               if args.recompute != "none" else {})}


def predicts(args) -> bool:
    """`vramlab.parallel`'s prediction is reported for lab 3's own settings only."""
    return (args.model == "lab" and args.precision == "fp32" and args.recompute == "none" and not args.sp
            and args.foreach and not args.gradient_as_bucket_view)


def storage_bytes(tensors, seen) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


# ----------------------------------------------------------------------------- processes

# what the CPU ranks import, loaded once by the fork server they start from (collectives.launch)
RANK_IMPORTS = ("transformers", "transformers.modeling_utils", "transformers.masking_utils", "torch.distributed.tensor",
                "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.fsdp",
                "torch.nn.parallel", "torch.distributed.optim", "vramlab.measure.memory", "vramlab.measure.models")


def run_rank(rank: int, world: int, args, port: int, run, report) -> None:
    """One rank of an experiment (each experiment module's `_worker`, started by `collectives.launch`): join the
    process group, run `run(rank, world, args, dev)` inside the rank's ledger (`ledger.LEDGER`), gather every
    rank's result and hand them to `report(ranks, args, world)` on rank 0. Any failure is a ParlabError of one
    line naming the rank."""
    import torch.distributed as dist

    from .collectives import first_line
    from .memory import settle_imports

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["WORLD_SIZE"] = str(world)
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: the process group did not form within {args.timeout:g} s: "
                          f"{first_line(e)}") from None
    try:
        dev = rank_device(args.backend, rank)
        settle_imports(RANK_IMPORTS)  # each gc.collect of a step walks only what was made since
        ledger.LEDGER = ledger.Ledger()
        with ledger.LEDGER:
            result = run(rank, world, args, dev)
        ledger.LEDGER = None
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            report(gathered, args, world)
    except ParlabError as e:
        raise ParlabError(f"rank {rank} of {world}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: {type(e).__name__}: {first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PROG = "python -m vramlab.measure.parallel"


def run_in_subprocess(argv_of, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`python -m vramlab.measure.parallel <argv_of(config, out)>` in a subprocess (its ranks spawned there), the
    JSON it wrote to `out` read back; a ParlabError in one line when it fails or runs past `timeout` seconds."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "vramlab.measure.parallel", *argv_of(config, out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ParlabError(f"{' '.join(cmd[2:])}: no result within {timeout:g} s") from None
        if done.returncode or not os.path.exists(out):
            last = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            raise ParlabError(f"{' '.join(cmd[2:])}: {last[-1] if last else f'exit status {done.returncode}'}")
        return json.loads(Path(out).read_text())


def campaign(path: str, configs, run, label, *, what: str, name: str, module: str) -> dict[str, Any]:
    """Run every configuration (`run(config)`), keep each rank's ledger summary, print each run's worst error
    (`label(config)` names it) and store them all with provenance in one JSON file at `path`; its command
    calls `module`'s function `name`."""
    from .record import provenance

    runs = []
    for config in configs:
        result = run(config)
        for r in result["per_rank"]:
            r["memory"] = {k: r["memory"][k] for k in ("peak", "peak_phase", "at_peak", "phases")}
        runs.append({"config": dict(config), "result": result})
        print(f"{label(config)}: worst error {max(abs(r['error']) for r in result['rows']):.2%}", flush=True)
    out = {"what": what, "command": f"python -c \"from {module} import {name}; {name}('{path}')\"",
           "provenance": provenance("cpu"), "runs": runs}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out
