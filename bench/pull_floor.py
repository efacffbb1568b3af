"""What each step of a pull costs this machine per GB, and the fastest pull its cores allow.

A pull from a registry on the same machine moves every byte through four steps, each on some
core: the server writes it into a loopback socket (and the kernel delivers it, charged to the
sender), the pull worker copies it out of the socket, hashes it (xxh3-128) and writes it into the
mirror's tmpfs file, over pages a removed version left. This script measures each step alone,
over ``--size-mib`` (1 GiB) in 1 MiB pieces, median of ``--repeats``, in CPU seconds per GB of
the process doing it, next to ``cp`` of the same bytes (tmpfs to tmpfs, into just-freed pages):

- ``send memory``: ``send()`` of an anonymous mapping's bytes, 4 MiB per call, over loopback to a
  reader that drops them: what a memory store's registry pays at least (``sender s/GB``), and
  what the reader pays to take bytes out of a socket (``receiver s/GB``);
- ``sendfile tmpfs``: the same bytes by ``sendfile`` from a tmpfs file (a disk store kept in
  tmpfs, as ``pull.py --store disk`` has it);
- ``sendfile ext4`` (with ``--disk-dir``): ``sendfile`` from a page-cached file on that directory;
- ``send mapped file``: ``send()`` from a read-only mapping of that tmpfs file;
- ``xxh3-128``: hashing a 1 MiB piece in cache; ``pwrite existing pages``: writing it over an
  allocated tmpfs file; ``copy into a populated mapping``: the same through a
  ``MAP_SHARED | MAP_POPULATE`` mapping, map and unmap included;
- ``cp`` (into pages just freed, as ``pull.py``'s ``cp`` runs) and ``dd conv=notrunc`` over the
  pages of an existing file (the copy a pull into a removed version's files makes).

The sender runs on CPU 0 and the reader on CPU 1, as ``pull.py`` pins its server and clients.
It ends with the floor: the cheapest measured road for each step added up (``machine s/GB``,
every core's share; the client's part of it), the rate a client at that floor reaches on one
core and the whole transfer on every core with nothing else running, each over the memory-copy
limit (the faster of ``cp`` and ``dd``). A pull that measures close to it is bound by the machine,
not by how it is written. The last line of stdout is the report as one JSON object. From the
repo root::

    .venv/bin/python bench/pull_floor.py                        # about 1 minute
    .venv/bin/python bench/pull_floor.py --disk-dir /var/tmp    # and sendfile from a disk's page cache
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

MiB = 1 << 20
PIECE = MiB
SEND = 4 * MiB


# As in pull.py: the server on CPU 0, the client on CPU 1 (each on its own core, as a registry
# and a node are); on one CPU both share it.
SENDER_CPU, READER_CPU = 0, 1 % (os.cpu_count() or 1)
ALL_CPUS = os.sched_getaffinity(0)


def pin(cpu: int | None) -> None:
    os.sched_setaffinity(0, ALL_CPUS if cpu is None else {cpu})


def cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def fill(fd: int, size: int) -> None:
    block = os.urandom(PIECE)
    for off in range(0, size, PIECE):
        os.pwrite(fd, block, off)


def loopback(size: int, send: Callable[[socket.socket], None]) -> dict:
    """One transfer of ``size`` bytes to a forked reader that drops them: both sides' CPU."""
    listener = socket.create_server(("127.0.0.1", 0))
    reader_end, writer_end = os.pipe()  # the reader's CPU seconds come back through it
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            pin(READER_CPU)
            conn = socket.create_connection(listener.getsockname())
            buffer, got = memoryview(bytearray(PIECE)), 0
            t0 = cpu_s()
            while got < size and (n := conn.recv_into(buffer)):
                got += n
            os.write(writer_end, json.dumps({"cpu_s": cpu_s() - t0, "bytes": got}).encode())
        finally:
            os._exit(0)
    os.close(writer_end)
    pin(SENDER_CPU)
    conn, _ = listener.accept()
    listener.close()
    t0, wall = cpu_s(), time.perf_counter()
    send(conn)
    sender = cpu_s() - t0
    reply = json.loads(os.read(reader_end, 4096))
    wall = time.perf_counter() - wall
    pin(None)
    os.waitpid(pid, 0)
    conn.close()
    os.close(reader_end)
    if reply["bytes"] != size:
        raise RuntimeError(f"the reader got {reply['bytes']} of {size} bytes")
    gb = size / 1e9
    return {"gb_per_s": gb / wall, "sender_s_per_gb": sender / gb, "receiver_s_per_gb": reply["cpu_s"] / gb}


def send_view(view: memoryview) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        off = 0
        while off < len(view):
            off += conn.send(view[off:off + SEND])
    return send


def send_file(fd: int, size: int) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        off = 0
        while off < size:
            off += os.sendfile(conn.fileno(), fd, off, min(SEND, size - off))
    return send


def per_gb(size: int, step: Callable[[], None]) -> float:
    t0 = cpu_s()
    step()
    return (cpu_s() - t0) / (size / 1e9)


def timed_child(argv: list[str], size: int) -> dict:
    t0, wall = cpu_s(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(argv, check=True)
    wall, cpu = time.perf_counter() - wall, cpu_s(resource.RUSAGE_CHILDREN) - t0
    return {"gb_per_s": size / 1e9 / wall, "s_per_gb": cpu / (size / 1e9)}


def cp_once(src: Path, dest: Path, size: int) -> dict:
    """``cp`` into pages freed just before (a file of the same size written and removed), as in
    ``pull.py``, where the contender before ``cp`` removed what it wrote: on a VM that hands free
    pages back to its host, ``cp`` into pages it must get back runs several times slower."""
    scratch = os.open(dest, os.O_RDWR | os.O_CREAT, 0o600)
    fill(scratch, size)
    os.close(scratch)
    dest.unlink()
    result = timed_child(["cp", str(src), str(dest)], size)
    dest.unlink()
    return result


def median_of(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def measure(size: int, repeats: int, tmp: Path, disk_dir: Path | None) -> dict:
    src = tmp / "src"
    fd = os.open(src, os.O_RDWR | os.O_CREAT, 0o600)
    fill(fd, size)
    anon = mmap.mmap(-1, size)
    anon[:] = os.pread(fd, size, 0)  # the same bytes in anonymous memory, as a memory store holds them
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    piece = memoryview(bytearray(os.urandom(PIECE)))
    target = os.open(tmp / "mirror", os.O_RDWR | os.O_CREAT, 0o600)
    fill(target, size)  # pages that exist, as a removed version's files leave them

    def hash_all() -> None:
        h = xxhash.xxh3_128()
        for _ in range(size // PIECE):
            h.update(piece)

    def pwrite_all() -> None:
        for off in range(0, size, PIECE):
            os.pwrite(target, piece, off)

    def copy_mapped() -> None:
        with mmap.mmap(target, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as m:
            view = memoryview(m)
            for off in range(0, size, PIECE):
                view[off:off + PIECE] = piece
            view.release()

    steps: dict[str, Callable[[], dict]] = {
        "send memory": lambda: loopback(size, send_view(memoryview(anon))),
        "sendfile tmpfs": lambda: loopback(size, send_file(fd, size)),
        "send mapped file": lambda: loopback(size, send_view(memoryview(mapped))),
        "xxh3-128": lambda: {"s_per_gb": per_gb(size, hash_all)},
        "pwrite existing pages": lambda: {"s_per_gb": per_gb(size, pwrite_all)},
        "copy into a populated mapping": lambda: {"s_per_gb": per_gb(size, copy_mapped)},
        "cp": lambda: cp_once(src, tmp / "copy", size),
        "dd over existing pages": lambda: timed_child(["dd", f"if={src}", f"of={tmp / 'mirror'}", "bs=1M",
                                                       "conv=notrunc", "status=none"], size),
    }
    disk_fd = None
    if disk_dir is not None:
        disk_path = Path(tempfile.mkdtemp(dir=disk_dir)) / "src"
        disk_fd = os.open(disk_path, os.O_RDWR | os.O_CREAT, 0o600)
        fill(disk_fd, size)
        os.pread(disk_fd, size, 0)  # in the page cache, as a served blob is
        steps["sendfile ext4"] = lambda: loopback(size, send_file(disk_fd, size))
    runs: dict[str, list[dict]] = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved, so that a slow spell hits every step alike
        for name, step in steps.items():
            runs[name].append(step())
    mapped.close()
    anon.close()
    for f in (fd, target):
        os.close(f)
    if disk_fd is not None:
        os.close(disk_fd)
        shutil.rmtree(disk_path.parent)
    return {name: median_of(rs) for name, rs in runs.items()}


def floor(steps: dict) -> dict:
    """The cheapest measured road through the four steps, and what it allows on every core."""
    send = steps["send memory"]
    write = min(steps["pwrite existing pages"]["s_per_gb"], steps["copy into a populated mapping"]["s_per_gb"])
    client = send["receiver_s_per_gb"] + steps["xxh3-128"]["s_per_gb"] + write
    machine = send["sender_s_per_gb"] + client
    cores = os.cpu_count() or 1
    # The memory-copy limit: the faster of cp (new files) and dd (existing pages), the harder yardstick.
    copy = max(steps["cp"]["gb_per_s"], steps["dd over existing pages"]["gb_per_s"])
    return {"machine_s_per_gb": round(machine, 3), "client_s_per_gb": round(client, 3), "cores": cores,
            "copy_gb_per_s": copy, "most_gb_per_s": round(cores / machine, 2),
            "most_over_copy": round(cores / machine / copy, 2),
            "one_core_client_gb_per_s": round(1 / client, 2), "one_core_client_over_copy": round(1 / client / copy, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tmp-dir", default="/dev/shm", help="a tmpfs, as the mirror's (default /dev/shm)")
    p.add_argument("--disk-dir", default=None, help="also sendfile from a page-cached file on this directory")
    args = p.parse_args()
    size = args.size_mib * MiB
    with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix="rolloutd-floor-") as tmp:
        steps = measure(size, args.repeats, Path(tmp), Path(args.disk_dir) if args.disk_dir else None)
    report = {"size_bytes": size, "repeats": args.repeats, "steps": steps, "floor": floor(steps)}
    print(f"# bench/pull_floor.py: {args.size_mib} MiB in {PIECE // MiB} MiB pieces, median of {args.repeats}\n")
    print("| step | GB/s | sender s/GB | receiver s/GB | s/GB |\n|---|---|---|---|---|")
    for name, r in steps.items():
        print(f"| {name} | {r.get('gb_per_s', '')} | {r.get('sender_s_per_gb', '')} | "
              f"{r.get('receiver_s_per_gb', '')} | {r.get('s_per_gb', '')} |")
    f = report["floor"]
    print(f"\nfloor of a pull from a memory store on this machine: {f['machine_s_per_gb']} machine s/GB, "
          f"{f['client_s_per_gb']} of it the client's")
    print(f"the memory-copy limit (faster of cp and dd): {f['copy_gb_per_s']} GB/s")
    print(f"a client at that floor on one core: {f['one_core_client_gb_per_s']} GB/s = "
          f"{f['one_core_client_over_copy']}x the copy")
    print(f"the whole transfer on {f['cores']} cores, nothing else running: {f['most_gb_per_s']} GB/s = "
          f"{f['most_over_copy']}x the copy")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
