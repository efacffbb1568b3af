"""The node daemon's wiring: start-up, the main loop, reloads, shutdown, the admin API, systemd
notification and the daemon's metrics."""
