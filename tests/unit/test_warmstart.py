"""The warm start (apps/model/warmstart.py): imitation data are the router's own token
sequences (assistant tokens marked), the result is a complete model directory that
transformers loads and whose policy writes tool calls the router parses, it is cached by a
stamp, and it is deterministic for a seed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from apps.harness.env import TOOLS, EnvConfig, Episode, eval_tasks
from apps.model.warmstart import STAMP, expert_segments, warm_start, without_system

# Enough steps for the format (not for copying the number: that takes the default's).
QUICK = {"copy_steps": 40, "steps": 4, "batch_size": 8, "episodes": 48}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def warm(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_start(base, tmp_path_factory.mktemp("warm") / "v0", seed=0, **QUICK)


def test_expert_segments_are_router_token_sequences_with_assistant_tokens_marked(base: Path):
    from services.router.tokenization import Tokenizer

    tok = Tokenizer.load(base)
    segments = expert_segments(tok, 8, seed=0)
    assert len(segments) == 8  # one per episode: every call continued the previous tokens
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    for s in segments:
        text = tok.decode(s.tokens, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and "<tool_call>" in text
        marked = [t for t, m in zip(s.tokens, s.mask, strict=True) if m]
        assert tok.decode(marked, skip_special_tokens=False).count("<|im_end|>") == marked.count(im_end) >= 1
        assert "write_file" in tok.decode(marked)  # the expert always ends with a write
        first = s.mask.index(True)  # the prompt is never a target
        assert tok.decode(s.tokens[:first], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    crops = without_system(segments, int(tok.hf.convert_tokens_to_ids("<|im_start|>")))
    assert len(crops) == len(segments)
    for crop, s in zip(crops, segments, strict=True):
        assert tok.decode(crop.tokens, skip_special_tokens=False).startswith("<|im_start|>user\nFiles: [")
        assert len(crop.tokens) < len(s.tokens) - 200 and sum(crop.mask) == sum(s.mask)


def test_the_experts_slips_are_context_not_targets(base: Path):
    from services.router.tokenization import Tokenizer

    tok = Tokenizer.load(base)
    segments = expert_segments(tok, 40, seed=0, p_slip=0.5)
    slips = 0
    for s in segments:
        runs, j = [], 0
        while j < len(s.tokens):  # the assistant turns: from "<|im_start|>assistant\n" to <|im_end|>
            text = tok.decode(s.tokens[: j + 1], skip_special_tokens=False)
            if text.endswith("<|im_start|>assistant\n"):
                k = j + 1
                while tok.decode([s.tokens[k]], skip_special_tokens=False) != "<|im_end|>":
                    k += 1
                runs.append((j + 1, k + 1))
                j = k
            j += 1
        for a, b in runs:
            marked = s.mask[a:b]
            assert all(marked) or not any(marked)
            if not any(marked):
                slips += 1
                out = tok.decode(s.tokens[a:b])
                assert "</tool_call>" not in out or '"path": "' in out  # cut off, or a missing file
        assert any(s.mask)  # the expert's own turns are learned
    assert slips >= 5


def test_warm_start_writes_a_loadable_model_that_calls_tools(warm: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apps.eval.local import Policy, sample_rollouts

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP):
        assert (warm / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(str(warm), local_files_only=True)
    assert model.dtype == torch.bfloat16  # as stored
    assert json.loads((warm / "config.json").read_text())["dtype"] == "bfloat16"  # what vLLM reads
    assert AutoTokenizer.from_pretrained(str(warm)).chat_template
    env = EnvConfig(time_scale=0.0, turns_min=2, turns_max=2)
    rollouts = sample_rollouts(
        Policy.load(warm), [(t, 0) for t in eval_tasks(4)], env, seed=0, temperature=0.0
    )
    first_calls = [r.turns[0].message.get("tool_calls") for r in rollouts]
    assert all(first_calls), [r.turns[0].text for r in rollouts]
    assert {c[0]["function"]["name"] for c in first_calls} <= {t["function"]["name"] for t in TOOLS}


def test_warm_start_is_cached_by_its_stamp_and_deterministic(base: Path, warm: Path, tmp_path: Path):
    mtime = (warm / "model.safetensors").stat().st_mtime_ns
    assert warm_start(base, warm, seed=0, **QUICK) == warm
    assert (warm / "model.safetensors").stat().st_mtime_ns == mtime  # kept, not retrained
    few = {"copy_steps": 3, "steps": 2, "episodes": 8}
    a = warm_start(base, tmp_path / "a", seed=1, **few)
    b = warm_start(base, tmp_path / "b", seed=1, **few)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = warm_start(base, tmp_path / "c", seed=2, **few)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_expert_episodes_are_the_tasks_episodes(base: Path):
    """The expert's episodes go through Episode.run like the harness's (no other path)."""
    from apps.harness.expert import Expert

    async def run() -> float:
        import random

        task = eval_tasks(1)[0]
        result = await Episode(task, EnvConfig(time_scale=0.0)).run(
            Expert(random.Random(0), p_list=0.0, p_notes=1.0), _no_sleep
        )
        return result.reward

    assert asyncio.run(run()) == 1.0


async def _no_sleep(_: float) -> None:
    return None
