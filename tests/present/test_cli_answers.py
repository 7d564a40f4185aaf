"""vramlab.present.cli_answers: does a parsed `vramlab` command fit, as its chapter's calculator computes it, and
each command's options for the library after the checks that span flags."""

import pytest

from vramlab import fitting, specs
from vramlab.present import cli_answers as A
from vramlab.present.cli_args import parser


def _ns(*argv):
    return parser().parse_args(list(argv))


def test_an_answer_is_the_fit_of_the_library():
    ns = _ns("estimate", "train", "--model", "gpt2", "--batch-size", "2", "--seq-len", "128", "--gpu", "t4")
    here = A.answer(ns, search=False)
    f = fitting.fit(specs.preset("gpt2"), specs.gpu("t4"), batch_size=2, seq_len=128, precision="fp32",
                    optimizer="adamw", max_search=1)
    assert (here.fits, here.needed, here.available) == (f.fits, f.needed, f.available) and here.largest is None
    assert A.answer(ns).largest >= 2


def test_options_refuse_flags_of_the_other_form():
    ns = _ns("estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--zero", "2",
             "--loss", "chunked")
    with pytest.raises(ValueError, match="--loss prices one GPU's step"):
        A.estimate_options(ns)
    ns = _ns("lora", "--model", "gpt2", "--method", "qlora", "--precision", "fp32", "--batch-size", "1",
             "--seq-len", "8", "--gpu", "h100")
    with pytest.raises(ValueError, match="does not apply to qlora"):
        A.lora_precision(ns)
    assert A.ZERO_RECIPE["bf16-mixed"] == "mixed-adam" and A.zero_stage(_ns(
        "estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--fsdp2")) == 3
