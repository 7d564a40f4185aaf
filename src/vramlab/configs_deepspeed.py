"""A DeepSpeed JSON (https://www.deepspeed.ai/docs/config-json/) read into a `configs_fields.Draft`:
the micro-batch and accumulation, bf16 / fp16 and ZeRO's recipe, the optimizer, the ZeRO stage, its
offload and bucket sizes, with "auto" filled as transformers' HfTrainerDeepSpeedConfig fills it. Also
read inside a TrainingArguments JSON, an accelerate config and an Axolotl YAML (`vramlab.configs_hf`).
Pure: the standard library and vramlab's calculators.
"""

from __future__ import annotations

import os

from . import checks
from . import zero as Z
from .configs_fields import TRAINER_BATCH, Block, Draft, as_bool, as_int, fail, parse, read_text

_DS_PASS = ("gradient_clipping", "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
            "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "scheduler",
            "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "checkpoint",
            "memory_breakdown", "sparse_gradients", "elasticity", "autotuning", "aio", "timers")
_ZERO_PASS = ("allgather_partitions", "reduce_scatter", "contiguous_gradients", "round_robin_gradients",
              "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
              "gather_16bit_weights_on_model_save", "elastic_checkpoint", "ignore_unused_parameters",
              "load_from_fp32_weights", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
              "sub_group_size", "allgather_bucket_size", "overlap_comm", "stage3_module_granularity_threshold",
              "module_granularity_threshold", "log_trace_cache_warnings", "compute_grad_norm",
              "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
              "stage3_allgather_sequential", "allgather_sequential", "parameter_alignment",
              "pipeline_loading_checkpoint", "override_module_apply", "enable_sanity_checks",
              "cpu_offload_use_pin_memory", "save_muon_momentum_buffer_in_memory")
# DeepSpeed's config model (deepspeed/runtime/zero/config.py) takes a stage3 field by its alias or its name
_ZERO_ALIASES = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
                 "stage3_param_persistence_threshold": "param_persistence_threshold",
                 "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
                 "stage3_model_persistence_threshold": "model_persistence_threshold"}


def _auto(d: Draft, ctx: dict, key: str, setting: str, name: str, fallback, why: str):
    """A DeepSpeed "auto": the value the enclosing config gives (transformers' HfTrainerDeepSpeedConfig
    fills it from TrainingArguments; accelerate from its own config), else that default."""
    if key in ctx:
        v, src = ctx[key]
        d.put(setting, v, f"{name} = \"auto\" -> {src}")
    elif ctx.get("_who") == "accelerate" and key == "batch":
        pass  # accelerate fills it from the script's DataLoader: the micro-batch must be given (batch_size=)
    else:
        d.put(setting, fallback, f"assumed: {name} = \"auto\" and nothing fills it: {why}")


def _match(ctx: dict, key: str, value, name: str) -> None:
    """transformers' HfTrainerDeepSpeedConfig.fill_match: a DeepSpeed value that is not "auto" must equal the
    TrainingArguments one, or the Trainer refuses to start; so do we."""
    if ctx.get("_who") == "trainer" and key in ctx and ctx[key][0] != value:
        fail(f"{name} = {value!r} but TrainingArguments' {ctx[key][1]} = {ctx[key][0]!r}: the Trainer refuses the "
             "mismatch (set it to \"auto\")")


def read_deepspeed(data, d: Draft, base: str, *, path: str = "", ctx: dict | None = None):
    """DeepSpeed's config-json (https://www.deepspeed.ai/docs/config-json/); "auto" as transformers'
    integrations/deepspeed.py (HfTrainerDeepSpeedConfig) fills it."""
    ctx = ctx or {}
    b = Block(data, path, "deepspeed")
    n = b.name
    mb = b.get("train_micro_batch_size_per_gpu")
    if mb == "auto":
        _auto(d, ctx, "batch", "micro_batch_size", n("train_micro_batch_size_per_gpu"), TRAINER_BATCH,
              "TrainingArguments' per_device_train_batch_size default")
    elif mb is not None:
        d.put("micro_batch_size", as_int(n("train_micro_batch_size_per_gpu"), mb), n("train_micro_batch_size_per_gpu"))
        _match(ctx, "batch", d.values["micro_batch_size"], n("train_micro_batch_size_per_gpu"))
    gas = b.get("gradient_accumulation_steps")
    if gas == "auto":
        _auto(d, ctx, "accumulation", "accumulation_steps", n("gradient_accumulation_steps"), 1,
              "TrainingArguments' gradient_accumulation_steps default")
    elif gas is not None:
        d.put("accumulation_steps", as_int(n("gradient_accumulation_steps"), gas), n("gradient_accumulation_steps"))
        _match(ctx, "accumulation", d.values["accumulation_steps"], n("gradient_accumulation_steps"))
    tbs = b.get("train_batch_size")
    if tbs is not None and tbs != "auto":
        d.values["_train_batch_size"] = (as_int(n("train_batch_size"), tbs), n("train_batch_size"))
    half = {}
    for key in ("bf16", "fp16"):
        blk = b.block(key)
        if blk is None:
            continue
        on = blk.get("enabled", False)
        if key == "fp16":
            blk.known("auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                      "consecutive_hysteresis", "min_loss_scale")
            blk.only("fp16_master_weights_and_grads", (False,), "fp16 master weights (ZeRO-Offload's variant)")
        else:
            blk.known("immediate_grad_update", "check_grad_overflow")
        blk.finish()
        if on == "auto":
            if key in ctx:
                half[key] = (ctx[key][0], f"{blk.name('enabled')} = \"auto\" -> {ctx[key][1]}")
            else:
                half[key] = (False, f"assumed: {blk.name('enabled')} = \"auto\" and nothing fills it: "
                                    f"TrainingArguments' {key} default False")
        else:
            half[key] = (as_bool(blk.name("enabled"), on), blk.name("enabled"))
            _match(ctx, key, half[key][0], blk.name("enabled"))
    amp = b.block("amp")
    if amp is not None:
        amp.only("enabled", (False,), "NVIDIA Apex AMP")
        amp.known("opt_level")
        amp.finish()
    on = [k for k, (v, _) in half.items() if v]
    if len(on) == 2:
        fail(f"{n('bf16.enabled')} and {n('fp16.enabled')} are both true: DeepSpeed takes one")
    acc_dtype = None
    dt = b.block("data_types")
    if dt is not None:
        acc_dtype = dt.only("grad_accum_dtype", ("fp32", "bf16", "fp16"), "a gradient accumulation dtype")
        dt.finish()
    if on:
        src = half[on[0]][1]
        recipe = "mixed-adam"
        if on[0] == "bf16" and acc_dtype == "fp32":
            recipe, src = "bf16-fp32-grads", f"{src} + {n('data_types.grad_accum_dtype')}"
        d.put("recipe", recipe, f"{src} (16-bit model, fp32 master weights and Adam states: zero.RECIPES)")
        d.put("precision", f"{on[0]}-mixed", src)
    else:
        srcs = " and ".join(s for _, s in half.values()) or "assumed: neither bf16 nor fp16 enabled (DeepSpeed's default)"
        d.put("recipe", "fp32-adam", srcs)
        d.put("precision", "fp32", srcs)
    opt = b.block("optimizer")
    if opt is not None:
        kind = opt.get("type", "")
        if str(kind).lower() not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
            fail(f"{opt.name('type')} = {checks.show(kind)} is not modelled: ZeRO ranks are estimated with Adam(W)")
        d.put("optimizer", "adamw", opt.name("type"))
        params = opt.block("params")
        if params is not None:
            torch_adam = params.get("torch_adam", False)
            params.known("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad")
            params.finish()
            if torch_adam and torch_adam != "auto" and as_bool(params.name("torch_adam"), torch_adam):
                d.put("optimizer_impl", "foreach", f"{params.name('torch_adam')} (torch.optim.AdamW, foreach)")
        if d.sources.get("optimizer_impl", "").find("torch_adam") < 0:
            d.put("optimizer_impl", "fused", f"{opt.name('type')} (DeepSpeed's FusedAdam: one flat partition)")
        opt.finish()
    act = b.block("activation_checkpointing")
    if act is not None:
        fail(f"{n('activation_checkpointing')} is not modelled: it is DeepSpeed's checkpointing API for Megatron "
             "models (transformers checkpoints with gradient_checkpointing)")
    b.only("communication_data_type", (), "a communication dtype other than the model's")
    b.only("seq_parallel_communication_data_type", (), "sequence parallelism")
    b.known(*_DS_PASS)
    zo = b.block("zero_optimization")
    if zo is not None:
        _zero_optimization(zo, d)
    d.put("sharding", "deepspeed", (zo.name("stage") if zo is not None else "assumed: no zero_optimization (ZeRO-0)"))
    if zo is None:
        d.put("zero_stage", 0, "assumed: no zero_optimization block, DeepSpeed's stage 0")
    b.finish()


def _zero_optimization(zo: Block, d: Draft) -> None:
    """DeepSpeed's zero_optimization block: the stage, what is refused or passed, the offload devices,
    the bucket sizes (their "auto" deferred to the model's hidden_size) and what the estimate leaves out."""
    stage = zo.get("stage", 0)
    if stage not in Z.STAGES or checks.is_bool(stage):
        fail(f"{zo.name('stage')} must be 0, 1, 2 or 3, got {checks.show(stage)}")
    d.put("zero_stage", stage, zo.name("stage"))
    zo.only("cpu_offload", (False,), "the old spelling of offload_optimizer: write offload_optimizer.device")
    zo.only("zero_quantized_weights", (False,), "ZeRO++ quantized weights")
    zo.only("zero_quantized_gradients", (False,), "ZeRO++ quantized gradients")
    zo.only("zero_hpz_partition_size", (1,), "ZeRO++ hierarchical partitioning")
    zo.only("mics_shard_size", (-1,), "MiCS sharding")
    zo.only("zero_quantized_nontrainable_weights", (False,), "ZeRO++ quantized frozen weights")
    zo.only("legacy_stage1", (False,), "DeepSpeed's legacy stage-1 implementation")
    zo.only("cpu_offload_param", (False,), "the old spelling of offload_param: write offload_param.device")
    zo.only("zenflow", (), "ZenFlow's asynchronous offloaded updates")
    zo.only("leaf_module", (), "ZeRO-3 leaf modules (gathered whole)")
    for k in ("stage3_model_persistence_threshold", "model_persistence_threshold"):
        zo.only(k, (), "a cap on ZeRO-3's persistent parameters (zero.persistent_params has none)")
    zo.known(*_ZERO_PASS)
    for key, setting in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        ob = zo.block(key)
        if ob is None:
            continue
        dev = ob.get("device", "none")
        if dev not in ("none", "cpu", "nvme"):
            fail(f"{ob.name('device')} must be none, cpu or nvme, got {checks.show(dev)}")
        ob.known("pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "ratio",
                 "pipeline_read", "pipeline_write", "pipeline", "cpuadam_cores_perc")
        ob.only("super_offload", (False,), "SuperOffload")
        ob.finish()
        d.put(setting, dev, ob.name("device"))
    for key, setting, hf_auto in (
            ("reduce_bucket_size", "reduce_bucket", lambda s: s.hidden_size * s.hidden_size),
            ("stage3_prefetch_bucket_size", "prefetch_bucket", lambda s: int(0.9 * s.hidden_size * s.hidden_size)),
            ("stage3_param_persistence_threshold", "persistence_threshold", lambda s: 10 * s.hidden_size),
            ("stage3_max_live_parameters", "max_live_parameters", None),
            ("stage3_max_reuse_distance", "max_reuse_distance", None)):
        if key not in zo.data and _ZERO_ALIASES.get(key) in zo.data:
            key = _ZERO_ALIASES[key]  # written by its field name (populate_by_name)
        v = zo.get(key)
        zo.known(_ZERO_ALIASES.get(key, key))
        if v is None or (setting in ("prefetch_bucket", "persistence_threshold", "max_live_parameters",
                                     "max_reuse_distance") and stage != 3):
            continue
        if v == "auto" and hf_auto is not None:
            rule = {"reduce_bucket": "h*h", "prefetch_bucket": "0.9*h*h", "persistence_threshold": "10*h"}[setting]
            d.deferred[setting] = (hf_auto, f"{zo.name(key)} = \"auto\" -> transformers' fill from the model's "
                                            f"hidden_size ({rule})")
        else:
            d.put(setting, as_int(zo.name(key), v, lo=0 if "persistence" in key else 1), zo.name(key))
    if zo.get("overlap_comm") and stage in (1, 2):
        d.notes.append(f"{zo.name('overlap_comm')}: transformers' DeepSpeed guide says it takes up to 4.5 x the "
                       "bucket sizes for its double buffers; zero.rank_phases counts one reduce bucket")
    if zo.given("allgather_bucket_size") and stage in (1, 2):
        d.notes.append(f"{zo.name('allgather_bucket_size')}: the all-gather of updated parameters after the step "
                       "(chunked by it) is not a peak in zero.rank_phases")
    if zo.given("sub_group_size") and stage == 3:
        d.notes.append(f"{zo.name('sub_group_size')}: the optimizer steps the partition in sub-groups; "
                       "zero.rank_phases steps it whole")
    zo.finish()

def deepspeed_file(ref, base: str, where: str) -> dict:
    if isinstance(ref, dict):
        return ref
    if not isinstance(ref, str):
        fail(f"{where} must be a DeepSpeed config path or a dict, got {checks.show(ref)}")
    # the launcher resolves it from its working directory; a config kept beside its DeepSpeed JSON names it
    # from its own folder: the first that exists
    tried = [ref] if os.path.isabs(ref) else list(dict.fromkeys([os.path.abspath(ref), os.path.join(base, ref)]))
    path = next((p for p in tried if os.path.exists(p)), None)
    if path is None:
        fail(f"{where} = {ref!r}: no such file (looked for {' and '.join(tried)})")
    data = parse(read_text(path), path, None)
    if not isinstance(data, dict):
        fail(f"{path!r} must be a DeepSpeed config (a JSON object)")
    return data
