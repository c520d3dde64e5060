"""Model implementations (llama family) over the paged KV pool."""
