# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``.

The NIXL connector up to v0.19, one module: what F2, F3 and F5 change here is
written under ``nixl/`` (``into=``), but for F2's per-release notification count.
"""

from __future__ import annotations

from vllm_patches._overlay import amend


@amend("F2", ">=0.18.0,<0.20.0")
class NixlConnectorWorker:
    """F2: notifications per decode reader, v0.18 - v0.19 (from the decoder's TP)."""

    def _notifications_per_reader(self, tp_size: int) -> int:
        """How many notifications one decode request sends this worker: one per
        decode rank reading from it (what _get_new_notifs waits for)."""
        assert self.kv_topo is not None
        tp_ratio = self.kv_topo.tp_ratio(tp_size)
        return -tp_ratio if tp_size > self.world_size else 1
