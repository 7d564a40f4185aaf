"""vramlab.snapshot: a PyTorch memory snapshot explained, every byte named.

The snapshots are built here to the format `torch.cuda.memory._snapshot()` documents (torch/cuda/memory.py) and
`torch/csrc/cuda/Module.cpp` writes (segments tiled by blocks, frames innermost first, C++ frames beside
Python's with the default stacks="all"), pickled, and checked with PyTorch's own parsers
(`torch.cuda._memory_viz`: `segsum`, `memory`, `segments`, `trace`, which run without a GPU) so that our
totals are PyTorch's, not our own arithmetic read back.
"""

import json
import os
import pickle
from pathlib import Path

import pytest

from vramlab import memory, snapshot as S

MiB, GiB = 1 << 20, 1 << 30
TORCH = "/venv/lib/python3.11/site-packages/torch"


def py(path, name, line=1):
    return {"filename": path, "line": line, "name": name}


def cpp(name):
    return {"filename": "??", "line": 0, "name": name}


TRAIN = py("/home/me/train.py", "main", 40)
PARAM = [py(f"{TORCH}/nn/modules/module.py", "convert", 1341), py(f"{TORCH}/nn/modules/module.py", "_apply", 900),
         py(f"{TORCH}/nn/modules/module.py", "to", 1355), TRAIN]
ADAM_INIT = [py(f"{TORCH}/optim/adam.py", "_init_group", 150), py(f"{TORCH}/optim/adam.py", "step", 220),
             py(f"{TORCH}/optim/optimizer.py", "wrapper", 485), TRAIN]
ADAM_STEP = [py(f"{TORCH}/optim/adam.py", "_multi_tensor_adam", 600), py(f"{TORCH}/optim/adam.py", "step", 240), TRAIN]
FORWARD = [cpp("at::native::addmm_out_cuda(...)"), py(f"{TORCH}/nn/modules/linear.py", "forward", 125),
           py(f"{TORCH}/nn/modules/module.py", "_call_impl", 1750), py("/home/me/model.py", "forward", 30), TRAIN]
ENGINE = [cpp("torch::autograd::Engine::evaluate_function(...)"), cpp("torch::autograd::Engine::thread_main(...)")]
GRAD_ACC = [cpp("torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)")] + ENGINE
MM_BACKWARD = [cpp("at::native::mm_out_cuda(...)"), cpp("torch::autograd::generated::MmBackward0::apply(...)")] + ENGINE
CKPT = ([py(f"{TORCH}/nn/modules/linear.py", "forward", 125), py(f"{TORCH}/utils/checkpoint.py", "recompute_fn", 1500)]
        + ENGINE)
CUBLAS = [cpp("at::cuda::getCUDABlasLtWorkspace()"), cpp("at::cuda::blas::gemm_and_bias<float>(...)")] + FORWARD
KV = [py("/venv/lib/python3.11/site-packages/transformers/cache_utils.py", "update", 700),
      py("/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py", "forward", 250), TRAIN]
INPUT = [TRAIN]  # torch.randn(..., device="cuda") in the script: no rule knows what it is


class Builder:
    """Segments and blocks as `_snapshot()` writes them: each segment's blocks tile it, in address order."""

    def __init__(self):
        self.segments, self.trace, self.address = [], [], 0x7F0000000000

    def segment(self, *blocks, large=True, stream=0):
        """blocks: (size, state, frames[, requested]); a segment's size is the sum of its blocks."""
        addr, out = self.address, []
        for b in blocks:
            size, state, frames = b[:3]
            requested = b[3] if len(b) > 3 else size
            out.append({"address": addr, "size": size, "requested_size": requested, "state": state, "frames": frames})
            addr += size
        total = addr - self.address
        alloc = sum(b["size"] for b in out if b["state"] == "active_allocated")
        active = sum(b["size"] for b in out if b["state"] != "inactive")
        self.segments.append({"device": 0, "address": self.address, "total_size": total, "allocated_size": alloc,
                              "active_size": active,
                              "requested_size": sum(b["requested_size"] for b in out if b["state"] != "inactive"),
                              "stream": stream, "segment_type": "large" if large else "small",
                              "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": out})
        self.address = addr + (64 << 20)
        return self

    def oom(self, size, device_free, frames=FORWARD):
        self.trace.append({"action": "oom", "device_free": device_free, "size": size, "stream": 0,
                           "time_us": 5, "frames": frames})
        return self

    def alloc_events(self):
        for s in self.segments:
            self.trace.append({"action": "segment_alloc", "addr": s["address"], "size": s["total_size"], "stream": 0,
                               "time_us": 1, "frames": []})
            for b in s["blocks"]:
                if b["state"] == "active_allocated":
                    self.trace.append({"action": "alloc", "addr": b["address"], "size": b["size"], "stream": 0,
                                       "time_us": 2, "frames": b["frames"]})
        return self

    def dict(self):
        return {"segments": self.segments, "device_traces": [self.trace],
                "allocator_settings": {"PYTORCH_ALLOC_CONF": "", "expandable_segments": False}}

    def bytes(self):
        return pickle.dumps(self.dict())


def training_oom():
    """A step that ran out of memory in forward: parameters, their gradients (one stolen from MmBackward0, one
    set by AccumulateGrad), Adam's states, live activations, a cuBLAS workspace, the input batch, a backward
    transient, fragmentation in a segment holding tensors, one wholly free segment, a block awaiting another
    stream; a 600 MiB request fails with 100 MiB free on the device."""
    b = Builder()
    b.segment((64 * MiB, "active_allocated", PARAM), (64 * MiB, "active_allocated", PARAM),
              (32 * MiB, "active_allocated", PARAM, 32 * MiB - 300))  # rounding: requested < size
    b.segment((64 * MiB, "active_allocated", MM_BACKWARD), (64 * MiB, "active_allocated", GRAD_ACC),
              (32 * MiB, "inactive", []))  # the third parameter has no gradient yet: 32 MiB free in this segment
    b.segment((128 * MiB, "active_allocated", ADAM_INIT), (128 * MiB, "active_allocated", ADAM_INIT),
              (64 * MiB, "active_allocated", ADAM_INIT))
    b.segment((200 * MiB, "active_allocated", FORWARD), (100 * MiB, "inactive", []),
              (300 * MiB, "active_allocated", FORWARD), (40 * MiB, "active_allocated", MM_BACKWARD))
    b.segment((8 * MiB, "active_allocated", CUBLAS), (12 * MiB, "active_allocated", INPUT))
    b.segment((2 * MiB, "inactive", []), large=False)  # wholly free: empty_cache would return it
    b.segment((1 * MiB, "active_pending_free", FORWARD), (1 * MiB, "inactive", []), large=False)
    return b.alloc_events().oom(600 * MiB, 100 * MiB)


def _viz():
    return pytest.importorskip("torch.cuda._memory_viz")


def _flame_totals(lines: str) -> dict[str, int]:
    """Bytes by block state from `_memory_viz.memory`'s flamegraph input ("stream_0;state;frames bytes")."""
    out = {}
    for line in lines.strip().splitlines():
        stack, n = line.rsplit(" ", 1)
        state = next(t for t in stack.split(";") if t in S.STATES)  # memory(): stream;state; segments(): +seg
        out[state] = out.get(state, 0) + int(n)
    return out


# ----------------------------------------------------------------------------- PyTorch's parsers agree

def test_totals_agree_with_pytorchs_memory_viz():
    viz = _viz()
    data = training_oom().dict()
    e = S.explain(pickle.dumps(data))
    # segsum asserts its own accounting (every segment's blocks tile it) and prints reserved and requested bytes
    summary = viz.segsum(data)
    assert f"total_reserved: {viz.Bytes(e.reserved)}" in summary
    assert f"total_allocated: {viz.Bytes(e.requested)}" in summary  # PyTorch's "allocated" here is requested
    assert f"segments: {len(data['segments'])}" in summary
    # memory()'s flamegraph lines: active_allocated blocks' requested bytes + their rounding gaps = allocated
    for parser in (viz.memory, viz.segments):
        by_state = _flame_totals(parser(data, format_flamegraph=lambda s: s))
        assert by_state["active_allocated"] == e.allocated == sum(e.by_category.values())
        assert sum(by_state.values()) == e.reserved
        assert by_state["inactive"] == e.fragmentation + e.free_segments
        assert by_state["active_pending_free"] == e.pending_free
    # trace() reads the oom entry as we do
    text = viz.trace(data)
    assert f"raise OutOfMemoryError # {viz.Bytes(600 * MiB)} requested, {viz.Bytes(100 * MiB)} free in CUDA" in text
    assert e.oom.size == 600 * MiB and e.oom.device_free == 100 * MiB


def test_every_frame_pytorch_shows_is_one_we_classified():
    """The frames `_memory_viz` prints for each allocated block (its own filter) are the frames our rule read:
    the per-stack byte totals of its flamegraph and of our blocks agree stack by stack."""
    viz = _viz()
    data = training_oom().dict()
    theirs = {}
    for line in viz.memory(data, format_flamegraph=lambda s: s).strip().splitlines():
        stack, n = line.rsplit(" ", 1)
        _, state, frames = stack.split(";", 2)  # memory(): "stream_0;state;frames root first"
        if state == "active_allocated" and frames != "<gaps>":
            theirs[frames] = theirs.get(frames, 0) + int(n)
    ours = {}
    for blk in S.load_snapshot(data).blocks:
        if blk.state == "active_allocated":
            key = ";".join(viz._frames_fmt([f.__dict__ for f in blk.frames], reverse=True)) or "<non-python>"
            ours[key] = ours.get(key, 0) + blk.requested
    assert ours == theirs


# ----------------------------------------------------------------------------- every byte named

def test_every_allocated_byte_is_in_one_category():
    e = S.explain(training_oom().bytes())
    assert sum(e.by_category.values()) == e.allocated == sum(e.by_rule.values())
    assert e.pending_free + e.fragmentation + e.free_segments + e.uncovered == e.reserved - e.allocated == e.cached_free
    assert e.uncovered == 0
    assert e.by_category == {"parameters": 160 * MiB, "gradients": 128 * MiB, "optimizer_states": 320 * MiB,
                             "activations": 500 * MiB, "temporaries": 40 * MiB, "other": 8 * MiB, "unknown": 12 * MiB}
    assert (e.fragmentation, e.free_segments, e.pending_free) == (133 * MiB, 2 * MiB, 1 * MiB)
    assert e.requested == e.allocated - 300
    assert e.largest_free_block == 100 * MiB < e.oom.size


def test_stolen_gradient_pairs_with_a_parameter_and_activation_gradients_do_not():
    e = S.explain(training_oom().bytes())
    # MmBackward0's 64 MiB block is the first parameter's gradient (AccumulateGrad stole it); the 40 MiB one
    # matches no parameter: an activation gradient, a backward transient
    assert e.by_rule[S.PAIRED_GRADIENT] == 64 * MiB
    assert e.by_rule["gradient (AccumulateGrad)"] == 64 * MiB
    assert e.by_rule["backward"] == 40 * MiB
    # pairing is one to one: two backward blocks of one parameter's size -> one gradient, one transient
    b = Builder().segment((4 * MiB, "active_allocated", PARAM), (4 * MiB, "active_allocated", MM_BACKWARD),
                          (4 * MiB, "active_allocated", MM_BACKWARD))
    e2 = S.explain(b.bytes())
    assert e2.by_category == {"parameters": 4 * MiB, "gradients": 4 * MiB, "temporaries": 4 * MiB}


@pytest.mark.parametrize("frames, category", [
    (PARAM, "parameters"), (ADAM_INIT, "optimizer_states"), (ADAM_STEP, "temporaries"), (FORWARD, "activations"),
    (GRAD_ACC, "gradients"), (MM_BACKWARD, "temporaries"), (CKPT, "activations"), (CUBLAS, "other"),
    (KV, "kv_cache"), (INPUT, "unknown"), ([], "unattributed"),
    ([py(f"{TORCH}/nn/modules/linear.py", "__init__", 100), TRAIN], "parameters"),
    ([py(f"{TORCH}/nn/functional.py", "cross_entropy", 3400), TRAIN], "activations"),
])
def test_each_rule(frames, category):
    e = S.explain(Builder().segment((2 * MiB, "active_allocated", frames)).bytes())
    assert e.by_category == {category: 2 * MiB}


def test_without_history_everything_is_unattributed_and_still_sums():
    b = training_oom()
    for s in b.segments:
        for blk in s["blocks"]:
            blk["frames"] = []
    data = {"segments": b.segments, "device_traces": [[]]}
    e = S.explain(pickle.dumps(data))
    assert e.by_category == {"unattributed": e.allocated}
    assert not e.history_recorded
    text = "\n".join(e.lines())
    assert "_record_memory_history" in text
    assert S.UNATTRIBUTED.startswith("unattributed (record history with torch.cuda.memory._record_memory_history")


def test_legacy_formats_read_as_memory_viz_reads_them():
    """A bare list of segments, blocks with a `history` list (torch/cuda/_memory_viz.py `_read`,
    `_block_extra_legacy`)."""
    viz = _viz()
    segs = [{"address": 0, "total_size": 4 * MiB, "allocated_size": 3 * MiB, "stream": 0, "segment_type": "large",
             "blocks": [{"size": 3 * MiB, "state": "active_allocated",
                         "history": [{"addr": 0, "real_size": 3 * MiB - 100, "frames": FORWARD}]},
                        {"size": 1 * MiB, "state": "inactive", "history": []}]}]
    e = S.explain(pickle.dumps(segs))
    assert e.by_category == {"activations": 3 * MiB} and e.requested == 3 * MiB - 100
    lines = _flame_totals(viz.memory({"segments": segs}, format_flamegraph=lambda s: s))
    assert lines["active_allocated"] == e.allocated and sum(lines.values()) == e.reserved


# ----------------------------------------------------------------------------- the estimate beside it

def test_unexpected_names_categories_over_the_estimate_largest_first():
    est = memory.MemoryBreakdown(parameters=160 * MiB, gradients=160 * MiB, optimizer_states=320 * MiB,
                                 activations=300 * MiB, temporaries=39 * MiB, other=8 * MiB)
    e = S.explain(training_oom().bytes(), estimate=est)
    assert [c for c, _, _ in e.unexpected] == ["activations", "unknown"]  # +200 MiB, +12 MiB (temporaries +1 MiB: within 5 %)
    assert e.unexpected[0] == ("activations", 500 * MiB, 300 * MiB)
    # the same estimate as `vramlab estimate --json` prints it, and as a plain dict
    as_json = {"breakdown": est.to_dict(), "batch_size": 4}
    assert S.explain(training_oom().bytes(), estimate=as_json).unexpected == e.unexpected
    assert S.explain(training_oom().bytes(), estimate=est.to_dict()).unexpected == e.unexpected
    rows = dict((c, (s, x)) for c, s, x in e.rows())
    assert rows["gradients"] == (128 * MiB, 160 * MiB) and rows["unknown"] == (12 * MiB, None)


def test_within_five_percent_is_expected():
    e = S.explain(Builder().segment((100 * MiB, "active_allocated", FORWARD)).bytes(),
                  estimate={"activations": 96 * MiB})
    assert e.unexpected == ()  # +4.2 %
    e = S.explain(Builder().segment((100 * MiB, "active_allocated", FORWARD)).bytes(),
                  estimate={"activations": 94 * MiB})
    assert [c for c, _, _ in e.unexpected] == ["activations"]  # +6.4 %


# ----------------------------------------------------------------------------- the verdicts

def test_oom_from_fragmentation_fits_with_expandable_segments():
    """600 MiB requested, 100 MiB free on the device, 135 MiB free in the cache: separately too little, together
    (with the segment's tail mapped page by page) enough."""
    total = 4 * GiB
    e = S.explain(training_oom().bytes(), device_total=total)
    assert e.fits_as_is is False
    capacity = e.reserved + 100 * MiB
    assert e.capacity == capacity and e.outside == total - capacity
    need = e.allocated + e.pending_free + 600 * MiB + S.EXPANDABLE_SLACK
    assert e.fits_with_expandable_segments is (need <= capacity)
    assert need > capacity  # this one does not: 1.17 GiB + 600 MiB > 1.3 GiB + 100 MiB
    # the same state with a 200 MiB request does: larger than the 100 MiB free on the device and than the
    # largest cached free block (100 MiB), smaller than the two together once segments expand
    small = training_oom()
    small.trace[-1]["size"] = 200 * MiB
    e2 = S.explain(small.bytes())
    assert e2.fits_as_is is False and e2.fits_with_expandable_segments is True


def test_largest_batch_scales_activations_only():
    """At batch 8 the activations, the input, backward transients and the failed (forward) request scale with
    the batch; parameters, gradients, states, the workspace do not. Check the answer against the definition:
    it fits at the answer and not one above, computed here from the categories."""
    e = S.explain(training_oom().bytes(), batch_size=8)
    assert e.scaling == 500 * MiB + 40 * MiB  # activations + backward transients (the input is "unknown": fixed)
    fixed = e.allocated - e.scaling + e.pending_free
    scale = e.scaling + 600 * MiB

    def need(b, extra):
        return fixed + scale * b / 8 + extra

    b = e.largest_batch_that_fits
    assert 0 < b < 8
    assert need(b, e.fragmentation) <= e.capacity < need(b + 1, e.fragmentation)
    bx = e.largest_batch_with_expandable_segments
    assert need(bx, S.EXPANDABLE_SLACK) <= e.capacity < need(bx + 1, S.EXPANDABLE_SLACK)
    assert bx >= b


def test_a_snapshot_at_peak_on_another_gpu():
    """No OOM: the capacity is device_total less the context (given); the same state on a smaller card."""
    data = Builder().segment((3 * GiB, "active_allocated", FORWARD), (1 * GiB, "inactive", [])).alloc_events().bytes()
    e = S.explain(data, device_total=4608 * MiB, context_bytes=600 * MiB, batch_size=4)
    assert (e.capacity, e.outside) == (4008 * MiB, 600 * MiB)  # less than the 4 GiB reserved
    assert e.fits_as_is is False and e.fits_with_expandable_segments is True
    assert e.largest_batch_that_fits == 4 * (e.capacity - 1 * GiB) // (3 * GiB)
    assert S.explain(data, device_total=5 * GiB).capacity is None  # the context is not guessed


# ----------------------------------------------------------------------------- bad input: one line

class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    target = str(tmp_path / "pwned")
    with pytest.raises(ValueError, match=r"^not a memory snapshot: it references (posix|nt|os)\.mkdir") as err:
        S.load_snapshot(pickle.dumps(Evil(target)))
    assert "\n" not in str(err.value) and not os.path.exists(target)
    import collections
    with pytest.raises(ValueError, match="collections.OrderedDict"):
        S.load_snapshot(pickle.dumps(collections.OrderedDict(segments=[])))


@pytest.mark.parametrize("data, message", [
    (training_oom().bytes()[:-40], "ends early"),
    (b"", "empty"),
    (b'{"segments": []}', "not a readable pickle"),  # JSON, not a pickle
    (pickle.dumps({"weights": [1, 2]}), "expected the dict torch.cuda.memory._snapshot"),
    (pickle.dumps({"segments": [{"address": 0, "blocks": []}]}), r"segments\[0\] has no 'total_size'"),
    (pickle.dumps({"segments": [{"address": 0, "total_size": 512, "blocks": [{"size": -1, "state": "inactive"}]}]}),
     "must be a whole number of bytes"),
    (pickle.dumps({"segments": [{"address": 0, "total_size": 512, "blocks": [{"size": 512, "state": "lost"}]}]}),
     "'state'] must be one of"),
], ids=["truncated", "empty", "json", "a-dict", "no-total-size", "negative-size", "bad-state"])
def test_bad_files_give_one_line(data, message):
    with pytest.raises(ValueError, match=message) as err:
        S.load_snapshot(data)
    assert "\n" not in str(err.value)


def test_bad_arguments_give_one_line(tmp_path):
    data = training_oom().bytes()
    for kw, message in [({"device_total": -1}, "device_total"), ({"batch_size": 0}, "batch_size"),
                        ({"estimate": {"weights": 1}}, "unknown categories weights"),
                        ({"estimate": "big"}, "estimate must be")]:
        with pytest.raises(ValueError, match=message):
            S.explain(data, **kw)
    with pytest.raises(ValueError, match="cannot read snapshot"):
        S.load_snapshot(str(tmp_path / "missing.pickle"))


def test_pure_python(assert_pure_python):
    assert_pure_python("import vramlab.snapshot")


def test_the_pages_entry_point_returns_json_ready_data():
    import json

    d = S.explain_bytes(training_oom().bytes(), device_total=4 * GiB, batch_size=8)
    assert json.loads(json.dumps(d))["by_category"]["parameters"] == 160 * MiB
    assert d["lines"][0].startswith("category")


def test_outside_beyond_the_context_is_noted():
    e = S.explain(training_oom().bytes(), device_total=8 * GiB, context_bytes=500 * MiB)
    assert e.outside == 8 * GiB - e.reserved - 100 * MiB
    assert any("beyond the CUDA context" in n for n in e.notes)


# ----------------------------------------------------------------------------- real stacks of a real step

def test_rules_on_the_stacks_of_a_real_training_step():
    """A real (tiny, CPU) GPT-2 training step: every tensor allocation's Python stack recorded as PyTorch records
    it (innermost first) by a dispatch mode, then the live tensors at two moments put in a snapshot with those
    frames. The truth is the tensors' identity (model.parameters(), p.grad, optimizer.state, the tensors autograd
    saved for backward), never our rules: the categories must come out as the identities say."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import traceback
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    frames_of: dict[int, list] = {}  # data_ptr -> the stack of its latest allocation

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = func is torch.ops.aten.lift_fresh.default  # torch.tensor(...): a new tensor, aliased on return
            if fresh or not any(r.alias_info for r in func._schema.returns):  # a fresh tensor, not a view or in-place
                stack = [py(f.filename, f.name, f.lineno) for f in traceback.extract_stack()[:-1]][::-1]
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                        frames_of[t.untyped_storage().data_ptr()] = stack
            return out

    def snapshot(truth: dict) -> dict:
        """One block per live storage, 512-byte aligned, in one segment; truth: category -> tensors."""
        seen, blocks = set(), []
        for tensors in truth.values():
            for t in tensors:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    n = -(-t.untyped_storage().nbytes() // 512) * 512
                    blocks.append((n, "active_allocated", frames_of.get(ptr, []), t.untyped_storage().nbytes()))
        return Builder().segment(*blocks).dict()

    def nbytes(tensors, skip=()):
        ptrs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(-(-n // 512) * 512 for p, n in ptrs.items() if p not in skip)

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    saved = []
    with Record():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        ids = torch.randint(0, 512, (2, 32))
        for step in range(2):  # the first step makes Adam's states
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = model(input_ids=ids, labels=ids)  # use_cache defaults to True, in training too
            loss = out.loss
            if step == 1:
                params = list(model.parameters())
                states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
                known = {t.untyped_storage().data_ptr() for t in params + kv + [ids]}
                acts = [t for t in saved if t.untyped_storage().data_ptr() not in known]
                e = S.explain(snapshot({"parameters": params, "optimizer_states": states, "activations": acts,
                                        "kv_cache": kv, "inputs": [ids]}))
                assert e.by_category == {"parameters": nbytes(params), "optimizer_states": nbytes(states),
                                         "activations": nbytes(acts), "kv_cache": nbytes(kv), "unknown": nbytes([ids])}
                assert nbytes(kv) > 0 and nbytes(acts) > 0 and nbytes(states) == 2 * nbytes(params) + 512 * len(params)
            del out
            loss.backward()
            if step == 1:  # after backward: the gradients (allocated by backward ops, on CPU in this thread)
                grads = [p.grad for p in params]
                e = S.explain(snapshot({"parameters": params, "gradients": grads, "optimizer_states": states}))
                assert e.by_category == {"parameters": nbytes(params), "gradients": nbytes(grads),
                                         "optimizer_states": nbytes(states)}
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_a_snapshot_of_two_gpus_asks_which():
    a, b = training_oom().dict(), Builder().segment((4 * MiB, "active_allocated", FORWARD)).oom(8 * MiB, 0).dict()
    for seg in b["segments"]:
        seg["device"] = 1
    both = {"segments": a["segments"] + b["segments"], "device_traces": a["device_traces"] + b["device_traces"]}
    with pytest.raises(ValueError, match="holds devices 0, 1: choose one"):
        S.explain(pickle.dumps(both))
    e1 = S.explain(pickle.dumps(both), device=1)
    assert e1.by_category == {"activations": 4 * MiB} and e1.oom.size == 8 * MiB
    assert S.explain(pickle.dumps(both), device=0).allocated == S.explain(pickle.dumps(a)).allocated
    with pytest.raises(ValueError, match="device 2 has no segments"):
        S.explain(pickle.dumps(both), device=2)


def test_expandable_segments_already_on():
    data = training_oom().dict()
    data["allocator_settings"]["expandable_segments"] = True
    e = S.explain(pickle.dumps(data))
    assert e.fits_with_expandable_segments is False and any("already on" in n for n in e.notes)


# ----------------------------------------------------------------------------- real snapshots, where recorded

STORED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "snapshots"
PEAKS = sorted(p for p in STORED.glob("*.json") if json.loads(p.read_text()).get("case") == "peak") if STORED.exists() else []


@pytest.mark.parametrize("sidecar", PEAKS or [None], ids=[p.stem for p in PEAKS] or ["none-recorded"])
def test_real_snapshots_agree_with_the_allocator_and_the_tensors(sidecar):
    """benchmarks/snapshot_probe.py's snapshots (a real GPU): allocated and reserved equal what
    torch.cuda.memory_allocated()/memory_reserved() said at the same moment, every byte is in a category, and
    parameters and optimizer states equal the tensors' own bytes (model.parameters(), optimizer.state)."""
    if sidecar is None:
        pytest.skip("no snapshots recorded yet: run benchmarks/snapshot_probe.py on a GPU")
    rec = json.loads(sidecar.read_text())
    for point, name in zip(rec["points"], rec["snapshots"]):
        e = S.explain(STORED / name, estimate=rec["estimate"])
        assert (e.allocated, e.reserved) == (point["memory_allocated"], point["memory_reserved"]), name
        assert sum(e.by_category.values()) == e.allocated
        truth = point["truth"]
        assert e.by_category.get("parameters", 0) == truth["parameters"], name
        assert e.by_category.get("optimizer_states", 0) == truth["optimizer_states"], name
        if rec["stacks"] == "all":
            assert e.by_category.get("gradients", 0) == truth["gradients"], name
