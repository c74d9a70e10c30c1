"""PhaseSpec: the geometry of chunked compression (science.md §1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from phaselens import PhaseLensError, PhaseSpec
from phaselens.errors import PhaseGeometryError

strides = st.integers(1, 12)
mults = st.integers(1, 4)
origins = st.integers(0, 20)


@st.composite
def spec_and_pos(draw):
    s = draw(strides)
    spec = PhaseSpec(s, s * draw(mults), draw(origins))
    t = spec.origin + draw(st.integers(0, 500))
    return spec, t


@given(spec_and_pos())
def test_every_token_belongs_to_w_over_s_entries_with_offsets_inside(arg):
    spec, t = arg
    entries = spec.entries_containing(t)
    offsets = spec.offsets(t)
    assert len(entries) == spec.window // spec.stride
    for j, off in zip(entries, offsets):
        start, stop = spec.window_of(j)
        assert start <= t < stop  # the entry's (clipped) window holds t
        # the offset counts from the unclipped window start
        assert off == t - (spec.origin + j * spec.stride + spec.stride - spec.window)
        assert 0 <= off < spec.window


@given(spec_and_pos())
def test_entries_containing_is_exactly_the_windows_holding_t(arg):
    spec, t = arg
    brute = [j for j in range(0, (t - spec.origin) // spec.stride + spec.window // spec.stride + 2)
             if spec.window_of(j).start <= t < spec.window_of(j).stop]
    assert brute == spec.entries_containing(t)


@given(spec_and_pos())
def test_entry_becomes_visible_exactly_at_its_last_token(arg):
    spec, t = arg
    j = spec.visible_entries(t)  # first invisible entry at t
    assert spec.completes_at(j) > t
    if j > 0:
        assert spec.completes_at(j - 1) <= t
        assert spec.visible_entries(spec.completes_at(j - 1)) == j  # visible at its last slot
        assert spec.visible_entries(spec.completes_at(j - 1) - 1) == j - 1 if spec.completes_at(j - 1) > spec.origin else True


@given(spec_and_pos())
def test_phase_is_periodic_and_boundary_is_last_slot(arg):
    spec, t = arg
    assert spec.phase(t + spec.stride) == spec.phase(t)
    assert spec.is_boundary(t) == (spec.phase(t) == spec.stride - 1)
    assert spec.residue(t, 3 * spec.stride) % spec.stride == spec.phase(t)
    # the token after a boundary starts a new entry
    if spec.is_boundary(t):
        assert spec.visible_entries(t) == spec.visible_entries(t - 1) + 1 if t > spec.origin else True


def test_concrete_deepseek_csa_layout():
    spec = PhaseSpec(4, 8)
    assert spec.entries_containing(13) == [3, 4]
    assert spec.offsets(13) == [5, 1]
    assert spec.window_of(0) == (0, 4)  # clipped at the origin
    assert spec.window_of(3) == (8, 16)
    assert spec.visible_entries(11) == 3 and spec.visible_entries(10) == 2
    assert spec.rope_position(3) == 12
    assert spec.boundary_phase == 3
    with_origin = PhaseSpec(4, 8, origin=3)
    assert with_origin.phase(3) == 0 and with_origin.entries_containing(16) == [3, 4]


def test_vectorised_over_numpy_and_torch():
    spec = PhaseSpec(4, 8, origin=1)
    t = np.arange(1, 40)
    for arr in (t, torch.from_numpy(t)):
        phases = spec.phase(arr)
        assert type(phases) is type(arr)
        assert list(np.asarray(phases)) == [spec.phase(int(x)) for x in t]
        ents = spec.entries_containing(arr)
        assert tuple(ents.shape) == (len(t), 2)
        assert np.asarray(ents).tolist() == [spec.entries_containing(int(x)) for x in t]
        assert np.asarray(spec.offsets(arr)).tolist() == [spec.offsets(int(x)) for x in t]
        assert np.asarray(spec.visible_entries(arr)).tolist() == [spec.visible_entries(int(x)) for x in t]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stride=0), "stride must be an integer >= 1"),
        (dict(stride=4, window=6), "positive multiple of the stride 4"),
        (dict(stride=4, window=0), "positive multiple"),
        (dict(stride=4, origin=-1), "origin must be an integer >= 0"),
    ],
)
def test_bad_arguments_raise_geometry_error(kwargs, match):
    with pytest.raises(PhaseGeometryError, match=match):
        PhaseSpec(**kwargs)


def test_position_before_origin_and_bad_modulus():
    spec = PhaseSpec(4, origin=5)
    with pytest.raises(PhaseGeometryError, match="before the origin 5"):
        spec.phase(3)
    with pytest.raises(PhaseLensError, match="multiple of the stride 4"):
        spec.residue(9, 6)
    with pytest.raises(PhaseGeometryError, match="integers"):
        spec.phase(np.array([1.5]))


def test_str_mentions_layout():
    assert "overlapping" in str(PhaseSpec(4, 8)) and "boundary phase 3" in str(PhaseSpec(4, 8))
