"""The estimate of the training configuration a user already has.

`read_setup(path_or_text)` reads one of

    deepspeed    a DeepSpeed JSON (https://www.deepspeed.ai/docs/config-json/)
    trainer      a Hugging Face `TrainingArguments` JSON (`TrainingArguments.to_dict()` /
                 `to_json_string()`, or the subset people write by hand; TRL's `max_length` too), its
                 `deepspeed` (a path or a dict) and its `fsdp` / `fsdp_config` (FSDP2) read with it
    accelerate   an `accelerate config` YAML: distributed_type NO | MULTI_GPU | DEEPSPEED | FSDP,
                 num_processes x num_machines, mixed_precision, deepspeed_config (inline, or its
                 deepspeed_config_file), fsdp_config (fsdp_version: 2 only)
    axolotl      an Axolotl YAML (base_model, adapter lora/qlora, sequence_len, micro_batch_size, ...)
    torchtune    a torchtune recipe YAML (model._component_, checkpointer, batch_size, dtype, ...)
    torchtitan   a torchtitan TOML ([training], [parallelism], [activation_checkpoint]): FSDP2

and normalises it into a `Setup`: every setting the estimate needs with the field it came from, or
"assumed: why" where the file does not say (`Setup.sources`). `Setup.estimate()` calls the library as
`Setup.api_call()` writes it (one of `memory.estimate_training`, `compression.peft_training`,
`zero.estimate_rank`, `zero.rank_phases`, `offload.model_offload`), so the number is the one the direct
call gives. A field this module does not know is refused in one line (a ValueError naming it), never
ignored; a known field whose value changes memory in a way no estimator here models (Adafactor,
torch.compile, FSDP1, CPU offload of several ranks, ...) is refused the same way.

The model: `model=` a local config.json (or its folder), a preset name, or a Hugging Face model id read
from the local cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub; never the network). Where
the format names the model (Axolotl's base_model, torchtune's checkpointer.checkpoint_dir) that is used
unless `model=` is given.

Each format has its reader: `configs_deepspeed` (DeepSpeed JSON), `configs_hf` (TrainingArguments,
accelerate, Axolotl), `configs_pytorch` (torchtune, torchtitan), all on `configs_fields` (the field
readers and the parser); this module resolves the model, puts the settings together and checks them.

Pure: the standard library and vramlab's calculators. A YAML is parsed by the `yaml_loader` the caller
passes (`vramlab.present.from_config.read_setup` passes PyYAML's `safe_load`); a dict is taken as it is.

Known limitations: what each estimator leaves out is listed in `Setup.notes` (DDP's gradient buckets,
an overlap_comm's extra buckets, a chunked loss under LoRA, ...); the sequence length is the padded
one (every micro-batch at the longest length the config allows); tensor, pipeline and context
parallelism are refused (`vramlab plan`, `vramlab context` price them).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from . import checks, fitting, memory, optimizers, specs
from . import compression as COMP
from . import offload as OFF
from . import zero as Z
from .configs_deepspeed import read_deepspeed
from .configs_fields import FORMAT_NAMES, FORMATS, Draft, fail, parse, read_text
from .configs_fields import MAX_FILE_BYTES, ConfigError  # noqa: F401 (callers name them configs.X)
from .configs_hf import read_accelerate, read_axolotl, read_trainer
from .configs_pytorch import read_torchtitan, read_torchtune


# ----------------------------------------------------------------------------- the model

def hf_cache_dir() -> str:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def cached_config(model_id: str) -> str:
    """The config.json of `model_id` ("org/name") in the local Hugging Face cache: the snapshot refs/main
    names, else the newest snapshot holding one. Offline: nothing is downloaded; a ConfigError naming
    the id and the cache when it is not there."""
    cache = hf_cache_dir()
    folder = os.path.join(cache, "models--" + model_id.replace("/", "--"))
    snaps = os.path.join(folder, "snapshots")
    try:
        with open(os.path.join(folder, "refs", "main"), encoding="utf-8") as f:
            main = os.path.join(snaps, f.read().strip(), "config.json")
        if os.path.isfile(main):
            return main
    except OSError:
        pass
    found = sorted(glob.glob(os.path.join(glob.escape(snaps), "*", "config.json")), key=os.path.getmtime)
    if not found:
        fail(f"model {model_id!r} is not in the local Hugging Face cache ({cache}): vramlab reads models offline; "
             f"download its config.json once (huggingface-cli download {model_id} config.json) or give a config.json path")
    return found[-1]


@dataclass(frozen=True)
class ModelRef:
    """The model as found: its spec, the expression that rebuilds it, the checkpoint's dtype (None: not said)."""

    spec: specs.ModelSpec
    expr: str
    dtype: str | None
    where: str


def resolve_model(ref: str) -> ModelRef:
    """A local config.json (or a folder holding one), a preset name, or a Hugging Face id from the cache."""
    ref = checks.text("model", ref)
    if os.path.exists(ref):
        path = os.path.join(ref, "config.json") if os.path.isdir(ref) else ref
        where = f"config {path}"
    elif ref in specs.preset_names():
        return ModelRef(specs.preset(ref), f"vramlab.specs.preset({ref!r})", None, f"preset {ref}")
    elif ref.count("/") <= 1 and not ref.startswith((".", "/", "~")) and not any(c.isspace() for c in ref):
        path = cached_config(ref)
        where = f"{ref} (Hugging Face cache: {path})"
    else:
        fail(f"model {ref!r} is neither a config.json path, a preset ({', '.join(specs.preset_names())}) nor a "
             "Hugging Face id (org/name)")
    raw = specs.read_json(path)
    spec = specs.from_config(path, name=ref if not os.path.exists(ref) else None)
    dtype = raw.get("dtype") or raw.get("torch_dtype") if isinstance(raw, dict) else None
    return ModelRef(spec, f"vramlab.specs.from_config({path!r}" + (f", name={ref!r})" if not os.path.exists(ref) else ")"),
                    dtype if isinstance(dtype, str) else None, where)


# ----------------------------------------------------------------------------- the setup

@dataclass(frozen=True, kw_only=True)
class Setup:
    """A training setup, normalised: what the estimators take, with the field each came from.

    micro_batch_size  # sequences a rank a micro-batch;  seq_len  # tokens a sequence (padded)
    gpus              # data-parallel ranks;  accumulation_steps  # micro-batches an optimizer step
    sharding          none (one GPU, or DDP: every rank holds the whole model) | deepspeed | fsdp2
    method            full | lora | qlora | lora-int8 (compression.peft_training)
    sources           setting -> the field it came from, or "assumed: why"
    notes             what the estimate leaves out, for this setup
    """

    fmt: str
    model: ModelRef
    micro_batch_size: int
    seq_len: int
    gpus: int = 1
    accumulation_steps: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    attention: str = "sdpa"
    recompute: str = "none"
    loss: str = "whole"
    use_cache: bool = False
    sharding: str = "none"
    zero_stage: int | None = None
    recipe: str | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reduce_bucket: int | None = None
    max_live_parameters: int | None = None
    persistence_threshold: int | None = None
    prefetch_bucket: int | None = None
    max_reuse_distance: int | None = None
    method: str = "full"
    lora_rank: int | None = None
    lora_targets: Any = "default"
    adapter_dtype: str = "fp32"
    gpu: str | None = None  # a GPU of specs.GPUS: sizes cuBLAS's workspaces, and `fit` checks against it
    sources: dict = field(default_factory=dict)
    notes: tuple = ()

    def call(self) -> tuple[str, Callable, tuple, dict, bool]:
        """(the function's name, the function, positional and keyword arguments, whether the peak is
        the max of its phases): the one call `estimate` makes and `api_call` writes."""
        spec = self.model.spec
        if self.sharding == "none" and self.offload_optimizer == "none":
            if self.method == "full":
                kw = dict(batch_size=self.micro_batch_size, seq_len=self.seq_len, precision=self.precision,
                          optimizer=self.optimizer, optimizer_impl=self.optimizer_impl, attention=self.attention,
                          recompute=self.recompute, accumulation_steps=self.accumulation_steps, loss=self.loss,
                          use_cache=self.use_cache, **self._gpu_kw())
                return "vramlab.memory.estimate_training", memory.estimate_training, (spec,), kw, False
            kw = dict(method=self.method, rank=self.lora_rank, targets=self.lora_targets,
                      batch_size=self.micro_batch_size, seq_len=self.seq_len, precision=self.precision,
                      optimizer=self.optimizer, optimizer_impl=self.optimizer_impl, attention=self.attention,
                      recompute=self.recompute, adapter_dtype=self.adapter_dtype, **self._gpu_kw())
            return "vramlab.compression.peft_training", COMP.peft_training, (spec,), kw, False
        if self.offload_optimizer != "none":
            kw = dict(scheme="zero-offload", batch_size=self.micro_batch_size, seq_len=self.seq_len)
            if self.reduce_bucket is not None:
                kw["reduce_bucket"] = self.reduce_bucket
            kw.update(self._gpu_kw())
            return "vramlab.offload.model_offload", OFF.model_offload, (spec,), kw, False
        kw = dict(micro_batch_size=self.micro_batch_size, seq_len=self.seq_len, recipe=self.recipe,
                  implementation=self.sharding, attention=self.attention, optimizer_impl=self.optimizer_impl,
                  accumulation_steps=self.accumulation_steps)
        for k in ("reduce_bucket", "max_live_parameters", "persistence_threshold", "prefetch_bucket",
                  "max_reuse_distance"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        if self.use_cache:
            kw["use_cache"] = True
        kw.update(self._gpu_kw())
        if self.recompute != "none" or self.loss != "whole":
            kw.update(recompute=self.recompute, loss=self.loss)
            return "vramlab.zero.rank_phases", Z.rank_phases, (spec, self.gpus, self.zero_stage), kw, True
        return "vramlab.zero.estimate_rank", Z.estimate_rank, (spec, self.gpus, self.zero_stage), kw, False

    def _gpu_kw(self) -> dict:
        return {} if self.gpu is None else {"gpu": self.gpu}

    def estimate(self) -> memory.MemoryBreakdown:
        """One rank's peak, in bytes (a MemoryBreakdown): the library call `api_call()` writes."""
        _, fn, args, kw, phases = self.call()
        out = fn(*args, **kw)
        if phases:
            return max(out, key=lambda b: b.total)
        return out.gpu_peak if isinstance(out, OFF.ModelOffload) else out

    def fit(self) -> fitting.Fit:
        """Does the estimate fit on `gpu` (`fitting.device_fit`: + margin + fragmentation + CUDA context)?
        The fragmentation block is the largest tensor's as `zero.fits` and `fitting.fit` take it."""
        if self.gpu is None:
            fail("no GPU given: give one (--gpu / gpu=) to check the fit")
        prec = Z.ACT_PRECISION[self.recipe] if self.sharding != "none" else self.precision
        largest = fitting.fragmentation_bytes(self.model.spec, batch_size=self.micro_batch_size, seq_len=self.seq_len,
                                              precision=prec, attention=self.attention)
        return fitting.device_fit(self.estimate(), self.gpu, largest_tensor=largest)

    def api_call(self) -> str:
        """The equivalent Python call, as text a reader can run (after `import vramlab`)."""
        name, _, args, kw, phases = self.call()
        parts = [self.model.expr] + [repr(a) for a in args[1:]] + [f"{k}={v!r}" for k, v in kw.items()]
        text = f"{name}({', '.join(parts)})"
        if phases:
            return f"max({text}, key=lambda b: b.total)"
        return text + (".gpu_peak" if name.endswith("model_offload") else "")

    def settings(self) -> list[tuple[str, Any, str]]:
        """(setting, value, source) for every setting the estimate uses, in a stable order."""
        out = [("model", self.model.spec.name, self.sources.get("model", ""))]
        for k in ("gpu", "gpus", "micro_batch_size", "seq_len", "accumulation_steps", "precision", "recipe", "optimizer",
                  "optimizer_impl", "attention", "recompute", "loss", "use_cache", "sharding", "zero_stage",
                  "offload_optimizer", "offload_param", "reduce_bucket", "max_live_parameters",
                  "persistence_threshold", "prefetch_bucket", "max_reuse_distance", "method", "lora_rank",
                  "lora_targets", "adapter_dtype"):
            if k in self.sources:
                out.append((k, getattr(self, k), self.sources[k]))
        return out

    def describe(self) -> str:
        """Every setting with the field it came from (or the assumption), the call, and what is left out."""
        rows = self.settings()
        w = max(len(k) for k, _, _ in rows)
        v = max(len(str(x)) for _, x, _ in rows)
        lines = [f"{FORMAT_NAMES[self.fmt]}: one rank's setup"]
        lines += [f"  {k:<{w}}  {str(x):<{v}}  <- {s}" for k, x, s in rows]
        lines.append(f"  the same estimate through the API: {self.api_call()}")
        lines += [f"  not counted: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"format": self.fmt, "model": self.model.spec.name, "model_source": self.model.where,
                "settings": {k: (list(x) if isinstance(x, tuple) else x) for k, x, _ in self.settings()},
                "sources": {k: s for k, _, s in self.settings()}, "api_call": self.api_call(),
                "notes": list(self.notes)}


# ----------------------------------------------------------------------------- reading the file

def _load(source, fmt: str | None, yaml_loader=None) -> tuple[Any, str, str | None]:
    """(the parsed document, its format, its path or None) from a path, a text, or a dict."""
    if fmt is not None:
        checks.one_of("format", fmt, FORMATS)
    path = None
    if isinstance(source, dict):
        data, text = source, None
    else:
        if not isinstance(source, (str, os.PathLike)):
            fail(f"expected a config path, its text or a dict, got {type(source).__name__}")
        s = os.fspath(source)
        if "\n" not in s and os.path.exists(s):
            path = s
            text = read_text(path)
        elif "\n" not in s and s.endswith((".json", ".yaml", ".yml", ".toml")):
            fail(f"cannot read {s!r}: no such file")
        else:
            text = s
        data = parse(text, path, fmt, yaml_loader)
    if fmt is None:
        fmt = _detect(data, path)
    elif not isinstance(data, dict):
        fail(f"{path or 'the config'} must be a mapping of fields, got {type(data).__name__}")
    return data, fmt, path


def _detect(data, path: str | None) -> str:
    if not isinstance(data, dict):
        fail(f"{path or 'the config'} must be a mapping of fields, got {type(data).__name__}")
    keys = set(data)
    if {"training", "parallelism"} & keys and isinstance(data.get("training"), dict) or "job" in keys:
        return "torchtitan"
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} and \
            not keys & {"per_device_train_batch_size", "output_dir"}:
        return "deepspeed"
    if keys & {"distributed_type", "compute_environment"}:
        return "accelerate"
    if "base_model" in keys:
        return "axolotl"
    if isinstance(data.get("model"), dict) and "_component_" in data["model"]:
        return "torchtune"
    if keys & {"per_device_train_batch_size", "output_dir", "optim", "gradient_checkpointing"}:
        return "trainer"
    fail(f"{path or 'the config'}: not a format vramlab reads ({', '.join(FORMAT_NAMES.values())}); "
         "give the format (--format / fmt=) if it is one of them")


_READERS = {"deepspeed": read_deepspeed, "trainer": read_trainer, "accelerate": read_accelerate,
            "axolotl": read_axolotl, "torchtune": read_torchtune, "torchtitan": read_torchtitan}


def read_setup(source, *, fmt: str | None = None, model: str | None = None, gpus: int | None = None,
               batch_size: int | None = None, seq_len: int | None = None, gpu: str | None = None,
               yaml_loader: Callable[[str], Any] | None = None) -> Setup:
    """A `Setup` from a training configuration: a path, its text, or the dict (DeepSpeed's, a
    TrainingArguments' `to_dict()`, ...). `fmt` one of FORMATS (default: found from the fields).
    `model`: a config.json path, a preset or a Hugging Face id from the local cache (required where the
    format does not name one). `gpus` (data-parallel ranks), `batch_size` (the micro-batch) and
    `seq_len` (tokens) say what the file leaves to the launcher; given, they win over the file (their
    source says so). `yaml_loader` parses a YAML text (`yaml.safe_load`; this module imports nothing but
    the standard library: `vramlab.present.from_config.read_setup` passes PyYAML's). Raises ConfigError
    (a ValueError) in one line naming the field it cannot use."""
    data, fmt, path = _load(source, fmt, yaml_loader)
    d = Draft()
    base = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    named = _READERS[fmt](data, d, base)
    if model is not None:
        d.put("model", model, "argument model")
    elif named is not None:
        d.put("model", named[0], named[1])
    if not d.has("model"):
        fail(f"this {FORMAT_NAMES[fmt]} does not name the model: give it (--model: a config.json path, a preset or "
             "a Hugging Face id in the local cache)")
    for name, v in (("gpus", gpus), ("micro_batch_size", batch_size), ("seq_len", seq_len)):
        if v is not None:
            arg = {"micro_batch_size": "batch_size"}.get(name, name)
            d.put(name, checks.whole(arg, v), f"argument {arg}"
                  + (f" (the file said {d.values[name]})" if name in d.values and d.values[name] != v else ""))
    ref = resolve_model(d.values["model"])
    if gpu is not None:
        g = specs.gpu(gpu)
        d.put("gpu", next(k for k, x in specs.GPUS.items() if x == g), "argument gpu")
    return _finish(d, fmt, ref)


# ----------------------------------------------------------------------------- the settings, together

def _precision(d: Draft, fmt: str, ref: ModelRef) -> None:
    """The precision of a setup without DeepSpeed: the half dtype the file asks for and the dtype the model
    is loaded in (transformers 5's from_pretrained loads dtype='auto': the checkpoint's dtype; Axolotl
    loads the model in the dtype it trains in)."""
    if d.has("precision"):
        return
    half, src = d.values.get("_half", (None, "assumed: no mixed precision named"))
    if d.values.get("_loaded_half"):
        loaded_half, lsrc = half is not None, "Axolotl loads the model in that dtype"
    elif ref.dtype:
        loaded_half = ref.dtype in ("bfloat16", "float16")
        lsrc = f"the checkpoint's dtype {ref.dtype} (from_pretrained's default dtype='auto')"
    else:
        loaded_half, lsrc = False, "assumed: a float32 checkpoint (the model's config names no dtype)"
    if d.values.get("sharding") == "fsdp2" and half:
        d.put("precision", f"{half}-mixed", f"{src} (FSDP2 under accelerate upcasts the parameters to fp32 and "
              "computes in 16 bits: MixedPrecisionPolicy)")
    elif loaded_half:
        d.put("precision", "bf16", f"{src}; {lsrc}: pure 16-bit parameters, gradients and optimizer states"
              + (" (fp16's bytes are bf16's)" if ref.dtype == "float16" or half == "fp16" else ""))
    elif half:
        d.put("precision", f"{half}-mixed", f"{src}; {lsrc}: autocast over fp32 parameters")
    else:
        d.put("precision", "fp32", f"{src}; {lsrc}")


def _finish(d: Draft, fmt: str, ref: ModelRef) -> Setup:
    spec = ref.spec
    v, s = d.values, d.sources
    s["model"] = f"{s['model']}: {ref.where}"
    if not d.has("seq_len"):
        fail(f"this {FORMAT_NAMES[fmt]} does not say the sequence length: give it (--seq-len / seq_len=)")
    if not d.has("micro_batch_size"):
        fail(f"this {FORMAT_NAMES[fmt]} does not say the micro-batch: give it (--batch-size / batch_size=)")
    if not d.has("gpus"):
        if "_train_batch_size" in v:  # DeepSpeed: train_batch_size = micro x accumulation x ranks
            tbs, src = v["_train_batch_size"]
            per = v["micro_batch_size"] * v.get("accumulation_steps", 1)
            if tbs % per:
                fail(f"{src} = {tbs} is not micro-batch x accumulation ({per}) x ranks")
            d.put("gpus", tbs // per, f"{src} / (micro-batch x gradient_accumulation_steps)")
        elif "_global_batch" in v:
            gb, src = v["_global_batch"]
            per = v["micro_batch_size"] * v.get("accumulation_steps", 1)
            if gb % per:
                fail(f"{src} = {gb} is not local_batch_size x ranks")
            d.put("gpus", gb // per, f"{src} / training.local_batch_size")
        elif "_gpus_from_launcher" in v:
            fail(f"{v['_gpus_from_launcher']}: give the number of ranks (--gpus / gpus=)")
        else:
            d.default("gpus", 1, "the launcher's world size is not in the file: one rank (give --gpus)")
    if "_train_batch_size" in v:  # DeepSpeed asserts train_batch_size = micro-batch x accumulation x ranks
        tbs, src = v["_train_batch_size"]
        want = v["micro_batch_size"] * v.get("accumulation_steps", 1) * v["gpus"]
        if tbs != want:
            fail(f"{src} = {tbs} but micro-batch x accumulation x ranks = {v['micro_batch_size']} x "
                 f"{v.get('accumulation_steps', 1)} x {v['gpus']} = {want}: DeepSpeed refuses the config")
    for setting, (fn, src) in d.deferred.items():
        if setting not in v:
            d.put(setting, fn(spec), src)
    _precision(d, fmt, ref)
    sharding = v.get("sharding", "none")
    if sharding == "none":
        for k in ("zero_stage", "recipe"):
            v.pop(k, None), s.pop(k, None)
    elif "recipe" not in v or v.get("sharding") == "fsdp2":
        prec = v["precision"]
        if prec not in ("fp32", "bf16-mixed", "fp16-mixed"):
            fail(f"{s['precision']}: pure {prec} parameters under {sharding} are not a modelled recipe "
                 "(zero.RECIPES keep fp32 master weights); set mixed precision")
        if "recipe" not in v:
            d.put("recipe", "fp32-adam" if prec == "fp32" else "mixed-adam",
                  f"{s['precision']} ({'fp32 model' if prec == 'fp32' else '16-bit compute, fp32 master weights'} and "
                  "Adam: zero.RECIPES)")
    if sharding == "none" and v.get("gpus", 1) > 1:
        d.notes.append("DDP: every rank holds the whole model as one GPU does; DDP's gradient buckets "
                       "(ddp_bucket_cap_mb, 25 MiB each; a flat copy of the gradients unless gradient_as_bucket_view) "
                       "are not in memory.estimate_training")
    method = v.get("method", "full")
    if method != "full" and sharding != "none":
        fail(f"{s['method']}: LoRA under {sharding} is not modelled (compression.peft_training prices one GPU)")
    if method != "full":
        if v.get("accumulation_steps", 1) > 1:
            d.notes.append(f"{s['accumulation_steps']}: compression.peft_training prices one micro-batch; accumulating "
                           "keeps the adapters' gradients between micro-batches (at most lora_params x 4 bytes more)")
        if v.get("loss", "whole") != "whole":
            d.notes.append(f"{s['loss']}: compression.peft_training models the whole loss, so the logits are "
                           "counted whole (an over-estimate)")
            v["loss"] = "whole"
            s.pop("loss")
        if v.get("optimizer") not in optimizers.SHARDED:
            fail(f"{s['optimizer']}: not modelled")
    off_o, off_p = v.get("offload_optimizer", "none"), v.get("offload_param", "none")
    if sharding == "deepspeed":
        if v.get("recompute", "none") != "none":
            fail(f"{s['recompute']} with DeepSpeed is not modelled: zero.rank_phases models recompute under FSDP2 "
                 "only (the DeepSpeed phases were measured without it); turn it off to price the rest")
        if v.get("optimizer", "adamw") not in ("adam", "adamw"):
            fail(f"{s['optimizer']}: ZeRO ranks are estimated with Adam(W) only")
        v.setdefault("optimizer_impl", "fused")
        s.setdefault("optimizer_impl", "assumed: DeepSpeed's FusedAdam (one flat partition tensor)")
        if off_p != "none" or off_o == "nvme":
            fail(f"{s.get('offload_param') if off_p != 'none' else s['offload_optimizer']}: parameter and NVMe offload "
                 "are priced by offload.infinity on one GPU (vramlab offload), not per rank here")
        if off_o == "cpu":
            if v["gpus"] != 1 or v["zero_stage"] not in (1, 2) or v["recipe"] != "mixed-adam" or \
                    v["precision"] != "bf16-mixed":
                fail(f"{s['offload_optimizer']}: CPU optimizer offload is priced for one GPU, ZeRO-1/2, bf16 "
                     "(offload.model_offload, measured so); this setup has "
                     f"{v['gpus']} rank(s), stage {v['zero_stage']}, {v['precision']}")
            d.notes.append("ZeRO-Offload: host memory (16 bytes a parameter) is not GPU memory and not in this estimate")
            if v.get("accumulation_steps", 1) > 1:
                d.notes.append(f"{s['accumulation_steps']}: offload.model_offload prices one micro-batch a step")
    elif sharding == "fsdp2":
        if spec.is_moe:
            fail("a mixture of experts under FSDP2 is not modelled (vramlab experts)")
        if v.get("optimizer", "adamw") not in ("adam", "adamw"):
            fail(f"{s['optimizer']}: FSDP2 ranks are estimated with Adam(W) only")
        v.setdefault("optimizer_impl", "fused")
        s.setdefault("optimizer_impl", "assumed: fused AdamW")
        if v.get("recompute", "none") not in ("none", "full"):
            fail(f"{s['recompute']}: only full recompute is modelled under FSDP2")
    kw = {k: v[k] for k in ("micro_batch_size", "seq_len", "gpus", "accumulation_steps", "precision", "optimizer",
                            "optimizer_impl", "attention", "recompute", "loss", "use_cache", "zero_stage", "recipe",
                            "offload_optimizer", "offload_param", "reduce_bucket", "max_live_parameters",
                            "persistence_threshold", "prefetch_bucket", "max_reuse_distance", "method", "lora_rank",
                            "lora_targets", "adapter_dtype", "gpu") if k in v}
    defaults = {"accumulation_steps": "one micro-batch a step", "optimizer": "AdamW, the Trainer's and the "
                "libraries' default", "attention": "SDPA, the default of transformers, torchtune and torchtitan (flash or "
                "memory-efficient kernels: no s x s scores kept)",
                "recompute": "no activation checkpointing named",
                "optimizer_impl": "torch.optim's default implementation (foreach)"}
    for k, why in defaults.items():
        if k not in s:
            s[k] = f"assumed: {why}"
    if sharding != "none":
        s["sharding"] = s.get("sharding", sharding)
    setup = Setup(fmt=fmt, model=ref, sharding=sharding, sources=dict(s), notes=tuple(d.notes), **kw)
    setup.estimate()  # every check of the estimator, now: a bad setup fails here in one line
    return setup
