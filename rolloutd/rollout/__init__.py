"""Keeping a node on the newest version: the update policy, the pull into the node's mirror,
loading a version into one server through the client for its routes, and its correctness gate."""
