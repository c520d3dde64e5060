"""pd-nixl: NVIDIA NIXL as a pdserve transfer backend.

`plugin` registers the backend (stdlib + pdcore only); `engine` is the only module that imports
the `nixl` SDK.
"""
