"""What both sides of the wire share, below services and router: tracing, sampling parameters
and their proto form, the cluster-token header, the ready line, one prefill-release client, and
settings declared once on config dataclasses. Nothing here imports torch or the engine."""
