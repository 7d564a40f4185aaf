"""What each optimizer keeps, tensor by tensor. Pure Python: no torch import.

An optimizer's state is a property of each parameter tensor and of the library that steps it: Adam keeps two
full-size moments, Adafactor (Shazeer & Stern 2018, arXiv:1804.04235) a row and a column statistic for a
matrix, the 8- and 4-bit optimizers (Dettmers et al. 2021, arXiv:2110.02861; torchao's `torchao.optim`) one or
half a byte a value plus a scale per block -- but only for tensors large enough, the others stay full size --
and GaLore (Zhao et al. 2024, arXiv:2403.03507) Adam's moments of an r-column projection of each targeted
matrix plus the projection itself. `tensor_states` gives one tensor's state bytes as the library stores them
(by the state's key), `state_bytes` a model's total, and `ledger` where each byte lives: on the device as the
caching allocator sees it, in memory the driver pages (bitsandbytes' paged optimizers), or on the host
(torchao's `CPUOffloadOptimizer`).

Every rule is read off the library's source. The state bytes of every optimizer that steps on the CPU are checked
against the real storage after a real step (tests/test_optimizers.py, benchmarks/results/optimizers/cpu.json).
Where bytes live is not: on the CPU bitsandbytes' paged optimizers fall back to ordinary buffers (the same bytes)
and torchao's CPUOffloadOptimizer refuses to run, so which buffers are paged and what the host holds are read from
their source only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from . import checks as _checks


BNB_BLOCK, BNB_MIN_8BIT, BNB_PAGE_MIN = 256, 4096, 100_000  # bitsandbytes' blocks, min_8bit_size, paging floor
AO_MIN = 4096  # torchao quantizes a tensor of at least 4096 values whose size the block divides
AO_BLOCK = {"adamw-8bit-ao": 256, "adamw-4bit-ao": 128, "adamw-fp8-ao": 256}
AO_QMAP = {"adamw-8bit-ao": 256, "adamw-4bit-ao": 16, "adamw-fp8-ao": 0}  # fp32 entries of each state's map
OFFLOAD_MIN = 4096  # torchao's CPUOffloadOptimizer keeps smaller parameters (and their optimizer) on the device


def pinned_bytes(nbytes: int) -> int:
    """What PyTorch's pinned host allocator (CachingHostAllocator) takes for a block of `nbytes`: the next power
    of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
GALORE_RANK = 128  # GaLore's default rank (its README's 7B recipe uses 1024, its 60M-1B runs 128-512)
GALORE_TARGETS = ("attn", "attention", "mlp", "densereludense")  # modules whose linear weights GaLore projects
ROUTERS = ("gate", "router")  # a mixture of experts' router (`mlp.gate`, `shared_expert_gate`) is not projected


# the version of each library whose source the rules below were read from (requirements.txt pins the installed
# ones; torchao's is benchmarks/results/optimizers/cpu.json's)
VERSIONS: dict[str, str] = {"torch.optim": "2.13.0", "bitsandbytes": "0.50.2", "transformers": "5.23.0",
                            "torchao": "0.18.0", "galore-torch": "1.0"}
PLACEMENTS: tuple[str, ...] = ("device", "paged", "host")


@dataclass(frozen=True)
class Info:
    """One optimizer of the registry: what it is (label, source, what it keeps), the library that steps it
    (`version`: the one its rules were read from), and how vramlab models it: `sharded` (ZeRO, FSDP and the
    pipelines shard its states as one flat tensor: `memory`'s parallel estimators take it), `shaped` (its
    states depend on each tensor's shape, so a flat count of parameters cannot price it), `recipe_states`
    (its moments take the precision recipe's state dtype, torch.optim's rule; the others keep their own),
    `placement` (where its large states live: the device's caching allocator, CUDA unified memory that
    pages to the host, or the host). The bytes themselves: `tensor_states`, `shared_bytes`, `ledger`;
    its step's temporaries: `memory.optimizer_step_temporaries`."""

    label: str
    source: str
    keeps: str
    library: str
    sharded: bool = False
    shaped: bool = False
    recipe_states: bool = False
    placement: str = "device"

    @property
    def version(self) -> str:
        return VERSIONS[self.library]


# the registry: every optimizer vramlab models, by the name the library, the CLI, the calculators and configs use
INFO: dict[str, Info] = {
    "adamw": Info("AdamW (torch.optim)", "Loshchilov & Hutter 2019; torch.optim.AdamW",
                  "m and v, full size, in the parameters' dtype",
                   library="torch.optim", sharded=True, recipe_states=True),
    "adam": Info("Adam (torch.optim)", "Kingma & Ba 2015; torch.optim.Adam", "m and v, full size",
                  library="torch.optim", sharded=True, recipe_states=True),
    "sgd": Info("SGD", "torch.optim.SGD", "nothing",
                 library="torch.optim", sharded=True, recipe_states=True),
    "sgd-momentum": Info("SGD with momentum", "torch.optim.SGD(momentum=0.9)", "one full-size buffer",
                          library="torch.optim", sharded=True, recipe_states=True),
    "adamw-8bit": Info("8-bit AdamW (bitsandbytes)", "Dettmers et al. 2021; bitsandbytes.optim.AdamW8bit",
                       "m and v in 1 byte, an fp32 absmax per 256 values; tensors under 4096 values in fp32",
                        library="bitsandbytes", sharded=True),
    "adafactor": Info("Adafactor (torch.optim)", "Shazeer & Stern 2018; torch.optim.Adafactor",
                      "a row and a column mean of g^2 per matrix (no momentum), full v for vectors",
                       library="torch.optim", shaped=True),
    "adafactor-hf": Info("Adafactor (transformers)", "transformers.optimization.Adafactor(beta1=None)",
                         "factored v in fp32, and each tensor's RMS",
                          library="transformers", shaped=True),
    "adafactor-momentum": Info("Adafactor with momentum (transformers)",
                               "transformers.optimization.Adafactor(beta1=0.9)", "factored v and a full m, fp32",
                                library="transformers", shaped=True),
    "adamw-8bit-ao": Info("8-bit AdamW (torchao)", "torchao.optim.AdamW8bit",
                          "1 byte a value + an fp32 scale per 256 + a 256-entry map, per moment",
                           library="torchao"),
    "adamw-4bit-ao": Info("4-bit AdamW (torchao)", "Li et al. 2023 (arXiv:2309.01507); torchao.optim.AdamW4bit",
                          "half a byte a value + an fp32 scale per 128 + a 16-entry map, per moment",
                           library="torchao"),
    "adamw-fp8-ao": Info("FP8 AdamW (torchao)", "torchao.optim.AdamWFp8",
                         "fp8 e4m3 values + an fp32 scale per 256, per moment",
                          library="torchao"),
    "galore-adamw": Info("GaLore AdamW", "Zhao et al. 2024 (arXiv:2403.03507); galore_torch.GaLoreAdamW",
                         "m and v of the rank-r projected gradient, and the projection, per targeted matrix",
                          library="galore-torch", shaped=True),
    "paged-adamw": Info("paged AdamW (bitsandbytes)", "Dettmers et al. 2023 (QLoRA); bitsandbytes.optim.PagedAdamW",
                        "fp32 m and v in CUDA unified memory, paged to the host under pressure",
                         library="bitsandbytes", placement="paged"),
    "paged-adamw-8bit": Info("paged 8-bit AdamW (bitsandbytes)", "bitsandbytes.optim.PagedAdamW8bit",
                             "8-bit m and v in unified memory",
                              library="bitsandbytes", placement="paged"),
    "adamw-cpu-offload": Info("AdamW offloaded to the CPU (torchao)", "torchao.optim.CPUOffloadOptimizer",
                              "on the host: the states, and pinned copies of the weights and gradients in their dtype",
                               library="torchao", placement="host"),
}
NAMES: tuple[str, ...] = tuple(INFO)
SHARDED: tuple[str, ...] = tuple(n for n, i in INFO.items() if i.sharded)  # ZeRO, FSDP, pipelines: flat shards
SHAPED: tuple[str, ...] = tuple(n for n, i in INFO.items() if i.shaped)  # need each tensor's shape
TORCH: tuple[str, ...] = tuple(n for n, i in INFO.items() if i.recipe_states)  # moments in the recipe's dtype


def check(optimizer: str) -> str:
    return _checks.one_of("optimizer", optimizer, NAMES)


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    out = tuple(_checks.wholes("shape", shape, lo=0, hi=1 << 48))
    if not out:
        out = (1,)  # a 0-dim parameter holds one value
    return out


def galore_target(name: str, shape: tuple[int, ...], targets: Iterable[str] = GALORE_TARGETS) -> bool:
    """GaLore's split: the 2-D weights of the attention and MLP projections are projected (its torchrun_main.py
    takes the nn.Linear weights of modules named "attn" or "mlp"; here every family's: GPT-2's Conv1D, T5's
    SelfAttention and DenseReluDense too); embeddings, norms, biases, the head, routers and 3-D expert tensors
    keep plain Adam."""
    module = name.rsplit(".", 1)[0].lower()
    last = module.rsplit(".", 1)[-1]
    router = last == "gate" or last.endswith("_gate") or "router" in last
    return len(shape) == 2 and name.endswith(".weight") and not router and any(t in module for t in targets)


def tensor_states(optimizer: str, shape, *, param_bytes: int, state_bytes: int | None = None,
                  rank: int = GALORE_RANK, projected: bool = True) -> dict[str, int]:
    """The bytes one parameter tensor of `shape` gets from `optimizer`, by the library's state key.
    `param_bytes`: the parameter's element size (2 bf16, 4 fp32); `state_bytes`: torch.optim's moments' element
    size where the recipe differs from the parameters' (fp32 states of a bf16 model), default `param_bytes`.
    `step` is torch's 0-dim fp32 step counter (on the host unless the step is fused or capturable); 8-bit maps
    shared by all tensors are not here (`shared_bytes`). GaLore: `projected` says whether this tensor is one it
    projects (`galore_target`), with `rank` columns (capped by the matrix's smaller side)."""
    optimizer = check(optimizer)
    shape = _shape(shape)
    pb = _checks.whole("param_bytes", param_bytes, lo=1, hi=8)
    sb = pb if state_bytes is None else _checks.whole("state_bytes", state_bytes, lo=1, hi=8)
    n = math.prod(shape)
    step = {"step": 4}
    if optimizer in ("adamw", "adam"):
        return {"exp_avg": n * sb, "exp_avg_sq": n * sb, **step}
    if optimizer == "sgd":
        return {}
    if optimizer == "sgd-momentum":
        return {"momentum_buffer": n * sb}
    if optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        if n < BNB_MIN_8BIT:
            return {"state1": 4 * n, "state2": 4 * n}
        absmax = 4 * -(-n // BNB_BLOCK)
        return {"state1": n, "state2": n, "absmax1": absmax, "absmax2": absmax}
    if optimizer == "paged-adamw":  # bitsandbytes' 32-bit states are fp32 whatever the parameters
        return {"state1": 4 * n, "state2": 4 * n}
    if optimizer in ("adafactor", "adafactor-hf", "adafactor-momentum"):
        hf = optimizer != "adafactor"
        eb = 4 if hf else pb  # transformers upcasts a 16-bit gradient to fp32 before making the states
        out = {}
        if optimizer == "adafactor-momentum":
            out["exp_avg"] = n * eb
        if len(shape) >= 2:
            rows, cols = n // shape[-1] if shape[-1] else 0, n // shape[-2] if shape[-2] else 0
            keys = ("exp_avg_sq_row", "exp_avg_sq_col") if hf else ("row_var", "col_var")
            out.update({keys[0]: rows * eb, keys[1]: cols * eb})
        else:
            out["exp_avg_sq" if hf else "variance"] = n * eb
        return {**out, **({"RMS": 4} if hf else step)}  # transformers' RMS is a 0-dim fp32 tensor; its step an int
    if optimizer in AO_BLOCK:
        block = AO_BLOCK[optimizer]
        if n < AO_MIN or n % block:
            return {"exp_avg": n * pb, "exp_avg_sq": n * pb, **step}  # zeros_like(p)
        codes = n // 2 if optimizer == "adamw-4bit-ao" else n
        one = codes + 4 * (n // block) + 4 * AO_QMAP[optimizer]
        return {"exp_avg": one, "exp_avg_sq": one, **step}
    if optimizer == "galore-adamw":  # galore_torch's AdamW: transformers' AdamW (an int step) on projections
        rank = _checks.whole("rank", rank, lo=1, hi=1 << 24)
        if not projected or len(shape) != 2:
            return {"exp_avg": n * pb, "exp_avg_sq": n * pb}
        m, s, k = max(shape), min(shape), min(rank, *shape)
        # the projection: k of the SVD's s singular vectors. For fp32 weights it is a slice of the SVD's whole
        # s x s factor, which its storage keeps; a 16-bit weight's is a converted copy of the slice
        ortho = s * s * 4 if pb == 4 else s * k * pb
        return {"exp_avg": m * k * pb, "exp_avg_sq": m * k * pb, "ortho_matrix": ortho}
    if optimizer == "adamw-cpu-offload":  # the host's torch AdamW
        return {"exp_avg": n * pb, "exp_avg_sq": n * pb, **step}
    raise AssertionError(optimizer)  # pragma: no cover


def shared_bytes(optimizer: str, shapes) -> int:
    """Bytes an optimizer keeps once for all tensors: bitsandbytes' two 256-entry fp32 quantization maps, made when
    its first 8-bit tensor is."""
    optimizer = check(optimizer)
    if optimizer in ("adamw-8bit", "paged-adamw-8bit") and any(math.prod(_shape(s)) >= BNB_MIN_8BIT for s in shapes):
        return 2 * 256 * 4
    return 0


def _named(tensors) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) pairs from a ModelSpec (its `param_shapes()`) or an iterable of shapes or pairs."""
    if hasattr(tensors, "param_shapes"):
        return [(n, tuple(s)) for n, s in tensors.param_shapes()]
    out = []
    for i, t in enumerate(tensors):
        if isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str):
            out.append((t[0], _shape(t[1])))
        else:
            out.append((f"tensor{i}", _shape(t)))
    return out


def named_sizes(tensors) -> list[tuple[str, int]]:
    """(name, values) of each tensor `ledger` takes."""
    return [(n, math.prod(s)) for n, s in _named(tensors)]


@dataclass(frozen=True)
class Ledger:
    """Where an optimizer's bytes live for one model. `device`: on the GPU, counted by the caching allocator
    (`max_memory_allocated`); `paged`: in CUDA unified memory (cudaMallocManaged), on the GPU until the driver
    pages it to the host under pressure, never counted by the allocator; `host`: on the CPU (an offloaded
    optimizer's states, and its pinned copies of the weights and gradients, each rounded up to a power of two by the
    pinned allocator); `steps`: torch's 0-dim step counters (host
    unless fused or capturable)."""

    optimizer: str
    device: int
    paged: int
    host: int
    steps: int

    @property
    def storage(self) -> int:
        """Every byte of the optimizer's state, wherever it lives (what the CPU measurement counts)."""
        return self.device + self.paged + self.steps + (self.host_states if self.optimizer == "adamw-cpu-offload" else 0)

    host_states: int = 0


def ledger(optimizer: str, tensors, *, param_bytes: int, state_bytes: int | None = None, rank: int = GALORE_RANK,
           targets: Iterable[str] = GALORE_TARGETS, trainable: Iterable[str] | None = None,
           projected: Iterable[str] | None = None) -> Ledger:
    """`optimizer`'s bytes for the parameter tensors `tensors` (a ModelSpec, or (name, shape) pairs, or shapes),
    split by where they live (`Ledger`). `trainable`: the names stepped (default all); `projected`: the names
    GaLore projects (default `galore_target`'s rule)."""
    optimizer = check(optimizer)
    named = _named(tensors)
    if trainable is not None:
        keep = set(trainable)
        named = [(n, s) for n, s in named if n in keep]
    targets = tuple(targets)
    chosen = None if projected is None else set(projected)
    device = paged = host = steps = host_states = 0
    for name, shape in named:
        proj = galore_target(name, shape, targets) if chosen is None else name in chosen
        st = tensor_states(optimizer, shape, param_bytes=param_bytes, state_bytes=state_bytes, rank=rank,
                           projected=proj)
        s = st.pop("step", 0)
        body = sum(st.values())
        n = math.prod(shape)
        if optimizer == "adamw-cpu-offload" and n >= OFFLOAD_MIN:
            # the host keeps pinned copies of the parameter and its gradient, and the (unpinned) states
            host += body + s + 2 * pinned_bytes(n * param_bytes)
            host_states += body + s
            continue
        if optimizer.startswith("paged") and n >= BNB_PAGE_MIN:
            # bitsandbytes' get_state_buffer pages m and v of >= 1e5 values; the absmax vectors stay ordinary
            moved = st.get("state1", 0) + st.get("state2", 0)
            paged += moved
            device += body - moved
        else:
            device += body
        steps += s
    device += shared_bytes(optimizer, [s for _, s in named])
    return Ledger(optimizer=optimizer, device=device, paged=paged, host=host, steps=steps, host_states=host_states)


def state_bytes(optimizer: str, tensors, *, param_bytes: int, state_bytes: int | None = None,
                rank: int = GALORE_RANK, targets: Iterable[str] = GALORE_TARGETS, steps: bool = False) -> int:
    """The optimizer's state bytes in the device's memory as its allocator counts them (`Ledger.device`),
    plus the step counters when `steps`."""
    lg = ledger(optimizer, tensors, param_bytes=param_bytes, state_bytes=state_bytes, rank=rank, targets=targets)
    return lg.device + (lg.steps if steps else 0)
