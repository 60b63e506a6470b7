Feature: Diagnostics of a running job (lattice diag)
  `lattice diag ID` gathers what a user needs to tell a slow or stuck job from a sick
  node: the network around the allocation (dragonfly group span, congestion,
  inter-node bandwidth), the storage it works in (each node's agent checks the mounts
  of the job's working directory and scratch: free space and a timed write, fsync and
  read) and its GPUs, each line with a health mark (✓ ok, ⚠ warning, ✗ critical, – no
  data). `--network` and `--storage` show one section; `-o json` is the structured
  answer. Every step runs against a real local cluster.

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario: A running job's lattice diag shows its working directory's mount and the mark its figures earn
    Given a job that runs until released
    When the user runs "lattice diag" on the job
    Then the storage section shows the job's working directory on the node that runs it
    And its mark is the one its free space and probe time earn (✓ under 100 ms and over 10 % free, ⚠ under 1 s and over 2 % free, else ✗)
    And lattice diag -o json reports that directory's mount with its free space and probe time
    And lattice diag --network shows the group span of the job's node and no storage section
