# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``.

NIXL push mode (v0.24+), decoder side:

- F9: the step's metadata names the requests whose registration the decoder's
  scheduler gave up on, so that its workers report each as a failed receive.
"""

from vllm_patches._overlay import amend, call_at_end_of


@amend("F9", ">=0.24.0")
class NixlConnectorMetadata:
    """F9: one more field, set by the push scheduler's registration watchdog."""

    @call_at_end_of("__init__")
    def _init_expired_push_registrations(self) -> None:
        # D-side (push): requests whose registration timed out without a push
        # completion; the workers report each as a failed receive.
        self.push_expired_registrations: set[str] = set()
