Feature: Live metrics of a job (lattice top)
  Node agents measure every allocation they run (CPU, memory, I/O; GPUs where there
  are any), attribute what they measure to the allocation through its cgroup scope or
  process group, aggregate it per window (mean, percentiles, max) and push it to the
  cluster's time-series database. `lattice top ID` shows the latest values, summed or
  averaged across the allocation's nodes, or one row per node; the user never talks to
  the database, the API asks it for that allocation only.

  The cluster is real: one quorum member, two node agents and a VictoriaMetrics, with
  2-second aggregation windows so that a scenario sees data within seconds.

  Scenario: A job that keeps a core busy shows in lattice top within two windows
    Given a Lattice cluster with 2 nodes and a metrics database
    When the user submits a job that keeps one core busy for a while
    And the job is running
    Then within two aggregation windows lattice top shows its CPU utilization above 50 %
    And lattice top --per-node shows one row for the node that runs it
    And lattice top -o json names the allocation and the node that reported

  Scenario: A job that has just been submitted has no metrics yet, and lattice top says why
    Given a Lattice cluster with 2 nodes and a metrics database
    When the user submits a job that waits for another job to finish
    Then lattice top of the waiting job says there are no metrics for it yet
