"""What the chapters predict, measured with torch: one module per chapter, named like its calculator
(`vramlab.zero` predicts, `vramlab.measure.zero` measures), plus what they share.

- `models`: a model built from a `ModelSpec` (random init, no download) and a batch for it;
- `record`: provenance, the measurement mode (GPU, CPU, trace) and a lab command's results file;
- `memory` (chapter 1): a training step or a prefill measured by category, isolated in its own
  process, or traced (`FakeTensorMode`) at any size;
- `collectives` (2), `parallel` (3), `zero` (4), `precision` (5), `offload` (6), `checkpointing` (7),
  `compression` (8): each chapter's measurement, runnable as `python -m vramlab.measure.<chapter>`.

Everything here imports torch; nothing in the pure calculators imports anything here.
"""
