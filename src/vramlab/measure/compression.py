"""Lab 8's experiments: train a small Llama-style model on text it generates, then compress it.

    python -m vramlab.measure.compression --out results.json        # CPU: minutes; a GPU adds its allocator's peaks

Nothing is downloaded: the "language" is an order-1 Markov chain over 128 tokens whose next-token
table the lab draws from a seed (its entropy is the best loss any model can reach). The lab
  1. trains the teacher (the model every other step compresses) until more steps gain next to
     nothing (warm-up and cosine decay; its loss beside the chain's own on the same tokens);
  2. quantizes its linear layers per tensor, per row and per group, in INT8 and INT4, as it is and
     with outlier channels (a function-preserving rescaling that gives some output rows the large
     scales trained LLMs have), and measures the loss change; then runs its matmuls in INT8 (weights
     only per row, vector-wise W8A8, LLM.int8()'s decomposition) as it is and with outlier
     *activation features* (a rescaling of the norms' gains and the next layers' input columns);
  3. fine-tunes it on a second chain with LoRA (peft) and fully, and measures one step's memory
     (one process per configuration) against `compression.peft_training`: full, LoRA, and with
     bitsandbytes (CUDA, or its CPU backend) full with 8-bit AdamW and QLoRA on an NF4 base;
  4. distils a student half as wide from it, against the same student trained on the data alone;
  5. prunes attention heads (structured: whole heads by the norm of their output weights) into
     the `compression.prune` spec, and measures loss and parameters, beside two controls: the
     teacher trained for the same recovery steps, and the pruned shape trained from scratch.

    python -m vramlab.measure.compression --moefication --out benchmarks/results/moefication/moefication_cpu.json

runs MoEfication alone (chapter 8; Zhang+22): the teacher and the same model with ReLU in the gate,
each FFN split into experts (`balanced_kmeans`), run expert by expert (`MoEFFN`) at k = 1..E with
three routers; the FLOPs and intermediates its forwards count beside `compression.moefication`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .. import checks
from .. import compression as C
from ..specs import ModelSpec, from_config

VOCAB, SEQ = 128, 64
TEACHER = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "vocab_size": VOCAB,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "hidden_act": "silu"}
STUDENT = {**TEACHER, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4}
NEXT_PROBS = (0.5, 0.2, 0.1, 0.08, 0.05, 0.04, 0.02, 0.01)  # the chain's 8 possible successors of a token


def teacher_spec() -> ModelSpec:
    return from_config(TEACHER, name="lab8-teacher")


def student_spec() -> ModelSpec:
    return from_config(STUDENT, name="lab8-student")


class Chain:
    """An order-1 Markov chain: each token has 8 successors with probabilities NEXT_PROBS."""

    def __init__(self, seed: int, *, reorder: int | None = None, sample_seed: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.next = torch.stack([torch.randperm(VOCAB, generator=g)[:len(NEXT_PROBS)] for _ in range(VOCAB)])
        if reorder is not None:  # the same successors, ranked differently: a related task to adapt to
            r = torch.Generator().manual_seed(reorder)
            self.next = torch.stack([row[torch.randperm(len(row), generator=r)] for row in self.next])
        self.probs = torch.tensor(NEXT_PROBS)
        self.g = torch.Generator().manual_seed(seed + 1 if sample_seed is None else sample_seed)

    def oracle_loss(self, x: torch.Tensor) -> float:
        """Nats a token that the chain itself scores the transitions of `x` (batch x seq) with: the
        best loss any model can have on those very tokens (the entropy, up to sampling noise)."""
        table = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        table.scatter_add_(1, self.next, self.probs.to(torch.float64).expand(VOCAB, -1).contiguous())
        return -table[x[:, :-1], x[:, 1:]].log().mean().item()

    @property
    def entropy(self) -> float:
        """Nats a token: the loss of a model that knows the chain."""
        return -sum(p * math.log(p) for p in NEXT_PROBS)

    def sample(self, batch: int, seq: int = SEQ) -> torch.Tensor:
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=self.g)
        for t in range(1, seq):
            k = torch.multinomial(self.probs, batch, replacement=True, generator=self.g)
            x[:, t] = self.next[x[:, t - 1], k]
        return x


def build(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    from .models import build_model

    torch.manual_seed(seed)
    return build_model(spec)


COSINE_FLOOR = 0.02  # where `train(cosine=True)` ends: this fraction of its learning rate


def train(model: torch.nn.Module, chain: Chain, *, steps: int, batch: int = 16, lr: float = 3e-3,
          loss_fn: Callable | None = None, progress=None, label: str = "", cosine: bool = False) -> list[float]:
    """AdamW on fresh samples of the chain; `loss_fn(model, x)` replaces the LM loss (distillation).
    `cosine`: a linear warm-up over the first 10 % of the steps, then a cosine decay to COSINE_FLOOR of `lr`
    (what lets a model settle at the bottom in few steps); else a constant `lr`."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for i in range(steps):
        if cosine:
            f = min(1.0, (i + 1) / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * i / steps))
            for g in opt.param_groups:
                g["lr"] = lr * max(f, COSINE_FLOOR)
        x = chain.sample(batch)
        loss = loss_fn(model, x) if loss_fn else model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if progress and (i + 1) % max(1, steps // 4) == 0:
            progress(f"  {label} step {i + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor) -> float:
    model.eval()
    return model(input_ids=x, labels=x).loss.item()


TEACHER_BATCH, TEACHER_LR = 32, 5e-3
RECOVER_LR = COSINE_FLOOR * TEACHER_LR  # the rate the teacher's schedule ends at: further training of a settled model


def train_teacher(steps: int = 250, progress=None) -> tuple[torch.nn.Module, Chain]:
    """The lab's trained model (deterministic: the same weights on every CPU run): batches of 32,
    warm-up and cosine decay, so that 150 steps bring it within a few hundredths of a nat of the
    chain's own loss and more steps gain next to nothing (the controls of distillation and pruning
    need a teacher that has converged)."""
    chain = Chain(seed=1)
    model = build(teacher_spec())
    train(model, chain, steps=steps, batch=TEACHER_BATCH, lr=TEACHER_LR, cosine=True, progress=progress, label="teacher")
    return model, chain


# ----------------------------------------------------------------------------- quantization
def linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights `compression.linear_layers` lists (every linear but the LM head), by name."""
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}


def fake_quantize(w: torch.Tensor, scheme: str, bits: int, group_size: int = 128) -> torch.Tensor:
    """Absmax quantize and dequantize in torch (the same arithmetic as `compression.quantize`)."""
    qmax = 2 ** (bits - 1) - 1
    if scheme == "per-tensor":
        s = w.abs().max() / qmax
        return torch.round(w / s).clamp(-qmax, qmax) * s
    if scheme == "per-row":
        s = w.abs().amax(dim=1, keepdim=True) / qmax
        return torch.where(s > 0, torch.round(w / s.clamp_min(1e-30)).clamp(-qmax, qmax) * s, 0.0)
    rows, cols = w.shape
    pad = (-cols) % group_size
    g = torch.nn.functional.pad(w, (0, pad)).view(rows, -1, group_size)
    s = g.abs().amax(dim=2, keepdim=True) / qmax
    q = torch.where(s > 0, torch.round(g / s.clamp_min(1e-30)).clamp(-qmax, qmax) * s, 0.0)
    return q.view(rows, -1)[:, :cols]


def quantized(model: torch.nn.Module, scheme: str, bits: int) -> torch.nn.Module:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for w in linear_weights(m).values():
            w.copy_(fake_quantize(w, scheme, bits))
    return m


def with_outliers(model: torch.nn.Module, *, factor: float = 50.0, channels: int = 4, seed: int = 5) -> torch.nn.Module:
    """The same function with some output rows `factor` times larger: per layer, `channels` rows of
    v_proj and of up_proj are scaled up and the matching columns of o_proj and down_proj scaled down
    (exact: attention is linear in v, and the MLP's output is linear in up's). Trained LLMs have
    output channels this much larger than the rest (Dettmers+22; Xiao+23); a model this small,
    trained for a minute, does not."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.model.layers:
            for up, down in ((layer.self_attn.v_proj, layer.self_attn.o_proj), (layer.mlp.up_proj, layer.mlp.down_proj)):
                idx = torch.randperm(up.weight.shape[0], generator=g)[:channels]
                up.weight[idx] *= factor
                down.weight[:, idx] /= factor
    return m


def quantization_study(model: torch.nn.Module, val: torch.Tensor, progress=None) -> dict[str, Any]:
    base = evaluate(model, val)
    out: dict[str, Any] = {"fp32_loss": base, "models": {}}
    for kind, m in (("as trained", model), ("outlier channels", with_outliers(model))):
        ref = evaluate(m, val)
        ws = linear_weights(m)
        rows = []
        for bits in (8, 4):
            for scheme in C.SCHEMES:
                loss = evaluate(quantized(m, scheme, bits), val)
                nbytes = sum(C.quant_bytes(w.shape[0], w.shape[1], scheme=scheme, bits=bits) for w in ws.values())
                err = [((fake_quantize(w, scheme, bits) - w).pow(2).mean() / w.pow(2).mean()).sqrt().item() for w in ws.values()]
                rows.append({"bits": bits, "scheme": scheme, "loss": loss, "delta": loss - ref,
                             "bytes": nbytes, "median_relative_error": sorted(err)[len(err) // 2]})
                if progress:
                    progress(f"  {kind:16s} INT{bits} {scheme:10s} loss change {rows[-1]['delta']:+.5f}")
        out["models"][kind] = {"fp32_loss": ref, "rescaling_changed_loss_by": ref - base, "rows": rows}
    out["matrix"] = example_matrix(model)
    out["activations"] = activation_outlier_study(model, val, progress=progress)
    return out


def with_activation_outliers(model: torch.nn.Module, *, factor: float = 100.0, channels: int = 4,
                             seed: int = 7) -> torch.nn.Module:
    """The same function with outlier *features* in the activations the linear layers read, as
    LLM.int8() (Dettmers+22) found in every large model's hidden states: per layer, `channels`
    hidden dimensions of both RMSNorms' gains are multiplied by `factor` and the matching input
    columns of q/k/v_proj and gate/up_proj divided by it (exact: a norm's output reaches only those
    linears). The normalised activations then hold values ~`factor` times the rest in those
    columns, in every token; the weights are unchanged elsewhere. The factor is this lab's choice,
    large enough to show the effect on a model this small."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.model.layers:
            for norm, lins in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                               (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
                idx = torch.randperm(norm.weight.shape[0], generator=g)[:channels]
                norm.weight[idx] *= factor
                for lin in lins:
                    lin.weight[:, idx] /= factor
    return m


INT8_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold (bitsandbytes' default)


class Int8Matmul(torch.nn.Module):
    """A linear layer whose product runs as an INT8 scheme would (simulated exactly: integer codes,
    products summed in fp32, which holds them exactly here, then rescaled):
      "w8-row":    weight-only per-row INT8, activations as they are;
      "w8a8":      vector-wise INT8 of both (one absmax per token, one per output row);
      "llm.int8":  w8a8 on the input columns without any |x| > threshold, the rest in full precision."""

    def __init__(self, lin: torch.nn.Linear, scheme: str, threshold: float = INT8_THRESHOLD):
        super().__init__()
        self.weight, self.scheme, self.threshold = lin.weight, scheme, threshold
        self.outlier_columns: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.scheme == "w8-row":
            return x @ fake_quantize(w, "per-row", 8).T
        x2 = x.reshape(-1, x.shape[-1])
        out = (x2.abs() > self.threshold).any(dim=0) if self.scheme == "llm.int8" else torch.zeros(
            x2.shape[-1], dtype=torch.bool, device=x.device)
        self.outlier_columns.append(int(out.sum()))
        keep = ~out

        def rows(m):
            s = m.abs().amax(dim=1, keepdim=True) / 127
            return torch.where(s > 0, torch.round(m / s.clamp_min(1e-30)), 0.0), s

        qx, sx = rows(x2[:, keep])
        qw, sw = rows(w[:, keep])
        y = (qx @ qw.T) * sx * sw.T + x2[:, out] @ w[:, out].T
        return y.reshape(*x.shape[:-1], w.shape[0])


def int8_matmuls(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """A copy of `model` whose linear layers (all but the LM head) multiply as `scheme` does."""
    m = copy.deepcopy(model)
    for name, mod in list(m.named_modules()):
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name and mod.bias is None:
            parent, _, leaf = name.rpartition(".")
            setattr(m.get_submodule(parent), leaf, Int8Matmul(mod, scheme))
    return m


INT8_SCHEMES = ("w8-row", "w8a8", "llm.int8")


def activation_outlier_study(model: torch.nn.Module, val: torch.Tensor, progress=None) -> dict[str, Any]:
    """The loss of each INT8 matmul scheme, on the model as trained and with activation outlier
    features (`with_activation_outliers`), and the share of input columns LLM.int8() multiplied in
    full precision."""
    out: dict[str, Any] = {"threshold": INT8_THRESHOLD, "models": {}}
    for kind, m in (("as trained", model), ("activation outliers", with_activation_outliers(model))):
        ref = evaluate(m, val)
        rows = []
        for scheme in INT8_SCHEMES:
            q = int8_matmuls(m, scheme)
            loss = evaluate(q, val)
            sims = [mod for mod in q.modules() if isinstance(mod, Int8Matmul)]
            cols = sum(sum(mod.outlier_columns) for mod in sims)
            seen = sum(len(mod.outlier_columns) * mod.weight.shape[1] for mod in sims)
            rows.append({"scheme": scheme, "loss": loss, "delta": loss - ref,
                         "fp_column_share": cols / seen if scheme == "llm.int8" and seen else 0.0})
            if progress:
                progress(f"  {kind:19s} {scheme:9s} loss change {rows[-1]['delta']:+.5f}")
        out["models"][kind] = {"fp32_loss": ref, "rescaling_changed_loss_by": ref - evaluate(model, val), "rows": rows}
    return out


EXAMPLE_MATRIX = "model.layers.1.mlp.up_proj"


def example_matrix(model: torch.nn.Module, name: str = EXAMPLE_MATRIX) -> dict[str, Any]:
    """One weight matrix quantized by `compression.quant_error`, as trained and with outlier
    channels, per tensor and per row at 8 and 4 bits: what chapter 8 shows (it reads this from the
    stored run instead of training the model again)."""
    out: dict[str, Any] = {"name": name}
    for kind, m in (("as trained", model), ("outlier channels", with_outliers(model))):
        w = linear_weights(m)[name].detach()
        out["shape"] = list(w.shape)
        for scheme in ("per-tensor", "per-row"):
            for bits in (8, 4):
                e = C.quant_error(w.tolist(), scheme=scheme, bits=bits)
                out.setdefault(kind, []).append({"scheme": scheme, "bits": bits, "relative": e.relative,
                                                 "max_abs": e.max_abs, "bytes": e.nbytes})
    return out


# ----------------------------------------------------------------------------- LoRA
def _peft(model: torch.nn.Module, targets: str, rank: int = 8) -> torch.nn.Module:
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=rank, target_modules=None if targets == "default" else targets))


def lora_study(teacher: torch.nn.Module, *, steps: int, progress=None) -> dict[str, Any]:
    """Fine-tune on a related chain (the same successors, ranked differently): LoRA r=8 on every
    linear layer against full fine-tuning, the same steps."""
    task = Chain(seed=1, reorder=7, sample_seed=70)
    val = task.sample(64)
    out: dict[str, Any] = {"before": evaluate(teacher, val), "entropy": task.entropy}
    for how in ("lora", "full"):
        m = copy.deepcopy(teacher)
        if how == "lora":
            m = _peft(m, "all-linear")
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        t0 = time.perf_counter()
        train(m, task, steps=steps, lr=3e-3, progress=progress, label=f"{how} fine-tune")
        out[how] = {"loss": evaluate(m, val), "trainable": trainable, "seconds": time.perf_counter() - t0}
    out["lora"]["predicted_trainable"] = C.lora_params(teacher_spec(), rank=8, targets="all-linear")
    return out


def _qlora(model: torch.nn.Module, targets: str, rank: int = 8, *, autocast: bool = True) -> torch.nn.Module:
    """QLoRA (Dettmers+23) as `compression.peft_training(method="qlora")` counts it: the model in
    bf16, every linear layer but the LM head in bitsandbytes' NF4 with double quantization
    (`Linear4bit`, bf16 compute), then fp32 LoRA adapters (peft). Runs on CUDA and, with bitsandbytes'
    CPU backend, on the CPU."""
    import bitsandbytes as bnb
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = model.to(torch.bfloat16)
    for mod in list(model.modules()):
        for name, lin in list(mod.named_children()):
            if not isinstance(lin, torch.nn.Linear) or name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta",
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4")
            if lin.bias is not None:
                q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
            setattr(mod, name, q.to(lin.weight.device))  # quantized on the move
    model = _peft(model, targets, rank)
    # peft casts each adapter's input to the adapter's fp32 unless `torch.is_autocast_enabled()`,
    # which sees CUDA's autocast only: under the CPU's it would add a copy a CUDA step never makes
    for mod in model.modules():
        if isinstance(mod, BaseTunerLayer):
            mod.cast_input_dtype_enabled = not autocast
    return model


PROMPT_TOKENS = 16  # the prompt / prefix probes' virtual tokens


def _prompt_peft(model: torch.nn.Module, method: str, num_virtual_tokens: int = PROMPT_TOKENS) -> torch.nn.Module:
    """peft's prompt tuning (Lester+21) or prefix tuning (Li & Liang 21) around the model, as
    `compression.peft_training(method="prompt" | "prefix")` counts it."""
    import warnings

    import peft

    cls = {"prompt": peft.PromptTuningConfig, "prefix": peft.PrefixTuningConfig, "p-tuning": peft.PromptEncoderConfig}[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cls(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens))


def _quant_state_bytes(model: torch.nn.Module) -> int:
    """NF4 weights' quantization state (absmax codes, their fp32 second-level scales, the code
    tables): tensors held outside the module's parameters and buffers, which the CPU tracker
    cannot see (a GPU's allocator does)."""
    from .memory import storage_bytes

    tensors = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            tensors += [qs.absmax, qs.code, getattr(qs, "offset", None)]
            qs = getattr(qs, "state2", None)
    return storage_bytes(tensors)


def _probe(cfg: dict[str, Any]) -> dict[str, Any]:
    """One fine-tuning step's memory, in this process (run by `memory_probes`, one per process)."""
    from .memory import measure_training

    if cfg["mode"] == "cpu":
        torch.set_num_threads(1)  # two probes run at once, one core each
    spec, method = teacher_spec(), cfg["method"]
    autocast = cfg.get("autocast", True)  # QLoRA: a bf16 step under autocast, or pure bf16 without
    precision = ("bf16-mixed" if autocast else "bf16") if method == "qlora" else "fp32"
    held: list[torch.nn.Module] = []

    def hook(m: torch.nn.Module) -> torch.nn.Module:
        held.append(_qlora(m, cfg["targets"], autocast=autocast) if method == "qlora"
                    else m if method == "full" else _prompt_peft(m, method) if method in C.PROMPT_METHODS
                    else _peft(m, cfg["targets"]))
        return held[-1]

    m = measure_training(spec, batch_size=cfg["batch_size"], seq_len=cfg["seq_len"], mode=cfg["mode"], model_hook=hook,
                         optimizer=cfg.get("optimizer", "adamw"), precision=precision,
                         recompute=cfg.get("recompute", "none"))
    bd = m.breakdown
    if method == "qlora" and cfg["mode"] != "cuda":
        bd = dataclasses.replace(bd, parameters=bd.parameters + _quant_state_bytes(held[0]))
    return {"measured_bytes": m.peak_allocated if cfg["mode"] == "cuda" else bd.total, "measured": bd.to_dict()}


PROBE_PRELOAD = ("vramlab.measure.compression", "peft")


def _probe_answer(cfg: dict[str, Any]) -> dict[str, Any]:
    """`_probe` for a forked process: its answer, or {"error": one line}."""
    import warnings

    from .memory import error_line

    warnings.simplefilter("ignore")
    try:
        return _probe(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line
        return {"error": error_line(e)}


PROBES: tuple[dict[str, str], ...] = (
    {"method": "full", "targets": "-", "optimizer": "adamw"},
    {"method": "lora", "targets": "default", "optimizer": "adamw"},
    {"method": "lora", "targets": "all-linear", "optimizer": "adamw"},
    {"method": "full", "targets": "-", "optimizer": "adamw-8bit"},  # bitsandbytes
    {"method": "qlora", "targets": "all-linear", "optimizer": "adamw"},  # bitsandbytes
    {"method": "prompt", "targets": "-", "optimizer": "adamw"},  # 16 virtual tokens (PROMPT_TOKENS)
    {"method": "prefix", "targets": "-", "optimizer": "adamw"},
)


def memory_probes(mode: str, progress=None) -> list[dict[str, Any]]:
    """One fine-tuning step of each of `PROBES` (batch 8 x 128 tokens), each in its own process,
    against `compression.peft_training`. Without bitsandbytes its two rows say so instead. On the
    CPU two processes run at a time (the tracker counts each process's tensors, not the machine's
    memory); on a GPU one at a time."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    have_bnb = importlib.util.find_spec("bitsandbytes") is not None
    cfgs = [{**c, "batch_size": 8, "seq_len": 128, "mode": mode} for c in PROBES]

    def one(cfg: dict[str, Any]) -> dict[str, Any]:
        if not have_bnb and (cfg["method"] == "qlora" or cfg["optimizer"] == "adamw-8bit"):
            return {**cfg, "skipped": "bitsandbytes is not installed (pip install bitsandbytes)"}
        if mode == "cuda":  # a new interpreter: nothing of CUDA may be inherited
            r = subprocess.run([sys.executable, "-m", "vramlab.measure.compression", "--probe", json.dumps(cfg)],
                               capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            lines = r.stdout.strip().splitlines()
            got = json.loads(lines[-1]) if r.returncode == 0 and lines else {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
        else:  # forked from a server that imported torch, transformers and peft once (a new process all the same)
            from .memory import in_fork

            got, log = in_fork(_probe_answer, cfg, timeout=900, preload=PROBE_PRELOAD, what=f"probe {probe_label(cfg)}")
            got = got or {"error": (log.strip().splitlines() or ["no output"])[-1]}
        if "error" in got:
            raise RuntimeError(f"probe {probe_label(cfg)}: {got['error']}")
        est = C.peft_training(teacher_spec(), method=cfg["method"], optimizer=cfg["optimizer"],
                              targets=cfg["targets"] if cfg["method"] not in ("full", *C.PROMPT_METHODS) else "default",
                              num_virtual_tokens=PROMPT_TOKENS,
                              batch_size=8, seq_len=128, device="cuda" if mode == "cuda" else "cpu")
        return {**cfg, **got, "estimated_bytes": est.total, "estimated": est.to_dict(), "estimated_phase": est.phase,
                "error_pct": 100 * (est.total - got["measured_bytes"]) / got["measured_bytes"]}

    rows = []
    with ThreadPoolExecutor(max_workers=1 if mode == "cuda" else 2) as pool:
        for row in pool.map(one, cfgs):
            rows.append(row)
            if progress:
                report_probe(row, progress)
    return rows


def report_probe(row: dict[str, Any], progress: Callable[[str], Any]) -> None:
    if "skipped" in row:
        progress(f"  {probe_label(row):22s} skipped: {row['skipped']}")
    else:
        progress(f"  {probe_label(row):22s} measured {row['measured_bytes'] / 2**20:7.1f} MiB, "
                 f"predicted {row['estimated_bytes'] / 2**20:7.1f} MiB ({row['error_pct']:+.2f} %)")


def probe_label(row: dict[str, Any]) -> str:
    """'full', 'lora default', 'full adamw-8bit', 'qlora all-linear': a probe row's name."""
    parts = [row["method"], "" if row["targets"] == "-" else row["targets"],
             "" if row.get("optimizer", "adamw") == "adamw" else row["optimizer"]]
    return " ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- distillation
def distillation_study(teacher: torch.nn.Module, chain: Chain, val: torch.Tensor, *, steps: int,
                       temperature: float = 2.0, alpha: float = 0.5, progress=None) -> dict[str, Any]:
    """A student half as wide and half as deep: trained on the data alone, and distilled (Hinton+15:
    alpha x T^2 x KL(teacher || student at T) + (1 - alpha) x the data's loss)."""
    import torch.nn.functional as F

    teacher.eval()

    def kd(model, x):
        with torch.no_grad():
            t = teacher(input_ids=x).logits
        out = model(input_ids=x, labels=x)
        T = temperature
        soft = F.kl_div(F.log_softmax(out.logits / T, dim=-1), F.softmax(t / T, dim=-1), reduction="batchmean") * T * T
        return alpha * soft / x.shape[1] + (1 - alpha) * out.loss

    res: dict[str, Any] = {"teacher_loss": evaluate(teacher, val), "teacher_params": teacher_spec().params,
                           "student_params": student_spec().params, "entropy": chain.entropy,
                           "oracle_loss": chain.oracle_loss(val)}
    for how in ("scratch", "distilled"):
        m = build(student_spec(), seed=3)
        src = Chain(seed=1, sample_seed=30)  # the teacher's chain, fresh samples
        train(m, src, steps=steps, loss_fn=kd if how == "distilled" else None, progress=progress, label=f"student ({how})")
        res[how] = evaluate(m, val)
    res["predicted_step_bytes"] = C.distillation(teacher_spec(), student_spec(), batch_size=16, seq_len=SEQ, device="cpu").total
    return res


# ----------------------------------------------------------------------------- pruning
def prune_heads(model: torch.nn.Module, heads: int) -> tuple[torch.nn.Module, ModelSpec]:
    """Remove the `heads` heads of every layer whose output weights (o_proj's columns) have the
    smallest norm, into a model built from `compression.prune`'s spec."""
    spec = teacher_spec()
    small_spec = C.prune(spec, heads=heads)
    small = build(small_spec)
    d = spec.head_dim
    sd = model.state_dict()
    new = small.state_dict()
    for i, layer in enumerate(model.model.layers):
        o = layer.self_attn.o_proj.weight  # h x (a d)
        norms = o.view(o.shape[0], spec.num_heads, d).pow(2).sum(dim=(0, 2))
        keep = sorted(norms.argsort(descending=True)[:small_spec.num_heads].tolist())
        cols = torch.cat([torch.arange(k * d, (k + 1) * d) for k in keep])
        p = f"model.layers.{i}.self_attn."
        for n in ("q_proj", "k_proj", "v_proj"):
            sd[p + n + ".weight"] = sd[p + n + ".weight"][cols]
        sd[p + "o_proj.weight"] = sd[p + "o_proj.weight"][:, cols]
    assert set(sd) == set(new)
    small.load_state_dict(sd)
    return small, small_spec


def pruning_study(model: torch.nn.Module, val: torch.Tensor, *, recover_steps: int, progress=None) -> dict[str, Any]:
    """Each pruned model's loss, before and after `recover_steps` of training on the teacher's chain
    (at the rate the teacher's schedule ended at), beside two controls: the unpruned teacher trained
    for the same extra steps (if it still improves, recovery is partly just more training), and a
    model of the pruned size trained from scratch for as many steps with the teacher's own recipe
    (what the pruned weights are worth)."""
    cont = copy.deepcopy(model)
    train(cont, Chain(seed=1, sample_seed=40), steps=recover_steps, batch=TEACHER_BATCH, lr=RECOVER_LR)
    controls = {"teacher_continued": evaluate(cont, val)}
    if progress:
        progress(f"  control: the teacher trained {recover_steps} more steps: loss {controls['teacher_continued']:.3f}")
    rows = []
    for heads in (2, 4, 6):
        if teacher_spec().hidden_size % (teacher_spec().num_heads - heads):
            continue
        small, spec = prune_heads(model, heads)
        before = evaluate(small, val)
        train(small, Chain(seed=1, sample_seed=40), steps=recover_steps, batch=TEACHER_BATCH, lr=RECOVER_LR)
        rows.append({"heads_removed": heads, "heads_left": spec.num_heads, "params": sum(p.numel() for p in small.parameters()),
                     "predicted_params": spec.params, "loss_pruned": before, "loss_after_recovery": evaluate(small, val),
                     "loss_scratch_same_steps": _scratch_loss(spec, recover_steps, val),
                     "predicted_inference_bytes": C.quantized_inference(spec, fmt="fp32", batch_size=16, seq_len=SEQ,
                                                                        device="cpu").total})
        if progress:
            progress(f"  {heads} heads removed: loss {before:.3f}, after {recover_steps} steps {rows[-1]['loss_after_recovery']:.3f}")
    return {"teacher_loss": evaluate(model, val), "teacher_params": teacher_spec().params, "rows": rows,
            "recover_steps": recover_steps, **controls}


def _scratch_loss(spec: ModelSpec, steps: int, val: torch.Tensor) -> float:
    m = build(spec, seed=11)
    train(m, Chain(seed=1, sample_seed=40), steps=steps, batch=TEACHER_BATCH, lr=TEACHER_LR, cosine=True)
    return evaluate(m, val)


# ----------------------------------------------------------------------------- MoEfication (Zhang+22)
MOE_EXPERTS = 8  # groups per FFN: 704 neurons -> 8 experts of 88
MOE_ROUTERS = ("oracle", "linear", "centroid")


def balanced_kmeans(rows: torch.Tensor, groups: int, *, iters: int = 30, seed: int = 0) -> list[list[int]]:
    """MoEfication's parameter clustering: split the neurons (each one row of the FFN's first weight,
    the gate's in a gated FFN) into `groups` groups of equal size by k-means on the unit-normalised
    rows, each round assigning the (neuron, centre) pairs nearest first under a cap of n / groups a
    group. Returns the groups, each a sorted list of neuron indices (a partition of range(n))."""
    n = rows.shape[0]
    groups = checks.whole("groups", groups, hi=n)
    if n % groups:
        raise ValueError(f"{n} neurons do not split into {groups} equal groups: choose a divisor of {n}")
    cap = n // groups
    x = torch.nn.functional.normalize(rows.detach().double(), dim=1)
    g = torch.Generator().manual_seed(seed)
    centers = x[torch.randperm(n, generator=g)[:groups]].clone()
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        order = torch.cdist(x, centers).flatten().argsort().tolist()
        got, fill, left = [-1] * n, [0] * groups, n
        for f in order:
            r, c = divmod(f, groups)
            if got[r] < 0 and fill[c] < cap:
                got[r] = c
                fill[c] += 1
                left -= 1
                if not left:
                    break
        new_assign = torch.tensor(got)
        if torch.equal(new_assign, assign):
            break
        assign = new_assign
        centers = torch.stack([x[assign == c].mean(0) for c in range(groups)])
    return [sorted((assign == c).nonzero().flatten().tolist()) for c in range(groups)]


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every tensor the operations run under it allocate (values and bytes); views of their
    inputs (a weight's transpose) allocate nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.values = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.values += t.numel()
                self.bytes += t.numel() * t.element_size()
        return out


class MoEFFN(torch.nn.Module):
    """A dense FFN computed as MoEfication's experts: for each token the `k` groups of neurons its
    router scores highest, only their rows of the input weights and columns of the output weight
    (expert by expert: the tokens routed to an expert gathered, their outputs added back).
    Gated: down(act(gate x + b) * (up x + b)); plain: out(act(fc x + b)). `router(x)` gives the
    (tokens x E) scores. With `count`, it adds each forward's matmul FLOPs (torch's FlopCounterMode)
    and the width-m intermediates the experts' forwards allocate (a dispatch mode) to `counted`."""

    def __init__(self, w_in: list[torch.Tensor], b_in: list[torch.Tensor | None], act: Callable, w_out: torch.Tensor,
                 b_out: torch.Tensor | None, groups: list[list[int]], k: int, router: Callable):
        super().__init__()
        self.gated, self.act, self.k, self.router = len(w_in) == 2, act, k, router
        self.b_out = b_out
        idx = [torch.tensor(g) for g in groups]
        self.experts = [([w[i].detach() for w in w_in], [None if b is None else b[i].detach() for b in b_in],
                         w_out[:, i].detach().contiguous()) for i in idx]
        self.count = False
        self.counted = {"flops": 0, "intermediate_values": 0, "intermediate_bytes": 0, "tokens": 0}

    @classmethod
    def from_llama(cls, mlp: torch.nn.Module, groups: list[list[int]], k: int, router: Callable) -> "MoEFFN":
        return cls([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias], mlp.act_fn,
                   mlp.down_proj.weight, mlp.down_proj.bias, groups, k, router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.count:
            return self._forward(x, None)
        from torch.utils.flop_counter import FlopCounterMode

        allocs = _Allocations()
        with FlopCounterMode(display=False) as fc:
            y = self._forward(x, allocs)
        c = self.counted
        c["flops"] += fc.get_total_flops()
        c["intermediate_values"] += allocs.values
        c["intermediate_bytes"] += allocs.bytes
        c["tokens"] += x.numel() // x.shape[-1]
        return y

    def _forward(self, x: torch.Tensor, allocs: "_Allocations | None") -> torch.Tensor:
        import contextlib

        F = torch.nn.functional
        x2 = x.reshape(-1, x.shape[-1])  # tokens x h
        top = self.router(x2).topk(self.k, dim=1).indices  # tokens x k: each token's experts
        out = torch.zeros(x2.shape[0], self.experts[0][2].shape[0], dtype=x.dtype, device=x.device)
        for e, (ws, bs, w2) in enumerate(self.experts):
            tok = (top == e).any(dim=1).nonzero().flatten()
            if not len(tok):
                continue
            xe = x2.index_select(0, tok)  # tokens routed here x h
            with allocs if allocs is not None else contextlib.nullcontext():  # the expert's intermediates (x m)
                if self.gated:
                    a = self.act(F.linear(xe, ws[0], bs[0])) * F.linear(xe, ws[1], bs[1])
                else:
                    a = self.act(F.linear(xe, ws[0], bs[0]))
            out.index_add_(0, tok, F.linear(a, w2))
        if self.b_out is not None:
            out = out + self.b_out
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _group_norms(mlp: torch.nn.Module, x: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """(tokens x E): the norm of each group's slice of the dense FFN's intermediate act(gate x) * up x."""
    with torch.no_grad():
        a = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        return torch.stack([a[:, g].norm(dim=1) for g in groups], dim=1)


def _mlp_inputs(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's FFN input (tokens x h) on the batch `x`, from the dense model."""
    got: list[torch.Tensor] = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: got.append(args[0].detach().reshape(-1, args[0].shape[-1])))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    return got


def moe_routers(model: torch.nn.Module, calib: torch.Tensor, groups: list[list[list[int]]]) -> dict[str, list[Callable]]:
    """Per layer, the three routers compared: "oracle", the groups whose true intermediate is largest
    (computes the dense FFN: an upper bound, no saving); "centroid", MoEfication's similarity
    selection, scores = x . (the mean of the group's gate rows), no training; "linear", a linear
    layer h -> E (with bias) fitted by least squares on `calib`'s tokens to predict each group's
    intermediate norm (MoEfication's learned router, one layer instead of two)."""
    out: dict[str, list[Callable]] = {r: [] for r in MOE_ROUTERS}
    for layer, xs, gs in zip(model.model.layers, _mlp_inputs(model, calib), groups):
        mlp = layer.mlp
        out["oracle"].append(lambda x, mlp=mlp, gs=gs: _group_norms(mlp, x, gs))
        cent = torch.stack([mlp.gate_proj.weight[g].mean(0) for g in gs]).detach()
        out["centroid"].append(lambda x, c=cent: x @ c.T)
        target = _group_norms(mlp, xs, gs)
        a = torch.cat([xs, torch.ones(len(xs), 1)], dim=1).double()
        sol = torch.linalg.lstsq(a, target.double()).solution  # (h + 1) x E
        lin = torch.nn.Linear(xs.shape[1], len(gs), dtype=xs.dtype)
        with torch.no_grad():
            lin.weight.copy_(sol[:-1].T)
            lin.bias.copy_(sol[-1])
        out["linear"].append(lin)
    return out


def moefied(model: torch.nn.Module, groups: list[list[list[int]]], k: int, routers: list[Callable]) -> torch.nn.Module:
    """A copy of the Llama-style `model` whose every FFN runs as a `MoEFFN` (top-`k` of its groups)."""
    m = copy.deepcopy(model)
    for layer, gs, r in zip(m.model.layers, groups, routers):
        layer.mlp = MoEFFN.from_llama(layer.mlp, gs, k, r)
    return m


def relu_teacher_spec() -> ModelSpec:
    return from_config({**TEACHER, "hidden_act": "relu"}, name="lab8-teacher-relu")


def moefication_study(model: torch.nn.Module, spec: ModelSpec, val: torch.Tensor, calib: torch.Tensor, *,
                      experts: int = MOE_EXPERTS, progress=None) -> dict[str, Any]:
    """MoEfy `model` (each FFN split into `experts` groups by `balanced_kmeans` on its gate rows) and
    measure, for k = 1..E and each router, the loss on `val`; count the linear router's FLOPs and
    FFN intermediates in the forward against `compression.moefication`; and how concentrated the
    FFN's activity is: the share of the intermediate's squared norm the top-k groups hold, and the
    share of intermediate values that are exactly zero (a ReLU's sparsity)."""
    dense = evaluate(model, val)
    groups = [balanced_kmeans(layer.mlp.gate_proj.weight, experts) for layer in model.model.layers]
    routers = moe_routers(model, calib, groups)
    xs = _mlp_inputs(model, val)
    energy, zeros = [], []
    with torch.no_grad():
        for layer, x, gs in zip(model.model.layers, xs, groups):
            a = layer.mlp.act_fn(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
            e = torch.stack([a[:, g].pow(2).sum(1) for g in gs], dim=1).sort(dim=1, descending=True).values
            energy.append((e.cumsum(1) / e.sum(1, keepdim=True)).mean(0))
            zeros.append((a == 0).float().mean().item())
    share = torch.stack(energy).mean(0).tolist()
    rows = []
    tokens = val.numel()
    for k in range(1, experts + 1):
        pred = C.moefication(spec, experts=experts, active=k, router="linear", router_bias=True, dtype="fp32",
                             precision="fp32", seq_len=val.shape[1], device="cpu")
        row: dict[str, Any] = {"k": k, "active_share": k / experts, "energy_share": share[k - 1]}
        for r in MOE_ROUTERS:
            m = moefied(model, groups, k, routers[r])
            if r == "linear":
                for mod in m.modules():
                    if isinstance(mod, MoEFFN):
                        mod.count = True
            row[f"loss_{r}"] = evaluate(m, val)
            if r == "linear":
                mods = [mod for mod in m.modules() if isinstance(mod, MoEFFN)]
                row["counted_ffn_flops_per_token"] = sum(mod.counted["flops"] for mod in mods) / tokens
                row["counted_intermediate_bytes_per_token"] = sum(mod.counted["intermediate_bytes"] for mod in mods) / tokens
                row["router_params"] = sum(p.numel() for mod in mods for p in mod.router.parameters())
        row.update(predicted_ffn_flops_per_token=pred.ffn_flops,
                   predicted_intermediate_bytes_per_token=4 * pred.ffn_intermediate_values,
                   predicted_router_params=pred.router_params, predicted_active_params=pred.active_params,
                   predicted_ffn_saved_bytes_per_token=pred.ffn_saved_bytes)
        rows.append(row)
        if progress:
            progress(f"  {spec.name} k={k}/{experts}: loss oracle {row['loss_oracle']:.3f}, linear {row['loss_linear']:.3f}, "
                     f"centroid {row['loss_centroid']:.3f} (dense {dense:.3f})")
    dense_flops = _dense_ffn_flops(model, val)
    return {"model": spec.name, "activation": spec.activation, "experts": experts,
            "neurons_per_expert": spec.intermediate_size // experts, "dense_loss": dense,
            "counted_dense_ffn_flops_per_token": dense_flops,
            "predicted_dense_ffn_flops_per_token": C.moefication(spec, experts=experts, active=experts).ffn_flops_dense,
            "params": sum(p.numel() for p in model.parameters()), "zero_share": sum(zeros) / len(zeros), "rows": rows}


def _dense_ffn_flops(model: torch.nn.Module, val: torch.Tensor) -> float:
    """The dense FFNs' matmul FLOPs a token, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    total = 0
    with torch.no_grad():
        for layer, x in zip(model.model.layers, _mlp_inputs(model, val)):
            with FlopCounterMode(display=False) as fc:
                layer.mlp(x)
            total += fc.get_total_flops()
    return total / val.numel()


def moefication_run(*, steps: int = 250, progress=print) -> dict[str, Any]:
    """`python -m vramlab.measure.compression --moefication`: the lab's SiLU teacher and the same
    model with ReLU (ReGLU: relu(gate x) * up x, trained the same way), each MoEfied and measured."""
    from .record import provenance

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"experiment": "moefication", "mode": "cpu", "provenance": provenance("cpu"), "steps": steps,
                           "models": []}
    for spec in (teacher_spec(), relu_teacher_spec()):
        progress(f"training {spec.name} ({spec.activation}, {steps} steps)")
        chain = Chain(seed=1)
        model = build(spec)
        train(model, chain, steps=steps, batch=TEACHER_BATCH, lr=TEACHER_LR, cosine=True)
        val, calib = chain.sample(64), chain.sample(32)
        res = moefication_study(model, spec, val, calib, progress=progress)
        res["oracle_loss"] = chain.oracle_loss(val)
        out["models"].append(res)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _bnb_version() -> str | None:
    """bitsandbytes' version, or None; without importing it (its import prints a warning on CPUs)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitsandbytes")
    except PackageNotFoundError:
        return None


def run(*, mode: str = "auto", steps: int = 250, progress=print) -> dict[str, Any]:
    from .record import provenance, resolve_mode

    mode_ = resolve_mode(mode)
    if mode_ == "trace":
        mode_ = "cpu"  # peft cannot wrap a model under FakeTensorMode: real CPU steps (small model)
    if mode_ == "cpu":
        # One compute thread: the model is small, and on a busy machine several threads wait on each
        # other at every operation (lab 8 ran 25 CPU-minutes instead of 3 with both cores taken).
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    progress(f"[1/6] training the teacher ({teacher_spec().params:,} parameters, {steps} steps)")
    teacher, chain = train_teacher(steps, progress=progress)
    val = chain.sample(64)
    progress("[2/6] quantizing its linear layers")
    quant = quantization_study(teacher, val, progress=progress)
    progress("[3/6] fine-tuning on a related chain: LoRA and full")
    lora = lora_study(teacher, steps=max(1, steps // 5), progress=progress)
    progress("[4/6] one fine-tuning step's memory, one process each")
    probes = memory_probes(mode_, progress=progress)
    progress("[5/6] distilling a student")
    distil = distillation_study(teacher, chain, val, steps=max(1, steps // 4), progress=progress)
    progress("[6/6] pruning heads")
    prune = pruning_study(teacher, val, recover_steps=max(1, steps // 10), progress=progress)
    return {"experiment": "compression", "mode": mode_, "provenance": provenance("cuda" if mode_ == "cuda" else "cpu"),
            "teacher": {"params": teacher_spec().params, "steps": steps, "val_loss": evaluate(teacher, val),
                        "entropy": chain.entropy, "oracle_loss": chain.oracle_loss(val)},
            "quantization": quant, "lora": lora, "memory": probes, "distillation": distil, "pruning": prune,
            "bitsandbytes": _bnb_version(), "wall_seconds": round(time.perf_counter() - t0, 1)}


PROG = "python -m vramlab.measure.compression"
_PROBE_KEYS = ("method", "targets", "optimizer", "batch_size", "seq_len", "mode", "autocast", "recompute")


def _probe_config(text: str) -> dict[str, Any]:
    """--probe's JSON (what `memory_probes` passes), checked before the step is measured: one line,
    SystemExit(2), otherwise."""
    from .memory import check_measurable

    try:
        cfg = json.loads(text)
    except ValueError as e:
        checks.fail(PROG, f"--probe must be a JSON object, cannot read {text[:40]!r}: {e}")
    try:
        if not isinstance(cfg, dict):
            raise ValueError(f"--probe must be a JSON object, got {type(cfg).__name__}")
        checks.no_unknown("--probe", cfg, _PROBE_KEYS)
        missing = [k for k in ("method", "targets", "batch_size", "seq_len", "mode") if k not in cfg]
        if missing:
            raise ValueError(f"--probe needs {', '.join(missing)}")
        checks.one_of("--probe method", cfg["method"], ("full", "lora", "qlora", "prompt", "prefix"))
        checks.one_of("--probe targets", cfg["targets"], ("-", "default", "all-linear"))
        checks.one_of("--probe optimizer", cfg.get("optimizer", "adamw"), ("adamw", "adamw-8bit"))
        checks.whole("--probe batch_size", cfg["batch_size"], hi=4096)
        checks.positions(teacher_spec(), checks.whole("--probe seq_len", cfg["seq_len"]), name="--probe seq_len")
        checks.one_of("--probe mode", cfg["mode"], ("cuda", "cpu"))
        if cfg["mode"] == "cuda" and not torch.cuda.is_available():
            raise ValueError("--probe mode cuda needs a CUDA GPU and this machine has none")
        checks.flag("--probe autocast", cfg.get("autocast", True))
        check_measurable(teacher_spec(), checks.text("--probe recompute", cfg.get("recompute", "none")))
    except (ValueError, NotImplementedError) as e:
        checks.fail(PROG, str(e))
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--steps", type=checks.argtype(checks.whole, int, lo=1, hi=100_000), default=250,
                    help="teacher training steps, 1 to 100,000 (the others scale with it)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here (checked before the lab starts)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--moefication", action="store_true",
                    help="only MoEfication (chapter 8): the teacher and a ReLU variant split into experts, on the CPU")
    a = ap.parse_args(argv)
    try:  # refusals return 2, as a failed run does
        if a.probe is not None:
            cfg = _probe_config(a.probe)
        else:
            if a.mode == "cuda" and not torch.cuda.is_available():
                checks.fail(PROG, "--mode cuda needs a CUDA GPU and this machine has none; use --mode cpu or auto")
            checks.output_path(PROG, a.out, make_folder=True)
    except SystemExit as e:
        return e.code
    if a.probe is not None:
        print(json.dumps(_probe(cfg)))
        return 0
    try:
        if a.moefication:
            res = moefication_run(steps=a.steps, progress=lambda s: print(s, file=sys.stderr, flush=True))
        else:
            res = run(mode=a.mode, steps=a.steps, progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    from .record import write_results

    return write_results(res, "vramlab.measure.compression", argv, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
