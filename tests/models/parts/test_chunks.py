"""Chunk planning: the pieces of a chunked forward, and the checks on its arguments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phaselens.errors import InputError
from phaselens.models.parts.chunks import ChunkPlan, plan_chunks


def test_unchunked_is_one_call():
    plan = plan_chunks(10, None, None)
    assert plan == ChunkPlan((), (0, 10)) and plan.calls == ((0, 10),) and plan.query_rows == 10


def test_pieces_then_the_query():
    plan = plan_chunks(23, 5, None)  # query: the last min(chunk, T) = 5 tokens
    assert plan.prefix == ((0, 5), (5, 10), (10, 15), (15, 18)) and plan.query == (18, 23)
    assert plan.query_start == 18 and plan.calls[-1] == (18, 23)
    assert plan_chunks(23, 5, 6).prefix[-1] == (15, 17) and plan_chunks(23, 5, 6).query == (17, 23)
    assert plan_chunks(4, 8, None) == ChunkPlan((), (0, 4))  # chunk longer than T: the query is everything
    assert plan_chunks(9, None, 1) == ChunkPlan(((0, 8),), (8, 9))  # a query engine's split: the prefix whole


@given(T=st.integers(1, 200), chunk=st.integers(1, 50), data=st.data())
def test_pieces_tile_the_tokens(T, chunk, data):
    q = data.draw(st.none() | st.integers(1, T))
    plan = plan_chunks(T, chunk, q)
    ranges = plan.calls
    assert ranges[0][0] == 0 and ranges[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(0 < stop - start <= chunk for start, stop in plan.prefix)
    assert plan.query_rows == (q if q is not None else min(chunk, T))


@pytest.mark.parametrize("chunk, query_len, match", [
    (0, None, "chunk must be a positive int"), (True, None, "chunk must"), (2.5, None, "chunk must"),
    (4, 0, "query_len must be an int in 1..10"), (4, 11, "query_len"), (None, True, "query_len"),
])
def test_bad_arguments(chunk, query_len, match):
    with pytest.raises(InputError, match=match):
        plan_chunks(10, chunk, query_len)


def test_numpy_integers_are_ints():
    assert plan_chunks(10, np.int64(4), np.int64(3)) == plan_chunks(10, 4, 3)
