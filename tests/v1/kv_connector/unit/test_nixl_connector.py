"""Amendments to upstream's tests/v1/kv_connector/unit/test_nixl_connector.py.

An overlay of an upstream test module (a fix's ``test_overlays``), spliced like the
overlays under vllm_patches/: each marked definition replaces upstream's of the same
name, so the fix's patch carries the upstream test it changes and no lane deselects it.
The functions run in upstream's module, where the names they use are bound (its
imports, its fixtures, FakeNixlWrapper and FakeNixlConnectorWorker): they are not imported here.
"""

from vllm_patches._overlay import amend


@amend("F3", ">=0.32.0")
@patch(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker.NixlWrapper",
    FakeNixlWrapper,
)
def test_notification_after_expiry_is_counted(default_vllm_config, dist_init):
    # A notification for a request that was never registered may race its
    # registration (it is staged until then): only one for a request released
    # without its pull (here: its lease expired) counts as after expiry.
    block_size = maybe_update_block_size(16)
    vllm_config = create_vllm_config(block_size=block_size)
    connector = NixlConnector(
        vllm_config,
        KVConnectorRole.WORKER,
        make_kv_cache_config(block_size=block_size),
    )
    connector.connector_worker = FakeNixlConnectorWorker(
        vllm_config, connector.engine_id, hand_shake_latency=0
    )
    worker = connector.connector_worker
    worker._reqs_to_process.update({"known", "expired"})
    worker._reqs_to_send["known"] = time.perf_counter() + 10
    worker._reqs_to_send["expired"] = time.perf_counter() - 1
    assert worker.get_transfer_results().finished_sending == {"expired"}
    worker.nixl_wrapper.get_new_notifs = MagicMock(
        return_value={"decode-agent": [b"known:1", b"expired:1"]}
    )

    assert worker._get_new_notifs() == {"known"}

    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, NixlKVConnectorStats)
    assert stats.data["num_notifications_after_expiry"] == [1]
