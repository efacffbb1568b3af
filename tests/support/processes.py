"""Processes as ``ps`` and ``/proc`` see them, independently of the code under test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def group_pids(pgid: int) -> list[int]:
    """Live processes of a group (zombies are dead: whoever adopted them has yet to reap them)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, g, stat in (line.split() for line in out.splitlines())
            if int(g) == pgid and not stat.startswith("Z")]


def gone(pid: int) -> bool:
    """The process exited and was reaped (or is a zombie of a parent that died)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
        return True


def listening_tcp_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on (IPv4 and IPv6), from /proc: its socket inodes, matched
    against the kernel's table of listening sockets."""
    inodes = set()
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(fd.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)
