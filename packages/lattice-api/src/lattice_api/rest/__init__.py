"""The REST gateway (aiohttp) under /api/v1: one routes module per proto service, each
with ``add_routes(router, ops)``, assembled by lattice_api.rest.app."""
