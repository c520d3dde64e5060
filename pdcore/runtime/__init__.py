"""The process side of a server: the scheduler process, TP rank processes and their group, the
lockstep that keeps every rank's scheduler identical, `run_node`, the in-process `LLMEngine`,
the attaching of a role extension, the engine handle the HTTP process holds (`handle`), and DP
replicas (`dp/`). It composes the engine (pdcore.engine) with the PD protocol (pdcore.disagg);
neither of those imports it.

What the server needs is exported here, and the server imports nothing else of this package
(tests/test_layers.py checks it): the engine handle (`EngineHandle`, the protocol every handle
implements) and its errors and states, `make_engine`
(the right handle for the arguments: one scheduler, DP replicas, DP ranks on other nodes), the
checks of the parallel flags, `run_node` (a further node of a multi-node server), and what the
server's start-up checks ask of the model the engine will load (`resolve_model`,
`default_model_file`: where the model is; `checked_quantization`: its quantization, against
--quantization, `checked_draft_quantization` the draft head's; `check_mtp_folder`: a NEXTN/MTP draft's layers), so the
server imports nothing of engine/model; and `lower_own_priority` (PDSERVE_HTTP_NICE)."""

from pdcore.engine.model.mtp import check_mtp_folder
from pdcore.engine.model.quant_config import checked_draft_quantization, checked_quantization
from pdcore.engine.model.source import default_model_file, resolve_model
from pdcore.runtime.dp.client import DPEngineClient
from pdcore.runtime.engine_handle import EngineHandle
from pdcore.runtime.engines import make_engine
from pdcore.runtime.handle import EngineClient, EngineError, EngineState, SchedulerTarget, new_rid
from pdcore.runtime.lifeline import lower_own_priority
from pdcore.runtime.node import run_node
from pdcore.runtime.topology import check_parallel_args

__all__ = ["DPEngineClient", "EngineClient", "EngineError", "EngineHandle", "EngineState",
           "SchedulerTarget", "check_mtp_folder", "check_parallel_args",
           "checked_draft_quantization", "checked_quantization",
           "default_model_file", "lower_own_priority", "make_engine", "new_rid", "resolve_model",
           "run_node"]
