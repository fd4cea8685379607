"""The built-in model: a tiny Llama with fixed weights, so ``kvsnap capture`` works offline.

``load_model(None)`` builds a 4-layer Llama (hidden 128, 4 attention heads sharing 2 KV heads,
head dim 32) from a config, with weights derived from a fixed seed through SHAKE-256, and pairs
it with :class:`ByteTokenizer` (UTF-8 bytes are the token ids). Nothing is downloaded and no file
is read: the model is identical on every machine, torch and numpy version, because its weights
come from a hash function rather than a library's random number generator.

``load_model("path/or/hub-id")`` loads a real transformers model from a local directory or from
the local Hugging Face cache (never from the network) and wraps it in the same
:class:`LoadedModel`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap.engines.weights import loaded_model_fingerprint
from kvsnap.errors import ModelLoadError

#: The id recorded in snapshot metadata for the built-in model.
DEFAULT_MODEL_ID = "kvsnap/tiny-llama"
#: Bumped whenever the built-in model's config or weight derivation changes.
DEFAULT_MODEL_REVISION = "v1"
#: Seed of the built-in model's weights (an input to SHAKE-256, not to a torch generator).
DEFAULT_MODEL_SEED = b"kvsnap/tiny-llama/v1"

#: The built-in model's shape: GQA with two query heads per KV head.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 259,  # 256 byte ids + BOS, EOS, PAD
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}


class ByteTokenizer:
    """A tokenizer whose ids are the bytes of the UTF-8 text, plus three special ids.

    ``encode`` maps text to ``[BOS] + list(text.encode("utf-8"))``; ``decode`` drops special and
    out-of-range ids and decodes the remaining bytes, replacing invalid UTF-8 sequences (a
    random model happily emits them) with U+FFFD.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``: BOS (unless ``add_bos`` is false), then one id per UTF-8 byte."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: byte ids decoded as UTF-8, every other id skipped."""
        data = bytes(int(token) for token in ids if 0 <= int(token) < 256)
        return data.decode("utf-8", errors="replace")


@dataclass
class LoadedModel:
    """A causal LM ready for kvsnap: the model, its tokenizer and what snapshots record about it.

    ``fingerprint`` is :func:`kvsnap.format.model_fingerprint_with_weights` of the model's
    config and weights (:func:`kvsnap.engines.weights.module_weights_fingerprint`); a snapshot
    restores into a model only when the fingerprints match (or the user forces it).
    ``notes`` say what a user should know about how it was loaded (a model without a working
    tokenizer, given byte ids instead).
    """

    model: torch.nn.Module
    tokenizer: Any
    model_id: str
    model_revision: str | None
    fingerprint: str
    notes: list[str] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model expects them (with the tokenizer's special tokens)."""
        return [int(token) for token in self.tokenizer.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids ``ids``, special tokens skipped."""
        return decode_with(self.tokenizer, ids)

    def encode_follow_up(self, text: str) -> list[int]:
        """Token ids of ``text`` to append after a prefix: no BOS or other special token."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text, add_bos=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [int(token) for token in ids]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def load_model(
    model: str | None = None, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    """Load the model kvsnap captures from and restores into.

    ``None`` builds the built-in tiny Llama (:func:`build_default_model`). A string names a local
    transformers model directory or a hub id already in the local Hugging Face cache; it is
    loaded with ``local_files_only=True`` (never downloaded), with its own tokenizer when it has
    one and :class:`ByteTokenizer` otherwise. Raises :class:`ModelLoadError` with a one-line
    message when the model cannot be found or loaded.
    """
    if model is None:
        built = build_default_model(dtype=dtype, device=device)
        return LoadedModel(
            model=built,
            tokenizer=ByteTokenizer(),
            model_id=DEFAULT_MODEL_ID,
            model_revision=DEFAULT_MODEL_REVISION,
            fingerprint=loaded_model_fingerprint(built),
        )
    return _load_pretrained(model, dtype=dtype, device=device)


def build_default_model(
    *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.nn.Module:
    """The built-in tiny Llama with its fixed weights, in eval mode, on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_LLAMA_CONFIG)
    # What save_pretrained records; set up front so the fingerprint is the same before and after.
    config.architectures = ["LlamaForCausalLM"]
    # SDPA is what a fresh model gets on CPU and CUDA; naming it keeps runs comparable.
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    # Every weight is overwritten: transformers' own init draws from torch's global generator.
    state = {
        name: torch.from_numpy(_seeded_weight(name, tuple(param.shape)))
        for name, param in model.state_dict().items()
    }
    model.load_state_dict(state, strict=True)
    # Greedy decoding by default, and no EOS stop: a random model would end runs at random.
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = TINY_LLAMA_CONFIG["pad_token_id"]
    return model.to(device=device, dtype=dtype).eval()


def _seeded_weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic fp32 weights for parameter ``name``: uniform, scaled by the tensor's role.

    RMSNorm gains are ones. Embeddings have unit variance; every projection has variance
    ``1 / fan_in``, which keeps activations of order one through the layers, so greedy
    generation is varied rather than stuck on one token.
    """
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    count = int(np.prod(shape))
    digest = hashlib.shake_256(DEFAULT_MODEL_SEED + b"/" + name.encode()).digest(4 * count)
    words = np.frombuffer(digest, dtype="<u4").astype(np.float64)
    uniform = words / 2.0**31 - 1.0  # in [-1, 1): variance 1/3
    std = 1.0 if "embed_tokens" in name else 1.0 / np.sqrt(shape[-1])
    return (uniform * np.sqrt(3.0) * std).astype(np.float32).reshape(shape)


def decode_with(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of token ids ``ids`` by ``tokenizer`` (a :class:`ByteTokenizer` or a
    transformers tokenizer), special tokens skipped."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return str(tokenizer.decode([int(token) for token in ids], skip_special_tokens=True))


#: Plain text every working tokenizer turns into ordinary tokens, and back.
_PROBE = "Hello, world: the kvsnap tokenizer check 2026."


def tokenizer_problem(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` does not work (transformers 5 returns an empty tokenizer for a model
    directory without tokenizer files rather than failing: one that encodes plain text to
    nothing, or to the unknown token only), or ``None``."""
    try:
        ids = [int(token) for token in tokenizer.encode(_PROBE, add_special_tokens=False)]
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        return f"its tokenizer cannot encode text ({type(error).__name__})"
    if not ids:
        return "its tokenizer encodes text to no tokens"
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and all(token == unknown for token in ids):
        return f"its tokenizer encodes plain text to the unknown token {tokenizer.unk_token!r}"
    if not decode_with(tokenizer, ids).strip():
        return "its tokenizer decodes what it encodes to nothing"
    return None


def prompt_problem(loaded: LoadedModel, prompt: str, ids: Sequence[int]) -> str | None:
    """Why the token ids ``ids`` that ``loaded`` encoded ``prompt`` into are not that prompt,
    or ``None``: no ordinary token at all, only unknown tokens, or ids that decode to less
    than half of the prompt's characters (a tokenizer that silently drops text)."""
    tokenizer = loaded.tokenizer
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if isinstance(tokenizer, ByteTokenizer):
        special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    unknown = getattr(tokenizer, "unk_token_id", None)
    special.discard(unknown)  # transformers counts the unknown token as special: it is not
    ordinary = [int(token) for token in ids if int(token) not in special]
    name = f"model {loaded.model_id!r}"
    if not ordinary:
        return f"encodes to no tokens with the tokenizer of {name}"
    if unknown is not None and all(token == unknown for token in ordinary):
        return f"encodes to unknown tokens only ({len(ordinary)}) with the tokenizer of {name}"
    written = sum(not character.isspace() for character in prompt)
    decoded = sum(not character.isspace() for character in loaded.decode(ordinary))
    if decoded * 2 < written:
        return (
            f"encodes to {len(ordinary)} token(s) that decode to {decoded} of its {written} "
            f"characters with the tokenizer of {name}"
        )
    return None


def load_tokenizer(name: str, *, vocab_size: int) -> tuple[Any, str | None]:
    """The tokenizer of the local model ``name``, and a note when it is not the model's own:
    a model without a working tokenizer (no tokenizer files, or files that encode text to
    nothing or to unknown tokens) gets :class:`ByteTokenizer`, said in the note, when its
    vocabulary holds byte ids; otherwise :class:`ModelLoadError`."""
    from transformers import AutoTokenizer

    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        reason: str | None = "it has no tokenizer files"
    else:
        reason = tokenizer_problem(tokenizer)
        if reason is None:
            return tokenizer, None
    if vocab_size < ByteTokenizer.vocab_size:
        raise ModelLoadError(
            f"model {name!r} has no working tokenizer ({reason}) and a vocabulary of "
            f"{vocab_size} ids, too small for byte ids (needs {ByteTokenizer.vocab_size}): add "
            "its tokenizer files to the model directory"
        )
    return ByteTokenizer(), (
        f"model {name!r} has no working tokenizer ({reason}): text is encoded as UTF-8 byte "
        "ids (add its tokenizer files to the model directory to use its own)"
    )


def _load_pretrained(name: str, *, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(name).is_dir() and _names_a_directory(name):
        raise ModelLoadError(f"model directory {name} does not exist")
    where = "directory" if Path(name).is_dir() else "hub id (local cache only)"
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as error:
        first_line = (
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise ModelLoadError(
            f"cannot load model {name!r} ({where}) offline: {first_line}"
        ) from error
    text_config = getattr(config, "get_text_config", lambda: config)()
    tokenizer, note = load_tokenizer(name, vocab_size=int(text_config.vocab_size))
    revision = getattr(config, "_commit_hash", None)
    return LoadedModel(
        model=model.to(device).eval(),
        tokenizer=tokenizer,
        model_id=getattr(config, "name_or_path", None) or name,
        model_revision=revision,
        fingerprint=loaded_model_fingerprint(model),
        notes=[] if note is None else [note],
    )


def _names_a_directory(name: str) -> bool:
    """Whether ``name`` can only mean a local directory, never a hub id (``org/model``): it is
    absolute, starts with ``.`` or ``~``, has more than one ``/`` or a backslash, or its first
    component is an existing local directory."""
    if name.startswith((".", "~", "/")) or "\\" in name or name.count("/") > 1:
        return True
    first = name.split("/", 1)[0]
    return "/" in name and Path(first).is_dir()
