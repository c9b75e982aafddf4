# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py``.

NIXL producer release path (F2, F3) on v0.20 - v0.23: written once in
``nixl/base_worker.py`` and ``nixl/pull_worker.py`` (``into="worker.py"``).
"""
