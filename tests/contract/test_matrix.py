"""The model-kind matrix: every analysis on every kind of model agrees with a reference computed the plain way,
or raises NotApplicableError with a reason. No cell may raise anything else.

The references never go through phaselens's analysis code: plain forwards with hand-written hooks at each row's
query slot (``model.run_with_hooks`` on our models and the unchunked torch-hook adapter), and for a phase
ensemble the shifted copies built, run and combined by hand. The chunked adapter's reference is the unchunked
adapter; the nnsight adapter's is the torch-hook adapter.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.analyses.items import analysis_geometry
from phaselens.analyses.maps import map_cells
from phaselens.analyses.scoring import answer_metrics
from phaselens.contract.protocol import capability, choose_engine
from phaselens.models.compressed.qwen3 import to_qwen3
from phaselens.repair.shifts import combine, shifted_copies
from phaselens.tasks import KVRecall
from phaselens.train.family.recipes import family_config
from tests.support.deepseek import tiny_v4_fp64
from tests.support.deepseek_v41 import write_tiny_checkpoint
from tests.support.margins import assert_flags_agree, scored
from tests.support.models import LAYOUTS, task_model

KINDS = ["zoo", "control", "uncompressed-layer", "ensemble-zoo", "v4", "v4-nnsight", "v4-chunked", "ensemble-v4",
         "v41", "family", "family-control", "causal-lm",
         "user-object"]
ANALYSES = ["evaluate", "record", "knockout", "ablate", "patch", "map", "plan", "attribution", "cycling", "repair",
            "report", "resume"]
# cells expected to raise NotApplicableError, with the reason they must name
NOT_APPLICABLE = {
    ("record", "ensemble-zoo"): "shifted copies",
    ("record", "ensemble-v4"): "shifted copies",
    ("cycling", "control"): "nothing to roll",
    ("cycling", "v4"): "cycle_gates",
    ("cycling", "v4-nnsight"): "cycle_gates",
    ("cycling", "v4-chunked"): "cycle_gates",
    ("cycling", "ensemble-v4"): "cycle_gates",
    ("repair", "ensemble-zoo"): "already phase-repaired",
    ("repair", "ensemble-v4"): "already phase-repaired",
    ("attribution", "v4-nnsight"): "gradient",
    ("cycling", "v41"): "cycle_gates",
    ("cycling", "family-control"): "nothing to roll",
    ("cycling", "causal-lm"): "cycle_gates",
    ("cycling", "user-object"): "cycle_gates",
}
V4_TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
TOL = 1e-5


def close(got, ref, tol: float = TOL) -> bool:
    """Agreement to ``tol`` relative to the reference's scale (fp32 logits of size ~20 carry ~1e-6 rounding)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return bool(np.all(np.abs(got - ref) <= tol * np.maximum(1.0, np.abs(ref))))


class Kind:
    """A model of one kind, its task and options, and the plain-way reference forward."""

    def __init__(self, name: str, model, *, ref=None, shifts=None, inner_ref=None, stride=None, n=1, arg=None):
        self.name, self.model, self.stride, self.n = name, model, stride, n
        # what the analyses are given: the model, or the user's own object it was adapted from (then the task
        # is passed explicitly: each call adapts the object anew, and an adapter has no default task)
        self.arg = model if arg is None else arg
        self.task = None if arg is None else model.default_task
        self.ref = ref if ref is not None else model  # plain reference model (no wrapper)
        self.shifts, self.inner_ref = shifts, inner_ref  # for ensembles: copies, and the inner reference

    @property
    def opts(self) -> dict:
        out = dict(n_per_residue=self.n, progress=False, stride=self.stride)
        return out if self.task is None else {**out, "task": self.task}

    def batch(self):
        return self.model.default_task.build(analysis_geometry(self.model, self.stride),
                                             n_per_residue=self.n)

    def query_logits(self, tokens, qp, hooks=lambda slots: []):
        """Reference logits ``[B, V]`` at slots ``qp``; ``hooks(slots [rows])`` gives (name, fn) pairs that act
        at the given slot of every row of the reference call."""
        if self.shifts is None:
            with torch.no_grad():
                out = self.ref.run_with_hooks(tokens, fwd_hooks=hooks(qp))
            return out[torch.arange(len(qp)), qp].float()
        K, B = len(self.shifts), len(qp)
        copies = shifted_copies(tokens, self.shifts, self.model.pad_id)
        slots = (qp[None] + torch.as_tensor(self.shifts)[:, None]).flatten()  # copy-major rows
        with torch.no_grad():
            out = self.inner_ref.run_with_hooks(copies, fwd_hooks=hooks(slots))
        per_copy = out[torch.arange(K * B), slots].view(K, B, -1)
        return combine(per_copy, self.model.rule)[0]


def zero_heads(layer: int, heads: list[int]):
    def factory(slots):
        def fn(z, hook):
            z = z.clone()
            z[torch.arange(z.shape[0])[:, None], slots[:, None], torch.tensor(heads)[None]] = 0
            return z

        return [(f"blocks.{layer}.attn.hook_z", fn)]

    return factory


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    zoo = phaselens.load("zoo:w4s4")
    # the DeepSeek kinds in fp64: their top-k picks and MoE routing are discrete steps that a last-bit
    # difference between two paths (an engine and a forward, or two CPUs) can flip in fp32
    hf = tiny_v4_fp64(seed=3)
    v4 = phaselens.from_hf(hf)
    v4.default_task = V4_TASK
    nn = phaselens.from_hf(hf, backend="nnsight")
    nn.default_task = V4_TASK
    ch = phaselens.from_hf(hf, chunk=8)
    ch.default_task = V4_TASK
    unc = task_model(LAYOUTS["w8s4-deepseek"], compressed_layers=(1,), n_layers=2)
    ens_zoo = phaselens.phase_ensemble(zoo)
    ens_v4 = phaselens.phase_ensemble(v4)
    v41 = phaselens.load(f"hf:{write_tiny_checkpoint(tmp_path_factory.mktemp('v41') / 'tiny-v41', engram=True)}",
                          dtype=torch.float64)  # with Engram, as the released model; fp64 as the V4 kinds
    v41.default_task = V4_TASK  # vocabulary 128 = the task's
    # the paper's family at its tiny size (Qwen3 backbone: QK-norm, SwiGLU, tied embeddings, 'half' RoPE, GQA),
    # with overlapping windows (W=8, S=4), and its full-attention control (Qwen3 itself); vocabulary 160 >= 128
    family = phaselens.models.CompressedTransformer(family_config("w8s4", "tiny", seed=4))
    family.default_task = V4_TASK
    family_control = phaselens.models.CompressedTransformer(family_config("full", "tiny", seed=5))
    family_control.default_task = V4_TASK
    # any transformers causal LM at a given stride: the family's control exported to transformers' Qwen3
    causal = phaselens.load(to_qwen3(phaselens.models.CompressedTransformer(family_config("full", "tiny", seed=6))), stride=4)
    causal.default_task = V4_TASK
    # a user's own transformers object, given to every analysis as it is (with stride=): adapted on each call
    users = to_qwen3(phaselens.models.CompressedTransformer(family_config("full", "tiny", seed=7)))
    adapted = phaselens.load(users, stride=4)
    adapted.default_task = V4_TASK
    out = [
        Kind("zoo", zoo),
        Kind("control", phaselens.load("zoo:full"), stride=4),
        Kind("uncompressed-layer", unc, n=2),
        Kind("ensemble-zoo", ens_zoo, shifts=ens_zoo.shifts, inner_ref=zoo),
        Kind("v4", v4, n=2),
        Kind("v4-nnsight", nn, ref=v4, n=2),
        Kind("v4-chunked", ch, ref=v4, n=2),
        Kind("ensemble-v4", ens_v4, shifts=ens_v4.shifts, inner_ref=v4, n=2),
        Kind("v41", v41),
        Kind("family", family),
        Kind("family-control", family_control, stride=4),
        Kind("causal-lm", causal),
        Kind("user-object", adapted, stride=4, arg=users),
    ]
    return {k.name: k for k in out}


def check_evaluate(k: Kind):
    ev = phaselens.evaluate(k.arg, **k.opts, n_permutations=1, n_bootstrap=0)
    b = k.batch()
    m = scored(k.query_logits(b.tokens, b.query_pos), b.answer, b.wrong)
    assert_flags_agree(ev.items["correct"].to_numpy(), m["correct"], m["margin"], what=f"{k.name} correct")
    assert close(ev.items["logit_diff"].to_numpy(), m["logit_diff"])
    assert ev.metadata["model"] and "arguments" in ev.metadata


def check_record(k: Kind):
    rec = phaselens.record(k.arg, **k.opts)
    b = k.batch()
    L = k.model.cfg.n_layers
    for layer in range(L):
        name = f"blocks.{layer}.attn.hook_pattern_entry"
        if name not in k.ref.hook_dict:
            continue
        kept = {}

        def keep(p, hook, kept=kept):
            kept["p"] = p[torch.arange(p.shape[0]), :, b.query_pos].sum(-1)  # [B, H] entry mass at the query

        with torch.no_grad():
            k.ref.run_with_hooks(b.tokens, fwd_hooks=[(name, keep)])
        assert close(rec.values["entries"][:, layer], kept["p"].numpy())
    assert rec.per_phase()["phase"].max() == rec.stride - 1


def check_knockout(k: Kind):
    b = k.batch()
    tokens = b.tokens[:2]
    T = tokens.shape[1]
    with phaselens.analyses.knocked_out(k.model, "L1H0", method="zero"), torch.no_grad():  # "last": each row's last slot
        got = k.model(tokens, logits="query", query_len=1)[:, -1].float()
    ref = k.query_logits(tokens, torch.full((2,), T - 1), zero_heads(1, [0]))
    assert close(got, ref)
    assert (got - k.query_logits(tokens, torch.full((2,), T - 1))).abs().max() > 1e-6  # it did something
    ev = phaselens.knockout(k.arg, "L1H1", method="zero", n_bootstrap=0, n_permutations=99, **k.opts)  # the analysis
    m = scored(k.query_logits(b.tokens, b.query_pos, zero_heads(1, [1])), b.answer, b.wrong)
    assert_flags_agree(ev.items["correct"].to_numpy(), m["correct"], m["margin"], what=f"{k.name} knockout correct")
    assert close(ev.items["logit_diff"].to_numpy(), m["logit_diff"])


def check_ablate(k: Kind):
    res = phaselens.ablate(k.arg, "L1H1", method="zero", n_bootstrap=0, **k.opts)
    b = k.batch()
    m = scored(k.query_logits(b.tokens, b.query_pos, zero_heads(1, [1])), b.answer, b.wrong)
    assert_flags_agree(res.items["correct_ko"].to_numpy(), m["correct"], m["margin"], what=f"{k.name} correct_ko")
    assert close(res.items["logit_diff_ko"].to_numpy(), m["logit_diff"])
    assert set(res.per_phase().columns) >= {"phase", "n", "clean_acc", "ko_acc", "rel_change", "ci_low", "pvalue"}


def check_map(k: Kind):
    pm = phaselens.specialization_map(k.arg, method="zero", kinds=("head", "layer"), n_bootstrap=0, **k.opts)
    b = k.batch()
    for i in (1, len(pm.cells) - 1):  # one head cell and one whole-layer cell
        row = pm.cells.iloc[i]
        m = answer_metrics(k.query_logits(b.tokens, b.query_pos, zero_heads(int(row.layer), list(row.heads))),
                           b.answer, b.wrong)
        assert close(pm.logit_diff_ko[i], m["logit_diff"]), row.label
    # engine="auto" takes the query-suffix engine wherever the model offers one (the adapter's kinds, locally)
    expected = "suffix" if capability(k.model, "query_engine") else "full"
    assert pm.metadata["engine"] == expected and repr(pm)
    if k.name in ("zoo", "v4", "v4-nnsight", "v4-chunked", "causal-lm"):
        assert expected == "suffix"


def check_plan(k: Kind):
    """The plan of the same map (tests/planning/test_run_plans.py holds its counts against counted runs)."""
    plan = phaselens.plan(k.arg, "specialization_map", method="zero", kinds=("head", "layer"), **k.opts)
    b = k.batch()
    cells = map_cells(k.model.dims, ("head", "layer"))
    assert (plan.items, plan.tokens, plan.n_cells) == (len(b), b.tokens.shape[1], len(cells))
    assert plan.engine == choose_engine(k.model, "auto")
    assert plan.forwards >= (1 if plan.engine == "suffix" else len(cells) + 1)
    assert plan.full_forwards >= 1 and plan.memory["weights"] > 0 and repr(plan).startswith("Plan(specialization_map on ")


def check_patch(k: Kind):
    res = phaselens.patch(k.arg, heads=["L0H1", "L1H0"], n_bootstrap=0, **k.opts)
    b = k.batch()
    for j, h in enumerate(res.heads):
        src = {}

        def grab(slots, src=src, h=h):
            def fn(z, hook):
                src["z"] = z[torch.arange(z.shape[0]), slots, h.head].clone()

            return [(f"blocks.{h.layer}.attn.hook_z", fn)]

        def put(slots, src=src, h=h):
            def fn(z, hook):
                z = z.clone()
                z[torch.arange(z.shape[0]), slots, h.head] = src["z"]
                return z

            return [(f"blocks.{h.layer}.attn.hook_z", fn)]

        k.query_logits(b.tokens, b.query_pos, grab)  # denoise: the clean run's z ...
        m = answer_metrics(k.query_logits(b.corrupted, b.query_pos, put), b.answer, b.wrong)  # ... into the corrupt
        assert close(res.logit_diff_patched[j], m["logit_diff"]), str(h)


def check_attribution(k: Kind):
    am = phaselens.attribution_map(k.arg, method="zero", **k.opts)
    b = k.batch()
    layer = 1
    kept = {}

    def keep(slots):
        def fn(z, hook):
            kept["z"], kept["slots"] = z, slots

        return [(f"blocks.{layer}.attn.hook_z", fn)]

    with torch.enable_grad():
        if k.shifts is None:
            out = k.ref.run_with_hooks(b.tokens, fwd_hooks=keep(b.query_pos))
            lp = out[torch.arange(len(b)), b.query_pos].float()
        else:
            K, B = len(k.shifts), len(b)
            copies = shifted_copies(b.tokens, k.shifts, k.model.pad_id)
            slots = (b.query_pos[None] + torch.as_tensor(k.shifts)[:, None]).flatten()
            out = k.inner_ref.run_with_hooks(copies, fwd_hooks=keep(slots))
            lp = combine(out[torch.arange(K * B), slots].view(K, B, -1), k.model.rule)[0]
        r = torch.arange(len(b))
        ld = lp[r, b.answer] - lp[r, b.wrong]
        (g,) = torch.autograd.grad(ld.sum(), [kept["z"]])
    rows = torch.arange(len(kept["slots"]))
    z = kept["z"].detach()[rows, kept["slots"]]
    est = (-(z * g[rows, kept["slots"]]).sum(-1)).view(-1, len(b), z.shape[1]).sum(0)  # copies summed: [N, H]
    assert close(am.values[:, layer], est.numpy())


def check_cycling(k: Kind):
    res = phaselens.gate_cycling_test(k.arg, deltas=(1,), **k.opts)
    inner = k.model if k.shifts is None else k.model.model
    rolled = copy.deepcopy(inner)
    with torch.no_grad():  # the plain way: roll every per-offset bias by hand
        for name, p in rolled.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.roll(p, 1, dims=1))
    ref = rolled if k.shifts is None else phaselens.phase_ensemble(rolled, shifts=k.shifts)
    ev = phaselens.evaluate(ref, **k.opts, n_permutations=1, n_bootstrap=0)
    assert close(res.evals[1].items["logit_diff"].to_numpy(), ev.items["logit_diff"].to_numpy())


def check_repair(k: Kind):
    tab = phaselens.repair_table(k.arg, shift_sets=("all",), combines=("max_conf",), n_bootstrap=0,
                                 n_permutations=1, **k.opts)
    b = k.batch()
    S = k.model.analysis_spec.stride if k.stride is None else k.stride
    shifts = tuple(range(S))
    pad = tab.metadata["pad_id"]
    K, B = len(shifts), len(b)
    copies = shifted_copies(b.tokens, shifts, pad)
    slots = (b.query_pos[None] + torch.as_tensor(shifts)[:, None]).flatten()
    with torch.no_grad():
        out = k.ref(copies)
    lp = combine(out[torch.arange(K * B), slots].view(K, B, -1), "max_conf")[0]
    m = answer_metrics(lp, b.answer, b.wrong)
    items = tab.evals[("all", "max_conf")].items
    assert close(items["logit_diff"].to_numpy(), m["logit_diff"])


def check_report(k: Kind, tmp_path):
    from phaselens.presentation.reporting import ReportSettings

    s = ReportSettings(n_eval=k.n, n_record=1, n_map=1, n_cycle=1, deltas=(1,), n_repair=1)
    path = phaselens.report([k.model], out=tmp_path / k.name, settings=s, progress=False, static=False)
    import json

    tables = json.loads((path / "results.json").read_text())["tables"]
    (per_residue,) = [v for key, v in tables.items() if key.endswith("_per_residue")]
    ev = phaselens.evaluate(k.model, n_per_residue=k.n, progress=False, n_permutations=1, n_bootstrap=0,
                            stride=k.stride)
    assert np.allclose([r["acc"] for r in per_residue], ev.per_residue()["acc"].to_numpy(), atol=1e-12)


def check_resume(k: Kind, tmp_path):
    """A journal resumes on the same model after it has run on a longer input (what runs observe, e.g. the
    adapter's longest input, is not part of the model's fingerprint): every unit is read back, same items."""
    path = tmp_path / "evaluate.journal"
    first = phaselens.evaluate(k.arg, **k.opts, n_permutations=1, n_bootstrap=0, journal=path)
    b = k.batch()
    room = int(k.model.cfg.n_ctx) - max(getattr(k.model, "shifts", (0,)))  # an ensemble pads its copies
    longer = torch.cat([b.tokens, b.tokens], dim=1)[:2, :room]
    with torch.no_grad():
        k.model(longer)
    again = phaselens.evaluate(k.arg, **k.opts, n_permutations=1, n_bootstrap=0, journal=path)
    (shard,) = again.metadata["shards"]
    assert shard["units"] >= 1 and len(shard["resumed"]) == shard["units"]
    cols = ["correct", "logit_diff"]
    assert first.items[cols].equals(again.items[cols])


CHECKS = {"evaluate": check_evaluate, "record": check_record, "knockout": check_knockout, "ablate": check_ablate,
          "patch": check_patch, "map": check_map, "plan": check_plan, "attribution": check_attribution,
          "cycling": check_cycling, "repair": check_repair, "report": check_report,
          "resume": check_resume}


# cells too slow for the 5-minute suite on 2 cores (run them with `make test-all`)
SLOW = {("v41", "report"), ("v41", "map")}


@pytest.mark.parametrize(("kind", "analysis"), [
    pytest.param(kind, analysis, marks=[pytest.mark.slow] if (kind, analysis) in SLOW else [], id=f"{kind}-{analysis}")
    for kind in KINDS for analysis in ANALYSES
])
def test_matrix(kinds, kind, analysis, tmp_path):
    k = kinds[kind]
    fn = CHECKS[analysis]
    args = (k, tmp_path) if analysis in ("report", "resume") else (k,)
    reason = NOT_APPLICABLE.get((analysis, kind))
    if reason is not None:
        with pytest.raises(phaselens.errors.NotApplicableError, match=reason):
            fn(*args)
    else:
        fn(*args)


def test_adapter_kinds_share_one_transformer_lens_config(kinds):
    """The TransformerLens-named cfg of the kinds phaselens adapts or builds beside TransformerLens (V4, V4.1, any
    causal LM) is one base class, with torch types for device and dtype on each (no str on one kind)."""
    from phaselens.models.parts.tl_habits import TLConfig

    for name in ("v4", "v41", "causal-lm"):
        cfg = kinds[name].model.cfg
        assert isinstance(cfg, TLConfig), name
        assert isinstance(cfg.device, torch.device) and isinstance(cfg.dtype, torch.dtype), name
        assert (cfg.n_layers, cfg.n_heads) == (kinds[name].model.dims.n_layers, kinds[name].model.dims.n_heads)
