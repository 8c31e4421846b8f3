"""vLLM's token filters, checked and made into token ids for the engine's sampler:
`allowed_token_ids` (only these may be drawn) and `bad_words` (words the output must not
write, as token sequences whose last token the sampler masks where the output ends with the
rest).

A bad word is tokenized as vLLM tokenizes it, so the same words ban the same tokens: its text
with leading spaces stripped, and with one space before it (the word in the middle of a
text) where that gives a different first token and as many tokens.
"""

from __future__ import annotations

from services.gateway.tokenizer import Tokenizer
from shared.errors import InvalidRequest

MAX_BAD_WORDS = 128  # vLLM's limits
MAX_BAD_WORD_TOKENS = 1024  # over all the words' sequences


def allowed_token_ids(token_ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    """The tokens a request may draw, sorted (empty: any)."""
    if token_ids is None:
        return ()
    if not token_ids:
        raise InvalidRequest("allowed_token_ids must name at least one token",
                             param="allowed_token_ids")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequest(f"allowed_token_ids must lie in [0, {vocab_size})",
                             param="allowed_token_ids")
    return tuple(sorted(set(token_ids)))


def bad_word_sequences(words: list[str] | None, tokenizer: Tokenizer
                       ) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (one or two per word)."""
    if not words:
        return ()
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words holds at most {MAX_BAD_WORDS} words",
                             param="bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise InvalidRequest("bad_words must not be empty or only spaces",
                                 param="bad_words")
        alone = tuple(tokenizer.encode(word.lstrip()))
        if not alone:
            raise InvalidRequest(f"bad word {word!r} has no tokens", param="bad_words")
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    if sum(map(len, sequences)) > MAX_BAD_WORD_TOKENS:
        raise InvalidRequest(f"bad_words come to more than {MAX_BAD_WORD_TOKENS} tokens",
                             param="bad_words")
    return tuple(sequences)
