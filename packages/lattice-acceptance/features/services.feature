Feature: Services: liveness probes and the service registry
  A service allocation (lifecycle unbounded) may declare a liveness probe (tcp connect or
  HTTP GET, 2xx/3xx alive) and the ports it exposes. The agent of its head node probes it;
  failure_threshold consecutive failures stop it, and it ends Failed with the reason
  liveness_probe_failed, then is requeued as its requeue policy and max_requeue say.
  While it runs, its exposed ports are endpoints in the quorum's service registry
  (`lattice services`), which follow it when it runs again and go when it ends.

  Every step runs against a real local cluster: a quorum member, a scheduler and two
  node agents on this machine.

  Background:
    Given a running Lattice cluster with 2 nodes for services

  Scenario: A service whose health endpoint starts failing is failed, requeued once, then stays Failed
    Given a service "web" with an HTTP liveness probe, requeue policy "always" and max_requeue 1
    When the health endpoint of "web" starts answering 500
    Then "web" is requeued with the reason "liveness_probe_failed" and runs again
    And `lattice services web` shows it on the node it runs on now
    When the health endpoint of "web" starts answering 500
    Then "web" ends Failed with the reason "liveness_probe_failed"
    And `lattice services` does not list "web"

  Scenario: A running service is found in the registry until it ends
    Given a service "api" with an HTTP liveness probe, requeue policy "never" and max_requeue 0
    Then `lattice services` lists "api" at its node and port
    And `lattice services api` shows it on the node it runs on now
    When "api" is cancelled
    Then `lattice services` does not list "api"
