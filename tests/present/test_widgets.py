"""vramlab.present.widgets: the calculators as ipywidgets (Jupyter, Colab), and `show`, which gives a
book cell both front ends at once."""

import pytest

from vramlab.present import calculators as C
from vramlab.present import widgets as W


def test_show_gives_both_front_ends():
    bundle = W.show("collectives", ranks=4)._repr_mimebundle_()
    assert 'data-calc="collectives"' in bundle["text/html"]
    assert "application/vnd.jupyter.widget-view+json" in bundle  # Jupyter and Colab draw the widget
    with pytest.raises(ValueError, match="ranks: 1 is out of range"):
        W.show("collectives", ranks=1)


def test_widget_recomputes_what_the_page_shows():
    from vramlab.present.widgets import calculator_widget

    w = calculator_widget("training", model="gpt2", batch_size=8)
    controls = {c.description: c for box in w.children[1].children for c in box.children}
    out = w.children[2]
    controls["batch size"].value = 16
    controls["GPU"].value = "a100-80gb"
    expected = C.get("training").run(model="gpt2", batch_size=16, gpu="a100-80gb")
    assert expected.numbers["train_total"][1] in out.value and expected.svg in out.value
    assert expected.svg_narrow not in out.value  # one chart, the wide one: the notebook is not a phone


def test_explain_widget_reads_an_uploaded_file():
    """In Jupyter the snapshot is a FileUpload: its bytes (kept in the kernel) are explained as the page does."""
    import datetime

    import ipywidgets as IW

    from vramlab.present.widgets import calculator_widget

    w = calculator_widget("explain")
    controls = {c.description: c for box in w.children[1].children for c in box.children}
    up = controls["snapshot file"]
    assert isinstance(up, IW.FileUpload) and up.accept == ".pickle,.pkl"
    out = w.children[2]
    assert C.get("explain").run().numbers["allocated"][1] in out.value  # no file yet: the built-in example
    data = C.example_snapshot(batch_size=4)
    up.value = ({"name": "oom.pickle", "type": "", "size": len(data), "content": memoryview(data), "last_modified": datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)},)
    assert C.get("explain").run(snapshot=data).numbers["allocated"][1] in out.value and "your file" in out.value
    up.value = ({"name": "notes.txt", "type": "text/plain", "size": 3, "content": memoryview(b"hi\n"), "last_modified": datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)},)
    assert 'class="vl-error"' in out.value and "snapshot file: not a memory snapshot" in out.value
