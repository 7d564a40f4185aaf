"""The program each rank of labs 2-4's checks runs, in a folder of its own that holds `programs/` (this
package), `answer.json` and `secret.json` (what the grader dealt this rank alone):

    python -I -c <vramlab.grading.run.launch("ranks")> HARNESS RANK WORLD CASE FD

HARNESS names the harness module of this package; CASE is JSON; FD is the descriptor of this rank's
socket to the check's process (`vramlab.grading.run.Switchboard`), its only way to the others: the
collectives of torch.distributed are replaced by messages over it (those the harness's ALLOWED names;
every other raises, with its HINT). The rank reads and deletes its secret, waits until every rank
has, runs the answer's source (`common.run_answer`), then the harness's
`run(case, rank, world, secret, answer, names)`, and sends its result, or the error it raised.

Nothing here is trusted: the answer runs in this process and could rewrite any of it; it cannot
rewrite the log, which the check's process keeps of what each rank sent it.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import struct
import sys

import torch
import torch.distributed as dist

from . import common

PHASE = ["setup"]  # where the harness is in its case: logged with every call
_LINK: dict = {}


def _private() -> None:
    # this process's memory cannot be read through /proc/<pid>/mem or ptrace by the other ranks
    # (same uid): what a rank was dealt stays its own
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _link_post(msg):
    data = json.dumps(msg).encode()
    _LINK["sock"].sendall(struct.pack(">Q", len(data)) + data)


def _link_read():
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = _LINK["sock"].recv(n - len(buf))
            if not chunk:
                raise RuntimeError("the check's process closed the link (it stopped this run)")
            buf += chunk
        return buf

    return json.loads(exactly(struct.unpack(">Q", exactly(8))[0]))


def _link_wait(rid, what=None):
    done = _LINK["done"]
    if what and rid not in done:
        _link_post({"t": "wait", "id": rid, "what": what})  # so that the check can tell a deadlock at once
    while rid not in done:
        msg = _link_read()
        done[msg.get("id")] = msg
    msg = done.pop(rid)
    if msg.get("error"):
        raise RuntimeError(msg["error"])
    return msg


class _Work:
    def __init__(self, rid, fill=None, what=""):
        self._rid, self._fill, self._done, self._what = rid, fill, False, what

    def wait(self, timeout=None):
        if not self._done:
            self._complete(_link_wait(self._rid, self._what))
        return True

    def _complete(self, msg):
        self._done = True
        if self._fill is not None:
            self._fill(msg)

    def is_completed(self):
        return self._done

    def result(self):
        self.wait()
        return []


def _op_name(op):
    name = getattr(op, "name", None) or str(op)
    return str(name).rsplit(".", 1)[-1].upper()


def _values(t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    return t.detach().flatten().tolist()


def _copy_into(tensors, values):
    flat = torch.tensor(values, dtype=torch.float64)
    at = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[at:at + n].view(t.shape).to(t.dtype))
        at += n


def _issue(call, async_op, fill, **fields):
    _LINK["next"] += 1
    rid = _LINK["next"]
    _link_post({"t": "call", "id": rid, "call": call, "async": bool(async_op),
                "phase": PHASE[0] if isinstance(PHASE, list) and PHASE else None, **fields})
    peer = fields.get("peer")
    work = _Work(rid, fill, f"the wait of its {call}" + (f" (peer {peer})" if peer is not None else ""))
    if async_op:
        return work
    work._complete(_link_wait(rid))  # (no "wait" note: the check knows a blocking call waits)
    return None


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _issue("send", False, None, peer=int(dst), tag=int(tag), values=_values(tensor), shape=list(tensor.shape))


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _issue("isend", True, None, peer=int(dst), tag=int(tag), values=_values(tensor), shape=list(tensor.shape))


def _recv_fill(tensor, box):
    def fill(msg):
        _copy_into([tensor], msg.get("values") or [])
        box.append(msg.get("src"))
    return fill


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    box = []
    _issue("recv", False, _recv_fill(tensor, box), peer=None if src is None else int(src), tag=int(tag),
           numel=tensor.numel(), shape=list(tensor.shape))
    return box[0] if box else -1


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _issue("irecv", True, _recv_fill(tensor, []), peer=None if src is None else int(src), tag=int(tag),
                  numel=tensor.numel(), shape=list(tensor.shape))


def _all_reduce(tensor, op=None, group=None, async_op=False):
    return _issue("all_reduce", async_op, lambda m: _copy_into([tensor], m["values"]), op=_op_name(op or "SUM"),
                  values=_values(tensor), shape=list(tensor.shape))


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    return _issue("reduce_scatter", async_op, lambda m: _copy_into([output], m["values"]), op=_op_name(op or "SUM"),
                  values=_values(input), shape=list(input.shape), out_numel=output.numel())


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    values = [v for t in input_list for v in _values(t)]
    return _issue("reduce_scatter", async_op, lambda m: _copy_into([output], m["values"]), op=_op_name(op or "SUM"),
                  values=values, shape=[len(values)], out_numel=output.numel(), name="reduce_scatter")


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    return _issue("all_gather", async_op, lambda m: _copy_into([output], m["values"]), values=_values(input),
                  shape=list(input.shape), out_numel=output.numel(), name="all_gather_into_tensor")


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    return _issue("all_gather", async_op, lambda m: _copy_into(list(tensor_list), m["values"]), values=_values(tensor),
                  shape=list(tensor.shape), out_numel=sum(t.numel() for t in tensor_list), name="all_gather")


def _barrier(group=None, async_op=False, device_ids=None):
    return _issue("barrier", async_op, None)


def _batch_isend_irecv(p2p_op_list):
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in p2p_op_list]


def mark(entry):
    """A note of the harness's for the log (which gradient became ready, where a step begins), kept in order."""
    _link_post({"t": "mark", "entry": entry})


def _missing(name, hint):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is not available here: " + hint)
    return collective


_IMPLEMENTED = {"send": _send, "isend": _isend, "recv": _recv, "irecv": _irecv, "all_reduce": _all_reduce,
                "reduce_scatter_tensor": _reduce_scatter_tensor, "reduce_scatter_single": _reduce_scatter_tensor,
                "reduce_scatter": _reduce_scatter, "all_gather_into_tensor": _all_gather_into_tensor,
                "all_gather": _all_gather, "batch_isend_irecv": _batch_isend_irecv}
_EVERY = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
          "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
          "all_reduce_coalesced", "all_gather_coalesced", "send", "recv", "isend", "irecv", "batch_isend_irecv",
          "send_object_list", "recv_object_list", "monitored_barrier", "new_group", "new_subgroups",
          "init_process_group", "init_device_mesh")


def _install_link(rank, world, fd, allowed, hint):
    import torch.distributed.distributed_c10d as c10d

    _LINK.update(sock=socket.socket(fileno=fd), next=0, done={}, rank=rank, world=world)
    for module in (dist, c10d):
        for name in _EVERY:
            setattr(module, name, _IMPLEMENTED[name] if name in allowed and name in _IMPLEMENTED else _missing(name, hint))
        module.get_rank = lambda group=None: rank
        module.get_world_size = lambda group=None: world
        module.is_initialized = lambda: True
        module.get_backend = lambda group=None: "gloo"
        module.barrier = _barrier
        module.destroy_process_group = lambda group=None: None


def main() -> None:
    _private()
    name, rank, world, case, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
    with open("answer.json") as fh:
        answer = json.load(fh)
    common.block(answer["blocked"])
    harness = importlib.import_module(f"{__package__}.{name}")  # (before the secret: what it counts as its own)
    _install_link(rank, world, fd, harness.ALLOWED, harness.HINT)
    # the data the grader dealt this rank alone (where the check deals any), in its own folder: read and
    # deleted by every rank before any of the answer's code runs (it runs only after this barrier)
    secret = None
    try:
        with open("secret.json") as fh:
            secret = json.load(fh)
        os.unlink("secret.json")
    except FileNotFoundError:
        pass
    _link_post({"t": "ready"})
    _link_wait(0)
    report = {"rank": rank}
    try:
        report["result"] = harness.run(case, rank, world, secret, common.run_answer(answer["source"]), answer["names"])
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    _link_post({"t": "report", "report": report})
