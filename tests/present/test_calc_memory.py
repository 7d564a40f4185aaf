"""vramlab.present.calc_memory: chapter 1's calculators (where memory goes), declared once: each is in the registry under its name, its defaults
pass its own inputs' checks, and it answers at them (tests/present/test_calculators.py checks what each shows)."""

import pytest

from vramlab.present import calc_memory as M
from vramlab.present import calculators as C


@pytest.mark.parametrize("name", ['TRAINING', 'MOE', 'SERVING'])
def test_declared_registered_and_answers_at_its_defaults(name):
    calc = getattr(M, name)
    assert C.get(calc.name) is calc
    assert all(i.check(i.default) == i.default for i in calc.inputs if i.kind != "file")
    r = calc.run()
    assert not r.error and r.text and r.numbers and r.svg, r.error
    assert set(r.numbers) <= set(calc.number_labels)
