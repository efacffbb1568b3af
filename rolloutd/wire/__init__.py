"""The wire contract, written once and imported by both sides: manifests and digests, error
codes, the messages nodes and the registry exchange, and the bearer-token check."""
