# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: a decode engine reads the one parallel-sampling sibling (``n > 1``) it was
  told about once per child: hold that sibling until all its reads are in, then
  release it with the siblings registered with it; siblings that register
  later are released when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

v0.20 - v0.23; from v0.24 the pull worker lives in ``nixl/pull_worker.py``
and its shared state in ``nixl/base_worker.py``. Everything this module
receives is written there, once for every layout (``into="worker.py"``).
"""
