"""What every worker process shares: async engine loop, gRPC server, metrics, CLI."""
