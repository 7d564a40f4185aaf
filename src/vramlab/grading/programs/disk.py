"""Lab 6's out-of-core forward, in a process of its own: the answer's
`forward_from_disk(f, manifest, x, *, run_layer, align, buffer)` on a model stored in one file, as
ZeRO-Infinity's NVMe swapper lays tensors out: one after another, each starting at a multiple of
`align` (O_DIRECT's block), zeros in between. The harness writes the file into its scratch folder
from the case's seed (`build`, which the check's own process calls too, to compute the reference)
and hands the answer a file object of its own, `f` (seek, tell, read and readinto; no name, no
descriptor), that logs every read: where it started and how many bytes it returned. `buffer` is a
bytearray as large as the largest layer with its padding.

Each layer's reads are those made since the layer before it ran. When layer i runs, the harness
checks its weight (the manifest's dtype and shape, the file's values) and its reads: they start at
layer i's offset and cover its bytes once, reaching at most into its padding. One call reading more
than the buffer holds (the whole file) is stopped where it happens. What the answer holds besides the
buffer is measured at every read and every layer: the Python objects it made (bytes, bytearrays,
numpy arrays: tracemalloc, without what an import inside the answer allocates) and the tensors whose
memory torch allocated for it (the objects made since the answer started, as the garbage collector
lists them; a tensor viewing Python memory is counted there once, by tracemalloc).

The report: the first misuse, the most held besides the buffer (and where), the first problem with
a layer's reads or weight, an error the answer raised, the layers run and the output."""

from __future__ import annotations

import gc
import os
import tracemalloc

import torch

from . import common
from .common import Misuse

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MODULUS = 1009.0  # run_layer keeps x's values whole numbers below this: every sum exact in float64
FILE = "model.bin"
_IMPORTS = [tracemalloc.Filter(False, "<frozen importlib._bootstrap>", all_frames=True),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>", all_frames=True)]


def aligned(nbytes: int, align: int) -> int:
    """`nbytes` rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def layout(case) -> tuple[list[tuple[int, int]], int]:
    """Each layer's (offset, bytes) in the file, and the file's size (a multiple of the alignment)."""
    spans, offset = [], 0
    for _, shape, dtype in case["layers"]:
        nbytes = numel(shape) * DTYPES[dtype].itemsize
        spans.append((offset, nbytes))
        offset += aligned(nbytes, case["align"])
    return spans, offset


def build(case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The case's input (float64) and weights (the manifest's dtypes), whole numbers drawn from its
    seed: exact in every dtype, so the forward's sums are exact whatever their order."""
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randint(-8, 9, (case["rows"], case["width"]), generator=g).double()
    weights = [torch.randint(-16, 17, tuple(shape), generator=g).to(DTYPES[dtype]) for _, shape, dtype in case["layers"]]
    return x, weights


def apply(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One layer: a matrix (out, in) multiplies, a vector scales; the result is kept below MODULUS."""
    y = x @ w.double().T if w.dim() == 2 else x * w.double() + 1
    return torch.remainder(y, MODULUS)


def write(case, weights, path: str) -> int:
    """The file: each layer's bytes at its offset, zeros between; its size."""
    spans, size = layout(case)
    blob = bytearray(size)
    flat = torch.frombuffer(blob, dtype=torch.uint8)
    for (offset, nbytes), w in zip(spans, weights):
        flat[offset:offset + nbytes].copy_(w.reshape(-1).view(torch.uint8))
    del flat
    with open(path, "wb") as fh:
        fh.write(blob)
    return size


class _State:
    """What the harness notes while the answer runs (the harness's, not the answer's: the answer sees
    only `f`, `run_layer` and the buffer)."""

    def __init__(self, case, spans, size, buffer):
        self.case, self.spans, self.size, self.align = case, spans, size, case["align"]
        self.buf_lo = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        self.buf_hi = self.buf_lo + len(buffer)
        self.buf_bytes = len(buffer)
        self.log: list[tuple[int, int]] = []  # (where a read started, bytes it returned)
        self.first = 0  # the log's first read of the layer to run next
        self.calls = 0
        self.misuse = self.problem = None
        self.used_read = False
        self.most, self.where = 0, ""
        self.skip: set[int] = set()
        self.base = 0

    def fail(self, message: str) -> Misuse:
        self.misuse = self.misuse or message
        return Misuse(message)

    def note(self, message: str) -> None:
        self.problem = self.problem or message

    # --- what the answer holds besides the buffer ---
    def start(self) -> None:
        """Before the answer runs: the storages alive now are not its own; the objects it makes from
        now on stay in the collector's youngest generations (no automatic collection)."""
        gc.collect()
        self.skip = set()
        for t in gc.get_objects():
            if issubclass(type(t), torch.Tensor):
                try:
                    self.skip.add(t.untyped_storage().data_ptr())
                except Exception:  # noqa: BLE001 - a tensor without storage (meta, a wrapper subclass)
                    pass
        gc.disable()
        tracemalloc.start(16)
        self.base = tracemalloc.get_traced_memory()[0]

    def python_bytes(self) -> int:
        now = tracemalloc.get_traced_memory()[0] - self.base
        if now <= self.case["slack"]:
            return now
        snap = tracemalloc.take_snapshot().filter_traces(_IMPORTS)  # not what an import allocated
        return sum(s.size for s in snap.statistics("filename"))

    def torch_bytes(self) -> int:
        """The tensors made since the answer started whose memory torch allocated (not views of the
        buffer or of Python objects, which tracemalloc counts), each storage once."""
        seen, n = set(), 0
        for gen in (0, 1):
            for t in gc.get_objects(generation=gen):
                if not issubclass(type(t), torch.Tensor):
                    continue
                try:
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    if not ptr or ptr in self.skip or ptr in seen or not st.resizable() or self.buf_lo <= ptr < self.buf_hi:
                        continue
                    seen.add(ptr)
                    n += st.nbytes()
                except Exception:  # noqa: BLE001 - a tensor without storage (meta, a wrapper subclass)
                    continue
        return n

    def sample(self, where: str, tensors: bool = False) -> None:
        held = self.python_bytes() + (self.torch_bytes() if tensors else 0)
        if held > self.most:
            self.most, self.where = held, where

    # --- each layer's reads ---
    def check_reads(self, i: int) -> None:
        """Layer i's reads (those since layer i - 1 ran) start at its offset and cover its bytes once,
        reaching at most into its padding; else the first problem is noted."""
        offset, nbytes = self.spans[i]
        span, align = aligned(nbytes, self.align), self.align
        _, shape, dtype = self.case["layers"][i]
        width, count = DTYPES[dtype].itemsize, numel(shape)
        reads = sorted((p, g) for p, g in self.log[self.first:] if g > 0)
        if not reads:
            return self.note(f"layer {i} ran without reading its bytes through f: f.seek(its offset), then "
                             f"f.readinto(memoryview(buffer)[:its bytes])")
        start = reads[0][0]
        if start != offset:
            return self.note(f"layer {i}'s bytes start at offset {offset:,}, not {start:,}{self._offset_hint(i, start)}")
        end = start
        for p, g in reads:
            if p < end:
                return self.note(f"some of layer {i}'s bytes were read twice ({sum(g for _, g in reads):,} bytes read "
                                 f"for a layer of {nbytes:,}): read each layer once")
            if p > end:
                return self.note(f"the reads of layer {i} skip bytes {end:,} to {p:,}: read its {nbytes:,} bytes from "
                                 f"offset {offset:,} in one piece")
            end = p + g
        length = end - offset
        if nbytes <= length <= span:
            return None
        other = next((w for w in (1, 2, 4, 8) if w != width and length in (count * w, aligned(count * w, align))), None)
        if other is not None:
            return self.note(f"layer {i} is {dtype}, {width} bytes a value: its {count:,} values are {nbytes:,} bytes, "
                             f"but {length:,} were read ({other} bytes a value): take each layer's width from its dtype")
        if length < nbytes:
            return self.note(f"only {length:,} of layer {i}'s {nbytes:,} bytes were read before it ran (readinto "
                             "returns how many it read)")
        return self.note(f"{length:,} bytes were read for layer {i}: it is {nbytes:,} bytes ({span:,} with its padding to "
                         f"a multiple of align={align}); read those and no more (memoryview(buffer)[:nbytes])")

    def _offset_hint(self, i: int, start: int) -> str:
        sizes = [numel(s) * DTYPES[d].itemsize for _, s, d in self.case["layers"]]
        if start == sum(sizes[:i]):
            return (f": the layers are not packed end to end; each starts at the next multiple of align={self.align} "
                    "after the one before (zeros in between)")
        for w in (2, 4):
            if start == sum(aligned(numel(s) * w, self.align) for _, s, _ in self.case["layers"][:i]):
                return f": those offsets count every layer as {w} bytes a value; take each layer's width from its dtype"
        other = next((j for j, (o, _) in enumerate(self.spans) if o == start), None)
        return f" (that is layer {other}'s offset)" if other is not None else ""


class _File:
    """The model's file as the answer sees it: seek, tell, read and readinto, each read logged."""

    __slots__ = ("_raw", "_state", "_pos")

    def __init__(self, raw, state: _State):
        self._raw, self._state, self._pos = raw, state, 0

    def seek(self, offset, whence=0):
        self._pos = self._raw.seek(offset, whence)
        return self._pos

    def tell(self):
        return self._pos

    def readable(self):
        return True

    def seekable(self):
        return True

    def _guard(self, call: str, want: int, whole: bool) -> None:
        st = self._state
        if want <= st.buf_bytes:
            return
        if whole or (self._pos == 0 and want >= st.size):
            raise st.fail(f"f.{call} read the whole file ({st.size:,} bytes) at once: read one layer at a time into "
                          f"the buffer ({st.buf_bytes:,} bytes, the largest layer with its padding)")
        raise st.fail(f"one f.{call} asked for {want:,} bytes, more than the largest layer with its padding "
                      f"({st.buf_bytes:,}, the buffer's size): read one layer at a time")

    def readinto(self, b):
        want = memoryview(b).nbytes
        self._guard("readinto", want, False)
        start = self._pos
        got = self._raw.readinto(b) or 0
        self._pos += got
        self._state.log.append((start, got))
        self._state.sample(f"while reading for layer {self._state.calls}")
        return got

    def read(self, size=-1):
        st = self._state
        whole = size is None or size < 0
        self._guard("read()" if whole else "read", st.size - self._pos if whole else size, whole)
        st.used_read = True
        start = self._pos
        data = self._raw.read(size)
        self._pos += len(data)
        st.log.append((start, len(data)))
        st.sample(f"while reading for layer {st.calls}")
        return data


def run(case, answer, names):
    fn = common.defined(answer, names[0])
    spans, size = layout(case)
    x, weights = build(case)
    path = os.path.abspath(FILE)
    write(case, weights, path)
    buffer = bytearray(max(aligned(n, case["align"]) for _, n in spans))
    manifest = [(name, tuple(shape), DTYPES[dtype]) for name, shape, dtype in case["layers"]]
    state = _State(case, spans, size, buffer)
    n_layers = len(manifest)

    def run_layer(i, x, w):
        st = state
        k = st.calls
        st.sample(f"when layer {k} ran", tensors=True)
        if k >= n_layers:
            raise st.fail(f"run_layer ran {k + 1} times: the manifest has {n_layers} layers")
        if i != k:
            raise st.fail(f"run the layers in order: run_layer({i!r}, ...) came " +
                          ("first" if k == 0 else f"after layer {k - 1}"))
        _, shape, dtype = case["layers"][k]
        if not isinstance(w, torch.Tensor):
            raise st.fail(f"layer {i} ran on a {type(w).__name__}, not a tensor")
        if w.dtype != DTYPES[dtype]:
            raise st.fail(f"layer {i} ran on a {str(w.dtype).replace('torch.', '')} weight: the manifest says {dtype} "
                          f"({DTYPES[dtype].itemsize} bytes a value): view its bytes as that dtype")
        if tuple(w.shape) != tuple(shape):
            raise st.fail(f"layer {i} ran on a weight of shape {tuple(w.shape)}: the manifest says {tuple(shape)}")
        want_in = shape[-1]
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64 or tuple(x.shape) != (case["rows"], want_in):
            raise st.fail(f"layer {i}'s x must be what run_layer returned for the layer before it (the input x for "
                          "the first)")
        st.check_reads(i)
        if st.problem is None and not torch.equal(w, weights[i]):
            st.note(f"layer {i}'s weight is not the bytes read for it: view the buffer from its start as the layer's "
                    "dtype and shape (torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape))")
        out = apply(x, w)
        st.calls += 1
        st.first = len(st.log)
        return out

    # warm up what the harness runs while the answer's memory is measured, so none of it is a first call
    apply(torch.zeros(1, 2, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float16))
    apply(torch.zeros(1, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.bfloat16))
    torch.frombuffer(bytearray(8), dtype=torch.float32).view(2, 1)
    out = error = None
    with open(path, "rb", buffering=0) as raw:
        f = _File(raw, state)
        state.start()
        try:
            out = fn(f, manifest, x, run_layer=run_layer, align=case["align"], buffer=buffer)
        except Misuse as e:
            state.misuse = state.misuse or str(e)
        except Exception as e:  # noqa: BLE001 - the answer's, reported
            error = f"{type(e).__name__}: {e}"[:300]
        finally:
            tracemalloc.stop()
            gc.enable()
    os.remove(path)
    after = sum(g for _, g in state.log[state.first:])
    if after and state.calls == n_layers:
        state.note(f"{after:,} bytes were read after the last layer ran")
    return {"misuse": state.misuse, "held": state.most, "where": state.where, "used_read": state.used_read,
            "problem": state.problem, "error": error, "calls": state.calls,
            "out": common.tolist(out), "out_kind": type(out).__name__}
