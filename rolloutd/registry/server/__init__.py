"""The registry service: versions and their bytes, leases, the replica directory and demand,
behind HTTP API v1."""
