"""In-place operations (chapter 1): what `nn.ReLU(inplace=True)`, `nn.Dropout(inplace=True)` and
`y.add_(x)` change in a training step, and where autograd refuses them. Pure Python: no torch import.

`mlp_block_memory` follows one residual MLP block (`MLPBlock`) op by op, `inplace_refusal` applies
autograd's rule, `inplace_sites` lists where one block of a preset family could run an op in place, and
`inplace_step` sums that over a whole model (the training calculator's in-place control).
`vramlab.measure.inplace` measures the same blocks in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from . import checks as _checks
from .activations import ATTENTIONS, AttentionImpl
from .checks import MAX_PARAMS
from .precision import PRECISIONS, Precision, dtype_sizes
from .specs import ModelSpec, resolve as _resolve


# What `nn.ReLU(inplace=True)`, `nn.Dropout(inplace=True)` and `y.add_(x)` change, from autograd's
# rules (tools/autograd/derivatives.yaml, torch 2.x): relu, sigmoid and tanh save their *output*
# (threshold_backward(grad, result), sigmoid_backward(grad, result), tanh_backward(grad, result)), so
# writing the output over the input loses nothing the backward needs; silu and gelu save their
# *input*: silu_ makes autograd keep a copy of the original input (the same bytes as out of place),
# and torch has no in-place gelu; add saves nothing. Dropout: out of place on CUDA is one fused
# kernel (`native_dropout`) that saves a 1-byte bool mask; in place (`dropout_`, and any dropout on
# the CPU) draws a noise tensor in the input's dtype, multiplies by it, and saves it (ATen
# native/Dropout.cpp, `_dropout_impl`). An in-place op bumps its tensor's version counter: if
# autograd saved that tensor before (a Linear's input, ReLU's output, a norm's input), the backward
# raises "one of the variables needed for gradient computation has been modified by an inplace
# operation"; on a leaf that requires grad the forward raises at once.

BLOCK_ACTIVATIONS: tuple[str, ...] = ("relu", "sigmoid", "tanh", "silu", "gelu")
BLOCK_NORMS: tuple[str, ...] = ("none", "layernorm", "rmsnorm")
_SAVES_OUTPUT = ("relu", "sigmoid", "tanh")  # derivatives.yaml: their backward reads `result`
# the ops of an MLP block that may run in place (`MLPBlock`)
INPLACE_OPS: tuple[str, ...] = ("activation", "inner_dropout", "outer_dropout", "residual", "residual_into_input")


@dataclass(frozen=True, kw_only=True)
class MLPBlock:
    """A residual MLP block, `x + dropout_out(fc2(dropout_in(act(fc1(norm(x))))))`: the setting of
    `mlp_block_memory`. `norm`: "layernorm" (a pre-LayerNorm, GPT-2's), "rmsnorm" (T5's T5LayerNorm,
    written out in fp32) or "none"; a dropout with p = 0 is absent. T5's feed-forward sublayer is
    MLPBlock(norm="rmsnorm", activation="relu", inner_dropout=p, outer_dropout=p, branch_ref=True) without
    biases (measured against transformers' T5LayerFF in tests/test_inplace.py).

    The ops that may run in place (INPLACE_OPS): "activation" (`nn.ReLU(inplace=True)`, `F.silu(...,
    inplace=True)`), "inner_dropout" / "outer_dropout" (`nn.Dropout(inplace=True)`), "residual"
    (`branch.add_(x)`: the sum written into the branch's output) and "residual_into_input"
    (`x.add_(branch)`: into the block's input, which the norm or fc1 saved: autograd refuses it)."""

    hidden_size: int
    intermediate_size: int
    activation: str = "relu"
    norm: str = "none"
    inner_dropout: float = 0.0
    outer_dropout: float = 0.0
    # the code keeps a name on fc2's output until the residual add (T5LayerFF's
    # `hidden_states + self.dropout(forwarded_states)`): that tensor outlives an out-of-place dropout
    branch_ref: bool = False

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        put("branch_ref", _checks.flag("branch_ref", self.branch_ref))
        put("hidden_size", _checks.whole("hidden_size", self.hidden_size, hi=MAX_PARAMS))
        put("intermediate_size", _checks.whole("intermediate_size", self.intermediate_size, hi=MAX_PARAMS))
        _checks.one_of("activation", self.activation, BLOCK_ACTIVATIONS)
        _checks.one_of("norm", self.norm, BLOCK_NORMS)
        for k in ("inner_dropout", "outer_dropout"):
            p = _checks.number(k, getattr(self, k), lo=0, hi=1, hi_open=True)
            put(k, float(p))


def inplace_set(inplace) -> frozenset[str]:
    if isinstance(inplace, str):
        inplace = (inplace,)
    if isinstance(inplace, bool) or not isinstance(inplace, Iterable) or isinstance(inplace, (bytes, dict)):
        raise ValueError(f"inplace must be a collection of op names from {', '.join(INPLACE_OPS)}, "
                         f"got {_checks.show(inplace)}")
    ops = list(inplace)
    for op in ops:
        _checks.one_of("in-place op", op, INPLACE_OPS)
    return frozenset(ops)


def inplace_refusal(block: MLPBlock, inplace: Iterable[str] = ()) -> str | None:
    """Why autograd (or torch) refuses running these ops of `block` in place, or None if it allows it.
    The rule: an op may overwrite a tensor only if no earlier op saved that tensor for backward."""
    if not isinstance(block, MLPBlock):
        raise ValueError(f"block must be a vramlab.inplace.MLPBlock, got {_checks.show(block)}")
    ops = inplace_set(inplace)
    act = block.activation
    if "activation" in ops and act == "gelu":
        return "torch has no in-place GELU (nn.GELU and F.gelu take no inplace argument)"
    if "inner_dropout" in ops and block.inner_dropout > 0 and act in _SAVES_OUTPUT:
        return (f"in-place dropout after {act} overwrites {act}'s output, which {act} saved for its backward: "
                "autograd raises 'one of the variables needed for gradient computation has been modified by an "
                "inplace operation' in the backward")
    if "residual_into_input" in ops:
        saver = "the norm" if block.norm != "none" else "fc1 (a Linear saves its input for the weight's gradient)"
        return (f"x.add_(branch) overwrites the block's input x, which {saver} saved: autograd raises 'one of "
                "the variables needed for gradient computation has been modified by an inplace operation' in the "
                "backward (and 'a leaf Variable that requires grad is being used in an in-place operation' in the "
                "forward if x is a leaf); write the sum into the branch instead: branch.add_(x)")
    return None


def mlp_block_memory(block: MLPBlock, *, batch_size: int, seq_len: int, precision: str = "fp32",
                     device: str = "cpu", inplace: Iterable[str] = ()) -> dict:
    """Bytes of one training forward of `block` (`MLPBlock`), with the ops in `inplace` run in place:

    saved         distinct tensors autograd saved for backward (parameters excluded; the block's input
                  counted where an op saves it, as in `layer_saved`)
    forward_peak  the most bytes allocated at once during the forward, beyond the parameters and the input
    end           bytes still allocated when the forward returns (saved tensors and the output)

    Simulated op by op from what each kernel allocates and saves (see the notes above `BLOCK_ACTIVATIONS`).
    `precision`: "fp32", or "bf16"/"fp16" for a model in 16 bits (no autocast). Raises ValueError, with
    autograd's reason, for a choice it refuses (`inplace_refusal`).
    Known limitations: the LayerNorm's statistics are counted in the input dtype on the CPU, fp32 on CUDA
    (measured on the CPU only); allocator rounding (CUDA: 512 bytes a block) is left out."""
    if not isinstance(block, MLPBlock):
        raise ValueError(f"block must be a vramlab.inplace.MLPBlock, got {_checks.show(block)}")
    b, s = _checks.whole("batch_size", batch_size), _checks.whole("seq_len", seq_len)
    _checks.one_of("precision", precision, ("fp32", "bf16", "fp16"))
    _checks.one_of("device", device, ("cuda", "cpu"))
    ops = inplace_set(inplace)
    why = inplace_refusal(block, ops)
    if why:
        raise ValueError(f"in place refused: {why}")
    t, h, i = b * s, block.hidden_size, block.intermediate_size
    nb = 4 if precision == "fp32" else 2
    live: dict[str, int] = {}
    saved: set[str] = set()
    peak = 0

    def alloc(name: str, nbytes: int) -> None:
        nonlocal peak
        live[name] = nbytes
        peak = max(peak, sum(live.values()))

    def drop(name: str) -> None:  # freed unless autograd saved it
        if name not in saved:
            live.pop(name, None)

    def dropout(src: str, p: float, width: int, where: str) -> str:
        if p <= 0:
            return src
        if where in ops:  # dropout_: noise in the dtype, then src.mul_(noise); mul_ saves the noise
            alloc(f"{where} noise", t * width * nb)
            saved.add(f"{where} noise")
            return src
        if device == "cuda":  # native_dropout: output and a bool mask, the mask saved
            alloc(f"{where} out", t * width * nb)
            alloc(f"{where} mask", t * width)
            saved.add(f"{where} mask")
        else:  # the CPU's dropout is the same noise-and-multiply, out of place
            alloc(f"{where} noise", t * width * nb)
            saved.add(f"{where} noise")
            alloc(f"{where} out", t * width * nb)
        if not (where == "outer_dropout" and block.branch_ref):
            drop(src)
        return f"{where} out"

    a = "x"
    saved_x = t * h * nb  # the norm, or fc1, saves the input
    if block.norm == "layernorm":  # native_layer_norm: output, mean, rstd; saves x, mean, rstd
        stat = 4 if device == "cuda" else nb
        alloc("ln out", t * h * nb)
        alloc("ln mean", t * stat)
        alloc("ln rstd", t * stat)
        saved.update(("ln mean", "ln rstd"))
        a = "ln out"
    elif block.norm == "rmsnorm":  # T5LayerNorm: v = x.float().pow(2).mean(-1); w * (x * rsqrt(v + eps)).to(dtype)
        if nb != 4:  # the fp32 copy, which pow saves (in fp32, .to() returns x itself)
            alloc("x fp32", t * h * 4)
            saved.add("x fp32")
        alloc("x^2", t * h * 4)
        alloc("variance", t * 4)
        drop("x^2")
        alloc("variance + eps", t * 4)
        drop("variance")
        alloc("rsqrt", t * 4)  # saved (rsqrt's backward reads its result; the multiply reads it too)
        saved.add("rsqrt")
        drop("variance + eps")
        alloc("normalized", t * h * 4)  # x * rsqrt: fp32 (an fp32 factor promotes a 16-bit x)
        if nb != 4:
            alloc("normalized (cast)", t * h * nb)
            drop("normalized")
        saved.add("normalized (cast)" if nb != 4 else "normalized")  # the weight multiply saves it
        alloc("norm out", t * h * nb)  # weight * normalized
        a = "norm out"
    saved.add(a)  # fc1 saves its input (for the weight's gradient)
    alloc("z", t * i * nb)  # fc1's output
    act = block.activation
    if "activation" in ops:
        if act in _SAVES_OUTPUT:  # z overwritten by act(z), which is saved
            saved.add("z")
        else:  # silu_: autograd keeps a copy of the original input
            alloc("z copy", t * i * nb)
            saved.add("z copy")
        r = "z"
    else:
        alloc("act out", t * i * nb)
        saved.add("act out" if act in _SAVES_OUTPUT else "z")
        drop("z")
        r = "act out"
    d = dropout(r, block.inner_dropout, i, "inner_dropout")
    saved.add(d)  # fc2 saves its input
    alloc("y", t * h * nb)  # fc2's output (not saved)
    y = dropout("y", block.outer_dropout, h, "outer_dropout")
    if "residual" in ops:  # y.add_(x)
        out = y
    else:
        alloc("out", t * h * nb)
        drop(y)
        out = "out"
    if block.branch_ref and out != "y":
        drop("y")
    saved_bytes = sum(live[n] for n in saved if n in live)
    if "x" not in live:  # the input: allocated before the block (not in the peak) but saved by it
        saved_bytes += saved_x
    return {"saved": saved_bytes, "forward_peak": peak, "end": sum(live.values()),
            "output": live[out], "inplace": tuple(sorted(ops))}


@dataclass(frozen=True, kw_only=True)
class InplaceSite:
    """One op of a preset family's block that could write into its input instead of a new tensor.

    width         elements per token of the tensor it would overwrite (0: one per attention score)
    allowed       autograd (and torch) allow it here
    saved_change  bytes per token it adds to what the block saves for backward (0: the ledger of
                  `layer_saved` is unchanged)
    transient     bytes per token fewer alive while the op runs (the output it no longer allocates):
                  the forward peak falls by this at most, and only if the peak is at that op
    why           autograd's rule, and where the site is in transformers' code"""

    name: str
    op: str
    width: int
    allowed: bool
    saved_change: int
    transient: int
    why: str


_NO_INPLACE_GELU = {"gelu": "GELUActivation (F.gelu): torch has no in-place GELU",
                    "gelu_new": "gelu_new is written out of several ops (x^3, tanh, ...): no inplace flag",
                    "gelu_fast": "gelu_fast is written out of several ops: no inplace flag",
                    "quick_gelu": "quick_gelu is x * sigmoid(1.702 x): no inplace flag"}


def inplace_sites(spec: ModelSpec, *, device: str = "cuda", precision: Precision = "fp32",
                  attention: AttentionImpl = "sdpa") -> tuple[InplaceSite, ...]:
    """Where one block of `spec`'s family could run an op in place, and what it would change: the
    activation (`nn.ReLU(inplace=True)`), each dropout (`nn.Dropout(inplace=True)`; OPT's are
    `F.dropout` calls), the residual add written into the branch (`branch.add_(residual)`) or into
    the residual stream (`residual.add_(branch)`). Autograd's rules are in the notes above
    `BLOCK_ACTIVATIONS`; `mlp_block_memory` prices a whole MLP block (measured in tests/test_inplace.py,
    T5's feed-forward layer among them).
    Known limitations: the in-place dropout's CUDA numbers are read from ATen's source, measured on the
    CPU only (where both forms save the same noise tensor); under autocast, `branch.add_(x)` writes the
    fp32 residual sum into a 16-bit tensor, which autograd allows but which changes the numerics."""
    spec = _resolve(spec)
    _checks.one_of("device", device, ("cuda", "cpu"))
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("attention implementation", attention, ATTENTIONS)
    nb = dtype_sizes(precision, device)
    half, x = nb["half"], nb["x"]
    h, i, f = spec.hidden_size, spec.intermediate_size, spec.family
    sites: list[InplaceSite] = []

    def dropout(name: str, width: int, saved_by: str | None, where: str) -> None:
        if saved_by:
            sites.append(InplaceSite(name=name, op="dropout", width=width, allowed=False, saved_change=0, transient=0,
                                     why=f"{where}: overwrites {saved_by}, saved for its backward: autograd raises "
                                         "'modified by an inplace operation' in the backward"))
        elif device == "cuda":  # native_dropout: output + bool mask; dropout_: a noise tensor in the dtype
            sites.append(InplaceSite(name=name, op="dropout", width=width, allowed=True,
                                     saved_change=width * (half - 1), transient=width,
                                     why=f"{where}: allowed, but CUDA's fused dropout saves a 1-byte mask and "
                                         f"dropout_ a {half}-byte noise tensor: it saves more than it frees"))
        else:  # the CPU's dropout saves the noise either way: in place frees the output only
            sites.append(InplaceSite(name=name, op="dropout", width=width, allowed=True, saved_change=0,
                                     transient=width * half,
                                     why=f"{where}: allowed; the CPU saves the noise either way, in place drops the output"))

    # the MLP's activation
    act = spec.activation
    gate = "act(gate) of the gated MLP" if spec.gated_mlp else "the MLP's activation"
    if act in _SAVES_OUTPUT:
        sites.append(InplaceSite(name=f"{act} ({gate})", op="activation", width=i, allowed=True, saved_change=0,
                                 transient=i * half,
                                 why=f"{act} saves its output: in place loses nothing the backward needs; "
                                     "only the forward's copy of the projection's output goes"))
    elif act == "silu":
        sites.append(InplaceSite(name=f"silu ({gate})", op="activation", width=i, allowed=True, saved_change=0,
                                 transient=0, why="silu's backward reads its input: silu_ makes autograd keep a "
                                                  "copy of it first, so in place saves nothing at all"))
    else:
        sites.append(InplaceSite(name=f"{act} ({gate})", op="activation", width=i, allowed=False, saved_change=0,
                                 transient=0, why=_NO_INPLACE_GELU.get(act, f"{act}: no inplace flag")))
    p = spec.hidden_dropout > 0
    if f == "t5" and p:
        dropout("dropout inside the MLP", i, None if spec.gated_mlp else f"{act}'s output",
                "T5DenseActDense: wi -> act -> dropout" if not spec.gated_mlp else "after act(wi_0) * wi_1")
    if p:
        names = {"gpt2": ("attention output dropout (resid_dropout)", "MLP output dropout"),
                 "gpt_neox": ("post_attention_dropout", "post_mlp_dropout"),
                 "opt": ("attention output dropout (F.dropout)", "MLP output dropout (F.dropout)"),
                 "bert": ("attention output dropout (BertSelfOutput)", "MLP output dropout (BertOutput)"),
                 "t5": ("self-attention output dropout", "feed-forward output dropout")}.get(f, ())
        for n in names:
            dropout(n, h, None, "on a projection's output, which the projection does not save")
    if spec.attention_dropout > 0 and attention == "eager":  # (SDPA's math path drops out internally)
        dropout("attention-probabilities dropout", 0, "softmax's output (softmax saves its result)",
                "eager attention: softmax -> dropout")
    # the residual add: into the branch, or into the stream
    amp = precision in ("bf16-mixed", "fp16-mixed")
    sites.append(InplaceSite(name="residual add into the branch: branch.add_(residual)", op="residual", width=h,
                             allowed=True, saved_change=0, transient=h * x,
                             why="add saves nothing, and no op saved the branch's output (a projection or "
                                 "dropout output)" + ("; under autocast it writes the fp32 sum into a 16-bit "
                                                      "tensor, which changes the residual stream's precision"
                                                      if amp else "")))
    saver = "the next sublayer's q/k/v or dense projections (post-norm: the stream is a LayerNorm's output)" \
        if f == "bert" else "the sublayer's norm (pre-norm: the norm saves its input)"
    sites.append(InplaceSite(name="residual add into the stream: residual.add_(branch)", op="residual", width=h,
                             allowed=False, saved_change=0, transient=0,
                             why=f"overwrites the residual stream, which {saver} saved: autograd raises "
                                 "'modified by an inplace operation' in the backward"))
    return tuple(sites)


INPLACE_CHOICES: tuple[str, ...] = ("none", "where it frees memory", "every allowed site")


def inplace_step(spec: ModelSpec, *, batch_size: int, seq_len: int, choice: str = "every allowed site",
                 device: str = "cuda", precision: Precision = "fp32", attention: AttentionImpl = "sdpa") -> dict:
    """What running ops in place changes over a whole model's training step, from `inplace_sites`:
    `choice` is "none", "where it frees memory" (the allowed sites that free a forward allocation and save no more
    for the backward: ReLU, the residual add into the branch; not SiLU, which gains nothing) or "every allowed site" (CUDA's in-place dropouts too, which
    save a noise tensor in the dtype instead of a 1-byte mask).

    Returns saved (bytes added to what every block keeps for its backward, summed over the blocks:
    what the step's peak at the start of the backward grows by; negative never happens: no allowed
    in-place op frees a saved tensor), per_block (each block's share; T5's decoder blocks hold one
    more output dropout, after the cross-attention), transient (the largest forward-only allocation
    avoided in one block: the forward's momentary peak falls by at most this), blocks and sites (the
    names chosen). Without recompute every block's saved tensors are alive at the backward's start;
    with recompute they are not, and this ledger does not say which are, so the caller must not add
    `saved` to a recomputing step's peak."""
    spec = _resolve(spec)
    _checks.one_of("in-place choice", choice, INPLACE_CHOICES)
    b = _checks.whole("batch_size", batch_size, lo=1)
    s = _checks.whole("seq_len", seq_len, lo=1)
    sites = inplace_sites(spec, device=device, precision=precision, attention=attention)
    if choice == "none":
        chosen: tuple[InplaceSite, ...] = ()
    else:
        chosen = tuple(x for x in sites if x.allowed and (choice == "every allowed site"
                                                           or (x.saved_change <= 0 < x.transient)))
    tokens = b * s
    per_block = sum(x.saved_change for x in chosen) * tokens
    encoder_decoder = spec.family == "t5"
    n_enc = spec.num_layers
    n_dec = spec.num_decoder_layers if encoder_decoder else 0
    # a T5 decoder block adds a cross-attention sublayer: one more output dropout on a projection's output
    cross = next((x for x in chosen if x.op == "dropout" and x.name.startswith("self-attention output")), None)
    saved = per_block * (n_enc + n_dec) + (cross.saved_change * tokens * n_dec if cross else 0)
    transient = max((x.transient for x in chosen), default=0) * tokens
    return {"saved": saved, "per_block": per_block, "transient": transient, "blocks": n_enc + n_dec,
            "sites": tuple(x.name for x in chosen)}
