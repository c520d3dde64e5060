"""The KV cache: the pool tensors per layer (`cache`), page allocation (`blocks`), the
scheduler's page bookkeeping per request (`pages`), and the radix prefix cache (`radix`)."""
