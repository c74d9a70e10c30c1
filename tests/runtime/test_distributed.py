"""Analyses across processes: gloo on loopback, ranks started by the test (as torchrun would start them).

Each rank runs ``tests/support/dist_worker.py``'s scenario on the zoo model w4s4 and writes what it returned; the
test compares it with the same analyses run here in one process (one thread, as the ranks use).
Ranks are forked from a forkserver that imported torch and phaselens once, so a rank starts in a moment.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import phaselens
from phaselens.parallel.distributed import assignment, item_blocks, shard_map, world
from tests.support.dist_worker import SCENARIOS, analyses, digest, run_rank
from tests.support.paths import ROOT

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

PRELOAD = ["torch", "torch.distributed", "phaselens.models", "phaselens.analyses.maps", "phaselens.evaluate",
           "phaselens.record", "tests.support.dist_worker"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(scenario: str, n: int, out: Path, timeout: float = 240) -> list[int]:
    """Start ``n`` ranks of ``scenario``; wait for all (a rank still running at the deadline is killed, as
    torchrun kills the others when one fails). Returns the exit codes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = _free_port()
    procs = [ctx.Process(target=run_rank, args=(scenario, str(out), r, n, port)) for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [int(p.exitcode) for p in procs]


@contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return phaselens.load("zoo:w4s4")


def single(model, which: tuple[str, ...]) -> dict[str, np.ndarray]:
    with one_thread():
        out: dict[str, np.ndarray] = {}
        for name, res in analyses(model, which).items():
            assert res.metadata["world_size"] == 1
            out.update(digest(res, name))
        return out


def rank_output(out: Path, rank: int) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(out / f"rank{rank}.npz", allow_pickle=False) as f:
        arrays = dict(f)
    return arrays, json.loads((out / f"rank{rank}.json").read_text())


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Counts and flags bit-identical; floats too (the ranks compute each unit on identical inputs), with
    1e-6 as the documented bound should a device not be deterministic."""
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape and g.dtype == w.dtype, key
        if w.dtype.kind in "biu":
            assert np.array_equal(g, w), key
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, equal_nan=True, err_msg=key)
            assert np.array_equal(g, w, equal_nan=True), f"{key}: equal within 1e-6 but not bit-identical"


def test_assignment_is_round_robin_over_the_work_list():
    assert assignment(5, 2) == [[0, 2, 4], [1, 3]]
    assert assignment(2, 3) == [[0], [1], []]  # more ranks than units: the extra ranks idle
    assert sorted(sum(assignment(17, 4), [])) == list(range(17))
    assert [(b.start, b.stop) for b in item_blocks(40, 16)] == [(0, 16), (16, 32), (32, 40)]
    with pytest.raises(ValueError):
        assignment(3, 0)


def test_outside_a_process_group_shard_map_is_a_plain_loop():
    assert world().size == 1
    calls = []

    def compute(idx):
        calls.append(list(idx))
        return [i * i for i in idx]

    assert shard_map(compute, ["a", "b", "c", "d", "e"], per_call=2) == [0, 1, 4, 9, 16]
    assert calls == [[0, 1], [2, 3], [4]]


def test_evaluate_journal_resumes_item_blocks_and_refuses_another_run(model, tmp_path):
    from phaselens.analyses.scoring import METRICS
    from phaselens.errors import JournalError
    from phaselens.parallel.distributed import open_journal

    kw = dict(n_per_residue=2, batch_size=14, n_permutations=20, n_bootstrap=20, progress=False)
    with one_thread():
        plain = phaselens.evaluate(model, **kw)
        journal = tmp_path / "eval.journal"
        first = phaselens.evaluate(model, **kw, journal=journal)
        # keep 2 of the 4 blocks, as if the run had stopped after them
        fp = first.metadata["shards"][0]
        store = open_journal(journal, _fingerprint_of(journal), METRICS)
        store.done = {k: v for k, v in store.done.items() if k in ("items 0-13", "items 28-41")}
        store.flush()
        again = phaselens.evaluate(model, **kw, journal=journal)
        with pytest.raises(JournalError, match="different computation"):
            phaselens.evaluate(model, **{**kw, "batch_size": 16}, journal=journal)
    assert fp["by_rank"] == [["items 0-13", "items 14-27", "items 28-41", "items 42-47"]]
    (shard,) = again.metadata["shards"]
    assert shard["resumed"] == ["items 0-13", "items 28-41"] and shard["by_rank"] == [["items 14-27", "items 42-47"]]
    for col in ("correct", "logit_diff", "nll", "rank"):
        assert np.array_equal(again.items[col].to_numpy(), plain.items[col].to_numpy())
        assert np.array_equal(first.items[col].to_numpy(), plain.items[col].to_numpy())
    assert again.mean == plain.mean and again.gap_ci == plain.gap_ci


def _fingerprint_of(path: Path) -> str:
    from phaselens.storage.resumable import safetensors_metadata

    return json.loads(safetensors_metadata(path, fix="")["manifest"])["fingerprint"]


def test_two_ranks_equal_one_process(model, tmp_path):
    codes = launch("equal", 2, tmp_path)
    assert codes == [0, 0]
    want = single(model, SCENARIOS["equal"])
    for rank in range(2):
        got, info = rank_output(tmp_path, rank)
        assert "error" not in info, info
        assert_same(got, want)  # every rank returns the whole result
        ev = info["evaluate"]
        assert ev["world_size"] == 2
        (shard,) = ev["shards"]
        assert shard["by_rank"] == [["items 0-13", "items 28-41"], ["items 14-27", "items 42-47"]]
        (shard,) = info["map"]["shards"]
        labels = ["L0H0", "L0H1", "L0H2", "L0H3", "L0", "L1H0", "L1H1", "L1H2", "L1H3", "L1"]
        assert shard["by_rank"] == [labels[0::2], labels[1::2]] and shard["unit"] == "cell"


def test_three_ranks_uneven_work_more_ranks_than_cells_and_a_failing_rank(model, tmp_path):
    codes = launch("uneven", 3, tmp_path)
    assert codes == [0, 0, 0]
    want = single(model, SCENARIOS["uneven"])
    for rank in range(3):
        got, info = rank_output(tmp_path, rank)
        assert "error" not in info, info
        assert_same(got, want)
        (blocks,) = info["evaluate"]["shards"]  # 4 blocks of items over 3 ranks
        assert blocks["by_rank"] == [["items 0-13", "items 42-47"], ["items 14-27"], ["items 28-41"]]
        cells = info["map_layers"]["shards"][-1]  # 2 cells over 3 ranks: rank 2 computes none
        assert cells["by_rank"] == [["L0"], ["L1"], []]
        # rank 1's share raised: it re-raises its own error, the others name rank 1 and its message
        fail = info["fail"]
        if rank == 1:
            assert fail["type"] == "InputError" and fail["origin"] == 1
        else:
            assert fail["type"] == "RankError"
            assert fail["message"] == "rank 1 of 3 failed: InputError: planted failure in this rank's cells"


def test_a_killed_rank_ends_the_run_and_one_process_resumes_it(model, tmp_path):
    codes = launch("kill", 2, tmp_path)
    assert codes[1] == -9  # SIGKILL at its third round
    _, info = rank_output(tmp_path, 0)
    assert info["error"]["type"] == "DistributedError" and "lost contact" in info["error"]["message"]
    journal = tmp_path / "map.journal"
    # rounds 1 and 2 finished on both ranks before the kill: exactly their 4 cells, in a complete file
    from phaselens.storage.resumable import safetensors_metadata

    manifest = json.loads(safetensors_metadata(journal, fix="")["manifest"])
    assert manifest["cells"] == ["L0H0", "L0H1", "L0H2", "L0H3"]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["map.journal", "rank0.json", "rank0.npz"]  # no temporary or torn file
    with one_thread():
        resumed = analyses(model, ("map",), journal=str(journal))["map"]
    (shard,) = resumed.metadata["shards"]
    assert shard["resumed"] == ["L0H0", "L0H1", "L0H2", "L0H3"]
    assert shard["by_rank"] == [["L0", "L1H0", "L1H1", "L1H2", "L1H3", "L1"]]
    assert_same(digest(resumed, "map"), single(model, ("map",)))


@pytest.mark.slow
def test_two_ranks_equal_one_process_for_every_other_analysis(model, tmp_path):
    codes = launch("more", 2, tmp_path)
    assert codes == [0, 0]
    want = single(model, SCENARIOS["more"])
    for rank in range(2):
        got, info = rank_output(tmp_path, rank)
        assert "error" not in info, info
        assert_same(got, want)
        assert all(info[name]["world_size"] == 2 for name in SCENARIOS["more"])


def test_replica_gpus_give_each_local_rank_its_own_group(monkeypatch):
    from phaselens.errors import InputError
    from phaselens.parallel.replicas import replica_gpus

    assert replica_gpus(1, rank=3, n_gpus=8) == [3]
    assert replica_gpus(2, rank=3, n_gpus=8) == [6, 7]
    assert [replica_gpus(4, rank=r, n_gpus=8) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert replica_gpus(2, n_gpus=4) == [2, 3]
    with pytest.raises(InputError, match="at most 2 process"):
        replica_gpus(4, rank=2, n_gpus=8)
    with pytest.raises(InputError):
        replica_gpus(0, rank=0, n_gpus=8)


def test_replica_device_map_covers_the_model_in_order_and_balances_bytes(tmp_path):
    from phaselens.parallel.replicas import _units, meta_model, replica_device_map
    from tests.support.deepseek import FLASH_CONFIG, meta_v4, tiny_v4_bf16

    flash = meta_v4(FLASH_CONFIG)  # the released V4-Flash, bf16, on the meta device
    dm = replica_device_map(flash, [4, 5, 6, 7])
    units = _units(flash)
    assert list(dm) == [n for n, _ in units] and set(dm.values()) == {4, 5, 6, 7}
    assert list(dm.values()) == sorted(dm.values())  # contiguous runs in execution order
    assert dm["model.embed_tokens"] == 4 and dm["lm_head"] == 7
    assert [dm[f"model.layers.{i}"] for i in (0, 42)] == [4, 7]
    loads = {g: sum(b for n, b in units if dm[n] == g) for g in (4, 5, 6, 7)}
    total, biggest = sum(loads.values()), max(b for _, b in units)
    assert max(loads.values()) <= total / 4 + biggest  # no GPU holds more than its share plus one layer
    named = {n for n, _ in flash.named_parameters()}
    assert all(any(p == k or p.startswith(k + ".") for k in dm) for p in named)  # every weight placed once
    # transformers loads a real checkpoint with the map (all on the CPU here) and computes the same logits
    tiny_v4_bf16(tmp_path)
    cpu_map = {k: "cpu" for k in replica_device_map(meta_model(tmp_path), [0, 1])}
    whole = phaselens.load(f"hf:{tmp_path}")
    spread = phaselens.load(f"hf:{tmp_path}", device_map=cpu_map)
    tokens = torch.randint(0, whole.cfg.d_vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(spread(tokens), whole(tokens), rtol=0, atol=0)


@pytest.mark.slow
def test_torchrun_cli_writes_once_and_equals_one_process(tmp_path):
    import os
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    args = ["map", "w4s4", "--n-per-residue", "2", "--kinds", "head,layer"]
    one = subprocess.run([sys.executable, "-m", "phaselens", *args, "--out", str(tmp_path / "one.csv"),
                          "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m",
                          "phaselens", *args, "--out", str(tmp_path / "two.csv")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    assert (tmp_path / "one.csv").read_bytes() == (tmp_path / "two.csv").read_bytes()
    assert two.stdout == one.stdout  # rank 0 prints what one process prints; rank 1 prints nothing
    assert two.stderr.count("| 0/10 [") == 1 and "| 10/10 [" in two.stderr  # one bar, counting every rank's cells
    (tmp_path / "ckdir").mkdir()
    # a directory is no journal: every rank refuses it before any work (the runner checks the path first), and
    # the job says so once, as rank 0, without a rank prefix (the error is not one rank's own)
    bad = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m",
                          "phaselens", *args, "--journal", str(tmp_path / "ckdir")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "is a directory" in lines[0] and "rank" not in lines[0], bad.stderr
    assert f'File "{root / "phaselens"}' not in bad.stderr  # no rank prints a traceback (torchrun prints its own)


def test_cli_prints_each_error_once_per_job(monkeypatch, capsys):
    from phaselens.errors import InputError, RankError
    from phaselens.presentation import cli

    def printed(rank: int, err: Exception) -> str:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        cli._report(err)
        return capsys.readouterr().err

    assert printed(0, InputError("bad --kinds")) == "error: bad --kinds\n"  # every rank meets it: rank 0 says it
    assert printed(1, InputError("bad --kinds")) == ""
    own = InputError("planted")
    own.phaselens_rank = 1  # raised in rank 1's own share
    assert printed(1, own) == "error: rank 1 of 2: planted\n"
    assert printed(0, RankError("rank 1 of 2 failed: InputError: planted", rank=1)) == ""  # rank 1 says it
    monkeypatch.setenv("WORLD_SIZE", "1")
    cli._report(InputError("alone"))
    assert capsys.readouterr().err == "error: alone\n"
