"""vramlab.grading.offload.check_forward_from_disk: lab 6's forward from a model stored on disk in
ZeRO-Infinity's aligned layout. The lab's solution passes (and so do answers that read a layer's
padding or read it in pieces); wrong offsets, wrong widths, reading the whole file, holding every
layer and copying each read fail, each with a line that names the mistake. The harness draws the
same input and weights as the check's reference."""

from __future__ import annotations

import pytest
import torch

from vramlab.grading.offload import check_forward_from_disk, disk_build, disk_cases, disk_layout, disk_reference
from vramlab.grading.programs import disk

from .conftest import answer, edited, solution

torch.set_num_threads(1)

SOURCE = solution("lab06_offload", "disk-solution")
READ = "f.readinto(memoryview(buffer)[:nbytes])"
WIDTH = "torch.empty(0, dtype=dtype).element_size()"


def _check(source: str, **kw) -> None:
    check_forward_from_disk(answer(source, "forward_from_disk"), **{"seed": 3, "n": 2, **kw})


def test_the_harness_draws_what_the_check_computes_its_reference_from():
    for case in disk_cases(5, 4):
        x, weights = disk_build(case)
        hx, hweights = disk.build(case)
        assert torch.equal(x, hx) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(weights, hweights))
        assert disk_layout(case) == disk.layout(case)
        for w in hweights:
            hx = disk.apply(hx, w)
        assert torch.equal(hx, disk_reference(case))


def test_every_case_shows_the_mistakes():
    """Both widths in every model, and no layer's bytes a multiple of the alignment: ignoring the
    alignment or a dtype's width always moves some offset or read."""
    for case in disk_cases(7, 20):
        dtypes = {dt for _, _, dt in case["layers"]}
        assert "float32" in dtypes and dtypes & {"float16", "bfloat16"}
        assert all(nbytes % case["align"] for _, nbytes in disk_layout(case)[0])


@pytest.mark.slow
@pytest.mark.parametrize("source", [
    SOURCE,
    edited(SOURCE, READ, "f.readinto(memoryview(buffer)[:-(-nbytes // align) * align])"),  # with its padding
    edited(SOURCE, READ, "[f.readinto(memoryview(buffer)[k:min(k + 65536, nbytes)]) for k in range(0, nbytes, 65536)]"),
], ids=["solution", "padding", "pieces"])
def test_the_solution_passes(source):
    _check(source, n=3)


@pytest.mark.slow
def test_the_hidden_run_draws_its_models_from_the_os():
    _check(SOURCE, seed=None)


LOAD_ALL = '''
def forward_from_disk(f, manifest, x, *, run_layer, align, buffer):
    weights, offset = [], 0
    for name, shape, dtype in manifest:
        numel = torch.Size(shape).numel()
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        f.seek(offset)
        f.readinto(memoryview(buffer)[:nbytes])
        weights.append(torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape).clone())
        offset += -(-nbytes // align) * align
    for i, w in enumerate(weights):
        x = run_layer(i, x, w)
    return x
'''

WRONG = [
    ("packed", edited(SOURCE, "offset += -(-nbytes // align) * align", "offset += nbytes"),
     r"layer \d's bytes start at offset [\d,]+, not [\d,]+: the layers are not packed end to end"),
    ("width 4", edited(SOURCE, WIDTH, "4"), r"layer \d is b?float16, 2 bytes a value: .* \(4 bytes a value\)"),
    ("width 2", edited(SOURCE, WIDTH, "2"), r"layer \d is float32, 4 bytes a value: .* \(2 bytes a value\)"),
    ("whole file", edited(SOURCE, "    offset = 0\n", "    offset, everything = 0, f.read()\n"),
     r"f\.read\(\) read the whole file \([\d,]+ bytes\) at once"),
    ("every layer", LOAD_ALL, r"held [\d.]+ [KM]iB when layer \d ran, besides the one buffer .*every layer at once"),
    ("new bytes", edited(SOURCE, f"{READ}\n        weight = torch.frombuffer(buffer,",
                         "data = bytearray(f.read(nbytes))\n        weight = torch.frombuffer(data,"),
     r"held [\d.]+ [KM]iB .*f\.read\(n\) makes new bytes"),
    ("a copy", edited(SOURCE, ".view(shape)", ".view(shape).clone()"), r"held .* not on a copy of it"),
    ("float32 view", edited(SOURCE, "frombuffer(buffer, dtype=dtype", "frombuffer(buffer, dtype=torch.float32"),
     r"layer \d ran on a float32 weight: the manifest says b?float16"),
    ("the whole buffer", edited(SOURCE, "memoryview(buffer)[:nbytes]", "buffer"),
     r"[\d,]+ bytes were read for layer \d: it is [\d,]+ bytes \([\d,]+ with its padding"),
]


@pytest.mark.slow
@pytest.mark.parametrize("source, match", [(s, m) for _, s, m in WRONG], ids=[k for k, _, _ in WRONG])
def test_wrong_answers_fail_with_their_mistake(source, match):
    with pytest.raises(AssertionError, match=match) as e:
        _check(source)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.slow
def test_the_stub_says_it_is_not_implemented():
    with pytest.raises(NotImplementedError):
        _check("def forward_from_disk(f, manifest, x, *, run_layer, align, buffer):\n    raise NotImplementedError()\n")
