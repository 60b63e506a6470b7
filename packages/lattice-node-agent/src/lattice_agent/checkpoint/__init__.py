"""Checkpoints of the allocations this node heads (spec: Checkpoint Broker, Application
Protocol; Preemption Policy, Checkpoint Timeout Handling).

When an allocation the node heads goes Checkpointing (preempted, or suspended by its
owner) and it declared a protocol, the agent asks the application to checkpoint into
``{checkpoint_root}/{tenant}/{project}/{alloc}/checkpoints/{id}/`` instead of killing
it, then stops its processes and reports the outcome with the next heartbeat:

* ``paths``: the checkpoint directory, its id and the LATTICE_CHECKPOINT_* / resume
  variables every run of a checkpointable allocation gets (pure);
* ``timeouts``: the specification's timeout table as a pure state machine (one 50 %
  extension for a responsive application, deferral up to max_deferral, then forced);
* ``signal`` (SIGUSR1 + sentinel file), ``shmem`` (an mmap'd flag region) and
  ``callback`` (gRPC over Unix sockets, proto/lattice/v1/checkpoint.proto): the three
  application protocols;
* ``coordinator``: one allocation's checkpoint, from request to outcome;
* ``manager``: the agent's side: prepares each run, starts coordinators, turns their
  outcomes into ``checkpointed`` / ``checkpoint_failed`` reports.
"""

from lattice_agent.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
