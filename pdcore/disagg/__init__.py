"""PD disaggregation, owned by the core: bootstrap, control plane, sender/receiver state machines.

Modules: states (KVPoll), aux (aux rows), wire (messages), bootstrap (P's HTTP server, D's
client), control (zmq control plane), common (counters, backend and planner set-up),
sessions/prefill_rooms/workers (P internals), prefill (PrefillKVManager), decode
(DecodeKVManager), heartbeat (D -> P liveness).
"""
