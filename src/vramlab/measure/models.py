"""Build real transformers models from a ModelSpec: offline, random init, on any device.

Memory does not depend on the weights' values, so nothing is ever downloaded. Imports torch.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..specs import ModelSpec

Attention = Literal["eager", "sdpa"]


def hf_config(spec: ModelSpec, *, attention: Attention = "sdpa"):
    """The transformers config object for `spec`, with the attention implementation set."""
    from transformers import AutoConfig

    from transformers import CONFIG_MAPPING

    d = spec.to_hf_config()
    model_type = d.pop("model_type")
    defaults = CONFIG_MAPPING[model_type]()  # the special tokens transformers would fill in
    # quiet, and right, for shrunk test models: special tokens outside a smaller vocabulary are no tokens
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = d.get(key, getattr(defaults, key, None))
        if isinstance(value, int) and value >= spec.vocab_size:
            d[key] = None
    cfg = AutoConfig.for_model(model_type, **d)
    cfg._attn_implementation = attention
    cfg.use_cache = False
    return cfg


def build_model(spec: ModelSpec, *, attention: Attention = "sdpa", dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None, train: bool = True) -> torch.nn.Module:
    """The model head the course uses for each family (causal LM; BERT masked LM; T5 seq2seq),
    randomly initialised from `spec`. device='meta' builds without allocating."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    cfg = hf_config(spec, attention=attention)
    auto = {"bert": AutoModelForMaskedLM, "t5": AutoModelForSeq2SeqLM}.get(spec.family, AutoModelForCausalLM)
    with torch.device(device or "cpu"):
        model = auto.from_config(cfg, dtype=dtype)
        if spec.family == "t5" and not spec.tie_word_embeddings:
            # transformers 5.x always ties T5's head; the published mT5 / T5 v1.1 models do not
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    if auto is AutoModelForCausalLM:  # name the loss (transformers warns "loss_type=None" at every first step)
        model.loss_type = "ForCausalLM"
    return model.train(train)


def make_batch(spec: ModelSpec, *, batch_size: int, seq_len: int, device: str | torch.device = "cpu",
               with_labels: bool = True) -> dict[str, torch.Tensor]:
    """Token ids (int64) for one step; labels equal the inputs (the model shifts them itself).
    T5 gets a decoder sequence of the same length."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch_size, seq_len), generator=g).to(device)
    batch = {"input_ids": ids}
    if with_labels:
        batch["labels"] = ids if spec.family != "t5" else ids.clone()
    return batch


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
