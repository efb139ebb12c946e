"""A call's output text as it streams, and stop strings of any length, matched the way
vLLM's detokenizer matches them (``vllm/v1/engine/detokenizer.py``).

Each new token is detokenized incrementally; after a chunk, the text it added (plus the
``len(stop) - 1`` characters before it) is searched for every stop string, the one that
completes earliest wins. On a match the tokens after the one that completed the stop string
are dropped (so the recorded tokens and the text end at the same place), the text is cut
before the stop string (after it with ``include_stop_str_in_output``), and the call ends
with finish reason ``stop``. While a call runs, the last ``len(longest stop) - 1``
characters are held back (a stop string may be forming) unless the stop string is to be
included anyway.

Why not call vLLM's ``check_stop_strings``: importing it pulls in vLLM and torch (seconds,
hundreds of MiB) into the router for a 30-line function; ``tests/unit/test_router_stops.py``
checks this copy against vLLM's on the same inputs.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Sequence

from gyre.errors import InvalidArgument
from services.router.tokenization import Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """(matched stop string, length to cut the text to or -1) or None; vLLM's semantics."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for s in stop:
        index = output_text.find(s, 1 - new_char_count - len(s))
        if index == -1:
            continue
        end = index + len(s)
        if end < best_end:
            best, best_index, best_end = s, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index


def parse_stop(stop: object) -> list[str]:
    """The request's ``stop`` field: a string or a list of strings (empty strings ignored)."""
    if stop is None or stop == "" or stop == []:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidArgument("stop must be a string or a list of strings")
    items = [s for s in items if s]
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise InvalidArgument(
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters"
        )
    return list(dict.fromkeys(items))


class OutputText:
    """Detokenizes one call's output and applies its stop strings; see the module docstring."""

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop_str_in_output: bool = False
    ) -> None:
        self._detok = tokenizer.detokenizer()
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if self.stop and not self.include else 0
        self.text = ""
        self._sent = 0
        self.stop_reason: str | None = None

    def push(self, ids: Sequence[int]) -> int:
        """Adds generated tokens; returns how many of them are kept (fewer than ``len(ids)``
        only when a stop string completed: the rest come after it and are dropped)."""
        if not ids or self.stop_reason is not None:
            return 0 if self.stop_reason is not None else len(ids)
        offsets = [len(self.text)]
        for tok in ids:
            self.text += self._detok.push([tok])
            offsets.append(len(self.text))
        if not self.stop:
            return len(ids)
        found = check_stop_strings(self.text, len(self.text) - offsets[0], self.stop, self.include)
        if found is None:
            return len(ids)
        stop, cut = found
        end = len(self.text) if cut == -1 else cut
        if not self.include:
            end += len(stop)
        kept = bisect.bisect_left(offsets, end, lo=1)
        if cut != -1:
            self.text = self.text[:cut]
        self.stop_reason = stop
        return kept

    def take(self, finished: bool) -> str:
        """The text not handed out yet, less what is held back while the call runs."""
        if finished and self.stop_reason is None:
            self.text += self._detok.flush()
        hold = 0 if finished else self._hold
        upto = max(len(self.text) - hold, self._sent)
        out = self.text[self._sent : upto]
        self._sent = upto
        return out
