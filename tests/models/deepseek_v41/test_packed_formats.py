"""Every packed tensor and scale of a V4.1 checkpoint is checked against its format at load (issue: reliability
round 4): a wrong dtype or shape is a CheckpointError naming the tensor, what it holds, what is needed and the
fix, never a silently wrong model (an int32 or float8_e4m3fn scale moved the tiny model's logits by 1.4 to 2.6).

The class test corrupts, for every kind of packed or scale tensor the tiny release-format checkpoint holds (FP8
weights and their UE8M0 scales, FP4 experts and theirs, Engram tables and theirs, ...), its dtype and its shape:
a new kind in :func:`tests.support.deepseek_v41.encode` is covered without a new test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from phaselens.errors import CheckpointError
from phaselens.models.deepseek_v41 import load_v41
from tests.support.deepseek_v41 import ENGRAM_TEXT, TINY_TEXT, encode, tiny_tensors, write_tiny_checkpoint

PACKED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def kinds(stored: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{kind: first tensor name}`` of every packed or scale tensor (a kind: the name without its numbers)."""
    out: dict[str, str] = {}
    for name, t in sorted(stored.items()):
        if not name.startswith("mtp.") and (name.endswith(".scale") or t.dtype in PACKED_DTYPES):
            out.setdefault(re.sub(r"\.\d+\.", ".*.", name), name)
    return out


# what write_tiny_checkpoint(engram=True) stores, by kind (test_the_kinds_are_the_checkpoints checks it)
KINDS = kinds(encode(tiny_tensors({**TINY_TEXT, **ENGRAM_TEXT})))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _float8(t: torch.Tensor) -> torch.Tensor:
    other = torch.float8_e5m2 if t.dtype == torch.float8_e4m3fn else torch.float8_e4m3fn
    return t.float().to(other)


CORRUPT = {  # a wrong dtype (values converted as a careless conversion would), then a wrong shape
    "int32": lambda t: _bytes(t).to(torch.int32),
    "float8": _float8,
    "bfloat16": lambda t: t.float().to(torch.bfloat16),
    "extra-row": lambda t: torch.cat([_bytes(t), _bytes(t)[:1]], 0).view(t.dtype),
    "extra-column": lambda t: torch.cat([_bytes(t), _bytes(t)[:, :1]], 1).view(t.dtype),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41fmt") / "tiny", seed=2, engram=True)


def edited(src: Path, dst: Path, edit: dict[str, object]) -> Path:
    """A copy of the checkpoint at ``src`` (unchanged files hard-linked) whose tensors ``edit`` names are replaced
    (a tensor) or converted (a function of the stored tensor)."""
    dst.mkdir()
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    touched = {weight_map[name] for name in edit}
    for f in src.iterdir():
        if f.name not in touched:
            os.link(f, dst / f.name)
    for shard in touched:
        tensors = load_file(str(src / shard))
        for name, how in edit.items():
            if weight_map[name] == shard:
                tensors[name] = how(tensors[name]) if callable(how) else how
        save_file(tensors, str(dst / shard))
    return dst


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(0))


def test_the_kinds_are_the_checkpoints(ckpt):
    """The parametrized kinds are those of the written checkpoint, read from its shards' headers."""
    dtypes = {}
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    packed = {n for n, d in dtypes.items() if d in ("F8_E4M3", "F8_E8M0", "I8", "U8") or n.endswith(".scale")}
    assert {re.sub(r"\.\d+\.", ".*.", n) for n in packed if not n.startswith("mtp.")} == set(KINDS)
    assert len(KINDS) >= 20 and any("experts" in k for k in KINDS) and any("engram.embed" in k for k in KINDS)


@pytest.mark.parametrize("how", list(CORRUPT))
@pytest.mark.parametrize("name", list(KINDS.values()), ids=list(KINDS))
def test_a_packed_tensor_of_the_wrong_dtype_or_shape_is_refused_by_name(ckpt, tmp_path, name, how):
    bad = edited(ckpt, tmp_path / "bad", {name: CORRUPT[how]})
    shard = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    t = load_file(str(bad / shard))[name]
    holds = f"holds {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    for weights in ("packed", "dequantized") if how == "int32" else ("packed",):  # one check serves both
        with pytest.raises(CheckpointError) as err:
            load_v41(bad, dtype=torch.float32, weights=weights)
        message = str(err.value)
        assert f"{name} (in " in message and holds in message, message
        assert "must be" in message and "Fix:" in message, message


@pytest.mark.parametrize("fp4", [torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8)],
                         ids=["uint8", "float4_e2m1fn_x2"])
def test_the_formats_other_spellings_load_to_the_same_logits(ckpt, tmp_path, fp4):
    """float32 scales (all of a module's), and FP4 pairs as uint8 or float4_e2m1fn_x2 (whose safetensors header
    counts 4-bit values: twice the bytes)."""
    stored = {}
    for shard in ckpt.glob("*.safetensors"):
        stored.update(load_file(str(shard)))
    edit = {n: t.float() for n, t in stored.items()
            if n.endswith(".scale") and t.dtype == torch.float8_e8m0fnu and ".engram.embed." not in n}
    edit |= {n: t.view(fp4) for n, t in stored.items() if t.dtype == torch.int8}
    other = edited(ckpt, tmp_path / "other", edit)
    ref = load_v41(ckpt, dtype=torch.float32, index_topk="all")(tokens())
    for weights in ("packed", "dequantized"):
        assert torch.equal(load_v41(other, dtype=torch.float32, index_topk="all", weights=weights)(tokens()), ref)


def test_routed_experts_with_scales_of_two_dtypes_are_refused(ckpt, tmp_path):
    """Each dtype is a valid scale, but a layer's experts are stacked in one (a float32 scale copied into UE8M0
    bytes was silently wrong)."""
    name = "layers.3.ffn.experts.2.w1.scale"
    bad = edited(ckpt, tmp_path / "mixed", {name: lambda t: t.float()})
    with pytest.raises(CheckpointError, match=r"experts\.2\.w1\.scale holds float32.*stacked in one format"):
        load_v41(bad)


def test_a_scale_shape_that_disagrees_with_the_config_names_the_blocks(ckpt, tmp_path):
    bad = tmp_path / "blocks"
    shutil.copytree(ckpt, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = [16, 16]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"scale \(in .*fit 32x32 blocks.*weight_block_size is \[16, 16\]: set "
                                              r"it to \[32, 32\]"):
        load_v41(bad)


def test_a_missing_shard_says_what_to_download(ckpt, tmp_path):
    bad = tmp_path / "lost"
    shutil.copytree(ckpt, bad)
    (bad / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lacks shards \['model-00002-of-00003.safetensors'\].*Download the "
                                              r"missing shards into .*huggingface-cli download"):
        load_v41(bad)


@pytest.mark.parametrize(("text", "fix"), [
    ("{bad json", "not valid JSON"),
    ("[1, 2]", "JSON array"),
    ('{"weight_map": [1]}', "no 'weight_map' object"),
    ('{"weight_map": {"embed.weight": 3}}', "not shard file names"),
    ('{"weight_map": {"embed.weight": "../model-00001-of-00003.safetensors"}}', "not shard file names"),
])
def test_a_damaged_index_is_a_checkpoint_error_naming_the_file_and_the_fix(ckpt, tmp_path, text, fix):
    bad = tmp_path / "index"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json.*{re.escape(fix)}.*restore "
                                              r"model\.safetensors\.index\.json from the checkpoint's source"):
        load_v41(bad)


def test_a_weight_without_its_scale_names_the_missing_scale(ckpt, tmp_path):
    bad = tmp_path / "noscale"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "layers.2.attn.wq_b.scale"
    shard = bad / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"wq_b\.weight \(in .*without its scale.*lacks it: download it again"):
        load_v41(bad)
