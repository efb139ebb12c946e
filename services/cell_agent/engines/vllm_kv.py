"""KV handoff for the vLLM engine: a KV connector that keeps each request's prompt KV in a
shared directory (the "file" medium on CPU), matches a continuation on its longest stored
block-aligned prefix, and frees what nobody pinned.

Built on vLLM's ``ExampleConnector`` (which stores a prompt's KV per layer as safetensors
while prefilling and loads it for a later request), with what a reroute needs:

* matching: a continuation's prompt is the original prompt plus generated tokens, so the
  stored entry is found by trying every block-aligned prefix, longest first (the example
  only tries one length);
* pinning: the front end (:meth:`VllmEngine.export_kv`) drops a ``pin-<handle>`` file into
  the entry before the router cancels the source request; ``release`` removes it;
* freeing: when the last request using an entry finishes, the scheduler-side connector
  deletes the entry unless it is pinned, so storage stays bounded by the live requests.

Limits: prompts longer than the prefill chunk (``max_num_batched_tokens``) are not stored
correctly by the example's save path; GPU deployments would use CUDA IPC / NIXL instead of
files. The entry naming (``folder_for``) must match the example's hashing.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.utils.hashing import safe_hash

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PIN_PREFIX = "pin-"


def folder_for(storage: str, token_ids: list[int]) -> str:
    """The directory that holds the KV of exactly ``token_ids`` (the example's naming)."""
    token_bytes = torch.tensor(token_ids).numpy().tobytes()
    return os.path.join(storage, safe_hash(token_bytes, usedforsecurity=False).hexdigest())


def stored_prefix_len(prompt_len: int, block_size: int) -> int:
    """How many prompt tokens a request stores while prefilling: the largest multiple of
    the block size strictly below the prompt length (``align_to_block_size``)."""
    return align_to_block_size(prompt_len, block_size)


def pinned(folder: str) -> bool:
    try:
        return any(name.startswith(PIN_PREFIX) for name in os.listdir(folder))
    except FileNotFoundError:
        return False


class GyreKvConnector(ExampleConnector):
    """ExampleConnector + longest-prefix matching + pins + freeing (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._match_len: dict[str, int] = {}
        self._users: dict[str, set[str]] = {}  # entry folder -> request ids using it
        self._entries_of: dict[str, set[str]] = {}  # request id -> entry folders

    # Scheduler side ------------------------------------------------------------------------

    def _longest_stored_prefix(self, prompt: list[int]) -> int:
        # The largest block multiple strictly below the prompt length: at least one prompt
        # token must be computed to produce the next token.
        k = align_to_block_size(len(prompt), self._block_size)
        while k >= self._block_size:
            if os.path.isdir(folder_for(self._storage_path, prompt[:k])):
                return k
            k -= self._block_size
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        k = self._longest_stored_prefix(prompt)
        if k <= num_computed_tokens:
            return 0, False
        self._match_len[request.request_id] = k
        return k - num_computed_tokens, False

    def _use(self, request_id: str, folder: str) -> None:
        self._users.setdefault(folder, set()).add(request_id)
        self._entries_of.setdefault(request_id, set()).add(folder)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            prompt = list(new_req.prompt_token_ids or [])
            rid = new_req.req_id
            if rid in self._requests_need_load:
                k = self._match_len.pop(rid, 0)
                # make_meta keeps align_to_block_size(len) = k tokens of prompt[:k + 1].
                meta.add_request(token_ids=prompt[: k + 1], block_ids=new_req.block_ids[0],
                                 block_size=self._block_size, is_store=False, mm_hashes=[])
                self._use(rid, folder_for(self._storage_path, prompt[:k]))
            n = stored_prefix_len(len(prompt), self._block_size)
            if n >= self._block_size:
                folder = folder_for(self._storage_path, prompt[:n])
                self._use(rid, folder)
                if not os.path.isdir(folder):
                    # Stored even when its prefix was loaded: a continuation can move again.
                    meta.add_request(token_ids=prompt, block_ids=new_req.block_ids[0],
                                     block_size=self._block_size, is_store=True, mm_hashes=[])
        # A preempted request recomputes locally (no reload through the connector).
        self._requests_need_load.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._match_len.pop(rid, None)
        for folder in self._entries_of.pop(rid, set()):
            users = self._users.get(folder, set())
            users.discard(rid)
            if not users:
                self._users.pop(folder, None)
                if not pinned(folder):
                    shutil.rmtree(folder, ignore_errors=True)
        return False, None
