# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``.

F5 before v0.22: the scheduler-side hook upstream adds in v0.22, on_new_request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_patches._overlay import amend

if TYPE_CHECKING:
    from vllm.v1.request import Request


@amend("F5", ">=0.18.0,<0.22.0", after="build_connector_meta")
class KVConnectorBase_V1:
    """F5 before v0.22: connectors may note each request as it arrives."""

    def on_new_request(self, request: "Request") -> None:
        """Called by the scheduler as a request arrives, before any seat admits it;
        a no-op unless a connector overrides it (upstream's hook from v0.22)."""
        return


@amend("F5", ">=0.22.0")
class KVConnectorBase_V1:
    """F5 from v0.22: upstream defines on_new_request."""
