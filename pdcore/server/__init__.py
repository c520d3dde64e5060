"""HTTP side of one pdserve server: the FastAPI app, its routes, the request planner, output
assembly and metrics, over the engine handle of `pdcore.runtime`. Tool calls and reasoning live
in `tools/`, what runs before the engine starts (flags, preflight) in `startup/`; the HTTP gates
it shares with the router (schemas, limits, auth, connections, tracing) in `pdcore.edge`."""
