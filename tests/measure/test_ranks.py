"""`vramlab.measure.ranks`: what the parallelism experiments share (lab 3's models, a rank's step, one rank's
life, a run in a subprocess)."""

from __future__ import annotations

import json
import pickle

import pytest

pytest.importorskip("torch")

from vramlab.measure import context_parallel, expert_parallel, parallel, ranks  # noqa: E402


def test_lab_models_resolve_and_each_family_has_a_split():
    assert ranks.lab_model() == ranks.model_spec("lab")
    assert all(ranks.model_spec(name).family in ranks.FAMILIES for name in ranks.MODELS)
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        ranks.model_spec("gpt5")


@pytest.mark.parametrize("module", [parallel, context_parallel, expert_parallel], ids=lambda m: m.__name__)
def test_each_experiments_rank_is_started_by_reference_from_its_own_module(module):
    """`collectives.launch` pickles the worker to the ranks (by module and name) and preloads the worker's module
    in the fork server: each command's worker is a module-level function of the module that runs it."""
    worker = module._worker
    assert worker.__module__ == module.__name__ and pickle.loads(pickle.dumps(worker)) is worker


def test_storage_bytes_counts_a_shared_storage_once():
    import torch

    t = torch.zeros(256)
    seen: set[int] = set()
    assert ranks.storage_bytes([t, t[:10], t.view(16, 16)], seen) == 1024 and len(seen) == 1
    assert ranks.storage_bytes([t], seen) == 0  # already counted


def test_a_campaigns_command_names_the_module_that_runs_it(tmp_path, capsys):
    result = {"per_rank": [{"memory": {"peak": 10, "peak_phase": "backward", "at_peak": {}, "phases": {}, "more": 1}}],
              "rows": [{"error": -0.02}, {"error": 0.01}]}
    path = tmp_path / "runs" / "cpu.json"
    out = ranks.campaign(str(path), [dict(model="lab")], lambda config: result, str, what="a test",
                         name="cp_campaign", module="vramlab.measure.context_parallel")
    assert out["command"] == f"python -c \"from vramlab.measure.context_parallel import cp_campaign; cp_campaign('{path}')\""
    assert json.loads(path.read_text())["runs"][0]["result"]["per_rank"][0]["memory"] == {
        "peak": 10, "peak_phase": "backward", "at_peak": {}, "phases": {}}
    assert "worst error 2.00%" in capsys.readouterr().out
