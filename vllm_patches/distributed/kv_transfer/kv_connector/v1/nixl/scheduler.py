# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py``.

NIXL consumer (decode) scheduler side, heartbeats (KV leases, from v0.22):

- F6: the children of a parallel-sampling request (``n > 1``) share one remote
  request id; the heartbeat that renews its lease on the producer lasts until
  the last child that needs it stops, not the first.

v0.22 - v0.23; from v0.24 the scheduler's shared state lives in
``nixl/base_scheduler.py``. Everything this module receives is written there,
once for both layouts (``into="scheduler.py"``).
"""
