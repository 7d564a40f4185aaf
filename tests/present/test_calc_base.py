"""vramlab.present.calc_base: the types every calculator is made of (Input, Result, Calculator) and what the
chapters share. Pure Python: the browser runs it."""

import pytest

from vramlab.present import calc_base as B


def test_an_input_checks_its_value_in_one_line():
    n = B.Input(name="n", label="ranks", kind="int", default=8, min=2, max=256)
    assert n.check("16") == 16 and n.check(" 1e2 ") == 100
    for bad, says in [(1.5, "whole number"), (True, "expected a number"), ("inf", "finite"), (512, "out of range")]:
        with pytest.raises(ValueError, match=says):
            n.check(bad)
    c = B.Input(name="c", label="cp", kind="choice", default=8, choices=(1, 2, 8))
    assert c.check("8") == 8
    with pytest.raises(ValueError, match="is not one of 1, 2, 8"):
        c.check(3)
    f = B.Input(name="f", label="snapshot", kind="file", default=None, choices=(".pickle",))
    assert f.check("") is None and f.check(b"ab") == b"ab" and f.check("data:,") == b"" and f.check("aGk=") == b"hi"


def test_a_calculator_refuses_bad_input_with_a_result_not_an_exception():
    def compute(*, n: int) -> B.Result:
        if n == 3:
            return B.refused("three is refused", "n")
        if n == 4:
            raise ValueError("four is not priced")
        return B.Result(text=f"n={n}")

    calc = B.Calculator(name="t", title="t", compute=compute,
                        inputs=(B.Input(name="n", label="n", kind="int", default=2, min=1, max=9),))
    assert calc.run().text == "n=2"
    assert calc.run(m=1).error == "unknown input m"
    assert calc.run(n=10).invalid == ("n",)
    assert calc.run(n=3).to_dict()["invalid"] == ["n"] and calc.run(n=4).error == "four is not priced"


def test_what_the_chapters_share():
    assert B.capacity_factor("dropless") is None and B.capacity_factor("1.25") == 1.25
    assert all(B.capacity_factor(c) is None or B.capacity_factor(c) > 0 for c in B.CAPACITIES)
    wide, narrow = B.both(lambda *, width=100: f"<svg width={width}>")
    assert wide == "<svg width=100>" and narrow != wide
    assert "h100-80gb" in B.GPU_CHOICES and "llama-3.1-8b" in B.DECODER_PRESETS
