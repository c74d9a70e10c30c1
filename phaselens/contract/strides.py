"""The one rule for a stride, wherever it is given (docs/concepts.md, "Strides: one rule").

A stride names the geometry phases are read at. It is given in four places: ``phaselens.load(obj, stride=)`` /
``from_hf(obj, stride=)`` / ``load("hf:DIR", stride=)`` (a model without compression, adapted at it),
DeepSeek-V4 / V4.1's load option ``analysis_stride=``, and an analysis's ``stride=``. Everywhere:

* it is an integer >= 1 (a bool is not);
* on a model with compressed layers it must be one of their strides or a multiple of one: each phase mod a
  multiple ``k * S`` lies inside one phase mod ``S``, so the compressor's phases are refined, never mixed;
  any other stride is refused by :func:`check_stride`, with the same :class:`PhaseGeometryError`;
* on a model without compression any stride is taken (the control is read at the stride it is compared at).

An accepted stride is applied and recorded: a model without compression is adapted anew at it (never returned
at its old stride; ``with_geometry``), an analysis reads phases at it, and the result's
``metadata["analysis_stride"]`` is the stride the phases were read at. A request that cannot be applied is
refused: a built model with compression keeps the geometry it was built with, so ``load(model, stride=S)``
with another ``S`` names the routes that apply it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phaselens.core.checks import as_int
from phaselens.errors import InputError, PhaseGeometryError


def compression_strides(model: Any) -> tuple[int, ...]:
    """The distinct strides of ``model``'s compressed layers, ascending (``()``: no compression), read from
    ``model.dims.phase_specs`` (a layer whose spec is ``None`` does not compress)."""
    specs = getattr(getattr(model, "dims", None), "phase_specs", ()) or ()
    return tuple(sorted({int(s.stride) for s in specs if s is not None and int(s.stride) >= 2}))


def check_stride(stride: Any, strides: Sequence[int], *, option: str = "stride", what: str = "this model") -> int:
    """``stride`` as an int, checked against the compression strides ``strides`` (``()``: any stride >= 1).

    Raises:
        InputError: not an integer >= 1.
        PhaseGeometryError: ``strides`` is not empty and ``stride`` is neither one of them nor a multiple of one.
    """
    s = as_int(option, stride, minimum=1, fix="A stride is the number of slots per phase cycle, e.g. 4.")
    strides = sorted({int(n) for n in strides})
    if strides and not any(s % n == 0 for n in strides):
        first = strides[0]
        raise PhaseGeometryError(
            f"{option}={s} does not fit {what}: its compressed layers have strides {strides}, and phases are read "
            f"at one of them or a multiple of one (e.g. {first} or {2 * first}), so that each phase lies inside "
            f"one phase of the compressor; a stride of {s} would mix them. Pass one of those, or leave it out for "
            f"the model's own ({first})."
        )
    return s


def refuse_restride(model: Any, stride: int, own: int, name: str) -> InputError:
    """The error for ``load(model, stride=S)`` of a built model with compression at another stride than its own:
    its geometry was fixed when it was built; the routes that apply ``S``."""
    return InputError(
        f"{name} is already built with compression and reads phases at stride {own}; load() cannot change that to "
        f"{stride}. Pass stride={stride} to the analysis (it reads phases at {stride} and records it in the "
        f"result's metadata), or load the checkpoint again with analysis_stride={stride} (DeepSeek-V4 / V4.1)."
    )


def stride_record(model: Any, spec: Any) -> dict[str, Any]:
    """What a result records of the geometry its phases were read at: ``analysis_stride`` (and window and
    origin where the model records them) of ``spec``, and ``model_analysis_stride``, the model's own, when an
    analysis's ``stride=`` read phases at another stride."""
    md = dict(getattr(model, "analysis_metadata", {}) or {})
    out: dict[str, Any] = {"analysis_stride": int(spec.stride)}
    if "analysis_window" in md:
        out["analysis_window"] = int(spec.window)
    if "analysis_origin" in md:
        out["analysis_origin"] = int(spec.origin)
    own = int(model.dims.analysis_spec.stride)
    if own != int(spec.stride):
        out["model_analysis_stride"] = own
    return out
