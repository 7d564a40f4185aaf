"""vramlab.present.cli_commands: what each `vramlab` subcommand prints or gives as one JSON object."""

import json

from vramlab import memory, specs
from vramlab.present import cli_commands as K
from vramlab.present.cli_args import parser


def test_every_computing_subcommand_has_its_command():
    assert set(K.COMMANDS) == set(parser().commands) - {"presets", "gpus"}


def test_estimate_gives_the_librarys_bytes(capsys):
    ns = parser().parse_args(["estimate", "infer", "--model", "gpt2", "--batch-size", "2", "--seq-len", "64", "--json"])
    assert K.COMMANDS["estimate"](ns) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["total_bytes"] == memory.estimate_inference(specs.preset("gpt2"), batch_size=2, seq_len=64).total
