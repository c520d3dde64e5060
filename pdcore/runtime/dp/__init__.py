"""Data-parallel replicas (`--dp-size N`), in one place: the handle over N replicas
(`client.DPEngineClient`), which replica a request goes to (`balance`), node 0's handle of a DP
rank on another node (`remote`), where each DP rank lives and its link to node 0 (`nodes`), and
what the DP flags must satisfy (`args`). DP attention inside the model is the engine's
(pdcore.engine.parallel). The server reaches all of this through pdcore.runtime's surface."""
