"""pdserve services: the engine and the gRPC workers around it."""
