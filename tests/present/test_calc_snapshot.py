"""vramlab.present.calc_snapshot: chapter 1's snapshot calculator, declared once: each is in the registry under its name, its defaults
pass its own inputs' checks, and it answers at them (tests/present/test_calculators.py checks what each shows)."""

import pytest

from tests.present import check_declared
from vramlab.present import calc_snapshot as M


@pytest.mark.parametrize("name", ['EXPLAIN'])
def test_declared_registered_and_answers_at_its_defaults(name):
    check_declared(M, name)
