"""vramlab.present.tables: one table, HTML for pages and notebooks, aligned text for terminals."""

import pytest

from vramlab.present.tables import Cell, Table


def test_html_and_text_show_the_same_cells():
    t = Table(["setup", "predicted", "measured", "error"],
              [["ZeRO-1", "1.20 GiB", "1.19 GiB", "+0.8 %"], ["FSDP2 <x>", "980 MiB", "1,001 MiB", Cell("-2.1 %", "bad")]],
              caption="gpt2, 2 ranks", notes="torch 2.13.0")
    h = t._repr_html_()
    assert h.count("<tr>") == 3 and "<caption>gpt2, 2 ranks</caption>" in h and "FSDP2 &lt;x&gt;" in h
    assert 'class="vl-bad"' in h and '<p class="vl-table-note">torch 2.13.0</p>' in h
    assert t.align == "lrrr"  # numbers with units and signs read as numbers
    lines = str(t).splitlines()
    assert lines[0] == "gpt2, 2 ranks" and lines[-1] == "torch 2.13.0"
    assert lines[3].endswith("+0.8 %") and len(lines[3]) == len(lines[4])


def test_groups_and_explicit_alignment():
    t = Table(["a", "b", "c"], [[1, 2, 3]], groups=[("", 1), ("GiB", 2)], align="lcr")
    assert '<th colspan="2" class="vl-group">GiB</th>' in t._repr_html_()


@pytest.mark.parametrize("kw, msg", [
    (dict(columns=[], rows=[]), "at least one column"),
    (dict(columns=["a"], rows=[[1, 2]]), "row 0 has 2 cells"),
    (dict(columns=["a", "b"], rows=[], align="x"), "align must"),
    (dict(columns=["a", "b"], rows=[], groups=[("g", 3)]), "groups must span"),
])
def test_bad_tables_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Table(**kw)


def test_cell_marks_are_checked():
    with pytest.raises(ValueError, match="cls must be"):
        Cell("x", "red")
