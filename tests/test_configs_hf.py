"""vramlab.configs_hf: a TrainingArguments JSON, an Axolotl YAML and an accelerate config, with the FSDP
block and the DeepSpeed config they may name.

Every example is a real, documented one typed in by hand (its source beside it); each estimate is checked
against the library call written out by hand, each setting's source against its field, and transformers'
and accelerate's own code where installed. The fixtures and helpers are tests/test_configs.py's.
"""

import copy
import json

import pytest

from vramlab import compression as COMP
from vramlab import memory, specs
from vramlab import zero as Z
from tests.test_configs import H, check_api_call, hf_cache, model, model32, read, same  # noqa: F401 (fixtures)
from tests.test_configs_deepspeed import ACCELERATE_ZERO1, MEDICALGPT_ZERO3


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
