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

    def decode(self, token_ids: list[int]) -> str: ...

    def detokenizer(self) -> Detokenizer: ...


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

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer()


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if t < 256))

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
        self._bos = _token_text(config.get("bos_token"))
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
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def detokenizer(self) -> Detokenizer:
        return _IncrementalDetokenizer(self)


class _IncrementalDetokenizer:
    """Decodes a sliding window of ids and emits only text that is complete (no trailing
    replacement character), as Hugging Face's streamers do; linear in the output length."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._emit(is_final=False)

    def flush(self) -> str:
        return self._emit(is_final=True)

    def _emit(self, *, is_final: bool) -> str:
        decode = self._tokenizer.decode
        seen = decode(self._ids[self._prefix:self._read])
        text = decode(self._ids[self._prefix:])
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
