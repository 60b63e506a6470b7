Feature: Tamper-evident audit log
  Security-relevant actions (node claims and releases, drains and disables, tenant and
  quota changes, sensitive allocations, failed logins) are recorded in the quorum's
  audit log: every entry says who did what to what, is signed with the cluster's audit
  key and chained by its hash to the entry before it. Administrators read it with
  `lattice admin audit query`, archive it with `lattice admin audit export`, and anyone
  holding the cluster's public key checks an archived file with
  `lattice admin audit verify`: an edited, removed or reordered entry is found, and the
  first bad one is named.

  The scenario starts its own small real cluster (one quorum member, one node agent);
  the administrator acts through the `lattice` CLI.

  Scenario: An administrator drains a node and changes a tenant quota; both appear in the audit log with who did it, and an exported log with one edited byte fails verification naming that entry
    Given a Lattice cluster with 1 node
    When the administrator "ops" drains the node for "firmware update"
    And the administrator "ops" sets the max nodes of tenant "default" to 4
    Then lattice admin audit query shows that "ops" drained the node for "firmware update"
    And lattice admin audit query shows that "ops" changed tenant "default" to max_nodes 4
    When the administrator exports the audit log to a file
    Then lattice admin audit verify accepts the file with the cluster's public key
    When one byte of the quota change's entry in the file is edited
    Then lattice admin audit verify rejects the file, naming the quota change's entry
