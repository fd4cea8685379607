"""Fixtures the format tests share."""

from __future__ import annotations

import numpy as np
import pytest

from kvsnap import format as fmt
from tests.support.store_helpers import GEOMETRIES, make_metadata, shared_prefix_tokens


@pytest.fixture
def metadata() -> fmt.SnapshotMetadata:
    rng = np.random.default_rng(3)
    geometry = GEOMETRIES["bf16"]
    return make_metadata(
        geometry, shared_prefix_tokens(rng, geometry.block_size), created=fmt.utc_now()
    )
