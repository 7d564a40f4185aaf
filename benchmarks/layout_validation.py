"""Per-rank memory of data, tensor and pipeline parallelism, measured on real gloo CPU ranks, on models
other than lab 3's: the ground truth for `vramlab.parallel`'s layout estimate.

Each case runs `python -m vramlab.measure.parallel ...` in its own processes (one per rank) and stores that run's
JSON, with provenance and the exact command, in benchmarks/results/parallel/validation/<case>.json.
The measurement is parlab's ledger (`memory` in every rank's record: the peak over one steady-state
step, its phase, the peak of each phase, bytes by category at those points, the largest storages);
see `vramlab.measure.parallel`. After each run the file is checked against counts made here from the config
alone (parameter bytes of each rank's shard, gradients = parameters, AdamW's two moments, DDP's
buckets, the bytes each pipeline stage sends, micro-batches in flight), and the checks are stored with
it ("checks"):

    python benchmarks/layout_validation.py                 # the whole sweep (~20 min on 2 CPU cores)
    python benchmarks/layout_validation.py --only tp_neox_t2,pp_neox_p4
    python benchmarks/layout_validation.py --list
    python benchmarks/layout_validation.py --check         # re-check the stored files, run nothing
    python benchmarks/layout_validation.py --summary       # Markdown tables of the stored files

Progress goes to stderr; the exit status is 1 when a run fails or a check does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "parallel" / "validation"
FOR_LOOP = ["--optimizer-impl", "for-loop"]  # AdamW one parameter at a time (foreach=False)
PP = ["--schedule", "gpipe,1f1b,interleaved", "--micro-batches", "4,8", "--chunks", "2", "--repeats", "2"]

# name -> (experiment, arguments). Every case: micro-batch 4 x 128 tokens (parlab's default), fp32 unless
# it says bf16, AdamW foreach=False, gradients kept between steps.
CASES: dict[str, tuple[str, list[str]]] = {
    # data parallelism, dp = 2: DDP's buckets a second copy of the gradients, or the gradients themselves
    "ddp_opt_dp2": ("ddp", ["--model", "opt-val"]),
    "ddp_opt_dp2_view": ("ddp", ["--model", "opt-val", "--gradient-as-bucket-view"]),
    "ddp_neox_dp2": ("ddp", ["--model", "neox-val"]),
    "ddp_neox_dp2_view": ("ddp", ["--model", "neox-val", "--gradient-as-bucket-view"]),
    "ddp_neox_dp2_bf16": ("ddp", ["--model", "neox-val", "--precision", "bf16"]),
    # tensor parallelism, t = 2, three families; one in bf16 autocast
    "tp_opt_t2": ("tp", ["--model", "opt-val"]),
    "tp_neox_t2": ("tp", ["--model", "neox-val"]),
    "tp_llamagqa_t2": ("tp", ["--model", "llama-gqa-val"]),
    "tp_llamagqa_t2_bf16": ("tp", ["--model", "llama-gqa-val", "--precision", "bf16"]),
    # sequence parallelism and recomputation
    "tp_llamagqa_t2_sp": ("tp", ["--model", "llama-gqa-val", "--sp"]),
    "tp_llamagqa_t2_selective": ("tp", ["--model", "llama-gqa-val", "--recompute", "selective"]),
    "tp_llamagqa_t2_full": ("tp", ["--model", "llama-gqa-val", "--recompute", "full"]),
    "tp_llamagqa_t2_sp_selective": ("tp", ["--model", "llama-gqa-val", "--sp", "--recompute", "selective"]),
    "tp_neox_t2_sp": ("tp", ["--model", "neox-val", "--sp"]),
    "tp_neox_t2_selective": ("tp", ["--model", "neox-val", "--recompute", "selective"]),
    "tp_neox_t2_full": ("tp", ["--model", "neox-val", "--recompute", "full"]),
    # t = 4 (8 heads, vocabulary 4096 and MLP 1024 divide by 4; llama-gqa-val's 2 key-value heads do not)
    "tp_neox_t4": ("tp", ["--model", "neox-val", "--nproc", "4"]),
    # pipeline parallelism: GPipe, 1F1B, interleaved 1F1B (v = 2), m = 4 and 8, p = 2 and 4
    "pp_neox_p2": ("pp", ["--model", "neox-val", "--nproc", "2", *PP]),
    "pp_neox_p4": ("pp", ["--model", "neox-val", "--nproc", "4", *PP]),
    "pp_llamagqa_p2": ("pp", ["--model", "llama-gqa-val", "--nproc", "2", *PP]),
    "pp_llamagqa_p4": ("pp", ["--model", "llama-gqa-val", "--nproc", "4", *PP]),
}

NOTE = ("CPU processes with gloo on a shared 2-core machine (several ranks per core): live-tensor accounting of "
        "what PyTorch's dispatcher allocates (parlab's ledger), not a GPU allocator's; the same tensors a GPU "
        "would hold except kernel workspaces and allocator rounding")


# ----------------------------------------------------------------------------- independent counts

def _layer_tensors(family: str, c: dict) -> dict[str, tuple[int, bool]]:
    """One block's parameters: name -> (numel, split by tensor parallelism). Written from the configs and
    the transformers modules, independently of vramlab.specs."""
    h = c["hidden_size"]
    if family == "llama":
        a, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        d, f = h // a, c["intermediate_size"]
        return {"q": (h * a * d, True), "k": (h * kv * d, True), "v": (h * kv * d, True), "o": (a * d * h, True),
                "gate": (h * f, True), "up": (h * f, True), "down": (f * h, True), "norms": (2 * h, False)}
    if family == "gpt_neox":
        f = c["intermediate_size"]
        return {"qkv": (3 * h * h + 3 * h, True), "dense.w": (h * h, True), "dense.b": (h, False),
                "h_to_4h": (h * f + f, True), "4h_to_h.w": (f * h, True), "4h_to_h.b": (h, False),
                "norms": (4 * h, False)}
    if family == "opt":
        f = c["ffn_dim"]
        return {"qkv": (3 * (h * h + h), True), "out.w": (h * h, True), "out.b": (h, False),
                "fc1": (h * f + f, True), "fc2.w": (f * h, True), "fc2.b": (h, False), "norms": (4 * h, False)}
    raise ValueError(family)


def _family(c: dict) -> str:
    return {"llama": "llama", "gpt_neox": "gpt_neox", "opt": "opt"}[c["model_type"]]


def _ends(family: str, c: dict) -> dict[str, tuple[int, bool]]:
    """Outside the blocks: first-stage and last-stage parameters (numel, split by TP)."""
    h, V = c["hidden_size"], c["vocab_size"]
    first = {"embed": (V * h, True)}
    if family == "opt":
        first["positions"] = ((c["max_position_embeddings"] + 2) * h, False)
    last = {"final_norm": (h if family == "llama" else 2 * h, False), "head": (V * h, True)}
    return {"first": first, "last": last}


def expected_params(c: dict, *, tp: int = 1, layers: range | None = None, first: bool = True, last: bool = True,
                    tied_counted_once: bool = True) -> int:
    """Parameters one rank holds (numel): blocks `layers` (all by default), the embedding on the first stage,
    the final norm and head on the last; split tensors divided by tp. A tied head is the embedding (counted
    once) when both are on the rank, its own copy on a last stage without the embedding."""
    fam = _family(c)
    L = c["num_hidden_layers"]
    layers = range(L) if layers is None else layers
    per = sum(n // tp if split else n for n, split in _layer_tensors(fam, c).values())
    total = per * len(layers)
    ends = _ends(fam, c)
    tied = c.get("tie_word_embeddings", fam == "opt")
    if first:
        total += sum(n // tp if s else n for n, s in ends["first"].values())
    if last:
        n, s = ends["last"]["head"]
        if not (tied and first and tied_counted_once):
            total += n // tp
        n, s = ends["last"]["final_norm"]
        total += n
    return total


def _param_tensors(c: dict, *, layers: range | None = None, first=True, last=True) -> int:
    """Number of parameter tensors (AdamW keeps one 4-byte step counter per tensor)."""
    fam = _family(c)
    per = {"llama": 9, "gpt_neox": 12, "opt": 16}[fam]  # weights, biases and norm weights/biases per block
    layers = range(c["num_hidden_layers"]) if layers is None else layers
    n = per * len(layers)
    tied = c.get("tie_word_embeddings", fam == "opt")
    if first:
        n += 1 + (1 if fam == "opt" else 0)
    if last:
        n += (1 if fam == "llama" else 2) + (0 if tied and first else 1)
    return n


# ----------------------------------------------------------------------------- checks

def _check(checks: list, name: str, expected, got, ok: bool | None = None) -> None:
    checks.append({"check": name, "expected": expected, "got": got, "ok": bool(expected == got if ok is None else ok)})


def _states(checks: list, where: str, cats: dict, params: int, tensors: int) -> None:
    """Parameters, gradients (fp32, = parameters) and AdamW's moments (2 x parameters + a 4-byte step each)."""
    _check(checks, f"{where}: parameter bytes = own count x 4", 4 * params, cats["parameters"])
    _check(checks, f"{where}: gradient bytes = parameter bytes (fp32)", cats["parameters"], cats["gradients"])
    _check(checks, f"{where}: AdamW states = 2 x parameters + 4 B step per tensor", 8 * params + 4 * tensors,
           cats["optimizer_states"])


def check_run(run: dict) -> list[dict]:
    """Checks of a stored parlab run against counts from its config."""
    checks: list[dict] = []
    c, exp, n = run["model"], run["experiment"], run["ranks"]
    for rank in run["per_rank"]:
        rows = rank["rows"] if exp == "pp" else [rank]
        for row in rows:
            mem = row["memory"]
            where = f"rank {row['rank']}" + (f" {row['schedule']} m={row['micro_batches']}" if exp == "pp" else "")
            cats = mem["at_peak"]["categories"]
            _check(checks, f"{where}: every resident storage seen by the ledger", {}, mem["resident_unseen_by_ledger"])
            _check(checks, f"{where}: categories at the peak add up to the peak", mem["peak"], mem["at_peak"]["total"])
            if exp == "ddp":
                _states(checks, where, cats, expected_params(c), _param_tensors(c))
                _check(checks, f"{where}: DDP gradients match one process on the whole batch (rel. < 1e-4)",
                       "< 1e-4", row["grad_max_rel_diff"], row["grad_max_rel_diff"] < 1e-4)
                _check(checks, f"{where}: DDP's buckets hold every gradient", cats["parameters"], sum(row["buckets"]))
                if row["gradient_as_bucket_view"]:
                    _check(checks, f"{where}: view: no second copy (persistent other < 64 KiB)", "< 65536",
                           cats["persistent_other"], cats["persistent_other"] < 65536)
                else:
                    _check(checks, f"{where}: buckets are a second copy (persistent other - buckets < 64 KiB)",
                           sum(row["buckets"]), cats["persistent_other"],
                           0 <= cats["persistent_other"] - sum(row["buckets"]) < 65536)
            elif exp == "tp":
                own = expected_params(c, tp=n)
                _states(checks, where, cats, own, _param_tensors(c))
                _check(checks, f"{where}: param_bytes_local = own count x 4", 4 * own, row["param_bytes_local"])
                _check(checks, f"{where}: split logits = unsplit (rel. < 1e-4)", "< 1e-4", row["logits_max_rel_diff"],
                       row["logits_max_rel_diff"] < 1e-4)
                _check(checks, f"{where}: loss = unsplit loss (abs. < 1e-4)", "< 1e-4", row["loss_abs_diff"],
                       row["loss_abs_diff"] < 1e-4)
                mt = row["measured"]["total"]
                _check(checks, f"{where}: MemTracker's peak within 1 % of the ledger's", mem["peak"], mt,
                       abs(mt - mem["peak"]) <= 0.01 * mem["peak"])
            else:
                spans = [row["layers"]] if isinstance(row["layers"][0], int) else row["layers"]
                own, tensors = 0, 0
                stages = n * len(row["virtual_stages"])
                for k, (a, b) in zip(row["virtual_stages"], spans):
                    own += expected_params(c, layers=range(a, b), first=k == 0, last=k == stages - 1)
                    tensors += _param_tensors(c, layers=range(a, b), first=k == 0, last=k == stages - 1)
                _states(checks, where, cats, own, tensors)
                act = run["micro_batch_size"] * run["seq_len"] * c["hidden_size"] * 4
                m = row["micro_batches"]
                sends_fwd = sum(1 for k in row["virtual_stages"] if k != stages - 1)
                sends_bwd = sum(1 for k in row["virtual_stages"] if k != 0)
                _check(checks, f"{where}: activations sent = stages not last x m x b s h x 4", sends_fwd * m * act,
                       row["p2p"]["sent_forward_bytes"])
                _check(checks, f"{where}: gradients sent = stages not first x m x b s h x 4", sends_bwd * m * act,
                       row["p2p"]["sent_backward_bytes"])
                fl = mem["in_flight"]["max_per_virtual_stage"]
                if row["schedule"] == "gpipe":
                    _check(checks, f"{where}: GPipe holds all m micro-batches", m, max(fl.values()))
                elif row["schedule"] == "1f1b":
                    _check(checks, f"{where}: 1F1B holds min(m, p - stage)", min(m, n - row["rank"]), max(fl.values()))
    if exp == "pp":  # interleaving multiplies the p2p traffic by (v p - 1) / (p - 1)
        for m in run["micro_batches"]:
            tot = {s: sum(r["p2p"]["sent_bytes"] for rk in run["per_rank"] for r in rk["rows"]
                          if r["schedule"] == s and r["micro_batches"] == m) for s in ("1f1b", "interleaved")}
            if tot["1f1b"] and tot["interleaved"]:
                v = run["chunks"]
                _check(checks, f"m={m}: interleaved / 1F1B p2p bytes = (v p - 1) / (p - 1)",
                       (v * n - 1) / (n - 1), tot["interleaved"] / tot["1f1b"])
    return checks


# ----------------------------------------------------------------------------- runs

def run_case(name: str, out_dir: Path) -> tuple[bool, float]:
    exp, extra = CASES[name]
    args = [exp, *(["--nproc", "2"] if "--nproc" not in extra else []), *extra, *FOR_LOOP]
    path = out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "vramlab.measure.parallel", *args, "--out", str(path)]
    print(f"[{name}] python -m vramlab.measure.parallel {' '.join(args)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not path.exists():
        last = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        print(f"[{name}] FAILED after {wall:.0f} s: {last[-1] if last else r.returncode}", file=sys.stderr)
        return False, wall
    run = json.loads(path.read_text())
    run["case"] = name
    run["note"] = NOTE
    run["sweep"] = {"script": "benchmarks/layout_validation.py", "case": name, "wall_s": round(wall, 1),
                    "stdout": r.stdout.splitlines()}
    run["command"] = " ".join(["python -m vramlab.measure.parallel", *args, "--out", str(path.relative_to(ROOT))])
    run["checks"] = check_run(run)
    path.write_text(json.dumps(run, indent=1) + "\n")
    bad = [c for c in run["checks"] if not c["ok"]]
    print(f"[{name}] {wall:.0f} s, {len(run['checks']) - len(bad)}/{len(run['checks'])} checks hold", file=sys.stderr)
    for c in bad:
        print(f"[{name}]   NOT: {c['check']}: expected {c['expected']}, got {c['got']}", file=sys.stderr)
    return not bad, wall


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _short(item: dict) -> str:
    op = item["op"].replace("aten.", "").replace("_c10d_functional.", "c10d.").rsplit(".", 1)[0]
    return f"{_mib(item['bytes'])} {item['dtype'].replace('float', 'f').replace('bfloat', 'bf')} {'x'.join(map(str, item['shape']))} {op}"


def summary(out_dir: Path, names: list[str]) -> str:
    """Markdown tables of the stored runs (MiB): each rank's (DDP, TP: rank 0, the others equal) or each
    pipeline stage's peak, its phase, the bytes by category at the peak, the largest storages there."""
    lines = []
    flat = [n for n in names if CASES[n][0] != "pp" and (out_dir / f"{n}.json").exists()]
    if flat:
        lines += ["| case | peak | phase | params | grads | states | act | bwd tmp | other | fwd end | largest at the peak "
                  "| largest in the backward | checks |", "|" + "---|" * 13]
        for n in flat:
            run = json.loads((out_dir / f"{n}.json").read_text())
            r = run["per_rank"][0]
            m, c = r["memory"], r["memory"]["at_peak"]["categories"]
            same = all(x["memory"]["peak"] == m["peak"] for x in run["per_rank"])
            ok = sum(x["ok"] for x in run.get("checks", []))
            lines.append(
                f"| {n} | {_mib(m['peak'])}{'' if same else ' (rank 0)'} | {m['peak_phase']} | {_mib(c['parameters'])} | "
                f"{_mib(c['gradients'])} | {_mib(c['optimizer_states'])} | {_mib(c['activations'])} | "
                f"{_mib(c['backward_transients'] + c['optimizer_transients'] + c['step_other'])} | "
                f"{_mib(c['inputs'] + c['buffers'] + c['persistent_other'])} | "
                f"{_mib(m['marks']['forward end']['total']) if 'forward end' in m['marks'] else '-'} | "
                f"{'; '.join(_short(i) for i in m['at_peak']['largest'][:3])} | "
                f"{'; '.join(_short(i) for i in m['largest_created'].get('backward', [])[:2])} | "
                f"{ok}/{len(run.get('checks', []))} |")
    for n in names:
        if CASES[n][0] != "pp" or not (out_dir / f"{n}.json").exists():
            continue
        run = json.loads((out_dir / f"{n}.json").read_text())
        ok = sum(x["ok"] for x in run.get("checks", []))
        lines += ["", f"**{n}** ({run['model_name']}, p = {run['ranks']}, micro-batch {run['micro_batch_size']} x "
                      f"{run['seq_len']}; checks {ok}/{len(run.get('checks', []))}). Per stage: peak MiB (phase) "
                      f"[activations, other] in flight at the peak / most; p2p MiB sent",
                  "", "| schedule | m | " + " | ".join(f"stage {k}" for k in range(run["ranks"])) + " |",
                  "|" + "---|" * (2 + run["ranks"])]
        rows: dict = {}
        for rank in run["per_rank"]:
            for r in rank["rows"]:
                rows.setdefault((r["schedule"], r["micro_batches"]), {})[r["rank"]] = r
        for (sched, m), by in sorted(rows.items(), key=lambda kv: (["gpipe", "1f1b", "interleaved"].index(kv[0][0]),
                                                                   kv[0][1])):
            cells = []
            for k in range(run["ranks"]):
                r = by[k]
                mem, c = r["memory"], r["memory"]["at_peak"]["categories"]
                fl = mem["in_flight"]
                cells.append(f"{_mib(mem['peak'])} ({mem['peak_phase']}) [{_mib(c['activations'])}, "
                             f"{_mib(c['inputs'] + c['buffers'] + c['persistent_other'])}] "
                             f"{fl['at_peak']['total']}/{fl['max']}; {_mib(r['p2p']['sent_bytes'])}")
            lines.append(f"| {sched} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure per-rank memory of DP/TP/PP layouts on gloo CPU ranks.")
    p.add_argument("--only", default=None, help="comma-separated case names (default: every case)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--check", action="store_true", help="re-run the checks on the stored files; run nothing")
    p.add_argument("--summary", action="store_true", help="print Markdown tables of the stored files; run nothing")
    p.add_argument("--out-dir", default=str(OUT), help=f"where the JSON files go (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    names = list(CASES)
    if args.only:
        names = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in names if x not in CASES]
        if unknown or not names:
            p.error(f"unknown case(s) {unknown or args.only!r}; --list shows them")
    if args.list:
        for name in CASES:
            exp, extra = CASES[name]
            print(f"{name:30} {exp} {' '.join(extra)}")
        return 0
    out_dir = Path(args.out_dir)
    if args.summary:
        print(summary(out_dir, names), end="")
        return 0
    if args.check:
        failed = 0
        for name in names:
            path = out_dir / f"{name}.json"
            if not path.exists():
                print(f"[{name}] no stored file", file=sys.stderr)
                failed += 1
                continue
            checks = check_run(json.loads(path.read_text()))
            bad = [c for c in checks if not c["ok"]]
            failed += bool(bad)
            print(f"[{name}] {len(checks) - len(bad)}/{len(checks)} checks hold", file=sys.stderr)
            for c in bad:
                print(f"[{name}]   NOT: {c['check']}: expected {c['expected']}, got {c['got']}", file=sys.stderr)
        return 1 if failed else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    ok, t0 = True, time.perf_counter()
    for i, name in enumerate(names, 1):
        print(f"# case {i}/{len(names)}, {time.perf_counter() - t0:.0f} s so far", file=sys.stderr)
        ok &= run_case(name, out_dir)[0]
    print(f"# {len(names)} cases in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
