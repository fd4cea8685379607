"""An fp8 snapshot written as fp8 again (``kvsnap convert --compress fp8``,
:func:`~kvsnap.encoded.write.recode_file`): kept as it is, never quantized a second time.

Quantizing an fp8 file's decoded pages again rounds them again: on the built-in model's KV about
half the values move, by up to 0.125, and the error recorded would be against the decoded
pages, not the captured ones, which are gone. So an fp8 file asked for as fp8 keeps its stored
values, scales and recorded error. It is checked whole first (as any re-encode decodes its
source: the container, the signature with keys, every scale and page check), then written as
it is, as ``--compress none`` writes an ordinary file, or, when keys are given for a file no
key signed, stored again around the same tensors with its pages' BLAKE3 digests and a
signature: byte for byte what an encode of the captured KV with that key writes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvsnap.encoded.file import EncodedFile
from kvsnap.encoded.read import decode, parse_encoded
from kvsnap.encoded.stored import StoredTensors
from kvsnap.encoding.report import ErrorReport
from kvsnap.format import encoded as enc
from kvsnap.format.signing import KeyRing


@dataclass(frozen=True)
class KeptFp8:
    """An fp8 file to write as fp8: the file (checked), the tensors to store again around a
    new signature (``None``: write the file as it is), its recorded error and what the caller
    should be told."""

    encoded: EncodedFile
    stored: StoredTensors | None
    report: ErrorReport | None
    notes: tuple[str, ...]


def kept_fp8(encoded: EncodedFile, target: str, keys: KeyRing | None, threads: int) -> KeptFp8:
    """What writing the fp8 file ``encoded`` (its container parsed, unchecked) to ``target`` as
    fp8 keeps (see the module): checked whole (its signature with ``keys`` when it is signed;
    ``SnapshotCorruptError``, ``BadSignatureError`` when it does not pass), to be copied, or
    with ``keys`` and no signature of its own, its tensors to be signed."""
    signed = encoded.layout.encoding.get("signature") is not None
    checked = parse_encoded(encoded.data, encoded.file, keys if signed else None)
    with ThreadPoolExecutor(max(1, threads)) as executor:
        decode(checked, executor)
    kept = f"{encoded.file} is fp8 already: {target}"
    why = "(quantizing its decoded pages again would round them a second time)"
    if keys is None or signed:
        copy = "a copy of it, signed as it was" if signed else "a copy of it"
        note = f"{kept} is {copy}: its values, scales and recorded error unchanged {why}"
        return KeptFp8(checked, None, checked.error, (note,))
    note = (
        f"{kept} holds its values, scales and recorded error unchanged, signed with key "
        f"{keys.signing_key_id} {why}"
    )
    return KeptFp8(checked, _stored_tensors(checked), checked.error, (note,))


def _stored_tensors(encoded: EncodedFile) -> StoredTensors:
    """The tensors ``encoded`` stores but its page checks, in file order, as an encode of the
    same values holds them before it adds the checks (every one on the host)."""
    kinds = {str(name): str(kind) for name, kind in encoded.encoding["tensors"].items()}
    checks = tuple(f"{name}{suffix}" for name in encoded.layout.fp8_names() for suffix in _CHECKS)
    stored = StoredTensors(kinds=kinds)
    for tensor in encoded.layout.checksummed:
        if tensor.name not in checks:
            data = encoded.tensor(tensor.name)
            stored.items.append((tensor.name, tensor.dtype, tensor.shape, data))
    return stored


_CHECKS = (enc.PAGES_SUFFIX, enc.DIGESTS_SUFFIX)
