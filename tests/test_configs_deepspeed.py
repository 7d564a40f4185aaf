"""vramlab.configs_deepspeed: a DeepSpeed JSON read as DeepSpeed and transformers read it.

The examples are DeepSpeed templates from accelerate and transformers' guide, typed in by hand (their
source beside them); each estimate is checked against `zero.estimate_rank` / `rank_phases` /
`offload.model_offload` called by hand; unknown fields and unmodelled values are refused in one line.
The fixtures and helpers are tests/test_configs.py's.
"""

import json

import pytest

from vramlab import specs
from vramlab import zero as Z
from tests.test_configs import H, check_api_call, model, read, same  # noqa: F401 (fixtures)


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


# ----------------------------------------------------------------------------- against the tools' own code

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
