"""pdserve on Ascend NPUs: the `npu` platform, the `npu` memory pool and the `ascend` backend."""

from __future__ import annotations

__version__ = "0.1.0"
