"""What every measurement records and how it runs: where and when it was taken (`provenance`),
which mode it runs in (`resolve_mode`: a GPU, the CPU, or trace), and a lab command's results file
(`write_results`). Used by every module of `vramlab.measure`."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path
from typing import Any, Literal

import torch

Mode = Literal["auto", "cuda", "cpu", "trace"]


def provenance(device: str | None = None) -> dict[str, Any]:
    """Where and when a measurement was taken: host, torch, transformers, GPU and driver."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device and device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            info["driver"] = _nvidia_driver()
        except Exception:  # pragma: no cover - nvidia-smi missing
            pass
    return info


def write_results(res: dict[str, Any], prog: str, argv: list[str] | None, out: Path | None) -> int:
    """A lab runner's ending: record the command line in `res` and write it as JSON to `out` (its
    folder made), or print it. Returns the exit status, 0."""
    res["command"] = f"python -m {prog} " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(res, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    else:
        print(text)
    return 0


def _nvidia_driver() -> str:
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True)
    return out.stdout.strip().splitlines()[0]


def resolve_mode(mode: Mode) -> str:
    if mode == "auto":
        return "cuda" if torch.cuda.is_available() else "trace"
    if mode == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("mode='cuda' needs a CUDA GPU; use mode='trace' (any model, no memory) or 'cpu'")
    if mode not in ("cuda", "cpu", "trace"):
        raise ValueError(f"unknown mode {mode!r}: expected auto, cuda, cpu or trace")
    return mode
