"""``phaselens plan`` on hostile configs (issue 44, class 6): every size bounded before anything is computed, the
JSON it reads bounded in depth, and messages that name ``plan``'s own options and the valid range.

Each case was a raw error, an out-of-memory kill or an unclear message: a dimension of 1e13 overflowed a storage
calculation, a deeply nested config.json raised RecursionError, ``--items 10**15`` ran out of memory and
suggested ``--n-per-residue`` (an option of other commands), and an out-of-range ``kv_source_layer_ids`` was
refused without the valid layers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import phaselens
from phaselens.errors import CheckpointError, PhaseLensError
from phaselens.planning.checkpoint_plan import plan_model
from phaselens.presentation.cli import app
from phaselens.storage.reading import MAX_JSON_DEPTH, json_depth, parse_json
from tests.support.paths import DATA

runner = CliRunner()
FLASH = DATA / "configs" / "DeepSeek-V4.1-Flash"
V4 = DATA / "configs" / "DeepSeek-V4-Flash"


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    return Path(write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt"))


def edited(src: Path, dest: Path, edit) -> Path:
    """A copy of ``src`` (weights hard-linked) whose config.json is ``edit(raw)``'s."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.link(f, dest / f.name)
    raw = json.loads((src / "config.json").read_text())
    edit(raw)
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


def text(key, value):
    return lambda raw: raw["text_config"].__setitem__(key, value)


def one_line_error(args) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 3, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], res.output
    return lines[0]


def _refusal(fn) -> PhaseLensError:
    with pytest.raises(PhaseLensError) as info:
        fn()
    return info.value


@pytest.mark.parametrize(("key", "value"), [("hidden_size", 10**13), ("vocab_size", 10**13),
                                            ("n_routed_experts", 2**40), ("num_attention_heads", 2**31)])
def test_a_huge_dimension_is_refused_by_plan_and_load_alike(v41_dir, tmp_path, key, value):
    d = edited(v41_dir, tmp_path / "c", text(key, value))
    planned, loaded = _refusal(lambda: plan_model(str(d), context=64)), _refusal(lambda: phaselens.load(f"hf:{d}"))
    assert (type(planned), str(planned)) == (type(loaded), str(loaded))
    assert f"text_config.{key}={value:,} exceeds 2,147,483,647" in str(planned)


def test_dimensions_within_bounds_whose_product_overflows_are_named(v41_dir, tmp_path):
    """hc_mult = 2^31 - 1 passes the per-field bound, but its mixes are hc_mult^2 x hidden: beyond 2^63 bytes."""
    d = edited(v41_dir, tmp_path / "c", text("hc_mult", 2**31 - 1))
    for call in (lambda: plan_model(str(d), context=64), lambda: phaselens.load(f"hf:{d}")):
        err = _refusal(call)
        assert isinstance(err, CheckpointError) and "more than 2^63 bytes" in str(err) and "config.json" in str(err)


def test_the_cli_names_the_field_of_a_huge_v4_dimension(tmp_path):
    d = edited(V4, tmp_path / "v4", lambda raw: raw.__setitem__("hidden_size", 10**13))
    line = one_line_error(["plan", str(d)])
    assert "hidden_size=10,000,000,000,000 exceeds 2,147,483,647" in line


def test_a_deeply_nested_config_is_refused_without_recursion(tmp_path):
    d = tmp_path / "deep"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "deepseek_v41", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = one_line_error(["plan", str(d)])
    assert f"nest more than {MAX_JSON_DEPTH} levels deep" in line and "config.json" in line
    assert isinstance(_refusal(lambda: phaselens.load(f"hf:{d}")), PhaseLensError)


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth('{"a": [1, {"b": "[[[[{{{"}]}') == 3 and json_depth("7") == 0
    assert json_depth('"\\"[["') == 0  # an escaped quote does not end the string
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(ValueError, match="nest more than"):
        parse_json("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


def test_a_huge_item_count_is_priced_from_numbers(v41_dir):
    """--items 10**15 listed 10**15 batch sizes and ran out of memory; it is a count now."""
    t0 = time.perf_counter()
    plan = plan_model(str(v41_dir), context=64, items=10**15, item_batch=3)
    m = plan.time["map"]
    assert m["items"] == 10**15 and m["prefix_passes"] == -(-(10**15) // 3)
    small = plan_model(str(v41_dir), context=64, items=7, item_batch=3).time["map"]
    assert small["prefix_passes"] == 3  # 3 + 3 + 1
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("option", ["--items", "--item-batch", "--batch", "--context"])
def test_counts_beyond_2_53_are_refused_naming_plans_option(v41_dir, option):
    line = one_line_error(["plan", str(v41_dir), option, str(2**60)])
    assert f"{option} (" in line and "2^53" in line


def test_out_of_memory_names_plans_own_options(monkeypatch):
    import phaselens.planning.checkpoint_plan as capacity

    def exhausted(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(capacity, "plan_model", exhausted)
    line = one_line_error(["plan", str(FLASH)])
    assert "ran out of memory" in line and "--items" in line
    assert "--n-per-residue" not in line and "--batch-size" not in line  # options plan does not have


def test_an_out_of_range_kv_source_says_the_valid_layers(v41_dir, tmp_path):
    raw = json.loads((v41_dir / "config.json").read_text())["text_config"]
    ids = list(raw["kv_source_layer_ids"])
    ids[-1] = 99
    d = edited(v41_dir, tmp_path / "c", text("kv_source_layer_ids", ids))
    line = one_line_error(["plan", str(d)])
    n = raw["num_hidden_layers"]
    assert "text_config.kv_source_layer_ids lists layers [99]" in line
    assert f"must be one of layers 2..{n - 1}" in line and f"0..{n - 1}" in line, line
