Feature: Task groups
  A task group (a job array) runs one command once for every index of a range, each
  run an allocation of its own that finds its index in LATTICE_TASK_INDEX:
  `lattice submit --task-group=0-99%20 script.sh` runs indexes 0 to 99, at most 20 at a
  time. `lattice status` shows the group on one row, and the group's tasks when asked
  for the group. Every step runs against a real local cluster: a quorum member, a
  scheduler and two node agents on this machine.

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario: A task group runs every index once, never more at a time than its concurrency
    When I submit a task group with lattice submit --task-group=0-5%1 whose tasks print "task-" and their index
    Then lattice confirms "Submitted task group" with "(6 tasks, at most 1 running)"
    And the group has 6 tasks, with the indexes 0 to 5
    And every task ends Completed and lattice logs of each show "task-" and its index
    And no two tasks ran at the same time, although 2 nodes were free
    And lattice status --all shows the group on one row, Completed, with nodes "1×6"
    And lattice status of the group with -o json lists its 6 tasks

  Scenario: A task group whose range ends before it starts is rejected with a hint
    When I run "lattice submit --task-group=9-3 --walltime=5m -- true"
    Then the submission is rejected with an error mentioning 'invalid task group '9-3''
    And the error carries a "Hint:" line
    And no allocation was stored
