"""vramlab.configs_pytorch: torchtune recipes and torchtitan TOMLs, from the tools' own example configs
(typed in by hand, their source beside them), each estimate against the library call written out by
hand. The fixtures and helpers are tests/test_configs.py's.
"""

import json

import pytest

from vramlab import compression as COMP
from vramlab import specs
from vramlab import zero as Z
from tests.test_configs import _llama, check_api_call, model, read, same  # noqa: F401 (fixtures)


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


# ----------------------------------------------------------------------------- the models the formats name

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
