"""vramlab.present.calc_parallel: chapters 2 and 3's calculators (collectives, parallelism), declared once: each is in the registry under its name, its defaults
pass its own inputs' checks, and it answers at them (tests/present/test_calculators.py checks what each shows)."""

import pytest

from tests.present import check_declared
from vramlab.present import calc_parallel as M


@pytest.mark.parametrize("name", ['COLLECTIVES', 'PARALLEL', 'LAYOUTS', 'CONTEXT', 'EXPERTS'])
def test_declared_registered_and_answers_at_its_defaults(name):
    check_declared(M, name)
