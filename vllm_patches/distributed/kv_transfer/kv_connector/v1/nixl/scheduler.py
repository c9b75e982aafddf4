# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py``.

NIXL decode scheduler heartbeats on v0.22 - v0.23: written once in
``nixl/base_scheduler.py`` (``into="scheduler.py"``).
"""
