"""pd-mooncake: the Mooncake transfer engine as a pdserve transfer backend.

`plugin` registers the backend and the Mooncake memory pools (stdlib + pdcore only);
`engine` is the only module that imports the `mooncake` SDK.
"""
