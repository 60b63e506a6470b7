"""The lattice command line."""
