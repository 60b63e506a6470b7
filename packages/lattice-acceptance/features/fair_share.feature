Feature: Fair share as a soft quota
  A tenant can have a fair share target: the share of the cluster's nodes it is meant to
  hold. The target is a soft quota, not a ceiling. While a tenant holds its share or
  more, its waiting jobs go behind those of tenants below their share, even when they
  have a higher class. Beyond its burst allowance (a multiple of the target) its jobs
  start only when nobody else's can. Nothing is ever refused: when no one else waits, the
  tenant still gets the idle nodes. Administrators set the target and the burst
  allowance of each tenant with `lattice admin tenant`.

  Every scenario starts its own small real cluster (one quorum member, a scheduler
  cycling every second and node agents that run real processes here), and users act
  through the `lattice` CLI.

  Background:
    Given a Lattice cluster with 2 nodes
    And the administrator creates the tenants "physics" and "biology", each with a fair share target of 0.5

  Scenario: A tenant at its fair share waits behind a tenant below it, even with a higher class
    Given the administrator sets the weights of vCluster "default" to priority 1 and every other weight to 0
    And physics runs a job "p-hold" of class 9 that holds one node until released
    And a tenant without a fair share target runs a job "other-hold" of class 9 that holds the other node until released
    When physics submits a job "p-next" of class 6
    And biology submits a job "b-next" of class 5 that runs until released
    Then "p-next" and "b-next" both wait Pending while no node is free
    When I release "other-hold"
    Then "b-next" starts on the node "other-hold" had, while "p-next" stays Pending
    When I release "p-hold"
    Then "p-next" runs on the node "p-hold" had and ends Completed
    When I release "b-next"
    Then "b-next" ends Completed

  Scenario: An administrator sets a tenant's burst allowance and sees it
    When the administrator runs lattice admin tenant update physics --burst-allowance 1.5
    Then lattice confirms "Updated tenant physics"
    And lattice admin tenant list shows physics with a fair share target of 0.5 and a burst allowance of 1.5
    And lattice admin tenant list still shows no burst allowance for biology
