"""Async Python client for the Lattice REST API."""
