"""vramlab: where GPU memory goes when large neural networks are trained and served.

The calculators (`specs`, `precision`, `memory`) are pure Python and import no torch;
`models` and `measure` need torch and transformers.
"""

from .memory import MemoryBreakdown, checkpoint_bytes, estimate_inference, estimate_training, fit
from .specs import GPUSpec, ModelSpec, SpecError, from_config, gpu, preset, preset_names

__version__ = "0.1.0"
__all__ = ["MemoryBreakdown", "ModelSpec", "GPUSpec", "SpecError", "estimate_training", "estimate_inference",
           "checkpoint_bytes", "fit", "from_config", "gpu", "preset", "preset_names"]
