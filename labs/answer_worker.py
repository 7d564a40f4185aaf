"""The process in which a student's answers run when a lab is graded (labs/README.md, threat model).

Standard library only, and started as `python -I answer_worker.py REQ_FD RESP_FD` in a scratch
directory (inside a sandbox where one can be made): the grader (`labs/sandbox.py`) sends the
submission's solution cells, this process runs them, then answers the grader's requests (call this
function, read that attribute) with plain values: ints, floats, strings, lists, tuples, dicts, sets,
None (subclasses and numpy's scalars and arrays as the built-in values they stand for), or a
reference to an object that stays here. Nothing of the student's code ever runs in the
grader, and nothing of the grader's (its tests, its expected values) is sent here.

The lab's setup imports (`import torch`, ...) are bound as modules imported on first use, and the answers'
annotations are kept as text: a process whose answers never run torch does not spend seconds importing it.

Before any student code runs: resource limits (file size, memory, no core files), and the packages
that would answer the exercises for the student (vramlab, transformers, ...) made unimportable.
"""

import __future__
import json
import math
import os
import resource
import sys
import traceback

MAX_FRAME = 4 << 20  # bytes of one message, either way
MAX_REFS = 100_000


def read_frame(fd):
    head = b""
    while len(head) < 8:
        chunk = os.read(fd, 8 - len(head))
        if not chunk:
            raise EOFError
        head += chunk
    n = int.from_bytes(head, "big")
    if n > MAX_FRAME:
        raise ValueError("frame too large")
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, min(1 << 20, n - len(data)))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data.decode())


def write_frame(fd, obj):
    data = json.dumps(obj, allow_nan=False).encode()
    if len(data) > MAX_FRAME:
        data = json.dumps({"id": obj.get("id"), "error": ["ValueError", "the answer returned more than 4 MiB"]}).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data):]


class Refs:
    def __init__(self):
        self.objects = {}

    def add(self, obj):
        if len(self.objects) >= MAX_REFS:
            raise MemoryError("too many objects handed to the grader")
        ref = len(self.objects) + 1
        self.objects[ref] = obj
        return ref


def plain(x):
    """The built-in value a plain value stands for, or None when `x` is not one: a subclass of int,
    float, str, list, tuple, dict, set or frozenset read through the built-in type's own methods (so
    an overridden __eq__ or __iter__ is never asked), and numpy's own scalars and arrays (exactly its
    types) through .item() and .tolist(). (type, value)."""
    t = type(x)
    for base, read in ((int, int.__int__), (float, float.__float__), (str, str.__str__),
                       (list, lambda v: list(list.__iter__(v))), (tuple, lambda v: tuple(tuple.__iter__(v))),
                       (dict, lambda v: dict(dict.items(v))), (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
                       (set, lambda v: set(set.__iter__(v)))):
        if isinstance(x, base) and t is not base and t is not bool:  # (a built-in itself: too large to send)
            return base, read(x)
    if getattr(t, "__module__", None) == "numpy":
        if t.__name__ == "ndarray" and x.size <= 100_000:
            return list, x.tolist()
        if hasattr(t, "item") and getattr(x, "shape", None) == ():
            v = x.item()
            if type(v) in (bool, int, float, str) or v is None:  # (a complex stays a reference)
                return type(v), v
    return None


def encode(x, refs, depth=0):
    """Built-in values as themselves (plain(): subclasses and numpy's values as the built-in value
    they stand for); anything else, a reference to the object, which stays here."""
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if x.bit_length() < 4096 else {"$r": refs.add(x), "type": "int (too large)"}
    if t is float:
        return x if math.isfinite(x) else {"$f": repr(x)}
    if depth < 32 and t in (list, tuple) and len(x) <= 100_000:
        items = [encode(v, refs, depth + 1) for v in x]
        return items if t is list else {"$t": items}
    if depth < 32 and t is dict and len(x) <= 100_000:
        return {"$d": [[encode(k, refs, depth + 1), encode(v, refs, depth + 1)] for k, v in x.items()]}
    if depth < 32 and t in (set, frozenset) and len(x) <= 100_000:
        return {"$s" if t is set else "$fs": [encode(v, refs, depth + 1) for v in x]}
    try:
        as_plain = plain(x) if depth < 32 else None
    except Exception:  # noqa: BLE001 - an object whose reading fails is handed over as a reference
        as_plain = None
    if as_plain is not None:
        return encode(as_plain[1], refs, depth + 1)
    ref = {"$r": refs.add(x), "type": t.__name__, "callable": callable(x)}
    name = getattr(x, "__name__", None) if isinstance(x, type) or callable(x) else None
    if type(name) is str:
        ref["name"] = name
    return ref


def decode(x, refs):
    if isinstance(x, list):
        return [decode(v, refs) for v in x]
    if isinstance(x, dict):
        if "$f" in x:
            return float(x["$f"])
        if "$t" in x:
            return tuple(decode(v, refs) for v in x["$t"])
        if "$s" in x or "$fs" in x:
            return (set if "$s" in x else frozenset)(decode(v, refs) for v in x.get("$s", x.get("$fs")))
        if "$d" in x:
            return {decode(k, refs): decode(v, refs) for k, v in x["$d"]}
        if "$r" in x:
            return refs.objects[x["$r"]]
    return x


def error(e):
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"line {f.lineno} of {f.filename}" for f in reversed(tb) if f.filename.startswith("<answer")), "")
    return [type(e).__name__, str(e)[:2000], where]


def block(names):
    """The packages that hold the answers cannot be used here: each is a placeholder module whose every
    attribute raises, a finder refuses their submodules (and under the sandbox their files are gone)."""
    import types

    why = "cannot be used by a graded answer: the exercise asks you to compute this yourself " \
          "(plain Python and torch are available)"

    class Placeholder(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):  # hasattr(module, "__file__") and the like: a module without it
                raise AttributeError(attr)
            raise ImportError(f"{self.__name__} {why}")

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in names:
                raise ModuleNotFoundError(f"{name} {why}")
            return None

    for mod in list(sys.modules):
        if mod.split(".")[0] in names:
            del sys.modules[mod]
    for name in names:
        sys.modules[name] = Placeholder(name)
        sys.modules[name].__path__ = []
    sys.meta_path.insert(0, Blocked())


class Deferred:
    """A module named by the lab's setup (`import torch.distributed as dist`) that is imported the first
    time the answer uses it: most answers never touch torch, and importing it costs each answer's
    process seconds. Once imported, every attribute is the real module's."""

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def _module(self):
        import importlib

        return importlib.import_module(object.__getattribute__(self, "_name"))

    def __getattr__(self, attr):
        return getattr(self._module(), attr)

    def __setattr__(self, attr, value):
        setattr(self._module(), attr, value)

    def __dir__(self):
        return dir(self._module())

    def __repr__(self):
        return repr(self._module())


def setup(stmt, ns):
    """Run one of the setup's import statements in `ns`: `import a.b` and `import a.b as c` bind a
    `Deferred` module unless it is loaded already (the same names, imported on first use); anything
    else runs as written."""
    import ast

    node = ast.parse(stmt).body[0] if stmt.strip() else None
    if isinstance(node, ast.Import):
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            target = alias.name if alias.asname else bound
            ns[bound] = sys.modules.get(target) or Deferred(target)
        return
    exec(compile(stmt, "<setup>", "exec"), ns)


def main():
    req, resp = int(sys.argv[1]), int(sys.argv[2])
    init = read_frame(req)
    mem = int(init.get("memory_bytes") or 0)
    for limit, value in ((resource.RLIMIT_FSIZE, 64 << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_DATA, mem if mem > 0 else None)):
        if value is not None:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass
    block(set(init["block"]))
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    for stmt in init.get("preamble", []):  # the lab's setup imports (import torch, ...), minus the blocked
        try:
            setup(stmt, ns)
        except Exception:  # noqa: BLE001 - a missing optional module: the answer will say NameError
            pass
    refs = Refs()
    names, errors = {}, {}
    for gid, source in init["cells"]:
        before = dict(ns)
        try:
            # annotations are kept as text (PEP 563), not evaluated: `def f(x: torch.Tensor)` defines f without
            # importing torch, which the answer's process then imports only where an answer runs it
            exec(compile(source, f"<answer {gid}>", "exec", flags=__future__.annotations.compiler_flag), ns)
        except BaseException as e:  # noqa: BLE001 - whatever the answer raised (SystemExit too) is its result
            errors[gid] = error(e)
        for k, v in ns.items():
            if not k.startswith("_") and (k not in before or before[k] is not v):
                names[k] = {"cell": gid, "value": encode(v, refs)}
    sys.stdout.flush()
    write_frame(resp, {"names": names, "errors": errors})
    while True:
        try:
            msg = read_frame(req)
        except EOFError:
            return
        rid = msg.get("id")
        try:
            if msg["op"] == "call":
                fn = refs.objects[msg["ref"]]
                out = fn(*decode(msg["args"], refs), **decode(msg["kwargs"], refs))
            elif msg["op"] == "getattr":
                out = getattr(refs.objects[msg["ref"]], msg["name"])
            else:
                raise ValueError(f"unknown request {msg['op']!r}")
            reply = {"id": rid, "ok": encode(out, refs)}
        except BaseException as e:  # noqa: BLE001 - reported to the grader as the answer's exception
            reply = {"id": rid, "error": error(e)}
        sys.stdout.flush()
        write_frame(resp, reply)


if __name__ == "__main__":
    main()
