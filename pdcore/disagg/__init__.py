"""PD disaggregation, owned by the core: bootstrap, control plane, sender/receiver state machines.

The tree shows the two sides and what they share:
- `prefill/` (P, the sender): kv_manager (PrefillKVManager), rooms, sessions (D sessions it
  serves), chunks (transfer workers), sched (the scheduling extension);
- `decode/` (D, the receiver): kv_manager (DecodeKVManager), rooms, resolve (bootstrapping with
  P), peers (heartbeat verdicts), sched (the scheduling extension);
- shared by both: states (KVPoll), aux (aux rows), wire (messages), bootstrap (P's HTTP server,
  D's client), control (zmq control plane), common (counters, backend and planner set-up),
  manager (KVManager: what both roles share), role (what both extensions share), scheduling
  (builds a role's extension), sessions (a D session as P holds it), staging (the staging
  ring), heartbeat (D -> P liveness), transfer_stats, agree, workers.
"""
