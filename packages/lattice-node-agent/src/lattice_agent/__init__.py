"""Per-node agent: registration, heartbeats, desired-state reconcile, process runtime."""
