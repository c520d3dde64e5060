"""Shared settings for the pd-nixl tests (set before NIXL/UCX load, inherited by children).

- UCX_NET_DEVICES=lo: only loopback carries test traffic (UCX otherwise adds the machine's
  other interface as a lane);
- UCX_MODULES=^ib: without it every process that loaded the UCX backend segfaults at exit
  (in the bundled libnl, during _dl_fini). Pure shared-memory UCX transports are never used:
  NIXL's peer error handling refuses them, and without it a dead peer hangs transfers.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
