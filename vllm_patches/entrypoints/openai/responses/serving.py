# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/entrypoints/openai/responses/serving.py.

F26 (v0.19 - v0.20, where a response request takes KV-transfer params): a response
rejected before the engine saw it sends the engine a rejection notice (PR 41269, in
v0.21; ``OpenAIServing._notify_kv_transfer_rejection``).
"""

from typing import Any

from fastapi import Request

from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from vllm_patches._overlay import amend, filter_result_of, redirect_call_in


@amend("F26", ">=0.19.0")
class OpenAIServingResponses:
    @redirect_call_in("create_responses", "self._generate_with_builtin_tools")
    def _generate_in_engine(self, *args, **kwargs) -> Any:
        """Upstream's ``self._generate_with_builtin_tools``."""
        return self._call_into_engine(
            self._generate_with_builtin_tools, *args, **kwargs
        )

    @filter_result_of("create_responses")
    def _notify_rejection(
        self, result: Any, request: ResponsesRequest, raw_request: Request | None
    ) -> Any:
        """What ``create_responses`` returns."""
        return self._notify_kv_transfer_rejection(result, request, raw_request)
