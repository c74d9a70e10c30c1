"""A served model against a real ``transformers serve`` (started by the session fixture, no mock): its answers
equal the in-process answers of the same weights item by item, a different tokenizer is refused, a dead
server is a typed error naming its address, hook-based analyses refuse it in one line, and the report and the
command line run on it."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import NotApplicableError, ServerError, TokenizerMismatchError
from phaselens.tasks import Needle, PaddingProbe, train_toy_tokenizer
from tests.support.deepseek import one_thread  # noqa: F401  (fixture)
from tests.support.serving import free_port

N = 3  # items per residue: 24 prompts of ~130 tokens per evaluation


@pytest.fixture(scope="module")
def served(server, checkpoint):
    model = phaselens.load(server.url, tokenizer=str(checkpoint), progress=False)
    yield model
    model.close()


@pytest.fixture(scope="module")
def local(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return phaselens.load(f"hf:{checkpoint}", dtype=torch.float32)


@pytest.fixture(scope="module")
def task(served):
    return Needle(served.tokenizer, n_records=8, n_demos=1, paired=True, modulus=8, padding="shared_prefix")


def mixed_answers(batch, predicted):
    """The same items with the answer set to the model's own greedy token on every other item, so that about
    half are right (a random tiny model answers none of them)."""
    answer = batch.answer.clone()
    answer[::2] = torch.as_tensor(np.array(predicted[::2]))
    return dataclasses.replace(batch, answer=answer)


def test_load_finds_the_model_the_dialect_and_the_geometry(served, server, checkpoint):
    md = served.analysis_metadata
    assert served.name == str(checkpoint) and md["served_endpoint"] == server.url
    assert md["served"]["protocol"] == "openai-text"  # transformers serve refuses token-id prompts
    assert "prompt must be a string" in md["served"]["checks"]["protocol"]
    assert "agree" in md["served"]["checks"]["tokenizer"]
    assert served.dims.black_box and served.dims.analysis_spec.stride == 4  # CSA ratio 4 from config.json
    assert served.dims.d_vocab == len(served.tokenizer)
    assert repr(served).startswith("ServedModel(")


def test_served_answers_equal_in_process_answers_item_by_item(served, local, task):
    ev = phaselens.evaluate(served, task, n_per_residue=N, progress=False, n_permutations=50, n_bootstrap=0)
    ref = phaselens.evaluate(local, task, n_per_residue=N, progress=False, n_permutations=50, n_bootstrap=0)
    a, b = ev.items, ref.items
    assert len(a) == 8 * N and a["residue"].tolist() == b["residue"].tolist()
    assert np.array_equal(a["predicted"].to_numpy(), b["predicted"].to_numpy())
    assert len(set(a["predicted"])) > 1  # the answers differ between items: the equality says something
    assert np.array_equal(a["correct"].to_numpy(), b["correct"].to_numpy())
    # no log-probabilities from transformers serve: NaN, accuracy-only statistics, said in the summary
    assert a["p_correct"].isna().all() and a["nll"].isna().all() and not ev.tests.continuous
    assert "accuracy alone" in ev.metadata["scored_by"] and "accuracy alone" in ev.summary()
    assert ev.metadata["served"]["prompts"].startswith("text") and ev.metadata["served_traffic"]["requests"] >= 8 * N

    # with answers the model gets half right, accuracy per residue agrees too
    batch = task.build(served.dims.analysis_spec, n_per_residue=N)
    mixed = mixed_answers(batch, ref.items["predicted"].to_numpy())
    ev2 = phaselens.evaluate(served, mixed, progress=False, n_permutations=50, n_bootstrap=0)
    ref2 = phaselens.evaluate(local, mixed, progress=False, n_permutations=50, n_bootstrap=0)
    assert 0 < ev2.mean < 1
    assert np.array_equal(ev2.items["correct"].to_numpy(), ref2.items["correct"].to_numpy())
    assert np.allclose(ev2.per_residue()["acc"], ref2.per_residue()["acc"])


def test_phaselens_plan_prices_the_served_requests(served, task):
    """The one planning call prices a served model's requests from the items alone: one prompt per item for
    ``evaluate``, one per shifted copy for ``repair_table``, at the stated prefill rate; nothing is sent."""
    sent = served.endpoint.traffic.requests
    plan = phaselens.plan(served, "evaluate", task, n_per_residue=N, prefill_tokens_per_s=1000.0)
    assert plan.model == served.name and plan.requests == 8 * N and plan.copies == 1
    assert plan.prompt_tokens >= plan.requests * plan.seq_len // 2 > 0
    assert plan.seconds == pytest.approx(plan.prefill_tokens / 1000.0)
    shifted = phaselens.plan(served, "repair_table", task, n_per_residue=N, pad_id=task.filler_ids[0])
    assert shifted.copies == 4 and shifted.requests == 8 * N * 4
    assert served.endpoint.traffic.requests == sent


def as_text_reads(vocab, ids):
    """What a text-only server's reply can name: a token whose text encodes back to it alone, else -1 (a lone
    byte of a multi-byte character decodes to U+FFFD, which names no token)."""
    return np.array([t if (text := vocab.decode([t])) and vocab.encode(text) == [t] else -1 for t in ids])


def test_the_padding_probe_runs_on_the_served_model(served, local):
    probe = PaddingProbe.fp8_example(served.tokenizer, max_units=24)
    ev = phaselens.evaluate(served, probe, n_per_residue=2, progress=False, n_permutations=50, n_bootstrap=0)
    ref = phaselens.evaluate(local, probe, n_per_residue=2, progress=False, n_permutations=50, n_bootstrap=0)
    assert ev.items["L"].tolist() == ref.items["L"].tolist()
    want = as_text_reads(served.vocab, ref.items["predicted"].to_numpy())
    assert np.array_equal(ev.items["predicted"].to_numpy(), want) and (want >= 0).any()
    assert np.array_equal(ev.items["correct"].to_numpy(), ref.items["correct"].to_numpy())


def test_repair_table_combines_the_served_copies(served, local, task):
    """Every shifted copy is a request; the unrepaired row and the share some copy gets right equal the
    in-process table, and ``vote`` agrees wherever the in-process vote has a strict majority."""
    ref0 = phaselens.evaluate(local, task, n_per_residue=2, progress=False, n_permutations=50, n_bootstrap=0)
    batch = mixed_answers(task.build(served.dims.analysis_spec, n_per_residue=2), ref0.items["predicted"].to_numpy())
    kw = dict(shift_sets=("all",), combines=("vote",), n_permutations=50, n_bootstrap=0, progress=False,
              pad_id=task.filler_ids[0])
    tab = phaselens.repair_table(served, batch, **kw)
    ref = phaselens.repair_table(local, batch, **kw)
    base, base_ref = tab.evals[("none", "none")].items, ref.evals[("none", "none")].items
    assert np.array_equal(base["predicted"].to_numpy(), base_ref["predicted"].to_numpy())
    assert np.allclose(tab.rows["any_copy_right"], ref.rows["any_copy_right"]) and 0 < tab.rows["any_copy_right"].iloc[1]
    # the copies' own answers, in process: a strict majority decides the vote the same way on both sides
    from phaselens.repair.table import block_copy_logits

    per_copy = block_copy_logits(local, batch, slice(0, len(batch)), tuple(range(4)), tab.metadata["pad_id"])
    votes = per_copy.argmax(-1).numpy()  # [K, N]
    top = np.array([np.bincount(v, minlength=per_copy.shape[-1]) for v in votes.T])
    strict = np.sort(top, 1)[:, -1] > np.sort(top, 1)[:, -2]
    got = tab.evals[("all", "vote")].items["predicted"].to_numpy()
    want = ref.evals[("all", "vote")].items["predicted"].to_numpy()
    assert strict.sum() >= len(batch) // 2 and np.array_equal(got[strict], want[strict])
    pad = task.filler_ids[0]
    with pytest.raises(NotApplicableError, match="full distribution"):
        phaselens.repair_table(served, batch, shift_sets=("all",), combines=("mean_logprob",), pad_id=pad)
    with pytest.raises(NotApplicableError, match="confidence"):  # max_conf needs logprobs transformers never sends
        phaselens.repair_table(served, batch, shift_sets=("all",), combines=("max_conf",), pad_id=pad, progress=False)


@pytest.mark.parametrize("what", ["record", "ablate", "patch", "map", "attribution", "cycling", "knockout",
                                  "knocked_out", "forward"])
def test_hook_based_analyses_refuse_in_one_line(served, what):
    calls = {
        "record": lambda: phaselens.record(served, progress=False),
        "ablate": lambda: phaselens.ablate(served, "L0H0", progress=False),
        "patch": lambda: phaselens.patch(served, heads=["L0H0"], progress=False),
        "map": lambda: phaselens.specialization_map(served, progress=False),
        "attribution": lambda: phaselens.attribution_map(served, progress=False),
        "cycling": lambda: phaselens.gate_cycling_test(served, deltas=(1,), progress=False),
        "knockout": lambda: phaselens.knockout(served, "L0H0", progress=False),
        "knocked_out": lambda: phaselens.analyses.knocked_out(served, "L0H0").__enter__(),
        "forward": lambda: served(torch.zeros(1, 4, dtype=torch.long)),
    }
    with pytest.raises(NotApplicableError) as err:
        calls[what]()
    msg = str(err.value)
    assert "served model" in msg and "\n" not in msg


def test_a_different_local_tokenizer_is_refused(server, tmp_path):
    # another vocabulary: counts differ on the probe prompts
    other = train_toy_tokenizer(vocab_size=400)
    with pytest.raises(TokenizerMismatchError, match="counted .* prompt tokens where the local tokenizer has"):
        phaselens.load(server.url, tokenizer=other, stride=4)
    # the same vocabulary without its BOS: the server adds one the local tokenizer does not
    no_bos = train_toy_tokenizer()
    no_bos.post_processor = None
    with pytest.raises(TokenizerMismatchError, match=r"adds 1 token\(s\) of its own"):
        phaselens.load(server.url, tokenizer=no_bos, stride=4)


def test_a_mismatch_on_any_reply_is_refused(server, checkpoint, task):
    """The check runs on every reply, not only at load: a tokenizer swapped after load is caught on the first
    request and no result is returned."""
    from phaselens.models.served.vocabulary import Vocabulary

    m = phaselens.load(server.url, tokenizer=str(checkpoint), progress=False)
    no_bos = train_toy_tokenizer()
    no_bos.post_processor = None
    m.vocab = Vocabulary(no_bos)
    items = Needle(no_bos, n_records=8, n_demos=1, modulus=8, prefix_ids=())
    with pytest.raises(TokenizerMismatchError, match="counted"):
        phaselens.evaluate(m, items, n_per_residue=1, progress=False)


def test_a_dead_server_is_a_typed_error_naming_its_address(checkpoint):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(ServerError, match=url.replace(".", r"\.")) as err:
        phaselens.load(url, tokenizer=str(checkpoint), retries=1, backoff=0.01)
    assert "2 attempt(s)" in str(err.value) and "connection refused" in str(err.value)


def test_no_tokenizer_and_no_tokenize_endpoint_names_the_option(server):
    with pytest.raises(ServerError, match="tokenizer=PATH"):
        phaselens.load(server.url, stride=4, retries=0)


def test_the_report_accepts_a_served_model(served, task, tmp_path):
    import json

    from phaselens.presentation.reporting import ReportSettings

    served.default_task = task
    try:
        s = ReportSettings(n_eval=2, n_record=1, n_map=1, n_cycle=1, deltas=(1,), n_repair=1)
        path = phaselens.report([served], out=tmp_path / "report", settings=s, progress=False, static=False)
    finally:
        served.default_task = None
    page = (path / "index.html").read_text()
    assert "Not run on tiny-v4: Knockout maps" in page and "served model" in page
    tables = json.loads((path / "results.json").read_text())["tables"]
    assert "tiny-v4_per_residue" in tables and "tiny-v4_repair" in tables and "tiny-v4_map" not in tables


@pytest.mark.slow  # starts a second server to kill (about 15 s idle, 50 s on a loaded 2-core machine)
def test_a_server_killed_mid_run_resumes_to_the_same_result(served, checkpoint, task, tmp_path):
    """Kill a server for real (SIGKILL to its process group) once the journal holds finished blocks: the run
    stops with a ServerError naming the address; another server of the same weights (the session's, on another
    port) resumes it from the journal to the result of an uninterrupted run."""
    import socket
    import threading
    import time

    from tests.support.serving import Server

    opts = dict(n_per_residue=8, batch_size=4, progress=False, n_permutations=50, n_bootstrap=0)
    whole = phaselens.evaluate(served, task, **opts)  # uninterrupted
    journal = tmp_path / "run.journal"
    first = Server(checkpoint).start()
    errors: list[BaseException] = []
    try:
        m = phaselens.load(first.url, tokenizer=str(checkpoint), retries=1, backoff=0.05, progress=False)

        def run() -> None:
            try:
                phaselens.evaluate(m, task, journal=journal, **opts)
            except BaseException as err:  # noqa: BLE001  (the test inspects it)
                errors.append(err)

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 120
        while not journal.exists() and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        first.stop()
        assert not first.alive()
        with pytest.raises(OSError):  # nothing listens on its port any more
            socket.create_connection(("127.0.0.1", first.port), timeout=2).close()
        worker.join(timeout=120)
    finally:
        first.stop()
    assert len(errors) == 1 and isinstance(errors[0], ServerError), errors
    assert first.url in str(errors[0])

    again = phaselens.evaluate(served, task, journal=journal, **opts)
    (shard,) = again.metadata["shards"]
    assert 0 < len(shard["resumed"]) < shard["units"] == 16  # some blocks were done before the kill, not all
    cols = ["item_id", "residue", "correct", "predicted"]
    assert again.items[cols].equals(whole.items[cols])
    assert again.per_residue()["acc"].equals(whole.per_residue()["acc"])


def test_the_command_line_end_to_end(server, checkpoint, tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from phaselens.presentation.cli import app

    runner = CliRunner()
    out = tmp_path / "eval.csv"
    preset = ["--tokenizer", str(checkpoint), "--task", "niah-128k", "--records", "8", "--length", "200"]
    res = runner.invoke(app, ["eval", server.url, *preset, "--n-per-residue", "2", "--concurrency", "2",
                              "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    frame = pd.read_csv(out)
    assert len(frame) == 16 and "predicted" in frame and frame["predicted"].ge(0).any()
    assert "PhaseEval" in res.output and "scored by greedy answers only" in res.output
    # pricing needs the tokenizer only, not the server
    plan = runner.invoke(app, ["eval", f"http://127.0.0.1:{free_port()}/v1", *preset, "--plan",
                               "--prefill-rate", "1000"])
    assert plan.exit_code == 0, plan.output
    assert "2,048 requests of up to" in plan.output and "from a prefix cache" in plan.output
    # a dead server: exit 3, one line that names the address
    url = f"http://127.0.0.1:{free_port()}/v1"
    dead = runner.invoke(app, ["eval", url, *preset, "--retries", "0", "--no-progress"])
    assert dead.exit_code == 3 and f"error: the server at {url}" in dead.output
    assert len(dead.output.strip().splitlines()) == 1
