"""Lab 6's streaming loop, in a process of its own: the answer's
`stream_forward(x, weights, streamed, link, *, run_layer, buffers, passes)` against a copy engine on a
virtual clock. A copy issued when the compute has reached time t starts at max(t, the end of the copy
before it) and lasts its bytes over the link's rate; link.wait(ticket) moves the compute to the
copy's end; run_layer(i, ...) moves it by layer i's seconds. Every misuse a real copy engine would
turn into wrong numbers or a stall is caught where it happens: a layer run on weights whose copy it
never waited for, a buffer refilled before its layer ran, a buffer that is not the link's. The
report: each pass's end on the virtual clock, the layers run, the buffers made, whether the output
is right."""

from __future__ import annotations

import torch

from . import common
from .common import Misuse


class _Link:
    def __init__(self, weights, rate):
        self.weights, self.rate, self.clock, self.engine = weights, rate, 0.0, 0.0
        self.buffers, self.ends, self.waited, self.holds = [], [], set(), {}

    def buffer(self, numel, dtype):
        b = torch.zeros(int(numel), dtype=dtype)
        self.buffers.append(b)
        return b

    def _which(self, t):
        p = t.data_ptr()
        for k, b in enumerate(self.buffers):
            if b.data_ptr() <= p < b.data_ptr() + b.numel() * b.element_size():
                return k
        return None

    def copy(self, dst, src):
        k = self._which(dst)
        if k is None:
            raise Misuse("link.copy's destination must be (a view of) a buffer from link.buffer")
        layer = next((i for i, w in enumerate(self.weights) if w.data_ptr() == src.data_ptr()), None)
        if layer is None:
            raise Misuse("link.copy's source must be one of the weights")
        if k in self.holds:
            raise Misuse(f"the copy of layer {layer} overwrites buffer {k} while it holds layer "
                         f"{self.holds[k][0]}'s weights, which have not run yet")
        start = max(self.clock, self.engine)
        self.engine = start + src.numel() * 1e6 / self.rate
        dst.copy_(src)
        self.ends.append(self.engine)
        self.holds[k] = (layer, len(self.ends) - 1)
        return len(self.ends) - 1

    def wait(self, ticket):
        self.clock = max(self.clock, self.ends[ticket])
        self.waited.add(ticket)


def run(case, answer, names):
    sizes, secs, streamed, link_GBps, buffers, passes = (case[k] for k in ("sizes", "secs", "streamed", "link", "buffers", "passes"))
    weights = [torch.arange(s // 10**6, dtype=torch.float32) * 1e-3 + i for i, s in enumerate(sizes)]
    link = _Link(weights, link_GBps * 1e9)
    marks, calls = [], [0]

    def run_layer(i, x, w):
        if not isinstance(w, torch.Tensor) or w.numel() != weights[i].numel():
            raise Misuse(f"layer {i} ran on a weight of {getattr(w, 'numel', lambda: '?')()} values; it has {weights[i].numel()}")
        if i in streamed:
            k = link._which(w)
            if k is None:
                raise Misuse(f"streamed layer {i} ran on its host weights, not on a device buffer")
            held = link.holds.get(k)
            if held is None or held[0] != i:
                raise Misuse(f"layer {i} ran on buffer {k}, which holds " + ("nothing" if held is None else f"layer {held[0]}'s weights"))
            if held[1] not in link.waited:
                raise Misuse(f"layer {i} ran before waiting for its copy (link.wait(ticket))")
            del link.holds[k]
        elif w.data_ptr() != weights[i].data_ptr():
            raise Misuse(f"resident layer {i} must run on its own weights")
        calls[0] += 1
        link.clock += secs[i]
        if calls[0] % len(weights) == 0:  # the end of a pass
            marks.append(link.clock)
        return x * 0.5 + float(w.double().sum()) * (i + 1)

    x = torch.ones(3, dtype=torch.float64)
    try:
        out = common.defined(answer, names[0])(x, weights, list(streamed), link, run_layer=run_layer, buffers=buffers,
                                               passes=passes)
    except Misuse as e:
        return {"misuse": str(e)}
    want = x
    for _ in range(passes):
        for i, w in enumerate(weights):
            want = want * 0.5 + float(w.double().sum()) * (i + 1)
    return {"marks": marks, "calls": calls[0], "buffers": [b.numel() for b in link.buffers],
            "matches": isinstance(out, torch.Tensor) and out.shape == want.shape and bool(torch.equal(out, want))}
