"""Shared vocabulary of Lattice: domain types, state machines, config, errors, wire contract."""
