Feature: File-access audit of sensitive allocations
  A sensitive allocation's telemetry is in audit mode: the node agent records every file
  its processes open (eBPF, filtered in the kernel to the audited allocation's processes)
  with the user's identity, and sends the events to the cluster's tamper-evident audit
  log, where they are read with `lattice admin audit query --action file.access`. A node
  that cannot run eBPF says so in its telemetry note; the scenario then skips.

  The scenario starts its own small real cluster (one quorum member, one node agent
  running as root) with a "sensitive" vCluster.

  Scenario: A sensitive job writes a file; the audit log lists the open under its user
    Given a Lattice cluster with 1 node and a "sensitive" vCluster, where eBPF can run
    When alice submits a sensitive job that waits, then writes "result.csv"
    And the node says in its telemetry note that it audits file access with eBPF
    And the job is let go
    Then alice's job ends Completed
    And lattice admin audit query --action file.access lists alice's write of "result.csv" on the node
    And the entries name no file opened by another allocation
