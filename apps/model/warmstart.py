"""A short supervised warm start of the tiny model on the example task: policy v0.

A random 0.5M-parameter model never writes a well-formed tool call, so RL from it has
nothing to reinforce. The warm start imitates a scripted, imperfect expert
(:mod:`apps.harness.expert`) on locally generated episodes: cross-entropy on the assistant
tokens only, the tokens the router would have recorded (prompts planned by the router's own
:func:`services.router.trajectory.chat_prompt`, so imitation and RL see the same token
sequences). The expert reads a listed file uniformly at random, so v0 writes well-formed
calls and copies the number it read, but reads the right file only as often as chance does
(about 40% of its episodes at temperature 1 reach the best reward): RL has the rest to
learn, which file to read. Some of the expert's reads are slips (a missing file, a call cut
off) kept in the context but not imitated, so v0 goes on after its own mistakes.

Two phases: ``copy_steps`` on the episodes without their system turn (short: copying what
was read forms there, within ~100 steps from tiny.py's initialisation), then ``steps`` on
whole episodes with as many short ones beside them. About 80 s of one core (a minute on
two); measured on this repo's 2-core machine while it was shared, 2 to 5 minutes.

The result is a complete model directory (config, tokenizer, bf16 safetensors), loadable by
transformers and vLLM, cached by a stamp like :func:`apps.model.tiny.build_tiny_model`.
Deterministic for a seed (on one machine and thread count).

    python -m apps.model.warmstart MODEL_DIR [--out OUT_DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

WARM_COPY_STEPS = 150
"""Steps on episodes without their system turn (:func:`without_system`): copying forms here."""
WARM_STEPS = 100
"""Steps on whole episodes (system turn, tools and all), with as many short ones beside."""
WARM_BATCH = 16
WARM_LR = 3e-3
WARM_EPISODES = 384
WARM_SLIP = 0.15
"""Share of the expert's reads that are slips (a missing file, a call cut off), kept as
context but not imitated: v0 learns to go on after its own mistakes."""
STAMP = "gyre_warm.json"


def default_out_dir(model_dir: str | Path, seed: int) -> Path:
    path = Path(model_dir)
    return path.parent / f"{path.name}-warm{seed}"


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def expert_segments(
    tok: Any,
    n_episodes: int,
    seed: int = 0,
    env: Any = None,
    p_list: float = 0.25,
    p_notes: float | None = None,
    p_more: float = 0.0,
    p_slip: float = 0.0,
) -> list[Any]:
    """Token segments (:class:`apps.eval.local.Segment`, the expert's own turns marked, its
    slips not) of ``n_episodes`` expert episodes on training tasks (``warm-{i}``, disjoint
    from the held-out ``eval-{i}``), recorded the way the router records a model's calls."""
    from apps.eval.local import Rollout, TurnSample
    from apps.harness.env import EnvConfig, Episode, make_tasks
    from apps.harness.expert import Expert, tool_call_text
    from services.router.tokenization import normalize_messages, normalize_tools
    from services.router.trajectory import ChatState, TrajectoryStore, chat_prompt

    env = env or EnvConfig()
    tasks = make_tasks(n_episodes, seed=seed * 7 + 11, prefix="warm")
    stop = tok.stop_token_ids[0]
    store = TrajectoryStore()

    async def no_sleep(_: float) -> None:
        return None

    async def one(k: int) -> list[Any]:
        task = tasks[k]
        rng = random.Random(seed * 1_000_003 + k)
        expert = Expert(rng, p_list=p_list, p_notes=p_notes, p_more=p_more, p_slip=p_slip)
        turns: list[TurnSample] = []
        execution_id = f"warm-{k}"

        async def chat(
            messages: list[dict[str, Any]], max_tokens: int, temperature: float, tools: list[dict[str, Any]]
        ) -> dict[str, Any]:
            norm = normalize_messages(messages)
            norm_tools, _ = normalize_tools(tools, None)
            prompt = chat_prompt(tok, store.get(execution_id), norm, norm_tools).token_ids
            message = await expert(messages, max_tokens, temperature, tools)
            calls = message.get("tool_calls") or []
            if calls:  # the text a model writes for the call (what the router parses back)
                fn = calls[0]["function"]
                text = tool_call_text(fn["name"], json.loads(fn["arguments"]))
            else:
                text = str(message.get("content") or "")
            output = tok.encode(text) + [stop]
            store.record(
                execution_id, prompt, output, ChatState.of(norm, norm_tools, message.get("content"), calls)
            )
            turns.append(TurnSample(prompt, output, [0.0] * len(output), "stop", text, message, 1.0))
            return message

        result = await Episode(task, env, k).run(chat, no_sleep)
        store.forget(execution_id)
        return Rollout(task, k, result, turns).segments([i not in expert.slipped for i in range(len(turns))])

    async def all_episodes() -> list[Any]:
        out: list[Any] = []
        for k in range(n_episodes):
            out += await one(k)
        return out

    segments: list[Any] = asyncio.run(all_episodes())
    return segments


def without_system(segments: list[Any], im_start: int) -> list[Any]:
    """Every episode without its system turn (the tool schemas, ~280 of its ~380 tokens):
    the task's user turn on. Copying what was read (a listed file name, the number in a
    file) is what the imitation must discover, the rest is fixed format; on these short
    sequences it forms within a hundred steps, then carries over to whole episodes (the
    offsets it copies from are the same)."""
    from apps.eval.local import Segment

    out = []
    for s in segments:
        starts = [i for i, t in enumerate(s.tokens) if t == im_start]
        if len(starts) >= 2 and any(s.mask[starts[1] :]):
            at = starts[1]
            out.append(Segment(s.tokens[at:], s.mask[at:], s.logprobs[at:]))
    return out


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    seed: int = 0,
    steps: int = WARM_STEPS,
    copy_steps: int = WARM_COPY_STEPS,
    batch_size: int = WARM_BATCH,
    lr: float = WARM_LR,
    episodes: int = WARM_EPISODES,
    p_list: float = 0.25,
    p_notes: float | None = None,
    p_more: float = 0.0,
    p_slip: float = WARM_SLIP,
    log: Any = None,
) -> Path:
    """Fine-tunes the model at ``model_dir`` on expert episodes and writes the result to
    ``out_dir`` (default: ``<model_dir>-warm<seed>`` beside it); returns the path. An
    existing complete result with the same stamp (base weights, seed, settings) is kept.

    ``copy_steps`` steps on episodes without their system turn (:func:`without_system`),
    then ``steps`` steps on whole episodes with as many short ones beside them; AdamW at
    ``lr`` with a short warm-up and a linear decay in the second phase. Cross-entropy on the
    assistant tokens only."""
    src = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else default_out_dir(src, seed)
    settings = {
        "seed": seed,
        "steps": steps,
        "copy_steps": copy_steps,
        "batch_size": batch_size,
        "lr": lr,
        "episodes": episodes,
        "p_list": p_list,
        "p_notes": p_notes,
        "p_more": p_more,
        "p_slip": p_slip,
    }
    stamp = {
        "base": _file_digest(src / "model.safetensors"),
        "tokenizer": _file_digest(src / "tokenizer.json"),
        "settings": settings,
        "builder": 1,
    }
    stamp_path = out / STAMP
    if stamp_path.exists() and (out / "model.safetensors").exists():
        if json.loads(stamp_path.read_text()) == stamp:
            return out

    import torch

    from apps.eval.local import Policy, save_model, token_logprobs

    started = time.perf_counter()
    policy = Policy.load(src)
    segments = expert_segments(
        policy.tok, episodes, seed, p_list=p_list, p_notes=p_notes, p_more=p_more, p_slip=p_slip
    )
    short = without_system(segments, int(policy.tok.hf.convert_tokens_to_ids("<|im_start|>")))
    if log:
        log(f"warm start: {len(segments)} expert episodes in {time.perf_counter() - started:.1f}s")
    torch.manual_seed(seed)
    model = policy.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = copy_steps + steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / 10)
            * (1.0 if s < copy_steps else max(0.05, 1.0 - (s - copy_steps) / max(1, steps)))
        ),
    )
    rng = random.Random(seed)
    for step in range(total):
        # Whole and short episodes go in separate forward passes: the whole ones share their
        # system turn (run once), the short ones are padded to their own length.
        batches = [rng.sample(short, min(batch_size, len(short)))]
        if step >= copy_steps:
            batches.append(rng.sample(segments, min(batch_size, len(segments))))
        lps = [lp for batch in batches for lp in token_logprobs(model, batch, 1.0)]
        loss = -torch.cat(lps).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 20 == 0 or step == total - 1):
            log(
                f"warm start step {step}: loss {float(loss.detach()):.4f} ({time.perf_counter() - started:.1f}s)"
            )
    model.eval()
    save_model(model, policy.tok, out)
    stamp_path.write_text(json.dumps(stamp))
    if log:
        log(f"warm start: {out} in {time.perf_counter() - started:.1f}s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--out", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WARM_STEPS)
    parser.add_argument("--copy-steps", type=int, default=WARM_COPY_STEPS)
    args = parser.parse_args()
    print(
        warm_start(
            args.model_dir, args.out, seed=args.seed, steps=args.steps, copy_steps=args.copy_steps, log=print
        )
    )


if __name__ == "__main__":
    main()
