"""Weights fingerprints of a loaded model or a checkpoint on disk, for every engine.

A snapshot records the model it came from (:func:`kvsnap.format.model_fingerprint_with_weights`):
the config alone would let a fine-tune of the same architecture accept the base model's KV.
:func:`module_weights_fingerprint` samples a loaded ``torch.nn.Module``'s parameters (one device
gather and one copy to the host for the whole model); :func:`checkpoint_weights_fingerprint`
samples the safetensors files of a checkpoint directory, for processes that hold no weights
(vLLM's scheduler). Both read the same windows (:func:`kvsnap.format.sample_windows`) of every
tensor under its checkpoint name, floating-point values as bfloat16, so a model loaded from a
directory gets the same fingerprint either way. ``full=True`` hashes every byte instead
(slower; catches a change confined to unsampled bytes).
"""

from __future__ import annotations

import copy
import json
import math
import operator
import os
import struct
import threading
import weakref
from collections.abc import Callable, Hashable
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvsnap.dtypes import SAFETENSORS_TYPES
from kvsnap.format.fingerprint import (
    CANONICAL_FLOAT,
    FLOAT_DTYPES,
    VOLATILE_CONFIG_KEYS,
    WeightSample,
    bfloat16_bits,
    model_fingerprint_with_weights,
    sample_windows,
    weights_fingerprint,
)

#: safetensors dtype names of torch dtypes that weights use beyond kvsnap's own table.
_EXTRA_DTYPE_NAMES = {torch.int32: "I32", torch.int16: "I16", torch.bool: "BOOL"}
_DTYPE_NAMES = {element.torch: name for name, element in SAFETENSORS_TYPES.items()}
_DTYPE_NAMES.update(_EXTRA_DTYPE_NAMES)
#: A safetensors header larger than this is not a checkpoint kvsnap reads (100 MB, the limit
#: the safetensors library itself enforces).
_MAX_HEADER_BYTES = 100_000_000

_MODULE_LOCK = threading.Lock()

T = TypeVar("T")


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.").upper()


class _Remembered:
    """A model as it was when its answers (fingerprints, and whatever
    :func:`remembered_answer` keeps) were computed, and whether it still is.

    Held: every submodule (weakly); of each, its ``_modules`` and ``_parameters`` dicts' sizes,
    names and values (as ids: a child is itself a held submodule and every parameter is held,
    so while the submodules are alive no other object can have one of these ids); every
    parameter's version counter, storage address, dtype and shape; and the model's config
    (:class:`_ConfigState`). :meth:`unchanged` tells whether any module or parameter was
    replaced, added, removed or renamed (an adapter injected or deleted, a weight reassigned),
    a parameter written in place (``copy_``, ``load_state_dict``, an optimizer step) or given
    other ``.data``, or a setting of the config changed. It is a few passes of C-level
    ``map``s over the modules' dicts and the parameters; for an 8B model's 423 modules and 291
    parameters it reads memory the restore before it evicted from the CPU's caches (~0.9 ms
    then on the development VM, ~0.4 ms in a loop: docs/benchmarks.md). Torch signals none of
    these changes (a deletion fires no registration hook), so nothing cheaper is exact.

    Modules are held by weak reference: this object is the value of a weak-keyed map whose key
    is the model, and a strong reference to any module of it would keep the model alive."""

    def __init__(self, module: torch.nn.Module) -> None:
        subs = list(module.modules())
        self.modules = [weakref.ref(sub) for sub in subs]
        dicts = list(chain.from_iterable(map(_DICTS, subs)))
        self.sizes = list(map(len, dicts))
        self.names = list(chain.from_iterable(dicts))
        values = list(chain.from_iterable(map(dict.values, dicts)))
        self.ids = list(map(id, values))
        self.parameters = [value for value in values if isinstance(value, torch.Tensor)]
        self.state = _tensor_state(self.parameters)
        self.config = _ConfigState.of(getattr(module, "config", None))
        self.answers: dict[Hashable, object] = {}

    def unchanged(self) -> bool:
        subs = [reference() for reference in self.modules]
        try:
            dicts = list(chain.from_iterable(map(_DICTS, subs)))
        except AttributeError:  # a submodule was freed: the tree lost it
            return False
        return (
            list(map(len, dicts)) == self.sizes
            and list(map(id, chain.from_iterable(map(dict.values, dicts)))) == self.ids
            and list(chain.from_iterable(dicts)) == self.names
            and _tensor_state(self.parameters) == self.state
            and self.config is not None
            and self.config.unchanged(getattr(subs[0], "config", None))
        )


#: A module's children and parameters, by name.
_DICTS = operator.attrgetter("_modules", "_parameters")


def _tensor_state(tensors: list[torch.Tensor]) -> tuple[list, list]:
    """What tells parameters' values apart without reading them: each one's version counter
    (bumped by every write in place), dtype and shape, and storage address (``.data``
    replaced, which leaves the version counter alone)."""
    return list(map(_VERSION_DTYPE_SHAPE, tensors)), list(map(torch.Tensor.data_ptr, tensors))


_VERSION_DTYPE_SHAPE = operator.attrgetter("_version", "dtype", "shape")


class _ConfigState:
    """A model config's settings as they were: the config itself and a deep copy of its
    attributes. A nested config (a multimodal model's text config) is copied with it and
    compared as its class compares configs (transformers: every field)."""

    def __init__(self, config: object, attributes: dict[str, Any]) -> None:
        self.config = config
        self.attributes = attributes

    @classmethod
    def of(cls, config: object) -> _ConfigState | None:
        """The state of ``config`` (also of no config, ``None``), or ``None`` when its
        attributes cannot be copied (then nothing about the model is remembered)."""
        try:
            return cls(config, copy.deepcopy(_attributes(config)))
        except Exception:  # an attribute deepcopy refuses: no state to compare against
            return None

    def unchanged(self, config: object) -> bool:
        """Whether ``config`` is the same object with the same settings. Attributes a
        fingerprint leaves out (``_``-prefixed, :data:`VOLATILE_CONFIG_KEYS`) may differ: a
        config whose only change is one of them is taken as the state from then on."""
        if config is not self.config:
            return False
        try:
            now = _attributes(config)
            if now == self.attributes:  # one C-level comparison: the call of every restore
                return True
            if _settings(now) != _settings(self.attributes):
                return False
            self.attributes = copy.deepcopy(now)
            return True
        except Exception:  # a value whose == is no bool (an array): taken as changed
            return False


def _attributes(config: object) -> dict[str, Any]:
    return {} if config is None else vars(config)


def _settings(attributes: dict[str, Any]) -> dict[str, Any]:
    """The attributes a fingerprint reads (:func:`kvsnap.format.model_fingerprint`)."""
    return {
        key: value
        for key, value in attributes.items()
        if not key.startswith("_") and key not in VOLATILE_CONFIG_KEYS
    }


_REMEMBERED: weakref.WeakKeyDictionary[torch.nn.Module, _Remembered] = weakref.WeakKeyDictionary()


def _remembered(module: torch.nn.Module) -> _Remembered:
    """The module's remembered state, new (with no answers) when anything changed."""
    with _MODULE_LOCK:
        remembered = _REMEMBERED.get(module)
    if remembered is None or not remembered.unchanged():
        remembered = _Remembered(module)
        with _MODULE_LOCK:
            _REMEMBERED[module] = remembered
    return remembered


def remembered_answer(module: torch.nn.Module, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, remembered per ``module`` under ``key`` until the module changes: a
    submodule or parameter replaced, added, removed or renamed, a parameter written in place or
    given other ``.data``, or a setting of ``module.config`` (or of a config nested in it)
    changed (:class:`_Remembered`). For answers that depend on nothing else: a model's KV
    geometry, its fingerprint. A hit costs one comparison pass over the module tree."""
    remembered = _remembered(module)
    if key in remembered.answers:
        return remembered.answers[key]  # type: ignore[return-value]
    answer = compute()
    remembered.answers[key] = answer
    return answer


def module_weights_fingerprint(module: torch.nn.Module, *, full: bool = False) -> str:
    """The weights fingerprint of a loaded model: every parameter (tied ones once, under their
    first name) by name, dtype, shape and sampled bytes.

    The sampled fingerprint is remembered per module until a module or parameter is
    replaced, added, removed or renamed or a parameter is written in place
    (:func:`remembered_answer`), so calling this per restore costs one pass of comparisons
    over the module tree.
    """
    if full:
        return weights_fingerprint(_module_samples(module, full=True), full=True)
    return _sampled_weights(module, _remembered(module))


def _sampled_weights(module: torch.nn.Module, remembered: _Remembered) -> str:
    known = remembered.answers.get(_WEIGHTS)
    if known is None:
        known = weights_fingerprint(_module_samples(module, full=False))
        remembered.answers[_WEIGHTS] = known
    return str(known)


#: The keys of the fingerprints among a module's remembered answers.
_WEIGHTS = ("fingerprint", "weights")
_MODEL = ("fingerprint", "model")


@torch.no_grad()
def _module_samples(module: torch.nn.Module, full: bool) -> list[WeightSample]:
    parameters = list(module.named_parameters())
    gathered: list[torch.Tensor] = []
    for _, parameter in parameters:
        flat = parameter.detach().reshape(-1)
        windows = sample_windows(flat.numel(), full)
        if len(windows) > 1:
            starts = torch.tensor([start for start, _ in windows], device=flat.device)
            width = torch.arange(windows[0][1], device=flat.device)
            flat = flat[(starts[:, None] + width).reshape(-1)]
        if dtype_name(parameter.dtype) in FLOAT_DTYPES:
            flat = flat.to(torch.bfloat16)
        gathered.append(flat.contiguous().view(torch.uint8))
    sizes = [piece.numel() for piece in gathered]
    # One copy to the host for the whole model (one synchronisation, not one per tensor).
    joined = torch.cat(gathered).cpu().numpy().tobytes() if gathered else b""
    samples = []
    offset = 0
    for (name, parameter), size in zip(parameters, sizes, strict=True):
        dtype = dtype_name(parameter.dtype)
        samples.append(
            WeightSample(
                name,
                CANONICAL_FLOAT if dtype in FLOAT_DTYPES else dtype,
                tuple(parameter.shape),
                joined[offset : offset + size],
            )
        )
        offset += size
    return samples


def loaded_model_fingerprint(module: torch.nn.Module) -> str:
    """The model fingerprint a snapshot of a loaded transformers model records: its config
    (``module.config``) and its weights (:func:`module_weights_fingerprint`).

    Remembered with the weights' fingerprint until the module tree, a parameter or a setting
    of the config changes (:func:`remembered_answer`): a config changed in place is seen."""
    remembered = _remembered(module)
    known = remembered.answers.get(_MODEL)
    if known is None:
        weights = _sampled_weights(module, remembered)
        known = model_fingerprint_with_weights(module.config, weights)
        remembered.answers[_MODEL] = known
    return str(known)


def checkpoint_weights_fingerprint(directory: str | os.PathLike[str], *, full: bool = False) -> str:
    """The weights fingerprint of the safetensors files of a checkpoint ``directory``: the
    same as :func:`module_weights_fingerprint` of a model loaded from it (in any float dtype
    that holds the stored values, as bfloat16 does a bfloat16 checkpoint). Raises
    ``FileNotFoundError`` when the directory holds no ``*.safetensors`` file and ``ValueError``
    for a file that is not safetensors."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    samples: list[WeightSample] = []
    for file in files:
        samples.extend(_file_samples(file, full))
    return weights_fingerprint(samples, full=full)


def _file_samples(path: Path, full: bool) -> list[WeightSample]:
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a safetensors header of {length} bytes is too large")
        header = json.loads(file.read(length))
        data_start = 8 + length
        samples = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = entry["dtype"]
            shape = tuple(entry["shape"])
            begin = data_start + entry["data_offsets"][0]
            size = _element_size(dtype, path)
            pieces = [
                os.pread(file.fileno(), count * size, begin + first * size)
                for first, count in sample_windows(math.prod(shape), full)
            ]
            raw = b"".join(pieces)
            if dtype in FLOAT_DTYPES:
                samples.append(WeightSample(name, CANONICAL_FLOAT, shape, _as_bf16(raw, dtype)))
            else:
                samples.append(WeightSample(name, dtype, shape, raw))
    return samples


def _element_size(dtype: str, path: Path) -> int:
    sizes = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
    sizes.update({"I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})
    if dtype not in sizes:
        raise ValueError(f"{path}: unknown safetensors dtype {dtype!r}")
    return sizes[dtype]


def _as_bf16(raw: bytes, dtype: str) -> bytes:
    """Stored floats as the bfloat16 bytes a model loaded in bfloat16 holds."""
    if dtype == "BF16":
        return raw
    numpy_type = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype]
    values = np.frombuffer(raw, dtype=numpy_type).astype(np.float32)
    return bfloat16_bits(values).tobytes()
