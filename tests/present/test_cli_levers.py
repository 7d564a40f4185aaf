"""vramlab.present.cli_levers: what `vramlab` tries when a configuration does not fit, each change answered by
the same estimators, and the ones that fit given as whole command lines."""

from vramlab.present import cli_levers as L
from vramlab.present.cli_answers import answer
from vramlab.present.cli_args import parser


def test_levers_that_fit_are_given_with_their_command_lines(capsys):
    ns = parser().parse_args(["estimate", "train", "--model", "gpt2", "--batch-size", "64", "--seq-len", "1024",
                              "--gpu", "t4", "--json"])
    here = answer(ns)
    assert not here.fits
    out = {}
    assert L.answer_out(ns, out, here, fits=False) == 0
    capsys.readouterr()
    tried = out["suggestions"]
    assert 0 < len(tried) <= L.SHOWN and all(s["fits"] and s["argv"][0] == "vramlab" for s in tried)
    again = parser().parse_args(tried[0]["argv"][1:])  # a suggestion is a command line that parses to its answer
    assert answer(again).needed == tried[0]["needed_bytes"]
