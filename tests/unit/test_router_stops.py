"""Stop strings of any length, as vLLM handles them: the router's matcher agrees with vLLM's
own ``check_stop_strings`` on random texts; a stop string that spans several tokens ends
the output at the token that completed it (tokens after it dropped, text cut before it, or
after it with include_stop_str_in_output); text that may be the start of a stop string is
held back while the call runs; the earliest-completing stop string wins."""

from __future__ import annotations

import random

import pytest

from gyre.errors import InvalidArgument
from services.router.stops import OutputText, check_stop_strings, parse_stop


def test_matches_vllm_check_stop_strings():
    vllm_detok = pytest.importorskip("vllm.v1.engine.detokenizer")
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("ab\nO:") for _ in range(rng.randrange(0, 30)))
        new = rng.randrange(0, len(text) + 1)
        stops = [
            "".join(rng.choice("ab\nO:") for _ in range(rng.randrange(1, 5)))
            for _ in range(rng.randrange(1, 4))
        ]
        for include in (False, True):
            assert check_stop_strings(text, new, stops, include) == vllm_detok.check_stop_strings(
                text, new, stops, include
            )


def _run(tok, ids, stops, include=False, chunk=1):
    out = OutputText(tok, stops, include)
    kept_ids, texts = [], []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        kept = out.push(part)
        kept_ids += part[:kept]
        done = out.stop_reason is not None or i + chunk >= len(ids)
        texts.append(out.take(finished=done))
        if out.stop_reason is not None:
            break
    return kept_ids, "".join(texts), out


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_multi_token_stop_string_cuts_tokens_and_text_at_the_same_place(tok, chunk):
    ids = tok.encode("Thought: read the file\nObservation: the value is 7")
    stop = "\nObservation:"
    assert len(tok.encode(stop)) > 1
    kept, text, out = _run(tok, ids, [stop], chunk=chunk)
    assert text == "Thought: read the file" and out.stop_reason == stop
    # The kept tokens end with the one that completed the stop string, as in vLLM.
    assert tok.decode(kept).endswith(stop) and not tok.decode(kept[:-1]).endswith(stop)
    kept_inc, text_inc, _ = _run(tok, ids, [stop], include=True, chunk=chunk)
    assert kept_inc == kept and text_inc == "Thought: read the file\nObservation:"


def test_held_back_text_is_released_at_the_end(tok):
    ids = tok.encode("value is 7\nObs")
    out = OutputText(tok, ["\nObservation:"])
    out.push(ids)
    early = out.take(finished=False)
    assert early == "value is 7\nObs"[: len("value is 7\nObs") - (len("\nObservation:") - 1)]
    assert early + out.take(finished=True) == "value is 7\nObs"


def test_earliest_completing_stop_wins(tok):
    ids = tok.encode("one two three four")
    _, text, out = _run(tok, ids, ["four", "two"], chunk=100)
    assert text == "one " and out.stop_reason == "two"


def test_no_stop_strings_passes_everything(tok):
    ids = tok.encode("naïve text ✓")
    kept, text, out = _run(tok, ids, [])
    assert kept == ids and text == tok.decode(ids) and out.stop_reason is None


@pytest.mark.parametrize("bad", [3, [1], ["x"] * 17, ["y" * 300]])
def test_bad_stop_field(bad):
    with pytest.raises(InvalidArgument):
        parse_stop(bad)
