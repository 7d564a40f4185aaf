"""The Hugging Face stack's training configs read into a `configs_fields.Draft`: a `TrainingArguments`
JSON (transformers 5.23; TRL's `max_length` too), an `accelerate config` YAML and an Axolotl YAML, with
the FSDP block all three write (FSDP2 only) and the DeepSpeed config they may name
(`vramlab.configs_deepspeed`). Pure: the standard library and vramlab's calculators.
"""

from __future__ import annotations

from . import checks
from .configs_deepspeed import deepspeed_file, read_deepspeed
from .configs_fields import TRAINER_BATCH, Block, Draft, as_bool, as_int, fail

# Every TrainingArguments field of transformers 5.23 and the 4.x ones still found in saved
# training_args.json files that do not change the peak of a training step (logging, saving, evaluation,
# the learning rate, the hub...). Fields that do change memory are read (read_trainer) or refused unless at
# their default; anything else is unknown.
_TRAINER_PASS = frozenset("""
output_dir overwrite_output_dir num_train_epochs max_steps learning_rate lr_scheduler_type lr_scheduler_kwargs
warmup_steps warmup_ratio optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm
label_smoothing_factor tf32 neftune_noise_alpha torch_empty_cache_steps logging_strategy logging_steps
logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level
log_level_replica disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id
trackio_static_space_id eval_strategy evaluation_strategy eval_steps eval_delay per_device_eval_batch_size
prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object eval_accumulation_steps
include_for_metrics include_inputs_for_metrics batch_eval_metrics save_only_model save_strategy save_steps
save_on_each_node save_total_limit save_safetensors enable_jit_checkpoint push_to_hub hub_token hub_private_repo
hub_model_id hub_strategy hub_always_push hub_revision load_best_model_at_end metric_for_best_model
greater_is_better ignore_data_skip restore_callback_states_from_checkpoint full_determinism seed data_seed
accelerator_config dataloader_drop_last dataloader_num_workers dataloader_pin_memory
dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order
remove_unused_columns label_names train_sampling_strategy length_column_name group_by_length
ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout
debug skip_memory_metrics do_train do_eval do_predict resume_from_checkpoint local_rank logging_dir
average_tokens_across_devices per_gpu_eval_batch_size past_index use_legacy_prediction_loop
push_to_hub_model_id push_to_hub_organization push_to_hub_token mp_parameters ray_scope include_tokens_per_second
save_on_each_node tpu_num_cores tpu_metrics_debug jit_mode_eval use_ipex fp16_opt_level half_precision_backend
fp16_backend bf16_full_eval fp16_full_eval dispatch_batches split_batches eval_accumulation_steps
use_mps_device no_cuda dataset_text_field packing dataset_num_proc
""".split())
# TrainingArguments.optim -> (vramlab optimizer, implementation)
TRAINER_OPTIMS = {"adamw_torch": ("adamw", "foreach"), "adamw_torch_fused": ("adamw", "fused"),
                  "adamw_hf": ("adamw", "for-loop"), "sgd": ("sgd", "foreach"),
                  "adamw_bnb_8bit": ("adamw-8bit", "foreach"), "adamw_8bit": ("adamw-8bit", "foreach"),
                  "paged_adamw_8bit": ("adamw-8bit", "foreach")}
TRAINER_OPTIM_DEFAULT = "adamw_torch_fused"  # transformers 5.23's default


def read_trainer(data, d: Draft, base: str):
    """TrainingArguments (transformers 5.23, training_args.py) as `to_dict()` writes it or a subset."""
    b = Block(data, "", "trainer")
    bs = b.get("per_device_train_batch_size")
    if bs is None and b.get("per_gpu_train_batch_size") is not None:
        bs, key = b.get("per_gpu_train_batch_size"), "per_gpu_train_batch_size"
    else:
        key = "per_device_train_batch_size"
    b.known("per_gpu_train_batch_size")
    if bs is None:
        d.put("micro_batch_size", TRAINER_BATCH, "assumed: no per_device_train_batch_size: its default 8")
    else:
        d.put("micro_batch_size", as_int(key, bs), key)
    gas = b.get("gradient_accumulation_steps")
    d.put("accumulation_steps", 1 if gas is None else as_int("gradient_accumulation_steps", gas),
          "gradient_accumulation_steps" if gas is not None else "assumed: gradient_accumulation_steps default 1")
    bf16, fp16 = (as_bool(k, b.get(k, False)) for k in ("bf16", "fp16"))
    d.values["_half"] = ("bf16" if bf16 else "fp16" if fp16 else None, "bf16" if bf16 else "fp16" if fp16 else
                         "bf16 and fp16 false")
    for key in ("max_length", "max_seq_length"):  # TRL's SFTConfig
        if b.get(key) is not None:
            d.put("seq_len", as_int(key, b.get(key)), f"{key} (TRL)")
    optim = b.get("optim", TRAINER_OPTIM_DEFAULT)
    if optim not in TRAINER_OPTIMS:
        fail(f"optim = {checks.show(optim)} is not modelled; modelled: {', '.join(TRAINER_OPTIMS)}")
    d.put("optimizer", TRAINER_OPTIMS[optim][0], "optim" if b.given("optim") else
          f"assumed: optim default {TRAINER_OPTIM_DEFAULT}")
    d.put("optimizer_impl", TRAINER_OPTIMS[optim][1], d.sources["optimizer"])
    b.known("optim_target_modules")
    ck = None
    for key in ("activation_checkpointing", "gradient_checkpointing"):  # 5.x name, and its deprecated alias
        v = b.get(key)
        if v is not None and ck is None:
            ck = (as_bool(key, v), key)
    b.known("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    if ck:
        d.put("recompute", "full" if ck[0] else "none", ck[1])
    if b.get("use_cache") is not None:
        d.put("use_cache", as_bool("use_cache", b.get("use_cache")), "use_cache")
    b.only("torch_compile", (False,), "torch.compile changes which activations are saved (see the compile chapter)")
    b.known("torch_compile_backend", "torch_compile_mode")
    b.only("use_liger_kernel", (False,), "Liger's fused kernels (its fused loss alone: --loss fused)")
    b.known("liger_kernel_config")
    b.only("auto_find_batch_size", (False,), "the Trainer halves the batch on OOM, so the batch is not known")
    b.only("use_cpu", (False,), "training on the CPU")
    b.only("parallelism_config", (), "tensor, context or sequence parallelism (vramlab plan / context)")
    b.known(*_TRAINER_PASS)
    ctx = {"batch": (d.values["micro_batch_size"], d.sources["micro_batch_size"]),
           "accumulation": (d.values["accumulation_steps"], d.sources["accumulation_steps"]),
           "bf16": (bf16, "bf16"), "fp16": (fp16, "fp16"), "_who": "trainer"}
    ds = b.get("deepspeed")
    fsdp = b.get("fsdp")
    if ds and fsdp:
        fail("deepspeed and fsdp are both set: the Trainer takes one")
    if ds:
        read_deepspeed(deepspeed_file(ds, base, "deepspeed"), d, base, path="deepspeed", ctx=ctx)
    fsdp_on = bool(fsdp) and fsdp not in ("", [], False)
    fc = b.block("fsdp_config")
    if fsdp_on:
        if isinstance(fsdp, (str, list)):
            opts = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
            bad = [o for o in opts if o not in ("full_shard", "auto_wrap")]
            if bad:
                fail(f"fsdp = {checks.show(fsdp)}: {bad[0]!r} is not modelled (FSDP2 full_shard, auto_wrap only)")
        _fsdp_config(fc, d, *_fsdp_version(fc, 2, "transformers 5's default FSDP version 2"))
    elif fc is not None:
        fc.seen.update(fc.data)  # fsdp off: its config is not used
    b.finish()
    return None


def _fsdp_key(fc: "Block", k: str) -> str:
    """accelerate and older Axolotl write fsdp_<name>, transformers and Axolotl <name>: whichever is there."""
    return next((n for n in ("fsdp_" + k, k) if n in fc.data), k)


def _fsdp_config(fc: "Block | None", d: Draft, version, version_src: str) -> None:
    """An FSDP config block (transformers' fsdp_config, accelerate's, Axolotl's): FSDP2's fully_shard,
    every block its own unit, reshard after forward."""
    if str(version) != "2":
        fail(f"{version_src.removeprefix('assumed: ')}: FSDP version {version} (FSDP1) is not modelled; vramlab "
             "prices FSDP2's fully_shard (set the FSDP version to 2)")
    d.put("sharding", "fsdp2", version_src)
    d.put("zero_stage", 3, f"{version_src} (fully_shard shards like ZeRO-3)")
    if fc is None:
        return
    key = lambda k: _fsdp_key(fc, k)  # noqa: E731
    fc.known(key("version"))
    strategy = fc.get(key("sharding_strategy"))
    if strategy is not None and str(strategy) not in ("FULL_SHARD", "1"):
        fail(f"{fc.name(key('sharding_strategy'))} = {checks.show(strategy)} is not modelled (FULL_SHARD only)")
    reshard = fc.get(key("reshard_after_forward"))
    if reshard is not None and str(reshard).lower() not in ("true", "full_shard"):
        fail(f"{fc.name(key('reshard_after_forward'))} = {checks.show(reshard)} is not modelled: FSDP2 with "
             "reshard_after_forward=True only")
    for k in ("offload_params", "cpu_offload"):
        off = fc.get(key(k))
        if off is not None and str(off).lower() != "false":
            fail(f"{fc.name(key(k))} = {checks.show(off)} is not modelled over several ranks (offload.model_offload "
                 "prices FSDP2's CPUOffloadPolicy on one GPU: vramlab offload --scheme fsdp2-cpu)")
    ac = fc.get(key("activation_checkpointing"))
    if ac is not None:
        d.put("recompute", "full" if as_bool(fc.name(key("activation_checkpointing")), ac) else "none",
              fc.name(key("activation_checkpointing")))
    for k in ("auto_wrap_policy", "transformer_layer_cls_to_wrap", "backward_prefetch", "forward_prefetch",
              "cpu_ram_efficient_loading", "state_dict_type", "sync_module_states", "use_orig_params",
              "min_num_params", "limit_all_gathers", "xla", "xla_fsdp_grad_ckpt", "xla_fsdp_v2",
              "cpu_offload_pin_memory"):
        fc.known(key(k))
    fc.finish()


def _fsdp_version(fc: "Block | None", default: int, why: str, top: tuple | None = None) -> tuple:
    """(FSDP version, its source): the block's version / fsdp_version field, else `top` (a field beside
    the block), else the tool's default."""
    if fc is not None:
        for k in ("fsdp_version", "version"):
            if fc.data.get(k) is not None:
                fc.known(k)
                return fc.data[k], fc.name(k)
    if top is not None and top[0] is not None:
        return top
    return default, f"assumed: {why}"

# ----------------------------------------------------------------------------- accelerate

_ACCEL_PASS = ("compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "machine_rank",
               "main_process_ip", "main_process_port", "main_training_function", "rdzv_backend", "same_network",
               "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "gpu_ids", "dynamo_config", "use_cpu", "tpu_name",
               "tpu_zone", "commands", "command_file", "ipex_config", "mpirun_config", "tpu_vm")


def read_accelerate(data, d: Draft, base: str):
    """accelerate's config YAML (`accelerate config`; examples/config_yaml_templates)."""
    b = Block(data, "", "accelerate")
    kind = b.get("distributed_type", "NO")
    if kind not in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP"):
        fail(f"distributed_type = {checks.show(kind)} is not modelled (NO, MULTI_GPU, DEEPSPEED, FSDP)")
    procs = as_int("num_processes", b.get("num_processes", 1))
    machines = as_int("num_machines", b.get("num_machines", 1))
    d.put("gpus", procs * machines if kind != "NO" else 1,
          "num_processes" + (" x num_machines" if b.given("num_machines") and machines > 1 else "")
          if kind != "NO" else "distributed_type NO")
    mp = b.get("mixed_precision", "no")
    if mp not in ("no", "bf16", "fp16"):
        fail(f"mixed_precision = {checks.show(mp)} is not modelled (no, bf16, fp16; fp8 is not)")
    d.values["_half"] = (None if mp == "no" else mp, "mixed_precision" if b.given("mixed_precision")
                         else "assumed: mixed_precision default no")
    b.only("use_cpu", (False,), "training on the CPU")
    for k, why in (("fp8_config", "fp8 training"), ("megatron_lm_config", "Megatron-LM's parallelism (vramlab plan)")):
        if b.get(k) not in (None, {}):
            fail(f"{k} is not modelled: {why}")
    pc = b.block("parallelism_config")
    if pc is not None:  # accelerate's ParallelismConfig: only its data-parallel sharding is modelled here
        for k in ("tp_size", "cp_size", "sp_size", "dp_replicate_size"):
            pc.only(f"parallelism_config_{k}", (1,), "only FSDP's sharding over the ranks is modelled here "
                    "(tensor and pipeline layouts: vramlab plan; context parallelism: vramlab context)")
        pc.known("parallelism_config_dp_shard_size")
        pc.finish()
    b.known(*_ACCEL_PASS)
    dsb = b.block("deepspeed_config")
    if kind == "DEEPSPEED":
        if dsb is None:
            fail("distributed_type DEEPSPEED without deepspeed_config")
        src = d.values["_half"][1]
        ctx = {"_who": "accelerate", "bf16": (mp == "bf16", src), "fp16": (mp == "fp16", src)}
        f = dsb.get("deepspeed_config_file")
        dsb.known("zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher",
                  "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")
        if f:
            dsb.finish()
            read_deepspeed(deepspeed_file(f, base, "deepspeed_config.deepspeed_config_file"), d, base,
                           path="deepspeed_config_file", ctx=ctx)
        else:  # accelerate's inline keys, which it turns into a DeepSpeed config (DeepSpeedPlugin)
            inline = {"zero_optimization": {"stage": dsb.get("zero_stage", 2)}}
            for k, dk in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
                if dsb.get(k) not in (None, "none"):
                    inline["zero_optimization"][dk] = {"device": dsb.get(k)}
                dsb.known(k.replace("device", "nvme_path"))
            if dsb.get("gradient_accumulation_steps") is not None:
                inline["gradient_accumulation_steps"] = dsb.get("gradient_accumulation_steps")
            dsb.known("gradient_clipping")
            if mp != "no":
                inline[mp] = {"enabled": True}
            dsb.finish()
            read_deepspeed(inline, d, base, path="deepspeed_config", ctx=ctx)
    elif dsb is not None:
        dsb.seen.update(dsb.data)
    fc = b.block("fsdp_config")
    if kind == "FSDP":
        _fsdp_config(fc, d, *_fsdp_version(fc, 1, "accelerate's default FSDP version 1"))
    elif fc is not None:
        fc.seen.update(fc.data)
    b.finish()
    return None

# ----------------------------------------------------------------------------- Axolotl

# Axolotl fields that do not change a training step's peak (data, logging, saving, the schedule...).
_AXOLOTL_PASS = frozenset("""
strict datasets test_datasets dataset_prepared_path val_set_size output_dir lora_model_dir lora_alpha
lora_dropout lora_fan_in_fan_out wandb_project wandb_entity wandb_watch wandb_name wandb_log_model
wandb_run_id mlflow_tracking_uri mlflow_experiment_name num_epochs max_steps lr_scheduler learning_rate
train_on_inputs group_by_length tf32 early_stopping_patience resume_from_checkpoint local_rank logging_steps
warmup_steps warmup_ratio evals_per_epoch eval_steps saves_per_epoch save_steps save_strategy eval_strategy
debug weight_decay special_tokens tokens eval_sample_packing loss_watchdog_threshold loss_watchdog_patience
hub_model_id chat_template tokenizer_type model_type tokenizer_config trust_remote_code seed max_grad_norm
dataset_processes shuffle_merged_datasets save_total_limit save_first_step auto_resume_from_checkpoints
xformers_attention flash_attention sdp_attention attn_implementation flash_attn_cross_entropy
flash_attn_rms_norm flash_attn_fuse_qkv flash_attn_fuse_mlp pad_to_sequence_len sample_packing
multipack_real_batches eval_batch_size eval_max_new_tokens eval_table_size do_bench_eval bench_dataset
gradient_checkpointing_kwargs lr_scheduler_kwargs cosine_min_lr_ratio optim_args adam_beta1 adam_beta2
adam_epsilon base_model_config tokenizer_use_fast tokenizer_legacy is_llama_derived_model
is_mistral_derived_model lora_modules_to_save peft_use_dora peft_use_rslora lora_on_cpu save_safetensors
""".split())
AXOLOTL_OPTIMS = dict(TRAINER_OPTIMS)


def read_axolotl(data, d: Draft, base: str):
    """An Axolotl YAML (docs: https://docs.axolotl.ai/docs/config-reference.html; examples/)."""
    b = Block(data, "", "axolotl")
    model = b.get("base_model")
    if b.given("sequence_len"):
        d.put("seq_len", as_int("sequence_len", b.get("sequence_len")), "sequence_len"
              + (" (every micro-batch packed to it: sample_packing)" if b.get("sample_packing") else
                 " (pad_to_sequence_len)" if b.get("pad_to_sequence_len") else
                 " (the longest a micro-batch can be: assumed padded to it)"))
    d.put("micro_batch_size", as_int("micro_batch_size", b.get("micro_batch_size", 1)),
          "micro_batch_size" if b.given("micro_batch_size") else "assumed: micro_batch_size default 1")
    if b.given("gradient_accumulation_steps"):
        d.put("accumulation_steps", as_int("gradient_accumulation_steps", b.get("gradient_accumulation_steps")),
              "gradient_accumulation_steps")
    optim = b.get("optimizer", "adamw_torch_fused")
    if optim not in AXOLOTL_OPTIMS:
        fail(f"optimizer = {checks.show(optim)} is not modelled; modelled: {', '.join(AXOLOTL_OPTIMS)}")
    d.put("optimizer", AXOLOTL_OPTIMS[optim][0], "optimizer" if b.given("optimizer") else
          "assumed: optimizer default adamw_torch_fused")
    d.put("optimizer_impl", AXOLOTL_OPTIMS[optim][1], d.sources["optimizer"])
    if optim.startswith("paged_"):
        d.notes.append("optimizer paged_*: bitsandbytes pages the states to the host under pressure; counted on the GPU")
    bf16, fp16 = b.get("bf16"), b.get("fp16")
    if bf16 == "auto":
        half = ("bf16", "assumed: bf16 = auto and the GPU supports bf16 (Axolotl then trains in bf16)")
    elif bf16 is not None and as_bool("bf16", bf16):
        half = ("bf16", "bf16")
    elif fp16 is not None and as_bool("fp16", fp16):
        half = ("fp16", "fp16")
    else:
        half = (None, "bf16 and fp16 not set")
    # Axolotl loads the model in the half dtype it trains in (torch_dtype), so the model is 16-bit throughout
    d.values["_half"] = half
    d.values["_loaded_half"] = True
    if b.given("gradient_checkpointing"):
        gc = b.get("gradient_checkpointing")
        d.put("recompute", "full" if (gc == "unsloth" or as_bool("gradient_checkpointing", gc)) else "none",
              "gradient_checkpointing")
    attn = b.get("attn_implementation")
    fused = [k for k in ("flash_attention", "sdp_attention", "xformers_attention") if b.get(k)]
    if attn == "eager":
        d.put("attention", "eager", "attn_implementation")
    elif attn is not None or fused:
        d.put("attention", "sdpa", f"{'attn_implementation' if attn else fused[0]} (a fused kernel: no s x s "
              "scores kept)")
    adapter = b.get("adapter")
    in4, in8 = (as_bool(k, b.get(k, False)) for k in ("load_in_4bit", "load_in_8bit"))
    if adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or in4 else "lora-int8" if in8 else "lora"
        if adapter == "qlora" and not in4:
            fail("adapter = qlora needs load_in_4bit: true")
        d.put("method", method, "adapter" + (" + load_in_4bit" if in4 else " + load_in_8bit" if in8 else ""))
        d.put("lora_rank", as_int("lora_r", b.get("lora_r", 8)), "lora_r" if b.given("lora_r") else
              "assumed: lora_r default 8")
        targets = b.get("lora_target_modules")
        if b.get("lora_target_linear"):
            d.put("lora_targets", "all-linear", "lora_target_linear")
        elif targets:
            if isinstance(targets, str):
                targets = [targets]
            d.put("lora_targets", tuple(dict.fromkeys(targets)), "lora_target_modules")
        else:
            d.put("lora_targets", "default", "assumed: no lora_target_modules: peft's default targets")
        b.known("lora_target_linear")
    elif adapter is not None:
        fail(f"adapter = {checks.show(adapter)} is not modelled (lora, qlora)")
    elif in4 or in8:
        fail("load_in_4bit / load_in_8bit without an adapter is not modelled (a quantized base needs lora or qlora)")
    b.only("torch_compile", (False,), "torch.compile changes which activations are saved")
    b.only("liger_kernel", (False,), "Liger's kernels")
    b.only("unfrozen_parameters", (), "partly frozen full fine-tuning")
    b.only("tensor_parallel_size", (1,), "tensor parallelism (vramlab plan)")
    b.only("context_parallel_size", (1,), "context parallelism (vramlab context)")
    b.only("sequence_parallel_degree", (1,), "sequence parallelism (vramlab context)")
    b.known(*_AXOLOTL_PASS)
    ds = b.get("deepspeed")
    fsdp, fc = b.get("fsdp"), b.block("fsdp_config")
    if ds:
        if adapter:
            fail("adapter with deepspeed is not modelled: compression.peft_training prices LoRA on one GPU")
        ctx = {half[0]: (True, half[1])} if half[0] else {}
        ctx["_who"] = "axolotl"
        ctx["batch"] = (d.values["micro_batch_size"], d.sources["micro_batch_size"])
        if d.has("accumulation_steps"):
            ctx["accumulation"] = (d.values["accumulation_steps"], d.sources["accumulation_steps"])
        read_deepspeed(deepspeed_file(ds, base, "deepspeed"), d, base, path="deepspeed", ctx=ctx)
    if fsdp or fc is not None:
        if adapter:
            fail("adapter with fsdp is not modelled: compression.peft_training prices LoRA on one GPU")
        _fsdp_config(fc, d, *_fsdp_version(fc, 1, "Axolotl's default FSDP version 1",
                                           top=(b.get("fsdp_version"), "fsdp_version")))
    b.known("fsdp_version")
    b.finish()
    return (model, "base_model") if model else None
