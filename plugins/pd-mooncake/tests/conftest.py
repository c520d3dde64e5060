"""Shared settings for the pd-mooncake tests.

Mooncake reads its own variables from the process environment: quiet logs for every engine in
this process and in the receiver processes it spawns. Tests only ever address 127.0.0.1 (the
library's listening sockets bind 0.0.0.0; that is the library, we never target other hosts).
"""

from __future__ import annotations

import os

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
