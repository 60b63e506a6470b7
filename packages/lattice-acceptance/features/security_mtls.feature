Feature: Mutual TLS between the cluster's components
  Every component authenticates to every other one. People reach the API over TLS with
  an OIDC token; lattice-server, the schedulers and the node agents talk to each other
  over mutual TLS with certificates of the site's PKI, and the quorum members encrypt
  their Raft traffic. A new node agent starts from a short-lived bootstrap certificate
  that it exchanges at first contact for a certificate of the cluster's internal CA (the
  quorum CA); it renews that certificate at two thirds of its lifetime while it runs,
  without dropping its connections. A node certificate names its node
  ({node}.{site}.lattice.internal) and acts for that node only: a certificate used for
  another node is refused with UNAUTHENTICATED, counted and written to the audit log. A
  bootstrap certificate may only ask for its own node's certificate. A client without a
  certificate of the cluster's CAs gets nothing from an internal port.

  Every step runs against one real local cluster that runs as production does
  (`lattice dev up --secure`): a site CA, a quorum member, a scheduler and two node
  agents on this machine, a local identity provider (which logs everyone in as alice;
  the administrator asks for the admin scope), and agent certificates that live 6
  seconds, so that renewals happen while the scenarios run.

  Background:
    Given a secure Lattice cluster: a site CA, TLS on the API, mutual TLS between its components
    And alice has logged in with "lattice login --device"
    And the administrator has logged in with "lattice login --device --scope 'openid admin'"

  Scenario: A new node joins with a bootstrap certificate and is shown as authenticated by the quorum CA
    When the administrator runs "lattice admin ca issue --kind bootstrap --name node-003 --out node-003-tls"
    And node-003's agent starts with only that bootstrap certificate and the site CA
    Then node-003 becomes Ready
    And node-003's agent log says it exchanged its bootstrap certificate for a quorum-CA certificate
    And the certificate node-003 keeps names node-003 and is signed by the internal CA that "lattice admin ca show" shows
    And "lattice nodes node-003" shows the agent identity "quorum-ca" with the serial of the certificate node-003 keeps
    And "lattice admin audit query --action cert.issue" shows that node-003's bootstrap identity was issued its agent certificate

  Scenario: A job runs on the secure cluster and its output comes back through the API
    When alice submits a job that prints "hello over mutual TLS"
    Then the job completes
    And "lattice logs" shows alice the line "hello over mutual TLS"
    And the node that ran it is shown as authenticated by the quorum CA

  Scenario: A node agent's certificate cannot be used to act for another node
    Given the value of lattice_node_identity_mismatch_total for node-001 is noted
    When a client presents node-001's agent certificate and sends a heartbeat for node-002
    Then it is refused with UNAUTHENTICATED: "the client certificate names node node-001, not node-002"
    And lattice_node_identity_mismatch_total for node-001 has gone up by 1
    And "lattice admin audit query --action node.identity_mismatch" shows that node-001's certificate was refused for node-002
    And node-002 is still Ready, authenticated by the quorum CA

  Scenario Outline: Without the cluster's credentials a client gets nothing from an internal port
    When a client that <client> calls <port>
    Then the connection is closed without an answer
    And the same call with <insider> is answered

    Examples:
      | port                       | client                                   | insider                      |
      | lattice-server's gRPC port | presents a certificate from a foreign CA | node-001's agent certificate |
      | lattice-server's gRPC port | uses TLS without a client certificate    | node-001's agent certificate |
      | lattice-server's gRPC port | speaks plaintext                         | node-001's agent certificate |
      | node-002's agent port      | presents a certificate from a foreign CA | lattice-server's certificate |
      | node-002's agent port      | uses TLS without a client certificate    | lattice-server's certificate |
      | node-002's agent port      | speaks plaintext                         | lattice-server's certificate |
      | member 1's Raft port       | speaks plaintext                         | the cluster's Raft password  |
      | member 1's Raft port       | uses a wrong Raft password               | the cluster's Raft password  |

  Scenario: A node agent renews its certificate while it runs and keeps its desired-state stream
    Given agent certificates on this cluster live 6 seconds
    When node-002's agent has renewed its certificate 3 times, past the expiry of the one it held
    Then node-002 keeps a certificate with a new serial from the internal CA
    And "lattice nodes node-002" shows the agent identity "quorum-ca" with the serial of the certificate node-002 keeps
    And a job on every node completes
    And node-002's agent registered once and never lost its desired-state stream

  Scenario: A bootstrap certificate can ask for its own node's certificate and nothing else
    Given node-001's bootstrap certificate, from when it joined
    When the bootstrap certificate asks lattice-server to sign a certificate request for node-001
    Then it gets an agent certificate for node-001 from the internal CA
    When the bootstrap certificate asks lattice-server to sign a certificate request for node-002
    Then it is refused with UNAUTHENTICATED: "the client certificate names node node-001, not node-002"
    When the bootstrap certificate lists the nodes
    Then it is refused with PERMISSION_DENIED: "bootstrap:node-001 (bootstrap) may not perform node.read"
    When the bootstrap certificate sends a heartbeat for node-001
    Then it is refused with PERMISSION_DENIED: "bootstrap:node-001 (bootstrap) may not perform node.agent"
