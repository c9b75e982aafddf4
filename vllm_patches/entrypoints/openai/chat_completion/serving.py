# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/entrypoints/openai/chat_completion/serving.py.

F26 (v0.18 - v0.20): a chat completion rejected before the engine saw it sends the
engine a rejection notice (PR 41269, in v0.21;
``OpenAIServing._notify_kv_transfer_rejection``).
"""

from typing import Any

from fastapi import Request

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_patches._overlay import amend, filter_result_of, redirect_call_in


@amend("F26", ">=0.18.0")
class OpenAIServingChat:
    @redirect_call_in("create_chat_completion", "self.engine_client.generate")
    def _generate_in_engine(self, *args, **kwargs) -> Any:
        """Upstream's ``self.engine_client.generate``."""
        return self._call_into_engine(self.engine_client.generate, *args, **kwargs)

    @filter_result_of("create_chat_completion")
    def _notify_rejection(
        self, result: Any, request: ChatCompletionRequest, raw_request: Request | None
    ) -> Any:
        """What ``create_chat_completion`` returns."""
        return self._notify_kv_transfer_rejection(result, request, raw_request)
