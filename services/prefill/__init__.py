"""Prefill worker: computes prompts, pins their KV blocks under a lease, serves them."""
