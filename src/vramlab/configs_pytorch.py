"""PyTorch's own trainers' configs read into a `configs_fields.Draft`: a torchtune recipe YAML (the
single-device recipes, LoRA and QLoRA among them, and the distributed ones: FSDP2) and a torchtitan
TOML (FSDP2 over data_parallel_shard_degree ranks). Pure: the standard library and vramlab's calculators.
"""

from __future__ import annotations

import os

from . import checks
from .configs_fields import Block, Draft, as_bool, as_int, fail

_TUNE_PASS = frozenset("""
tokenizer dataset seed shuffle lr_scheduler epochs max_steps_per_epoch output_dir metric_logger log_every_n_steps
log_peak_memory_stats profiler resume_from_checkpoint save_adapter_weights_only device clip_grad_norm
optimizer_in_bwd_kwargs log_level valid_data_files run_val_every_n_steps dataset_val inference custom_sharded_layers
""".split())
# torchtune's model builders (torchtune/models/*) and torchtitan's flavors whose shapes are a preset's
TUNE_PRESETS = {"llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b", "llama3_1_405b": "llama-3.1-405b",
                "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b", "mistral_7b": "mistral-7b"}
TITAN_PRESETS = {("llama3", "8B"): "llama-3.1-8b", ("llama3", "70B"): "llama-3.1-70b",
                 ("llama3", "405B"): "llama-3.1-405b"}
_TUNE_LORA_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}


def read_torchtune(data, d: Draft, base: str):
    """A torchtune recipe config (recipes/configs/*.yaml): the single-device recipes, or the distributed
    ones (FSDP2 over the ranks `tune run --nproc_per_node` starts: give gpus=)."""
    b = Block(data, "", "torchtune")
    m = b.block("model")
    comp = str(m.get("_component_"))
    last = comp.rsplit(".", 1)[-1]
    if last.startswith(("lora_", "qlora_")):
        d.put("method", "qlora" if last.startswith("qlora_") else "lora", "model._component_")
        d.put("lora_rank", as_int("model.lora_rank", m.get("lora_rank", 8)), "model.lora_rank")
        mods = m.get("lora_attn_modules", [])
        bad = [x for x in mods if x not in _TUNE_LORA_NAMES]
        if bad:
            fail(f"model.lora_attn_modules: {bad[0]!r} is not a torchtune attention projection")
        t = [_TUNE_LORA_NAMES[x] for x in mods]
        if as_bool("model.apply_lora_to_mlp", m.get("apply_lora_to_mlp", False)):
            t += ["gate_proj", "down_proj", "up_proj"]  # w1, w2, w3
        m.only("apply_lora_to_output", (False,), "LoRA on the output projection")
        d.put("lora_targets", tuple(dict.fromkeys(t)), "model.lora_attn_modules + model.apply_lora_to_mlp")
        d.put("adapter_dtype", "base", "dtype (torchtune holds the adapters in the model's dtype)")
        m.known("lora_alpha", "lora_dropout", "use_dora", "quantize_base")
    m.finish()
    ck = b.block("checkpointer")
    named = None
    if ck is not None:
        cdir = ck.get("checkpoint_dir")
        ck.known("_component_", "checkpoint_files", "recipe_checkpoint", "output_dir", "model_type",
                 "adapter_checkpoint", "safe_serialization")
        ck.finish()
        if cdir and os.path.isfile(os.path.join(cdir, "config.json")):
            named = (cdir, "checkpointer.checkpoint_dir (its config.json)")
    builder = last.removeprefix("qlora_").removeprefix("lora_")
    if named is None and builder in TUNE_PRESETS:
        named = (TUNE_PRESETS[builder], f"model._component_ ({builder}: the preset of its shapes)")
    tok = b.block("tokenizer")
    if tok is not None and tok.get("max_seq_len") is not None:
        d.put("seq_len", as_int("tokenizer.max_seq_len", tok.get("max_seq_len")), "tokenizer.max_seq_len")
    if tok is not None:
        tok.seen.update(tok.data)
    d.put("micro_batch_size", as_int("batch_size", b.get("batch_size", 1)), "batch_size")
    if b.given("gradient_accumulation_steps"):
        d.put("accumulation_steps", as_int("gradient_accumulation_steps", b.get("gradient_accumulation_steps")),
              "gradient_accumulation_steps")
    dt = b.get("dtype", "fp32")
    if dt not in ("bf16", "fp32"):
        fail(f"dtype = {checks.show(dt)} is not modelled (bf16, fp32)")
    d.put("precision", "bf16" if dt == "bf16" else "fp32", "dtype (torchtune trains the whole model in it: "
          "parameters, gradients and optimizer states)")
    opt = b.block("optimizer")
    if opt is not None:
        oc = opt.get("_component_", "")
        kinds = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd",
                 "bitsandbytes.optim.PagedAdamW8bit": "adamw-8bit", "bitsandbytes.optim.AdamW8bit": "adamw-8bit"}
        if oc not in kinds:
            fail(f"optimizer._component_ = {checks.show(oc)} is not modelled; modelled: {', '.join(kinds)}")
        d.put("optimizer", kinds[oc], "optimizer._component_")
        fused, foreach = opt.get("fused"), opt.get("foreach")
        if fused is not None and as_bool("optimizer.fused", fused):
            d.put("optimizer_impl", "fused", "optimizer.fused")
        elif foreach is not None and not as_bool("optimizer.foreach", foreach):
            d.put("optimizer_impl", "for-loop", "optimizer.foreach")
        else:
            d.put("optimizer_impl", "foreach", "assumed: torch's default (foreach)")
        opt.known("lr", "weight_decay", "betas", "eps", "momentum", "amsgrad")
        opt.finish()
    loss = b.block("loss")
    if loss is not None:
        lc = loss.get("_component_", "")
        kinds = {"torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
                 "torchtune.modules.loss.LinearCrossEntropyLoss": "chunked",
                 "torch.nn.CrossEntropyLoss": "whole"}
        if lc not in kinds:
            fail(f"loss._component_ = {checks.show(lc)} is not modelled; modelled: {', '.join(kinds)}")
        loss.known("num_output_chunks")
        loss.finish()
        d.put("loss", kinds[lc], "loss._component_ (torchtune's chunked cross-entropy: memory.TORCHTUNE_CHUNKS)")
    if b.given("enable_activation_checkpointing"):
        d.put("recompute", "full" if as_bool("enable_activation_checkpointing", b.get("enable_activation_checkpointing"))
              else "none", "enable_activation_checkpointing")
    b.only("enable_activation_offloading", (False,), "activation offloading (vramlab offload --scheme save-on-cpu)")
    b.only("compile", (False,), "torch.compile changes which activations are saved")
    b.only("optimizer_in_bwd", (False,), "the optimizer step fused into the backward")
    b.only("fsdp_cpu_offload", (False,), "FSDP2's CPU offload over several ranks")
    b.only("tensor_parallel_dim", (1,), "tensor parallelism (vramlab plan)")
    b.known("fsdp_reshard_after_forward", "data_parallel_shard_dim", "data_parallel_replicate_dim",
            "memory_efficient_fsdp_wrap")
    if b.get("fsdp_reshard_after_forward") is False:
        fail("fsdp_reshard_after_forward = False is not modelled: FSDP2 with reshard_after_forward=True only")
    b.only("data_parallel_replicate_dim", (1,), "HSDP (replicated shards)")
    b.known(*_TUNE_PASS)
    b.finish()
    marks = [k for k in ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "memory_efficient_fsdp_wrap",
                         "data_parallel_shard_dim", "custom_sharded_layers") if k in data]
    if marks:  # a *_distributed recipe's config: FSDP2 over the ranks
        d.put("sharding", "fsdp2", f"{marks[0]} (a distributed recipe: FSDP2's fully_shard)")
        d.put("zero_stage", 3, f"{marks[0]} (fully_shard shards like ZeRO-3)")
    return named

# ----------------------------------------------------------------------------- torchtitan

def read_torchtitan(data, d: Draft, base: str):
    """A torchtitan train config (torchtitan/models/*/train_configs/*.toml): FSDP2 over
    data_parallel_shard_degree ranks, mixed_precision_param bf16 with fp32 sharded parameters."""
    b = Block(data, "", "torchtitan")
    for k in ("job", "profiling", "metrics", "lr_scheduler", "checkpoint", "comm", "validation", "fault_tolerance",
              "experimental", "memory_estimation"):
        b.known(k)
    m = b.block("model")
    named = None
    if m is not None:
        hf = m.get("hf_assets_path")
        if hf and os.path.isfile(os.path.join(hf, "config.json")):
            named = (hf, "model.hf_assets_path (its config.json)")
        key = (m.get("name"), str(m.get("flavor")))
        if named is None and key in TITAN_PRESETS:
            named = (TITAN_PRESETS[key], f"model.name + model.flavor ({key[0]} {key[1]}: the preset of its shapes)")
        m.known("name", "flavor", "tokenizer_path", "hf_assets_path")
        m.only("converters", ([], ""), "float8 / mx training")
        m.finish()
    opt = b.block("optimizer")
    if opt is not None:
        name = opt.get("name", "AdamW")
        if name not in ("AdamW", "Adam"):
            fail(f"optimizer.name = {checks.show(name)} is not modelled (AdamW, Adam)")
        d.put("optimizer", "adamw", "optimizer.name")
        impl = opt.get("implementation", "fused")
        if impl not in ("fused", "foreach", "for-loop"):
            fail(f"optimizer.implementation = {checks.show(impl)} is not modelled")
        d.put("optimizer_impl", impl, "optimizer.implementation" if opt.given("implementation")
              else "assumed: torchtitan's default implementation fused")
        opt.known("lr", "eps", "beta1", "beta2", "weight_decay", "early_step_in_backward")
        opt.finish()
    t = b.block("training")
    if t is None:
        fail("a torchtitan config needs its [training] section (batch size, seq_len)")
    for key in ("local_batch_size", "batch_size"):
        if t.get(key) is not None:
            d.put("micro_batch_size", as_int(f"training.{key}", t.get(key)), f"training.{key}")
            break
    if t.get("global_batch_size") not in (None, -1):
        d.values["_global_batch"] = (as_int("training.global_batch_size", t.get("global_batch_size")),
                                     "training.global_batch_size")
    if t.get("seq_len") is not None:
        d.put("seq_len", as_int("training.seq_len", t.get("seq_len")), "training.seq_len")
    mpp = t.get("mixed_precision_param", "bfloat16")
    if mpp not in ("bfloat16", "float32"):
        fail(f"training.mixed_precision_param = {checks.show(mpp)} is not modelled (bfloat16, float32)")
    recipe_src = "training.mixed_precision_param" if t.given("mixed_precision_param") else \
        "assumed: torchtitan's default mixed_precision_param bfloat16"
    d.put("recipe", "mixed-adam" if mpp == "bfloat16" else "fp32-adam", recipe_src + " (fp32 sharded parameters)")
    d.put("precision", "bf16-mixed" if mpp == "bfloat16" else "fp32", recipe_src)
    t.only("compile", (False,), "torch.compile changes which activations are saved")
    t.only("enable_cpu_offload", (False,), "FSDP2's CPU offload over several ranks")
    t.known("max_norm", "steps", "dataset", "dataset_path", "mixed_precision_reduce", "gc_freq", "seed",
            "deterministic", "warmup_steps")
    t.finish()
    c = b.block("compile")
    if c is not None:
        c.only("enable", (False,), "torch.compile changes which activations are saved")
        c.known("components", "backend")
        c.finish()
    p = b.block("parallelism")
    shard = -1
    if p is not None:
        for k in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                  "expert_parallel_degree", "data_parallel_replicate_degree"):
            p.only(k, (1,), "only FSDP (data_parallel_shard_degree) is modelled here: vramlab plan / context / experts")
        shard = p.get("data_parallel_shard_degree", -1)
        p.known("enable_async_tensor_parallel", "fsdp_reshard_after_forward", "disable_loss_parallel",
                "enable_compiled_autograd", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size")
        if p.get("fsdp_reshard_after_forward", "default") not in ("default", "always"):
            fail("parallelism.fsdp_reshard_after_forward other than default/always is not modelled")
        p.finish()
    if shard != -1:
        d.put("gpus", as_int("parallelism.data_parallel_shard_degree", shard), "parallelism.data_parallel_shard_degree")
    else:
        d.values["_gpus_from_launcher"] = "parallelism.data_parallel_shard_degree = -1 (every rank torchrun starts)"
    d.put("sharding", "fsdp2", "torchtitan shards with FSDP2's fully_shard")
    d.put("zero_stage", 3, "torchtitan: fully_shard shards like ZeRO-3")
    ac = b.block("activation_checkpoint")
    if ac is not None:
        mode = ac.get("mode", "selective")
        if mode not in ("none", "full"):
            fail(f"activation_checkpoint.mode = {checks.show(mode)} is not modelled with FSDP2 "
                 "(zero.rank_phases: none or full); vramlab checkpoint prices selective plans on one GPU")
        d.put("recompute", mode, "activation_checkpoint.mode")
        ac.known("selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop")
        ac.finish()
    f8 = b.block("float8")
    if f8 is not None:
        f8.only("enable_fsdp_float8_all_gather", (False,), "float8 all-gathers")
        f8.known("precompute_float8_dynamic_scale_for_fsdp", "filter_fqns", "recipe_name", "emulate")
        f8.finish()
    b.finish()
    return named
