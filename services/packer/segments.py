"""Trajectory segments: the unit the packer trains. One execution's consecutive turns form
one segment while each turn's prompt extends the previous turn's tokens (its prompt + its
output), which is how the router builds a token-consistent trajectory; a turn whose prompt
does not (the harness edited history, or a record is missing) starts the next segment, as
does a turn sampled at another temperature than the previous one (a segment is scored at one
temperature: ``PackedSequence.temperature``).

A segment is trained as one sequence: all its tokens once (the last turn's prompt + its
output), the loss mask on every member turn's generated tokens only (prompts, observations,
tool results masked), and each generated token's behaviour log-prob and policy version at
its position. Since each turn's prompt is a prefix of the segment, a causal LM predicts every
generated token from exactly the context it had when it was generated: the gradient equals
that of training each turn on its own (tests/unit/test_training_segments.py), for a fraction
of the tokens.

The rule, for anything that must mirror it (the simulator): per execution, turns sorted by
index; turn k+1 joins turn k's segment iff ``prompt[k+1][:len(prompt[k]) + len(output[k])]
== prompt[k] + output[k]`` and ``temperature[k+1] == temperature[k]``; a segment costs
``len(prompt[last]) + len(output[last])`` packed tokens and ``sum(loss_mask)`` of its
turns' outputs as loss tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.packer.model import Turn


def continues(prev: Turn, nxt: Turn) -> bool:
    """True when ``nxt``'s prompt is ``prev``'s prompt + output followed by more tokens, and
    ``nxt`` was sampled at ``prev``'s temperature (a segment never mixes temperatures)."""
    if nxt.temperature != prev.temperature:
        return False
    n, m = len(prev.prompt), len(prev.output)
    return len(nxt.prompt) >= n + m and nxt.prompt[:n] == prev.prompt and nxt.prompt[n : n + m] == prev.output


def split_segments(turns: Mapping[int, Turn]) -> list[tuple[int, ...]]:
    """An execution's turn indexes grouped into segments, in order."""
    out: list[list[int]] = []
    prev: Turn | None = None
    for index in sorted(turns):
        turn = turns[index]
        if prev is not None and continues(prev, turn):
            out[-1].append(index)
        else:
            out.append([index])
        prev = turn
    return [tuple(s) for s in out]


@dataclasses.dataclass(frozen=True)
class Segment:
    """The turns of one segment, first to last."""

    turns: tuple[Turn, ...]

    @property
    def last(self) -> Turn:
        return self.turns[-1]

    @property
    def tokens(self) -> int:
        """Packed tokens: every token of the segment once."""
        return len(self.last.prompt) + len(self.last.output)

    @property
    def loss_tokens(self) -> int:
        return sum(t.loss_tokens for t in self.turns)

    def oldest_version(self, fallback: int) -> int:
        return min(t.oldest_version(fallback) for t in self.turns)

    def arrays(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """(token ids, loss mask, behaviour log-probs, policy versions), aligned; mask,
        log-probs and versions are 0 outside generated tokens."""
        last = self.last
        ids = list(last.prompt) + list(last.output)
        n = len(ids)
        mask, logprobs, versions = [0] * n, [0.0] * n, [0] * n
        for t in self.turns:  # slice assignments: no per-token Python loop on the claim path
            start, k = len(t.prompt), len(t.mask)
            mask[start : start + k] = t.mask
            logprobs[start : start + k] = (
                t.logprobs
                if all(t.mask)
                else [lp if m else 0.0 for m, lp in zip(t.mask, t.logprobs, strict=True)]
            )
            if t.versions:
                versions[start : start + k] = t.versions
        return ids, mask, logprobs, versions


def per_turn(indexes: Sequence[int]) -> list[tuple[int, ...]]:
    """Each turn its own segment (WAL events written before segments existed)."""
    return [(i,) for i in sorted(indexes)]
