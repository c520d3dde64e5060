"""pdcore entry point `staging`: registers the `staging` transfer planner.

Imports only stdlib and pdcore; the planner (which imports torch) loads when it is selected,
i.e. when SGLANG_DISAGG_STAGING_BUFFER=1.
"""

from __future__ import annotations

from pdcore.plugins import hookimpl
from pdcore.plugins.hookspecs import Register
from pdcore.plugins.lazy import importable, lazy

_PATH = "pd_staging.planner:StagingTransferPlanner"


@hookimpl
def pd_register_transfer_planners(register: Register) -> None:
    register("staging", lazy(_PATH), availability=importable(_PATH),
             description=("different TP sizes: gather a chunk's head slices into one buffer, "
                          "one bulk write into decode's staging ring, scatter into its pages "
                          "(SGLANG_DISAGG_STAGING_BUFFER=1 on both sides)"))
