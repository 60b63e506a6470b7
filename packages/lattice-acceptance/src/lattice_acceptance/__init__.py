"""BDD acceptance scenarios run against a real local cluster."""
