"""gRPC API of pdserve (generated stubs: regenerate with `make protos`)."""
