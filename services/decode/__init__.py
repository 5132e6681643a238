"""Decode worker: pulls KV blocks, runs the continuous batch, streams tokens."""
