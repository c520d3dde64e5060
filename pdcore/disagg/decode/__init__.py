"""D's side of the PD protocol: the KV manager (`kv_manager`: rooms, the prefill instances they
resolve to, the heartbeat) with its records (`rooms`), bootstrapping with P (`resolve`) and
what the heartbeat's verdicts do (`peers`), and the scheduling extension that drives it
(`sched`)."""

from pdcore.disagg.decode.kv_manager import DecodeKVManager

__all__ = ["DecodeKVManager"]
