"""The real-vLLM worlds of this folder, built once per session, together (``vllm_worlds.py``).

Each fixture below is one world, named as the world is; the first one a test asks for builds
every world the session's tests need (those the collected tests, not skipped, ask for), two
engines at a time, before any of those tests runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.support import vllm_contract, vllm_remote, vllm_scenario, vllm_tampered, vllm_trust
from tests.support.vllm_contract import Refusal
from tests.support.vllm_engines import EngineRun
from tests.support.vllm_remote import RemoteRun
from tests.support.vllm_scenario import Scenario
from tests.support.vllm_tampered import Tampered
from tests.support.vllm_trust import Trust
from tests.support.vllm_worlds import World, Worlds, make_model

#: Every world, by the name of the fixture that gives it (a parametrized fixture's worlds are
#: named ``fixture[param]``).
WORLDS: dict[str, World] = {
    "scenario": vllm_scenario.WORLD,
    "perturbed_run": vllm_scenario.PERTURBED,
    "trust": vllm_trust.WORLD,
    "tampered": vllm_tampered.WORLD,
    "served": vllm_remote.WORLD,
    "sliding_window_refusal": vllm_contract.SLIDING_WINDOW,
    **{f"failed_load[{kind}]": world for kind, world in vllm_contract.FAILED_LOAD.items()},
}


def _needed(items: list[pytest.Item]) -> set[str]:
    """The worlds the tests ``items`` ask for, leaving out the tests that skip."""
    needed = set()
    for item in items:
        if item.get_closest_marker("skip") is not None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in item.fixturenames:
            if name in params:
                name = f"{name}[{params[name]}]"
            if name in WORLDS:
                needed.add(name)
    return needed


@pytest.fixture(scope="session")
def vllm_worlds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    def model() -> Path:
        """The random-weight Llama of ``vllm_make_model.py`` (seed 0): the worlds'."""
        return make_model(tmp_path_factory.mktemp("vllm-model") / "model")

    def directory(name: str) -> Path:
        return tmp_path_factory.mktemp("vllm-" + name.replace("[", "-").rstrip("]"))

    return Worlds(WORLDS, _needed(request.session.items), directory, functools.cache(model))


@pytest.fixture(scope="session")
def scenario(vllm_worlds: Worlds) -> Scenario:
    return vllm_worlds.get("scenario")


@pytest.fixture(scope="session")
def perturbed_run(vllm_worlds: Worlds) -> EngineRun:
    return vllm_worlds.get("perturbed_run")


@pytest.fixture(scope="session")
def trust(vllm_worlds: Worlds) -> Trust:
    return vllm_worlds.get("trust")


@pytest.fixture(scope="session")
def tampered(vllm_worlds: Worlds) -> Tampered:
    return vllm_worlds.get("tampered")


@pytest.fixture(scope="session")
def served(vllm_worlds: Worlds) -> RemoteRun:
    return vllm_worlds.get("served")


@pytest.fixture(scope="session")
def sliding_window_refusal(vllm_worlds: Worlds) -> Refusal:
    return vllm_worlds.get("sliding_window_refusal")
