"""The gRPC (grpclib) services of lattice-server: one adapter module per proto service,
assembled by lattice_api.grpc.server."""
