"""Keeping a node on the newest version: the update policy, the pull into the node's mirror,
loading a version into one server, its correctness gate, and heartbeats to the registry."""
