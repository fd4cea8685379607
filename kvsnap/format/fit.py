"""Whether a snapshot fits a target: the one place the restore contract's checks live.

The KV geometry (layers, KV heads x head dim or latent, tokens per block, dtype, and each
layer's attention type: sliding-window KV is not full-attention KV) must match, and the model
fingerprint must too unless forced. Layout, TP size and paged/dynamic caches may differ: they
are converted through the canonical page.
"""

from __future__ import annotations

from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.format import SnapshotMetadata
from kvsnap.layout import KVGeometry

_GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "latent_dim", "block_size", "dtype")


def geometry_differences(snapshot: KVGeometry, target: KVGeometry) -> list[str]:
    """What differs between two geometries, one ``"field: snapshot X, target Y"`` each."""
    if snapshot == target:  # every field equal (one comparison): nothing to name
        return []
    differences = [
        f"{name}: snapshot {getattr(snapshot, name)!r}, target {getattr(target, name)!r}"
        for name in _GEOMETRY_FIELDS
        if getattr(snapshot, name) != getattr(target, name)
    ]
    if not differences and snapshot.attention_types != target.attention_types:
        layers = [
            index
            for index, (mine, theirs) in enumerate(
                zip(snapshot.attention_types, target.attention_types, strict=True)
            )
            if mine != theirs
        ]
        first = layers[0]
        differences.append(
            f"attention type of layer {first}: snapshot {snapshot.attention_types[first]!r}, "
            f"target {target.attention_types[first]!r} ({len(layers)} layer(s) differ)"
        )
    return differences


def check_fits(
    metadata: SnapshotMetadata,
    target: KVGeometry,
    *,
    path: str,
    model_fingerprint: str | None = None,
    force: bool = False,
) -> None:
    """Refuse (:class:`IncompatibleSnapshotError`, naming both sides) a snapshot that does not
    fit ``target``. Without ``model_fingerprint`` only the geometry is checked."""
    mine = metadata.geometry
    differences = geometry_differences(mine, target)
    if differences:
        raise IncompatibleSnapshotError(
            f"{path} does not fit the target cache ({'; '.join(differences)}). "
            f"Snapshot: {mine.describe()}; target: {target.describe()}",
            snapshot=mine.describe(),
            target=target.describe(),
        )
    stored = metadata.source.model_fingerprint
    if model_fingerprint is not None and not force and stored and stored != model_fingerprint:
        raise IncompatibleSnapshotError(
            f"{path} was captured from model {metadata.source.model_id!r} "
            f"(fingerprint {stored[:16]}), the target's fingerprint is "
            f"{model_fingerprint[:16]} (other weights or config); a forced restore skips this "
            "check",
            snapshot=metadata.source.model_id,
            target=model_fingerprint[:16],
        )
