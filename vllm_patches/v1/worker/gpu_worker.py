# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/worker/gpu_worker.py: start the KV connector's deferred
CPU cache registration once the worker finished warm-up and CUDA-graph capture.

After compile_or_warm_up_model() no capture runs again (elastic EP, which would, is
rejected); from v0.33 the hook filters _compile_or_warm_up_model()'s result.
"""

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

from vllm_patches._overlay import amend, filter_result_of


@amend("F4", ">=0.19.0")
class Worker:
    def _start_async_register_cache(self) -> None:
        """Let a connector with ``start_async_register_cache`` (SimpleCPUOffload
        with ``async_register_cache``) start its CUDA work now that no graph is
        being captured (vllm#46933: cudaHostRegister during a capture fails with
        cudaErrorStreamCaptureUnsupported or invalidates the capture)."""
        if has_kv_transfer_group():
            start = getattr(get_kv_transfer_group(), "start_async_register_cache", None)
            if start is not None:
                start()


@amend("F4", ">=0.19.0,<0.33.0")
class Worker:
    @filter_result_of("compile_or_warm_up_model")
    def _after_warm_up(self, compilation_times):
        self._start_async_register_cache()
        return compilation_times


@amend("F4", ">=0.33.0")
class Worker:
    @filter_result_of("_compile_or_warm_up_model")
    def _after_warm_up(self, compilation_times):
        self._start_async_register_cache()
        return compilation_times
