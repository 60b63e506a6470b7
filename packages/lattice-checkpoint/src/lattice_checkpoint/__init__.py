"""Checkpoint broker."""
