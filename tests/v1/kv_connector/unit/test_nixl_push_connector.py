"""Amendments to upstream's tests/v1/kv_connector/unit/test_nixl_push_connector.py.

An overlay of an upstream test module (a fix's ``test_overlays``), spliced like the
overlays under vllm_patches/: each marked definition replaces upstream's of the same
name, so the fix's patch carries the upstream test it changes and no lane deselects it.
The members run in upstream's module, where the names they use are bound (its
imports and its stub worker): they are not imported here.
"""

from vllm_patches._overlay import amend


@amend("F18", ">=0.30.0")
class TestPushWriterNotifs:
    """A completed push is reported done sending when its WRITEs complete."""

    def test_completed_push_send_waits_for_consumer_notif(self):
        """P-side sends are completed by local WRITE-handle completion."""
        # Changed: a push decoder sends no notification when a WRITE lands, so the
        # producer reports the send done once all its WRITEs completed (as before
        # v0.30.0 and from v0.31.0), not after a consumer notif.
        w = self._pollable_worker()
        request_id = self._make_sending_req(w)
        w.nixl_wrapper.check_xfer_state.return_value = "DONE"

        results = w.get_transfer_results()

        assert request_id in results.finished_sending
        assert request_id not in w._reqs_to_send
        assert request_id not in w._sending_transfers
        assert w.get_transfer_results().finished_sending == set()
