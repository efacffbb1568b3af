"""libtorrent beside rolloutd's swarm, on the same many-nodes harness (an existing engine measured
before keeping a swarm of our own): egress from the trainer, time, and failure behaviour.

The version (``--size-mib`` in ``--files`` files) is published to a registry on the shaped
trainer host, as for ``bench/egress.py``. A BitTorrent v2 torrent of the same files (SHA-256
merkle trees per 16 KiB block, ``--piece-mib`` pieces) names the registry's Range route as its
web seed (BEP 19: ``<seed>/<torrent name>/<file>`` is ``/v1/versions/<v>/files/<file>``). On
every node a libtorrent session (``lt_client`` below) downloads it; peers find each other the way
a tracker would tell them (every node's address, ``connect_peer``); DHT, LSD, UPnP are off.
Measured like the swarm: bytes the registry served per version size, and time until every
node has the version, alone and with N nodes. ``--kill`` also kills one node mid-download.

The registry runs without a token here: libtorrent's Python bindings give a web seed no
header (a deployment would need the token in the URL or a proxy).

    .venv/bin/pip install libtorrent     # bench only; not a dependency of rolloutd
    .venv/bin/python bench/torrent.py --nodes 8 --size-mib 512
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from egress import MiB, identical, load, make_version  # noqa: E402

from tests.support.netns_fleet import Fleet  # noqa: E402

PORT = 6881

LT_CLIENT = textwrap.dedent("""
    import json, sys, time
    import libtorrent as lt
    torrent, save, me, others = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    s = lt.session({"listen_interfaces": f"{me}:LT_PORT", "enable_dht": False, "enable_lsd": False,
                    "enable_upnp": False, "enable_natpmp": False, "alert_mask": 0,
                    "allow_multiple_connections_per_ip": True})
    h = s.add_torrent({"ti": lt.torrent_info(torrent), "save_path": save})
    t0 = time.monotonic()
    while not h.status().is_seeding:
        for o in others:
            h.connect_peer((o, LT_PORT))
        time.sleep(0.1)
    seconds, st = time.monotonic() - t0, h.status()
    h.flush_cache()  # the files complete on disk before the bench reads them (not timed)
    time.sleep(1.0)
    print(json.dumps({"seconds": seconds, "download": st.total_payload_download}), flush=True)
    while True:
        time.sleep(1)
""").replace("LT_PORT", str(PORT))


def make_torrent(python: str, data: Path, out: Path, seed_url: str, piece_mib: int) -> None:
    """A v2-only torrent named ``files`` whose web seed is the registry's version URL."""
    script = textwrap.dedent(f"""
        import libtorrent as lt
        fs = lt.file_storage()
        lt.add_files(fs, {str(data)!r})
        ct = lt.create_torrent(fs, {piece_mib} << 20, flags=lt.create_torrent.v2_only)
        ct.add_url_seed({seed_url!r})
        lt.set_piece_hashes(ct, {str(data.parent)!r})
        open({str(out)!r}, "wb").write(lt.bencode(ct.generate()))
    """)
    subprocess.run([python, "-c", script], check=True, timeout=600)


def run(fleet: Fleet, python: str, torrent: Path, data: Path, sums, size: int, nodes: int,
        kill: bool = False, timeout_s: float = 900) -> dict:
    for i in range(nodes):
        shutil.rmtree(fleet.dir / f"lt{i}", ignore_errors=True)
    before = fleet.served_bytes()
    addrs = [fleet.address(f"node{i}") for i in range(nodes)]
    procs, logs, started = [], [], []
    start = time.monotonic()
    for i in range(nodes):
        save = fleet.dir / f"lt{i}"
        save.mkdir()
        logs.append(fleet.dir / f"lt{i}.log")
        logs[-1].write_text("")
        started.append(time.monotonic())
        procs.append(fleet.spawn(f"node{i}", [python, "-c", LT_CLIENT, str(torrent), str(save), addrs[i],
                                              json.dumps([a for a in addrs if a != addrs[i]])], logs[-1]))
    killed = None
    done: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < nodes - (1 if killed is not None else 0) and time.monotonic() < deadline:
        for i, log in enumerate(logs):
            text = log.read_text()
            if i not in done and i != killed and '"seconds"' in text:
                # the client's own clock from its start (the flush after is not timed) + its start
                done[i] = json.loads(text[text.index("{"):].splitlines()[0])["seconds"] + started[i] - start
            if procs[i].poll() is not None and i != killed:
                raise RuntimeError(f"libtorrent client on node{i} exited:\n{log.read_text()[-2000:]}")
        if kill and killed is None and fleet.served_bytes() - before > size * 0.3:
            killed = nodes - 1
            procs[killed].kill()
        time.sleep(0.05)
    for p in procs:
        p.kill()
    survivors = [i for i in range(nodes) if i != killed]

    class Copy:  # identical() reads the mirror of a daemon's config
        def __init__(self, i):
            self.cfg = {"mirror": {"dir": str(fleet.dir / f"lt{i}")}, "node": {"name": f"node{i}"}}
    return {"nodes": nodes, "done": len(done), "seconds": round(max(done.values()), 2) if done else None,
            "registry_file_ratio": round((fleet.served_bytes() - before) / size, 3), "killed": killed,
            "not_identical": identical(fleet, [Copy(i) for i in survivors], "files", sums)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--piece-mib", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=200.0)
    p.add_argument("--kill", action="store_true", help="also a run with one node killed mid-download")
    p.add_argument("--python", default=sys.executable, help="a Python with libtorrent")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory, kept (default: a temporary one)")
    args = p.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="rolloutd-torrent-"))
    result: dict = {"nodes": args.nodes, "size_mib": args.size_mib, "rate_mbit": args.rate_mbit,
                    "load_before": load()}
    try:
        data = scratch / "files"
        sums = make_version(data, args.size_mib, args.files)
        size = args.size_mib * MiB
        with Fleet(scratch / "fleet", args.nodes, rate_mbit=args.rate_mbit).setup() as fleet:
            fleet.start_registry(token=False)
            fleet.publish(1, data, chunk_bytes=64 * MiB)
            torrent = scratch / "v1.torrent"
            make_torrent(args.python, data, torrent, f"{fleet.registry_url}/v1/versions/1/", args.piece_mib)
            alone = run(fleet, args.python, torrent, data, sums, size, 1)
            print("alone:", json.dumps(alone), flush=True)
            swarm = run(fleet, args.python, torrent, data, sums, size, args.nodes)
            print("swarm:", json.dumps(swarm), flush=True)
            result.update(alone=alone, swarm=swarm, egress_ratio=swarm["registry_file_ratio"],
                          all_nodes_time_ratio=round(swarm["seconds"] / alone["seconds"], 3))
            if args.kill:
                result["kill"] = run(fleet, args.python, torrent, data, sums, size, args.nodes, kill=True)
                print("kill:", json.dumps(result["kill"]), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["load_after"] = load()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
