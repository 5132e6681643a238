"""What the prefill and decode services share: the async engine loop, the worker settings,
metrics, proto conversions, and the launcher that starts a worker as a child process."""
