Feature: Backups of the quorum state
  An administrator takes a consistent backup of the quorum state (allocations, nodes,
  tenants, vClusters, the audit log) with `lattice admin backup create`: one file with
  a checksum, the format version and the Raft term and index it was taken at. `lattice
  admin backup verify` checks a file (checksum, version, Raft metadata, full decoding)
  and says what it holds; a file with a single changed byte is refused with the reason,
  and so is a restore from it. Restoring a good file needs a restart into a fresh
  quorum (`lattice-server --recover-from FILE --bootstrap`), which `lattice admin
  backup restore` spells out.

  The scenario shares the module's real local cluster (one quorum member, two agents).

  Scenario: An administrator backs up the cluster, the backup verifies, and a copy with one changed byte is refused by verify and restore
    Given a running Lattice cluster with 2 nodes and a completed job
    When the administrator runs lattice admin backup create --to a local file
    Then the file is written and lattice admin backup verify accepts it, counting 2 nodes and the job
    And lattice admin backup restore of the file prints the restart steps with --recover-from
    When one byte in the middle of a copy of the file is changed
    Then lattice admin backup verify rejects the copy with "checksum mismatch" and a hint
    And lattice admin backup restore rejects the copy too
