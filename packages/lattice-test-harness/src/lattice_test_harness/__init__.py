"""Pytest fixtures that start real local Lattice clusters."""
