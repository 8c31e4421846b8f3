"""When a JSON output starts closing: once the budget left barely covers what is open and
what the grammar wants after it (a tool call's end tag)."""

from __future__ import annotations

import torch

from engine.grammar import GrammarVocab, JsonCloser

VOCAB = GrammarVocab([b'"', b"}", b"x", b"xyzw"], vocab_size=4)
BUDGET = 24  # a margin of 6 tokens


def steered(closer: JsonCloser, remaining: int) -> bool:
    logits = torch.zeros(VOCAB.size)
    closer.steer(logits, remaining, BUDGET)
    return bool(torch.isinf(logits).any())


def test_closing_starts_earlier_by_what_the_grammar_wants_after_the_json() -> None:
    plain, call = JsonCloser(VOCAB), JsonCloser(VOCAB, trailing=len(b"</tool_call>"))
    for closer in (plain, call):
        closer.state = closer.state.after(b'{"a": "x')  # owes a quote and a brace
    assert not steered(plain, 2 + 6 + 1) and steered(plain, 2 + 6)
    assert not steered(call, 2 + 12 + 6 + 1) and steered(call, 2 + 12 + 6)
    # Steered, only the short token that leaves least open may come next: the quote.
    logits = torch.zeros(VOCAB.size)
    call.steer(logits, 2 + 12 + 6, BUDGET)
    assert torch.isfinite(logits).tolist() == [True, False, False, False]
