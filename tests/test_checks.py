"""vramlab.checks: the one vocabulary every public entry point checks its arguments with. What each
check takes and refuses, and that its message names the argument (the modules' own tests check the
calls: tests/test_args_*.py, tests/test_inputs.py)."""

from __future__ import annotations

import argparse
import math

import pytest

from vramlab import checks


@pytest.mark.parametrize("good, expect", [(1, 1), (7, 7), (checks.MAX_COUNT, checks.MAX_COUNT)])
def test_whole_takes_whole_numbers(good, expect):
    got = checks.whole("n", good)
    assert got == expect and type(got) is int


@pytest.mark.parametrize("bad", [0, -1, checks.MAX_COUNT + 1, 2.0, True, "2", None, math.nan])
def test_whole_refuses_and_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^n "):
        checks.whole("n", bad)


def test_numpy_scalars_come_back_as_plain_python():
    np = pytest.importorskip("numpy")
    assert type(checks.whole("n", np.int64(3))) is int and checks.whole("n", np.int64(3)) == 3
    assert type(checks.number("x", np.float32(0.5))) is float
    assert checks.one_of("stage", np.int64(2), (0, 1, 2, 3)) == 2 and type(checks.one_of("stage", np.int64(2), (0, 1, 2, 3))) is int
    with pytest.raises(ValueError):
        checks.whole("n", np.bool_(True))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "1", 10**400])
def test_number_refuses_what_is_not_a_finite_real(bad):
    with pytest.raises(ValueError, match="x"):
        checks.number("x", bad)


def test_bounds_of_number_fraction_and_share():
    assert checks.number("x", 0) == 0.0 and checks.positive("x", 1e-30) == 1e-30
    with pytest.raises(ValueError):
        checks.positive("x", 0)
    assert checks.fraction("f", 1) == 1.0
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="f"):
            checks.fraction("f", bad)
    with pytest.raises(ValueError):
        checks.number("x", 5, hi=4)


def test_one_of_wants_the_same_kind():
    assert checks.one_of("stage", 2, (0, 1, 2, 3)) == 2
    for bad in (2.0, True, "2"):
        with pytest.raises(ValueError, match="stage"):
            checks.one_of("stage", bad, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="fp32"):  # the message lists the choices
        checks.one_of("precision", "fp64", ("fp32", "bf16"))


def test_lists_and_text():
    assert checks.wholes("sizes", [0, 3]) == [0, 3] and checks.numbers("xs", (1, 2.5)) == [1.0, 2.5]
    with pytest.raises(ValueError, match="sizes"):
        checks.wholes("sizes", [1, -2])
    with pytest.raises(ValueError, match="sizes"):
        checks.wholes("sizes", [])
    assert checks.text("label", "x") == "x"
    with pytest.raises(ValueError, match="label"):
        checks.text("label", "")
    assert checks.flag("f", True) is True
    with pytest.raises(ValueError, match="f"):
        checks.flag("f", 1)


def test_unknown_keywords_are_named():
    checks.no_unknown("fit", {"seq_len": 1}, ("seq_len", "batch_size"))
    with pytest.raises(ValueError, match="reserve"):
        checks.no_unknown("fit", {"reserve": 1}, ("seq_len",))


def test_index_and_is_bool():
    assert checks.index(3) == 3 and checks.index(True) is None and checks.index(3.0) is None
    assert checks.is_bool(False) and not checks.is_bool(0)


def test_argtype_and_parser_give_one_line_and_exit_2(capsys):
    p = checks.Parser(prog="prog")
    p.add_argument("--n", type=checks.argtype(checks.whole))
    assert p.parse_args(["--n", "4"]).n == 4
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("prog: error: ") and "--n" in err
    assert isinstance(p, argparse.ArgumentParser)


def test_output_path_refuses_before_any_work(tmp_path, capsys):
    checks.output_path("prog", tmp_path / "out.json")  # a new file in a folder that exists
    (tmp_path / "afile").write_text("x")
    for bad, says in ((tmp_path / "afile" / "x.json", "not a folder"), (tmp_path, "folder"),
                      (tmp_path / "nodir" / "x.json", "does not exist")):
        with pytest.raises(SystemExit) as e:
            checks.output_path("prog", bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    checks.output_path("prog", tmp_path / "made" / "x.json", make_folder=True)
