"""Deterministic synthetic KV caches and the reproducible snapshots written from them.

:func:`generate` builds a real CPU cache of any layout kvsnap supports (through the
:mod:`kvsnap.layout` constructors), fills it with synthetic KV and writes it with
:func:`kvsnap.snapshot.capture` — the real capture path — with ``reproducible=True``. For the same
arguments the file is byte-identical on every machine: every random number comes from one
``torch.Generator`` on the CPU seeded with ``seed``, drawn in a fixed order, computed in float64
and cast to the KV dtype only at the end.

What the values model (see docs/fixtures.md):

* **keys**: per (layer, head, channel) a mean and a scale, a few large-magnitude outlier channel
  pairs per head among the lowest-frequency rotary pairs (where real models' key outliers sit),
  then the rotary embedding (base 10000, rotate-half pairing as in Llama/NeoX) at the token's
  absolute position;
* **values**: N(0, 0.5²), no structure;
* **MLA latents**: a compressed part with per-channel scales and a few outlier channels, followed
  by a rotary part (the last ``latent_dim // 9`` dims, rounded down to even, at least 2;
  576 → 512 + 64 as in DeepSeek-V3) with interleaved-pair RoPE as DeepSeek uses;
* **tokens**: uniform ids in ``[0, vocab_size)``; with ``shared_prefix_tokens`` every sequence
  starts with the same tokens *and the same KV* for them, and the full blocks of that prefix are
  one set of physical blocks shared by all sequences (as with vLLM's prefix caching), so
  capture's prefix deduplication stores them once;
* **the cache**: physical block ids are a random permutation, with spare blocks (not part of any
  sequence) filled with NaN, so a capture that reads a wrong block shows up; token slots after a
  sequence's end in its last block are zero.

Attention type ``"sliding"`` alternates sliding-window and full layers (sliding first, as in
Gemma 2); the type is recorded per layer in the snapshot and does not change the values.

The modules: ``spec`` (:class:`SyntheticSpec`), ``values`` (:func:`synthesize`, RoPE),
``build`` (:func:`build_cache`, :func:`generate`).
"""

from kvsnap.testing.synthetic.build import (
    SyntheticCache,
    build_cache,
    generate,
    source_info,
    write_spec,
)
from kvsnap.testing.synthetic.spec import (
    ATTENTIONS,
    DEFAULT_VOCAB_SIZE,
    GENERATOR_VERSION,
    LAYOUTS,
    OUTLIER_MAGNITUDE,
    ROPE_BASE,
    SYNTHETIC_ENGINE,
    SYNTHETIC_MODEL_ID,
    VALUE_STD,
    SyntheticSpec,
    make_spec,
)
from kvsnap.testing.synthetic.values import SyntheticSequence, apply_rope, synthesize

__all__ = [
    "ATTENTIONS",
    "DEFAULT_VOCAB_SIZE",
    "GENERATOR_VERSION",
    "LAYOUTS",
    "OUTLIER_MAGNITUDE",
    "ROPE_BASE",
    "SYNTHETIC_ENGINE",
    "SYNTHETIC_MODEL_ID",
    "VALUE_STD",
    "SyntheticCache",
    "SyntheticSequence",
    "SyntheticSpec",
    "apply_rope",
    "build_cache",
    "generate",
    "make_spec",
    "source_info",
    "synthesize",
    "write_spec",
]
