"""``kvcached_provider``: the ``org.vllm-hust.kvcached`` sibling bundle.

kvcached (``ovg-project/kvcached``) replaces vLLM's KV block pool with an elastic,
virtual-memory-backed one. This package is the glue a vLLM-HUST deployment needs around it;
kvcached itself stays an optional dependency that is never imported at module import time:

- :mod:`kvcached_provider.checks` -- pre-launch checks the extension manager runs
  (``vllm_hust_ext.bundle_checks`` entry point); metadata and filesystem only.
- :mod:`kvcached_provider.signals` -- cheap in-process capacity signals for the BidKV policy
  (memory limit, shrink state, available blocks, free physical pages, pages a victim returns).
- :mod:`kvcached_provider.limit` -- revisioned memory limits with a persisted, monotonically
  increasing revision, a guard against mixing with ``kvctl limit``, and the request/answer
  transport to the engine process.
- :mod:`kvcached_provider.activation` -- the vLLM general plugin that runs the limit
  responder inside the engine process.
- :mod:`kvcached_provider.cli` -- the ``kvcached-provider`` command.
"""

from __future__ import annotations

EXTENSION_ID = "org.vllm-hust.kvcached"
MIN_KVCACHED_VERSION = "0.1.6"

__all__ = ["EXTENSION_ID", "MIN_KVCACHED_VERSION"]
