"""Running real vLLM engines (the CPU build, in ``.venv-vllm``) from the test suite.

Each engine runs ``vllm_run_engine.py`` in a subprocess with ``.venv-vllm/bin/python`` and this
tree's kvsnap first on the path; a test names its prompts by label and gets back, per label, the
generated tokens, vLLM's cached-token count and the connector's events. Tests that use it are
marked ``vllm``: ``tests/conftest.py`` skips them where ``.venv-vllm`` is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.engines.vllm import external_request_id, read_events

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
HELPERS = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 300


@dataclass
class EngineRun:
    """One finished engine: request label -> generated tokens, plus its event log and dumps."""

    tokens: dict[str, list[int]]
    cached: dict[str, int]
    events: list[dict[str, Any]]
    dumps: Path
    labels: dict[str, str]  # vLLM's external request id -> prompt label
    startup_seconds: float
    #: Request label -> vLLM's finish reason (``length``; an error is not).
    finished: dict[str, str | None] = field(default_factory=dict)

    def events_for(self, name: str, label: str) -> list[dict[str, Any]]:
        return [
            event
            for event in self.events
            if event["event"] == name
            and self.labels.get(external_request_id(event.get("request", ""))) == label
        ]

    def saved(self) -> dict[str, list[Path]]:
        """Prompt label -> the chunks this engine saved for it, in order."""
        chunks: dict[str, list[Path]] = {}
        for event in self.events:
            if event["event"] == "save":
                label = self.labels[external_request_id(event["request"])]
                chunks.setdefault(label, []).append(Path(event["path"]))
        return chunks


def write_job(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> tuple[Path, dict[str, Any]]:
    """Write the job file of one engine (``vllm_run_engine.py`` says what it holds): ``labels``
    name its prompts in request order. Options: ``connector`` (the connector's extra config;
    none: no connector), ``tp``, ``policy`` (``kv_load_failure_policy``), ``enable_lora``,
    ``no_persist`` (labels kept out of the store), ``extras`` (label -> more request
    fields: ``lora`` ``{"name", "id", "path"}``, ``cache_salt``) and ``fsync_delay_s`` (every
    ``fsync`` under the connector's ``path`` waits that long: a slow disk), ``executor``
    (vLLM's ``distributed_executor_backend``), ``sequential`` (one prompt at a time),
    ``tamper`` (what ``vllm_tampering_connector.TamperingConnector``, then the connector, does
    to the store), ``pause`` (``{"before": i, "file": PATH}``: with ``sequential``, wait
    before prompt ``i`` until ``PATH`` exists)."""
    connector = options.pop("connector", None)
    job = {
        "model": str(model),
        "tensor_parallel_size": options.pop("tp", 1),
        "connector": connector,
        "load_failure_policy": options.pop("policy", "recompute"),
        "enable_lora": options.pop("enable_lora", False),
        "prompts": [
            {
                "token_ids": prompts[label],
                "persist": label not in options.get("no_persist", ()),
                **options.get("extras", {}).get(label, {}),
            }
            for label in labels
        ],
        "max_tokens": 8,
        "output": str(tmp / f"{name}.out.json"),
        "fsync_delay_s": options.pop("fsync_delay_s", 0.0),
        "executor": options.pop("executor", None),
        "sequential": options.pop("sequential", False),
        "pause": options.pop("pause", None),
    }
    tamper = options.pop("tamper", None)
    if tamper is not None:
        job["connector_class"] = "tampering"
        job["tamper"] = tamper
    path = tmp / f"{name}.job.json"
    path.write_text(json.dumps(job))
    return path, job


def start_engine(
    job_path: Path, log: Path, environment: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start the engine of the job at ``job_path`` (its output to ``log``), in this process's
    environment and ``environment`` (more variables, e.g. a remote tier's endpoint)."""
    # The engine imports kvsnap from this tree (whatever the venv's editable install points at),
    # then whatever the caller's path adds.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **(environment or {}), "PYTHONPATH": path}
    return subprocess.Popen(
        [str(PYTHON), str(HELPERS / "vllm_run_engine.py"), str(job_path)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(job_path.parent),
    )


def finish_engine(
    process: subprocess.Popen[bytes],
    job: dict[str, Any],
    labels: list[str],
    log: Path,
    events: Path,
    dumps: Path,
) -> EngineRun:
    try:
        code = process.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    if code != 0 or not Path(job["output"]).exists():
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"vLLM engine failed (exit {code}); log tail:\n{tail}")
    result = json.loads(Path(job["output"]).read_text())
    by_label = {str(index): label for index, label in enumerate(labels)}
    tokens = {by_label[out["request_id"]]: out["token_ids"] for out in result["outputs"]}
    cached = {by_label[out["request_id"]]: out["num_cached_tokens"] for out in result["outputs"]}
    finished = {by_label[out["request_id"]]: out.get("finish_reason") for out in result["outputs"]}
    return EngineRun(
        tokens, cached, read_events(events), dumps, by_label, result["startup_seconds"], finished
    )


def run_engine(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> EngineRun:
    process, job, log, events, dumps = launch_engine(tmp, name, model, labels, prompts, **options)
    return finish_engine(process, job, labels, log, events, dumps)


def launch_engine(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path, Path, Path]:
    """Start the engine ``name`` (``write_job``'s options, and ``environment``: more variables
    for its processes); its process, job, log, event log and dump directory."""
    events, dumps = tmp / f"{name}.events.jsonl", tmp / f"{name}.dumps"
    environment = options.pop("environment", None)
    if options.get("connector") is not None:
        options["connector"] = {
            **options["connector"],
            "event_log": str(events),
            "dump_path": str(dumps),
        }
    job_path, job = write_job(tmp, name, model, labels, prompts, **options)
    log = tmp / f"{name}.log"
    return start_engine(job_path, log, environment), job, log, events, dumps
