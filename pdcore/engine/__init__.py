"""The serving engine, by concern: `model/` (families, weights, one forward pass), `kv/` (the
paged KV cache and prefix cache), `sched/` (the scheduler, sampling, speculative decoding),
`parallel/` (data-parallel attention), `native/` (the C++ kernels); `build` assembles an engine.
The messages between the HTTP process and the scheduler are `pdcore.messages`."""
