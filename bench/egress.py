"""Trainer egress and fleet time with the chunk swarm: N nodes, each its own host (network
namespaces, ``tests/support/netns_fleet.py``), the trainer's link shaped with ``tc`` so its NIC is the
bottleneck, one version of ``--size-mib``.

Runs, one after the other, each on a fresh registry and fresh mirrors:

1. ``alone``: one node pulls the version; the time from the publish returning to the version
   being complete in its mirror is the reference.
2. ``swarm``: N nodes (peers on) pull it together. Measured: bytes out of the trainer's link
   per version size (``egress_ratio``; every packet counted, headers and heartbeats included)
   and the registry's own count of file bytes sent (``registry_file_ratio``); the time until all
   N mirrors hold it over the alone time (``all_nodes_time_ratio``).
3. ``--no-peers`` adds the same N nodes without peers (today's behaviour), for the baseline.
4. ``--s3``: the version published to a real S3 server (SeaweedFS) on a shaped host of its own;
   the registry's link should carry about the manifest only.
5. ``--faults``: N nodes, peers on, a FAKE peer (``tests/support/fake_peer.py``) claiming every chunk
   and serving wrong bytes, one node killed once the pull is under way, and the registry killed
   and restarted (on its data directory) mid-pull: every surviving node must end with the version.
6. ``--delta`` (instead of 1-2; the size defaults to 2 GiB): N nodes, peers on, one registry:
   version 1, bf16 tensors (the bit patterns of normal floats), published full; once every node
   serves it, version 2, the same tensors with ``--changed`` of their elements one bf16 step
   away (what an RL step leaves of a bf16 policy), which the registry publishes as a delta on
   version 1. Measured: trainer bytes out for version 2 per delta byte (``delta_egress_ratio``,
   every packet counted) and for version 1 per version byte (``egress_ratio``); publish (the
   version visible) to every node serving it, version 2's over version 1's
   (``delta_vs_full_time``), and the same to every mirror holding it; each node's pull kind
   (every one must be ``delta``), bytes fetched and rebuild time; and the bytes the machine
   wrote to the disk that holds the mirrors meanwhile (``disk_write_bytes``, from
   ``/proc/diskstats``, all processes), with its rate: every node writes the whole version
   into its mirror, a delta version too, so N nodes on one disk write N versions at once.

Every mirror is compared with the published files (sha256 of every file). The last line of
stdout is one JSON object: ``nodes``, ``egress_ratio``, ``all_nodes_time_ratio`` and the rest.
Needs root (namespaces, ``tc``). From the repository root::

    .venv/bin/python bench/egress.py                       # 8 nodes, 512 MiB, 200 Mbit/s
    .venv/bin/python bench/egress.py --s3 --faults --no-peers
    .venv/bin/python bench/egress.py --nodes 3 --size-mib 32 --rate-mbit 100   # a short run
    .venv/bin/python bench/egress.py --delta               # 8 nodes, 2 GiB, a full version then a delta
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.netns_fleet import Fleet  # noqa: E402

MiB = 1 << 20


def make_version(directory: Path, size_mib: int, files: int) -> dict[str, str]:
    """``files`` safetensors files of random bytes (one uint8 tensor each), ``size_mib`` in all;
    their sha256 by name. Real safetensors, so the servers load the version: one they could not
    load would be refused, and its copy leave the mirrors before they are compared."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    sums = {}
    per = size_mib * MiB // files
    for i in range(files):
        path = directory / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file({f"model.layers.{i}.blob": np.frombuffer(os.urandom(per), dtype=np.uint8)}, str(path))
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(8 * MiB):
                h.update(block)
        sums[path.name] = h.hexdigest()
    return sums


BF16_TENSORS_PER_FILE = 8


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            h.update(block)
    return h.hexdigest()


def write_bf16(path: Path, tensors: dict) -> None:
    """A safetensors file of BF16 tensors given as uint16 arrays of their bit patterns (numpy has
    no bfloat16; the file is what a trainer's bf16 checkpoint is, byte for byte)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [int(t.size)], "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for t in tensors.values():
            f.write(t.tobytes())


def make_bf16_versions(full: Path, delta: Path, size_mib: int, files: int, changed: float,
                       seed: int = 0) -> tuple[dict[str, str], dict[str, str]]:
    """Two versions of ``size_mib`` in ``files`` files of BF16 tensors: ``full`` (the bit
    patterns of normal floats) and ``delta``, the same with ``changed`` of each tensor's elements
    one bf16 step up or down. Returns the sha256 of each file of each, by name."""
    import numpy as np

    rng = np.random.default_rng(seed)
    full.mkdir(parents=True, exist_ok=True)
    delta.mkdir(parents=True, exist_ok=True)
    sums: tuple[dict[str, str], dict[str, str]] = ({}, {})
    elements = size_mib * MiB // files // 2 // BF16_TENSORS_PER_FILE
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        before, after = {}, {}
        for k in range(BF16_TENSORS_PER_FILE):
            t = (rng.standard_normal(elements, dtype=np.float32) * 0.02).view(np.uint32) >> 16
            before[f"model.layers.{i}.w{k}.weight"] = t = t.astype(np.uint16)
            stepped = t.copy()
            idx = rng.integers(0, elements, int(elements * changed))
            stepped[idx] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), idx.size)  # +-1 step (wraps)
            after[f"model.layers.{i}.w{k}.weight"] = stepped
        for d, tensors, out in ((full, before, sums[0]), (delta, after, sums[1])):
            write_bf16(d / name, tensors)
            out[name] = _sha256(d / name)
    return sums


def identical(fleet: Fleet, daemons, version: int, sums: dict[str, str]) -> list[str]:
    """Nodes whose mirror copy differs from the published files (none: every byte the same)."""
    bad = []
    for d in daemons:
        vdir = Path(d.cfg["mirror"]["dir"]) / str(version)
        for name, want in sums.items():
            h = hashlib.sha256()
            try:
                with open(vdir / name, "rb") as f:
                    while block := f.read(8 * MiB):
                        h.update(block)
            except OSError:
                bad.append(f"{d.cfg['node']['name']}: {name} missing")
                continue
            if h.hexdigest() != want:
                bad.append(f"{d.cfg['node']['name']}: {name} differs")
    return bad


def wait_serving(daemons, timeout_s: float = 120) -> None:
    for d in daemons:
        d.wait(lambda st: st["registry"]["reachable"], timeout_s, "the registry reached")


def reset_nodes(fleet: Fleet) -> None:
    fleet.stop_nodes()
    for i in range(fleet.n):
        shutil.rmtree(fleet.dir / f"node{i}", ignore_errors=True)


def run_once(fleet: Fleet, data: Path, sums, size: int, *, nodes: int, peers: bool, chunk: int,
             to: str | None = None, timeout_s: float = 900) -> dict:
    """Fresh registry and mirrors; ``nodes`` nodes; publish; wait until every mirror has it."""
    reset_nodes(fleet)
    fleet.stop_registry()
    fleet.start_registry()
    daemons = fleet.start_nodes(nodes, peers=peers, object_store=to is not None)
    wait_serving(daemons)
    trainer0 = fleet.tx_bytes("trainer")
    store0 = fleet.tx_bytes("store") if to else 0
    published = fleet.publish(1, data, chunk_bytes=chunk, to=to)
    done = fleet.wait_mirrors(daemons, 1, timeout_s)
    last = max(done.values()) - published
    out = {"nodes": nodes, "peers": peers, "seconds": round(last, 2),
           "first_s": round(min(done.values()) - published, 2),
           "trainer_tx_ratio": round((fleet.tx_bytes("trainer") - trainer0) / size, 3),
           "registry_file_ratio": round(fleet.served_bytes() / size, 3)}
    if to:
        out["store_tx_ratio"] = round((fleet.tx_bytes("store") - store0) / size, 3)
    statuses = [d.status() for d in daemons]
    sources = [st["pull_sources"] for st in statuses]
    out["pull_s_max"] = max(st["pull"]["seconds"] for st in statuses)  # the pullers' own clocks
    out["bytes_from_peers_ratio"] = round(sum(s["last_pull"].get("peers", 0) for s in sources) / size, 3)
    out["not_identical"] = identical(fleet, daemons, 1, sums)
    return out


def run_faults(fleet: Fleet, data: Path, sums, size: int, *, nodes: int, chunk: int, timeout_s: float = 900) -> dict:
    """Peers on; a fake peer with bad bytes; one node killed and the registry restarted mid-pull."""
    reset_nodes(fleet)
    fleet.stop_registry()
    reg_data = fleet.dir / "registry-data"
    shutil.rmtree(reg_data, ignore_errors=True)
    fleet.start_registry(data_dir=reg_data)
    daemons = fleet.start_nodes(nodes, peers=True)
    wait_serving(daemons)
    liar = fleet.spawn("trainer", [sys.executable, str(ROOT / "tests" / "support" / "fake_peer.py"), "--registry",
                                   fleet.registry_url, "--token-file", str(fleet.token_file), "--node", "liar",
                                   "--host", fleet.address("trainer"), "--port", "9399", "--version", "1"],
                       fleet.dir / "fake_peer.log")
    trainer0 = fleet.tx_bytes("trainer")
    published = fleet.publish(1, data, chunk_bytes=chunk)
    victim, survivors = daemons[-1], daemons[:-1]

    def progress(d) -> float:
        try:
            p = d.status()["pull"]
            return p["bytes_done"] / max(p["bytes_total"], 1) if p and p["version"] == 1 else 0.0
        except Exception:
            return 0.0
    deadline = time.monotonic() + timeout_s
    while max(progress(d) for d in daemons) < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.kill_everything()  # a peer gone mid-pull, its chunks half handed out
    killed_at = round(time.monotonic() - published, 2)
    time.sleep(0.5)
    fleet.stop_registry()  # the registry restarted mid-pull: a new instance, the tracker empty
    fleet.start_registry(data_dir=reg_data)
    restarted_at = round(time.monotonic() - published, 2)
    done = fleet.wait_mirrors(survivors, 1, timeout_s)
    liar.kill()
    log = (fleet.dir / "fake_peer.log").read_text().strip().splitlines()
    dropped = sum(d.log_text().count("drop peer liar") for d in survivors)
    return {"nodes": nodes, "survivors": len(survivors), "seconds": round(max(done.values()) - published, 2),
            "node_killed_at_s": killed_at, "registry_restarted_at_s": restarted_at,
            "trainer_tx_ratio": round((fleet.tx_bytes("trainer") - trainer0) / size, 3),
            "fake_peer": log[-1] if log else "", "fake_peer_dropped_by": dropped,
            "not_identical": identical(fleet, survivors, 1, sums)}


def wait_all_serving(daemons, version: int, timeout_s: float) -> float:
    """When every server of every daemon first served ``version`` (monotonic time, by polling)."""
    deadline = time.monotonic() + timeout_s
    left = list(daemons)
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not served by {[d.cfg['node']['name'] for d in left]}")
        for d in list(left):
            try:
                servers = d.status()["servers"]
            except Exception:
                continue
            if servers and all(s["state"] == "SERVING" and s["version"] == version for s in servers):
                left.remove(d)
        time.sleep(0.05)
    return time.monotonic()


def run_delta(fleet: Fleet, full: Path, delta: Path, sums: tuple[dict, dict], size: int, *, nodes: int,
              chunk: int, timeout_s: float = 1800) -> dict:
    """One registry, ``nodes`` nodes with peers: version 1 (full), then version 2 (a delta on it)."""
    reset_nodes(fleet)
    fleet.stop_registry()
    reg_data = fleet.dir / "registry-data"  # on disk: two versions of the model stay out of memory
    shutil.rmtree(reg_data, ignore_errors=True)
    fleet.start_registry(data_dir=reg_data)
    daemons = fleet.start_nodes(nodes, peers=True)
    wait_serving(daemons)
    out: dict = {"nodes": nodes}
    for version, data in ((1, full), (2, delta)):
        trainer0, served0, disk0 = fleet.tx_bytes("trainer"), fleet.served_bytes(), disk_written(fleet.dir)
        began = time.monotonic()
        visible = fleet.publish(version, data, chunk_bytes=chunk)
        mirrors = fleet.wait_mirrors(daemons, version, timeout_s)
        serving = wait_all_serving(daemons, version, timeout_s)
        tx, served = fleet.tx_bytes("trainer") - trainer0, fleet.served_bytes() - served0
        disk = disk_written(fleet.dir) - disk0
        manifest = httpx.get(f"{fleet.registry_url}/v1/versions/{version}", headers=fleet.auth, timeout=30).json()
        statuses = [d.status() for d in daemons]
        pulls = [st["pull"] for st in statuses]
        run = {"publish_to_visible_s": round(visible - began, 2),
               "to_all_mirrors_s": round(max(mirrors.values()) - visible, 2),
               "to_all_serving_s": round(serving - visible, 2),
               "trainer_tx_bytes": tx, "registry_file_bytes": served,
               "kinds": sorted({p["kind"] for p in pulls}),
               "bytes_fetched_per_node": sorted(p["bytes_fetched"] for p in pulls),
               "reconstruct_s": sorted(p["reconstruct_s"] for p in pulls if p["reconstruct_s"] is not None),
               "pull_s_max": max(p["seconds"] for p in pulls),
               "bytes_from_peers": sum(st["pull_sources"]["last_pull"].get("peers", 0) for st in statuses),
               "not_identical": identical(fleet, daemons, version, sums[version - 1]),
               "disk_write_bytes": disk, "disk_write_mb_s": round(disk / 1e6 / max(serving - began, 1e-9), 1)}
        if version == 2:
            if manifest.get("delta") is None:
                raise RuntimeError("version 2 was published full: the registry made no delta of it")
            delta_bytes = sum(f["size"] for f in manifest["delta"]["files"])
            run.update(delta_bytes=delta_bytes, delta_of_full=round(delta_bytes / size, 4),
                       trainer_tx_per_delta=round(tx / delta_bytes, 3),
                       registry_file_per_delta=round(served / delta_bytes, 3))
        else:
            run.update(trainer_tx_per_version=round(tx / size, 3), registry_file_per_version=round(served / size, 3))
        out[f"v{version}"] = run
        print(f"version {version}:", json.dumps(run), flush=True)
    v1, v2 = out["v1"], out["v2"]
    out.update(egress_ratio=v1["trainer_tx_per_version"], delta_egress_ratio=v2["trainer_tx_per_delta"],
               delta_vs_full_time=round(v2["to_all_serving_s"] / v1["to_all_serving_s"], 4),
               delta_vs_full_mirror_time=round(v2["to_all_mirrors_s"] / v1["to_all_mirrors_s"], 4))
    return out


def disk_written(path: Path) -> int:
    """Bytes written so far to the block device that holds ``path`` (every process's writes;
    0 where /proc/diskstats does not list it, e.g. on tmpfs)."""
    dev = os.stat(path).st_dev
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return int(f[9]) * 512  # sectors written; the kernel counts them in 512 bytes
    return 0


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--size-mib", type=int, default=None, help="the version's size (default 512; 2048 with --delta)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--chunk-mib", type=int, default=8, help="the manifest's chunk size (the swarm's unit)")
    p.add_argument("--rate-mbit", type=float, default=200.0, help="the trainer's (and the store's) link")
    p.add_argument("--s3", action="store_true", help="also with the version in a real S3 server")
    p.add_argument("--faults", action="store_true", help="also the fault run")
    p.add_argument("--no-peers", action="store_true", help="also N nodes without peers (the baseline)")
    p.add_argument("--delta", action="store_true", help="a full version then a delta version, instead of the "
                   "alone and swarm runs")
    p.add_argument("--changed", type=float, default=0.015, help="with --delta: the share of elements changed")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/egress.py: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    args.size_mib = args.size_mib or (2048 if args.delta else 512)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="rolloutd-egress-"))
    chunk = args.chunk_mib * MiB
    if args.delta:
        return main_delta(args, scratch, chunk)
    result: dict = {"nodes": args.nodes, "size_mib": args.size_mib, "chunk_mib": args.chunk_mib,
                    "rate_mbit": args.rate_mbit, "load_before": load()}
    try:
        sums = make_version(scratch / "version", args.size_mib, args.files)
        size = args.size_mib * MiB
        with Fleet(scratch / "fleet", args.nodes, rate_mbit=args.rate_mbit).setup(store=args.s3) as fleet:
            alone = run_once(fleet, scratch / "version", sums, size, nodes=1, peers=True, chunk=chunk)
            print("alone:", json.dumps(alone), flush=True)
            swarm = run_once(fleet, scratch / "version", sums, size, nodes=args.nodes, peers=True, chunk=chunk)
            print("swarm:", json.dumps(swarm), flush=True)
            result.update(alone_s=alone["seconds"], all_nodes_s=swarm["seconds"],
                          all_nodes_time_ratio=round(swarm["seconds"] / alone["seconds"], 3),
                          egress_ratio=swarm["trainer_tx_ratio"], registry_file_ratio=swarm["registry_file_ratio"],
                          alone=alone, swarm=swarm)
            if args.no_peers:
                base = run_once(fleet, scratch / "version", sums, size, nodes=args.nodes, peers=False, chunk=chunk)
                print("no peers:", json.dumps(base), flush=True)
                result["no_peers"] = base
            if args.s3:
                fleet.start_s3()
                s3 = run_once(fleet, scratch / "version", sums, size, nodes=args.nodes, peers=True, chunk=chunk,
                              to=f"s3://{fleet.s3.bucket}/egress")
                print("s3:", json.dumps(s3), flush=True)
                result["s3"] = s3
            if args.faults:
                faults = run_faults(fleet, scratch / "version", sums, size, nodes=args.nodes, chunk=chunk)
                print("faults:", json.dumps(faults), flush=True)
                result["faults"] = faults
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["load_after"] = load()
    result["ok"] = (result["egress_ratio"] <= 1.5 and result["all_nodes_time_ratio"] <= 2.0
                    and not swarm["not_identical"] and not result.get("s3", {}).get("not_identical")
                    and not result.get("faults", {}).get("not_identical"))
    print(json.dumps(result))
    return 0


def main_delta(args, scratch: Path, chunk: int) -> int:
    result: dict = {"nodes": args.nodes, "size_mib": args.size_mib, "chunk_mib": args.chunk_mib,
                    "rate_mbit": args.rate_mbit, "changed": args.changed, "load_before": load()}
    try:
        sums = make_bf16_versions(scratch / "v1", scratch / "v2", args.size_mib, args.files, args.changed)
        with Fleet(scratch / "fleet", args.nodes, rate_mbit=args.rate_mbit).setup() as fleet:
            result.update(run_delta(fleet, scratch / "v1", scratch / "v2", sums, args.size_mib * MiB,
                                    nodes=args.nodes, chunk=chunk))
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["load_after"] = load()
    v1, v2 = result["v1"], result["v2"]
    result["ok"] = (result["delta_egress_ratio"] <= 1.5 and result["delta_vs_full_time"] <= 0.1
                    and v2["kinds"] == ["delta"] and not v1["not_identical"] and not v2["not_identical"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

