"""The gateway's tokenizer interface and a simple deterministic byte tokenizer.

Tokenization and detokenization happen only in the gateway. Real Hugging Face tokenizers
implement the same `Tokenizer` protocol.
"""

from __future__ import annotations

import codecs
from typing import Protocol


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

    def encode(self, text: str) -> list[int]: ...

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

    def encode(self, text: str) -> list[int]:
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
