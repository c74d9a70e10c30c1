"""Engram's tables in host memory (issue "DeepSeek-V4.1 at its real size", item 3): device maps keep each table
on the host and send only the looked-up rows to the layer's device. The numbers must not move: the host path is
bit-identical to the in-module table (fp32, CPU), the bytes it moves are counted, and the plan fits
V4.1-Flash with Engram on one 8 x H100 node."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from typer.testing import CliRunner

from phaselens.models.deepseek_v41 import IndexTopKWarning, load_v41
from phaselens.models.deepseek_v41.checkpoint import meta_v41
from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.device_maps import host_modules, resolve
from phaselens.models.deepseek_v41.engram import EngramTable, engram_traffic
from phaselens.parallel.replicas import _units, replica_device_map
from phaselens.planning.checkpoint_plan import plan_model
from phaselens.presentation.cli import app
from tests.support.deepseek_v41 import TINY_TEXT, write_tiny_checkpoint
from tests.support.paths import DATA

pytestmark = pytest.mark.filterwarnings("ignore::phaselens.models.deepseek_v41.IndexTopKWarning")
FLASH = DATA / "configs" / "DeepSeek-V4.1-Flash"
TABLES = ("blocks.1.engram.embed", "blocks.2.engram.embed")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41p") / "tiny-v41-engram", engram=True)


def load(root, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        warnings.simplefilter("ignore", UserWarning)  # accelerate's notice about offloaded parameters
        return load_v41(root, dtype=torch.float32, **kw)


def tokens(b=2, n=21, seed=0):
    return torch.randint(0, TINY_TEXT["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


def old_table_forward(table: EngramTable, rows: torch.Tensor) -> torch.Tensor:
    """``EngramTable.forward`` as it was before host placement (rows indexed in the module), verbatim."""
    values = table.weight[rows].float().unflatten(-1, (-1, 32))
    return (values * table.scale[rows].float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def recorder(store: dict[str, torch.Tensor]):
    return lambda t, hook: store.setdefault(hook.name, t.clone())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# ---- the table -------------------------------------------------------------------------------------------
def test_host_gather_is_bit_identical_to_the_in_module_table():
    """Every finite E4M3 byte and a spread of UE8M0 scales (subnormal products included): the host path (bytes
    gathered, sent, dequantized where the rows are) gives the old in-module values bit for bit."""
    g = torch.Generator().manual_seed(0)
    table = EngramTable(300, 64)
    codes = torch.randint(0, 256, (300, 64), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3's NaN codes
    with torch.no_grad():
        table.weight.view(torch.uint8).copy_(codes)
        table.scale.view(torch.uint8).copy_(torch.randint(100, 155, (300, 2), generator=g, dtype=torch.uint8))
    rows = torch.randint(0, 300, (3, 17, 4), generator=g)
    old = old_table_forward(table, rows)
    assert torch.equal(bits(table(rows)), bits(old))  # in-module path
    table.staged = True
    host = table(rows)
    assert host.shape == (3, 17, 4, 64) and host.dtype == torch.bfloat16
    assert torch.equal(bits(host), bits(old))
    assert table.moved_bytes == rows.numel() * (64 + 2)  # FP8 values and one scale byte per 32 values, per row
    values, scales = table.gather(rows)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(values.view(torch.uint8), table.weight.view(torch.uint8)[rows])


# ---- the whole model ---------------------------------------------------------------------------------
def test_device_maps_keep_the_tables_on_the_host_with_bit_identical_logits(ckpt):
    """``device="cpu"`` (tables in the module, as before) against device maps (tables on the host, rows gathered
    and sent): logits, Engram's hooks and a rows-editing hook agree bit for bit; accelerate never hooks a table."""
    x = tokens()
    base = load(ckpt)
    assert not any(base.get_submodule(t).staged for t in TABLES)
    with torch.no_grad():
        want = base(x)
        seen: dict[str, torch.Tensor] = {}
        names = [f"blocks.{i}.engram.{h}" for i in (1, 2) for h in ("hook_value", "hook_out")]
        with base.hooks(fwd_hooks=[(n, recorder(seen)) for n in names]):
            base(x)
        edit = [("blocks.2.engram.hook_rows", lambda t, hook: t.flip(-1))]
        with base.hooks(fwd_hooks=edit):
            want_edited = base(x)
    assert not torch.equal(want_edited, want)
    for device_map in ("auto", {"": "cpu"}, "cpu",
                       {k: "cpu" for k in replica_device_map(meta_v41(ckpt), [0, 1])}):
        model = load(ckpt, device_map=device_map)
        assert host_modules(model) == list(TABLES)
        for t in TABLES:
            table = model.get_submodule(t)
            assert model.hf_device_map[t] == "cpu" and table.staged and table.weight.device.type == "cpu"
            assert not hasattr(table, "_hf_hook")  # hidden from accelerate: on a GPU node it would copy the table
        with torch.no_grad():
            assert torch.equal(model(x), want), device_map
            got: dict[str, torch.Tensor] = {}
            with model.hooks(fwd_hooks=[(n, recorder(got)) for n in names]):
                model(x)
            with model.hooks(fwd_hooks=edit):
                assert torch.equal(model(x), want_edited)
        assert all(torch.equal(got[n], seen[n]) for n in names)
    assert {n for n, _ in model.named_parameters() if "engram.embed" in n} == {f"{t}.{p}" for t in TABLES
                                                                            for p in ("weight", "scale")}


def test_a_map_that_names_a_table_places_it_there(ckpt):
    """A table named in the map goes where the map says (here the CPU, as the only device of this machine);
    an unnamed one defaults to the host."""
    meta = meta_v41(ckpt)
    placed = resolve(meta, {"": "cpu", "blocks.1.engram.embed": "cpu"})
    assert placed["blocks.1.engram.embed"] == "cpu" and placed["blocks.2.engram.embed"] == "cpu"
    assert resolve(meta, "cpu") == {"": "cpu", TABLES[0]: "cpu", TABLES[1]: "cpu"}


def test_the_rows_moved_are_counted(ckpt):
    """Per token and Engram layer one row per n-gram size and head (tiny: 2 sizes x 2 heads), each row
    ``head_dim`` FP8 bytes plus one scale per 32: what the tables send in a forward, and in a cached one."""
    model = load(ckpt, device_map="cpu")
    t = engram_traffic(model.config)
    assert (t.layers, t.rows_per_token, t.row_bytes) == (2, 4, 33) and t.bytes_per_token == 264
    x = tokens(2, 21)
    with torch.no_grad():
        model(x)
        cache = model.new_cache(2)
        model(x[:, :13], cache=cache)
        model(x[:, 13:], cache=cache)
    moved = sum(model.get_submodule(n).moved_bytes for n in TABLES)
    assert moved == 2 * t.bytes_at(2 * 21)


def test_flash_traffic_and_host_memory():
    """Released V4.1-Flash: 2 Engram layers x (3 n-gram sizes x 8 heads = 24 rows) x (256 + 8 bytes) = 12,672 B per
    token, 1.66 GB for a 131,072-token pass; 768,022,850 rows in host memory."""
    raw = json.loads((FLASH / "config.json").read_text())
    t = engram_traffic(V41Config.from_dict(raw))
    assert (t.layers, t.rows_per_token, t.row_bytes, t.bytes_per_token) == (2, 24, 264, 12_672)
    assert t.bytes_at(131_072) == 1_660_944_384 and t.index_bytes_per_token == 2 * 24 * 8


def test_gpu_sizing_leaves_the_tables_out():
    """replica_device_map's units (what ``phaselens plan`` and device maps size) count no table: Flash's layer 1
    weighs what layer 0 does plus Engram's projection (less than 1 GB), not plus a 101 GB table."""
    flash = meta_v41(FLASH)
    units = dict(_units(flash))
    extra = units["blocks.1"] - units["blocks.0"]
    assert 0 < extra < 1e9
    assert sum(units.values()) < 0.31e12  # ~0.3 TB on GPUs


def test_plan_fits_flash_with_engram_on_one_h100_node(tmp_path):
    """Acceptance: ``phaselens plan DIR --gpu-memory H100`` fits V4.1-Flash with Engram on 8 x H100 and says how."""
    d = tmp_path / "DeepSeek-V4.1-Flash"
    d.mkdir()
    shutil.copy(FLASH / "config.json", d / "config.json")
    res = CliRunner().invoke(app, ["plan", str(d), "--gpu-memory", "H100", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["gpus"] <= 8 and plan["map_node_gpus"] == 8
    assert plan["engram_placement"] == "host" and plan["engram_host_bytes"] == 202_758_032_400
    assert plan["engram_bytes_per_token"] == 12_672 and plan["engram_map_context_bytes"] == 1_660_944_384
    # the map's rows: 8 prefixes of 131,071 tokens and their query rows (12,672 B each), and per item and cell one
    # query row through the Engram layers at or above the cell's layer (64 heads x (2 + 15) layer-tables x 6,336 B)
    assert plan["time"]["map"]["host_bytes"] == 8 * (1_660_944_384 + 64 * 17 * 6_336)
    text = CliRunner().invoke(app, ["plan", str(d), "--gpu-memory", "H100"]).output
    assert "Engram: tables in host memory (188.8 GiB)" in text and "12,672 B per token" in text
    assert "per-head map at 131,072 tokens: 8 x 80 GB" in text
    dropped = plan_model(str(d), gpu_memory="H100", engram="drop")
    assert dropped.engram_placement is None and dropped.engram_bytes_per_token == 0
