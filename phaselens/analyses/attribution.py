"""``attribution_map``: a gradient screen of head knockouts (attribution patching).

A first-order estimate of each head's knockout effect on the logit difference at the query position:
``delta ~ (z_replacement - z_clean) . d(logit_diff)/dz``, from one forward and one backward pass over the
items (about three forward-equivalents in all, against one pass per head for the exact map).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np
import torch
from scipy import stats as sps

from phaselens.analyses.knockouts import Calibration, calibrate, calibration_items, check_method, z_name
from phaselens.analyses.runner import Analysis, Common, CommonOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import model_logits
from phaselens.analyses.units import Units
from phaselens.contract.protocol import HookContext, PhaseModel, model_name
from phaselens.core.labelled import Labelled
from phaselens.errors import InputError, NotApplicableError
from phaselens.results.attribution_estimate import PhaseAttribution
from phaselens.stats.by_residue import residue_mean_ci


@dataclass(frozen=True)
class AttributionState:
    """The calibration (``None`` for zero replacement)."""

    calibration: Calibration | None


@dataclass(frozen=True)
class Attribution(Analysis[AttributionState]):
    """One forward and one backward pass per block of items: the first-order knockout estimate of every head."""

    name = "attribution_map"
    stage = "attribution"

    method: str = "mean"
    calibration: Any = None
    exact: Any = None

    def check(self, model: PhaseModel, options: Common) -> Attribution:
        method = check_method(self.method, ("mean", "zero"))
        if torch.is_inference_mode_enabled():
            raise NotApplicableError(
                "attribution_map needs gradients, but it was called inside torch.inference_mode(), which forbids "
                "them; call it outside that block (torch.no_grad() around it is fine: attribution_map enables "
                "gradients itself, and fills no parameter's .grad).")
        return replace(self, method=method)

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """The calibration (mean: the task's items, 64 per forward), then one forward and one backward of
        every item."""
        return Units(item_passes=1, calibration_items=calibration_items(self.method, self.calibration,
                                                                        int(items.modulus)), backward=True)

    def prepare(self, run: Run) -> AttributionState:
        L, H = run.model.dims.n_layers, run.model.dims.n_heads
        _check_exact(self.exact, L, H, run.modulus)
        return AttributionState(None if self.method == "zero" else calibrate(run.model, self.calibration,
                                                                              list(range(L)), task=run.task))

    def fields(self, run: Run) -> tuple[str, ...]:
        return ("estimate",)

    def fingerprint(self, run: Run, state: AttributionState) -> dict[str, Any]:
        cal = state.calibration
        return dict(method=self.method, calibration=None if cal is None else cal.z)

    def compute(self, run: Run, state: AttributionState, idx: list[int]) -> list[tuple[np.ndarray]]:
        return [(_block(run, state.calibration, run.blocks[b]).numpy(),) for b in idx]

    def result(self, run: Run, state: AttributionState, parts: list[tuple[np.ndarray]]) -> PhaseAttribution:
        model, batch = run.model, run.batch
        L, H = model.dims.n_layers, model.dims.n_heads
        values = np.concatenate([p[0] for p in parts])  # [N, L, H]
        residue = batch.frame["residue"].to_numpy()
        M = run.modulus
        mean, lo, hi = residue_mean_ci(values, residue, M)  # [L, H, M]
        coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
        lab = Labelled(mean, ("layer", "head", "residue"), coords, lo, hi, name="estimated_delta_logit_diff")
        rho = None
        if self.exact is not None:
            ex = self.exact.values("head", "delta_logit_diff").values
            ok = ~np.isnan(ex) & ~np.isnan(mean)
            rho = float(sps.spearmanr(mean[ok], ex[ok]).statistic)
        cal = state.calibration
        return PhaseAttribution(lab, rho, self.method, run.stride, M, values, residue,
                              run.metadata(calibration=None if cal is None else cal.source))


def _block(run: Run, cal: Calibration | None, block: slice) -> torch.Tensor:
    """Estimates ``[b, L, H]`` of one block of items."""
    model, batch = run.model, run.batch
    L, H = model.dims.n_layers, model.dims.n_heads
    tokens, qp = batch.tokens[block], batch.query_pos[block]
    b = len(qp)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(z: torch.Tensor, hook: HookContext, _qp: torch.Tensor = qp, _kept: dict = kept) -> Any:
        if not z.requires_grad:  # frozen weights (requires_grad=False): the gradient starts at z itself
            z = z.detach().requires_grad_()
            _kept[hook.layer()] = (z, hook.rows(_qp, z.shape[1]))
            return z  # the same values, now on the gradient path
        _kept[hook.layer()] = (z, hook.rows(_qp, z.shape[1]))
        return None

    with torch.enable_grad():
        logits = model_logits(model, tokens, qp, [(z_name(layer), keep) for layer in range(L)])
        dev = logits.device
        r = torch.arange(b, device=dev)
        q = logits[r, (qp - (tokens.shape[1] - logits.shape[1])).to(dev)]
        ld = q[r, batch.answer[block].to(dev)] - q[r, batch.wrong[block].to(dev)]
        # gradients with respect to z only: no parameter .grad is filled
        zs = [kept[layer][0] for layer in range(L)]
        if not all(z.requires_grad for z in zs) or not ld.requires_grad:
            raise NotApplicableError(
                f"{model_name(model)} passes its hooks tensors that are not on the gradient path of its logits "
                "(copies, as the DeepSeek-V4 adapter's nnsight backend makes); load the model with "
                "backend='torch' for attribution_map."
            )
        grads = torch.autograd.grad(ld.sum(), zs, allow_unused=True)
        if any(g is None for g in grads):
            raise NotApplicableError(
                f"{model_name(model)}'s hooked z is not on the gradient path of its logits (copies, as the "
                "DeepSeek-V4 adapter's nnsight backend makes); load the model with backend='torch' for "
                "attribution_map."
            )
    per_layer = []
    for layer in range(L):
        z_all, at = kept[layer]
        rows = torch.arange(len(at), device=z_all.device)
        z = z_all.detach()[rows, at.to(z_all.device)]  # [R, H, d]; R = copies x b
        g = grads[layer][rows, at.to(z_all.device)]
        repl = torch.zeros_like(z) if cal is None else cal.mean(layer).to(device=z.device, dtype=z.dtype).expand_as(z)
        per_layer.append(((repl - z) * g).sum(-1).view(-1, b, H).sum(0))  # copies' terms summed: [b, H]
    return torch.stack(per_layer, 1).float().cpu()


@public
def attribution_map(
    model: PhaseModel,
    task: Any = None,
    *,
    method: str = "mean",
    calibration: Any = None,
    exact: Any = None,
    **options: Unpack[CommonOptions],
) -> PhaseAttribution:
    """Estimate every head's knockout effect on the answer-minus-wrong logit difference, per residue.

    Gradients flow through the query rows only, so under chunked prefill this is exactly the gradient of a
    query-row intervention; on a phase ensemble a head is knocked out in every copy (the estimate sums the
    copies' first-order terms).

    Args:
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal: the common options
            (docs/api.md); a journal holds each finished block's estimates.
        method: ``"mean"`` or ``"zero"`` replacement (as in :func:`phaselens.specialization_map`).
        calibration: the calibration items for ``"mean"`` (default: the task's own, another seed).
        exact: an exact PhaseMap built on the same items (same task, ``n_per_residue`` and ``seed``) to
            report the Spearman correlation with.
    """
    arguments = arguments_of(attribution_map, locals())
    return run(Attribution.from_arguments(arguments), model, task, arguments)


def _check_exact(exact: Any, n_layers: int, n_heads: int, modulus: int) -> None:
    """``exact`` must be a PhaseMap with head cells on the same layers, heads and residues (checked before the
    gradients run)."""
    from phaselens.results.phase_map import PhaseMap

    if exact is None:
        return
    if not isinstance(exact, PhaseMap):
        raise InputError(f"exact must be a PhaseMap (from specialization_map on the same items) or None, got "
                         f"{type(exact).__name__}.")
    want = (n_layers, n_heads, modulus)
    got = exact.values("head", "delta_logit_diff").values.shape
    if tuple(got) != want:
        raise InputError(f"exact has head cells of shape {tuple(got)} (layer, head, residue), but this map has "
                         f"{want}; build it with specialization_map on the same model and task.")
