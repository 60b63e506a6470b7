"""The API's operations, one module per proto service, independent of transport.

The gRPC adapters (lattice_api.grpc) and the REST routes (lattice_api.rest) call these
with an Identity and plain data, after the permission table has been checked. Writes
become quorum commands; reads go through named queries (lattice_quorum.queries).
"""
