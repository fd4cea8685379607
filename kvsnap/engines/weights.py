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

import json
import math
import operator
import os
import struct
import threading
import weakref
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch

from kvsnap.dtypes import SAFETENSORS_TYPES
from kvsnap.format.fingerprint import (
    CANONICAL_FLOAT,
    FLOAT_DTYPES,
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


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.").upper()


class _Remembered:
    """A module tree as it was when its fingerprints were computed: every submodule with its
    children and parameters (the objects), and every parameter's storage address and version
    counter. :meth:`unchanged` tells, in one pass of identity and integer comparisons, whether
    any module or parameter was replaced (an adapter injected, a weight reassigned) or written
    in place (``copy_``, ``load_state_dict``, an optimizer step): a walk through
    ``named_parameters()`` costs ~1.4 ms per call for an 8B model on the H200's host, too much
    for a check made on every restore.

    Modules are held by weak reference: this object is the value of a weak-keyed map whose key
    is the model, and a strong reference to any module of it would keep the model alive."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.nodes = [
            (
                weakref.ref(sub),
                tuple(map(_weak, sub._modules.values())),
                tuple(sub._parameters.values()),
            )
            for sub in module.modules()
        ]
        self.parameters = [p for _, _, params in self.nodes for p in params if p is not None]
        self.versions = [p._version for p in self.parameters]
        self.pointers = [p.data_ptr() for p in self.parameters]
        self.fingerprints: dict[str, str] = {}

    def unchanged(self) -> bool:
        for sub_ref, children, params in self.nodes:
            sub = sub_ref()
            if sub is None:
                return False
            now = sub._modules.values()
            if len(now) != len(children) or not all(map(operator.is_, map(_strong, children), now)):
                return False
            if not _same(sub._parameters.values(), params):
                return False
        return [p._version for p in self.parameters] == self.versions and [
            p.data_ptr() for p in self.parameters
        ] == self.pointers


def _weak(module: torch.nn.Module | None) -> Callable[[], torch.nn.Module | None]:
    """A weak reference to ``module`` (a registered ``None`` stays ``None`` when called)."""
    return _no_module if module is None else weakref.ref(module)


def _no_module() -> None:
    """What :func:`_weak` gives for a registered ``None``: called, it is ``None`` again."""
    return None


def _strong(reference: Callable[[], torch.nn.Module | None]) -> torch.nn.Module | None:
    return reference()


def _same(now: Collection[object], then: tuple[object, ...]) -> bool:
    """Whether ``now`` holds exactly the objects ``then`` does, in order (by identity: a
    tensor's ``==`` compares elements)."""
    return len(now) == len(then) and all(map(operator.is_, now, then))


_REMEMBERED: weakref.WeakKeyDictionary[torch.nn.Module, _Remembered] = weakref.WeakKeyDictionary()


def _remembered(module: torch.nn.Module) -> _Remembered:
    """The module's remembered state, new (with no fingerprints) when anything changed."""
    with _MODULE_LOCK:
        remembered = _REMEMBERED.get(module)
    if remembered is None or not remembered.unchanged():
        remembered = _Remembered(module)
        with _MODULE_LOCK:
            _REMEMBERED[module] = remembered
    return remembered


def module_weights_fingerprint(module: torch.nn.Module, *, full: bool = False) -> str:
    """The weights fingerprint of a loaded model: every parameter (tied ones once, under their
    first name) by name, dtype, shape and sampled bytes.

    The sampled fingerprint is remembered per module until a module or parameter is
    replaced or a parameter is written in place, so calling this per restore costs one pass
    of comparisons over the module tree.
    """
    if full:
        return weights_fingerprint(_module_samples(module, full=True), full=True)
    return _sampled_weights(module, _remembered(module))


def _sampled_weights(module: torch.nn.Module, remembered: _Remembered) -> str:
    known = remembered.fingerprints.get("weights")
    if known is None:
        known = weights_fingerprint(_module_samples(module, full=False))
        remembered.fingerprints["weights"] = known
    return known


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

    Remembered with the weights' fingerprint: a config changed in place after the model was
    built is not seen (transformers reads it when building the modules, so such a change does
    not change what the model computes either)."""
    remembered = _remembered(module)
    known = remembered.fingerprints.get("model")
    if known is None:
        weights = _sampled_weights(module, remembered)
        known = model_fingerprint_with_weights(module.config, weights)
        remembered.fingerprints["model"] = known
    return known


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
