"""Lab 6's link measurement, in a process of its own: the answer's `link_GBps(link, host)` against a
copy engine on a virtual clock. link.copy(buffer, host) queues a copy that lasts its bytes over the
link's rate (the first one also pays a one-time setup, as a driver's first copy does, and one later
copy is slowed threefold, as by other traffic); link.wait(ticket) moves the compute's clock to the
copy's end; link.clock() reads that clock. A clock read before waiting has not moved."""

from __future__ import annotations

import torch

from . import common
from .common import Misuse


class _Link:
    def __init__(self, host, rate, setup, slow):
        self.host, self.rate, self.setup, self.slow = host, rate, setup, slow
        self.now, self.engine, self.ends, self.buffers, self.waits = 0.0, 0.0, [], [], 0

    def buffer(self, numel, dtype):
        b = torch.empty(int(numel), dtype=dtype)
        self.buffers.append(b)
        return b

    def copy(self, dst, src):
        if not any(b.data_ptr() <= dst.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in self.buffers):
            raise Misuse("link.copy's destination must be (a view of) a buffer from link.buffer")
        if src.data_ptr() != self.host.data_ptr() or src.numel() != self.host.numel():
            raise Misuse("copy the whole host tensor: link.copy(buffer, host)")
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise Misuse(f"the buffer holds {dst.numel()} {dst.dtype} values, the host tensor {src.numel()} {src.dtype}")
        k = len(self.ends)
        seconds = src.numel() * src.element_size() / self.rate
        if k == 0:
            seconds += self.setup
        if k == self.slow:
            seconds *= 3
        self.engine = max(self.now, self.engine) + seconds
        self.ends.append(self.engine)
        dst.copy_(src)
        return k

    def wait(self, ticket):
        self.now = max(self.now, self.ends[ticket])
        self.waits += 1

    def clock(self):
        return self.now


def run(case, answer, names):
    host = torch.arange(case["numel"], dtype=getattr(torch, case["dtype"]))
    link = _Link(host, case["GBps"] * 1e9, case["setup"], case["slow"])
    try:
        got = common.defined(answer, names[0])(link, host)
    except Misuse as e:
        return {"misuse": str(e)}
    except ZeroDivisionError:
        return {"zero": True, "copies": len(link.ends), "waits": link.waits}
    return {"got": float(got), "copies": len(link.ends), "waits": link.waits}
