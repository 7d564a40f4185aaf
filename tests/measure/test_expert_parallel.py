"""`vramlab.measure.expert_parallel`: the EP experiment's models, routing and command line."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from vramlab.measure import expert_parallel as eplab  # noqa: E402


def test_ep_campaign_configs_round_trip_through_the_command_line():
    config = dict(model="ep-qwen2", ep=2, dp=4, micro_batch=1, seq=64, capacity_factor=1.5, zero=1)
    argv = eplab.ep_argv(config, "out.json")
    assert argv[:1] == ["ep"] and argv[argv.index("--capacity-factor") + 1] == "1.5" and argv[-2:] == ["--zero", "1"]
    assert "--capacity-factor" not in eplab.ep_argv(dict(config, capacity_factor=None), "out.json")
    assert all(c["model"] in eplab.EP_MODELS for c in eplab.EP_CAMPAIGN)
    with pytest.raises(ValueError, match="unknown EP model"):
        eplab.ep_model_spec("lab")


def test_capacity_keeps_each_experts_first_choices_in_token_order():
    import torch

    keep, pos = eplab._capacity_keep(torch.tensor([[0], [0], [0], [1]]), num_experts=2, capacity=2)
    assert keep.tolist() == [True, True, False, True] and pos.tolist() == [0, 1, 2, 0]
