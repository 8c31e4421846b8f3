"""The gateway's tokenizer interface and a simple deterministic byte tokenizer.

Tokenization and detokenization happen only in the gateway. Real Hugging Face tokenizers
implement the same `Tokenizer` protocol.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol

from shared.errors import ConfigError


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str:
        """Text made complete by these tokens (partial characters are held back)."""

    def flush(self) -> str:
        """Whatever is held back, at the end of the output."""


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's own template
        (a BOS for Llama): on for raw completions, off for chat (the template has them)."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def detokenizer(self, *, skip_special_tokens: bool = True) -> Detokenizer: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a part of a character, for some)."""


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus `<|bos|>` = 256 and `<|eos|>` = 257."""

    BOS_ID = 256
    EOS_ID = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_token(self) -> str:
        return "<|bos|>"

    @property
    def eos_token(self) -> str:
        return "<|eos|>"

    @property
    def eos_token_id(self) -> int | None:
        return self.EOS_ID

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return _ByteDetokenizer(skip_special_tokens).push(token_ids) or ""

    def detokenizer(self, *, skip_special_tokens: bool = True) -> Detokenizer:
        return _ByteDetokenizer(skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        return (self.bos_token if token_id == self.BOS_ID else self.eos_token).encode()


class _ByteDetokenizer:
    SPECIAL = {ByteTokenizer.BOS_ID: b"<|bos|>", ByteTokenizer.EOS_ID: b"<|eos|>"}

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_special_tokens

    def push(self, token_ids: list[int]) -> str:
        data = b"".join(bytes([t]) if t < 256 else b"" if self._skip
                        else self.SPECIAL.get(t, b"") for t in token_ids)
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HfTokenizer:
    """A Hugging Face `tokenizer.json` (via `tokenizers`) with its `tokenizer_config.json`."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
        except (OSError, ValueError, Exception) as exc:
            raise ConfigError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
        self._encode_batch = getattr(self._tokenizer, "encode_batch_fast",  # tokenizers 0.21
                                     self._tokenizer.encode_batch)
        self._bos = _token_text(config.get("bos_token"))
        # Byte-level BPE spells bytes as printable characters (GPT-2's table): undo it.
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._eos = _token_text(config.get("eos_token"))
        self.chat_template = _chat_template(config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str:
        return self._bos

    @property
    def eos_token(self) -> str:
        return self._eos

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.token_to_id(self._eos) if self._eos else None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # The batch call lets go of the GIL while it runs (`encode` holds it: seconds for a
        # long prompt); its fast form skips the offsets, which are never read.
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = True) -> Detokenizer:
        return _IncrementalDetokenizer(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id) or ""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()


class _IncrementalDetokenizer:
    """Decodes a sliding window of ids and emits only text that is complete (no trailing
    replacement character), as Hugging Face's streamers do; linear in the output length."""

    def __init__(self, tokenizer: HfTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._emit(is_final=False)

    def flush(self) -> str:
        return self._emit(is_final=True)

    def _emit(self, *, is_final: bool) -> str:
        decode, skip = self._tokenizer.decode, self._skip
        seen = decode(self._ids[self._prefix:self._read], skip_special_tokens=skip)
        text = decode(self._ids[self._prefix:], skip_special_tokens=skip)
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not is_final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]


def _token_text(token: object) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return str(token or "")


def _chat_template(template: object) -> str | None:
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(extra)}}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
