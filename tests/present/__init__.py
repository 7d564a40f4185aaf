"""Tests of vramlab.present; `check_declared` is the check every calculator module's test file runs."""


def check_declared(module, name: str) -> None:
    """The calculator `name` of `module` is in the registry under its own name, its defaults pass its own inputs'
    checks, and it answers at them (tests/present/test_calculators.py checks what each shows)."""
    from vramlab.present import calculators as C

    calc = getattr(module, name)
    assert C.get(calc.name) is calc
    assert all(i.check(i.default) == i.default for i in calc.inputs if i.kind != "file")
    r = calc.run()
    assert not r.error and r.text and r.numbers and r.svg, r.error
    assert set(r.numbers) <= set(calc.number_labels)
