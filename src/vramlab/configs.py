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

Pure: the standard library and vramlab's calculators. A YAML is parsed by the `yaml_loader` the caller
passes (`vramlab.present.from_config.read_setup` passes PyYAML's `safe_load`); a dict is taken as it is.

Known limitations: what each estimator leaves out is listed in `Setup.notes` (DDP's gradient buckets,
an overlap_comm's extra buckets, a chunked loss under LoRA, ...); the sequence length is the padded
one (every micro-batch at the longest length the config allows); tensor, pipeline and context
parallelism are refused (`vramlab plan`, `vramlab context` price them).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import checks, fitting, memory, optimizers, specs
from . import compression as COMP
from . import offload as OFF
from . import zero as Z

FORMATS: tuple[str, ...] = ("deepspeed", "trainer", "accelerate", "axolotl", "torchtune", "torchtitan")
FORMAT_NAMES = {"deepspeed": "DeepSpeed JSON", "trainer": "TrainingArguments JSON", "accelerate": "accelerate config",
                "axolotl": "Axolotl YAML", "torchtune": "torchtune recipe", "torchtitan": "torchtitan TOML"}
MAX_FILE_BYTES = 1 << 20  # a training config is a few KB
TRAINER_BATCH = 8  # TrainingArguments.per_device_train_batch_size's default (transformers 5.23)


class ConfigError(ValueError):
    """A configuration this module cannot price: the message is one line naming the field."""


def _fail(msg: str) -> None:
    raise ConfigError(" ".join(msg.split()))


# ----------------------------------------------------------------------------- reading fields

class _Block:
    """One mapping of a config. Each key is taken (it sets something), passed (known, no effect on
    memory) or refused when `finish()` finds it neither."""

    def __init__(self, data, path: str, fmt: str):
        if not isinstance(data, dict):
            _fail(f"{path or 'the file'} must be a mapping of fields, got {checks.show(data)}")
        self.data, self.path, self.fmt, self.seen = data, path, fmt, set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default=None):
        self.seen.add(key)
        v = self.data.get(key)
        return default if v is None else v

    def given(self, key: str) -> bool:
        return self.data.get(key) is not None

    def block(self, key: str) -> "_Block | None":
        self.seen.add(key)
        v = self.data.get(key)
        if v is None or v == {}:
            return None
        return _Block(v, self.name(key), self.fmt)

    def known(self, *keys: str) -> None:
        self.seen.update(keys)

    def only(self, key: str, allowed: tuple, why: str):
        """A field that changes memory in a way not modelled: accepted only at a value in `allowed`
        (None, absent, is always allowed)."""
        v = self.get(key)
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            _fail(f"{self.name(key)} = {checks.show(v)} is not modelled: {why}")
        return v

    def finish(self) -> None:
        extra = [k for k in self.data if k not in self.seen]
        if extra:
            k = extra[0]
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            _fail(f"unknown field {self.name(k)!r}{more} in this {FORMAT_NAMES[self.fmt]}: vramlab does not know what it "
                  "does to memory, so it refuses it rather than ignore it; remove it, or ask for it to be modelled")


def _int(name: str, v, *, lo: int = 1) -> int:
    """A count as configs write it: 8, 2e8 (JSON float), "2e8" (YAML 1.1 reads 1e9 as a string)."""
    x = v
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            _fail(f"{name} must be a whole number, got {checks.show(v)}")
    if isinstance(x, float):
        if not math.isfinite(x) or x != int(x):
            _fail(f"{name} must be a whole number, got {checks.show(v)}")
        x = int(x)
    try:
        return checks.whole(name, x, lo=lo)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _bool(name: str, v) -> bool:
    """A truth value; YAML and accelerate also write 'true' / 'false' as strings."""
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if not checks.is_bool(v):
        _fail(f"{name} must be true or false, got {checks.show(v)}")
    return bool(v)


@dataclass
class _Draft:
    """Settings as they are found: value and source."""

    values: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    deferred: dict = field(default_factory=dict)  # setting -> (function of the spec, source): DeepSpeed's "auto"

    def put(self, setting: str, value, source: str) -> None:
        self.values[setting] = value
        self.sources[setting] = source

    def has(self, setting: str) -> bool:
        return setting in self.values

    def default(self, setting: str, value, why: str) -> None:
        if setting not in self.values:
            self.put(setting, value, f"assumed: {why}")


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
        _fail(f"model {model_id!r} is not in the local Hugging Face cache ({cache}): vramlab reads models offline; "
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
        _fail(f"model {ref!r} is neither a config.json path, a preset ({', '.join(specs.preset_names())}) nor a "
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
            _fail("no GPU given: give one (--gpu / gpu=) to check the fit")
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


# ----------------------------------------------------------------------------- parsing the file

def _read_text(path: str) -> str:
    """A config file's text: a regular file (a FIFO would hang) of at most MAX_FILE_BYTES, UTF-8."""
    if not os.path.isfile(path):
        _fail(f"cannot read {path!r}: not a regular file")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        _fail(f"cannot read {path!r}: too large for a training config (at most {MAX_FILE_BYTES:,} bytes)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}")


def _load(source, fmt: str | None, yaml_loader=None) -> tuple[Any, str, str | None]:
    """(the parsed document, its format, its path or None) from a path, a text, or a dict."""
    if fmt is not None:
        checks.one_of("format", fmt, FORMATS)
    path = None
    if isinstance(source, dict):
        data, text = source, None
    else:
        if not isinstance(source, (str, os.PathLike)):
            _fail(f"expected a config path, its text or a dict, got {type(source).__name__}")
        s = os.fspath(source)
        if "\n" not in s and os.path.exists(s):
            path = s
            text = _read_text(path)
        elif "\n" not in s and s.endswith((".json", ".yaml", ".yml", ".toml")):
            _fail(f"cannot read {s!r}: no such file")
        else:
            text = s
        data = _parse(text, path, fmt, yaml_loader)
    if fmt is None:
        fmt = _detect(data, path)
    elif not isinstance(data, dict):
        _fail(f"{path or 'the config'} must be a mapping of fields, got {type(data).__name__}")
    return data, fmt, path


def _toml():
    """The standard library's TOML reader (Python 3.11+), else one line: the rest of vramlab, the command line
    included, runs on Python 3.10, which has none (this layer imports nothing outside the standard library)."""
    try:
        import tomllib
    except ModuleNotFoundError:
        _fail("reading a TOML config needs Python 3.11 or later (this is Python 3.10)")
    return tomllib


def _parse(text: str, path: str | None, fmt: str | None, yaml_loader: Callable[[str], Any] | None = None):
    where = repr(path) if path else "the text"
    ext = os.path.splitext(path or "")[1].lower()
    section = re.compile(r"^\[[A-Za-z_][\w.]*\]\s*(#.*)?$", re.M)  # a TOML table header: [training]
    if ext == ".toml" or fmt == "torchtitan" or (ext not in (".json", ".yaml", ".yml") and section.search(text)):
        toml = _toml()
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as e:
            _fail(f"{where} is not valid TOML: {e}")
    if ext == ".json" or text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            _fail(f"{where} is not valid JSON: {e.msg} (line {e.lineno})")
        except RecursionError:
            _fail(f"{where} is nested too deeply to be a training config")
    if yaml_loader is None:  # this layer is the standard library only: the caller brings the YAML parser
        _fail(f"{where} is YAML: pass a parser (yaml_loader=yaml.safe_load), or read it with "
              "vramlab.present.from_config.read_setup, which does")
    try:
        return yaml_loader(text)
    except ValueError as e:
        _fail(f"{where}: {e}")
    except Exception as e:  # the parser's own error type (yaml.YAMLError): a malformed file, one line
        _fail(f"{where} is not valid YAML: {e}")


def _detect(data, path: str | None) -> str:
    if not isinstance(data, dict):
        _fail(f"{path or 'the config'} must be a mapping of fields, got {type(data).__name__}")
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
    _fail(f"{path or 'the config'}: not a format vramlab reads ({', '.join(FORMAT_NAMES.values())}); "
          "give the format (--format / fmt=) if it is one of them")


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
    d = _Draft()
    base = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    named = _READERS[fmt](data, d, base)
    if model is not None:
        d.put("model", model, "argument model")
    elif named is not None:
        d.put("model", named[0], named[1])
    if not d.has("model"):
        _fail(f"this {FORMAT_NAMES[fmt]} does not name the model: give it (--model: a config.json path, a preset or "
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


# ----------------------------------------------------------------------------- DeepSpeed

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


def _auto(d: _Draft, ctx: dict, key: str, setting: str, name: str, fallback, why: str):
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
        _fail(f"{name} = {value!r} but TrainingArguments' {ctx[key][1]} = {ctx[key][0]!r}: the Trainer refuses the "
              "mismatch (set it to \"auto\")")


def _deepspeed(data, d: _Draft, base: str, *, path: str = "", ctx: dict | None = None):
    """DeepSpeed's config-json (https://www.deepspeed.ai/docs/config-json/); "auto" as transformers'
    integrations/deepspeed.py (HfTrainerDeepSpeedConfig) fills it."""
    ctx = ctx or {}
    b = _Block(data, path, "deepspeed")
    n = b.name
    mb = b.get("train_micro_batch_size_per_gpu")
    if mb == "auto":
        _auto(d, ctx, "batch", "micro_batch_size", n("train_micro_batch_size_per_gpu"), TRAINER_BATCH,
              "TrainingArguments' per_device_train_batch_size default")
    elif mb is not None:
        d.put("micro_batch_size", _int(n("train_micro_batch_size_per_gpu"), mb), n("train_micro_batch_size_per_gpu"))
        _match(ctx, "batch", d.values["micro_batch_size"], n("train_micro_batch_size_per_gpu"))
    gas = b.get("gradient_accumulation_steps")
    if gas == "auto":
        _auto(d, ctx, "accumulation", "accumulation_steps", n("gradient_accumulation_steps"), 1,
              "TrainingArguments' gradient_accumulation_steps default")
    elif gas is not None:
        d.put("accumulation_steps", _int(n("gradient_accumulation_steps"), gas), n("gradient_accumulation_steps"))
        _match(ctx, "accumulation", d.values["accumulation_steps"], n("gradient_accumulation_steps"))
    tbs = b.get("train_batch_size")
    if tbs is not None and tbs != "auto":
        d.values["_train_batch_size"] = (_int(n("train_batch_size"), tbs), n("train_batch_size"))
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
            half[key] = (_bool(blk.name("enabled"), on), blk.name("enabled"))
            _match(ctx, key, half[key][0], blk.name("enabled"))
    amp = b.block("amp")
    if amp is not None:
        amp.only("enabled", (False,), "NVIDIA Apex AMP")
        amp.known("opt_level")
        amp.finish()
    on = [k for k, (v, _) in half.items() if v]
    if len(on) == 2:
        _fail(f"{n('bf16.enabled')} and {n('fp16.enabled')} are both true: DeepSpeed takes one")
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
            _fail(f"{opt.name('type')} = {checks.show(kind)} is not modelled: ZeRO ranks are estimated with Adam(W)")
        d.put("optimizer", "adamw", opt.name("type"))
        params = opt.block("params")
        if params is not None:
            torch_adam = params.get("torch_adam", False)
            params.known("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad")
            params.finish()
            if torch_adam and torch_adam != "auto" and _bool(params.name("torch_adam"), torch_adam):
                d.put("optimizer_impl", "foreach", f"{params.name('torch_adam')} (torch.optim.AdamW, foreach)")
        if d.sources.get("optimizer_impl", "").find("torch_adam") < 0:
            d.put("optimizer_impl", "fused", f"{opt.name('type')} (DeepSpeed's FusedAdam: one flat partition)")
        opt.finish()
    act = b.block("activation_checkpointing")
    if act is not None:
        _fail(f"{n('activation_checkpointing')} is not modelled: it is DeepSpeed's checkpointing API for Megatron "
              "models (transformers checkpoints with gradient_checkpointing)")
    b.only("communication_data_type", (), "a communication dtype other than the model's")
    b.only("seq_parallel_communication_data_type", (), "sequence parallelism")
    b.known(*_DS_PASS)
    zo = b.block("zero_optimization")
    stage = 0
    if zo is not None:
        stage = zo.get("stage", 0)
        if stage not in Z.STAGES or checks.is_bool(stage):
            _fail(f"{zo.name('stage')} must be 0, 1, 2 or 3, got {checks.show(stage)}")
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
                _fail(f"{ob.name('device')} must be none, cpu or nvme, got {checks.show(dev)}")
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
                d.put(setting, _int(zo.name(key), v, lo=0 if "persistence" in key else 1), zo.name(key))
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
    d.put("sharding", "deepspeed", (zo.name("stage") if zo is not None else "assumed: no zero_optimization (ZeRO-0)"))
    if zo is None:
        d.put("zero_stage", 0, "assumed: no zero_optimization block, DeepSpeed's stage 0")
    b.finish()


def _read_deepspeed(data, d: _Draft, base: str):
    _deepspeed(data, d, base)
    return None


def _ds_file(ref, base: str, where: str) -> dict:
    if isinstance(ref, dict):
        return ref
    if not isinstance(ref, str):
        _fail(f"{where} must be a DeepSpeed config path or a dict, got {checks.show(ref)}")
    # the launcher resolves it from its working directory; a config kept beside its DeepSpeed JSON names it
    # from its own folder: the first that exists
    tried = [ref] if os.path.isabs(ref) else list(dict.fromkeys([os.path.abspath(ref), os.path.join(base, ref)]))
    path = next((p for p in tried if os.path.exists(p)), None)
    if path is None:
        _fail(f"{where} = {ref!r}: no such file (looked for {' and '.join(tried)})")
    data = _parse(_read_text(path), path, None)
    if not isinstance(data, dict):
        _fail(f"{path!r} must be a DeepSpeed config (a JSON object)")
    return data


# ----------------------------------------------------------------------------- TrainingArguments

# Every TrainingArguments field of transformers 5.23 and the 4.x ones still found in saved
# training_args.json files that do not change the peak of a training step (logging, saving, evaluation,
# the learning rate, the hub...). Fields that do change memory are read (_trainer) or refused unless at
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


def _trainer(data, d: _Draft, base: str):
    """TrainingArguments (transformers 5.23, training_args.py) as `to_dict()` writes it or a subset."""
    b = _Block(data, "", "trainer")
    bs = b.get("per_device_train_batch_size")
    if bs is None and b.get("per_gpu_train_batch_size") is not None:
        bs, key = b.get("per_gpu_train_batch_size"), "per_gpu_train_batch_size"
    else:
        key = "per_device_train_batch_size"
    b.known("per_gpu_train_batch_size")
    if bs is None:
        d.put("micro_batch_size", TRAINER_BATCH, "assumed: no per_device_train_batch_size: its default 8")
    else:
        d.put("micro_batch_size", _int(key, bs), key)
    gas = b.get("gradient_accumulation_steps")
    d.put("accumulation_steps", 1 if gas is None else _int("gradient_accumulation_steps", gas),
          "gradient_accumulation_steps" if gas is not None else "assumed: gradient_accumulation_steps default 1")
    bf16, fp16 = (_bool(k, b.get(k, False)) for k in ("bf16", "fp16"))
    d.values["_half"] = ("bf16" if bf16 else "fp16" if fp16 else None, "bf16" if bf16 else "fp16" if fp16 else
                         "bf16 and fp16 false")
    for key in ("max_length", "max_seq_length"):  # TRL's SFTConfig
        if b.get(key) is not None:
            d.put("seq_len", _int(key, b.get(key)), f"{key} (TRL)")
    optim = b.get("optim", TRAINER_OPTIM_DEFAULT)
    if optim not in TRAINER_OPTIMS:
        _fail(f"optim = {checks.show(optim)} is not modelled; modelled: {', '.join(TRAINER_OPTIMS)}")
    d.put("optimizer", TRAINER_OPTIMS[optim][0], "optim" if b.given("optim") else
          f"assumed: optim default {TRAINER_OPTIM_DEFAULT}")
    d.put("optimizer_impl", TRAINER_OPTIMS[optim][1], d.sources["optimizer"])
    b.known("optim_target_modules")
    ck = None
    for key in ("activation_checkpointing", "gradient_checkpointing"):  # 5.x name, and its deprecated alias
        v = b.get(key)
        if v is not None and ck is None:
            ck = (_bool(key, v), key)
    b.known("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    if ck:
        d.put("recompute", "full" if ck[0] else "none", ck[1])
    if b.get("use_cache") is not None:
        d.put("use_cache", _bool("use_cache", b.get("use_cache")), "use_cache")
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
        _fail("deepspeed and fsdp are both set: the Trainer takes one")
    if ds:
        _deepspeed(_ds_file(ds, base, "deepspeed"), d, base, path="deepspeed", ctx=ctx)
    fsdp_on = bool(fsdp) and fsdp not in ("", [], False)
    fc = b.block("fsdp_config")
    if fsdp_on:
        if isinstance(fsdp, (str, list)):
            opts = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
            bad = [o for o in opts if o not in ("full_shard", "auto_wrap")]
            if bad:
                _fail(f"fsdp = {checks.show(fsdp)}: {bad[0]!r} is not modelled (FSDP2 full_shard, auto_wrap only)")
        _fsdp_config(fc, d, *_fsdp_version(fc, 2, "transformers 5's default FSDP version 2"))
    elif fc is not None:
        fc.seen.update(fc.data)  # fsdp off: its config is not used
    b.finish()
    return None


def _fsdp_key(fc: "_Block", k: str) -> str:
    """accelerate and older Axolotl write fsdp_<name>, transformers and Axolotl <name>: whichever is there."""
    return next((n for n in ("fsdp_" + k, k) if n in fc.data), k)


def _fsdp_config(fc: "_Block | None", d: _Draft, version, version_src: str) -> None:
    """An FSDP config block (transformers' fsdp_config, accelerate's, Axolotl's): FSDP2's fully_shard,
    every block its own unit, reshard after forward."""
    if str(version) != "2":
        _fail(f"{version_src.removeprefix('assumed: ')}: FSDP version {version} (FSDP1) is not modelled; vramlab "
              "prices FSDP2's fully_shard (set the FSDP version to 2)")
    d.put("sharding", "fsdp2", version_src)
    d.put("zero_stage", 3, f"{version_src} (fully_shard shards like ZeRO-3)")
    if fc is None:
        return
    key = lambda k: _fsdp_key(fc, k)  # noqa: E731
    fc.known(key("version"))
    strategy = fc.get(key("sharding_strategy"))
    if strategy is not None and str(strategy) not in ("FULL_SHARD", "1"):
        _fail(f"{fc.name(key('sharding_strategy'))} = {checks.show(strategy)} is not modelled (FULL_SHARD only)")
    reshard = fc.get(key("reshard_after_forward"))
    if reshard is not None and str(reshard).lower() not in ("true", "full_shard"):
        _fail(f"{fc.name(key('reshard_after_forward'))} = {checks.show(reshard)} is not modelled: FSDP2 with "
              "reshard_after_forward=True only")
    for k in ("offload_params", "cpu_offload"):
        off = fc.get(key(k))
        if off is not None and str(off).lower() != "false":
            _fail(f"{fc.name(key(k))} = {checks.show(off)} is not modelled over several ranks (offload.model_offload "
                  "prices FSDP2's CPUOffloadPolicy on one GPU: vramlab offload --scheme fsdp2-cpu)")
    ac = fc.get(key("activation_checkpointing"))
    if ac is not None:
        d.put("recompute", "full" if _bool(fc.name(key("activation_checkpointing")), ac) else "none",
              fc.name(key("activation_checkpointing")))
    for k in ("auto_wrap_policy", "transformer_layer_cls_to_wrap", "backward_prefetch", "forward_prefetch",
              "cpu_ram_efficient_loading", "state_dict_type", "sync_module_states", "use_orig_params",
              "min_num_params", "limit_all_gathers", "xla", "xla_fsdp_grad_ckpt", "xla_fsdp_v2",
              "cpu_offload_pin_memory"):
        fc.known(key(k))
    fc.finish()


def _fsdp_version(fc: "_Block | None", default: int, why: str, top: tuple | None = None) -> tuple:
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


def _accelerate(data, d: _Draft, base: str):
    """accelerate's config YAML (`accelerate config`; examples/config_yaml_templates)."""
    b = _Block(data, "", "accelerate")
    kind = b.get("distributed_type", "NO")
    if kind not in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP"):
        _fail(f"distributed_type = {checks.show(kind)} is not modelled (NO, MULTI_GPU, DEEPSPEED, FSDP)")
    procs = _int("num_processes", b.get("num_processes", 1))
    machines = _int("num_machines", b.get("num_machines", 1))
    d.put("gpus", procs * machines if kind != "NO" else 1,
          "num_processes" + (" x num_machines" if b.given("num_machines") and machines > 1 else "")
          if kind != "NO" else "distributed_type NO")
    mp = b.get("mixed_precision", "no")
    if mp not in ("no", "bf16", "fp16"):
        _fail(f"mixed_precision = {checks.show(mp)} is not modelled (no, bf16, fp16; fp8 is not)")
    d.values["_half"] = (None if mp == "no" else mp, "mixed_precision" if b.given("mixed_precision")
                         else "assumed: mixed_precision default no")
    b.only("use_cpu", (False,), "training on the CPU")
    for k, why in (("fp8_config", "fp8 training"), ("megatron_lm_config", "Megatron-LM's parallelism (vramlab plan)")):
        if b.get(k) not in (None, {}):
            _fail(f"{k} is not modelled: {why}")
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
            _fail("distributed_type DEEPSPEED without deepspeed_config")
        src = d.values["_half"][1]
        ctx = {"_who": "accelerate", "bf16": (mp == "bf16", src), "fp16": (mp == "fp16", src)}
        f = dsb.get("deepspeed_config_file")
        dsb.known("zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher",
                  "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")
        if f:
            dsb.finish()
            _deepspeed(_ds_file(f, base, "deepspeed_config.deepspeed_config_file"), d, base,
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
            _deepspeed(inline, d, base, path="deepspeed_config", ctx=ctx)
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


def _axolotl(data, d: _Draft, base: str):
    """An Axolotl YAML (docs: https://docs.axolotl.ai/docs/config-reference.html; examples/)."""
    b = _Block(data, "", "axolotl")
    model = b.get("base_model")
    if b.given("sequence_len"):
        d.put("seq_len", _int("sequence_len", b.get("sequence_len")), "sequence_len"
              + (" (every micro-batch packed to it: sample_packing)" if b.get("sample_packing") else
                 " (pad_to_sequence_len)" if b.get("pad_to_sequence_len") else
                 " (the longest a micro-batch can be: assumed padded to it)"))
    d.put("micro_batch_size", _int("micro_batch_size", b.get("micro_batch_size", 1)),
          "micro_batch_size" if b.given("micro_batch_size") else "assumed: micro_batch_size default 1")
    if b.given("gradient_accumulation_steps"):
        d.put("accumulation_steps", _int("gradient_accumulation_steps", b.get("gradient_accumulation_steps")),
              "gradient_accumulation_steps")
    optim = b.get("optimizer", "adamw_torch_fused")
    if optim not in AXOLOTL_OPTIMS:
        _fail(f"optimizer = {checks.show(optim)} is not modelled; modelled: {', '.join(AXOLOTL_OPTIMS)}")
    d.put("optimizer", AXOLOTL_OPTIMS[optim][0], "optimizer" if b.given("optimizer") else
          "assumed: optimizer default adamw_torch_fused")
    d.put("optimizer_impl", AXOLOTL_OPTIMS[optim][1], d.sources["optimizer"])
    if optim.startswith("paged_"):
        d.notes.append("optimizer paged_*: bitsandbytes pages the states to the host under pressure; counted on the GPU")
    bf16, fp16 = b.get("bf16"), b.get("fp16")
    if bf16 == "auto":
        half = ("bf16", "assumed: bf16 = auto and the GPU supports bf16 (Axolotl then trains in bf16)")
    elif bf16 is not None and _bool("bf16", bf16):
        half = ("bf16", "bf16")
    elif fp16 is not None and _bool("fp16", fp16):
        half = ("fp16", "fp16")
    else:
        half = (None, "bf16 and fp16 not set")
    # Axolotl loads the model in the half dtype it trains in (torch_dtype), so the model is 16-bit throughout
    d.values["_half"] = half
    d.values["_loaded_half"] = True
    if b.given("gradient_checkpointing"):
        gc = b.get("gradient_checkpointing")
        d.put("recompute", "full" if (gc == "unsloth" or _bool("gradient_checkpointing", gc)) else "none",
              "gradient_checkpointing")
    attn = b.get("attn_implementation")
    fused = [k for k in ("flash_attention", "sdp_attention", "xformers_attention") if b.get(k)]
    if attn == "eager":
        d.put("attention", "eager", "attn_implementation")
    elif attn is not None or fused:
        d.put("attention", "sdpa", f"{'attn_implementation' if attn else fused[0]} (a fused kernel: no s x s "
              "scores kept)")
    adapter = b.get("adapter")
    in4, in8 = (_bool(k, b.get(k, False)) for k in ("load_in_4bit", "load_in_8bit"))
    if adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or in4 else "lora-int8" if in8 else "lora"
        if adapter == "qlora" and not in4:
            _fail("adapter = qlora needs load_in_4bit: true")
        d.put("method", method, "adapter" + (" + load_in_4bit" if in4 else " + load_in_8bit" if in8 else ""))
        d.put("lora_rank", _int("lora_r", b.get("lora_r", 8)), "lora_r" if b.given("lora_r") else
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
        _fail(f"adapter = {checks.show(adapter)} is not modelled (lora, qlora)")
    elif in4 or in8:
        _fail("load_in_4bit / load_in_8bit without an adapter is not modelled (a quantized base needs lora or qlora)")
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
            _fail("adapter with deepspeed is not modelled: compression.peft_training prices LoRA on one GPU")
        ctx = {half[0]: (True, half[1])} if half[0] else {}
        ctx["_who"] = "axolotl"
        ctx["batch"] = (d.values["micro_batch_size"], d.sources["micro_batch_size"])
        if d.has("accumulation_steps"):
            ctx["accumulation"] = (d.values["accumulation_steps"], d.sources["accumulation_steps"])
        _deepspeed(_ds_file(ds, base, "deepspeed"), d, base, path="deepspeed", ctx=ctx)
    if fsdp or fc is not None:
        if adapter:
            _fail("adapter with fsdp is not modelled: compression.peft_training prices LoRA on one GPU")
        _fsdp_config(fc, d, *_fsdp_version(fc, 1, "Axolotl's default FSDP version 1",
                                           top=(b.get("fsdp_version"), "fsdp_version")))
    b.known("fsdp_version")
    b.finish()
    return (model, "base_model") if model else None


# ----------------------------------------------------------------------------- torchtune

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


def _torchtune(data, d: _Draft, base: str):
    """A torchtune recipe config (recipes/configs/*.yaml): the single-device recipes, or the distributed
    ones (FSDP2 over the ranks `tune run --nproc_per_node` starts: give gpus=)."""
    b = _Block(data, "", "torchtune")
    m = b.block("model")
    comp = str(m.get("_component_"))
    last = comp.rsplit(".", 1)[-1]
    if last.startswith(("lora_", "qlora_")):
        d.put("method", "qlora" if last.startswith("qlora_") else "lora", "model._component_")
        d.put("lora_rank", _int("model.lora_rank", m.get("lora_rank", 8)), "model.lora_rank")
        mods = m.get("lora_attn_modules", [])
        bad = [x for x in mods if x not in _TUNE_LORA_NAMES]
        if bad:
            _fail(f"model.lora_attn_modules: {bad[0]!r} is not a torchtune attention projection")
        t = [_TUNE_LORA_NAMES[x] for x in mods]
        if _bool("model.apply_lora_to_mlp", m.get("apply_lora_to_mlp", False)):
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
        d.put("seq_len", _int("tokenizer.max_seq_len", tok.get("max_seq_len")), "tokenizer.max_seq_len")
    if tok is not None:
        tok.seen.update(tok.data)
    d.put("micro_batch_size", _int("batch_size", b.get("batch_size", 1)), "batch_size")
    if b.given("gradient_accumulation_steps"):
        d.put("accumulation_steps", _int("gradient_accumulation_steps", b.get("gradient_accumulation_steps")),
              "gradient_accumulation_steps")
    dt = b.get("dtype", "fp32")
    if dt not in ("bf16", "fp32"):
        _fail(f"dtype = {checks.show(dt)} is not modelled (bf16, fp32)")
    d.put("precision", "bf16" if dt == "bf16" else "fp32", "dtype (torchtune trains the whole model in it: "
          "parameters, gradients and optimizer states)")
    opt = b.block("optimizer")
    if opt is not None:
        oc = opt.get("_component_", "")
        kinds = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd",
                 "bitsandbytes.optim.PagedAdamW8bit": "adamw-8bit", "bitsandbytes.optim.AdamW8bit": "adamw-8bit"}
        if oc not in kinds:
            _fail(f"optimizer._component_ = {checks.show(oc)} is not modelled; modelled: {', '.join(kinds)}")
        d.put("optimizer", kinds[oc], "optimizer._component_")
        fused, foreach = opt.get("fused"), opt.get("foreach")
        if fused is not None and _bool("optimizer.fused", fused):
            d.put("optimizer_impl", "fused", "optimizer.fused")
        elif foreach is not None and not _bool("optimizer.foreach", foreach):
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
            _fail(f"loss._component_ = {checks.show(lc)} is not modelled; modelled: {', '.join(kinds)}")
        loss.known("num_output_chunks")
        loss.finish()
        d.put("loss", kinds[lc], "loss._component_ (torchtune's chunked cross-entropy: memory.TORCHTUNE_CHUNKS)")
    if b.given("enable_activation_checkpointing"):
        d.put("recompute", "full" if _bool("enable_activation_checkpointing", b.get("enable_activation_checkpointing"))
              else "none", "enable_activation_checkpointing")
    b.only("enable_activation_offloading", (False,), "activation offloading (vramlab offload --scheme save-on-cpu)")
    b.only("compile", (False,), "torch.compile changes which activations are saved")
    b.only("optimizer_in_bwd", (False,), "the optimizer step fused into the backward")
    b.only("fsdp_cpu_offload", (False,), "FSDP2's CPU offload over several ranks")
    b.only("tensor_parallel_dim", (1,), "tensor parallelism (vramlab plan)")
    b.known("fsdp_reshard_after_forward", "data_parallel_shard_dim", "data_parallel_replicate_dim",
            "memory_efficient_fsdp_wrap")
    if b.get("fsdp_reshard_after_forward") is False:
        _fail("fsdp_reshard_after_forward = False is not modelled: FSDP2 with reshard_after_forward=True only")
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

def _torchtitan(data, d: _Draft, base: str):
    """A torchtitan train config (torchtitan/models/*/train_configs/*.toml): FSDP2 over
    data_parallel_shard_degree ranks, mixed_precision_param bf16 with fp32 sharded parameters."""
    b = _Block(data, "", "torchtitan")
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
            _fail(f"optimizer.name = {checks.show(name)} is not modelled (AdamW, Adam)")
        d.put("optimizer", "adamw", "optimizer.name")
        impl = opt.get("implementation", "fused")
        if impl not in ("fused", "foreach", "for-loop"):
            _fail(f"optimizer.implementation = {checks.show(impl)} is not modelled")
        d.put("optimizer_impl", impl, "optimizer.implementation" if opt.given("implementation")
              else "assumed: torchtitan's default implementation fused")
        opt.known("lr", "eps", "beta1", "beta2", "weight_decay", "early_step_in_backward")
        opt.finish()
    t = b.block("training")
    if t is None:
        _fail("a torchtitan config needs its [training] section (batch size, seq_len)")
    for key in ("local_batch_size", "batch_size"):
        if t.get(key) is not None:
            d.put("micro_batch_size", _int(f"training.{key}", t.get(key)), f"training.{key}")
            break
    if t.get("global_batch_size") not in (None, -1):
        d.values["_global_batch"] = (_int("training.global_batch_size", t.get("global_batch_size")),
                                     "training.global_batch_size")
    if t.get("seq_len") is not None:
        d.put("seq_len", _int("training.seq_len", t.get("seq_len")), "training.seq_len")
    mpp = t.get("mixed_precision_param", "bfloat16")
    if mpp not in ("bfloat16", "float32"):
        _fail(f"training.mixed_precision_param = {checks.show(mpp)} is not modelled (bfloat16, float32)")
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
            _fail("parallelism.fsdp_reshard_after_forward other than default/always is not modelled")
        p.finish()
    if shard != -1:
        d.put("gpus", _int("parallelism.data_parallel_shard_degree", shard), "parallelism.data_parallel_shard_degree")
    else:
        d.values["_gpus_from_launcher"] = "parallelism.data_parallel_shard_degree = -1 (every rank torchrun starts)"
    d.put("sharding", "fsdp2", "torchtitan shards with FSDP2's fully_shard")
    d.put("zero_stage", 3, "torchtitan: fully_shard shards like ZeRO-3")
    ac = b.block("activation_checkpoint")
    if ac is not None:
        mode = ac.get("mode", "selective")
        if mode not in ("none", "full"):
            _fail(f"activation_checkpoint.mode = {checks.show(mode)} is not modelled with FSDP2 "
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


_READERS = {"deepspeed": _read_deepspeed, "trainer": _trainer, "accelerate": _accelerate, "axolotl": _axolotl,
            "torchtune": _torchtune, "torchtitan": _torchtitan}


# ----------------------------------------------------------------------------- the settings, together

def _precision(d: _Draft, fmt: str, ref: ModelRef) -> None:
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


def _finish(d: _Draft, fmt: str, ref: ModelRef) -> Setup:
    spec = ref.spec
    v, s = d.values, d.sources
    s["model"] = f"{s['model']}: {ref.where}"
    if not d.has("seq_len"):
        _fail(f"this {FORMAT_NAMES[fmt]} does not say the sequence length: give it (--seq-len / seq_len=)")
    if not d.has("micro_batch_size"):
        _fail(f"this {FORMAT_NAMES[fmt]} does not say the micro-batch: give it (--batch-size / batch_size=)")
    if not d.has("gpus"):
        if "_train_batch_size" in v:  # DeepSpeed: train_batch_size = micro x accumulation x ranks
            tbs, src = v["_train_batch_size"]
            per = v["micro_batch_size"] * v.get("accumulation_steps", 1)
            if tbs % per:
                _fail(f"{src} = {tbs} is not micro-batch x accumulation ({per}) x ranks")
            d.put("gpus", tbs // per, f"{src} / (micro-batch x gradient_accumulation_steps)")
        elif "_global_batch" in v:
            gb, src = v["_global_batch"]
            per = v["micro_batch_size"] * v.get("accumulation_steps", 1)
            if gb % per:
                _fail(f"{src} = {gb} is not local_batch_size x ranks")
            d.put("gpus", gb // per, f"{src} / training.local_batch_size")
        elif "_gpus_from_launcher" in v:
            _fail(f"{v['_gpus_from_launcher']}: give the number of ranks (--gpus / gpus=)")
        else:
            d.default("gpus", 1, "the launcher's world size is not in the file: one rank (give --gpus)")
    if "_train_batch_size" in v:  # DeepSpeed asserts train_batch_size = micro-batch x accumulation x ranks
        tbs, src = v["_train_batch_size"]
        want = v["micro_batch_size"] * v.get("accumulation_steps", 1) * v["gpus"]
        if tbs != want:
            _fail(f"{src} = {tbs} but micro-batch x accumulation x ranks = {v['micro_batch_size']} x "
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
            _fail(f"{s['precision']}: pure {prec} parameters under {sharding} are not a modelled recipe "
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
        _fail(f"{s['method']}: LoRA under {sharding} is not modelled (compression.peft_training prices one GPU)")
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
            _fail(f"{s['optimizer']}: not modelled")
    off_o, off_p = v.get("offload_optimizer", "none"), v.get("offload_param", "none")
    if sharding == "deepspeed":
        if v.get("recompute", "none") != "none":
            _fail(f"{s['recompute']} with DeepSpeed is not modelled: zero.rank_phases models recompute under FSDP2 "
                  "only (the DeepSpeed phases were measured without it); turn it off to price the rest")
        if v.get("optimizer", "adamw") not in ("adam", "adamw"):
            _fail(f"{s['optimizer']}: ZeRO ranks are estimated with Adam(W) only")
        v.setdefault("optimizer_impl", "fused")
        s.setdefault("optimizer_impl", "assumed: DeepSpeed's FusedAdam (one flat partition tensor)")
        if off_p != "none" or off_o == "nvme":
            _fail(f"{s.get('offload_param') if off_p != 'none' else s['offload_optimizer']}: parameter and NVMe offload "
                  "are priced by offload.infinity on one GPU (vramlab offload), not per rank here")
        if off_o == "cpu":
            if v["gpus"] != 1 or v["zero_stage"] not in (1, 2) or v["recipe"] != "mixed-adam" or \
                    v["precision"] != "bf16-mixed":
                _fail(f"{s['offload_optimizer']}: CPU optimizer offload is priced for one GPU, ZeRO-1/2, bf16 "
                      "(offload.model_offload, measured so); this setup has "
                      f"{v['gpus']} rank(s), stage {v['zero_stage']}, {v['precision']}")
            d.notes.append("ZeRO-Offload: host memory (16 bytes a parameter) is not GPU memory and not in this estimate")
            if v.get("accumulation_steps", 1) > 1:
                d.notes.append(f"{s['accumulation_steps']}: offload.model_offload prices one micro-batch a step")
    elif sharding == "fsdp2":
        if spec.is_moe:
            _fail("a mixture of experts under FSDP2 is not modelled (vramlab experts)")
        if v.get("optimizer", "adamw") not in ("adam", "adamw"):
            _fail(f"{s['optimizer']}: FSDP2 ranks are estimated with Adam(W) only")
        v.setdefault("optimizer_impl", "fused")
        s.setdefault("optimizer_impl", "assumed: fused AdamW")
        if v.get("recompute", "none") not in ("none", "full"):
            _fail(f"{s['recompute']}: only full recompute is modelled under FSDP2")
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
