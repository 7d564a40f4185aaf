"""vramlab.configs: the estimate of a training configuration the user already has.

Every format is read from a real, documented example typed in by hand (its source beside it); each
estimate is checked against the equivalent call of the library written out here by hand (same bytes,
category by category), each setting's source against the field it came from, unknown fields and
unmodelled values against a one-line refusal naming the field. Models are small config.json files in
tmp_path (a fake Hugging Face cache for the model-id path); nothing touches the network.
"""

import copy
import json

import pytest

import vramlab
from vramlab import compression as COMP
from vramlab import configs, memory, specs
from vramlab import zero as Z
from vramlab.present import from_config

H = 256  # the test model's hidden size
read = from_config.read_setup  # configs.read_setup with PyYAML's safe_load for the YAML formats


def _llama(dtype="bfloat16", **over) -> dict:
    cfg = {"model_type": "llama", "hidden_size": H, "intermediate_size": 688, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 16384,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    if dtype:
        cfg["torch_dtype"] = dtype
    cfg.update(over)
    return cfg


@pytest.fixture
def model(tmp_path):
    """A small llama config.json saved in bf16 (as Llama 3's checkpoints are)."""
    folder = tmp_path / "small-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama()))
    return str(folder / "config.json")


@pytest.fixture
def model32(tmp_path):
    folder = tmp_path / "small-llama-fp32"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama("float32")))
    return str(folder / "config.json")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding NousResearch/Llama-3.2-1B's config (a small one): the layout
    huggingface_hub writes (models--ORG--NAME/refs/main, snapshots/<commit>/config.json)."""
    cache = tmp_path / "hub"
    repo = cache / "models--NousResearch--Llama-3.2-1B"
    snap = repo / "snapshots" / "4e20de362430cd3b72f300e6b0f18e50e7166e08"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(_llama()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4e20de362430cd3b72f300e6b0f18e50e7166e08")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return str(snap / "config.json")


def same(a: memory.MemoryBreakdown, b: memory.MemoryBreakdown) -> None:
    assert a.to_dict() == b.to_dict() and a.phase == b.phase and a.total == b.total


def check_api_call(setup: configs.Setup) -> None:
    """The call `api_call()` writes, run as written, gives the same bytes."""
    got = eval(setup.api_call(), {"vramlab": vramlab})
    same(setup.estimate(), got)


# ----------------------------------------------------------------------------- DeepSpeed JSON

# https://github.com/huggingface/accelerate/blob/main/examples/deepspeed_config_templates/zero_stage2_config.json
ACCELERATE_ZERO2 = """
{
    "fp16": {
        "enabled": true,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "weight_decay": "auto",
            "torch_adam": true,
            "adam_w_mode": true
        }
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto"
        }
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": true
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""

# https://github.com/huggingface/accelerate/blob/main/examples/deepspeed_config_templates/zero_stage1_config.json
# (the same as zero_stage2_config.json but for "stage": 1)
ACCELERATE_ZERO1 = ACCELERATE_ZERO2.replace('"stage": 2', '"stage": 1')

# https://github.com/huggingface/accelerate/blob/main/examples/deepspeed_config_templates/zero_stage3_offload_config.json
ACCELERATE_ZERO3_OFFLOAD = """
{
    "fp16": {
        "enabled": true,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "weight_decay": "auto"
        }
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto"
        }
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": "auto"
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""

# https://github.com/shibing624/MedicalGPT/blob/main/deepspeed_zero_stage3_config.json (transformers' ZeRO-3
# template of its DeepSpeed guide, without the offload)
MEDICALGPT_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_deepspeed_zero2_equals_estimate_rank(tmp_path, model):
    path = tmp_path / "zero_stage2_config.json"
    path.write_text(ACCELERATE_ZERO2)
    s = read(str(path), model=model, seq_len=512, gpus=2)
    assert s.fmt == "deepspeed"
    spec = specs.from_config(model)
    direct = Z.estimate_rank(spec, 2, 2, micro_batch_size=8, seq_len=512, recipe="mixed-adam", implementation="deepspeed",
                             optimizer_impl="foreach", reduce_bucket=H * H)
    same(s.estimate(), direct)
    check_api_call(s)
    src = s.sources
    assert src["zero_stage"] == "zero_optimization.stage"
    assert src["recipe"].startswith("fp16.enabled")
    assert "torch_adam" in src["optimizer_impl"]
    # "auto" with nothing to fill it: said, with what was assumed
    assert src["micro_batch_size"].startswith("assumed:") and "auto" in src["micro_batch_size"]
    assert "auto" in src["reduce_bucket"] and "hidden_size" in src["reduce_bucket"] and s.reduce_bucket == H * H
    assert src["seq_len"] == "argument seq_len" and src["gpus"] == "argument gpus"
    assert any("overlap_comm" in n for n in s.notes)


def test_deepspeed_needs_what_the_file_leaves_out(tmp_path, model):
    path = tmp_path / "ds.json"
    path.write_text(ACCELERATE_ZERO2)
    with pytest.raises(ValueError, match="sequence length"):
        read(str(path), model=model)
    with pytest.raises(ValueError, match="does not name the model"):
        read(str(path), seq_len=512)


def test_deepspeed_train_batch_size_gives_the_ranks(model):
    ds = json.loads(ACCELERATE_ZERO2)
    ds.update(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    s = read(ds, model=model, seq_len=256)
    assert s.gpus == 4 and "train_batch_size" in s.sources["gpus"]
    same(s.estimate(), Z.estimate_rank(specs.from_config(model), 4, 2, micro_batch_size=4, seq_len=256,
                                       recipe="mixed-adam", implementation="deepspeed", optimizer_impl="foreach",
                                       reduce_bucket=H * H, accumulation_steps=2))
    ds["train_batch_size"] = 30
    with pytest.raises(ValueError, match="train_batch_size"):
        read(ds, model=model, seq_len=256)
    ds["train_batch_size"] = 32
    with pytest.raises(ValueError, match="DeepSpeed refuses"):  # 4 x 2 x 2 ranks is not 32
        read(ds, model=model, seq_len=256, gpus=2)


def test_deepspeed_bf16_and_fp32_accumulation(model):
    ds = json.loads(ACCELERATE_ZERO2)
    del ds["fp16"]
    ds["bf16"] = {"enabled": True}
    ds["data_types"] = {"grad_accum_dtype": "fp32"}
    ds["train_micro_batch_size_per_gpu"] = 2
    s = read(ds, model=model, seq_len=128, gpus=2)
    assert s.recipe == "bf16-fp32-grads" and "grad_accum_dtype" in s.sources["recipe"]
    same(s.estimate(), Z.estimate_rank(specs.from_config(model), 2, 2, micro_batch_size=2, seq_len=128,
                                       recipe="bf16-fp32-grads", implementation="deepspeed", optimizer_impl="foreach",
                                       reduce_bucket=H * H))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(my_new_option=True), "my_new_option"),
    (lambda d: d["zero_optimization"].update(stage3_magic=1), "zero_optimization.stage3_magic"),
    (lambda d: d["optimizer"].update(type="Lamb"), "optimizer.type"),
    (lambda d: d["zero_optimization"].update(zero_quantized_weights=True), "zero_optimization.zero_quantized_weights"),
    (lambda d: d.update(activation_checkpointing={"partition_activations": True}), "activation_checkpointing"),
    (lambda d: d["fp16"].update(mystery=2), "fp16.mystery"),
])
def test_deepspeed_refuses_what_it_does_not_know(model, edit, field):
    ds = json.loads(ACCELERATE_ZERO2)
    edit(ds)
    with pytest.raises(ValueError) as e:
        read(ds, model=model, seq_len=128)
    msg = str(e.value)
    assert field in msg and "\n" not in msg


def test_deepspeed_offload(model):
    # ZeRO-3 with parameters and optimizer on the CPU: offload.infinity prices it on one GPU, not per rank
    with pytest.raises(ValueError, match="offload_param"):
        read(ACCELERATE_ZERO3_OFFLOAD, model=model, seq_len=128, gpus=4)
    # ZeRO-2's optimizer offload on one bf16 GPU: offload.model_offload's ZeRO-Offload (measured so)
    ds = json.loads(ACCELERATE_ZERO2)
    del ds["fp16"], ds["optimizer"]["params"]["torch_adam"]
    ds["bf16"] = {"enabled": True}
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    s = read(ds, model=model, seq_len=128, batch_size=2)
    from vramlab import offload

    same(s.estimate(), offload.model_offload(specs.from_config(model), scheme="zero-offload", batch_size=2,
                                             seq_len=128, reduce_bucket=H * H).gpu_peak)
    check_api_call(s)
    assert s.sources["offload_optimizer"] == "zero_optimization.offload_optimizer.device"
    with pytest.raises(ValueError, match="one GPU"):
        read(ds, model=model, seq_len=128, gpus=2)


# ----------------------------------------------------------------------------- TrainingArguments JSON

# transformers 5.23: TrainingArguments(output_dir="your-model", learning_rate=2e-5, per_device_train_batch_size=16,
# per_device_eval_batch_size=16, num_train_epochs=2, weight_decay=0.01, eval_strategy="epoch",
# save_strategy="epoch", load_best_model_at_end=True, gradient_checkpointing=True).to_json_string():
# the Trainer guide's example (https://huggingface.co/docs/transformers/trainer) with gradient checkpointing
TRAINER_TO_DICT = """
{
  "output_dir": "your-model", "per_device_train_batch_size": 16, "num_train_epochs": 2, "max_steps": -1,
  "learning_rate": 2e-05, "lr_scheduler_type": "linear", "lr_scheduler_kwargs": null, "warmup_steps": 0,
  "optim": "adamw_torch_fused", "optim_args": null, "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999,
  "adam_epsilon": 1e-08, "optim_target_modules": null, "gradient_accumulation_steps": 1,
  "average_tokens_across_devices": true, "max_grad_norm": 1.0, "label_smoothing_factor": 0.0, "bf16": false,
  "fp16": false, "bf16_full_eval": false, "fp16_full_eval": false, "tf32": null, "activation_checkpointing": true,
  "activation_checkpointing_kwargs": null, "gradient_checkpointing": true, "gradient_checkpointing_kwargs": null,
  "torch_compile": false, "torch_compile_backend": null, "torch_compile_mode": null, "use_liger_kernel": false,
  "liger_kernel_config": null, "use_cache": false, "neftune_noise_alpha": null, "torch_empty_cache_steps": null,
  "auto_find_batch_size": false, "logging_strategy": "steps", "logging_steps": 500, "logging_first_step": false,
  "log_on_each_node": true, "logging_nan_inf_filter": true, "include_num_input_tokens_seen": "no",
  "log_level": "passive", "log_level_replica": "warning", "disable_tqdm": false, "report_to": [], "run_name": null,
  "project": "huggingface", "trackio_space_id": null, "trackio_bucket_id": null, "trackio_static_space_id": null,
  "eval_strategy": "epoch", "eval_steps": null, "eval_delay": 0, "per_device_eval_batch_size": 16,
  "prediction_loss_only": false, "eval_on_start": false, "eval_do_concat_batches": true,
  "eval_use_gather_object": false, "eval_accumulation_steps": null, "include_for_metrics": [],
  "batch_eval_metrics": false, "save_only_model": false, "save_strategy": "epoch", "save_steps": 500,
  "save_on_each_node": false, "save_total_limit": null, "enable_jit_checkpoint": false, "push_to_hub": false,
  "hub_token": "<HUB_TOKEN>", "hub_private_repo": null, "hub_model_id": null, "hub_strategy": "every_save",
  "hub_always_push": false, "hub_revision": null, "load_best_model_at_end": true, "metric_for_best_model": "loss",
  "greater_is_better": false, "ignore_data_skip": false, "restore_callback_states_from_checkpoint": false,
  "full_determinism": false, "seed": 42, "data_seed": null, "use_cpu": false,
  "accelerator_config": {"split_batches": false, "dispatch_batches": null, "even_batches": true,
                         "use_seedable_sampler": true, "non_blocking": false, "gradient_accumulation_kwargs": null},
  "parallelism_config": null, "dataloader_drop_last": false, "dataloader_num_workers": 0,
  "dataloader_pin_memory": true, "dataloader_persistent_workers": false, "dataloader_prefetch_factor": null,
  "dataloader_multiprocessing_context": null, "dataloader_in_order": true, "remove_unused_columns": true,
  "label_names": null, "train_sampling_strategy": "random", "length_column_name": "length",
  "ddp_find_unused_parameters": null, "ddp_bucket_cap_mb": null, "ddp_broadcast_buffers": null,
  "ddp_static_graph": null, "ddp_backend": null, "ddp_timeout": 1800, "fsdp": null, "fsdp_config": null,
  "deepspeed": null, "debug": [], "skip_memory_metrics": true, "do_train": false, "do_eval": true,
  "do_predict": false, "resume_from_checkpoint": null, "local_rank": -1
}
"""


def test_trainer_to_dict_bf16_checkpoint(tmp_path, model):
    path = tmp_path / "training_args.json"
    path.write_text(TRAINER_TO_DICT)
    s = read(str(path), model=model, seq_len=512)
    assert s.fmt == "trainer"
    # transformers 5 loads the bf16 checkpoint in bf16 (dtype="auto"): pure bf16, no autocast
    same(s.estimate(), memory.estimate_training(specs.from_config(model), batch_size=16, seq_len=512, precision="bf16",
                                                optimizer="adamw", optimizer_impl="fused", recompute="full"))
    check_api_call(s)
    src = s.sources
    assert src["micro_batch_size"] == "per_device_train_batch_size"
    assert src["recompute"] == "activation_checkpointing"
    assert src["optimizer"] == "optim" and src["optimizer_impl"] == "optim"
    assert "bfloat16" in src["precision"]
    assert src["gpus"].startswith("assumed:")


def test_trainer_amp_over_an_fp32_checkpoint_and_ddp(model32):
    args = json.loads(TRAINER_TO_DICT)
    args.update(bf16=True, optim="adamw_torch", gradient_accumulation_steps=4)
    s = read(args, model=model32, seq_len=256, gpus=8)
    assert s.precision == "bf16-mixed" and "float32" in s.sources["precision"]
    same(s.estimate(), memory.estimate_training(specs.from_config(model32), batch_size=16, seq_len=256,
                                                precision="bf16-mixed", optimizer="adamw", optimizer_impl="foreach",
                                                recompute="full", accumulation_steps=4))
    assert any(n.startswith("DDP") for n in s.notes)


def test_trainer_hand_written_subset_and_trl(model32):
    # the Trainer guide's arguments as people write them by hand; TRL's SFTConfig adds max_length
    args = {"output_dir": "your-model", "learning_rate": 2e-5, "per_device_train_batch_size": 16,
            "per_device_eval_batch_size": 16, "num_train_epochs": 2, "weight_decay": 0.01, "eval_strategy": "epoch",
            "save_strategy": "epoch", "load_best_model_at_end": True, "push_to_hub": True, "max_length": 1024}
    s = read(args, model=model32)
    assert s.seq_len == 1024 and "TRL" in s.sources["seq_len"] and s.precision == "fp32"
    assert s.sources["optimizer"].startswith("assumed:")
    same(s.estimate(), memory.estimate_training(specs.from_config(model32), batch_size=16, seq_len=1024,
                                                optimizer_impl="fused"))


def test_trainer_with_deepspeed_fills_auto(model32):
    args = {"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "fp16": True,
            "deepspeed": copy.deepcopy(MEDICALGPT_ZERO3)}
    s = read(args, model=model32, seq_len=256, gpus=4)
    src = s.sources
    assert src["micro_batch_size"] == 'deepspeed.train_micro_batch_size_per_gpu = "auto" -> per_device_train_batch_size'
    assert src["accumulation_steps"].endswith("-> gradient_accumulation_steps")
    assert "fp16" in src["recipe"] and s.recipe == "mixed-adam"
    assert "0.9*h*h" in src["prefetch_bucket"] and "10*h" in src["persistence_threshold"]
    direct = Z.estimate_rank(specs.from_config(model32), 4, 3, micro_batch_size=4, seq_len=256, recipe="mixed-adam",
                             implementation="deepspeed", optimizer_impl="fused", accumulation_steps=2,
                             reduce_bucket=H * H, prefetch_bucket=int(0.9 * H * H), persistence_threshold=10 * H,
                             max_live_parameters=10**9, max_reuse_distance=10**9)
    same(s.estimate(), direct)
    check_api_call(s)
    # a value that is not "auto" must match TrainingArguments', as the Trainer requires
    args["deepspeed"]["train_micro_batch_size_per_gpu"] = 2
    with pytest.raises(ValueError, match="mismatch"):
        read(args, model=model32, seq_len=256, gpus=4)
    # gradient checkpointing under DeepSpeed: not modelled (zero.rank_phases), refused rather than dropped
    args["deepspeed"]["train_micro_batch_size_per_gpu"] = "auto"
    args["gradient_checkpointing"] = True
    with pytest.raises(ValueError, match="gradient_checkpointing with DeepSpeed"):
        read(args, model=model32, seq_len=256, gpus=4)


def test_trainer_fsdp2(model32):
    args = {"output_dir": "out", "per_device_train_batch_size": 2, "bf16": True, "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                            "activation_checkpointing": True}}
    s = read(args, model=model32, seq_len=256, gpus=4)
    assert s.sharding == "fsdp2" and s.sources["sharding"] == "fsdp_config.version"
    got = max(Z.rank_phases(specs.from_config(model32), 4, 3, micro_batch_size=2, seq_len=256, recipe="mixed-adam",
                            implementation="fsdp2", optimizer_impl="fused", recompute="full"), key=lambda b: b.total)
    same(s.estimate(), got)
    check_api_call(s)
    args["fsdp_config"]["version"] = 1
    with pytest.raises(ValueError, match="FSDP1"):
        read(args, model=model32, seq_len=256, gpus=4)


@pytest.mark.parametrize("edit, field", [
    ({"my_custom_flag": 1}, "my_custom_flag"),
    ({"optim": "adafactor"}, "optim"),
    ({"torch_compile": True}, "torch_compile"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_trainer_refuses(model, edit, field):
    args = json.loads(TRAINER_TO_DICT)
    args.update(edit)
    with pytest.raises(ValueError) as e:
        read(args, model=model, seq_len=128)
    assert field in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- Axolotl YAML

# https://github.com/axolotl-ai-cloud/axolotl/blob/main/examples/llama-3/lora-1b.yml
AXOLOTL_LORA_1B = """
base_model: NousResearch/Llama-3.2-1B

load_in_8bit: false
load_in_4bit: false
strict: false

datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.1
output_dir: ./outputs/lora-out

adapter: lora
lora_model_dir:

sequence_len: 2048
sample_packing: true
eval_sample_packing: true
pad_to_sequence_len: true

lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_fan_in_fan_out:
lora_target_modules:
  - gate_proj
  - down_proj
  - up_proj
  - q_proj
  - v_proj
  - k_proj
  - o_proj

wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:

gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_8bit
lr_scheduler: cosine
learning_rate: 0.0002

train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false

gradient_checkpointing: true
early_stopping_patience:
resume_from_checkpoint:
local_rank:
logging_steps: 1
xformers_attention:
flash_attention: true

loss_watchdog_threshold: 5.0
loss_watchdog_patience: 3

warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
debug:
deepspeed:
weight_decay: 0.0
fsdp:
fsdp_config:
special_tokens:
  pad_token: "<|end_of_text|>"
"""

# https://github.com/axolotl-ai-cloud/axolotl/blob/main/examples/llama-3/qlora-1b.yml
AXOLOTL_QLORA_1B = """
base_model: NousResearch/Llama-3.2-1B
# Automatically upload checkpoint and final model to HF
# hub_model_id: username/custom_model_name

load_in_8bit: false
load_in_4bit: true

datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.1
output_dir: ./outputs/qlora-out

adapter: qlora
lora_model_dir:

sequence_len: 2048
sample_packing: true
eval_sample_packing: true


lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules:
  - gate_proj
  - down_proj
  - up_proj
  - q_proj
  - v_proj
  - k_proj
  - o_proj

wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:

gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002

bf16: auto
tf32: false

gradient_checkpointing: true
resume_from_checkpoint:
logging_steps: 1
attn_implementation: flash_attention_2

loss_watchdog_threshold: 5.0
loss_watchdog_patience: 3

warmup_ratio: 0.1
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
  pad_token: "<|end_of_text|>"
"""

# https://github.com/axolotl-ai-cloud/axolotl/blob/main/examples/llama-3/fft-1b-fsdp.yml
AXOLOTL_FFT_FSDP1 = """
base_model: meta-llama/Llama-3.2-1B

save_safetensors: true

datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca

dataset_prepared_path: ./last_run_prepared

output_dir: ./outputs/fft-out
sequence_len: 2048

gradient_accumulation_steps: 1
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_torch
learning_rate: 2e-5

bf16: auto
fp16:
tf32: false

logging_steps: 10
xformers_attention:
flash_attention: true

warmup_steps: 10
evals_per_epoch: 2
save_steps: 2
max_steps: 5
weight_decay: 0.0

fsdp:
  - full_shard
  - auto_wrap
fsdp_config:
  fsdp_limit_all_gathers: true
  fsdp_sync_module_states: true
  fsdp_offload_params: false
  fsdp_use_orig_params: true
  fsdp_cpu_ram_efficient_loading: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_backward_prefetch: BACKWARD_PRE
"""

LORA_TARGETS = ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj")


def test_axolotl_lora_from_the_hf_cache(tmp_path, hf_cache):
    path = tmp_path / "lora-1b.yml"
    path.write_text(AXOLOTL_LORA_1B)
    s = read(str(path))
    assert s.fmt == "axolotl" and s.model.spec.name == "NousResearch/Llama-3.2-1B"
    assert s.sources["model"].startswith("base_model") and hf_cache in s.sources["model"]
    direct = COMP.peft_training(specs.from_config(hf_cache), method="lora", rank=16, targets=LORA_TARGETS,
                                batch_size=2, seq_len=2048, precision="bf16", optimizer="adamw-8bit",
                                optimizer_impl="foreach", attention="sdpa", recompute="full")
    same(s.estimate(), direct)
    check_api_call(s)
    src = s.sources
    assert src["lora_rank"] == "lora_r" and src["lora_targets"] == "lora_target_modules"
    assert src["micro_batch_size"] == "micro_batch_size" and src["seq_len"].startswith("sequence_len")
    assert src["recompute"] == "gradient_checkpointing" and src["optimizer"] == "optimizer"
    assert src["precision"].startswith("assumed: bf16 = auto")
    assert src["attention"].startswith("flash_attention")
    assert any("gradient_accumulation_steps" in n for n in s.notes)


def test_axolotl_qlora(hf_cache):
    s = read(AXOLOTL_QLORA_1B)
    assert s.method == "qlora" and s.sources["method"] == "adapter + load_in_4bit"
    same(s.estimate(), COMP.peft_training(specs.from_config(hf_cache), method="qlora", rank=32, targets=LORA_TARGETS,
                                          batch_size=2, seq_len=2048, precision="bf16", optimizer="adamw-8bit",
                                          recompute="full"))
    # --model wins over base_model, and says so
    s2 = read(AXOLOTL_QLORA_1B, model=hf_cache)
    assert s2.sources["model"].startswith("argument model")


def test_axolotl_model_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError) as e:
        read(AXOLOTL_LORA_1B)
    assert "NousResearch/Llama-3.2-1B" in str(e.value) and "cache" in str(e.value) and "\n" not in str(e.value)


def test_hf_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert configs.hf_cache_dir() == str(tmp_path / "hf" / "hub")
    snap = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(_llama()))  # no refs/main: the newest snapshot
    assert configs.cached_config("org/name") == str(snap / "config.json")


@pytest.mark.parametrize("yaml_text, field", [
    (AXOLOTL_FFT_FSDP1, "FSDP1"),
    (AXOLOTL_LORA_1B + "some_new_option: 3\n", "some_new_option"),
    (AXOLOTL_LORA_1B.replace("optimizer: adamw_8bit", "optimizer: lion_8bit"), "optimizer"),
    (AXOLOTL_LORA_1B.replace("adapter: lora", "adapter: ia3"), "adapter"),
    (AXOLOTL_LORA_1B + "tensor_parallel_size: 2\n", "tensor_parallel_size"),
])
def test_axolotl_refuses(hf_cache, yaml_text, field):
    with pytest.raises(ValueError) as e:
        read(yaml_text, gpus=2)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_axolotl_fsdp2_full_finetune(hf_cache):
    text = AXOLOTL_FFT_FSDP1 + "fsdp_version: 2\n"
    s = read(text.replace("base_model: meta-llama/Llama-3.2-1B", "base_model: NousResearch/Llama-3.2-1B"),
                           gpus=2)
    assert s.sharding == "fsdp2" and s.sources["sharding"] == "fsdp_version" and s.recipe == "mixed-adam"
    same(s.estimate(), Z.estimate_rank(specs.from_config(hf_cache), 2, 3, micro_batch_size=1, seq_len=2048,
                                       recipe="mixed-adam", implementation="fsdp2", optimizer_impl="foreach"))


# ----------------------------------------------------------------------------- torchtune

# recipes/configs/llama3_1/8B_lora_single_device.yaml, as the stored copy of pytorch/torchtune has it (the
# dataset's long system prompt shortened: it does not change memory)
TORCHTUNE_LORA = """
# Model Arguments
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: ['q_proj', 'v_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: False
  apply_lora_to_output: False
  lora_rank: 16
  lora_alpha: 32
  lora_dropout: 0.0

# Tokenizer
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Meta-Llama-3.1-8B-Instruct/original/tokenizer.model
  max_seq_len: null

checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: CHECKPOINT_DIR
  checkpoint_files: [
    model-00001-of-00004.safetensors,
    model-00002-of-00004.safetensors,
    model-00003-of-00004.safetensors,
    model-00004-of-00004.safetensors
  ]
  recipe_checkpoint: null
  output_dir: /tmp/Meta-Llama-3.1-8B-Instruct/checkpoints/
  model_type: LLAMA3
resume_from_checkpoint: False
save_adapter_weights_only: False

# Dataset and Sampler
dataset:
  _component_: torchtune.datasets.instruct_dataset
  source: json
  data_files: data/compliance_dataset.json
  split: train
  new_system_prompt: "You are a guardian model evaluating the compliance of a chatbot agent."
valid_data_files: data/validation_dataset.json
seed: null
shuffle: True
batch_size: 2

# Optimizer and Scheduler
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 1e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100

loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss

# Training
epochs: 5
max_steps_per_epoch: null
gradient_accumulation_steps: 16
compile: False # set it to True for better memory and performance

# Logging
output_dir: /tmp/lora_finetune_output
metric_logger:
  _component_: torchtune.training.metric_logging.WandBLogger
  project: torchtune
  name: initial cot
log_every_n_steps: 1
log_peak_memory_stats: False

# Environment
device: cuda
dtype: bf16

# Activations Memory
enable_activation_checkpointing: True
enable_activation_offloading: False

# Profiler (disabled)
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
  output_dir: ${output_dir}/profiling_outputs
  cpu: True
  cuda: True
"""

# recipes/configs/llama3_1/8B_full.yaml (full_finetune_distributed), pytorch/torchtune
TORCHTUNE_FULL_DISTRIBUTED = """
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Meta-Llama-3.1-8B-Instruct/original/tokenizer.model
dataset:
  _component_: torchtune.datasets.alpaca_dataset
seed: null
shuffle: True
model:
  _component_: torchtune.models.llama3_1.llama3_1_8b
checkpointer:
  _component_: torchtune.utils.FullModelHFCheckpointer
  checkpoint_dir: /tmp/Meta-Llama-3.1-8B-Instruct/
  checkpoint_files: [
    model-00001-of-00004.safetensors,
    model-00002-of-00004.safetensors,
    model-00003-of-00004.safetensors,
    model-00004-of-00004.safetensors
  ]
  recipe_checkpoint: null
  output_dir: /tmp/Meta-Llama-3.1-8B-Instruct/
  model_type: LLAMA3
resume_from_checkpoint: False
batch_size: 2
epochs: 3
optimizer:
  _component_: torch.optim.AdamW
  lr: 2e-5
  foreach: False
loss:
  _component_: torch.nn.CrossEntropyLoss
max_steps_per_epoch: null
gradient_accumulation_steps: 1
device: cuda
enable_activation_checkpointing: True
memory_efficient_fsdp_wrap: True
dtype: bf16
metric_logger:
  _component_: torchtune.utils.metric_logging.DiskLogger
  log_dir: ${output_dir}
output_dir: /tmp/full-llama3.1-finetune
log_every_n_steps: 1
log_peak_memory_stats: False
"""


def test_torchtune_lora_single_device(tmp_path, model):
    text = TORCHTUNE_LORA.replace("CHECKPOINT_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="sequence length"):  # tokenizer.max_seq_len: null
        read(text, model=model)
    s = read(text, model=model, seq_len=1024)
    assert s.fmt == "torchtune"
    direct = COMP.peft_training(specs.from_config(model), method="lora", rank=16, targets=("q_proj", "v_proj", "o_proj"),
                                batch_size=2, seq_len=1024, precision="bf16", optimizer="adamw",
                                optimizer_impl="fused", recompute="full", adapter_dtype="base")
    same(s.estimate(), direct)
    check_api_call(s)
    src = s.sources
    assert src["method"] == "model._component_" and src["lora_rank"] == "model.lora_rank"
    assert src["precision"].startswith("dtype") and src["recompute"] == "enable_activation_checkpointing"
    assert src["optimizer_impl"] == "optimizer.fused" and src["micro_batch_size"] == "batch_size"
    # the chunked loss: peft_training prices the whole one, and the setup says so
    assert any("CEWithChunkedOutputLoss" in n or "loss._component_" in n for n in s.notes)


def test_torchtune_model_from_the_checkpointer(tmp_path):
    ckpt = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_llama()))
    s = read(TORCHTUNE_LORA.replace("CHECKPOINT_DIR", str(ckpt)), seq_len=512)
    assert s.sources["model"].startswith("checkpointer.checkpoint_dir")


def test_torchtune_distributed_pure_bf16_is_refused(model):
    # full_finetune_distributed shards bf16 parameters with no fp32 copy: not one of zero.RECIPES
    with pytest.raises(ValueError, match="not a modelled recipe"):
        read(TORCHTUNE_FULL_DISTRIBUTED, model=model, seq_len=512, gpus=4)
    with pytest.raises(ValueError, match="enable_activation_offloading"):
        read(TORCHTUNE_LORA.replace("enable_activation_offloading: False",
                                                  "enable_activation_offloading: True"), model=model, seq_len=512)


# ----------------------------------------------------------------------------- accelerate config

# https://github.com/huggingface/accelerate/blob/main/examples/config_yaml_templates/deepspeed.yaml
ACCELERATE_DEEPSPEED = """
# Similar to FSDP, we set the distributed type as DEEPSPEED
distributed_type: DEEPSPEED
# With DeepSpeed, we utilize a deepspeed config file for the entire configuration
deepspeed_config:
  # Can also be any of the config json's in accelerate/examples/deepspeed_config_templates
  deepspeed_config_file: ../deepspeed_config_templates/zero_stage1_config.json
  # If using ZeRO-3 and wanting to load big models in, this should be set to `true` so
  # `transformers` uses the right `init` function
  zero3_init_flag: false # true

# Finally we need to specify the number of accelerators to use
num_processes: 2
# Optionally we can set the mixed precision now instead of in the deepspeed config file,
# however this requires the `fp16` and `bf16` options to be set to `auto` in the deepspeed config file
# mixed_precision: "bf16"
"""

# https://github.com/huggingface/accelerate/blob/main/examples/config_yaml_templates/multi_gpu.yaml
ACCELERATE_MULTI_GPU = """
# Specify distributed_type as `MULTI_GPU` for DDP
distributed_type: "MULTI_GPU"
# Can be one of "no", "fp16", or "bf16" (see `transformer_engine.yaml` for `fp8`)
mixed_precision: "bf16"
# Specify the number of GPUs to use
num_processes: 2
"""

# https://github.com/huggingface/accelerate/blob/main/examples/config_yaml_templates/fsdp.yaml
ACCELERATE_FSDP = """
# Since we are doing FSDP (even though it's multi-GPU), we need to specify the distributed type as FSDP
distributed_type: FSDP
# Can be one of "no", "fp16", or "bf16" (see `transformer_engine.yaml` for `fp8`, but it works for FSDP as well)
mixed_precision: 'bf16'
# Specify the number of GPUs to use
num_processes: 2
# Then we can specify the FSDP config
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
"""

# https://github.com/huggingface/accelerate/blob/main/examples/torch_native_parallelism/configs/nd.yaml (FSDP2)
ACCELERATE_ND = """
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_cp_size: 4
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_deepspeed_file(tmp_path, model):
    (tmp_path / "deepspeed_config_templates").mkdir()
    (tmp_path / "deepspeed_config_templates" / "zero_stage1_config.json").write_text(ACCELERATE_ZERO1)
    (tmp_path / "config_yaml_templates").mkdir()
    path = tmp_path / "config_yaml_templates" / "deepspeed.yaml"
    path.write_text(ACCELERATE_DEEPSPEED.replace("zero_stage1_config", "zero_stage9_config"))
    with pytest.raises(ValueError, match=r"zero_stage9_config.json.: no such file"):
        read(str(path), model=model, seq_len=256, batch_size=4)
    path.write_text(ACCELERATE_DEEPSPEED)
    with pytest.raises(ValueError, match="micro-batch"):  # "auto": accelerate takes it from the script's DataLoader
        read(str(path), model=model, seq_len=256)
    s = read(str(path), model=model, seq_len=256, batch_size=4)
    assert s.fmt == "accelerate" and s.gpus == 2 and s.sources["gpus"] == "num_processes"
    assert s.sources["zero_stage"] == "deepspeed_config_file.zero_optimization.stage"
    same(s.estimate(), Z.estimate_rank(specs.from_config(model), 2, 1, micro_batch_size=4, seq_len=256,
                                       recipe="mixed-adam", implementation="deepspeed", optimizer_impl="foreach",
                                       reduce_bucket=H * H))
    check_api_call(s)


def test_accelerate_multi_gpu_is_ddp(model32):
    s = read(ACCELERATE_MULTI_GPU, model=model32, seq_len=256, batch_size=4)
    assert s.sharding == "none" and s.gpus == 2 and s.precision == "bf16-mixed"
    same(s.estimate(), memory.estimate_training(specs.from_config(model32), batch_size=4, seq_len=256,
                                                precision="bf16-mixed"))
    assert any(n.startswith("DDP") for n in s.notes)


def test_accelerate_fsdp(model):
    with pytest.raises(ValueError, match="FSDP1"):  # no fsdp_version: accelerate's FSDP1
        read(ACCELERATE_FSDP, model=model, seq_len=256, batch_size=1)
    with pytest.raises(ValueError, match="parallelism_config_cp_size"):  # context parallelism: vramlab context
        read(ACCELERATE_ND, model=model, seq_len=256, batch_size=1)
    # the same file with its FSDP2 sharding over all 8 ranks and no context parallelism
    nd = ACCELERATE_ND.replace("parallelism_config_cp_size: 4", "parallelism_config_cp_size: 1").replace(
        "parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 8")
    s = read(nd, model=model, seq_len=256, batch_size=1)
    assert s.sharding == "fsdp2" and s.sources["sharding"] == "fsdp_config.fsdp_version" and s.gpus == 8
    assert s.recipe == "mixed-adam" and "upcasts" in s.sources["precision"]
    assert s.sources["recompute"] == "fsdp_config.fsdp_activation_checkpointing"
    same(s.estimate(), Z.estimate_rank(specs.from_config(model), 8, 3, micro_batch_size=1, seq_len=256,
                                       recipe="mixed-adam", implementation="fsdp2", optimizer_impl="fused"))


# ----------------------------------------------------------------------------- torchtitan (FSDP2)

# https://github.com/pytorch/torchtitan/blob/main/torchtitan/models/llama3/train_configs/llama3_8b.toml
TORCHTITAN_8B = """
# torchtitan Config.toml
# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"
# converters = "float8"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
compile = false
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500
model_weights_only = false
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = 'selective'  # ['none', 'selective', 'full']
selective_ac_option = 'op'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = "output"
"""


def test_torchtitan(tmp_path, model):
    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN_8B)
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):  # selective: not modelled under FSDP2
        read(str(path), model=model, gpus=8)
    path.write_text(TORCHTITAN_8B.replace("mode = 'selective'", "mode = 'full'"))
    with pytest.raises(ValueError, match="data_parallel_shard_degree"):  # -1: every rank torchrun starts
        read(str(path), model=model)
    s = read(str(path), model=model, gpus=8)
    assert s.fmt == "torchtitan" and s.seq_len == 8192 and s.sources["seq_len"] == "training.seq_len"
    assert s.sources["recompute"] == "activation_checkpoint.mode" and s.recipe == "mixed-adam"
    got = max(Z.rank_phases(specs.from_config(model), 8, 3, micro_batch_size=1, seq_len=8192, recipe="mixed-adam",
                            implementation="fsdp2", optimizer_impl="fused", recompute="full"), key=lambda b: b.total)
    same(s.estimate(), got)
    check_api_call(s)
    path.write_text(TORCHTITAN_8B.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2"))
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        read(str(path), model=model, gpus=8)


# ----------------------------------------------------------------------------- input errors, one line each

@pytest.mark.parametrize("source, fmt, match", [
    ("{not json", None, "not valid JSON"),
    ("[training]\nseq_len = = 1", None, "not valid TOML"),
    ("just: some\nyaml: here\n", None, "not a format vramlab reads"),
    ("/no/such/file.json", None, "no such file"),
    (ACCELERATE_ZERO2, "nonsense", "format"),
])
def test_bad_input_is_one_line(source, fmt, match, model):
    with pytest.raises(ValueError) as e:
        read(source, fmt=fmt, model=model, seq_len=128)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_model_references(model, tmp_path):
    assert configs.resolve_model(model).dtype == "bfloat16"
    assert configs.resolve_model(str(tmp_path / "small-llama")).spec == specs.from_config(model)
    assert configs.resolve_model("gpt2").expr == "vramlab.specs.preset('gpt2')"
    with pytest.raises(ValueError, match="neither"):
        configs.resolve_model("not a model")


def test_models_the_formats_name_as_presets(tmp_path):
    # torchtitan's llama3 8B flavor and torchtune's llama3_1_8b builder have the shapes of the llama-3.1-8b preset
    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN_8B.replace("mode = 'selective'", "mode = 'full'"))
    s = read(str(path), gpus=8)
    assert s.sources["model"].startswith("model.name + model.flavor")
    got = max(Z.rank_phases(specs.preset("llama-3.1-8b"), 8, 3, micro_batch_size=1, seq_len=8192, recipe="mixed-adam",
                            implementation="fsdp2", optimizer_impl="fused", recompute="full"), key=lambda b: b.total)
    same(s.estimate(), got)
    s = read(TORCHTUNE_LORA.replace("CHECKPOINT_DIR", str(tmp_path / "nowhere")), seq_len=2048)
    assert s.sources["model"].startswith("model._component_") and s.model.expr == "vramlab.specs.preset('llama-3.1-8b')"
    same(s.estimate(), COMP.peft_training(specs.preset("llama-3.1-8b"), method="lora", rank=16,
                                          targets=("q_proj", "v_proj", "o_proj"), batch_size=2, seq_len=2048,
                                          precision="bf16", optimizer="adamw", optimizer_impl="fused",
                                          recompute="full", adapter_dtype="base"))


def test_yaml_without_pyyaml_is_one_line(monkeypatch, model):
    import sys

    # the pure layer imports no YAML parser: the caller gives one
    with pytest.raises(ValueError, match="yaml_loader"):
        configs.read_setup(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1)
    import yaml

    s = configs.read_setup(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1, yaml_loader=yaml.safe_load)
    assert s.fmt == "accelerate"
    with pytest.raises(ValueError, match="not valid YAML"):
        read("a: [unclosed\nb: 1\n", model=model)
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(ValueError, match="PyYAML"):
        read(ACCELERATE_MULTI_GPU, model=model, seq_len=128, batch_size=1)
    s = configs.read_setup(ACCELERATE_ZERO2, model=model, seq_len=128)  # JSON and TOML need nothing
    assert s.fmt == "deepspeed"


# ----------------------------------------------------------------------------- against the tools' own code

def test_auto_is_filled_as_transformers_fills_it(model32):
    """transformers' own HfTrainerDeepSpeedConfig (integrations/deepspeed.py) fills the same "auto" values from
    TrainingArguments and the model's hidden_size, and refuses the same mismatch."""
    from types import SimpleNamespace

    hf_ds = pytest.importorskip("transformers.integrations.deepspeed")
    args = SimpleNamespace(world_size=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
                           learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                           save_on_each_node=False, fp16=True, fp16_full_eval=False, bf16=False, bf16_full_eval=False,
                           get_warmup_steps=lambda n: 0)
    hf_model = SimpleNamespace(config=SimpleNamespace(hidden_size=H))

    def filled(ds: dict) -> dict:
        hf = hf_ds.HfTrainerDeepSpeedConfig(copy.deepcopy(ds))
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, hf_model, 100)
        return hf.config

    c = filled(MEDICALGPT_ZERO3)
    trainer = {"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "fp16": True,
               "deepspeed": copy.deepcopy(MEDICALGPT_ZERO3)}
    s = read(trainer, model=model32, seq_len=256, gpus=4)
    zo = c["zero_optimization"]
    assert (s.micro_batch_size, s.accumulation_steps) == (c["train_micro_batch_size_per_gpu"],
                                                          c["gradient_accumulation_steps"])
    assert (s.reduce_bucket, s.prefetch_bucket, s.persistence_threshold) == (
        zo["reduce_bucket_size"], zo["stage3_prefetch_bucket_size"], zo["stage3_param_persistence_threshold"])
    assert c["fp16"]["enabled"] is True and s.recipe == "mixed-adam"
    # the config as DeepSpeed receives it (nothing "auto" left but the save flag) gives the same estimate,
    # its train_batch_size (micro x accumulation x world size) the same ranks
    s2 = read(c, model=model32, seq_len=256)
    assert s2.gpus == 4 and "train_batch_size" in s2.sources["gpus"]
    same(s2.estimate(), s.estimate())
    bad = copy.deepcopy(MEDICALGPT_ZERO3)
    bad["train_micro_batch_size_per_gpu"] = 2
    with pytest.raises(ValueError, match="mismatch"):
        filled(bad)
    trainer["deepspeed"] = bad
    with pytest.raises(ValueError, match="mismatch"):
        read(trainer, model=model32, seq_len=256, gpus=4)


def test_every_field_of_deepspeeds_zero_config_is_known(model):
    """DeepSpeed's own ZeRO config model (runtime/zero/config.py, offload_config.py): every field, by its JSON
    name and its alias, is read, passed as not changing the peak, or refused as not modelled -- never unknown."""
    zcfg = pytest.importorskip("deepspeed.runtime.zero.config")
    from deepspeed.runtime.zero import offload_config as ocfg

    def outcome(zo: dict) -> str:
        ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zo}}
        try:
            read(ds, model=model, seq_len=64)
        except ValueError as e:
            return str(e)
        return "ok"

    names = {n for n, f in zcfg.DeepSpeedZeroConfig.model_fields.items()} | {
        f.alias for f in zcfg.DeepSpeedZeroConfig.model_fields.values() if f.alias}
    for name in sorted(names - {"offload_param", "offload_optimizer"}):
        msg = outcome({name: None})
        assert not msg.startswith("unknown field"), msg
    for block, model_cls in (("offload_param", ocfg.DeepSpeedZeroOffloadParamConfig),
                             ("offload_optimizer", ocfg.DeepSpeedZeroOffloadOptimizerConfig)):
        for name in model_cls.model_fields:
            msg = outcome({block: {name: None}})
            assert not msg.startswith("unknown field"), msg


def test_every_field_accelerate_config_writes_is_known(model32):
    """accelerate's ClusterConfig (commands/config/config_args.py): what `accelerate config` writes."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    import dataclasses

    for f in dataclasses.fields(config_args.ClusterConfig):
        if f.name in ("distributed_type", "num_processes"):
            continue
        cfg = {"distributed_type": "MULTI_GPU", "num_processes": 2, f.name: None}
        s = read(cfg, model=model32, seq_len=64, batch_size=1)
        assert s.gpus == 2
