"""vramlab: where GPU memory goes when large neural networks are trained and served.

The folder tells the layer (see README, "The package"):

- `vramlab.*` — the calculators, one module per concept, pure Python (no torch, ever): `checks`,
  `units`, `specs`, `precision`, `activations`, `memory`, `fitting`, `collectives`, `parallel`,
  `zero`, `offload`, `checkpointing`, `compression`, `moe`, `serving`, `allocator`;
- `vramlab.measure.*` — what the calculators predict, measured with torch (one module per chapter,
  named like its calculator: `vramlab.zero` predicts, `vramlab.measure.zero` measures);
- `vramlab.present.*` — the calculators' declarations, their widgets, figures and the CLI;
- `vramlab.grading.*` — the checks the labs' test cells call, and the programs their ranks run.
"""

from .fitting import fit
from .memory import MemoryBreakdown, checkpoint_bytes, estimate_inference, estimate_training
from .specs import GPUSpec, ModelSpec, SpecError, from_config, gpu, preset, preset_names

__version__ = "0.1.0"
__all__ = ["MemoryBreakdown", "ModelSpec", "GPUSpec", "SpecError", "estimate_training", "estimate_inference",
           "checkpoint_bytes", "fit", "from_config", "gpu", "preset", "preset_names"]
