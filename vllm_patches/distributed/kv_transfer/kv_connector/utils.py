# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/utils.py``.

- F5: ``PromptReads``, which of a decoder's requests reads a shared remote prompt.
  Here, not in the NIXL connector module, so that it exports without F2 and F3.
- F12: ``PromptWrites``, the same for push mode's registrations (v0.28+).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from vllm_patches._overlay import add

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import VllmConfig
    from vllm.v1.request import Request


@add("F5", ">=0.18.0")
class _PromptRead:
    """One remote prompt on the decoder: the request that reads it (None: nobody,
    the prompt's earlier requests all finished), whether its KV arrived, and every
    request with its kv_transfer_params that asked the connector so far."""

    def __init__(self, reader: "Request | None") -> None:
        self.reader = reader
        self.loaded = False
        self.members: dict[str, Request] = {}


@add("F5", ">=0.18.0")
class PromptReads:
    """Which of the decoder's requests reads a remote prompt's KV, named by
    (remote_engine_id, remote_request_id): the children of an ``n > 1`` request.

    - At most one request at a time reads it, as upstream does.
    - Another waits ("not ready yet", ``None``) only while that reader is alive and
      its KV not loaded; then, if its prefix hit leaves at most a block, it computes
      the rest (0 tokens) and notifies the producer as a full hit does; else it reads.
    - State lives until the prompt's last request finished; then its name stays among
      the last ``ended_limit`` ended prompts, for late children, which wait on nobody.
    """

    # A pull decode leg names the remote blocks it reads (the prefill's response
    # lists them); one without them reads nothing.
    names_remote_blocks = True

    # Names of ended prompts kept (two short strings each: well under a MiB). A
    # late sibling arrives within a step or a few of the others.
    ended_limit = 4096

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._reads: dict[tuple[str, str], _PromptRead] = {}
        self._prompt_of: dict[str, tuple[str, str]] = {}
        self._ended: OrderedDict[tuple[str, str], bool] = OrderedDict()
        # Every request of a prompt since its arrival (on_new_request), asked or
        # not (a decoder with no free seat asks nothing).
        self._arrivals: dict[tuple[str, str], dict[str, Request]] = {}
        self._arrival_of: dict[str, tuple[str, str]] = {}

    @classmethod
    def for_decoder(
        cls, vllm_config: "VllmConfig", switch: str
    ) -> "PromptReads | None":
        """The instance a decoder's connector scheduler asks; None when
        kv_connector_extra_config[switch] is false or the decoder has no prefix
        cache to serve the other requests from."""
        cache_config = vllm_config.cache_config
        assert vllm_config.kv_transfer_config is not None
        switched_on = vllm_config.kv_transfer_config.get_from_extra_config(switch, True)
        if not switched_on or not cache_config.enable_prefix_caching:
            return None
        return cls(block_size=cache_config.block_size)

    @classmethod
    def prompt(cls, request: "Request") -> tuple[str, str] | None:
        """The remote prompt ``request`` is still to receive, or None."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        if cls.names_remote_blocks and not params.get("remote_block_ids"):
            return None
        engine_id = params.get("remote_engine_id")
        remote_id = params.get("remote_request_id")
        if engine_id is None or remote_id is None:
            return None
        return str(engine_id), str(remote_id)

    def local_answer(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool] | None:
        """What the connector answers for ``request`` instead of reading: ``(None,
        False)`` while another request reads its prompt, ``(0, False)`` once that
        read is in the local prefix cache; None when ``request`` reads (upstream's
        answer)."""
        prompt = self.prompt(request)
        if prompt is None:
            return None
        read = self._reads.get(prompt)
        if read is None:
            ended = self._ended.pop(prompt, False)
            read = self._reads[prompt] = _PromptRead(None if ended else request)
        read.members[request.request_id] = request
        self._prompt_of[request.request_id] = prompt
        if read.reader is request:
            return None
        if read.reader is not None and self._loading(read.reader):
            return None, False
        if request.num_prompt_tokens - num_computed_tokens <= self.block_size:
            return 0, False
        # The reader's KV is not (or no longer) in the local prefix cache.
        read.reader = request
        return None

    @staticmethod
    def _loading(reader: "Request") -> bool:
        """Whether ``reader``'s remote KV is still to arrive: scheduled to load
        (WAITING_FOR_REMOTE_KVS) or not scheduled yet. A preempted reader, or one
        that finished or was aborted, is not loading."""
        from vllm.v1.request import RequestStatus

        if reader.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return True
        return (
            reader.status == RequestStatus.WAITING and reader.num_computed_tokens == 0
        )

    def arrived(
        self, request: "Request", request_finished: "Callable[..., object]"
    ) -> None:
        """``request`` reached the scheduler (on_new_request). One that comes after
        its prompt's read completed needs the producer no more: it sends now what a
        request that ends unscheduled sends (``request_finished`` with no blocks),
        not when a seat admits it, maybe past the producer's lease or timeout."""
        prompt = self.prompt(request)
        if prompt is None:
            return
        self._arrivals.setdefault(prompt, {})[request.request_id] = request
        self._arrival_of[request.request_id] = prompt
        read = self._reads.get(prompt)
        if read is not None and read.loaded and read.reader is not request:
            request_finished(request, ())

    def served_by(self, loaded: "set[str] | frozenset[str]") -> list["Request"]:
        """The requests that no longer need the producer because a request among
        ``loaded`` (finished receiving) read their prompt: each reader's prompt's other
        requests not scheduled yet, those that asked for it and (v0.22+) those that
        arrived. They take the prompt from the prefix cache, or compute it, whenever
        they are admitted: their release waits on no seat."""
        served: list[Request] = []
        for req_id in loaded:
            prompt = self._prompt_of.get(req_id)
            if prompt is None:
                continue
            read = self._reads.get(prompt)
            if read is None or read.reader is None or read.reader.request_id != req_id:
                continue
            read.loaded = True
            others = {**read.members, **self._arrivals.get(prompt, {})}
            served.extend(
                request
                for other_id, request in others.items()
                if other_id != req_id and self.prompt(request) == prompt
            )
        return served

    def release_served(
        self,
        loaded: "set[str] | frozenset[str] | None",
        request_finished: "Callable[..., object]",
    ) -> None:
        """Each request ``served_by(loaded)`` sends the producer now what upstream
        sends for a request that ends unscheduled (the connector scheduler's
        ``request_finished`` with no blocks)."""
        for request in self.served_by(loaded) if loaded else ():
            request_finished(request, ())

    def finished(self, request: "Request") -> None:
        """``request`` left the scheduler: forget its prompt once no request uses it."""
        arrival = self._arrival_of.pop(request.request_id, None)
        if arrival is not None:
            arrivals = self._arrivals[arrival]
            del arrivals[request.request_id]
            if not arrivals:
                del self._arrivals[arrival]
        prompt = self._prompt_of.pop(request.request_id, None)
        if prompt is None:
            return
        read = self._reads[prompt]
        read.members.pop(request.request_id, None)
        if not read.members:
            del self._reads[prompt]
            self._ended[prompt] = True
            if len(self._ended) > self.ended_limit:
                self._ended.popitem(last=False)


@add("F12", ">=0.28.0")
class PromptWrites(PromptReads):
    """PromptReads for push mode (v0.28+), with "registers" for "reads": the producer
    WRITEs a prompt once. Once a registration failed nobody registers that prompt
    again (each would wait out a watchdog in turn); the others compute it.
    """

    names_remote_blocks = False

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._failed: set[tuple[str, str]] = set()

    def local_answer(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool] | None:
        """PromptReads' answer, and 0 tokens for a prompt whose registration
        failed."""
        prompt = self.prompt(request)
        if prompt in self._failed:
            self._reads[prompt].members[request.request_id] = request
            self._prompt_of[request.request_id] = prompt
            return 0, False
        return super().local_answer(request, num_computed_tokens)

    def finished(self, request: "Request") -> None:
        """PromptReads' bookkeeping; a reader that finished with an error marks
        its prompt failed, until no request uses the prompt."""
        from vllm.v1.request import RequestStatus

        prompt = self._prompt_of.get(request.request_id)
        if prompt is not None:
            reader = self._reads[prompt].reader
            if reader is request and request.status == RequestStatus.FINISHED_ERROR:
                self._failed.add(prompt)
        super().finished(request)
        if prompt is not None and prompt not in self._reads:
            self._failed.discard(prompt)
