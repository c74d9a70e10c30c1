"""The adapter against DeepSeek's own V4 ``inference/model.py``, when a local copy is given.

phaselens cannot ship DeepSeek's code, so this runs only with ``PHASELENS_DEEPSEEK_V4_INFERENCE`` set to a
directory holding it (a released checkpoint's ``inference/``, or the first commit with real files of GitHub
``Mockingjay1316/deepseek-v4-flash-spark``); otherwise it is skipped. It runs ``tests/reference/v4_parity.py``
at a smaller size (1 x 128 tokens) and holds the results to the bars of issue 25: fp32 to float rounding, and in
bf16 ``numerics="reference"`` within the floor (two legitimate emulations of DeepSeek's attention kernel).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.deepseek import one_thread  # noqa: F401  (fixture)

INFERENCE = os.environ.get("PHASELENS_DEEPSEEK_V4_INFERENCE")
pytestmark = pytest.mark.skipif(
    not INFERENCE or not (Path(INFERENCE) / "model.py").is_file(),
    reason="set PHASELENS_DEEPSEEK_V4_INFERENCE to a local copy of DeepSeek-V4's inference/ directory",
)


@pytest.fixture(scope="module")
def results():
    from tests.reference.v4_parity import run

    return run(Path(INFERENCE), tokens=128, batch=1, binding_topk=8)


def test_fp32_is_the_reference_to_float_rounding(results):
    for numerics in ("transformers", "reference"):
        assert results["fp32"][numerics]["max_rel"] < 1e-5  # measured 3e-7 at 2 x 256 tokens


@pytest.mark.parametrize("topk", ["all_entries", "binding"])
def test_bf16_reference_numerics_are_within_the_floor(results, topk):
    section = results["bf16"][topk]
    floor = min(section["floor_blocks_of_8"]["mean_rel"], section["floor_fp32_probabilities"]["mean_rel"])
    assert section["reference"]["mean_rel"] < floor < section["transformers"]["mean_rel"]


def test_op_by_op_the_reference_numerics_compute_what_deepseek_does(results):
    ops = results["ops"]["reference"]
    for op in ("compressor entries", "router weights", "MoE (routed + shared)", "shared expert", "head"):
        assert all(v in (None, 0.0) for v in ops[op]), op  # bit for bit given the same input
    floor = results["ops"]["floor"]["attention core, floor (blocks of 8)"]
    assert all(ours <= max(f, 1e-5) for ours, f in zip(ops["attention core"], floor))
    assert all(v in (None, 1.0) for v in ops["router experts (agreement)"])


def test_the_quantize_settings_reproduce_their_kernels(results):
    q = results["quantize"]["binding"]
    assert q["adapter 'published' vs reference as published"]["mean_rel"] < \
        q["floor as published (reference, blocks of 8)"]["mean_rel"]
    assert q["adapter 'fp8' vs reference with e4m3"]["mean_rel"] < q["floor with e4m3 (reference, blocks of 8)"]["mean_rel"]
    assert q["adapter 'fp8' vs reference as published"]["mean_rel"] > q["floor as published (reference, blocks of 8)"]["mean_rel"]
