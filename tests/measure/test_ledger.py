"""`vramlab.measure.ledger`: the record of every storage a rank creates, and lab 3's live bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from vramlab.measure import ledger  # noqa: E402


def test_a_measured_step_sorts_what_it_holds(monkeypatch):
    """A steady-state step of a model built inside the ledger (as a rank builds it): the parameters, gradients
    and inputs that exist before the step are those categories at every point; what the forward creates is
    activations."""
    import torch

    def step(tr):
        tr.set_phase("forward")
        y = model(x)
        tr.set_phase("loss")
        loss = y.square().sum()
        tr.set_phase("backward")
        loss.backward()
        tr.set_phase("optimizer")
        opt.step()

    with ledger.Ledger() as led:
        monkeypatch.setattr(ledger, "LEDGER", led)
        model = torch.nn.Linear(64, 64, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 64)
        model(x).sum().backward()  # the gradients exist before the step, and are kept
        opt.zero_grad(set_to_none=False)
        out = ledger.ledger_step(step, [model], opt, [x])
    assert out["resident_unseen_by_ledger"] == {}
    assert out["phases"]["forward"]["categories"]["activations"] >= 32 * 64 * 4
    assert out["marks"] == {} and out["peak"] >= 2 * 64 * 64 * 4 + 2 * 32 * 64 * 4
    cats = out["at_peak"]["categories"]
    assert (cats["parameters"], cats["gradients"], cats["inputs"]) == (64 * 64 * 4, 64 * 64 * 4, 32 * 64 * 4)


def test_resizes_in_place_are_frees_and_allocations():
    import torch

    with ledger.Ledger() as led, ledger.track_resizes(led):
        t = torch.empty(256)
        before = led.now
        st = t.untyped_storage()
        st.resize_(0)
        assert led.now == before - 1024
        st.resize_(1024)
        assert led.now == before


def test_live_bytes_counts_from_creation_to_free():
    import torch

    with ledger.LiveBytes({"storages": set()}) as live:
        t = torch.empty(1000)
        del t
        u = torch.empty(10)
    assert live.peak == 4000 and live.now == 40
    del u
