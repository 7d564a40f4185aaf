"""Lab 4's experiments: DeepSpeed's ZeRO stages 0-3 and PyTorch's FSDP2 on real ranks, measured.

    python -m vramlab.measure.zero --nproc 2                           # gloo, CPU processes, every setup
    python -m vramlab.measure.zero --setups 2,3,fsdp2 --nproc 4
    python -m vramlab.measure.zero --precision bf16                    # DeepSpeed bf16, FSDP2 MixedPrecisionPolicy
    python -m vramlab.measure.zero --backend nccl --nproc 8            # one process per GPU
    torchrun --nproc-per-node 8 -m vramlab.measure.zero --backend nccl --setups 3
    python -m vramlab.measure.zero --model llama-gqa-wide-mlp --reduce-bucket 1e6 --allgather-bucket 1e6
    python -m vramlab.measure.zero --model opt-wide-vocab --setups 3 --prefetch-bucket 1e6 --max-live-params 2e6
    python -m vramlab.measure.zero --model llama-gqa-wide-mlp --setups 0,2,fsdp2 --accumulation-steps 4
    python -m vramlab.measure.zero --setups fsdp2 --accumulation-steps 4 --no-sync   # set_requires_gradient_sync(False)
    python -m vramlab.measure.zero --list-models

Each setup trains the same small model (lab 4's GPT-2 unless --model names another of MODELS, built
from a transformers config, random init, fp32 weights, dropout 0) for a few steps on fixed data, one
process group per setup, and reports per rank:
- resident memory after a step, by category: every live storage is found (a scan of the objects
  Python holds) and sorted into parameters (the module's, flat or partitioned), gradients,
  optimizer states (the inner optimizer's states and DeepSpeed's fp32 master partitions) and other
  (communication buckets and the like, largest first with their shapes);
- the step's peak: resident plus the most that a step's own storages held at once
  (`measure.ledger.LiveBytes`), the largest over the measured steps (all but the first two);
- bytes communicated in the step, counted at the `torch.distributed` calls (payload per collective
  and what each rank sends on a ring, `collectives.bytes_sent_per_rank`);
- the trained parameters against one process training the same model on all ranks' data (with
  --accumulation-steps k, each optimizer step is k micro-batches per rank, `_micro_batches`, and the
  one process trains on all of them at once; the memory and traffic are the whole optimizer step's);
- `peak`: the step's peak as everything live (the storages the step starts with, found by the scan,
  plus every storage an operation creates or a storage `resize_` allocates, until it is freed), with
  the phase it happened in (forward, backward, step = optimizer step and zero_grad), what was live at
  that moment (bytes by owner category and the largest transient storages: bytes, dtype, shape, the
  operation that made them, their role: a module's gathered parameter, a gradient, other), each phase's
  own peak, and a cross-check against PyTorch's CPU allocator (the profiler's memory events).
  `step_peak` and `step_transient_peaks` keep lab 4's accounting (`measure.ledger.LiveBytes`: the resident
  total plus the most that operation outputs held at once), which cannot see storages FSDP2 reallocates
  with `resize_` (its gathered parameters after the first step) nor resident storages freed in a step.
Imports torch and DeepSpeed (FSDP2 needs only torch).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from .. import checks
from ..specs import ModelSpec, from_config
from . import zero_tracking as track

# The lab's model: GPT-2's architecture with matrices above DeepSpeed's stage-3 persistence threshold
# (1e5 elements: smaller parameters stay whole on every rank) and a small vocabulary.
LAB_CONFIG = dict(model_type="gpt2", n_embd=256, n_inner=1024, n_layer=2, n_head=4, vocab_size=512,
                  n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
SETUPS = ("0", "1", "2", "3", "fsdp2")
LR = 1e-3
DEFAULT_MODEL = "gpt2-lab4"

# Models this module can train (--model): transformers configs, random init, no download, dropout 0. Each
# has a micro-batch and sequence length that give it activations worth measuring beside its model
# states; `persistent` lists the parameters at or below DeepSpeed's default stage-3 persistence
# threshold (1e5 elements: kept whole on every rank), norms and biases aside.
MODELS: dict[str, dict[str, Any]] = {
    DEFAULT_MODEL: {
        "family": "gpt2", "classes": ("GPT2Config", "GPT2LMHeadModel"), "config": LAB_CONFIG,
        "micro_batch": 2, "seq": 64, "max_seq": LAB_CONFIG["n_positions"],
        "about": "lab 4's GPT-2: 2 blocks, h 256, vocabulary 512, tied head (block > root)",
        "persistent": "the attention output projections (256 x 256 = 65,536)"},
    "opt-wide-vocab": {
        "family": "opt", "classes": ("OPTConfig", "OPTForCausalLM"),
        "config": dict(model_type="opt", vocab_size=16384, hidden_size=384, ffn_dim=1536, num_hidden_layers=2,
                       num_attention_heads=6, max_position_embeddings=512, word_embed_proj_dim=384,
                       do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       layerdrop=0.0, tie_word_embeddings=True),
        "micro_batch": 2, "seq": 128, "max_seq": 512,
        "about": "OPT-like: tied embeddings, vocabulary 16,384, h 384, 2 blocks (root 6.5 M > block 1.8 M)",
        "persistent": "none"},
    "pythia-wide-vocab": {
        "family": "gpt_neox", "classes": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
        "config": dict(model_type="gpt_neox", vocab_size=10240, hidden_size=384, intermediate_size=1536,
                       num_hidden_layers=2, num_attention_heads=6, rotary_pct=0.25, max_position_embeddings=512,
                       use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                       tie_word_embeddings=False),
        "micro_batch": 2, "seq": 128, "max_seq": 512,
        "about": "GPT-NeoX/Pythia-like: untied head, vocabulary 10,240, h 384, 2 blocks (root 7.9 M > block 1.8 M)",
        "persistent": "none"},
    "llama-gqa-wide-mlp": {
        "family": "llama", "classes": ("LlamaConfig", "LlamaForCausalLM"),
        "config": dict(model_type="llama", vocab_size=512, hidden_size=512, intermediate_size=2048,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       max_position_embeddings=512, attention_dropout=0.0, tie_word_embeddings=False),
        "micro_batch": 4, "seq": 128, "max_seq": 512,
        "about": "Llama-like: GQA (8 query, 4 key/value heads), SwiGLU 2048, vocabulary 512, untied, h 512, "
                 "2 blocks (block 3.9 M > root 0.5 M)",
        "persistent": "none"},
    "mt5-small-like": {
        "family": "t5", "classes": ("MT5Config", "MT5ForConditionalGeneration"),
        # untied_lm_head: vramlab.specs' key for the published mT5's untied head (transformers 5 ties it)
        "config": dict(model_type="mt5", untied_lm_head=True, vocab_size=32768, d_model=256, d_kv=64, d_ff=1024,
                       num_layers=2, num_decoder_layers=2, num_heads=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                       tie_word_embeddings=False,
                       # transformers' T5 init gives the head std 1, made for a tied head scaled by
                       # d_model^-0.5: untied, the first loss is ~176 and training is chaotic (5 steps
                       # drift 1e-4 from one process on rounding alone); 1/16 starts at ln V
                       initializer_factor=0.0625),
        "micro_batch": 2, "seq": 128, "max_seq": 512,
        "about": "mT5-small-like encoder-decoder: gated GELU, vocabulary 32,768, untied head, d_model 256, "
                 "2 + 2 blocks (root 16.8 M > decoder block 1.8 M); encoder and decoder see seq tokens each",
        "persistent": "the relative attention biases (32 x 8)"},
    # GPU-scale models (published configurations, or a published block with a small vocabulary), for one
    # rank of a larger world on a GPU with torch's fake process group (--backend fake): too large for
    # CPU ranks, and the regime where the units and the logits are as large as practitioners see
    "llama-3.2-1b": {
        "family": "llama", "classes": ("LlamaConfig", "LlamaForCausalLM"), "scale": "gpu",
        "config": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       max_position_embeddings=131072, rope_theta=500000.0, attention_dropout=0.0,
                       tie_word_embeddings=True),
        "micro_batch": 2, "seq": 1024, "max_seq": 131072,
        "about": "Llama-3.2-1B's configuration: tied embeddings, vocabulary 128,256, 16 blocks "
                 "(root 263 M > block 61 M)", "persistent": "none"},
    "pythia-410m": {
        "family": "gpt_neox", "classes": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "scale": "gpu",
        "config": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=24, num_attention_heads=16, rotary_pct=0.25, max_position_embeddings=2048,
                       use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                       tie_word_embeddings=False),
        "micro_batch": 4, "seq": 1024, "max_seq": 2048,
        "about": "Pythia-410M's configuration: untied head, vocabulary 50,304, 24 blocks (root 103 M > block 12.6 M)",
        "persistent": "none"},
    "mistral-block-small-vocab": {
        "family": "llama", "classes": ("LlamaConfig", "LlamaForCausalLM"), "scale": "gpu",
        "config": dict(model_type="llama", vocab_size=8192, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=8192, attention_dropout=0.0, tie_word_embeddings=False),
        "micro_batch": 1, "seq": 2048, "max_seq": 8192,
        "about": "Mistral-7B's block (h 4096, SwiGLU 14,336, GQA 32/8) with a vocabulary of 8,192, untied, 4 blocks "
                 "(block 218 M > root 67 M)", "persistent": "none"},
    "mt5-base": {
        "family": "t5", "classes": ("MT5Config", "MT5ForConditionalGeneration"), "scale": "gpu",
        "config": dict(model_type="mt5", untied_lm_head=True, vocab_size=250112, d_model=768, d_kv=64, d_ff=2048,
                       num_layers=12, num_decoder_layers=12, num_heads=12, feed_forward_proj="gated-gelu",
                       dropout_rate=0.0, tie_word_embeddings=False, initializer_factor=0.0625),
        "micro_batch": 2, "seq": 512, "max_seq": 4096,
        "about": "mT5-base's configuration: encoder-decoder, vocabulary 250,112, untied head, 12 + 12 blocks "
                 "(root 384 M > block 7 M)", "persistent": "the relative attention biases (32 x 12)"},
}


def lab_model() -> ModelSpec:
    return from_config(LAB_CONFIG, name="gpt2-lab4")


def model_spec(name: str = DEFAULT_MODEL) -> ModelSpec:
    """vramlab's ModelSpec of one of MODELS (what the estimator is given for a run with --model name)."""
    if name == DEFAULT_MODEL:
        return lab_model()
    return from_config(MODELS[name]["config"], name=name)


def predict(run: dict[str, Any], setup: str, *, device: str = "cpu", gpu: Any = None, phases: bool = False):
    """What the estimator says for one setup of a results record (`zero.estimate_rank`, or with
    `phases` every phase, `zero.rank_phases`), asked as a user would ask it: the record's model,
    ranks, micro-batch and sequence, precision (fp32 -> "fp32-adam", else "mixed-adam"), DeepSpeed's
    knobs (their defaults where the record left them unset), the torch.optim for-loop AdamW the ranks
    ran, and the KV-cache setting (records before it was recorded trained with the configs' default,
    on). `device` / `gpu` as `estimate_rank` takes them."""
    from .. import zero

    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
    knobs = run.get("deepspeed_knobs") or {}
    kw = dict(micro_batch_size=run["micro_batch_size"], seq_len=run["seq_len"],
              recipe="fp32-adam" if run["precision"] == "fp32" else "mixed-adam",
              implementation="fsdp2" if setup == "fsdp2" else "deepspeed", optimizer_impl="for-loop", device=device,
              reduce_bucket=knobs.get("reduce_bucket_size") or zero.REDUCE_BUCKET,
              max_live_parameters=knobs.get("stage3_max_live_parameters") or zero.MAX_LIVE,
              persistence_threshold=knobs.get("stage3_param_persistence_threshold") or zero.PERSISTENCE,
              prefetch_bucket=knobs.get("stage3_prefetch_bucket_size") or zero.PREFETCH,
              use_cache=run.get("use_cache", True), gpu=gpu,
              accumulation_steps=run.get("accumulation_steps", 1), no_sync=bool(run.get("no_sync", False)))
    stage = 3 if setup == "fsdp2" else int(setup)
    return (zero.rank_phases if phases else zero.estimate_rank)(model_spec(run["model_name"]), run["ranks"], stage, **kw)


class ZerolabError(RuntimeError):
    """A rank could not finish: one line that says which and why."""


# ----------------------------------------------------------------------------- measuring (torch)

def _config(name: str):
    """The transformers config of a MODELS entry (its own keys that are not the config's removed)."""
    import transformers

    m = MODELS[name]
    cfg = {k: v for k, v in m["config"].items() if k not in ("model_type", "untied_lm_head")}
    return getattr(transformers, m["classes"][0])(**cfg)


def _build(seed: int = 0, name: str = DEFAULT_MODEL, use_cache: bool | None = None):
    import torch
    import transformers

    torch.manual_seed(seed)
    m = MODELS[name]
    model = getattr(transformers, m["classes"][1])(_config(name))
    if m["config"].get("untied_lm_head"):  # transformers 5 always ties T5/mT5's head: untie it, as the published mT5 is
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
    if use_cache is not None:  # None: the config's default (transformers': on)
        model.config.use_cache = use_cache
    return model


def _batch(rank: int, b: int, s: int, name: str = DEFAULT_MODEL):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, MODELS[name]["config"]["vocab_size"], (b, s), generator=g)


def _micro_batches(rank: int, world: int, b: int, s: int, name: str = DEFAULT_MODEL, accumulation_steps: int = 1) -> list:
    """A rank's micro-batches of one optimizer step: the first is `_batch(rank)` (what it trains without
    accumulation), the j-th `_batch(rank + j * world)`: no two ranks or micro-batches alike."""
    return [_batch(rank + j * world, b, s, name) for j in range(accumulation_steps)]


def _blocks(model) -> list:
    """The transformer blocks (the classes transformers' `_no_split_modules` names: decoder layers, T5's
    encoder and decoder blocks), in module order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def structure(model, persistence_threshold: int = 100_000) -> dict[str, Any]:
    """Parameter counts of a built model: all (each shared tensor once), the root (what is outside
    every block: embeddings, final norms, head), each block, the largest parameter, and the parameters
    at or below DeepSpeed's stage-3 persistence threshold."""
    params = list(model.parameters())
    in_blocks = {id(p) for b in _blocks(model) for p in b.parameters()}
    small = [p for p in params if p.numel() <= persistence_threshold]
    return {"params": sum(p.numel() for p in params),
            "root_params": sum(p.numel() for p in params if id(p) not in in_blocks),
            "block_params": [sum(p.numel() for p in b.parameters()) for b in _blocks(model)],
            "block_class": type(_blocks(model)[0]).__name__ if _blocks(model) else None,
            "largest_param": max(p.numel() for p in params),
            "persistence_threshold": persistence_threshold,
            "at_or_below_threshold": {"tensors": len(small), "params": sum(p.numel() for p in small),
                                      "largest": max((p.numel() for p in small), default=0)},
            "head_tied_to_embedding": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


# DeepSpeed's zero_optimization keys set by the command line (None: DeepSpeed's default)
DS_KNOBS = {"reduce_bucket": "reduce_bucket_size", "allgather_bucket": "allgather_bucket_size",
            "prefetch_bucket": "stage3_prefetch_bucket_size", "max_live_params": "stage3_max_live_parameters",
            "persistence_threshold": "stage3_param_persistence_threshold"}


def deepspeed_config(setup: str, micro_batch: int, precision: str = "fp32", knobs: dict | None = None,
                     accumulation_steps: int = 1) -> dict:
    """The DeepSpeed config this module passes for ZeRO stage `setup`; `knobs` maps DS_KNOBS' keys to values."""
    zero: dict[str, Any] = {"stage": int(setup)}
    for k, v in (knobs or {}).items():
        if v is not None:
            zero[DS_KNOBS[k]] = v
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation_steps,
            "zero_optimization": zero, "steps_per_print": 10**9,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at norm 1.0 unless told not to
            "bf16": {"enabled": precision == "bf16"}}


def _engine(setup: str, model, world: int, micro_batch: int, precision: str = "fp32", knobs: dict | None = None,
            marks: track.Marks | None = None, accumulation_steps: int = 1, no_sync: bool = False):
    """(module, optimizer, step(batches), description): the setup's training step on a list of
    micro-batches (one optimizer step; each micro-batch's forward and backward marked "forward" and
    "backward"), its phases marked. FSDP2 scales each loss by 1 / len(batches) itself (DeepSpeed's engine
    does, `gradient_accumulation_steps`); with `no_sync` it calls `set_requires_gradient_sync(False)`
    for every micro-batch but the last."""
    import torch

    marks = marks or track.Marks()
    if setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dev = "cuda" if _on_gpu() else "cpu"
        mesh = init_device_mesh(dev, (world,))
        model.to(dev)
        kw = {}
        if precision == "bf16":  # bf16 compute on gathered copies; fp32 sharded parameters and reductions
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        names = {m: n for n, m in model.named_modules()}
        units = _blocks(model)  # each transformer block its own unit, then the root (embeddings, norms, head)
        for block in units:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)

        def step(batches):
            for j, ids in enumerate(batches):
                if no_sync:  # reduce-scatter only in the last micro-batch's backward
                    model.set_requires_gradient_sync(j == len(batches) - 1)
                with marks("forward"):
                    loss = model(input_ids=ids, labels=ids).loss / len(batches)
                with marks("backward"):
                    loss.backward()
                del loss
            with marks("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        about = {"fully_shard_units": [names[u] for u in units] + ["(root)"],
                 "accumulation": (f"{accumulation_steps} micro-batches, set_requires_gradient_sync(False) but on "
                                  "the last" if no_sync else f"{accumulation_steps} micro-batches, reduce-scatter "
                                  "each"),
                 "mp_policy": "param_dtype bf16, reduce_dtype fp32" if precision == "bf16" else None,
                 "optimizer": "torch.optim.AdamW(foreach=False)"}
        return model, opt, step, about

    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.ERROR)
    if no_sync:
        raise ValueError("no_sync is FSDP2's (set_requires_gradient_sync); DeepSpeed decides by stage")
    config = deepspeed_config(setup, micro_batch, precision, knobs, accumulation_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    engine, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(batches):
        for j, ids in enumerate(batches):
            with marks("forward"):
                loss = engine(input_ids=ids, labels=ids).loss
            with marks("backward"):
                engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
                del loss
                if j < len(batches) - 1:
                    engine.step()  # not a boundary: counts the micro-step, steps nothing
        with marks("step"):
            engine.step()
    try:
        resolved = engine._config.zero_config.model_dump(mode="json", by_alias=True)
    except Exception as e:  # noqa: BLE001 - a record, not a requirement
        resolved = f"unavailable: {type(e).__name__}"
    about = {"deepspeed_config": config, "zero_config_resolved": resolved,
             "optimizer": f"{type(zopt).__module__}.{type(zopt).__name__} around torch.optim.AdamW(foreach=False)"}
    return engine.module, zopt, step, about


def _on_gpu() -> bool:
    """Whether this rank trains on a GPU: NCCL, or the fake process group where CUDA is present."""
    import torch

    return torch.cuda.is_available() and torch.distributed.get_backend() in ("nccl", "fake")


def _full_params(setup: str, model) -> dict[str, Any]:
    import torch

    if setup == "3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", torch.float32)
            for n, p in model.named_parameters()}


def _reference(world: int, micro_batch: int, seq: int, steps: int, name: str = DEFAULT_MODEL,
               accumulation_steps: int = 1) -> dict[str, Any]:
    """One process, all ranks' data at once, every micro-batch of theirs (`_micro_batches`) in one
    batch (the mean of equal micro-batches' mean losses = the mean over the whole batch)."""
    import torch

    model = _build(name=name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ids = torch.cat([b for r in range(world) for b in _micro_batches(r, world, micro_batch, seq, name, accumulation_steps)])
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def accumulation_noise(world: int, micro_batch: int, seq: int, steps: int, name: str = DEFAULT_MODEL) -> float:
    """The rounding floor of `max_abs_diff_vs_one_process`: the largest difference between `_reference`
    (one process, all ranks' data in one batch) and one process that adds up each rank's micro-batch
    gradient (loss / world each), as data parallelism does, in another order. Adam turns rounding in
    near-zero gradients (dead ReLU units, say) into whole updates, so some models sit well above
    1e-5 per step however exact the sharding is."""
    import torch

    ref = _reference(world, micro_batch, seq, steps, name)
    model = _build(name=name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    batches = [_batch(r, micro_batch, seq, name) for r in range(world)]
    if world == 1:
        batches = list(batches[0].split(1))
    for _ in range(steps):
        for ids in batches:
            (model(input_ids=ids, labels=ids).loss / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return max(float((p.detach() - ref[n]).abs().max()) for n, p in model.named_parameters())


def warmup_steps(steps: int) -> int:
    """Steps trained before any is measured: two (one when only two are trained)."""
    return min(2, steps - 1)


def run_setup(setup: str, rank: int, world: int, *, micro_batch: int, seq: int, steps: int,
              precision: str = "fp32", model: str = DEFAULT_MODEL, knobs: dict | None = None,
              allocator_check: bool = True, use_cache: bool | None = None, accumulation_steps: int = 1,
              no_sync: bool = False) -> dict[str, Any]:
    """Train `steps` steps (each of `accumulation_steps` micro-batches) and measure every one after the warm-up (`warmup_steps`); return this
    rank's report. The step's peak is the largest over the measured steps, as the allocator's peak
    over a run is: which buffers of the last collective are still alive at a step's worst moment
    depends on when Python frees them, and one step can miss a buffer that the next one holds."""
    from .ledger import LiveBytes

    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if _on_gpu() else None
    marks = track.Marks()
    alloc_log = track.AllocatorLog() if allocator_check and dev is None else None
    with alloc_log or contextlib.nullcontext():
        marks.profiling = alloc_log is not None
        built = _build(name=model, use_cache=use_cache)
        shape = structure(built) if rank == 0 or torch.distributed.get_backend() == "fake" else None
        module, opt, step, about = _engine(setup, built, world, micro_batch, precision, knobs, marks,
                                           accumulation_steps=accumulation_steps, no_sync=no_sync)
        del built
        ids = [x.to(dev or "cpu") for x in _micro_batches(rank, world, micro_batch, seq, model, accumulation_steps)]
        for k in range(warmup_steps(steps)):
            marks.step = k
            step(ids)
        before = track.resident(module, opt)
        if dev is not None:  # on a GPU the allocator is the truth: its peak over the measured steps
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        peaks, comm, tracked = [], None, []
        for k in range(warmup_steps(steps), steps):
            storages = track.resident(module, opt)["storages"] if peaks else before.pop("storages")
            tracker = track.PeakTracker(module, opt, track.owned_storages(module, opt))
            marks.step, marks.tracker = k, tracker
            with track.CommCounter(world) as counter, LiveBytes({"storages": storages}) as live, track.TrackMode(tracker):
                step(ids)
            marks.tracker = None
            tracked.append(tracker.close())
            peaks.append(live.peak)
            comm = comm or counter  # every measured step sends the same
            del tracker
    allocator = alloc_log.steps(list(range(warmup_steps(steps), steps))) if alloc_log is not None else None
    del alloc_log
    cuda = None
    if dev is not None:
        torch.cuda.synchronize()
        cuda = {"gpu": torch.cuda.get_device_name(), "allocated_after_step": torch.cuda.memory_allocated(),
                "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
    after = track.resident(module, opt)
    after.pop("storages")
    # the fake process group moves no data: the trained values mean nothing there
    full = _full_params(setup, module) if torch.distributed.get_backend() != "fake" else None
    return {"setup": setup, "rank": rank, "resident": after, "step_peak": before["total"] + max(peaks),
            "step_transient_peak": max(peaks), "step_transient_peaks": peaks, "cuda": cuda,
            "comm": comm.report(), "peak": _peak_report(tracked, allocator), "engine": about,
            "structure": shape, "params_after": full}


def _peak_report(tracked: list[dict], allocator: list[dict] | None) -> dict[str, Any]:
    """The measured steps' tracked peaks: the largest over steps, the phase it fell in and what was live
    then; each phase's largest with what was live at it; each step's numbers; the allocator's check."""
    def peak_of(t):
        return max(p["peak"] for p in t["phases"].values())

    k = max(range(len(tracked)), key=lambda i: peak_of(tracked[i]))
    phase = max(tracked[k]["phases"], key=lambda ph: tracked[k]["phases"][ph]["peak"])
    by_phase = {}
    for ph in track.PHASES:
        have = [(t["phases"][ph]["peak"], i) for i, t in enumerate(tracked) if ph in t["phases"]]
        if have:
            i = max(have)[1]
            by_phase[ph] = {"measured_step": i, **tracked[i]["phases"][ph]}
    out = {"step_peak": peak_of(tracked[k]), "phase": phase, "measured_step": k,
           "at_peak": tracked[k]["phases"][phase],
           "phase_peaks": {ph: v["peak"] for ph, v in by_phase.items()},
           "phases": by_phase,
           "per_step": [{"start": t["start"], "end": t["end"],
                         "phase_peaks": {ph: v["peak"] for ph, v in t["phases"].items() if ph in track.PHASES},
                         "first_seen_as_input_bytes": t["first_seen_as_input_bytes"],
                         "resize_allocated_bytes": t["resize_allocated_bytes"],
                         "collective_internal_peak": t["collective_internal_peak"]} for t in tracked]}
    if allocator is not None:
        rows = []
        for t, a in zip(tracked, allocator):
            if "error" in a:
                rows.append(a)
                continue
            mine = max(p for ph, p in ((ph, v["peak"]) for ph, v in t["phases"].items()) if ph in track.PHASES) - t["start"]
            rows.append({**a, "tracked_peak_above_start": mine,
                         "tracked_phase_peaks_above_start": {ph: v["peak"] - t["start"]
                                                             for ph, v in t["phases"].items() if ph in track.PHASES}})
        out["allocator_check"] = rows
        # the CPU allocator's own peak, gloo's internal buffers included, from steps whose record lost no
        # free (a free in a thread the profiler does not follow inflates everything after it)
        whole = [t["start"] + a["peak_above_start"] for t, a in zip(tracked, allocator)
                 if "error" not in a and abs(a["end_above_start"]) <= track.SLACK]
        out["cpu_allocator_step_peak"] = max(whole) if whole else None
        out["tracked_equals_allocator"] = all(
            abs(a["peak_above_start_excluding_collective_internals"] - a["tracked_peak_above_start"]) <= track.SLACK
            for a in rows if "error" not in a and abs(a["end_above_start_excluding_collective_internals"]) <= track.SLACK)
    return out


def _record(args, world: int, *, note: str, device: str, structure_, setups: dict, knobs: dict) -> dict:
    """The results file's record, the same for real ranks (rank 0 writes it) and a fake one."""
    from .record import provenance

    model = getattr(args, "model", DEFAULT_MODEL)
    out = {"experiment": "zero", "note": note, "backend": args.backend, "ranks": world,
           "model": MODELS[model]["config"], "params": model_spec(model).params,
           "micro_batch_size": args.micro_batch, "seq_len": args.seq, "steps": args.steps,
           "provenance": provenance(device), "setups": setups}
    try:
        import deepspeed

        out["provenance"]["deepspeed"] = deepspeed.__version__
    except ImportError:  # FSDP2 alone needs only torch
        pass
    out.update(model_name=model, model_family=MODELS[model]["family"],
               model_about=MODELS[model]["about"], structure=structure_, precision=args.precision,
               deepspeed_knobs=knobs, accumulation_steps=getattr(args, "accumulation_steps", 1),
               no_sync=bool(getattr(args, "no_sync", False)), use_cache=_use_cache(model) if getattr(args, "use_cache", None) is None
               else args.use_cache)
    return out


def _use_cache(name: str) -> bool:
    """Whether the model trains with transformers' KV cache on: its config's use_cache (this module keeps
    transformers' default, on; it changes what fused-QKV blocks save: memory.training_phases)."""
    return bool(_config(name).use_cache)


def _worker(rank: int, world: int, args, port: int) -> None:
    import torch
    import torch.distributed as dist

    from .collectives import first_line
    from .memory import settle_imports
    from .ranks import rank_device

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    rank_device(args.backend, rank)
    model = getattr(args, "model", DEFAULT_MODEL)
    knobs = {k: getattr(args, k, None) for k in DS_KNOBS}
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        settle_imports(RANK_IMPORTS)
        reports = []
        for setup in args.setups:
            r = run_setup(setup, rank, world, micro_batch=args.micro_batch, seq=args.seq, steps=args.steps,
                          precision=args.precision, model=model, knobs=knobs,
                          allocator_check=getattr(args, "allocator_check", True),
                          use_cache=getattr(args, "use_cache", None),
                          accumulation_steps=getattr(args, "accumulation_steps", 1),
                          no_sync=getattr(args, "no_sync", False))
            reports.append(r)
            dist.barrier()
            gc.collect()
        if rank == 0:
            cache = getattr(args, "ref_cache", None)
            if cache and Path(cache).exists():
                ref = torch.load(cache)
            else:
                ref = _reference(world, args.micro_batch, args.seq, args.steps, model,
                                 getattr(args, "accumulation_steps", 1))
                if cache:
                    torch.save(ref, cache)
        gathered = [None] * world
        slim = [{k: v for k, v in r.items() if k not in ("params_after", "structure")} for r in reports]
        diffs = []
        for r in reports:
            if rank == 0:
                diffs.append(max(float((r["params_after"][n] - ref[n]).abs().max()) for n in ref))
        dist.all_gather_object(gathered, slim)
        if rank == 0:
            note = (f"NCCL on {world} GPUs; memory by a scan of live storages" if args.backend == "nccl" else
                    f"gloo on {world} CPU processes; memory by a scan of live storages on the CPU, not a GPU measurement")
            out = _record(args, world, note=note, device="cuda" if args.backend == "nccl" else "cpu",
                          structure_=reports[0]["structure"] if reports else None,
                          setups={s: {"max_abs_diff_vs_one_process": d, "per_rank": [g[i] for g in gathered],
                                      "engine": gathered[0][i].get("engine")}
                                  for i, (s, d) in enumerate(zip(args.setups, diffs))},
                          knobs={DS_KNOBS[k]: v for k, v in knobs.items()})
            Path(args.out).write_text(json.dumps(out) + "\n")
        dist.barrier()
        dist.destroy_process_group()
        import multiprocessing

        if multiprocessing.current_process().name != "MainProcess":
            # a spawned rank: leave without interpreter teardown, where a thread DeepSpeed leaves behind
            # aborts the process ("terminate called without an active exception") after the work is done
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except Exception as e:  # noqa: BLE001 - one line per failing rank
        if os.environ.get("ZEROLAB_DEBUG"):  # the whole traceback, for whoever debugs a rank
            import traceback
            traceback.print_exc()
        raise ZerolabError(f"rank {rank}: {type(e).__name__}: {first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fake_rank(args) -> int:
    """One rank (`args.rank`) of a world of `args.nproc`, alone in this process, with torch's fake process
    group: every collective returns at once and moves nothing, but FSDP2 allocates its all-gather and
    reduce-scatter buffers, shards and gathered parameters exactly as on real ranks. On a GPU the
    allocator's peak is this rank's truth (NCCL's own buffers, outside PyTorch's allocator, aside), for
    worlds larger than the machine's GPUs; on the CPU it checks the method against real gloo ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .collectives import first_line

    rank, world = args.rank, args.nproc
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        r = run_setup("fsdp2", rank, world, micro_batch=args.micro_batch, seq=args.seq, steps=args.steps,
                      precision=args.precision, model=args.model, allocator_check=False,
                      use_cache=args.use_cache, accumulation_steps=args.accumulation_steps, no_sync=args.no_sync)
    except Exception as e:  # noqa: BLE001 - one line
        if os.environ.get("ZEROLAB_DEBUG"):
            import traceback
            traceback.print_exc()
        print(f"zerolab: rank {rank} of {world} (fake process group): {type(e).__name__}: {first_line(e)}",
              file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    where = (f"on {torch.cuda.get_device_name()}: the allocator's peak is the measurement" if on_gpu else
             "on the CPU: memory by a scan of live storages, not a GPU measurement")
    structure_ = r.pop("structure")
    r.pop("params_after")
    out = _record(args, world, note=f"rank {rank} of {world} alone, torch's fake process group (collectives move "
                                     f"no data; every allocation real) {where}",
                  device="cuda" if on_gpu else "cpu", structure_=structure_, knobs={},
                  setups={"fsdp2": {"max_abs_diff_vs_one_process": None, "per_rank": [r], "engine": r.get("engine")}})
    out = {"experiment": out.pop("experiment"), "backend": "fake", "ranks": world, "measured_rank": rank, **out}
    out["command"] = "python -m vramlab.measure.zero " + " ".join(args.argv)
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


def _elements(minimum: int):
    """An argparse type: a whole number of elements (5e8 and 500000000 alike), at least `minimum`."""
    def parse(text: str) -> int:
        try:
            x = float(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of elements, got {text!r}") from None
        if not x == x or x in (float("inf"), float("-inf")) or x != int(x):
            raise argparse.ArgumentTypeError(f"expected a whole number of elements, got {text!r}")
        if not minimum <= x <= 1 << 40:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {1 << 40:,} elements, got {text!r}")
        return int(x)
    return parse


PROG = "python -m vramlab.measure.zero"
# what every CPU rank imports, loaded once by the fork server the ranks start from (collectives.launch); the
# profiler's memory record and DeepSpeed's optimizers import torch's compiler stack
RANK_IMPORTS = ("deepspeed", "transformers", "torch.distributed.fsdp", "torch._dynamo", "torch._inductor.compile_fx",
                "torch.profiler")
MAX_RANKS = 256  # real ranks (processes on this machine, or one per GPU)
MAX_FAKE_WORLD = 1 << 16  # --backend fake: the world one measured rank belongs to


def main(argv: list[str] | None = None) -> int:
    from .collectives import backend_problem, launch

    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: ZeRO stages 0-3 and/or fsdp2")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS),
                   help=f"the model trained (default {DEFAULT_MODEL}, lab 4's; --list-models describes them)")
    p.add_argument("--list-models", action="store_true", help="describe the models and exit")
    p.add_argument("--backend", choices=("gloo", "nccl", "fake"), default="gloo",
                   help="fake: one rank (--rank) of --nproc alone in this process, torch's fake process group "
                        "(FSDP2 only; on a GPU where there is one)")
    p.add_argument("--nproc", type=A(whole, int, lo=1, hi=MAX_FAKE_WORLD), default=2,
                   help=f"ranks: 1 to {MAX_RANKS} real ones, or the world of --backend fake (up to {MAX_FAKE_WORLD:,})")
    p.add_argument("--rank", type=A(whole, int, lo=0, hi=MAX_FAKE_WORLD - 1), default=0,
                   help="with --backend fake: the rank measured (default 0)")
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=None,
                   help="per rank (default: the model's, 2 for the lab's)")
    p.add_argument("--seq", type=A(whole, int, lo=1), default=None,
                   help="tokens per sequence, at most the model's positions (default: the model's, 64 for the lab's)")
    p.add_argument("--steps", type=int, default=5,
                   help="steps trained, 2 to 1000; every one after the first two is measured (the peak is their "
                        "largest)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: DeepSpeed's bf16 optimizer, FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reductions)")
    ds = p.add_argument_group("DeepSpeed's zero_optimization (elements; default: DeepSpeed's own)")
    ds.add_argument("--reduce-bucket", type=_elements(1), default=None, help="reduce_bucket_size (DeepSpeed: 5e8)")
    ds.add_argument("--allgather-bucket", type=_elements(1), default=None,
                    help="allgather_bucket_size, stages 1-2 (DeepSpeed: 5e8)")
    ds.add_argument("--prefetch-bucket", type=_elements(0), default=None,
                    help="stage3_prefetch_bucket_size (DeepSpeed: 5e7)")
    ds.add_argument("--max-live-params", type=_elements(0), default=None,
                    help="stage3_max_live_parameters (DeepSpeed: 1e9)")
    ds.add_argument("--persistence-threshold", type=_elements(0), default=None,
                    help="stage3_param_persistence_threshold (DeepSpeed: 1e5)")
    p.add_argument("--accumulation-steps", type=A(whole, int, lo=1, hi=64), default=1,
                   help="micro-batches per optimizer step, 1 to 64 (each --micro-batch sequences; default 1)")
    p.add_argument("--no-sync", action="store_true",
                   help="FSDP2 with --accumulation-steps: set_requires_gradient_sync(False) on every micro-batch but "
                        "the last (needs --setups fsdp2)")
    p.add_argument("--kv-cache", choices=("default", "on", "off"), default="default",
                   help="transformers' KV cache while training (default: the config's, on): changes what "
                        "fused-QKV blocks save (vramlab.memory.training_phases' use_cache)")
    p.add_argument("--no-allocator-check", dest="allocator_check", action="store_false",
                   help="skip the cross-check against the CPU allocator's record (the profiler's memory events)")
    p.add_argument("--out", default="", help="write the results as JSON here (checked before any rank starts)")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0,
                   help="rendezvous port, 1 to 65535 (default 0: a free one)")
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=300.0,
                   help="seconds a rendezvous or collective may take (default 300)")
    args = p.parse_args(argv)
    args.use_cache = {"default": None, "on": True, "off": False}[args.kv_cache]
    if args.list_models:
        for name, m in MODELS.items():
            print(f"{name:20} {m['family']:9} micro-batch {m['micro_batch']} x seq {m['seq']}: {m['about']}")
        return 0
    spec = MODELS[args.model]
    args.micro_batch = spec["micro_batch"] if args.micro_batch is None else args.micro_batch
    args.seq = spec["seq"] if args.seq is None else args.seq
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in args.setups if s not in SETUPS]
    if bad or not args.setups:
        p.error(f"unknown setup {', '.join(bad) or '(none)'}; choose from {', '.join(SETUPS)}")
    if len(set(args.setups)) != len(args.setups):
        p.error(f"--setups names each setup once, got {','.join(args.setups)}")
    if not 2 <= args.steps <= 1000:
        p.error(f"--steps must be at least 2 and at most 1,000 (the first two are not measured), got {args.steps}")
    if args.seq > spec["max_seq"]:
        which = "the lab model's" if args.model == DEFAULT_MODEL else f"{args.model}'s"
        p.error(f"--seq must be at most {spec['max_seq']} ({which} positions)")
    if args.no_sync and args.setups != ["fsdp2"]:
        p.error("--no-sync is FSDP2's set_requires_gradient_sync(False): add --setups fsdp2 (DeepSpeed decides by "
                "stage: ZeRO-0/1 reduce once per step, ZeRO-2/3 every micro-batch)")
    if args.backend == "fake":
        if args.setups != ["fsdp2"]:
            p.error("--backend fake runs FSDP2 only: add --setups fsdp2")
        if not 0 <= args.rank < args.nproc:
            p.error(f"--rank must be between 0 and {args.nproc - 1} (--nproc {args.nproc})")
        checks.output_path(PROG, args.out)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return _fake_rank(args)
    if args.rank:
        p.error("--rank needs --backend fake (real ranks are all measured)")
    if args.nproc > MAX_RANKS:
        p.error(f"--nproc must be at most {MAX_RANKS} real ranks, got {args.nproc} (--backend fake measures one rank "
                f"of a larger world)")
    if MODELS[args.model].get("scale") == "gpu" and args.backend == "gloo":
        p.error(f"{args.model} is GPU-scale: measure one of its ranks with --backend fake --setups fsdp2 "
                f"(on a GPU), or choose a CPU model (--list-models)")
    checks.output_path(PROG, args.out)
    why = backend_problem(args)
    if why:  # NCCL: one process per GPU, before any rank starts
        checks.fail(PROG, why)
    # one process group per setup, in fresh processes: nothing of one setup (DeepSpeed's buffers, a
    # model) can be alive in the next one's measurement
    import tempfile

    merged: dict[str, Any] | None = None
    out, setups = args.out, args.setups
    with tempfile.TemporaryDirectory() as keep:
        args.ref_cache = str(Path(keep) / "reference.pt")  # one process's training, computed once for all setups
        for k, setup in enumerate(setups):
            print(f"zerolab: {setup if setup == 'fsdp2' else 'ZeRO-' + setup} on {args.nproc} {args.backend} ranks, "
                  f"{args.model} ({k + 1}/{len(setups)})", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                args.setups, args.out = [setup], str(Path(tmp) / "part.json")
                status = launch(_worker, args, prog=PROG, error=ZerolabError, torchrun_port=29500, preload=RANK_IMPORTS)
                if status:
                    return status
                if not Path(args.out).exists():  # under torchrun only rank 0 writes
                    continue
                part = json.loads(Path(args.out).read_text())
            if merged is None:
                merged = part
            else:
                merged["setups"].update(part["setups"])
    if merged is None:
        return 0
    merged["command"] = "python -m vramlab.measure.zero " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(merged, indent=1) + "\n"
    if out:
        Path(out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
