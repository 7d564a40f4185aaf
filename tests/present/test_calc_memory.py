"""vramlab.present.calc_memory: chapter 1's calculators (where memory goes), declared once: each is in the registry under its name, its defaults
pass its own inputs' checks, and it answers at them (tests/present/test_calculators.py checks what each shows)."""

import pytest

from tests.present import check_declared
from vramlab.present import calc_memory as M


@pytest.mark.parametrize("name", ['TRAINING', 'MOE', 'SERVING'])
def test_declared_registered_and_answers_at_its_defaults(name):
    check_declared(M, name)
