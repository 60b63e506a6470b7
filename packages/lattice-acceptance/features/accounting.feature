Feature: Accounting: money reserved at submission, charged for the runtime
  With accounting on, a submission's estimated cost (nodes x walltime x price) is
  reserved from its project before it is accepted; when the job ends it is charged
  exactly its runtime and the rest of the reservation goes back to the project. A
  submission its project cannot pay for is refused with the numbers and a hint, and
  nothing is stored. Administrators top tenants up; users see balances and costs.

  The scenarios share the module's real local cluster with lattice-accounting running
  (SQLite ledger), a price of 36.00 per node-hour on the default vCluster.

  Scenario: A funded job is charged its runtime to the cent, the rest of its reservation released
    Given a Lattice cluster with accounting and 25.00 in project "physics" of tenant "default"
    When the user submits a 2-second job to project "physics" with a 10-minute walltime
    Then lattice account balance shows 6.00 reserved for project "physics" while the job has not ended
    And after the job ends lattice history shows its cost, its runtime at 0.01 per second
    And lattice account balance shows 0.00 reserved and 25.00 less that cost available in project "physics"

  Scenario: An underfunded submission is refused with the numbers and nothing is stored
    Given a Lattice cluster with accounting and 12.50 in project "small" of tenant "default"
    When the user submits a 2-node job with a 2-hour walltime to project "small"
    Then the submission is refused with 'allocation rejected: project "default/small" has 12.50 available, the estimate is 144.00 (2 nodes x 2h x 36.00/node-hour)'
    And the refusal has a hint to top up or transfer funds
    And no allocation was stored and project "small" still has 12.50 available

  Scenario: An administrator tops a tenant up and the balance shows it
    Given a Lattice cluster with accounting
    When the administrator runs lattice account topup --tenant default 40.25
    Then lattice account balance --tenant default shows 40.25 more available than before
    And lattice account transactions --kind topup lists the top-up of 40.25
