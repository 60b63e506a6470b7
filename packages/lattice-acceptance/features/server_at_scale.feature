Feature: The server's cost stays flat as its state grows
  A quorum member holds every live allocation and node in memory. Two costs used to grow
  with that state: the garbage collector's full walk of every record (a pause with
  nothing committed, longer than a Raft election timeout at 100,000 allocations), and
  turning records into gRPC messages through generic dictionaries (half the server's
  CPU per submission). The collector now leaves the long-lived records out of its walks
  and shows its pauses to operators; messages are built directly, exactly as before, and
  a bulk submitter may ask for the ids alone.

  The cluster is real: one quorum member and two node agents, shared by the scenarios.

  Scenario: Operators see the garbage collector's pauses on the server's metrics
    Given a running Lattice cluster with 2 nodes
    When the operator reads the server's metrics
    Then they show the collector's pauses by generation, the longest full collection and the objects kept out of its walks

  Scenario: A job submitted over gRPC is answered with the allocation as stored
    Given a running Lattice cluster with 2 nodes
    When the user submits a job with environment variables and tags over gRPC
    Then the answer carries the allocation's id, entrypoint, environment and tags
    And lattice status of that allocation shows the same entrypoint, environment and tags

  Scenario: A bulk submitter asks for the ids alone, and the job is stored and runs all the same
    Given a running Lattice cluster with 2 nodes
    When the user submits a job with environment variables and tags over gRPC, asking for the ids alone
    Then the answer carries the allocation's id and no allocation
    And lattice status of that allocation shows the same entrypoint, environment and tags
