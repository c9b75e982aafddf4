# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py``.

NIXL decode scheduler side: F5 reads a parallel-sampling prompt once
(``PromptReads``) and sends its full-hit notifications before a step's forward pass
(v0.29+), F12 registers it once in push mode (``PromptWrites``). Up to v0.19
in ``nixl_connector.py``; from v0.24 in ``NixlBaseConnector`` and ``NixlPullConnector``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import PromptReads, PromptWrites
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_patches._overlay import amend, call_at_end_of, redirect_call_in

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@amend("F5", ">=0.24.0")
@amend("F5", ">=0.20.0,<0.24.0", name="NixlConnector")
@amend("F5", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnector")
class NixlBaseConnector:
    """F5: the scheduler-side calls go through PromptReads."""

    # Set by the pull connector's scheduler role when a prompt is read once (and by
    # the push connector's when it is written once); None (each request reads or
    # registers, as upstream) for worker roles, a decoder without prefix caching,
    # and read_prompt_once (write_prompt_once) false.
    _prompt_reads: "PromptReads | None" = None

    @redirect_call_in(
        "get_num_new_matched_tokens",
        "self.connector_scheduler.get_num_new_matched_tokens",
    )
    def _num_new_matched_tokens_reading_prompt_once(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Upstream's answer, unless another request reads the same remote prompt
        (PromptReads.local_answer)."""
        assert self.connector_scheduler is not None
        reads = self._prompt_reads
        answer = reads.local_answer(request, num_computed_tokens) if reads else None
        if answer is not None:
            return answer
        return self.connector_scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )

    @redirect_call_in("request_finished", "self.connector_scheduler.request_finished")
    def _finish_remote_prompt(
        self, request: "Request", block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """Upstream's request_finished, after PromptReads forgot the request."""
        assert self.connector_scheduler is not None
        if self._prompt_reads is not None:
            self._prompt_reads.finished(request)
        return self.connector_scheduler.request_finished(request, block_ids)

    @redirect_call_in(
        "request_finished_all_groups", "self.connector_scheduler.request_finished"
    )
    def _finish_remote_prompt_all_groups(
        self, request: "Request", block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """The same for hybrid models (one block list per KV cache group)."""
        return self._finish_remote_prompt(request, block_ids)


@amend("F5", ">=0.29.0")
class NixlBaseConnector:
    """F5: full-hit notifications leave before the step's forward pass (v0.29+)."""

    @redirect_call_in(
        "build_connector_meta", "self.connector_scheduler.build_connector_meta"
    )
    def _notify_full_hits_before_forward(
        self, scheduler_output: "SchedulerOutput"
    ) -> "KVConnectorMetadata":
        """Upstream's metadata; a step that notifies the producer of a full local
        prefix hit (the children PromptReads answers 0 tokens) starts its KV work
        before the forward pass, as every step did up to v0.28. From v0.29 a step
        without sync loads starts it after the forward, which on a synchronous
        backend delays the notifications by the whole pass, past the lease."""
        assert self.connector_scheduler is not None
        meta = self.connector_scheduler.build_connector_meta(scheduler_output)
        if (
            not scheduler_output.has_sync_kv_loads
            and isinstance(meta, NixlConnectorMetadata)
            and any(
                not any(recv.local_block_ids) for recv in meta.reqs_to_recv.values()
            )
        ):
            scheduler_output.has_sync_kv_loads = True
        return meta


@amend("F5", ">=0.24.0")
@amend("F5", ">=0.22.0,<0.24.0", name="NixlConnector")
class NixlBaseConnector:
    """F5 (KV leases, v0.22+): a prompt's other requests stop needing the producer
    when its one read completes, admitted or not."""

    @call_at_end_of("on_new_request")
    def _note_arrival(self, request: "Request") -> None:
        """Every request of a remote prompt, from its arrival."""
        if self._prompt_reads is not None:
            assert self.connector_scheduler is not None
            self._prompt_reads.arrived(
                request, self.connector_scheduler.request_finished
            )

    @call_at_end_of("update_connector_output")
    def _release_prompt_once_read(self, connector_output: "KVConnectorOutput") -> None:
        """The producer releases a prompt as soon as its one read (push: WRITE) is
        done: each other request not scheduled yet sends now what upstream sends for
        a request that ends unscheduled (request_finished), and stops heartbeating.
        Admitted later, it takes the prompt from the prefix cache or computes it;
        never reads. A decoder short of seats otherwise holds the producer's blocks
        for as long as its waves last, on heartbeats alone."""
        if self._prompt_reads is not None:
            assert self.connector_scheduler is not None
            self._prompt_reads.release_served(
                connector_output.finished_recving,
                self.connector_scheduler.request_finished,
            )


@amend("F5", ">=0.20.0,<0.22.0", name="NixlConnector")
@amend("F5", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnector")
class NixlBaseConnector:
    """F5 before v0.22: the same release, against the producer's fixed timeout
    (VLLM_NIXL_ABORT_REQUEST_TIMEOUT); the arrivals come from on_new_request, which
    F5 adds to the scheduler and the base connector (upstream's from v0.22)."""

    def on_new_request(self, request: "Request") -> None:
        """Every request of a remote prompt, from its arrival."""
        if self._prompt_reads is not None:
            assert self.connector_scheduler is not None
            self._prompt_reads.arrived(
                request, self.connector_scheduler.request_finished
            )

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """The producer releases a prompt as soon as its one read is done, before
        its timeout frees it under the children that a decoder short of seats
        admits later (each would notify a prompt the producer no longer holds)."""
        if self._prompt_reads is not None:
            assert self.connector_scheduler is not None
            self._prompt_reads.release_served(
                connector_output.finished_recving,
                self.connector_scheduler.request_finished,
            )


@amend("F5", ">=0.24.0")
@amend("F5", ">=0.20.0,<0.24.0", name="NixlConnector")
@amend("F5", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnector")
class NixlPullConnector:
    """F5: the pull connector's scheduler role decides who reads a prompt."""

    @call_at_end_of("__init__")
    def _init_prompt_reads(
        self, vllm_config: "VllmConfig", role: KVConnectorRole
    ) -> None:
        """One reader per remote prompt, unless switched off
        (kv_connector_extra_config["read_prompt_once"]) or the decoder has no
        prefix cache to serve the other requests from."""
        if role == KVConnectorRole.SCHEDULER:
            self._prompt_reads = PromptReads.for_decoder(
                vllm_config, "read_prompt_once"
            )


@amend("F12", ">=0.28.0")
class NixlPushConnector:
    """F12: the push connector's scheduler role decides who registers for a
    prompt."""

    @call_at_end_of("__init__")
    def _init_prompt_writes(
        self, vllm_config: "VllmConfig", role: KVConnectorRole
    ) -> None:
        """One registration per remote prompt, unless switched off
        (kv_connector_extra_config["write_prompt_once"]) or the decoder has no
        prefix cache to serve the other requests from."""
        if role == KVConnectorRole.SCHEDULER:
            self._prompt_reads = PromptWrites.for_decoder(
                vllm_config, "write_prompt_once"
            )
