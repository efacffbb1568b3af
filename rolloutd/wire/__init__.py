"""The wire contract, written once and imported by both sides: manifests and digests, error
codes, the messages nodes and the registry exchange (a server's states among their words), and
the bearer-token check. The bottom layer: it imports nothing else of rolloutd."""
