Feature: Scheduled snapshots and restoring the quorum from a backup
  The leader writes a snapshot of the quorum state on a schedule
  (backup.schedule_interval_seconds) to backup.destination, as snap-<UTC time>.bin and
  snap-latest.bin, and deletes the oldest beyond backup.retention_count. `lattice admin
  backup verify` without a file checks the latest scheduled snapshot. After a disaster
  an administrator starts a fresh quorum from a backup (`lattice-server --recover-from
  FILE --bootstrap`): every allocation, node, tenant and vCluster is back as it was
  when the backup was taken, and the cluster goes on working.

  The module's own real local cluster: one quorum member and one node agent, a snapshot
  every second, two kept.

  Background:
    Given a running Lattice cluster of one quorum member and 1 node that takes a snapshot every second and keeps 2

  Scenario: The leader's scheduled snapshots are pruned to the retention count and the latest one verifies
    When the leader has taken at least 4 scheduled snapshots
    Then the snapshot directory never holds more than 2 timestamped snapshots, besides snap-latest.bin
    And no scheduled snapshot failed
    And "lattice admin backup verify" without a file accepts the latest scheduled snapshot

  Scenario: An administrator restores a backup into a fresh quorum and finds the cluster as it was
    Given a tenant "bio" with a vCluster "gpu" that no scheduler serves
    And a completed job and a job of "bio" waiting in "gpu"
    When the administrator backs the cluster up with lattice admin backup create --to a local file
    And the quorum member is stopped and its Raft data directory wiped
    And lattice-server is started with --recover-from the backup file
    Then every allocation, node, tenant and vCluster is as it was when the backup was taken
    And a job submitted after the restore runs to completion
