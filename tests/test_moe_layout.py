"""An MoE's model states per rank under tensor, pipeline and expert parallelism with ZeRO
(`expert_parallel.moe_layout_states`, Megatron-Core's parallel folding). Checked against the transformers models
built on the meta device at their published shapes: each rank's tensors cut out of the real parameters with
torch (`tensor_split` along the dimension Megatron-Core splits -- heads and MLP widths by columns or rows,
vocabulary rows, experts along their first dimension and inside each by etp -- and the blocks split over
stages by `tensor_split` of the layer list), counted with numel(): the shapes are the library's, the cut is
torch's."""

import json

import pytest

from vramlab import expert_parallel, specs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Megatron-Core's layer specs: linear_qkv / linear_fc1 / MLA's up-projections column-parallel (dim 0 of a
# torch (out, in) weight), linear_proj / linear_fc2 row-parallel (dim 1), MLA's down-projections, the norms
# and the router duplicated, embedding and output layer vocabulary-parallel (rows)
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"}
ROW = {"o_proj", "down_proj"}
VOCAB = {"embed_tokens", "lm_head"}


def _model(name):
    d = json.loads((specs._preset_dir() / f"{name}.json").read_text())
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _cut(name, p, *, tp, ep, etp):
    """This rank's (rank 0 of every group: the largest piece) part of parameter `name`."""
    parts = name.split(".")
    if "experts" in parts and "shared_experts" not in parts:  # (E, 2i, h) gate_up or (E, h, i) down
        mine = torch.tensor_split(p, ep, dim=0)[0]
        return "experts", torch.tensor_split(mine, etp, dim=1 if parts[-1] == "gate_up_proj" else 2)[0]
    owner = parts[-2]
    if owner in VOCAB:
        return "dense", torch.tensor_split(p, tp, dim=0)[0]
    if owner in COLUMN:
        return "dense", torch.tensor_split(p, tp, dim=0)[0]
    if owner in ROW and parts[-1] == "weight":
        return "dense", torch.tensor_split(p, tp, dim=1)[0]
    return "dense", p


def _rank_counts(model, *, tp, pp, ep, etp):
    """Per stage: {"dense": elements, "experts": elements} of rank 0 of its tp x dp ranks."""
    layers = model.model.layers
    stages = [list(x) for x in torch.tensor_split(torch.arange(len(layers)), pp)]
    out = []
    for k, mine in enumerate(stages):
        modules = [(f"model.layers.{int(i)}", layers[int(i)]) for i in mine]
        if k == 0:
            modules.append(("model.embed_tokens", model.model.embed_tokens))
        if k == pp - 1:
            modules += [("model.norm", model.model.norm), ("lm_head", model.lm_head)]
        n = {"dense": 0, "experts": 0}
        for prefix, m in modules:
            for pname, p in m.named_parameters():
                kind, piece = _cut(f"{prefix}.{pname}", p, tp=tp, ep=ep, etp=etp)
                n[kind] += piece.numel()
        out.append(n)
    return out


@pytest.mark.parametrize("name, tp, pp, ep, etp, dp", [
    ("mixtral-8x7b", 2, 2, 8, 1, 4),  # Mixtral: GQA, 8 experts, no shared ones
    ("mixtral-8x7b", 4, 4, 2, 2, 2),  # experts split by etp as well
    ("qwen3-30b-a3b", 4, 4, 16, 1, 8),  # 128 experts, q/k norms
    ("qwen1.5-moe-a2.7b", 2, 3, 4, 1, 2),  # shared expert with its gate; 24 blocks over 3 stages
    ("olmoe-1b-7b", 2, 1, 8, 2, 8),
    ("deepseek-v2-lite", 2, 3, 8, 1, 4),  # MLA without a query down-projection; a dense first block
    ("deepseek-v3", 1, 16, 64, 1, 128),  # as DeepSeek trained it: PP 16, EP 64 (V3 report, 3.2)
    ("deepseek-v3", 8, 8, 32, 1, 4),  # MLA's up-projections split, its down-projections duplicated
])
def test_rank_states_equal_the_real_tensors_cut_as_megatron_cuts_them(name, tp, pp, ep, etp, dp):
    model = _model(name)
    want = _rank_counts(model, tp=tp, pp=pp, ep=ep, etp=etp)
    r = expert_parallel.moe_layout_states(name, tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, zero_stage=1)
    assert [s["param_counts"] for s in r["stages"]] == want
    assert r["edp"] * r["ep"] * r["etp"] == tp * dp
    busiest = max(r["stages"], key=lambda s: s["states"])
    assert r["states"] == busiest["states"] and r["devices"] == tp * pp * dp


def test_zero_shards_dense_over_dp_and_experts_over_edp():
    base = expert_parallel.moe_layout_states("mixtral-8x7b", tp=2, ep=4, dp=8, precision="bf16-mixed")["stages"][0]
    z1 = expert_parallel.moe_layout_states("mixtral-8x7b", tp=2, ep=4, dp=8, zero_stage=1)["stages"][0]
    z2 = expert_parallel.moe_layout_states("mixtral-8x7b", tp=2, ep=4, dp=8, zero_stage=2)["stages"][0]
    n = base["param_counts"]
    edp = 2 * 8 // 4
    # AdamW in fp32 (AMP's master weights are the model): 8 bytes an element, over the owning group
    assert z1["optimizer_states"] == {"dense": 8 * -(-n["dense"] // 8), "experts": 8 * -(-n["experts"] // edp)}
    assert z1["gradients"] == base["gradients"] == {"dense": 4 * n["dense"], "experts": 4 * n["experts"]}
    assert z2["gradients"] == {"dense": 4 * -(-n["dense"] // 8), "experts": 4 * -(-n["experts"] // edp)}
    assert z2["states"] < z1["states"] < base["states"]


def test_more_expert_ranks_never_hold_more():
    prev = None
    for ep in (1, 2, 4, 8):
        s = expert_parallel.moe_layout_states("mixtral-8x7b", tp=1, ep=ep, dp=8, zero_stage=1)["states"]
        assert prev is None or s < prev
        prev = s


@pytest.mark.parametrize("kw, says", [
    (dict(ep=3, dp=3), "must divide mixtral-8x7b's 8 routed experts"),
    (dict(ep=8, dp=2), "etp x ep must divide tp x dp"),
    (dict(tp=3), "tp=3 must divide"),
    (dict(etp=3, dp=3), "etp must divide"),
    (dict(pp=33), "pp must be at most"),
    (dict(zero_stage=3), "zero_stage"),
    (dict(ep=0), "ep"),
])
def test_bad_layouts_are_one_line(kw, says):
    with pytest.raises(ValueError, match=None) as e:
        expert_parallel.moe_layout_states("mixtral-8x7b", **kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="dense model"):
        expert_parallel.moe_layout_states("llama-3.2-1b", ep=2, dp=2)
