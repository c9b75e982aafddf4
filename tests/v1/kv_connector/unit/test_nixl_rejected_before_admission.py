# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request the decoder rejects before admission frees the producer's prompt at once.

A P/D decoder's serving layer that rejects a request with a remote prefill (a chat
template or validation error, an unknown model) never let the engine see it, so the
NIXL producer held the prompt's blocks until VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
Upstream PR vllm-project/vllm#41269 (v0.21.0) sends the engine a notice, which its
connector turns into the empty receive that frees them. The rejection tests fail on
stock v0.18.0 .. v0.20.2 and pass with the fix.
"""

import asyncio
import inspect
from collections.abc import AsyncGenerator
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import pytest

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.request import Request

from .utils import create_request, create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

# Event-loop turns a notice may take to reach the scheduler (it takes one).
NOTICE_TURNS = 5
SERVED_MODEL = "served-model"


class InProcessEngineCore:
    """EngineCore's own add and abort paths, on one scheduler."""

    add_request = EngineCore.add_request
    abort_requests = EngineCore.abort_requests

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler


class InProcessFrontEnd:
    """AsyncLLM as far as these requests go, its engine core in process."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.vllm_config = scheduler.vllm_config
        self.core = InProcessEngineCore(scheduler)
        self.engine_core = self
        # assign_request_id is a static method.
        self.input_processor = InputProcessor
        self.model_config = MagicMock(
            max_model_len=64, generation_config="vllm", override_generation_config={}
        )
        self.model_config.get_diff_sampling_param.return_value = {}
        self.renderer = MagicMock()
        self.io_processor = MagicMock()
        self.errored = False
        self.generate_calls = 0

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.core.add_request(Request.from_engine_core_request(request, None))

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """The client disconnects while the engine serves the request."""
        self.generate_calls += 1
        raise asyncio.CancelledError
        yield

    def __getattr__(self, name: str) -> Any:
        # AsyncLLM's other methods, bound to this front end.
        return getattr(AsyncLLM, name).__get__(self)


def _serving(kind: str, front_end: InProcessFrontEnd) -> Any:
    """The OpenAI serving class of ``kind``, serving SERVED_MODEL."""
    cls = OpenAIServingChat if kind == "chat" else OpenAIServingCompletion
    models = MagicMock(lora_requests={})
    models.is_base_model.side_effect = lambda name: name == SERVED_MODEL
    render = MagicMock()
    # The rendered prompt: three tokens.
    render.render_completion = AsyncMock(return_value=[{"prompt_token_ids": [1, 2, 3]}])
    # The renderer's argument, renamed in v0.30.
    renderer = (
        "online_renderer"
        if "online_renderer" in inspect.signature(cls.__init__).parameters
        else "openai_serving_render"
    )
    if kind == "chat":
        return cls(
            front_end,
            models,
            "assistant",
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            **{renderer: render},
        )
    serving = cls(front_end, models, request_logger=None, **{renderer: render})
    serving._extract_prompt_len = lambda prompt: 3
    return serving


def _request(kind: str, model: str, kv_transfer_params: dict[str, Any]) -> Any:
    if kind == "chat":
        return ChatCompletionRequest(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            kv_transfer_params=kv_transfer_params,
        )
    return CompletionRequest(
        model=model, prompt="hi", kv_transfer_params=kv_transfer_params
    )


def _serve(
    kind: str, scheduler: Any, model: str, kv_transfer_params: dict[str, Any]
) -> tuple[Any, InProcessFrontEnd]:
    """What the serving call returns, once every notice reached the engine."""
    front_end = InProcessFrontEnd(scheduler)
    serving = _serving(kind, front_end)
    request = _request(kind, model, kv_transfer_params)
    create = (
        serving.create_chat_completion if kind == "chat" else serving.create_completion
    )

    async def serve() -> Any:
        result = await create(request, None)
        for _ in range(NOTICE_TURNS):
            await asyncio.sleep(0)
        return result

    return asyncio.run(serve()), front_end


def _remote_prefill(request_id: int) -> dict[str, Any]:
    params = create_request(request_id=request_id, do_remote_prefill=True)
    assert params.kv_transfer_params is not None
    return params.kv_transfer_params


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_rejected_request_frees_the_producers_prompt(kind: str):
    """A request with a remote prefill for a model the decoder does not serve makes
    its NIXL connector send the producer the empty receive that frees the prompt,
    without ever scheduling it (vllm#41269)."""
    scheduler = create_scheduler(create_vllm_config())
    params = _remote_prefill(7)

    result, front_end = _serve(kind, scheduler, "another-model", params)

    assert result.error.code == 404
    assert front_end.generate_calls == 0
    assert not scheduler.requests, "the notice ends as it is added"
    output = scheduler.schedule()
    assert not output.scheduled_new_reqs
    reqs_to_recv = output.kv_connector_metadata.reqs_to_recv
    assert len(reqs_to_recv) == 1, "the producer is notified once"
    (meta,) = reqs_to_recv.values()
    assert meta.local_block_ids == []
    assert meta.remote.request_id == "prefill-7"
    # The client's params are as sent: the connector changed a copy.
    assert params["do_remote_prefill"] is True


def test_request_without_remote_prefill_sends_no_notice():
    """A rejected request that holds nothing on a producer sends the engine nothing."""
    scheduler = create_scheduler(create_vllm_config())
    params = create_request(request_id=8, do_remote_decode=True).kv_transfer_params
    assert params is not None

    result, _ = _serve("completion", scheduler, "another-model", params)

    assert result.error.code == 404
    assert not scheduler.requests
    assert not scheduler.schedule().kv_connector_metadata.reqs_to_recv


def test_error_past_the_engine_call_sends_no_notice():
    """Once a serving call passed its engine call, the engine may hold the request
    and READ the prompt: an error it returns then (here the client disconnected)
    sends no notice, which would free the prompt under that READ."""
    scheduler = create_scheduler(create_vllm_config())

    result, front_end = _serve(
        "completion", scheduler, SERVED_MODEL, _remote_prefill(9)
    )

    assert result.error.message == "Client disconnected"
    assert front_end.generate_calls == 1
    assert not scheduler.requests
    assert not scheduler.schedule().kv_connector_metadata.reqs_to_recv
