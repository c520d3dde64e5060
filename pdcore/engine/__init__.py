"""The serving engine: model, paged KV cache, scheduler, sampler."""
