"""Built-in plugin: cpu/cuda platforms, torch/pinned/shm pools, tcp/shm/fake backends, planner."""
