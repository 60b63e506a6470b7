"""Public gRPC and REST API of lattice-server."""
