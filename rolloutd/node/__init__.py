"""The node daemon's wiring: start-up, the main loop, reloads, shutdown, the heartbeats to the
registry, the admin API and systemd notification."""
