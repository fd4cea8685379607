"""The real-vLLM worlds of ``tests/engines/vllm``, built together, two engines at a time.

A world is what one test module reads from real engines: the restart scenario
(``vllm_scenario.py``), the trusted store (``vllm_trust.py``), the tampered store
(``vllm_tampered.py``), the remote tier (``vllm_remote.py``), ... An engine spends most of its
~25 s importing vLLM and torch in three processes one after the other (the engine, its core, its
worker), each on one core: built one after the other, the worlds keep one core of a 2-core
machine idle. So each world is split into jobs that need nothing of each other (a reference
engine without a connector beside a chain of engines on one store), and the jobs of every world
a session needs run on two threads, longest first, each job one engine at a time: both cores
busy, and never more than two engines alive at once (as when the restart scenario ran its
reference engine beside its first one).

The first test that asks for a world waits until every world the session needs is built, so no
other test runs beside the engines; each world's fixture then gets its own world, or its own
error or skip, as if it had been built alone. Each world has a directory of its own (its store,
its logs); they share only the random-weight model, which no engine writes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_engines import HELPERS, PYTHON

#: Engines alive at once: one per core of the 2-core machine the suite is sized for.
ENGINES_AT_ONCE = 2
#: What a world's build may end in instead of the world: an error, or a skip.
_OUTCOMES = (Exception, pytest.skip.Exception)


def make_model(directory: Path, *arguments: str) -> Path:
    """Save ``vllm_make_model.py``'s random-weight model (``arguments``: its seed and sliding
    window) in ``directory``, with the vLLM virtualenv's Python."""
    subprocess.run(
        [str(PYTHON), str(HELPERS / "vllm_make_model.py"), str(directory), *arguments],
        check=True,
        capture_output=True,
    )
    return directory


@dataclass(frozen=True)
class Job:
    """One part of a world that needs no other part: it runs at most one engine at a time."""

    run: Callable[[Any], Any]  # the world's context -> this part's result
    engines: float = 1.0  # about how many engines long it is (the longest start first)


@dataclass(frozen=True)
class World:
    """``prepare`` (in the test process's main thread: inputs the jobs share, no engine), then
    the ``jobs`` (each on a thread of its own), then ``combine`` of their results."""

    prepare: Callable[[Path, Path], Any]  # (the world's directory, the model) -> context
    jobs: dict[str, Job]
    combine: Callable[[Any, dict[str, Any]], Any]  # (context, results by job name) -> world


@dataclass
class Worlds:
    """The worlds a session needs, built on first use (``get``)."""

    worlds: dict[str, World]
    needed: set[str]
    directory: Callable[[str], Path]  # a fresh directory for the named world
    model: Callable[[], Path]  # the shared model, built on first call
    _outcomes: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        """The world ``name``; raises its build's error (or skip) instead where it had one."""
        if name not in self._outcomes:
            self._build({name, *self.needed} - set(self._outcomes))
        outcome = self._outcomes[name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _build(self, names: Iterable[str]) -> None:
        names = sorted(names)
        model = self.model()
        contexts: dict[str, Any] = {}
        for name in names:
            try:
                contexts[name] = self.worlds[name].prepare(self.directory(name), model)
            except _OUTCOMES as error:  # a skip too: it is that world's outcome
                self._outcomes[name] = error
        parts = [
            (job.engines, name, part, job)
            for name in contexts
            for part, job in self.worlds[name].jobs.items()
        ]
        parts.sort(key=lambda entry: -entry[0])
        futures: dict[tuple[str, str], Future[Any]] = {}
        pool = ThreadPoolExecutor(ENGINES_AT_ONCE, thread_name_prefix="vllm-world")
        try:
            for _, name, part, job in parts:
                futures[name, part] = pool.submit(job.run, contexts[name])
            wait(futures.values())
        finally:  # interrupted: no job starts any more, the running ones end with their engine
            pool.shutdown(wait=True, cancel_futures=True)
        for name, context in contexts.items():
            self._outcomes[name] = _combine(self.worlds[name], context, futures, name)


def _combine(
    world: World, context: Any, futures: dict[tuple[str, str], Future[Any]], name: str
) -> Any:
    """The world ``name`` from its jobs' results, or the first of their errors."""
    results = {}
    for part in world.jobs:
        error = futures[name, part].exception()
        if error is not None:
            return error
        results[part] = futures[name, part].result()
    try:
        return world.combine(context, results)
    except _OUTCOMES as error:
        return error
