# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py``.

F5 before v0.22: MultiConnector passes on_new_request to each of its connectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_patches._overlay import amend

if TYPE_CHECKING:
    from vllm.v1.request import Request


@amend("F5", ">=0.18.0,<0.22.0", after="update_state_after_alloc")
class MultiConnector:
    """F5 before v0.22: every connector hears of each arrival."""

    def on_new_request(self, request: "Request") -> None:
        """Each connector's on_new_request (upstream's fan-out from v0.22)."""
        for connector in self._connectors:
            connector.on_new_request(request)


@amend("F5", ">=0.22.0")
class MultiConnector:
    """F5 from v0.22: upstream's MultiConnector passes on_new_request on."""
