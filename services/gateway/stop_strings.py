"""Stop-string detection over streamed text.

Text that could be the start of a stop string is held back until it is known not to be one,
so a client never sees a partial stop string. The output ends before the match, or with it
(`include_stop`: vLLM's `include_stop_str_in_output`).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str], *, include_stop: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self._held = ""
        self.is_stopped = False

    def push(self, text: str) -> str:
        """Text that is safe to emit now. After a match, `is_stopped` is set and the text up
        to the stop string (with it, if included) has been returned; of several matches the
        earliest wins, and of those starting there the first listed."""
        if self.is_stopped:
            return ""
        if not self._stop:
            return text
        buffer = self._held + text
        found = [(i, n) for n, i in enumerate(buffer.find(s) for s in self._stop) if i >= 0]
        if found:
            cut, which = min(found)
            self.is_stopped = True
            self._held = ""
            return buffer[:cut + len(self._stop[which])] if self._include_stop else buffer[:cut]
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of the output."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
