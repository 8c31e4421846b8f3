"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request's `SamplingParams.grammar` (a `GrammarSpec`: any JSON, a JSON schema, or an EBNF
grammar) becomes a matcher per sequence: before each token is sampled its bitmask leaves only
the tokens the grammar allows, and each sampled token advances it. The matcher lives with the
sequence; it never crosses a process: a decode worker rebuilds it from the output tokens that
came with the request (prefill's first token, or a continuation's tail). Grammars compile
once per spec and worker (`Grammars` keeps the last `MAX_COMPILED`).

Every grammar's output stays valid UTF-8: xgrammar's character classes admit the UTF-8
encoding of a surrogate (ED A0..BF xx), which no decoder accepts (`GrammarVocab`). JSON
outputs get two more guards, so that even a model with random weights returns JSON that
parses: no token with a control byte (xgrammar's strings admit some that JSON forbids
unescaped), and, once the token budget barely covers closing what is open (`JsonCloser`),
the allowed token that leaves the least to close.

xgrammar (and the transformers tokenizer it reads the vocabulary through) is imported on
first use: a worker that never sees a structured request never pays for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import InvalidRequest
from shared.json_state import JsonState
from shared.messages import GrammarSpec

if TYPE_CHECKING:
    import xgrammar


def _literal(text: str) -> xgrammar.Grammar | None:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") if text else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # xgrammar prefixes "[time] path:line: "; keep what it says.
    return text[0].split(": ", 1)[-1] if text else type(exc).__name__


MAX_COMPILED = 256


class Grammars:
    """Compiled grammars and matchers for one model's vocabulary."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._vocab: GrammarVocab | None = None
        self._compiled: dict[GrammarSpec, xgrammar.CompiledGrammar] = {}  # oldest first
        self._lock = threading.Lock()
        self._flights: dict[GrammarSpec, threading.Lock] = {}  # specs being compiled

    @property
    def compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(
                    tokenizer_file=str(self.model_dir / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
                self._vocab = GrammarVocab(info.decoded_vocab, self.vocab_size)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The spec's grammar, compiled the first time it is seen (from the event loop's
        thread pool, via the engine's `prepare`), then cached. Callers asking for a spec
        being compiled wait for that compile (a burst of requests with one schema compiles
        it once: each compile holds the GIL for stretches and would starve the loop)."""
        with self._lock:
            compiled = self._compiled.get(spec)
            flight = self._flights.setdefault(spec, threading.Lock())
        if compiled is not None:
            return compiled
        with flight:
            with self._lock:
                compiled = self._compiled.get(spec)
            if compiled is None:
                try:
                    compiled = self._compile(spec)
                except BaseException:
                    with self._lock:
                        self._flights.pop(spec, None)
                    raise
                with self._lock:
                    if len(self._compiled) >= MAX_COMPILED:
                        del self._compiled[next(iter(self._compiled))]
                    self._compiled[spec] = compiled
                    self._flights.pop(spec, None)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        import xgrammar as xgr

        compiler = self.compiler
        try:
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.source)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "json_object":  # any object, compact (no runaway whitespace)
                grammar = xgr.Grammar.from_json_schema('{"type": "object"}',
                                                       any_whitespace=False, strict_mode=False)
            else:
                grammar = xgr.Grammar.from_json_schema(spec.source, any_whitespace=False,
                                                       strict_mode=True)
            if spec.begin or spec.end:
                grammar = xgr.Grammar.concat(*(
                    part for part in (_literal(spec.begin), grammar, _literal(spec.end))
                    if part is not None))
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"the {spec.kind} cannot be served: {_first_line(exc)}",
                                 param="response_format") from exc

    def matcher(self, spec: GrammarSpec, accepted: Sequence[int] = ()) -> Matcher:
        """A matcher at the start of the output, advanced over `accepted` output tokens."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        vocab = self._vocab
        assert vocab is not None  # read with the compiler
        closer = JsonCloser(vocab, trailing=len(spec.end.encode())) \
            if spec.kind in ("json_object", "json_schema") else None
        matcher = Matcher(xgr.GrammarMatcher(compiled), vocab, closer)
        for token_id in accepted:
            matcher.accept(token_id)
        return matcher


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, vocab: GrammarVocab, closer: JsonCloser | None) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._vocab = vocab
        self._bitmask = xgr.allocate_token_bitmask(1, vocab.size)
        self._closer = closer
        self._ends_with_ed = False  # the output so far ends with a lone ED lead byte

    def mask(self, logits: torch.Tensor, remaining: int, budget: int) -> None:
        """Leave, in one row of logits, only the tokens the grammar allows next; with
        `remaining` of `budget` output tokens left (this one included)."""
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.unsqueeze(0)
        xgr.apply_token_bitmask_inplace(row, self._bitmask.to(logits.device),
                                        vocab_size=self._vocab.size)
        self._vocab.forbid_surrogates(logits, after_ed=self._ends_with_ed)
        if self._closer is not None:
            self._closer.steer(logits, remaining, budget)

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise InvalidRequest(f"token {token_id} breaks the request's grammar")
        token_bytes = self._vocab.token_bytes[token_id]
        if token_bytes:
            self._ends_with_ed = token_bytes[-1] == _SURROGATE_LEAD
        if self._closer is not None:
            self._closer.advance(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())


_SURROGATE_LEAD = 0xED  # then A0..BF: U+D800..DFFF, which UTF-8 may not encode
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class GrammarVocab:
    """Each token's bytes, and the tokens no grammar may let through:
    - those that would write a surrogate's UTF-8 encoding, which xgrammar admits and no
      decoder does (each of its bytes decodes to U+FFFD: three characters where the grammar
      counted one, breaking a schema's `maxLength`, and text no one asked for). A byte-level
      vocabulary has a token for every byte, so a surrogate can also be written across
      tokens: after a token that ends with the lead byte ED, one starting with A0..BF;
    - for JSON: those with a control byte (never allowed), and the short ones that are
      closing candidates."""

    MAX_CLOSING_BYTES = 3

    def __init__(self, decoded: Sequence[bytes], vocab_size: int) -> None:
        self.size = vocab_size
        self.token_bytes = list(decoded) + [b""] * (vocab_size - len(decoded))
        self.surrogates = _ids(_SURROGATE.search(b) for b in self.token_bytes)
        self.surrogate_tails = _ids(b[:1] and 0xA0 <= b[0] <= 0xBF for b in self.token_bytes)
        self.banned = _ids(any(c < 0x20 for c in b) for b in self.token_bytes)
        self.short = _ids(0 < len(b) <= self.MAX_CLOSING_BYTES and not any(c < 0x20 for c in b)
                          for b in self.token_bytes)

    def forbid_surrogates(self, logits: torch.Tensor, *, after_ed: bool) -> None:
        """Mask, in one row of logits, the tokens that would write a surrogate next."""
        for ids in (self.surrogates, self.surrogate_tails) if after_ed else (self.surrogates,):
            if len(ids):
                logits[ids.to(logits.device)] = float("-inf")


def _ids(flags: Iterable[object]) -> torch.Tensor:
    """The token ids whose flag is true."""
    return torch.tensor([i for i, flag in enumerate(flags) if flag], dtype=torch.long)


class JsonCloser:
    """Tracks how much of a JSON text is left open, and when the token budget barely covers
    closing it, steers to the allowed token that leaves the least open.

    The estimate (closing characters still owed: a quote for an open string, a value for a
    pending key or element, a bracket per open container; then what the grammar wants after
    the JSON, `trailing`: a tool call's end tag) is a lower bound; the margin, a quarter of
    the budget, covers what a schema adds (required keys still to write)."""

    MARGIN = 6
    MARGIN_SHARE = 4  # of the budget

    def __init__(self, vocab: GrammarVocab, trailing: int = 0) -> None:
        self.vocab = vocab
        self.state = JsonState()
        self.trailing = trailing

    def advance(self, token_id: int) -> None:
        self.state = self.state.after(self.vocab.token_bytes[token_id])

    def steer(self, logits: torch.Tensor, remaining: int, budget: int) -> None:
        vocab = self.vocab
        if len(vocab.banned):
            logits[vocab.banned.to(logits.device)] = float("-inf")
        if remaining > (self.state.owed() + self.trailing
                        + max(self.MARGIN, budget // self.MARGIN_SHARE)):
            return
        candidates = vocab.short.to(logits.device)
        allowed = candidates[torch.isfinite(logits[candidates])]
        if not len(allowed):
            return  # only long tokens or stop tokens left: the grammar decides
        ids = allowed.tolist()
        # Least left open; then a structural token over one more digit or letter of a
        # literal (which could go on and on).
        owed = [(self.state.after(vocab.token_bytes[i]).owed(),
                 not any(c in _STRUCTURAL for c in vocab.token_bytes[i])) for i in ids]
        best = min(owed)
        keep = torch.tensor([i for i, o in zip(ids, owed, strict=True) if o == best],
                            dtype=torch.long, device=logits.device)
        kept = logits[keep]
        logits.fill_(float("-inf"))
        logits[keep] = kept


_STRUCTURAL = frozenset(b'"{}[],:')


def json_schema_spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", source=json.dumps(schema, sort_keys=True))
