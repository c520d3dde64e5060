"""P's side of the PD protocol: the KV manager (`kv_manager`: rooms, D sessions, the bootstrap
server) with its room records (`rooms`), D-session table (`sessions`) and transfer workers
(`chunks`), and the scheduling extension that drives it (`sched`)."""

from pdcore.disagg.prefill.kv_manager import PrefillKVManager

__all__ = ["PrefillKVManager"]
