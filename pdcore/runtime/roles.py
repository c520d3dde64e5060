"""Attaching a role extension: the one place where the engine and the PD protocol meet. In
`--disaggregation-mode null` the scheduler keeps its default (no-op) extension."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcore.engine.build import Engine


def attach_role(engine: Engine) -> None:
    if engine.args.disaggregation_mode == "null":
        return
    from pdcore.disagg.scheduling import make_extension
    from pdcore.engine.sched.runtime_api import RuntimeAPI

    ext, info = make_extension(engine.args, engine.kv, engine.scheduler)
    RuntimeAPI(engine.scheduler).attach_role(ext)
    engine.info = dataclasses.replace(engine.info, **info)  # its fields (a misspelt one: error)
