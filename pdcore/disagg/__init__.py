"""PD disaggregation, owned by the core: bootstrap, control plane, sender/receiver state machines.

Modules: states (KVPoll), aux (aux rows), wire (messages), bootstrap (P's HTTP server, D's
client), control (zmq control plane), common (counters, backend and planner set-up), manager
(KVManager: what both roles share), prefill (PrefillKVManager) with sessions/prefill_sessions/
prefill_rooms/workers (its internals), decode (DecodeKVManager) with decode_rooms, heartbeat
(D -> P liveness).
"""
