"""The inference engine: model, paged KV block pool, scheduler, sampler (no I/O)."""
