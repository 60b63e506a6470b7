"""Command handlers of ``state.apply``, one module per domain (nodes, allocations,
assignment, tenancy) over shared primitives in ``common``. Each handler is named after
its command's tag and has the signature ``(state, command, changes) -> CommandResult``;
``state._HANDLERS`` maps each command type to one of them.
"""
