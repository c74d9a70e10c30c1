"""One IndexTopKWarning for every kind."""

from __future__ import annotations

import warnings

from phaselens.models.deepseek_v4 import IndexTopKWarning as V4Warning
from phaselens.models.deepseek_v41 import IndexTopKWarning as V41Warning
from phaselens.models.parts.index_topk import IndexTopKWarning


def test_one_class_one_base():
    assert V4Warning is IndexTopKWarning is V41Warning
    assert IndexTopKWarning.__bases__ == (UserWarning,)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn(IndexTopKWarning("x"), stacklevel=1)
    assert seen[0].category is IndexTopKWarning
