"""`vramlab.measure.pipeline`: lab 3's pipeline parallelism, its settings and its bubble."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from vramlab.measure import pipeline  # noqa: E402
from vramlab.measure.ranks import model_spec  # noqa: E402


def test_pipeline_settings_that_cannot_run_are_named():
    lab = model_spec("lab")  # 4 layers
    assert pipeline.pp_problem(lab, 2, ["gpipe", "1f1b"], 2, [1, 2, 4]) is None
    assert "need at least 8" in pipeline.pp_problem(lab, 4, ["interleaved"], 2, [4])
    assert "multiple of" in pipeline.pp_problem(model_spec("neox-val"), 4, ["interleaved"], 2, [8, 9])


def test_the_measured_bubble_of_a_gpipe_step_without_gaps_is_the_formula():
    """Two stages, two micro-batches, forward 1 and backward 2 (GPipe): span 9, each stage busy 6, so the
    bubble is 1/3 = (p-1)/(m+p-1)."""
    stage0 = [("F", 0.0, 1.0), ("F", 1.0, 2.0), ("B", 5.0, 7.0), ("B", 7.0, 9.0)]
    stage1 = [("F", 1.0, 2.0), ("F", 2.0, 3.0), ("B", 3.0, 5.0), ("B", 5.0, 7.0)]
    ranks = [{"rows": [{"schedule": "gpipe", "micro_batches": 2, "steps": [{"ops": ops}]}]} for ops in (stage0, stage1)]
    got = pipeline.measured_bubble(ranks, "gpipe", 2)
    assert got["bubble"] == pytest.approx(1 / 3) and got["per_step"] == [pytest.approx(1 / 3)]
    assert got["forward_s"] == [1.0, 1.0] and got["backward_s"] == [2.0, 2.0]
    with pytest.raises(ValueError, match="no 1f1b run with 2 micro-batches"):
        pipeline.measured_bubble(ranks, "1f1b", 2)
