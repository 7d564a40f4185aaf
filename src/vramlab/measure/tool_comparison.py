"""How the memory estimators practitioners use compare with vramlab on the same measured runs.

Every tool is asked about each stored H100 training run (benchmarks/results/h100/, provenance in
its README: one process per run, AdamW, one warm step, then the allocator's
`max_memory_allocated()` over one measured step) and its answer is set against that peak:

- accelerate's `accelerate estimate-memory` (accelerate/commands/estimate.py): its own
  `gather_data` runs on a local `config.json` written from the run's model (its one Hub call,
  `verify_on_hub`, is replaced by the local config; nothing is fetched). It builds `AutoModel` on
  the meta device, sums every parameter and buffer in fp32 (`calculate_maximum_sizes`), and its
  "Training using Adam" column is the LARGEST of its components (`estimate_training_usage`), not
  their sum: 4 x the fp32 size for float32 (the `step` term), 2 x the fp32 size for float16 (its
  mixed-precision branch). Runs in fp32 read its float32 row, the others its float16 row.
- DeepSpeed's model-state estimators, called live: `estimate_zero2_model_states_mem_needs`
  (deepspeed/runtime/zero/stage_1_and_2.py) and `estimate_zero3_model_states_mem_needs`
  (stage3.py), the functions behind `..._all_cold` / `..._all_live`, for one GPU on one node
  without offload: 2 + 18 bytes per parameter (ZeRO-2), plus 4 x the largest layer (ZeRO-3).
- The Ultra-Scale Playbook's memory widget (Hugging Face Space nanotron/ultrascale-playbook,
  `src/memory.js`: `activationMemory` after Korthikanti et al. 2022, arXiv:2205.05198, and
  `paramGradsOpt`), re-implemented line for line in `playbook_widget`.
- The rule of thumb "weights x 4 + 20 %": parameters x the model's bytes per parameter x 4 (1 x
  weights, 1 x gradients, 2 x Adam) x 1.2 (forward-pass overhead), as H. Husain writes it for full
  fine-tuning in "Estimating vRAM" (https://hamel.dev/notes/llm/finetuning/03_estimating_vram.html).
- vramlab's `memory.estimate_training` (device="cuda", gpu="h100"), the call chapter 1 makes.

`compare(select_runs()[0])` returns one entry per run; `python -m vramlab.measure.tool_comparison`
writes benchmarks/results/tool_comparison/cpu.json (no GPU needed: the measurements are stored).

Known limitations: only single-GPU AdamW runs of decoder or encoder stacks are compared (see
`select_runs`); the tools other than vramlab are asked the question as their documentation poses
it, and their answers are compared with `max_memory_allocated`, not with what the device reports
(which adds the CUDA context and the allocator's cache: the `peak_reserved` and `device_in_use`
kept beside each run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import statistics
import tempfile
import types
from functools import cache
from pathlib import Path
from typing import Any

from .. import checks
from ..specs import ModelSpec, preset

PROG = "python -m vramlab.measure.tool_comparison"
ROOT = Path(__file__).resolve().parents[3]
H100 = ROOT / "benchmarks" / "results" / "h100"
OUT = ROOT / "benchmarks" / "results" / "tool_comparison" / "cpu.json"
SOURCES = ("presets_train_h100.jsonl", "benchmark_cases_h100.jsonl")
MAX_PARAMS = 10**15  # parameters: beyond any model (checks.whole defaults to 2**31)
TOOLS = ("vramlab", "accelerate", "deepspeed_zero2", "deepspeed_zero3", "playbook", "rule_of_thumb")

# What each tool's number does not contain (the reader's "why is it under/over").
LEAVES_OUT: dict[str, list[str]] = {
    "vramlab": ["the CUDA context and library handles (outside max_memory_allocated)",
                "the allocator's cache and fragmentation (reserved - allocated)"],
    "accelerate": ["activations", "the logits and the loss", "temporaries (optimizer step, cuBLAS workspaces)",
                   "the task head when it is not tied (it builds AutoModel, the bare backbone)",
                   "the sum: it reports the largest single component (4 x fp32 size in fp32, 2 x in mixed)",
                   "the CUDA context and the allocator's cache"],
    "deepspeed_zero2": ["activations", "the logits and the loss", "temporaries and the optimizer step's scratch",
                        "the real precision: it assumes 16-bit weights and gradients plus fp32 master weights",
                        "the CUDA context and the allocator's cache"],
    "deepspeed_zero3": ["activations", "the logits and the loss", "temporaries and the optimizer step's scratch",
                        "the real precision: it assumes 16-bit weights and gradients plus fp32 master weights",
                        "the CUDA context and the allocator's cache"],
    "playbook": ["the model's real parameter count (GPT formula h(v+s) + L(12h^2+13h) + 2h)",
                 "SDPA/FlashAttention (it keeps the s x s attention scores)",
                 "the backward pass's and the optimizer step's temporaries, cuBLAS workspaces",
                 "the fp32 gradients of mixed precision; master weights counted even in pure bf16",
                 "the CUDA context and the allocator's cache"],
    "rule_of_thumb": ["activations beyond a flat 20 %: batch size and sequence length do not enter",
                      "the logits", "mixed precision's extra copies", "the CUDA context and the allocator's cache"],
}

SOURCE_OF: dict[str, str] = {
    "vramlab": "vramlab.memory.estimate_training(spec, device='cuda', gpu='h100', ...)",
    "accelerate": "accelerate.commands.estimate.gather_data (accelerate estimate-memory), local config.json",
    "deepspeed_zero2": "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs"
                       "(P, 1, 1, cpu_offload=False)",
    "deepspeed_zero3": "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs(P, largest_layer, 1, 1,"
                       " cpu_offload=False, cpu_offload_params=False)",
    "playbook": "nanotron/ultrascale-playbook src/memory.js activationMemory + paramGradsOpt (re-implemented)",
    "rule_of_thumb": "P x bytes/param x 4 x 1.2 (H. Husain, 'Estimating vRAM', hamel.dev)",
}


# ----------------------------------------------------------------------------------- the runs --

def parse_case(case: str) -> tuple[str, dict[str, int], dict[str, Any]]:
    """A stored case name -> (preset, spec overrides, estimate_training options). Two forms:
    'llama-3.2-1b[num_layers=3] b=2 s=512 precision=bf16-mixed' (benchmark cases) and
    'gpt2 b=8 s=1024 bf16-mixed recompute=none attention=sdpa' (presets)."""
    head, *rest = checks.text("case", case).split()
    m = re.fullmatch(r"([\w.\-]+)(?:\[(.*)\])?", head)
    if not m:
        raise ValueError(f"case {case!r}: expected 'preset[key=value,...] b=N s=N ...'")
    over = {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split(","))} if m.group(2) else {}
    opts: dict[str, Any] = {"precision": "fp32"}
    for tok in rest:
        if "=" not in tok:
            opts["precision"] = tok
            continue
        k, v = tok.split("=", 1)
        k = {"b": "batch_size", "s": "seq_len"}.get(k, k)
        opts[k] = int(v) if k in ("batch_size", "seq_len") else v
    return m.group(1), over, opts


def _rows(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines() if line.strip()]


def select_runs(folder: Path | str = H100) -> tuple[list[dict], list[dict]]:
    """The stored H100 training runs every tool can be asked about, and those left out with why.

    Kept: every row of presets_train_h100.jsonl and benchmark_cases_h100.jsonl that trains a
    decoder or encoder stack with Adam(W) on one GPU. Left out: T5/mT5 (encoder-decoder: the
    Playbook widget models one stack, and those rows were measured under an older transformers
    whose T5 attention vramlab does not model), non-Adam optimizers (accelerate, DeepSpeed and the
    rule of thumb all assume Adam), and the expandable-segments repeat of a configuration (the
    allocator setting changes reserved bytes, not allocated ones).

    The labs' stored runs (labs/results/) are not used: lab 1's training rows repeat an H100-set
    configuration (GPT-2 b=4 s=512 fp32, the same bytes) or do not record the model's shape (its
    Llama row has 505,956,352 parameters, a shrunk llama-3.2-1b whose overrides the file omits), and
    the other labs measure multi-rank, offload or compression setups none of these tools models."""
    folder = Path(folder)
    kept, left = [], []
    for src in SOURCES:
        for r in _rows(folder, src):
            case = r["case"]
            name, over, opts = parse_case(case)
            spec = preset(name)
            why = ""
            if r.get("alloc_conf"):
                why = f"a repeat under PYTORCH_CUDA_ALLOC_CONF={r['alloc_conf']} (same allocated bytes)"
            elif spec.family == "t5":
                why = "encoder-decoder (T5/mT5): the Playbook widget models one stack; measured under transformers 5.17"
            elif opts.get("optimizer", "adamw") not in ("adam", "adamw"):
                why = f"optimizer {opts['optimizer']}: accelerate, DeepSpeed and the rule of thumb assume Adam"
            rid = f"{src.split('_h100')[0]}: {case}" + (f" ({r['alloc_conf']})" if r.get("alloc_conf") else "")
            run = {"run": rid, "source": f"benchmarks/results/h100/{src}",
                   "model": name, "overrides": over, "options": opts,
                   "measured": {k: r[k] for k in ("peak_allocated", "peak_reserved", "device_in_use") if k in r}}
            if "params" in r:
                run["params_measured"] = r["params"]
            (left if why else kept).append({**run, "reason": why} if why else run)
    return kept, left


def run_spec(run: dict) -> ModelSpec:
    return dataclasses.replace(preset(run["model"]), **run["overrides"])


# ---------------------------------------------------------------------------------- the tools --

def rule_of_thumb(params: int, precision: str) -> dict[str, Any]:
    """'Weights x 4 + 20 %': params x bytes/param x 4 x 1.2, in bytes. The bytes per parameter are
    those the model is held in: 4 for fp32 and for PyTorch AMP (bf16-/fp16-mixed keep an fp32
    model), 2 for pure bf16. Source: H. Husain, "Estimating vRAM" (hamel.dev), full fine-tuning
    (trainable = all parameters): 4x = 1x model + 1x gradients + 2x Adam, 1.2x = forward overhead."""
    params = checks.whole("params", params, hi=MAX_PARAMS)
    precision = checks.one_of("precision", precision, ("fp32", "bf16-mixed", "fp16-mixed", "bf16"))
    per = 2 if precision == "bf16" else 4
    return {"bytes": params * per * 4 * 12 // 10, "bytes_per_param": per}


def _ff_activation(spec: ModelSpec) -> str:
    if spec.gated_mlp:
        return "swiglu"
    if "gelu" in spec.activation:
        return "gelu"
    if spec.activation == "relu":
        return "relu"
    raise ValueError(f"activation {spec.activation!r}: the Playbook widget knows relu, gelu and swiglu")


def playbook_widget(*, a: int, b: int, h: int, h_ff: int, L: int, s: int, v: int, k: int = 8, mixed: bool = True,
                    recomputation: str = "none", ff_activation: str = "relu") -> dict[str, int]:
    """The Ultra-Scale Playbook widget's memory, in bytes, as its `src/memory.js` computes it
    (tp = dp = 1, zero = 0, no sequence parallelism): `activationMemory` (Korthikanti+22 eq. 2 per
    layer: attention s b h (5 bpv + 1) + (2 bpv + 1) a s^2 b; the MLP's inputs; two LayerNorms; the
    input dropout, final LayerNorm, projection and an fp32 cross-entropy s b v 4) and
    `paramGradsOpt` (n = h(v + s) + L(12h^2 + 13h) + 2h; bpv = 2 mixed else 4; k = 8 (+4 mixed)).
    a heads, b micro-batch, h hidden, h_ff MLP width, L layers, s tokens, v vocabulary."""
    for name, val in dict(a=a, b=b, h=h, h_ff=h_ff, L=L, s=s, v=v, k=k).items():
        checks.whole(name, val)
    mixed = checks.flag("mixed", mixed)
    recomputation = checks.one_of("recomputation", recomputation, ("none", "selective", "full"))
    ff_activation = checks.one_of("ff_activation", ff_activation, ("relu", "gelu", "swiglu"))
    bpv = 2 if mixed else 4  # bytesPerValue
    if recomputation in ("none", "full"):
        attention = s * b * h * (bpv * 4 + bpv + 1) + (2 * bpv + 1) * a * s * s * b  # eq (2), tp = 1
    else:
        attention = s * b * h * (bpv * 4 + bpv + 1)  # table 2
    ff = s * b * h * bpv + s * b * h_ff * bpv + s * b * h  # inputs of both linears + dropout mask
    if ff_activation == "gelu":
        ff += s * b * h_ff * bpv  # the activation's input
    elif ff_activation == "swiglu":
        ff += s * b * h_ff * bpv * 3
    layer_norm = s * b * h * bpv
    tail = s * b * h + s * b * h * bpv + s * b * h * bpv + s * b * v * 4  # dropout, LN, projection, CE (fp32)
    if recomputation == "full":
        activations = s * b * h * bpv * L + tail  # LayerInput
    else:
        activations = L * (attention + ff + 2 * layer_norm) + tail
    n = h * (v + s) + L * (12 * h ** 2 + 13 * h) + 2 * h
    k_eff = k + 4 if mixed else k
    bpp = 2 if mixed else 4
    return {"parameters": bpp * n, "gradients": bpp * n, "optimizer_states": k_eff * n,
            "activations": activations, "params_counted": n}


def playbook_for(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: str,
                 recompute: str = "none") -> dict[str, Any]:
    """The widget's inputs for one run (its sliders: a, b, h, h_ff, L, s, v; mixed unless fp32;
    recomputation none/full) and its total; raises ValueError for what the widget cannot express."""
    if spec.family in ("t5", "moe"):
        raise ValueError(f"{spec.family}: the widget models one dense transformer stack")
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute={recompute!r}: the widget offers none, selective (attention) and full")
    inputs = dict(a=spec.num_heads, b=batch_size, h=spec.hidden_size, h_ff=spec.intermediate_size, L=spec.num_layers,
                  s=seq_len, v=spec.vocab_size, mixed=precision != "fp32", recomputation=recompute,
                  ff_activation=_ff_activation(spec))
    parts = playbook_widget(**inputs)
    total = sum(v for k, v in parts.items() if k != "params_counted")
    return {"bytes": total, "inputs": inputs, "breakdown": parts}


def deepspeed_model_states(total_params: int, largest_layer_params: int) -> dict[str, int]:
    """DeepSpeed's own estimators, called live, for one GPU on one node without offload (what a
    single-GPU run is): GPU bytes of ZeRO-2 (2 P + 18 P) and ZeRO-3 (4 x largest layer + 18 P)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total_params = checks.whole("total_params", total_params, hi=MAX_PARAMS)
    largest_layer_params = checks.whole("largest_layer_params", largest_layer_params, hi=MAX_PARAMS)
    _, z2 = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1,
                                                     num_nodes=1, cpu_offload=False, cpu_offload_params=False)
    return {"zero2": int(z2), "zero3": int(z3)}


@cache
def model_counts(spec: ModelSpec) -> dict[str, int]:
    """The trained model's parameters (the course's head, built on the meta device) and its largest
    layer as DeepSpeed's `stage3.model_to_params` finds it. The total is counted by parameter
    identity: DeepSpeed's own count deduplicates by `data_ptr()`, which is 0 for every meta tensor."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    from .models import build_model, count_parameters

    model = build_model(spec, device="meta")
    _, largest = model_to_params(model)
    return {"params": count_parameters(model), "largest_layer_params": int(largest)}


@cache
def accelerate_rows(spec: ModelSpec) -> dict[str, dict[str, Any]]:
    """accelerate's `estimate-memory` table for `spec`, by its own `gather_data`, keyed by dtype
    (float32, float16): largest layer, total size and the training column (`max` of
    `estimate_training_usage`'s components, as `estimate_command` prints it), in bytes. The model
    comes from a local config.json (written from `spec`); the Hub lookup is replaced."""
    from unittest import mock

    from accelerate.commands import estimate

    from .models import hf_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = hf_config(spec)
        cfg.save_pretrained(tmp)
        local = {"config": json.loads((Path(tmp) / "config.json").read_text()), "library_name": "transformers"}

        def verify_local(repo, token=None):  # replaces accelerate's only Hub call (huggingface_hub.model_info)
            if repo != tmp:
                raise AssertionError(f"accelerate asked the Hub about {repo!r}")
            return types.SimpleNamespace(**local)

        args = types.SimpleNamespace(model_name=tmp, library_name="transformers", trust_remote_code=False,
                                     dtypes=["float32", "float16"])
        with mock.patch.object(estimate, "verify_on_hub", verify_local), contextlib.redirect_stdout(io.StringIO()):
            data = estimate.gather_data(args)
    out = {}
    for dtype, largest, total, training in data:
        train = max(training.values())
        out[dtype] = {"largest_layer": int(largest), "total_size": int(total),
                      "training": None if train == -1 else int(train), "components": dict(training)}
    return out


def _vramlab(spec: ModelSpec, opts: dict) -> int:
    from ..memory import estimate_training

    return estimate_training(spec, device="cuda", gpu="h100", **opts).total


# -------------------------------------------------------------------------------- comparison --

def signed_error(estimate: int | None, measured: int) -> float | None:
    """(estimate - measured) / measured: positive over, negative under; None when no estimate."""
    return None if estimate is None else (estimate - measured) / measured


def _answer(value: int | None, measured: int, tool: str, *, reason: str = "", **extra) -> dict[str, Any]:
    ans = {"bytes": value, "error": signed_error(value, measured), "leaves_out": LEAVES_OUT[tool]}
    if reason:
        ans["reason"] = reason
    return {**ans, **extra}


def compare_run(run: dict) -> dict[str, Any]:
    """Every tool's answer for one stored run, with its signed error against `peak_allocated`."""
    spec = run_spec(run)
    opts = dict(run["options"])
    measured = run["measured"]["peak_allocated"]
    precision = opts["precision"]
    counts = model_counts(spec)
    tools: dict[str, Any] = {}
    tools["vramlab"] = _answer(_vramlab(spec, opts), measured, "vramlab")
    acc_dtype = "float32" if precision == "fp32" else "float16"
    acc = accelerate_rows(spec)[acc_dtype]
    tools["accelerate"] = _answer(acc["training"], measured, "accelerate", dtype_row=acc_dtype,
                                  total_size=acc["total_size"], components=acc["components"],
                                  note=f"counts {acc['total_size'] // (4 if acc_dtype == 'float32' else 2):,} elements "
                                       f"(AutoModel's parameters and buffers) vs {counts['params']:,} trained")
    ds = deepspeed_model_states(counts["params"], counts["largest_layer_params"])
    tools["deepspeed_zero2"] = _answer(ds["zero2"], measured, "deepspeed_zero2")
    tools["deepspeed_zero3"] = _answer(ds["zero3"], measured, "deepspeed_zero3",
                                       largest_layer_params=counts["largest_layer_params"])
    try:
        pb = playbook_for(spec, batch_size=opts["batch_size"], seq_len=opts["seq_len"], precision=precision,
                          recompute=opts.get("recompute", "none"))
        tools["playbook"] = _answer(pb["bytes"], measured, "playbook", inputs=pb["inputs"],
                                    params_counted=pb["breakdown"]["params_counted"])
    except ValueError as e:
        tools["playbook"] = _answer(None, measured, "playbook", reason=str(e))
    rt = rule_of_thumb(counts["params"], precision)
    tools["rule_of_thumb"] = _answer(rt["bytes"], measured, "rule_of_thumb", bytes_per_param=rt["bytes_per_param"])
    return {**{k: run[k] for k in ("run", "source", "model", "overrides", "options", "measured")},
            "params": counts["params"], "tools": tools}


def compare(rows: list[dict]) -> list[dict]:
    """One entry per run (from `select_runs`): run id, measured bytes, every tool's bytes, signed
    error and what it leaves out (None and a reason where a tool cannot answer)."""
    return [compare_run(r) for r in rows]


def summarize(entries: list[dict]) -> dict[str, dict[str, Any]]:
    """Per tool: runs answered, median |error| and the worst (largest |error|, signed) error."""
    out = {}
    for tool in TOOLS:
        errs = [(e["tools"][tool]["error"], e["run"]) for e in entries if e["tools"][tool]["error"] is not None]
        if not errs:
            out[tool] = {"answered": 0, "median_abs_error": None, "worst_error": None, "worst_run": None}
            continue
        worst = max(errs, key=lambda x: abs(x[0]))
        out[tool] = {"answered": len(errs), "median_abs_error": statistics.median(abs(x) for x, _ in errs),
                     "worst_error": worst[0], "worst_run": worst[1]}
    return out


def versions() -> dict[str, str]:
    import accelerate
    import deepspeed
    import torch
    import transformers

    return {"accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"the results JSON (default {OUT.relative_to(ROOT)})")
    a = ap.parse_args(argv)
    checks.output_path(PROG, a.out, make_folder=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .record import provenance

    kept, left = select_runs()
    entries = []
    for run in kept:
        e = compare_run(run)
        entries.append(e)
        cells = "  ".join(f"{t} {100 * e['tools'][t]['error']:+.1f}%" if e["tools"][t]["error"] is not None
                          else f"{t} n/a" for t in TOOLS)
        print(f"{e['run']}: measured {e['measured']['peak_allocated'] / 2**30:.2f} GiB  {cells}", flush=True)
    res = {"what": "memory estimators vs the H100 allocator peak (max_memory_allocated), same runs",
           "measured_provenance": json.loads((H100 / "provenance.json").read_text()),
           "provenance": provenance("cpu"), "versions": versions(),
           "command": f"{PROG}" + (" " + " ".join(argv) if argv else ""),
           "tools": {t: {"source": SOURCE_OF[t], "leaves_out": LEAVES_OUT[t]} for t in TOOLS},
           "left_out": [{"run": r["run"], "reason": r["reason"]} for r in left],
           "summary": summarize(entries), "runs": entries}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
