"""The transfer backend a PD server uses when none is given: SGLang's default, `mooncake`, when
its plugin is installed and usable here, else `tcp`. Prefill and decode decide on their own, so
a P with pd-mooncake and a D without it disagree: D refuses P at bootstrap naming both backends
(pdcore.disagg.decode), and the fix is to give both --disaggregation-transfer-backend."""

from __future__ import annotations

import logging

from pdcore.config import ServerArgs
from pdcore.plugins.host import transfer_backends

log = logging.getLogger("pdcore.plugins")

DEFAULT_BACKEND, FALLBACK_BACKEND = "mooncake", "tcp"


def default_transfer_backend() -> tuple[str, str]:
    """(backend, why) when --disaggregation-transfer-backend is not given."""
    reg = transfer_backends()
    if DEFAULT_BACKEND not in reg:
        return FALLBACK_BACKEND, (f"the {DEFAULT_BACKEND} backend is not installed "
                                  "(pip install ./plugins/pd-mooncake)")
    ok, reason = reg.get(DEFAULT_BACKEND).available()
    if not ok:
        return FALLBACK_BACKEND, f"the {DEFAULT_BACKEND} backend is not usable here: {reason}"
    return DEFAULT_BACKEND, f"the {DEFAULT_BACKEND} backend is installed and available"


def resolve_transfer_backend(args: ServerArgs) -> str | None:
    """Fill in args.disaggregation_transfer_backend in PD modes (None in unified mode); logs the
    choice and its reason when it was a default."""
    if args.disaggregation_mode == "null" or args.disaggregation_transfer_backend:
        return args.disaggregation_transfer_backend
    name, why = default_transfer_backend()
    args.disaggregation_transfer_backend = name
    log.info("transfer backend %s (default: %s); give prefill and decode the same "
             "--disaggregation-transfer-backend to choose", name, why)
    return name
