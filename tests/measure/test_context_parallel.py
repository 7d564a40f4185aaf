"""`vramlab.measure.context_parallel`: context parallelism's command line and campaign."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from vramlab.measure import context_parallel as cplab  # noqa: E402
from vramlab.measure import parallel as parlab  # noqa: E402
from vramlab.measure.ranks import model_spec  # noqa: E402
from .conftest import refused  # noqa: E402


# --------------------------------------------------------------- cp: FSDP2 over the CP ranks

def test_cp_fsdp_flag_round_trips_through_the_campaigns_command_line():
    config = dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024, recompute="full", fsdp=True)
    argv = cplab.cp_argv(config, "out.json")
    assert argv.count("--fsdp") == 1 and "--fsdp" not in cplab.cp_argv(dict(config, fsdp=False), "out.json")
    assert any(c.get("fsdp") for c in cplab.CP_CAMPAIGN)


@pytest.mark.usefixtures("nothing_starts")
def test_cp_fsdp_refuses_a_value_in_one_line(capsys):
    line = refused(parlab.main, ["cp", "--fsdp=yes"], capsys)
    assert "--fsdp" in line, line


def test_cp_replaces_llama_family_attention_only():
    assert "Llama-family attention only" in cplab.cp_problem(model_spec("opt-val"), 2, "ring", 256)
    assert cplab.cp_problem(model_spec("lab"), 2, "ring", 256) is None
