"""Real memory snapshots for `vramlab explain`: a small model trained from its config (no hub)
with allocation history recorded, `torch.cuda.memory._snapshot()` dumped at known points and at a real
out-of-memory error, each pickle beside a JSON of provenance and of what torch reported at that moment.

    python benchmarks/snapshot_probe.py                       # every case, one process each
    python benchmarks/snapshot_probe.py --case peak --stacks all

Cases (each in its own process: no case sees another's memory):
- peak: GPT-2 (the preset, random weights), fp32, AdamW foreach, SDPA, --batch x --seq; a warm-up step makes the
  optimizer's states, then one recorded step is snapshotted after the forward (the loss alive: activations) and
  after the backward (gradients); the sidecar holds memory_allocated()/memory_reserved() at each point (what
  `explain`'s totals must equal) and `vramlab.memory.estimate_training` for the same setup.
- oom: the same model and states, then the device filled with a ballast outside PyTorch's allocator (cudaMalloc
  through ctypes) until only --room-fraction of the step's estimated extra need is left; the step at --batch
  runs out of memory and the snapshot is dumped from the except branch (its trace holds the `oom` entry).
- check: the oom case's setup at --batch with the room in --room-bytes (optionally under
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): did the step fit? The default run explains the oom snapshot
  and checks its two verdicts this way (the largest batch it says fits, that batch + 1, and --batch with
  expandable segments), so the verdicts meet real runs.

On a machine without CUDA it says so in one line and exits 0. Output: benchmarks/results/snapshots/ (--out-dir).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "snapshots"


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("peak", "oom", "check"), default=None, help="one case (default: all, each in a process)")
    ap.add_argument("--model", default="gpt2", help="a vramlab preset, built from its config (default gpt2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--stacks", choices=("python", "all"), default="python",
                    help="_record_memory_history's stacks: all adds C++ frames (slow to symbolise; context='state')")
    ap.add_argument("--room-fraction", type=float, default=0.5, help="oom: the share of the step's extra need left free")
    ap.add_argument("--room-bytes", type=int, default=None, help="check: bytes left free after the ballast")
    ap.add_argument("--tag", default="", help="a name part for the files (check)")
    ap.add_argument("--out-dir", type=Path, default=OUT)
    return ap.parse_args(argv)


def _cudart():
    """libcudart for a cudaMalloc outside PyTorch's allocator (the ballast), or None."""
    import torch

    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"]
    site = Path(torch.__file__).resolve().parents[1]
    names += sorted(glob.glob(str(site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so*")))
    names += sorted(glob.glob(str(site / "nvidia" / "cu*" / "lib" / "libcudart.so*")))
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _ballast(nbytes: int) -> int:
    """Hold `nbytes` of device memory outside PyTorch's allocator; returns the bytes held (0: not possible)."""
    lib = _cudart()
    if lib is None or nbytes <= 0:
        return 0
    ptr = ctypes.c_void_p()
    return nbytes if lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0 else 0


def _setup(args, record: bool):
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from vramlab.measure.memory import make_optimizer
    from vramlab.measure.models import build_model, make_batch
    from vramlab.specs import preset

    if record:
        kw = {"context": "state"} if args.stacks == "all" else {}
        torch.cuda.memory._record_memory_history(enabled="all", stacks=args.stacks, max_entries=200_000, **kw)
    spec = preset(args.model)
    model = build_model(spec, device="cuda")
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], optimizer="adamw", optimizer_impl="foreach")
    warm = make_batch(spec, batch_size=1, seq_len=args.seq, device="cuda")
    model(**warm).loss.backward()  # the warm-up: Adam's states, cuBLAS workspaces
    opt.step()
    opt.zero_grad(set_to_none=True)
    del warm
    torch.cuda.synchronize()
    return spec, model, opt, make_batch


def _estimate(spec, args) -> dict:
    from vramlab import memory

    e = memory.estimate_training(spec, batch_size=args.batch, seq_len=args.seq, precision="fp32", optimizer="adamw")
    return {"breakdown": e.to_dict(), "total_bytes": e.total, "batch_size": args.batch, "seq_len": args.seq,
            "phase": e.phase}


def _point(torch, label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"point": label, "memory_allocated": torch.cuda.memory_allocated(),
            "memory_reserved": torch.cuda.memory_reserved(), "device_free": free, "device_total": total}


def _truth(model, opt) -> dict:
    """The bytes of each category by the tensors' identity (blocks of 512 B, as the allocator rounds): what
    `explain`'s frame rules must find in the snapshot taken at the same moment."""
    def blocks(tensors):
        ptrs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(-(-n // 512) * 512 for n in ptrs.values())
    params = list(model.parameters())
    states = [v for st in opt.state.values() for v in st.values() if hasattr(v, "is_cuda") and v.is_cuda]
    # "parameters" as the rules count them: the module's parameters and buffers (built or moved with it)
    return {"parameters": blocks(params + [b for b in model.buffers() if b.is_cuda]),
            "gradients": blocks([p.grad for p in params]),
            "optimizer_states": blocks(states)}


def _dump(torch, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


def _sidecar(path: Path, res: dict) -> None:
    from vramlab.measure.record import provenance

    res = {"provenance": provenance("cuda:0"), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), **res,
           "command": "python benchmarks/snapshot_probe.py " + " ".join(sys.argv[1:])}
    path.write_text(json.dumps(res, indent=1) + "\n")


def case_peak(args) -> int:
    import torch

    spec, model, opt, make_batch = _setup(args, record=True)
    batch = make_batch(spec, batch_size=args.batch, seq_len=args.seq, device="cuda")
    name = f"{args.model}_fp32_adamw_b{args.batch}_s{args.seq}_{args.stacks}"
    points = []
    loss = model(**batch).loss
    points.append({**_point(torch, "after forward"), "truth": _truth(model, opt)})
    _dump(torch, args.out_dir / f"{name}_after_forward.pickle")
    loss.backward()
    del loss
    points.append({**_point(torch, "after backward"), "truth": _truth(model, opt)})
    _dump(torch, args.out_dir / f"{name}_after_backward.pickle")
    _sidecar(args.out_dir / f"{name}.json", {"case": "peak", "model": args.model, "stacks": args.stacks,
                                             "points": points, "estimate": _estimate(spec, args),
                                             "snapshots": [f"{name}_after_forward.pickle", f"{name}_after_backward.pickle"]})
    print(f"snapshot_probe: peak -> {args.out_dir / name}_*.pickle")
    return 0


def _fill(torch, args, room: int) -> int:
    free, _ = torch.cuda.mem_get_info()
    return _ballast(free - room)


def case_oom(args, check: bool = False) -> int:
    import torch

    spec, model, opt, make_batch = _setup(args, record=not check)
    est = _estimate(spec, args)
    if check:
        room = args.room_bytes
    else:  # leave a share of what the step needs beyond what is reserved now
        room = int(args.room_fraction * max(0, est["total_bytes"] - torch.cuda.memory_reserved()))
    ballast = _fill(torch, args, room)
    before = _point(torch, "before the step")
    batch = make_batch(spec, batch_size=args.batch, seq_len=args.seq, device="cuda")
    tag = "check" if check else "oom"
    name = f"{args.model}_fp32_adamw_b{args.batch}_s{args.seq}_{tag}{args.tag}"
    fit, at = True, None
    try:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        # inside the except: the failed step's frames (its live activations) are still held by the traceback
        fit, at = False, _point(torch, "at the OOM")
        if not check:
            _dump(torch, args.out_dir / f"{name}.pickle")
    if fit and not check:  # no OOM: the state after the step, for the record
        _dump(torch, args.out_dir / f"{name}.pickle")
    res = {"case": tag, "model": args.model, "batch_size": args.batch, "seq_len": args.seq, "fit": fit,
           "room_bytes": room, "ballast_bytes": ballast, "ballast": "cudaMalloc via ctypes" if ballast else "none",
           "before": before, "at_oom": at, "estimate": est}
    if not check:
        res["snapshot"] = f"{name}.pickle"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _sidecar(args.out_dir / f"{name}.json", res)
    print(f"snapshot_probe: {tag} at batch {args.batch}: {'fits' if fit else 'out of memory'} (ballast {ballast:,} B)")
    return 0


def _run(argv: list[str], env: dict | None = None) -> int:
    return subprocess.run([sys.executable, __file__, *argv], env={**os.environ, **(env or {})}).returncode


def run_all(args) -> int:
    base = ["--model", args.model, "--seq", str(args.seq), "--out-dir", str(args.out_dir)]
    _run(["--case", "peak", "--batch", str(args.batch), "--stacks", "python", *base])
    _run(["--case", "peak", "--batch", "2", "--stacks", "all", *base])
    _run(["--case", "oom", "--batch", str(args.batch), "--room-fraction", str(args.room_fraction), *base])
    oom = json.loads((args.out_dir / f"{args.model}_fp32_adamw_b{args.batch}_s{args.seq}_oom.json").read_text())
    if oom["fit"] or not oom["ballast_bytes"]:
        print("snapshot_probe: no OOM under a ballast: the verdicts are not checked")
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from vramlab import snapshot as S

    e = S.explain(args.out_dir / oom["snapshot"], estimate=oom["estimate"], batch_size=args.batch,
                  device_total=oom["at_oom"]["device_total"])
    verdicts = {"largest_batch_that_fits": e.largest_batch_that_fits,
                "fits_with_expandable_segments": e.fits_with_expandable_segments,
                "largest_batch_with_expandable_segments": e.largest_batch_with_expandable_segments}
    room = ["--room-bytes", str(oom["room_bytes"])]
    checks = []
    for b in sorted({e.largest_batch_that_fits or 0, (e.largest_batch_that_fits or 0) + 1} - {0}):
        checks.append(("default", b))
        _run(["--case", "check", "--batch", str(b), "--tag", "_default", *room, *base])
    _run(["--case", "check", "--batch", str(args.batch), "--tag", "_expandable", *room, *base],
         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    checks.append(("expandable", args.batch))
    found = {}
    for conf, b in checks:
        f = args.out_dir / f"{args.model}_fp32_adamw_b{b}_s{args.seq}_check_{conf}.json"
        found[f"{conf} batch {b}"] = json.loads(f.read_text())["fit"] if f.exists() else None
    (args.out_dir / f"{args.model}_verdicts.json").write_text(json.dumps({"predicted": verdicts, "measured": found},
                                                                          indent=1) + "\n")
    print(f"snapshot_probe: verdicts {verdicts}; runs {found}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        import torch
    except ImportError:
        print("snapshot_probe: needs torch with CUDA; nothing recorded")
        return 0
    if not torch.cuda.is_available():
        print("snapshot_probe: needs a CUDA GPU (torch.cuda.is_available() is False); nothing recorded")
        return 0
    if args.case == "peak":
        return case_peak(args)
    if args.case in ("oom", "check"):
        return case_oom(args, check=args.case == "check")
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
