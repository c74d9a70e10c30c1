"""A plan refuses what the run would refuse, with the same message, and before anything is built (issue
"Reliability round 4"): ``phaselens plan`` against ``phaselens.load`` on malformed config.json files, a context
priced from numbers, ``--plan`` never silently dropping ``--out``, and every ``train`` argument checked before the
first step."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import phaselens
from phaselens.errors import PhaseLensError
from phaselens.planning.checkpoint_plan import plan_model
from phaselens.presentation.cli import app
from tests.support.paths import DATA

runner = CliRunner()
CONFIGS = DATA / "configs"
MISSING = object()  # the edit that deletes the field


# ---- config.json: plan and load raise the same error -------------------------------------------------------
@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    return Path(write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt"))


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """A tiny transformers DeepSeek-V4 whose config schedules its layers by ``compress_ratios``, as the releases do
    (``layer_types`` dropped: load's own length check of a listed schedule comes before the config check)."""
    from tests.support.deepseek import tiny_v4_model

    d = tmp_path_factory.mktemp("v4") / "ckpt"
    tiny_v4_model().save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("layer_types")
    raw["compress_ratios"] = [0, 4, 128, 4]
    (d / "config.json").write_text(json.dumps(raw))
    return d


def edited(src: Path, dest: Path, where: str, key: str, value: object) -> Path:
    """A copy of the checkpoint ``src`` (weights hard-linked) with one field of ``config.json`` changed."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.link(f, dest / f.name)
    raw = json.loads((src / "config.json").read_text())
    target = raw if where == "top" else raw.setdefault(where, {})
    if value is MISSING:
        target.pop(key, None)
    else:
        target[key] = value
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


BAD_INT = [0, -1, True, 2.5, "x", None, [1]]
BAD_COUNT = [-1, True, 2.5, "x", None]  # fields where 0 is allowed
BAD_REAL = [0, -1.5, True, "x", None, math.nan, math.inf]
V41_POSITIVE = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"]
V41_REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                "o_lora_rank", "o_groups", "sliding_window", "compress_ratios", "kv_source_layer_ids",
                "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "qk_rope_head_dim"]
V41_CASES = (
    [("text_config", k, v) for k in V41_POSITIVE for v in BAD_INT]
    + [("text_config", k, v) for k in ("qk_rope_head_dim", "n_shared_experts", "candidate_topk_blocks",
                                       "candidate_block_size", "num_nextn_predict_layers") for v in BAD_COUNT]
    + [("text_config", k, v) for k in ("rms_norm_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor",
                                       "hc_eps") for v in BAD_REAL]
    + [("text_config", "swiglu_limit", v) for v in (-1, True, "x", None)]
    + [("text_config", k, MISSING) for k in V41_REQUIRED]
    + [("text_config", "scoring_func", "bogus"), ("text_config", "hidden_act", "gelu"),
       ("text_config", "norm_topk_prob", "yes"), ("text_config", "candidate_source_layer_id", -2),
       ("text_config", "compress_ratios", "x"), ("text_config", "compress_ratios", [0, "a"]),
       ("text_config", "kv_source_layer_ids", None), ("text_config", "rope_scaling", "x"),
       ("text_config", "engram_num_embeddings", [0]),
       ("quantization_config", "quant_method", "gptq"), ("quantization_config", "quant_method", MISSING),
       ("quantization_config", "fmt", "e5m2"), ("quantization_config", "scale_fmt", "float"),
       ("quantization_config", "expert_dtype", "fp2"), ("quantization_config", "weight_block_size", [0, 32]),
       ("quantization_config", "weight_block_size", "x"), ("top", "quantization_config", "fp8")]
)
V4_POSITIVE = ["hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
               "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_window",
               "index_n_heads", "index_head_dim", "index_topk", "vocab_size", "hc_mult", "hc_sinkhorn_iters",
               "max_position_embeddings"]
V4_CASES = (
    [("top", k, v) for k in V4_POSITIVE for v in BAD_INT]
    + [("top", k, v) for k in ("n_shared_experts", "num_nextn_predict_layers", "num_key_value_heads",
                               "num_hash_layers") for v in BAD_COUNT]
    + [("top", k, v) for k in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor")
       for v in BAD_REAL]
    + [("top", "swiglu_limit", v) for v in (-1, True, "x", None)]
    + [("top", k, v) for k in ("tie_word_embeddings", "norm_topk_prob", "attention_bias") for v in (0, "yes", None)]
    + [("top", "scoring_func", "bogus"), ("top", "hidden_act", "bogus"), ("top", "dtype", "bogus"),
       ("top", "partial_rotary_factor", 2.0), ("top", "compress_ratios", [0, 3, 128, 4]),
       ("top", "mlp_layer_types", ["moe"] * 3), ("top", "rope_parameters", "x"), ("top", "use_cache", 0),
       ("top", "initializer_range", "x"), ("top", "bos_token_id", 2.5), ("top", "expert_dtype", "fp2"),
       ("top", "quantization_config", {"quant_method": "gptq"}),
       ("top", "quantization_config", {"quant_method": "fp8", "fmt": "e5m2"}),
       ("top", "quantization_config", {"quant_method": "fp8", "expert_dtype": "int4"}),
       ("top", "quantization_config", {"quant_method": "fp8", "weight_block_size": [128]}),
       ("top", "quantization_config", {"activation_scheme": "dynamic"})]
)


def _ids(cases: list[tuple[str, str, object]]) -> list[str]:
    return [f"{k}={'missing' if v is MISSING else repr(v)}" + (f"@{w}" if w != "top" else "") for w, k, v in cases]


def _raised(fn) -> PhaseLensError:
    with pytest.raises(Exception) as info:  # noqa: PT011 (the class is what is compared)
        fn()
    assert isinstance(info.value, PhaseLensError), f"{type(info.value).__name__}: {info.value}"
    assert "internal error" not in str(info.value)
    return info.value


def _same_refusal(src: Path, tmp_path: Path, where: str, key: str, value: object) -> None:
    d = edited(src, tmp_path / "ckpt", where, key, value)
    planned = _raised(lambda: plan_model(str(d), context=64))
    loaded = _raised(lambda: phaselens.load(f"hf:{d}"))
    assert (type(planned), str(planned)) == (type(loaded), str(loaded))
    named = key if where in ("top", "text_config") or key in str(planned) else where
    assert named in str(planned)  # the message names the field


@pytest.mark.parametrize(("where", "key", "value"), V41_CASES, ids=_ids(V41_CASES))
def test_v41_plan_and_load_refuse_a_malformed_field_alike(v41_dir, tmp_path, where, key, value):
    _same_refusal(v41_dir, tmp_path, where, key, value)


@pytest.mark.parametrize(("where", "key", "value"), V4_CASES, ids=_ids(V4_CASES))
def test_v4_plan_and_load_refuse_a_malformed_field_alike(v4_dir, tmp_path, where, key, value):
    _same_refusal(v4_dir, tmp_path, where, key, value)


def test_the_unedited_tiny_checkpoints_plan(v41_dir, v4_dir):
    """The tables' baseline: the same checkpoints without an edit plan (and the V4.1 one loads)."""
    for d in (v41_dir, v4_dir):
        assert plan_model(str(d), context=64).weights_bytes > 0
    assert phaselens.load(f"hf:{v41_dir}") is not None


@pytest.mark.parametrize("release", ["DeepSeek-V4.1-Flash", "DeepSeek-V4-Flash"])
@pytest.mark.parametrize(("key", "value"), [("hidden_size", 0), ("num_hidden_layers", 2.5), ("n_routed_experts", -1),
                                            ("num_attention_heads", "64"), ("expert_dtype", "fp2")])
def test_plan_cli_names_the_field_in_one_line(tmp_path, release, key, value):
    """``phaselens plan`` on a released config.json with one bad field: exit 3, one ``error:`` line naming it."""
    where = "text_config" if release.startswith("DeepSeek-V4.1") and key != "expert_dtype" else "top"
    where = "quantization_config" if release.startswith("DeepSeek-V4.1") and key == "expert_dtype" else where
    d = edited(CONFIGS / release, tmp_path / release, where, key, value)
    res = runner.invoke(app, ["plan", str(d)])
    assert res.exit_code == 3, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0]
    assert "internal error" not in res.output and "fix the field" in res.output


# ---- sizes priced from numbers, before anything is built at that size -------------------------------------
@pytest.mark.parametrize("release", ["DeepSeek-V4.1-Flash", "DeepSeek-V4-Flash"])
def test_a_huge_context_is_refused_at_once(release):
    t0 = time.perf_counter()
    res = runner.invoke(app, ["plan", str(CONFIGS / release), "--context", str(10**12)])
    assert res.exit_code == 3 and "max_position_embeddings=1,048,576" in res.output, res.output
    assert time.perf_counter() - t0 < 60  # the meta model only (the released V4 takes seconds); no allocation


def test_a_context_the_config_allows_is_priced_in_bounded_time(tmp_path):
    """A config that claims 10**15 positions: 10**12 tokens in chunks of 64 would be 1.6e10 prefill calls to
    walk; the plan names the chunk that prices instead of hanging."""
    d = edited(CONFIGS / "DeepSeek-V4.1-Flash", tmp_path / "c", "text_config", "max_position_embeddings", 10**15)
    t0 = time.perf_counter()
    with pytest.raises(phaselens.PhaseLensError, match="prefill calls.*--chunk 953675 or larger"):
        plan_model(str(d), context=10**12, chunk=64)
    assert time.perf_counter() - t0 < 60
    plan = plan_model(str(d), context=10**12, chunk=10**6)  # priced from numbers, in seconds
    assert plan.cache_bytes > 10**15 and plan.gpus is None


@pytest.mark.parametrize("size", ["nan", "inf", "-1", "0", "lots", "1e400"])
def test_gpu_memory_must_be_a_finite_size(size):
    res = runner.invoke(app, ["plan", str(CONFIGS / "DeepSeek-V4.1-Flash"), "--gpu-memory", size])
    assert res.exit_code == 3 and "--gpu-memory" in res.output and "internal error" not in res.output


# ---- --plan never drops --out silently -------------------------------------------------------------------
@pytest.mark.parametrize("command", [["train", "--recipe", "paper-w4s4"], ["train", "--recipe", "w4s4"],
                                     ["map", "w4s4"], ["eval", "w4s4"]])
def test_plan_with_out_is_refused_on_every_command(tmp_path, command):
    out = tmp_path / "out.csv"
    res = runner.invoke(app, [*command, "--plan", "--out", str(out)])
    assert res.exit_code == 3, res.output
    assert res.output.startswith("error: --plan") and "--out" in res.output and len(res.output.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_every_plan_command_is_covered_by_the_refusal():
    """Every command with a --plan option also has --out, and goes through the one check (base._Command)."""
    import typer.main

    from phaselens.presentation.cli.common import _Command

    group = typer.main.get_command(app)
    with_plan = {name: c for name, c in group.commands.items() if any(p.name == "plan" for p in c.params)}
    assert set(with_plan) >= {"train", "map", "eval"}
    assert all(isinstance(c, _Command) and any(p.name == "out" for p in c.params) for c in with_plan.values())


# ---- train: every argument before the first step ---------------------------------------------------------
@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Run in an empty folder; building a model or training fails the test."""
    import phaselens.train.family.run as family_run
    import phaselens.train.family.trainer as trainer

    def never(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(family_run, "train_family", never)
    monkeypatch.setattr(trainer, "train_family", never)
    monkeypatch.setattr(family_run, "run_recipe", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    np.save(tmp_path / "short.npy", np.arange(100, dtype=np.int32))
    runner.invoke(app, ["train", "--recipe", "paper-w4s4", "--plan"])  # imports once, outside the timings
    return tmp_path


def _fails_fast(folder: Path, args: list[str]) -> str:
    before = sorted(p.name for p in folder.iterdir())
    t0 = time.perf_counter()
    res = runner.invoke(app, ["train", "--recipe", "paper-w4s4", "--no-progress", *args])
    took = time.perf_counter() - t0
    assert res.exit_code == 3, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], res.output
    assert took < 5, f"{took:.1f}s"  # about a second on an idle machine; minutes of training before
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
    return lines[0]


# arguments both the run and its plan refuse, with one message (one check: train.family.command.check_args)
BAD_TRAIN = {
    "empty size": ["--size", ""],
    "unknown size": ["--size", "huge"],
    "unknown recipe": ["--recipe", "paper-w5s5"],
    "eval items beyond memory": ["--eval-per-residue", str(10**9)],
    "tokens nan": ["--tokens", "nan"],
    "tokens inf": ["--tokens", "inf"],
    "tokens and steps": ["--tokens", "1e6", "--steps", "5"],
    "seed beyond 64 bits": ["--seed", str(2**70)],
    "kv heads not a divisor": ["--kv-heads", "3"],
    "vocab below the task's": ["--vocab", "10"],
    "precision": ["--precision", "fp16"],
    "micro-batch not a divisor": ["--micro-batch", "5"],
    "pretrain file missing": ["--pretrain", "nofile.npy", "--pretrain-ratio", "0.5"],
    "pretrain file too short": ["--pretrain", "short.npy", "--pretrain-ratio", "0.5"],
    "pretrain file not ids": ["--pretrain", "afile", "--pretrain-ratio", "0.5", "--pretrain-dtype", "int64"],
    "ratio without files": ["--pretrain-ratio", "0.5"],
    "files without ratio": ["--pretrain", "short.npy"],
    "raw dtype unknown": ["--pretrain", "afile", "--pretrain-ratio", "0.5", "--pretrain-dtype", "float8"],
    "batch over micro": ["--batch-size", "30", "--micro-batch", "4"],
}


@pytest.mark.parametrize("args", BAD_TRAIN.values(), ids=BAD_TRAIN.keys())
def test_a_bad_train_argument_fails_at_once_and_the_plan_says_the_same(no_training, args):
    ran = _fails_fast(no_training, args)
    planned = _fails_fast(no_training, [*args, "--plan"])
    free = re.compile(r"[\d,.]+ GiB is available; use --eval-per-residue [\d,]+")  # memory free now varies
    assert free.sub("", ran) == free.sub("", planned)


# run-only: where the run writes, and what this machine holds
RUN_ONLY = {
    "runs is a file": (["--runs", "afile"], "afile is a file"),
    "runs under a file": (["--runs", "afile/sub"], "is a file"),
    "out is a file": (["--out", "afile"], "existing file"),
    "vocab beyond memory": (["--vocab", str(10**12)], "GiB per rank"),
}


@pytest.mark.parametrize(("args", "says"), RUN_ONLY.values(), ids=RUN_ONLY.keys())
def test_a_bad_run_location_or_size_fails_before_the_first_step(no_training, args, says):
    assert says in _fails_fast(no_training, args)


def test_plan_gpus_refuse_the_split_the_run_refuses(no_training, monkeypatch):
    """--plan --gpus 3 (a batch of 32 over 3 ranks) says what a run on 3 ranks says, before building anything."""
    import phaselens.parallel.world as world

    planned = _fails_fast(no_training, ["--plan", "--gpus", "3"])
    monkeypatch.setattr(world, "process_world", lambda: world.World(0, 3))
    assert _fails_fast(no_training, []) == planned
    assert "split evenly over 3 rank(s)" in planned
    assert "smaller than the 64 rank(s)" in _fails_fast(no_training, ["--plan", "--gpus", "64"])


def test_the_default_plan_leaves_out_counts_the_batch_cannot_split_over(no_training):
    res = runner.invoke(app, ["train", "--recipe", "paper-w4s4", "--plan"])
    assert res.exit_code == 0 and "over 8 GPU(s), micro-batch 4" in res.output
    assert "not planned: 64 GPUs" in res.output and "over 64 GPU" not in res.output


def test_size_empty_is_not_the_tiny_size(no_training):
    assert "--size" in _fails_fast(no_training, ["--size", "", "--steps", "1"])
    res = runner.invoke(app, ["train", "--recipe", "w4s4", "--size", ""])
    assert res.exit_code == 3 and "paper's family only" in res.output
