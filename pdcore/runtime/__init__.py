"""The process side of a server: the scheduler process, TP rank processes and their group, the
lockstep that keeps every rank's scheduler identical, `run_node`, the in-process `LLMEngine`,
and the attaching of a role extension. It composes the engine (pdcore.engine) with the PD
protocol (pdcore.disagg); neither of those imports it."""
