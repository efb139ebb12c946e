"""An execution's tokens only grow: a chat call whose history is the previous call's plus
the assistant's answer plus new messages gets the previous prompt + exactly the generated
tokens (even where decoding and re-encoding them would give other tokens) + the template's
delta; tool calls and tool results continue the same way; an output that ended on a stop
string gets the template's whole closing; a harness that edits history, the reply or the
tools starts a new segment, counted by reason."""

from __future__ import annotations

import pytest

from services.router.tokenization import normalize_messages
from services.router.trajectory import ChatState, Trajectory, TrajectoryStore, chat_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def _turn(tok, store, messages, output, tools=(), reply=None):
    """Plans a call, 'generates' ``output``, records it; returns (prompt, break reason)."""
    norm = normalize_messages(messages)
    planned = chat_prompt(tok, store.get("x"), norm, list(tools))
    content, calls = reply if reply is not None else (tok.decode(output), [])
    chat = ChatState.of(norm, list(tools), content, calls)
    store.record("x", planned.token_ids, output, chat, planned.break_reason)
    return planned.token_ids, planned.break_reason


def test_continuation_keeps_generated_tokens(tok):
    store = TrajectoryStore()
    end = tok.stop_token_ids[0]
    m1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # "hello" as single characters: decoding and re-encoding would merge them differently.
    out1 = [t for ch in "hello" for t in tok.encode(ch)] + [end]
    assert tok.encode(tok.decode(out1)) != out1[:-1]
    p1, why1 = _turn(tok, store, m1, out1)
    assert why1 == "first" and p1 == tok.encode_chat(m1)
    m2 = m1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "the file says 7"}]
    p2, why2 = _turn(tok, store, m2, tok.encode("ok") + [end])
    assert why2 is None
    assert p2[: len(p1) + len(out1)] == p1 + out1
    assert p2[len(p1) + len(out1) :] == tok.encode(
        "\n<|im_start|>user\nthe file says 7<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(p2, skip_special_tokens=False) == tok.render(normalize_messages(m2), None, True)
    assert store.continued == 1 and not store.breaks and store.get("x").segment == 0


def test_tool_call_and_tool_result_continue(tok):
    store = TrajectoryStore()
    end = tok.stop_token_ids[0]
    m1 = [{"role": "user", "content": "find the secret"}]
    call_text = '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'
    out1 = tok.encode(call_text) + [end]
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
        }
    ]
    p1, _ = _turn(tok, store, m1, out1, TOOLS, reply=(None, calls))
    m2 = m1 + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "The secret number is 42."},
    ]
    p2, why = _turn(tok, store, m2, tok.encode("42") + [end], TOOLS)
    assert why is None and p2[: len(p1) + len(out1)] == p1 + out1
    assert tok.decode(p2[len(p1) + len(out1) :], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nThe secret number is 42.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_output_cut_by_a_stop_string_gets_the_whole_closing(tok):
    store = TrajectoryStore()
    m1 = [{"role": "user", "content": "think"}]
    out1 = tok.encode("Thought: read it\nObservation:")  # no stop token: a stop string ended it
    p1, _ = _turn(tok, store, m1, out1, reply=("Thought: read it", []))
    m2 = m1 + [
        {"role": "assistant", "content": "Thought: read it"},
        {"role": "user", "content": "Observation: 7"},
    ]
    p2, why = _turn(tok, store, m2, [5])
    assert why is None and p2[: len(p1) + len(out1)] == p1 + out1
    assert tok.decode(p2[len(p1) + len(out1) :], skip_special_tokens=False).startswith(
        "<|im_end|>\n<|im_start|>user"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m, t: ([{"role": "system", "content": "summary"}] + m[2:], t), "history_edited"),
        (lambda m, t: (m[:1] + [{"role": "assistant", "content": "edited"}] + m[2:], t), "reply_edited"),
        (lambda m, t: (m, []), "tools_changed"),
    ],
)
def test_changed_history_starts_a_counted_segment(tok, change, reason):
    store = TrajectoryStore()
    end = tok.stop_token_ids[0]
    m1 = [{"role": "user", "content": "hi"}]
    _turn(tok, store, m1, tok.encode("yes") + [end], TOOLS)
    m2, tools = change(
        m1 + [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "more"}], TOOLS
    )
    p2, why = _turn(tok, store, m2, [7], tools)
    assert why == reason and p2 == tok.encode_chat(m2, tools)
    assert store.breaks == {reason: 1} and store.get("x").segment == 1


def test_token_level_calls_continue_on_prefix():
    store = TrajectoryStore()
    store.record("x", [1, 2], [3])
    store.record("x", [1, 2, 3, 9], [4])
    store.record("x", [1, 2], [5])
    assert store.continued == 1 and store.breaks == {"prompt_differs": 1} and store.get("x").segment == 1
    store.forget("x")
    assert store.get("x") is None


def test_first_prompt_with_tools_is_what_vllms_server_renders(tok):
    """vLLM's OpenAI server renders chat prompts with the tokenizer's apply_chat_template
    (tools passed along, tool-call arguments as objects): the router's first prompt is the
    same token list."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "text"},
    ]
    planned = chat_prompt(tok, None, normalize_messages(messages), TOOLS)
    conversation = [dict(m) for m in messages]
    conversation[2] = {
        **messages[2],
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a"}}}
        ],
    }
    reference = tok.hf.apply_chat_template(
        conversation, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert planned.token_ids == list(reference)


def test_a_chat_state_survives_its_record_and_a_retry_continues_what_its_first_try_did(tok):
    """What another router rebuilds from a turn record (tokens + the encoded chat state)
    plans the same next prompt as the router that served the call; a retried call (same
    idempotency key) continues the trajectory its first try continued."""
    store = TrajectoryStore()
    end = tok.stop_token_ids[0]
    m1 = [{"role": "user", "content": "hi"}]
    out1 = [t for ch in "hello" for t in tok.encode(ch)] + [end]
    planned = chat_prompt(tok, None, normalize_messages(m1), [])
    chat = ChatState.of(normalize_messages(m1), [], "hello", [])
    assert ChatState.decode(chat.encode()) == chat and ChatState.decode("") is None
    here = store.record("x", planned.token_ids, out1, chat, planned.break_reason, "k1")
    rebuilt = Trajectory(here.tokens, here.prompt_len, 0, 1, ChatState.decode(chat.encode()))
    m2 = normalize_messages(
        [*m1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    )
    assert chat_prompt(tok, rebuilt, m2, []) == chat_prompt(tok, here, m2, [])
    assert chat_prompt(tok, rebuilt, m2, []).break_reason is None
    # Turn 1 (key k2); its retry plans from turn 0 and replaces it in the store.
    p2 = chat_prompt(tok, store.base("x", "k2"), m2, []).token_ids
    store.record("x", p2, tok.encode("ok") + [end], None, None, "k2")
    assert store.base("x", "k2") is not None and store.base("x", "k2").tokens == here.tokens
    retry = chat_prompt(tok, store.base("x", "k2"), m2, [])
    assert retry.token_ids == p2 and retry.break_reason is None
    store.record("x", retry.token_ids, tok.encode("no") + [end], None, None, "k2")
    assert store.retried == 1 and store.continued == 2 and not store.breaks
    assert store.get("x").turns == 2 and store.get("x").before.before is None
