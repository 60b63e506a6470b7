"""vCluster scheduling loops: ordering, placement, proposals to the quorum."""
