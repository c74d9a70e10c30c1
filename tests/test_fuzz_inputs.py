"""Fuzz (issue 14 §3-4): every public analysis, wrapper and CLI subcommand with the classes of bad input.

Each call must raise a :class:`PhaseLensError` subclass whose message names the fix (or return a documented
result), never another exception type; afterwards no hook is left on the model, no gradient on its parameters,
and its logits are unchanged. ``CASES`` are the hand-written cases (class and a phrase of the fix each);
hypothesis draws further bad values of the shared options, task fields and CLI options: a few derandomized
examples in the fast suite, many random ones under ``slow``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import phaselens
from phaselens import errors as E
from phaselens.core.geometry import PhaseSpec
from phaselens.presentation.cli import app
from phaselens.tasks import KVRecall
from phaselens.train.loop import TrainSettings
from tests.support.models import task_model, tiny_task

FAST = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
OK = None  # a case whose documented result is a return value


@functools.cache
def world() -> SimpleNamespace:
    """The tiny model (S = 4, M = 8), the full-attention control, inputs and the reference logits."""
    m = task_model()
    task = tiny_task()
    tokens = task.build(m.analysis_spec, n_per_residue=1, seed=0).tokens[:2]
    short = tokens[:1, :24]  # enough for whole compressed entries; the logits check is one short forward
    with torch.no_grad():
        ref = m(short).clone()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    return SimpleNamespace(m=m, ctrl=task_model(None), task=task, tokens=tokens, short=short, ref=ref, state=state,
                           batch=task.build(m.analysis_spec, n_per_residue=1, seed=1))


def n_hooks(model: torch.nn.Module) -> int:
    return sum(len(x._forward_hooks) + len(x._forward_pre_hooks) + len(x._backward_hooks) for x in model.modules())


def assert_untouched(w: SimpleNamespace, *, logits: bool = True) -> None:
    """No hook left, no gradient left, the same weights and buffers, eval mode, no per-call state left set, and
    (``logits``) the same logits."""
    from phaselens.contract.protocol import _CALL
    from phaselens.models.parts.hooking import _START

    assert _CALL.get() is None and _START.get() == 0
    assert n_hooks(w.m) == 0 and not torch.nn.modules.module._global_forward_hooks
    assert all(p.grad is None for p in w.m.parameters())
    assert not w.m.training
    now = w.m.state_dict()
    assert now.keys() == w.state.keys() and all(torch.equal(now[k], v) for k, v in w.state.items())
    if logits:
        with torch.no_grad():
            assert torch.equal(w.m(w.short), w.ref)


def expect(call, error, fix: str = "") -> None:
    """Run ``call``: it raises ``error`` (a PhaseLensError subclass) naming ``fix``, or returns if ``error`` is OK.

    Afterwards the model is checked (weights, buffers, hooks, gradients, mode, call state; the logits too after a
    call that returned; for the others once, after the whole fuzz, in the last test of this module).
    """
    w = world()
    try:
        if error is OK:
            call()
        else:
            with pytest.raises(E.PhaseLensError) as info:
                call()
            assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
            assert fix.lower() in str(info.value).lower(), str(info.value)
    finally:
        assert_untouched(w, logits=error is OK)


# ---- the hand-written cases ---------------------------------------------------------------------------------
# (id, call(w), error class or OK, a phrase of the fix). Options that make a valid call cheap:
Q = dict(n_per_residue=1, progress=False)
QE = dict(Q, n_bootstrap=0, n_permutations=1)


def _with_knockout(w, **kw):
    with phaselens.analyses.knocked_out(w.m, "L1H0", method="zero", **kw):
        w.m(w.tokens)


CASES = [
    # shared options of the analyses
    ("batch_size=0", lambda w: phaselens.evaluate(w.m, **QE, batch_size=0), E.InputError, "items per forward"),
    ("batch_size=-1", lambda w: phaselens.record(w.m, **Q, batch_size=-1), E.InputError, "items per forward"),
    ("seed=-1", lambda w: phaselens.ablate(w.m, "L1H0", **Q, seed=-1), E.InputError, "non-negative"),
    ("seed=1.5", lambda w: phaselens.patch(w.m, heads="L1H0", **Q, seed=1.5), E.InputError, "must be an integer"),
    ("n_bootstrap=-1", lambda w: phaselens.specialization_map(w.m, **Q, n_bootstrap=-1), E.InputError, ">= 0"),
    ("n_permutations=0", lambda w: phaselens.repair_table(w.m, **Q, n_permutations=0), E.InputError, ">= 1"),
    ("phase=1.5", lambda w: phaselens.ablate(w.m, "L1H0", phase=1.5, **Q), E.InputError, "phase must be an integer"),
    ("phase=[]", lambda w: phaselens.patch(w.m, heads="L1H0", phase=[], **Q), E.ResidueError, "phase is empty"),
    ("phase=np.int64(0)", lambda w: phaselens.ablate(w.m, "L1H0", phase=np.int64(0), method="zero", **Q, n_bootstrap=0),
     OK, ""),
    ("n_per_residue=np.int64(1)", lambda w: phaselens.record(w.m, n_per_residue=np.int64(1), progress=False), OK, ""),
    ("n_per_residue=0", lambda w: phaselens.attribution_map(w.m, n_per_residue=0), E.TaskError, "integer >= 1"),
    ("stride=0", lambda w: phaselens.evaluate(w.m, **QE, stride=0), E.InputError, "Pass None"),
    ("progress='yes'", lambda w: phaselens.record(w.m, n_per_residue=1, progress="yes"), E.InputError, "True or False"),
    ("residues=5", lambda w: phaselens.record(w.m, **Q, residues=5), E.ResidueError, "residues=[5]"),
    ("residues=[99]", lambda w: phaselens.record(w.m, **Q, residues=[99]), E.ResidueError, "outside 0..7"),
    # tasks and models
    ("task='kv'", lambda w: phaselens.evaluate(w.m, "kv", **QE), E.TaskError, "KVRecall(...)"),
    ("task=KVRecall (class)", lambda w: phaselens.record(w.m, KVRecall, **Q), E.TaskError, "task=KVRecall(...)"),
    ("model='zoo:w4s4'", lambda w: phaselens.evaluate("zoo:w4s4", **QE), E.UnsupportedModelError,
     "phaselens.load('zoo:w4s4')"),
    ("model=None", lambda w: phaselens.patch(None, heads="L1H0", **Q), E.UnsupportedModelError, "phaselens.load"),
    ("empty batch [0, T]", lambda w: phaselens.record(w.m, w.batch[np.array([], dtype=int)], progress=False),
     E.TaskError, "n_per_residue >= 1"),
    ("KVRecall(target_records='ab')", lambda w: KVRecall(target_records="ab"), E.TaskError, "pair (lo, hi)"),
    ("KVRecall(modulus=np.int64(24))", lambda w: KVRecall(modulus=np.int64(24)).to_dict(), OK, ""),
    ("build(seed=-1)", lambda w: w.task.build(w.m.analysis_spec, n_per_residue=1, seed=-1), E.TaskError, ">= 0"),
    ("build(spec=None)", lambda w: w.task.build(None, n_per_residue=1), E.TaskError, "model.analysis_spec"),
    ("batch[999]", lambda w: w.batch[999], E.BatchIndexError, "valid: -8..7"),
    ("batch['x']", lambda w: w.batch["x"], E.BatchIndexError, "index with an int"),
    ("heads (np.int64, np.int64)", lambda w: phaselens.core.heads.parse_heads((np.int64(1), np.int64(0)), w.m.cfg), OK, ""),
    # specialization_map, attribution_map, patch
    ("kinds=()", lambda w: phaselens.specialization_map(w.m, kinds=(), **Q), E.InputError, "kinds=('head',)"),
    ("kinds=('bogus',)", lambda w: phaselens.specialization_map(w.m, kinds=("bogus",), **Q), E.InputError,
     "unknown ['bogus']"),
    ("kinds='head'", lambda w: phaselens.specialization_map(w.m, kinds="head", **Q), E.InputError, "kinds=('head',)"),
    ("journal=5", lambda w: phaselens.specialization_map(w.m, journal=5, **Q), E.JournalError, "file path"),
    ("journal under a file", lambda w: phaselens.specialization_map(w.m, journal=__file__ + "/x", **Q),
     E.JournalError, "in a folder"),
    ("calibration [0, T]", lambda w: phaselens.specialization_map(w.m, calibration=torch.zeros(0, 4, dtype=torch.long),
                                                                 **Q), E.InputError, "N, T >= 1"),
    ("calibration='abc'", lambda w: phaselens.ablate(w.m, "L1H0", calibration="abc", **Q), E.InputError,
     "a [N, T] token tensor"),
    ("calibration float ids", lambda w: phaselens.ablate(w.m, "L1H0", calibration=torch.zeros(2, 5), **Q),
     E.InputError, "tokens.long()"),
    ("method='x'", lambda w: phaselens.attribution_map(w.m, method="x", **Q), E.InputError, "one of ('mean', 'zero')"),
    ("exact='yes'", lambda w: phaselens.attribution_map(w.m, exact="yes", **Q), E.InputError, "PhaseMap"),
    ("engine='x'", lambda w: phaselens.ablate(w.m, "L1H0", engine="x", **Q), E.InputError, "'auto', 'suffix'"),
    ("eps=nan", lambda w: phaselens.patch(w.m, heads="L1H0", eps=math.nan, **Q), E.InputError, "finite number > 0"),
    ("direction='up'", lambda w: phaselens.patch(w.m, heads="L1H0", direction="up", **Q), E.InputError, "'noise'"),
    # gate cycling
    ("deltas=(0,)", lambda w: phaselens.gate_cycling_test(w.m, deltas=(0,), **Q), E.InputError, "deltas=(1, 2, 3)"),
    ("deltas=()", lambda w: phaselens.gate_cycling_test(w.m, deltas=(), **Q), E.InputError, "deltas=(1, 2, 3)"),
    ("deltas='1'", lambda w: phaselens.gate_cycling_test(w.m, deltas="1", **Q), E.InputError, "list of ints"),
    ("deltas=(1.5,)", lambda w: phaselens.gate_cycling_test(w.m, deltas=(1.5,), **Q), E.InputError, "integer"),
    ("cycling the control", lambda w: phaselens.gate_cycling_test(w.ctrl, deltas=(1,), **Q), E.NotApplicableError,
     "no compressed layers"),
    # phase repair
    ("shifts='ALL'", lambda w: phaselens.phase_ensemble(w.m, shifts="ALL"), E.InputError, "'all', 'opposite'"),
    ("shifts=(0.5,)", lambda w: phaselens.phase_ensemble(w.m, shifts=(0.5,)), E.InputError, "list of ints"),
    ("shifts=()", lambda w: phaselens.phase_ensemble(w.m, shifts=()), E.InputError, "non-empty"),
    ("insert_at out of range", lambda w: phaselens.phase_ensemble(w.m, insert_at=1000)(w.tokens), E.InputError,
     "insert_at < 61"),
    ("insert_at=-1", lambda w: phaselens.phase_ensemble(w.m, insert_at=-1), E.InputError, ">= 0"),
    ("pad_id=1.5", lambda w: phaselens.phase_ensemble(w.m, pad_id=1.5), E.InputError, "integer"),
    ("pad_id outside the vocabulary", lambda w: phaselens.phase_ensemble(w.m, pad_id=9999), E.InputError,
     "ids 0..127"),
    ("shift_sets=()", lambda w: phaselens.repair_table(w.m, shift_sets=(), **Q), E.InputError, "non-empty"),
    ("combines='vote'", lambda w: phaselens.repair_table(w.m, combines="vote", **Q), E.InputError,
     "combines=('vote',)"),
    # knockouts and the model itself
    ("knockout positions=-1", lambda w: phaselens.analyses.knocked_out(w.m, "L1H0", method="zero", positions=-1),
     E.InputError, "from 0"),
    ("knockout slot past the input", lambda w: _with_knockout(w, positions=999), E.InputError, "outside"),
    ("knockout method='max'", lambda w: phaselens.analyses.knocked_out(w.m, "L1H0", method="max"), E.InputError,
     "'resample'"),
    ("knockout analysis method='max'", lambda w: phaselens.knockout(w.m, "L1H0", method="max", **Q), E.InputError,
     "'resample'"),
    ("knockout analysis positions=-1", lambda w: phaselens.knockout(w.m, "L1H0", positions=-1, **Q), E.InputError,
     "from 0"),
    ("knockout analysis head out of range", lambda w: phaselens.knockout(w.m, "L9H0", **Q), E.HeadSpecError,
     "layers are 0..1"),
    ("head out of range", lambda w: phaselens.ablate(w.m, "L9H0", **Q), E.HeadSpecError, "layers are 0..1"),
    ("cycle_gates(1.5)", lambda w: phaselens.analyses.cycling.cycle_gates(w.m, 1.5), E.InputError, "integer"),
    ("query_len=1.5", lambda w: w.m(w.tokens, logits="query", query_len=1.5), E.InputError, "integer"),
    ("hook on a missing name", lambda w: w.m.run_with_hooks(w.tokens, fwd_hooks=[("blocks.9.attn.hook_z", print)]),
     E.HookNameError, "did you mean"),
    # the full-attention control without a stride
    ("evaluate(control)", lambda w: phaselens.evaluate(w.ctrl, **QE), E.StatsInputError, "stride="),
    ("repair_table(control)", lambda w: phaselens.repair_table(w.ctrl, **Q), E.StatsInputError, "stride="),
    # a subset of residues is a documented option (issue 12): the battery runs over the residues present
    ("evaluate(residues=[0, 1])", lambda w: phaselens.evaluate(w.m, **QE, residues=[0, 1]), OK, ""),
    # results and files
    ("plot(control='x')", lambda w: phaselens.evaluate(w.m, **QE).plot("x"), E.InputError, "PhaseEval"),
    ("report(out=a file)", lambda w: phaselens.report(["w4s4"], out=__file__), E.OutputError, "is a file"),
    ("report(['nope'])", lambda w: phaselens.report(["nope"], out=world_tmp() / "r"), E.ZooError, "available"),
    ("load('zoo:nope')", lambda w: phaselens.load("zoo:nope"), E.ZooError, "available"),
    # issue 24: ids, devices, sizes and sources
    ("a negative distractor id", lambda w: phaselens.evaluate(w.m, _ids(w, wrong=-1), **QE), E.InputError,
     "distractor (wrong) ids span -1..-1, outside the model's vocabulary"),
    ("an answer id past the vocabulary", lambda w: phaselens.patch(w.m, "L1H0", task=_ids(w, answer=10_000), **Q),
     E.InputError, "vocabulary 0..127"),
    ("a negative token id", lambda w: phaselens.record(w.m, _ids(w, tokens=-3), progress=False), E.InputError,
     "token ids"),
    ("load(device='meta')", lambda w: phaselens.load("zoo:w4s4", device="meta"), E.InputError, "use 'cpu'"),
    ("weights on the meta device", lambda w: phaselens.evaluate(task_model().to("meta"), **QE), E.InputError,
     "meta device"),
    ("load('hf:w4s4')", lambda w: phaselens.load("hf:w4s4"), E.CheckpointError, "phaselens.load('zoo:w4s4')"),
    ("load('hf:zoo:w8s4')", lambda w: phaselens.load("hf:zoo:w8s4"), E.CheckpointError,
     "phaselens.load('zoo:w8s4')"),
    ("load(a hub id without hf:)", lambda w: phaselens.load("deepseek-ai/DeepSeek-V4-Flash"), E.CheckpointError,
     "then phaselens.load('hf:dir')"),
    ("load(a name too long)", lambda w: phaselens.load("x" * 300), E.CheckpointError, "name is too long"),
    ("report('nope') is one name, not letters", lambda w: phaselens.report("nope", out=world_tmp() / "r1"),
     E.ZooError, "no zoo model 'nope'"),
    ("n_per_residue=10**9", lambda w: phaselens.evaluate(w.m, n_per_residue=10**9, progress=False), E.ResourceError,
     "or fewer"),
    ("batch_size=10**6 over 10**6 items", lambda w: phaselens.record(w.m, n_per_residue=125_000, batch_size=10**6,
                                                                     progress=False), E.ResourceError, "or fewer"),
    ("plan of 8e12 items prices without building", lambda w: _plan_of_trillions(w), OK, ""),
    ("seed=2**63", lambda w: phaselens.evaluate(w.m, **QE, seed=2**63), E.InputError, "below 2**63"),
    ("seed=2**64 (resample map)", lambda w: phaselens.specialization_map(w.m, **Q, seed=2**64, method="resample"),
     E.InputError, "below 2**63"),
    ("n_bootstrap=10**7", lambda w: phaselens.ablate(w.m, "L1H0", **Q, n_bootstrap=10**7), E.InputError, "a million"),
    ("n_permutations=10**12", lambda w: phaselens.evaluate(w.m, n_per_residue=1, progress=False,
                                                           n_permutations=10**12), E.InputError, "a million"),
    ("attribution_map inside inference_mode", lambda w: _inference_mode(lambda: phaselens.attribution_map(w.m, **Q)),
     E.NotApplicableError, "outside that block"),
    ("attribution_map of frozen weights", lambda w: _frozen_attribution(), OK, ""),
    ("TrainSettings(threads=10**9)", lambda w: TrainSettings(threads=10**9), E.ConfigError, "or fewer"),
    # issue 32 (round 4), one or more cases of each class
    # 1. a result file chooses no code: a skeleton naming a function, or a registered type with other fields
    ("a result file naming os.system", lambda w: phaselens.results.load(_crafted("phaselens.storage.writing:os.system",
                                                                                 {"command": "touch X"})),
     E.ResultFileError, "not one of phaselens' result types"),
    ("a result file with unknown fields", lambda w: phaselens.results.load(_crafted("PhaseEval", {"bogus": 1})),
     E.ResultFileError, "save the result again"),
    # 3. silent wrong: a batch of another geometry, result-method ranges, a head spec's bad part
    ("a batch built at stride 2", lambda w: phaselens.evaluate(w.m, w.task.build(PhaseSpec(2), n_per_residue=1),
                                                               progress=False), E.TaskError, "Rebuild it"),
    ("top_heads(phase=99)", lambda w: _small_map(w).top_heads(99), E.ResidueError, "0..3"),
    ("top_heads(k=-1)", lambda w: _small_map(w).top_heads(0, k=-1), E.InputError, "positive"),
    ("bh_mask(alpha=2)", lambda w: _small_map(w).bh_mask(alpha=2), E.InputError, "between 0 and 1"),
    ("head spec 'L1H0.5'", lambda w: phaselens.ablate(w.m, "L1H0.5", **Q), E.HeadSpecError,
     "the head number is '0.5'"),
    # 4. sizes priced before allocating; a hook's return checked where it replaces the value
    ("CompressedConfig(d_model=10**7)", lambda w: phaselens.models.CompressedTransformer(
        dataclasses.replace(w.m.config, d_model=10**7)), E.ResourceError, "or smaller"),
    ("new_cache(batch_size=10**9)", lambda w: w.m.new_cache(10**9), E.ResourceError, "batch_size="),
    ("a hook returning another shape", lambda w: w.m.run_with_hooks(
        w.short, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z[..., :1])]), E.InputError,
     "the hook on blocks.0.attn.hook_z returned a tensor of shape"),
    ("a hook returning a number", lambda w: w.m.run_with_hooks(
        w.short, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: 3)]), E.InputError, "returns None"),
    ("load(foo=1)", lambda w: phaselens.load("zoo:w4s4", foo=1), E.InputError, "takes no ['foo']"),
]


def _crafted(name: str, fields: dict):
    """A result file whose skeleton names ``name`` with ``fields`` (the format of the day, one array)."""
    import json

    from safetensors.numpy import save_file

    from phaselens.results import storage

    path = world_tmp() / "crafted.r"
    save_file({"a0": np.arange(3.0)}, str(path),
              metadata={"format": storage.FORMAT, "skeleton": json.dumps({"__dataclass__": name, "fields": fields})})
    return path


def _small_map(w):
    if not hasattr(w, "small_map"):  # one map for the cases on its methods
        w.small_map = phaselens.specialization_map(w.m, **Q, kinds=("layer",), method="zero", n_bootstrap=0)
    return w.small_map


def _ids(w, **values):
    """The fuzz batch with one id field replaced by a constant."""
    from dataclasses import replace

    b = w.batch
    return replace(b, **{k: getattr(b, k) * 0 + v for k, v in values.items()})


def _plan_of_trillions(w):
    plan = phaselens.plan(w.m, "specialization_map", n_per_residue=10**12, progress=False)
    assert plan.items == 8 * 10**12 and not plan.fits and "does NOT fit" in repr(plan) and plan.max_per_residue


def _inference_mode(call):
    with torch.inference_mode():
        return call()


def _frozen_attribution():
    """requires_grad=False on every weight was blamed on 'the nnsight backend'; the gradient starts at z, so
    the estimates are those of the same weights unfrozen."""
    m = task_model()
    want = phaselens.attribution_map(m, **Q).values
    for p in m.parameters():
        p.requires_grad_(False)
    assert np.array_equal(phaselens.attribution_map(m, **Q).values, want)
    assert all(p.grad is None for p in m.parameters())


@functools.cache
def world_tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="phaselens-fuzz-"))


@pytest.mark.parametrize(("call", "error", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_phaselens_error_naming_the_fix(call, error, fix):
    expect(lambda: call(world()), error, fix)


# ---- hypothesis: the shared options of every analysis -------------------------------------------------------
def _not_int() -> st.SearchStrategy:
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.booleans(),
                     st.lists(st.integers(0, 3), max_size=2), st.just(np.float32(2.0)), st.just(1 + 2j))


BAD = {  # option -> values that are never valid there
    "n_per_residue": st.one_of(st.integers(max_value=0), _not_int(), st.none()),
    "seed": st.one_of(st.integers(max_value=-1), _not_int(), st.none()),
    "batch_size": st.one_of(st.integers(max_value=0), _not_int(), st.none()),
    "n_bootstrap": st.one_of(st.integers(max_value=-1), _not_int(), st.none()),
    "n_permutations": st.one_of(st.integers(max_value=0), _not_int(), st.none()),
    "stride": st.one_of(st.integers(max_value=0), _not_int()),
    "progress": st.one_of(st.integers(), st.text(max_size=2), st.none(), st.floats()),
    "residues": st.one_of(st.lists(st.integers(), min_size=1, max_size=3).filter(
                              lambda r: any(not 0 <= x < 8 for x in r) or len(set(r)) < len(r)),
                          st.just([]), st.integers(), st.text(min_size=1, max_size=3),
                          st.lists(st.floats(allow_nan=True), min_size=1, max_size=2)),
    "phase": st.one_of(st.integers().filter(lambda p: not 0 <= p < 4), st.just([]), st.floats(allow_nan=True),
                       st.text(max_size=2), st.lists(st.integers(4, 99), min_size=1, max_size=2)),
    "task": st.one_of(st.text(max_size=4), st.integers(), st.just(KVRecall), st.lists(st.integers(), max_size=2)),
}
COMMON = ("n_per_residue", "seed", "batch_size", "stride", "progress", "residues", "task")
ANALYSES = {  # name -> (call with extra kwargs, the options it takes)
    "evaluate": (lambda w, **kw: phaselens.evaluate(w.m, **kw), (*COMMON, "n_bootstrap", "n_permutations")),
    "ablate": (lambda w, **kw: phaselens.ablate(w.m, "L1H0", **kw), (*COMMON, "n_bootstrap", "phase")),
    "patch": (lambda w, **kw: phaselens.patch(w.m, heads="L1H0", **kw), (*COMMON, "n_bootstrap", "phase")),
    "specialization_map": (lambda w, **kw: phaselens.specialization_map(w.m, **kw), (*COMMON, "n_bootstrap")),
    "attribution_map": (lambda w, **kw: phaselens.attribution_map(w.m, **kw), COMMON),
    "record": (lambda w, **kw: phaselens.record(w.m, **kw), COMMON),
    "gate_cycling_test": (lambda w, **kw: phaselens.gate_cycling_test(w.m, deltas=(1,), **kw), COMMON),
    "repair_table": (lambda w, **kw: phaselens.repair_table(w.m, **kw), (*COMMON, "n_bootstrap", "n_permutations")),
}
PAIRS = [(a, o) for a, (_, opts) in ANALYSES.items() for o in opts]


def _analysis_with_a_bad_option(data) -> None:
    name, option = data.draw(st.sampled_from(PAIRS), label="analysis, option")
    value = data.draw(BAD[option], label=option)
    call, _ = ANALYSES[name]
    kw = dict(n_per_residue=1, progress=False)
    kw[option] = value
    w = world()
    try:
        call(w, **kw)
    except E.PhaseLensError as err:
        assert str(err)
    else:
        raise AssertionError(f"{name}({option}={value!r}) returned instead of raising")
    finally:
        assert_untouched(w, logits=False)  # weights, buffers, hooks, grads each time; logits once at the end


@FAST
@given(st.data())
def test_every_analysis_refuses_bad_shared_options(data):
    _analysis_with_a_bad_option(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_every_analysis_refuses_bad_shared_options_at_length(data):
    _analysis_with_a_bad_option(data)
    assert_untouched(world(), logits=data.draw(st.integers(0, 9), label="check logits") == 0)


# ---- hypothesis: task fields and batch indexing ------------------------------------------------------------
KV_FIELDS = {  # field -> values never valid there (n_records is 6 below, so n_demos <= 4)
    "n_records": st.one_of(st.integers(max_value=1), _not_int(), st.none()),
    "n_demos": st.one_of(st.integers(max_value=-1), st.integers(5, 99), _not_int()),
    "block_filler": st.one_of(st.integers(max_value=-1), _not_int(), st.none()),
    "modulus": st.one_of(st.integers(max_value=0), _not_int(), st.none()),
    "target_records": st.one_of(st.text(max_size=3), st.integers(), st.lists(st.integers(), min_size=3, max_size=4),
                                st.tuples(st.floats(), st.integers()),
                                st.tuples(st.integers(), st.integers()).filter(lambda t: not 0 <= t[0] <= t[1] < 6)),
    "padding": st.text(max_size=4),
    "paired": st.one_of(st.integers(), st.text(max_size=2), st.none()),
}


def _task_with_a_bad_field(data) -> None:
    field = data.draw(st.sampled_from(sorted(KV_FIELDS)), label="field")
    value = data.draw(KV_FIELDS[field], label=field)
    kw = dict(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
    kw[field] = value
    with pytest.raises(E.TaskError):
        KVRecall(**kw)


def _bad_index(data) -> None:
    w = world()
    idx = data.draw(st.one_of(st.integers().filter(lambda i: not -8 <= i < 8), st.text(max_size=2), st.floats(),
                              st.lists(st.integers(-99, 99), min_size=1).filter(lambda r: max(map(abs, r)) > 8),
                              st.lists(st.floats(), min_size=1, max_size=3), st.just([[0, 1]]),
                              st.lists(st.booleans(), min_size=1).filter(lambda m: len(m) != 8)), label="index")
    with pytest.raises(E.BatchIndexError):
        w.batch[idx]
    with pytest.raises(IndexError):  # still an IndexError for code that catches those
        w.batch[idx]


@FAST
@given(st.data())
def test_tasks_and_batches_refuse_bad_fields_and_indices(data):
    _task_with_a_bad_field(data)
    _bad_index(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_tasks_and_batches_refuse_bad_fields_and_indices_at_length(data):
    _task_with_a_bad_field(data)
    _bad_index(data)


# ---- the command line: exit 2 (usage) or 3 (one line naming the fix), never a traceback -----------------------
runner = CliRunner()


def _cli(args: list[str]) -> None:
    res = runner.invoke(app, args)
    assert not (res.exception and not isinstance(res.exception, SystemExit)), (args, repr(res.exception))
    assert res.exit_code in (2, 3), (args, res.exit_code, res.output[-300:])
    if res.exit_code == 3:
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.output)
    assert "Traceback" not in res.output


CLI_CASES = [
    ["eval", "w4s4", "--n-per-residue", "0"], ["eval", "w4s4", "--seed", "-1"], ["eval", "w4s4", "--stride", "0"],
    ["eval", "full"], ["eval", "nope"], ["eval", "/no/such/dir"], ["eval", "hf:/no/such"], ["eval", ""],
    ["eval", "w4s4", "--out", "/no/such/x.csv"], ["eval", "w4s4", "--out", "/"], ["eval", "w4s4", "--out", __file__ + "/x"],
    ["record", "w4s4", "--n-per-residue", "-3"], ["record", "w4s4", "--seed", "-1"], ["record", "w4s4", "--out", "/"],
    ["map", "w4s4", "--kinds", "bogus"], ["map", "w4s4", "--kinds", ","], ["map", "w4s4", "--method", "max"],
    ["map", "w4s4", "--n-per-residue", "0"], ["map", "full"], ["map", "w4s4", "--journal", "/"],
    ["map", "w4s4", "--journal", __file__ + "/x"], ["map", "w4s4", "--stride", "-4"],
    ["train", "--recipe", "nope"], ["train", "--recipe", "w4s4", "--threads", "0"], ["train", "--recipe", "w4s4",
                                                                                    "--steps", "0"],
    ["train", "--recipe", "w4s4", "--runs", __file__], ["train", "--recipe", "w4s4", "--out", __file__],
    ["report", "nope", "--out", "/no/such/dir/r"], ["report", "--out", __file__], ["report", "nope", "--quick"],
    ["zoo", "list", "--bogus"], ["bogus"],
    # issue 24: names too long, numbers too large, counts the machine cannot run
    ["eval", "w4s4", "--out", "x" * 300 + ".csv"], ["map", "w4s4", "--journal", "y" * 300],
    ["eval", "x" * 300], ["eval", "hf:w4s4"], ["eval", "w4s4", "--n-per-residue", "99999999999999999999999"],
    ["record", "w4s4", "--seed", "99999999999999999999"], ["train", "--recipe", "w4s4", "--threads", "1000000000"],
    ["train", "--recipe", "w4s4", "--runs", "z" * 300], ["report", "w4s4", "--out", "r" * 300],
]


@pytest.mark.parametrize("args", CLI_CASES, ids=[" ".join(a) for a in CLI_CASES])
def test_every_subcommand_answers_bad_input_with_exit_2_or_3(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written in the repository, even by a case that goes wrong
    _cli(args)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", ["report", "train"])
def test_a_directory_with_user_files_is_refused_before_any_work_and_force_exists(cmd, tmp_path):
    out = tmp_path / "out"
    target = out if cmd == "report" else out / "w4s4"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    args = (["report", "w4s4", "--out", str(out), "--quick"] if cmd == "report"
            else ["train", "--recipe", "w4s4", "--out", str(out), "--runs", str(tmp_path / "runs")])
    res = runner.invoke(app, [*args, "--no-progress"])
    assert res.exit_code == 3 and "--force" in res.output and "notes.txt" in res.output
    assert not (tmp_path / "runs").exists()  # refused before training started
    assert "--force" in runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"}).output


def _raise(err):
    def call(*args, **kwargs):
        raise err
    return call


ANY_ERROR = [  # (what a command meets, a phrase of its one line): the CLI never shows a traceback without --debug
    (MemoryError(), "ran out of memory"),
    (PermissionError(13, "Permission denied", "runs/zoo"), "permission denied for runs/zoo"),
    (OSError(28, "No space left on device", "w4s4.csv"), "the disk is full"),
    (OSError(36, "File name too long", "x" * 300), "the file name is too long"),
    (OverflowError("Python int too large to convert to C long"), "a number is too large"),
    (RuntimeError("something deep inside torch"), "internal error (RuntimeError"),
]


@pytest.mark.parametrize(("err", "said"), ANY_ERROR, ids=[type(e).__name__ + str(getattr(e, "errno", "") or "")
                                                          for e, _ in ANY_ERROR])
def test_any_error_of_a_command_is_one_line_and_exit_3(monkeypatch, err, said):
    monkeypatch.setattr("phaselens.analyses.evaluation.evaluate", _raise(err))
    res = runner.invoke(app, ["eval", "w4s4", "--n-per-residue", "1", "--no-progress"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 3 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert said in lines[0] and "Traceback" not in res.output
    res = runner.invoke(app, ["--debug", "eval", "w4s4", "--n-per-residue", "1", "--no-progress"])
    assert res.exception is err  # --debug lets it through, with its traceback


def test_an_unwritable_runs_folder_is_refused_before_training(tmp_path, monkeypatch):
    import phaselens.storage.writing as files

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(files, "writable", lambda folder: folder.name != "runs")  # root writes anywhere: simulated
    res = runner.invoke(app, ["train", "--recipe", "w4s4", "--out", str(tmp_path / "zoo"), "--runs",
                              str(tmp_path / "runs"), "--no-progress"])
    assert res.exit_code == 3 and "--runs" in res.output and "permission denied" in res.output
    assert list((tmp_path / "runs").iterdir()) == [] and "Traceback" not in res.output


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "abc"}, {"WORLD_SIZE": "0"}, {"WORLD_SIZE": "2", "RANK": "5"},
                                 {"LOCAL_RANK": "-1"}])
def test_a_broken_torchrun_environment_is_one_line(env):
    res = runner.invoke(app, ["zoo", "list"], env=env)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 3 and len(lines) == 1 and lines[0].startswith("error: ") and "torchrun" in lines[0]


@pytest.mark.parametrize("cmd", [["eval", "w4s4", "--n-per-residue", "1"], ["record", "w4s4", "--n-per-residue", "1"]])
@pytest.mark.parametrize("link", [False, True])
def test_out_onto_a_special_file_is_refused_and_left_as_it_was(cmd, link, tmp_path):
    """Issue 32, class 2: --out onto a FIFO (a device node's stand-in), or a symlink to one, never replaces it,
    with or without --force."""
    import os
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = fifo
    if link:
        out = tmp_path / "link.csv"
        out.symlink_to(fifo)
    for force in ([], ["--force"]):
        _cli([*cmd, "--out", str(out), *force])
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (not link or out.is_symlink())


def test_out_replaces_only_a_file_phaselens_wrote_unless_forced(tmp_path):
    mine, ours = tmp_path / "mine.csv", tmp_path / "ours.csv"
    mine.write_text("my,table\n")
    args = ["eval", "w4s4", "--n-per-residue", "1", "--no-progress", "--out"]
    res = runner.invoke(app, [*args, str(mine)])
    assert res.exit_code == 3 and "--force" in res.output and mine.read_text() == "my,table\n"  # refused first
    assert runner.invoke(app, [*args, str(ours)]).exit_code == 0
    first = ours.read_bytes()
    assert runner.invoke(app, [*args, str(ours), "--seed", "3"]).exit_code == 0  # its own: replaced, no --force
    assert ours.read_bytes() != first
    ours.write_text("edited")  # edited by hand: the user's now
    assert runner.invoke(app, [*args, str(ours)]).exit_code == 3 and ours.read_text() == "edited"
    assert runner.invoke(app, [*args, str(mine), "--force"]).exit_code == 0  # --force names that one file
    assert mine.read_text().startswith("item_id") or "residue" in mine.read_text()


CLI_OPTIONS = {  # subcommand -> option -> never-valid values
    "eval": {"--n-per-residue": st.integers(max_value=0), "--seed": st.integers(max_value=-1),
             "--stride": st.integers(max_value=0)},
    "record": {"--n-per-residue": st.integers(max_value=0), "--seed": st.integers(max_value=-1)},
    "map": {"--n-per-residue": st.integers(max_value=0), "--seed": st.integers(max_value=-1),
            "--stride": st.integers(max_value=0),
            "--method": st.text(min_size=1, max_size=5).filter(lambda m: m not in ("mean", "zero", "resample")),
            "--kinds": st.text(min_size=1, max_size=8).filter(lambda k: not _valid_kinds(k))},
}


def _valid_kinds(text: str) -> bool:
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    return bool(kinds) and kinds <= {"head", "kv_head", "layer"}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _cli_with_a_bad_option(data) -> None:
    cmd = data.draw(st.sampled_from(sorted(CLI_OPTIONS)), label="command")
    option = data.draw(st.sampled_from(sorted(CLI_OPTIONS[cmd])), label="option")
    never_an_int = st.text(max_size=3).filter(lambda v: not _is_int(v))  # bad usage where an int is meant
    value = str(data.draw(st.one_of(CLI_OPTIONS[cmd][option], never_an_int), label="value"))
    if option in ("--method", "--kinds") and (value in ("mean", "zero", "resample") or _valid_kinds(value)):
        return
    _cli([cmd, "w4s4", f"{option}={value}", "--no-progress"])


@FAST
@given(st.data())
def test_cli_options_refuse_bad_values(data):
    _cli_with_a_bad_option(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_cli_options_refuse_bad_values_at_length(data):
    _cli_with_a_bad_option(data)


def test_every_error_class_is_documented_with_its_fix():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    api, gotchas = (docs / "api.md").read_text(), (docs / "gotchas.md").read_text()
    errors = api.split("## Errors", 1)[1].split("\n## ", 1)[0]
    for name in E.__all__:
        assert f"| `{name}` |" in errors, name
        assert name == "PhaseLensError" or f"- `{name}`: " in gotchas, name


def test_the_model_answers_as_before_after_the_fuzz():
    """Last in this module: after every case and example above ran on the same model, its logits are unchanged."""
    assert_untouched(world())
