"""Tokenization happens once, from the model directory: a chat prompt is the chat template
applied once and tokenized without extra special tokens; streamed text deltas, joined, equal
the decoded output even when a character spans several tokens; malformed messages are 400s."""

from __future__ import annotations

import pytest

from gyre.errors import InvalidArgument
from services.router.tokenization import normalize_messages


def test_chat_template_applied_once(tok):
    ids = tok.encode_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    )
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(text)
    assert ids.count(tok.encode("<|im_start|>")[0]) == 3
    assert tok.encode("<|im_end|>")[0] in tok.stop_token_ids


def test_streamed_deltas_join_to_decoded_text(tok):
    ids = tok.encode("naïve 日本語 text ✓ done")
    for step in (1, 2, 3):
        d = tok.detokenizer()
        parts = [d.push(ids[i : i + step]) for i in range(0, len(ids), step)]
        assert "".join(parts) + d.flush() == tok.decode(ids)
        assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image"}]}],
        ["x"],
    ],
)
def test_malformed_messages(messages):
    with pytest.raises(InvalidArgument):
        normalize_messages(messages)
