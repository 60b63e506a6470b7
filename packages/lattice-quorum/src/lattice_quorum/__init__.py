"""Raft quorum member: replicated GlobalState and the commands that change it."""
