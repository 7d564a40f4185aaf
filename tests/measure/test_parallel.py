"""`vramlab.measure.parallel`: the parallel chapter's measurement command."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from vramlab.measure import parallel as parlab  # noqa: E402
from .conftest import refused  # noqa: E402


# --------------------------------------------------------------- the command refuses bad arguments before any work

PARLAB = [
    (["ddp", "--timeout", "nan"], "--timeout"), (["ddp", "--timeout", "-1"], "--timeout"),
    (["ddp", "--timeout", "0"], "--timeout"), (["ddp", "--timeout", "inf"], "--timeout"),
    (["ddp", "--timeout", "1e9"], "--timeout"), (["ddp", "--port", "70000"], "--port"),
    (["ddp", "--port", "-1"], "--port"), (["ddp", "--port", "80.5"], "--port"),
    (["ddp", "--bucket-cap-mb", "nan"], "--bucket-cap-mb"), (["ddp", "--bucket-cap-mb", "-5"], "--bucket-cap-mb"),
    (["ddp", "--bucket-cap-mb", "0"], "--bucket-cap-mb"), (["ddp", "--bucket-cap-mb", "inf"], "--bucket-cap-mb"),
    (["ddp", "--nproc", "0"], "--nproc"), (["ddp", "--nproc", "65"], "--nproc"), (["ddp", "--nproc", "two"], "--nproc"),
    (["ddp", "--micro-batch", "0"], "--micro-batch"), (["ddp", "--micro-batch", "5000"], "--micro-batch"),
    (["ddp", "--seq", "1"], "--seq"), (["ddp", "--seq", "5000"], "reads at most 512 positions; --seq 5,000"),
    (["tp", "--model", "opt-val", "--seq", "513"], "reads at most 512"),
    (["tp", "--nproc", "3"], "cannot be split 3 ways"), (["tp", "--nproc", "2", "--sp", "--model", "opt-val"], "--sp"),
    (["pp", "--nproc", "8"], "need at least 8"), (["pp", "--nproc", "4", "--schedule", "interleaved"], "need at least 8"),
    (["pp", "--chunks", "1"], "--chunks"), (["pp", "--chunks", "9"], "--chunks"), (["pp", "--repeats", "0"], "--repeats"),
    (["pp", "--repeats", "101"], "--repeats"), (["pp", "--micro-batches", "0"], "--micro-batches"),
    (["pp", "--micro-batches", "2,2"], "once"), (["pp", "--micro-batches", "1,,2"], "--micro-batches"),
    (["pp", "--schedule", "zigzag"], "--schedule"), (["pp", "--schedule", "gpipe,gpipe"], "once"),
    (["ddp", "--repeats", "3"], "--repeats applies to pp only"), (["tp", "--micro-batches", "2"], "applies to pp only"),
    (["ddp", "--schedule", "1f1b"], "--schedule applies to pp only"), (["ddp", "--chunks", "2"], "applies to pp only"),
    (["tp", "--bucket-cap-mb", "2"], "--bucket-cap-mb applies to ddp only"), (["ddp", "--sp"], "--sp applies to tp only"),
    (["pp", "--gradient-as-bucket-view"], "applies to ddp only"),
    (["zero"], "invalid choice"), ([], "required"), (["ddp", "--model", "gpt5"], "--model"),
    (["ddp", "--backend", "mpi"], "--backend"), (["ddp", "--precision", "fp8"], "--precision"),
    (["ddp", "--recompute", "most"], "--recompute"), (["ddp", "--bogus"], "unrecognized arguments"),
]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, says", PARLAB, ids=[" ".join(a) or "(none)" for a, _ in PARLAB])
def test_parlab_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(parlab.main, argv, capsys)
    assert line.startswith("python -m vramlab.measure.parallel: error: ") and says in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_parlab_out_is_checked_first_and_named_parlab(afile, tmp_path, capsys):
    """The --out error named commbench (the launcher's module); a file where a folder should be is
    refused before any rank starts."""
    for out in (afile / "x.json", tmp_path):
        line = refused(parlab.main, ["ddp", "--out", str(out)], capsys)
        assert line.startswith("python -m vramlab.measure.parallel: error: --out") and "commbench" not in line, line
