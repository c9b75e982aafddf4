# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/entrypoints/openai/engine/serving.py.

F26 (v0.18 - v0.20): a request with a remote prefill that the serving layer rejects
before the engine sees it makes the engine free what its prefill holds (PR 41269, in
v0.21). The serving classes' hooks call these methods.
"""

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar

from fastapi import Request

from vllm.entrypoints.openai.engine.protocol import ErrorResponse

from vllm_patches._overlay import amend


@amend("F26", ">=0.18.0")
class OpenAIServing:
    # Whether the serving call in this task passed its engine call: from there the
    # engine may hold the request, and a rejection notice would free its remote
    # prefill under the decoder's READ, so only the engine's own finish frees it.
    _kv_transfer_past_engine_call: ClassVar[ContextVar[bool]] = ContextVar(
        "kv_transfer_past_engine_call", default=False
    )
    # The notices on their way to the engine (the event loop keeps only weak
    # references to its tasks).
    _kv_transfer_notices: ClassVar[set["asyncio.Future[None]"]] = set()

    def _call_into_engine(self, call: Callable[..., Any], /, *args, **kwargs) -> Any:
        """``call(*args, **kwargs)``, a serving call's way into the engine; remembers
        for the rest of the serving call that the request may be in the engine."""
        self._kv_transfer_past_engine_call.set(True)
        return call(*args, **kwargs)

    def _notify_kv_transfer_rejection(
        self, result: Any, request: Any, raw_request: Request | None
    ) -> Any:
        """``result``, a serving call's; when it rejects a request with a remote
        prefill before the engine saw it, first sends the engine a rejection notice
        (vllm#41269: else the producer holds the prompt until its abort timeout)."""
        past_engine_call = self._kv_transfer_past_engine_call.get()
        self._kv_transfer_past_engine_call.set(False)
        params = getattr(request, "kv_transfer_params", None)
        notify = getattr(
            self.engine_client, "notify_kv_transfer_request_rejected", None
        )
        if (
            past_engine_call
            or not isinstance(result, ErrorResponse)
            or not params
            or not params.get("do_remote_prefill")
            or notify is None
        ):
            return result
        notice = asyncio.ensure_future(
            notify(
                request.request_id,
                params,
                data_parallel_rank=self._get_data_parallel_rank(raw_request),
            )
        )
        self._kv_transfer_notices.add(notice)
        notice.add_done_callback(self._kv_transfer_notice_done)
        return result

    @classmethod
    def _kv_transfer_notice_done(cls, notice: "asyncio.Future[None]") -> None:
        cls._kv_transfer_notices.discard(notice)
        if not notice.cancelled() and notice.exception() is not None:
            logger.warning(
                "Failed to notify the KV connector of a rejected request: %s",
                notice.exception(),
            )
