Feature: Ended allocations move to the history store
  The quorum keeps an ended allocation only for a retention window
  (storage.allocation_retention_hours); afterwards its final record lives in the
  history store, and `lattice history` and `lattice status ID` read it from there like
  sacct reads the accounting database. Every step runs against a real local cluster
  whose retention is a couple of seconds.

  Background:
    Given a running Lattice cluster that keeps ended allocations live for 2 seconds

  Scenario: A job that ended long ago still shows in the history with its exit code
    When alice submits "short-job", which exits with code 3
    And the job ended more than 2 seconds ago
    Then the quorum's live state no longer holds the job
    And "lattice history" lists "short-job" as Failed with exit code 3
    And "lattice status" of the job still says Failed

  Scenario: The history's time window and limit apply to jobs that left the quorum
    When alice submits "first-job", which exits with code 1
    And the job ended more than 2 seconds ago
    And alice submits "second-job", which exits with code 2
    And the job ended more than 2 seconds ago
    Then the quorum's live state no longer holds the job
    And "lattice history --limit 1" lists only "second-job"
    And "lattice history --since" a moment after "first-job" ended lists "second-job" but not "first-job"
