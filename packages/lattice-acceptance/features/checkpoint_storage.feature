Feature: Checkpoints kept in S3-compatible storage, and what happens when it is down
  When the checkpoint root is an S3 bucket (`checkpoint_root: s3://BUCKET/PREFIX`), a
  job still writes its checkpoint into a directory on its node; the node agent then
  stores it in the bucket and the allocation records the s3:// path. When the job runs
  again the agent fetches that checkpoint first, and the job resumes from it. If the
  bucket cannot be written, a checkpoint would be lost: the checkpoint broker reports
  the outage (lattice_checkpoint_storage_unavailable 1) and a job that must stop now is
  stopped without a checkpoint (SIGTERM, grace, SIGKILL) and ends Failed, saying that
  checkpoint storage is unavailable. Every step runs against a real local cluster, a
  real S3-compatible server and real test applications that count.

  Scenario: A suspended job's checkpoint is stored in the bucket and it resumes from it
    Given a Lattice cluster with 1 node that keeps checkpoints in an S3 bucket
    And a class-3 job "counter" submitted with "--checkpoint=signal" that counts to 160
    When the owner runs "lattice suspend" on "counter"
    Then "counter" becomes Suspended with its checkpoint stored in the bucket
    When the owner runs "lattice resume" on "counter"
    Then "counter" runs again, resumes from its saved counter and ends Completed

  Scenario: With the bucket down, a job that must stop ends Failed instead of Suspended
    Given a Lattice cluster with 1 node that keeps checkpoints in an S3 bucket
    And a class-3 job "counter" submitted with "--checkpoint=signal" that counts to 100000
    When the S3 service stops
    Then the checkpoint broker reports checkpoint storage unavailable
    When the owner runs "lattice suspend" on "counter"
    Then "counter" ends Failed because checkpoint storage is unavailable and was never Suspended
    And "counter" never wrote a checkpoint
