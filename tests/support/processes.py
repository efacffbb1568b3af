"""Processes as ``ps`` and ``/proc`` see them, independently of the code under test."""

from __future__ import annotations

import subprocess


def group_pids(pgid: int) -> list[int]:
    """Live processes of a group (zombies are dead: whoever adopted them has yet to reap them)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, g, stat in (line.split() for line in out.splitlines())
            if int(g) == pgid and not stat.startswith("Z")]
