"""The real-vLLM scenario, run once per session for the tests that ask for it."""

from __future__ import annotations

import pytest

from tests.support.vllm_scenario import Scenario, build_scenario


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    return build_scenario(tmp_path_factory)
