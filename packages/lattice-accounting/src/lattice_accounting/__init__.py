"""Lattice accounting: the double-entry ledger, pre-run reservations, the job charger,
the watchdog and the Waldur push (feature flag ``accounting.enabled``)."""
