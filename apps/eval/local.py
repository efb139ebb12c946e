"""A local sampler and evaluator for the example task, on transformers (no vLLM engine, no
router process), that speaks the router's chat protocol exactly.

Each model call goes the way the router serves it: the OpenAI messages are normalized, the
prompt is planned by the router's own :func:`services.router.trajectory.chat_prompt` (the
execution's previous tokens + exactly the tokens generated + the template's delta, so
generated text is never re-tokenized), the output is sampled up to ``max_tokens`` at a
temperature and stops at ``<|im_end|>``, and its text is parsed by the router's tool-call
parser (vLLM's ``hermes``, :mod:`services.router.toolcalls`). The episodes themselves are
:meth:`apps.harness.env.Episode.run`, with a no-op sleep. Calls of concurrent episodes are
batched: when every live episode waits on a model call, they are sampled together (left
padded, one KV cache), from one ``torch.Generator``: a run is deterministic for a seed.

Every call's prompt ids, generated ids and their log-probs (``log_softmax(logits / T)`` of
the sampled token; at T = 0, greedy, at T = 1, as the trainer scores a greedy turn) are
kept, per episode as :class:`Rollout`, so a study can train on the samples
(:func:`policy_gradient_step` is a minimal GRPO step).

    from apps.eval.local import Policy, evaluate
    from apps.harness.env import EnvConfig, eval_tasks
    result = evaluate("path/to/model", eval_tasks(32), EnvConfig(), samples_per_task=4, seed=0)
    print(result.mean, result.ci95)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.eval.stats import bootstrap_ci
from apps.harness.env import SECRET_FILE, EnvConfig, Episode, EpisodeResult, Task
from services.router.tokenization import Tokenizer, normalize_messages, normalize_tools
from services.router.toolcalls import ToolCallParser, ToolCallParsers
from services.router.trajectory import ChatState, TrajectoryStore, chat_prompt

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class Policy:
    """A causal LM (eval mode, float32 by default) and the router's tokenizer wrapper of its
    directory."""

    model: Any
    tok: Tokenizer
    model_dir: Path | None = None

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str = "float32", threads: int | None = None) -> Policy:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        path = Path(model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), local_files_only=True
        )
        model.eval()
        return cls(model, Tokenizer.load(path), path)

    def save(self, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
        """Writes a complete model directory (config, tokenizer, weights in ``dtype``)."""
        return save_model(self.model, self.tok, out_dir, dtype)


def save_model(model: Any, tok: Tokenizer, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    import copy

    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save_pretrained(str(out))
    clone = copy.deepcopy(model).to(getattr(torch, dtype))
    clone.config.dtype = getattr(torch, dtype)
    clone.save_pretrained(str(out), safe_serialization=True)
    return out


def as_policy(model_or_dir: Policy | str | Path) -> Policy:
    return model_or_dir if isinstance(model_or_dir, Policy) else Policy.load(model_or_dir)


# Sampling ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    """One sampled output: its ids (the stop token included when it stopped), their
    log-probs at the sampling temperature, and why it ended ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def common_prefix(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """Length of the longest common prefix of ``seqs``, at most ``limit``."""
    first = seqs[0]
    n = min(limit, *(len(s) for s in seqs))
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n


MIN_SHARED_PREFIX = 16
"""A common prefix at least this long (the system turn with the tools) is run once per
batch, its KV cache repeated for every row."""


def _prefix_forward(model: Any, seqs: Sequence[Sequence[int]], limit: int) -> tuple[int, Any]:
    """(prefix length, a DynamicCache of the shared prefix repeated over the batch) or (0,
    None) when the rows share too little. Differentiable when grads are on."""
    import torch
    from transformers import DynamicCache

    p = common_prefix(seqs, limit) if len(seqs) > 1 else 0
    if p < MIN_SHARED_PREFIX:
        return 0, None
    cache = DynamicCache()
    model.model(
        input_ids=torch.tensor([list(seqs[0][:p])], dtype=torch.long), past_key_values=cache, use_cache=True
    )
    cache.batch_repeat_interleave(len(seqs))
    return p, cache


def _batch(
    rows: Sequence[Sequence[int]], p: int, left: bool, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask over prefix + rows, position ids) of the rows' suffixes after a
    shared prefix of length ``p``, padded on the left or the right."""
    import torch

    n, width = len(rows), max(len(r) - p for r in rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, p + width), dtype=torch.long)
    mask[:, :p] = 1
    for i, r in enumerate(rows):
        k = len(r) - p
        at = width - k if left else 0
        ids[i, at : at + k] = torch.tensor(list(r[p:]), dtype=torch.long)
        mask[i, p + at : p + at + k] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]
    return ids, mask, pos


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    temperature: float,
    stop_ids: Sequence[int],
    generator: torch.Generator | None = None,
    pad_id: int = 0,
) -> list[Generation]:
    """Samples a continuation of every prompt, batched (the shared prefix run once, the rest
    left padded, one KV cache; a row that stopped leaves the batch). T = 0 is greedy,
    scored at T = 1."""
    import torch
    from transformers import DynamicCache

    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("empty prompt")
    n = len(prompts)
    out: list[Generation] = [Generation([], [], "length") for _ in range(n)]
    if max_tokens <= 0:
        return out
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    with torch.inference_mode():
        p, cache = _prefix_forward(model, prompts, min(len(x) for x in prompts) - 1)
        cache = cache if cache is not None else DynamicCache()
        ids, mask, pos = _batch(prompts, p, left=True, pad_id=pad_id)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        rows = list(range(n))
        next_pos = pos[:, -1] + 1
        for step in range(max_tokens):
            scaled = logits.float() / temperature if temperature > 0 else logits.float()
            logp = torch.log_softmax(scaled, dim=-1)
            if temperature > 0:
                tok = torch.multinomial(logp.exp(), 1, generator=generator)
            else:
                tok = logp.argmax(dim=-1, keepdim=True)
            tok_lp = logp.gather(1, tok).squeeze(1).tolist()
            flat = tok.squeeze(1)
            done = torch.isin(flat, stops).tolist()
            for r, i in enumerate(rows):
                out[i].token_ids.append(int(flat[r]))
                out[i].logprobs.append(float(tok_lp[r]))
                if done[r]:
                    out[i].finish_reason = "stop"
            if step == max_tokens - 1:
                break
            keep = [r for r in range(len(rows)) if not done[r]]
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(index)
                mask, next_pos, tok = mask[index], next_pos[index], tok[index]
                rows = [rows[r] for r in keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            logits = model(
                input_ids=tok,
                attention_mask=mask,
                position_ids=next_pos.view(-1, 1),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_pos = next_pos + 1
    return out


@dataclasses.dataclass
class TurnSample:
    """One model call of an episode, as the router would have served it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    """Per output token, ``log_softmax(logits / T)`` of the sampled token."""
    finish_reason: str
    text: str
    message: dict[str, Any]
    """The assistant message the harness got (``content``, ``tool_calls``)."""
    temperature: float


@dataclasses.dataclass
class Segment:
    """A token sequence to train on: ``mask[i]`` is True where ``tokens[i]`` was generated,
    with its sampling log-prob in ``logprobs[i]`` (0.0 elsewhere)."""

    tokens: list[int]
    mask: list[bool]
    logprobs: list[float]


@dataclasses.dataclass
class Rollout:
    """One episode: its task, member index, result and model calls."""

    task: Task
    member: int
    result: EpisodeResult
    turns: list[TurnSample]

    @property
    def reward(self) -> float:
        return self.result.reward

    def segments(self, marked: Sequence[bool] | None = None) -> list[Segment]:
        """The episode's token sequences (one, unless a call did not continue the previous
        call's tokens), each with the generated positions marked (``marked``: per turn,
        whether its output is marked; by default every turn's)."""
        segs: list[Segment] = []
        for k, turn in enumerate(self.turns):
            mark = True if marked is None else bool(marked[k])
            cur = segs[-1] if segs else None
            prompt = turn.prompt_ids
            if cur is None or len(prompt) < len(cur.tokens) or prompt[: len(cur.tokens)] != cur.tokens:
                cur = Segment(list(prompt), [False] * len(prompt), [0.0] * len(prompt))
                segs.append(cur)
            else:
                extra = prompt[len(cur.tokens) :]
                cur.tokens += extra
                cur.mask += [False] * len(extra)
                cur.logprobs += [0.0] * len(extra)
            cur.tokens += turn.output_ids
            cur.mask += [mark] * len(turn.output_ids)
            cur.logprobs += turn.logprobs if mark else [0.0] * len(turn.output_ids)
        return segs


class LocalSampler:
    """Serves ``Episode.run`` chat calls from a local policy, batched across episodes."""

    def __init__(self, policy: Policy, seed: int = 0, tool_call_parser: str = "hermes") -> None:
        import torch

        self.policy = policy
        self.generator = torch.Generator().manual_seed(seed)
        self.store = TrajectoryStore()
        self._parsers = ToolCallParsers(tool_call_parser, policy.tok)
        self._pending: list[tuple[int, _Request]] = []
        self._live = 0
        hf = policy.tok.hf
        self._pad = int(hf.pad_token_id if hf.pad_token_id is not None else 0)

    async def rollouts(
        self,
        jobs: Sequence[tuple[Task, int]],
        env: EnvConfig,
        temperature: float | None = None,
        workspace_root: str | None = None,
    ) -> list[Rollout]:
        """Runs one episode per (task, member), all at once; their calls are batched."""
        turns: list[list[TurnSample]] = [[] for _ in jobs]
        self._live = len(jobs)

        async def no_sleep(_: float) -> None:
            return None

        async def one(k: int, task: Task, member: int) -> EpisodeResult:
            episode = Episode(task, env, member)
            execution_id = f"{task.task_id}-{member}-{k}"

            async def chat(
                messages: list[dict[str, Any]], max_tokens: int, temp: float, tools: list[dict[str, Any]]
            ) -> dict[str, Any]:
                t = temp if temperature is None else temperature
                return await self._call(k, execution_id, messages, max_tokens, t, tools, turns[k])

            try:
                return await episode.run(chat, no_sleep, workspace_root)
            finally:
                self._live -= 1
                self.store.forget(execution_id)
                self._maybe_flush()

        results = await asyncio.gather(*(one(k, t, m) for k, (t, m) in enumerate(jobs)))
        return [Rollout(t, m, r, turns[k]) for k, ((t, m), r) in enumerate(zip(jobs, results, strict=True))]

    async def _call(
        self,
        k: int,
        execution_id: str,
        messages: list[dict[str, Any]],
        max_tokens: int,
        temperature: float,
        tools: list[dict[str, Any]],
        record: list[TurnSample],
    ) -> dict[str, Any]:
        norm = normalize_messages(messages)
        norm_tools, parse_tools = normalize_tools(tools or None, None)
        prompt = chat_prompt(self.policy.tok, self.store.get(execution_id), norm, norm_tools)
        parser = await self._parsers.new(norm_tools, "gyre") if parse_tools else None
        request = _Request(
            execution_id,
            prompt.token_ids,
            max_tokens,
            temperature,
            norm,
            norm_tools,
            parser,
            asyncio.get_running_loop().create_future(),
            record,
        )
        self._pending.append((k, request))
        self._maybe_flush()
        message: dict[str, Any] = await request.future
        return message

    def _maybe_flush(self) -> None:
        if not self._pending or len(self._pending) < self._live:
            return
        batch = sorted(self._pending, key=lambda kr: kr[0])
        self._pending = []
        try:
            self._serve([r for _, r in batch])
        except BaseException as exc:
            for _, r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            raise

    def _serve(self, requests: list[_Request]) -> None:
        tok = self.policy.tok
        by_sampling: dict[tuple[int, float], list[_Request]] = {}
        for r in requests:
            by_sampling.setdefault((r.max_tokens, r.temperature), []).append(r)
        for (max_tokens, temperature), group in by_sampling.items():
            gens = generate(
                self.policy.model,
                [r.prompt for r in group],
                max_tokens,
                temperature,
                tok.stop_token_ids,
                self.generator,
                self._pad,
            )
            for r, g in zip(group, gens, strict=True):
                text = tok.decode(g.token_ids)
                with _quiet_parser():  # a malformed call is the policy's business, not an error
                    content, calls = r.parser.parse(text) if r.parser is not None else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                self.store.record(
                    r.execution_id, r.prompt, g.token_ids, ChatState.of(r.messages, r.tools, content, calls)
                )
                r.record.append(
                    TurnSample(r.prompt, g.token_ids, g.logprobs, g.finish_reason, text, message, temperature)
                )
                r.future.set_result(message)


@contextlib.contextmanager
def _quiet_parser() -> Any:
    """vLLM's hermes parser logs a traceback for every call it cannot parse."""
    logger = logging.getLogger("vllm.tool_parsers.hermes_tool_parser")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


@dataclasses.dataclass
class _Request:
    execution_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    parser: ToolCallParser | None
    future: asyncio.Future[dict[str, Any]]
    record: list[TurnSample]


def sample_rollouts(
    policy: Policy,
    jobs: Sequence[tuple[Task, int]],
    env: EnvConfig,
    seed: int = 0,
    temperature: float | None = None,
    batch_size: int = 64,
) -> list[Rollout]:
    """One episode per (task, member) with ``policy``, ``batch_size`` episodes at a time
    (their calls batched). Deterministic for a seed. Blocking: runs its own event loop."""
    step = max(1, batch_size)

    async def sample() -> list[Rollout]:
        sampler = LocalSampler(policy, seed)
        out: list[Rollout] = []
        with tempfile.TemporaryDirectory(prefix="gyre-eval-") as root:
            for start in range(0, len(jobs), step):
                out += await sampler.rollouts(jobs[start : start + step], env, temperature, root)
        return out

    rollouts: list[Rollout] = _run(sample())
    return rollouts


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("called from a running event loop: run it in a thread (asyncio.to_thread)")


# Evaluation --------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalResult:
    """Mean reward over tasks (each task's mean over its samples) with a 95% bootstrap
    interval over tasks; ``n`` episodes; ``per_task`` task id -> mean reward."""

    mean: float
    ci95: tuple[float, float]
    n: int
    per_task: dict[str, float]
    success: float = 0.0
    """Share of episodes with the best reward (the secret written)."""
    read_secret_first: float = 0.0
    """Share of episodes whose first read_file was notes.txt."""
    tool_call_rate: float = 0.0
    """Share of model calls that came back with a parsed tool call."""
    turns: float = 0.0
    """Mean turns per episode."""
    seconds: float = 0.0
    rollouts: list[Rollout] = dataclasses.field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "mean": round(self.mean, 4),
            "ci95": [round(self.ci95[0], 4), round(self.ci95[1], 4)],
            "n": self.n,
            "tasks": len(self.per_task),
            "success": round(self.success, 4),
            "read_secret_first": round(self.read_secret_first, 4),
            "tool_call_rate": round(self.tool_call_rate, 4),
            "turns": round(self.turns, 3),
            "seconds": round(self.seconds, 2),
        }


def summarize(rollouts: Sequence[Rollout], seconds: float = 0.0, boot_seed: int = 0) -> EvalResult:
    """An :class:`EvalResult` of already sampled episodes."""
    by_task: dict[str, list[float]] = {}
    for r in rollouts:
        by_task.setdefault(r.task.task_id, []).append(r.reward)
    per_task = {t: sum(v) / len(v) for t, v in by_task.items()}
    mean, lo, hi = bootstrap_ci(list(per_task.values()), seed=boot_seed)
    calls = [t for r in rollouts for t in r.turns]
    first_reads = [next((c for c in r.result.calls if c.startswith("read_file(")), "") for r in rollouts]
    n = max(1, len(rollouts))
    return EvalResult(
        mean=mean,
        ci95=(lo, hi),
        n=len(rollouts),
        per_task=per_task,
        success=sum(r.result.success for r in rollouts) / n,
        read_secret_first=sum(c == f"read_file({SECRET_FILE})" for c in first_reads) / n,
        tool_call_rate=sum(bool(t.message.get("tool_calls")) for t in calls) / max(1, len(calls)),
        turns=sum(r.result.turns for r in rollouts) / n,
        seconds=seconds,
        rollouts=list(rollouts),
    )


def evaluate(
    model_or_dir: Policy | str | Path,
    tasks: Sequence[Task],
    env: EnvConfig | None = None,
    samples_per_task: int = 4,
    seed: int = 0,
    temperature: float | None = None,
    batch_size: int = 64,
) -> EvalResult:
    """Runs ``samples_per_task`` episodes of every task (held-out:
    :func:`apps.harness.env.eval_tasks`) with the policy at ``temperature`` (None: the
    env's) and returns the mean reward with a 95% bootstrap interval over tasks.
    Deterministic for a seed (and ``batch_size``: the episodes sampled together draw from
    one generator). Blocking (inside an event loop, run it in a thread)."""
    policy = as_policy(model_or_dir)
    env = env or EnvConfig()
    jobs = [(t, m) for t in tasks for m in range(samples_per_task)]
    started = time.perf_counter()
    rollouts = sample_rollouts(policy, jobs, env, seed, temperature, batch_size)
    return summarize(rollouts, time.perf_counter() - started, boot_seed=seed)


# Training on the samples -------------------------------------------------------------------


def token_logprobs(model: Any, segments: Sequence[Segment], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per segment, the policy's log-probs (at ``temperature``; T = 0 scored at 1) of its
    generated tokens, with gradients: the shared prefix (the system turn) run once, the rest
    right padded, the LM head applied at the generated positions only."""
    import torch

    firsts = [next((j for j in range(1, len(s.tokens)) if s.mask[j]), len(s.tokens)) for s in segments]
    p, cache = _prefix_forward(model, [s.tokens for s in segments], min(firsts) - 1)
    ids, mask, pos = _batch([s.tokens for s in segments], p, left=False, pad_id=0)
    hidden = model.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=cache is not None,
    ).last_hidden_state
    rows, cols, targets, counts = [], [], [], []
    for i, s in enumerate(segments):
        k = 0
        for j in range(max(1, p + 1), len(s.tokens)):
            if s.mask[j]:
                rows.append(i)
                cols.append(j - 1 - p)
                targets.append(s.tokens[j])
                k += 1
        counts.append(k)
    h = hidden[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)]
    logits = model.lm_head(h).float()
    logits = logits / temperature if temperature > 0 else logits
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets).view(-1, 1)).squeeze(1)
    return list(torch.split(lp, counts))


def group_advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """GRPO advantages: reward minus the mean of the rollouts of the same task."""
    by_task: dict[str, list[float]] = {}
    for r in rollouts:
        by_task.setdefault(r.task.task_id, []).append(r.reward)
    return [r.reward - sum(by_task[r.task.task_id]) / len(by_task[r.task.task_id]) for r in rollouts]


def policy_gradient_step(
    policy: Policy, optimizer: Any, rollouts: Sequence[Rollout], max_grad_norm: float = 1.0
) -> dict[str, float]:
    """One on-policy REINFORCE step with GRPO advantages: loss = −Σ_episodes A · Σ_tokens
    log π (generated tokens, at the sampling temperature) / episodes. Returns statistics."""
    import torch

    advantages = group_advantages(rollouts)
    items = [
        (a, s, r.turns[0].temperature)
        for a, r in zip(advantages, rollouts, strict=True)
        for s in r.segments()
    ]
    items = [it for it in items if it[0] != 0.0 and any(it[1].mask)]
    stats = {"episodes": float(len(rollouts)), "trained": float(len(items)), "loss": 0.0}
    if not items:
        return stats
    model = policy.model
    model.train()
    optimizer.zero_grad(set_to_none=True)
    temperature = items[0][2]
    lps = token_logprobs(model, [s for _, s, _ in items], temperature)
    loss = -sum(a * lp.sum() for (a, _, _), lp in zip(items, lps, strict=True)) / len(rollouts)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    model.eval()
    stats["loss"] = float(loss.detach())
    return stats
