"""Delta versions on real optimizer steps: how small each encoding is, how close to the entropy
of the change, and what encoding and rebuilding cost against a full publish and a memory copy.

A Qwen2-shaped transformers model built from a config (random init, ``--hidden``/``--layers``/
``--vocab``; the defaults give about 55 M parameters) trains with fp32 master weights and AdamW
on a causal-LM loss over random token batches, once per learning rate (``--lrs``, each run from
the same initial weights). After every optimizer step the weights are published in bf16 (the
files a full publish writes: ``rolloutd.trainer.shards.serialize_shards``) and, side by side
on that step's bytes against the previous step's:

- ``changed``: the fraction of elements whose bf16 bytes changed;
- for each encoding of ``rolloutd.wire.delta``: the delta's bytes and their ratio to the full
  size; the encode time (``encode_file`` over every file, on a thread pool as the registry
  encodes, plus the delta files' chunk digests) against a full publish of the same state dict
  to an in-process ``EmbeddedRegistry`` (``delta=False`` where publish has it); the rebuild
  time (``apply_and_verify`` of every file, with a thread pool as the pull worker has, from
  base files on disk into a fresh file) against one memory copy of the full size (a fresh
  buffer, page faults included, as bench/publish.py measures it); and that the rebuilt bytes
  equal the target's;
- ``bound``: an entropy bound on what any encoding of this change needs, as a fraction of the
  full size: per element the binary entropy of the changed fraction (which elements changed),
  plus per changed element the empirical entropy of how many bf16 steps it moved (the
  distribution of the difference of the values' ordinals over all changed elements). It
  assumes elements independent; an encoding may beat it where changes cluster.

Every timing is the median of ``--repeats`` (3) per step (one at the other learning rates),
taken interleaved (publish, copy, then each encoding's encode and rebuild, again and again);
the summary's ratios are the median,
over the steps of the first learning rate, of each step's ratio: figures measured side by side.
Each is also taken in CPU seconds of every thread of the process (the codec's pool, the
registry's threads), which move less than wall seconds with the machine's other load; the goals
are stated in wall seconds. The last stdout line is
one JSON object; ``bench/results/delta.json`` holds every step. From the repository root::

    .venv/bin/python bench/delta.py                     # 55 M parameters, 10 steps per lr
    .venv/bin/python bench/delta.py --hidden 64 --layers 2 --vocab 512 --steps 2   # seconds
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from rolloutd.trainer.shards import serialize_shards  # noqa: E402
from rolloutd.wire import delta  # noqa: E402
from rolloutd.wire.manifest import DEFAULT_CHUNK_BYTES, DEFAULT_HASH, hash_chunks  # noqa: E402

SHIPPED = delta.DEFAULT_ENCODING


def build_model(hidden: int, layers: int, vocab: int, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    heads = max(1, hidden // 64)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), max_position_embeddings=512,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def bf16_files(model) -> tuple[list[tuple[str, bytes]], dict]:
    """The files a full publish of the model's weights in bf16 writes."""
    import torch
    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return list(serialize_shards(sd)), sd


def ordinals(u: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as integers in the order of the values they stand for."""
    u = u.astype(np.int32)
    return np.where(u & 0x8000, -(u & 0x7FFF), u)


def entropy_bound(base: dict, target: dict) -> tuple[float, float]:
    """(changed fraction, bound as a fraction of the full bytes) over every bf16 tensor."""
    import torch
    n = changed = 0
    steps: list[np.ndarray] = []
    full = 0
    for name, t in target.items():
        full += t.numel() * t.element_size()
        if t.dtype != torch.bfloat16:
            continue
        a = base[name].contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        b = t.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        diff = a != b
        n += a.size
        changed += int(diff.sum())
        steps.append(ordinals(b[diff]) - ordinals(a[diff]))
    p = changed / n if n else 0.0
    h_which = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    h_step = 0.0
    if changed:
        _, counts = np.unique(np.concatenate(steps), return_counts=True)
        q = counts / counts.sum()
        h_step = float(-(q * np.log2(q)).sum())
    bits = n * h_which + changed * h_step
    return p, bits / 8 / full


class Timed:
    """Wall seconds of a block, and CPU seconds of every thread of this process meanwhile (the
    codec's pool, the registry's threads): the CPU figure moves less with other load."""

    def __enter__(self) -> Timed:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def memcpy(files: list[tuple[str, bytes]]) -> Timed:
    """One copy of every file's bytes into fresh memory."""
    with Timed() as t:
        for _, data in files:
            dst = np.empty(len(data), dtype=np.uint8)
            np.copyto(dst, np.frombuffer(data, dtype=np.uint8))
            del dst
    return t


def encode_all(bases: dict[str, bytes], targets: list[tuple[str, bytes]], encoding: str, pool) -> tuple[dict, Timed]:
    """Delta bytes per target file, and the time to encode them and hash their chunks."""
    out = {}
    with Timed() as t:
        for name, data in targets:
            buf = io.BytesIO()
            delta.encode_file(bases, data, buf, encoding=encoding, pool=pool, target_name=name)
            out[name] = buf.getvalue()
            hash_chunks(out[name], DEFAULT_CHUNK_BYTES, DEFAULT_HASH, pool)
    return out, t


def rebuild_all(base_dir: Path, deltas: dict[str, bytes], targets: list[tuple[str, bytes]],
                digests: dict[str, list[str]], work: Path, pool, check: bool) -> tuple[Timed, bool]:
    """The time to rebuild and verify every target file from the base files and the deltas (files
    on disk, as in a node's mirror), and (``check``) whether every rebuilt file equals its target."""
    base_files = {p.name: p for p in base_dir.iterdir()}
    jobs = []
    for i, (name, _) in enumerate(targets):
        dpath = work / f"{i}.delta"
        dpath.write_bytes(deltas[name])
        jobs.append((name, dpath, work / f"{i}.target", digests[name]))
    with Timed() as t:
        for _name, dpath, tpath, digests in jobs:
            tpath.touch()
            delta.apply_and_verify(base_files, dpath, tpath, hash_name=DEFAULT_HASH,
                                   chunk_bytes=DEFAULT_CHUNK_BYTES, digests=digests, pool=pool)
    exact = not check or all(tpath.read_bytes() == data
                             for (_, data), (_, _, tpath, _) in zip(targets, jobs, strict=True))
    for _, dpath, tpath, _ in jobs:
        dpath.unlink()
        tpath.unlink()
    return t, exact


def write_base(files: list[tuple[str, bytes]], directory: Path) -> None:
    for p in directory.iterdir():
        p.unlink()
    for name, data in files:
        (directory / name).write_bytes(data)


def full_publisher():
    """publish(version, state_dict) as a full version into an in-process registry."""
    from rolloutd.trainer import EmbeddedRegistry
    reg = EmbeddedRegistry(port=0).start()
    kwargs = {"delta": False} if "delta" in inspect.signature(reg.publish).parameters else {}
    return reg, lambda version, sd: reg.publish(version, sd, **kwargs)


def run_lr(lr: float, args, pool, tmp: Path) -> list[dict]:
    import torch
    model = build_model(args.hidden, args.layers, args.vocab, args.seed)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    base_dir, work = tmp / "base", tmp / "work"
    base_dir.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    reg, publish = full_publisher()
    rows = []
    try:
        base_files, base_sd = bf16_files(model)
        write_base(base_files, base_dir)
        version = 1
        publish(version, base_sd)
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            t0 = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            train_s = time.perf_counter() - t0
            files, sd = bf16_files(model)
            full = sum(len(d) for _, d in files)
            changed, bound = entropy_bound(base_sd, sd)
            bases = dict(base_files)
            times: dict[str, list[Timed]] = {"publish": [], "memcpy": []}
            sizes, exact = {}, dict.fromkeys(delta.ENCODINGS, True)
            digests = {name: hash_chunks(data, DEFAULT_CHUNK_BYTES, DEFAULT_HASH) for name, data in files}
            repeats = args.repeats if lr == args.lrs[0] else 1  # the summary's times are the first lr's
            for rep in range(repeats):  # interleaved, so that a busy moment hits every figure alike
                version += 1
                with Timed() as t:
                    publish(version, sd)
                times["publish"].append(t)
                times["memcpy"].append(memcpy(files))
                for encoding in delta.ENCODINGS:
                    deltas, t = encode_all(bases, files, encoding, pool)
                    times.setdefault(f"enc {encoding}", []).append(t)
                    sizes[encoding] = sum(len(d) for d in deltas.values())
                    t, ok = rebuild_all(base_dir, deltas, files, digests, work, pool, check=rep == 0)
                    times.setdefault(f"rebuild {encoding}", []).append(t)
                    exact[encoding] &= ok
            w = {k: statistics.median(x.wall for x in v) for k, v in times.items()}
            c = {k: statistics.median(x.cpu for x in v) for k, v in times.items()}
            row = {"lr": lr, "step": step, "params": params, "loss": round(loss.item(), 4),
                   "train_s": round(train_s, 3), "full_bytes": full, "changed": changed, "bound": bound,
                   "publish_s": w["publish"], "memcpy_s": w["memcpy"], "publish_cpu_s": c["publish"],
                   "memcpy_cpu_s": c["memcpy"], "enc": {}}
            for e in delta.ENCODINGS:
                row["enc"][e] = {"bytes": sizes[e], "ratio": sizes[e] / full,
                                 "encode_s": w[f"enc {e}"], "rebuild_s": w[f"rebuild {e}"],
                                 "encode_vs_publish": w[f"enc {e}"] / w["publish"],
                                 "rebuild_vs_memcpy": w[f"rebuild {e}"] / w["memcpy"],
                                 "encode_cpu_vs_publish_cpu": c[f"enc {e}"] / c["publish"],
                                 "rebuild_cpu_vs_memcpy_cpu": c[f"rebuild {e}"] / max(c["memcpy"], 1e-9),
                                 "exact": exact[e]}
            rows.append(row)
            print_row(row)
            base_files, base_sd = files, sd
            write_base(base_files, base_dir)
    finally:
        reg.stop()
    return rows


def print_row(r: dict) -> None:
    sizes = "  ".join(f"{e} {v['ratio'] * 100:5.2f}% enc {v['encode_vs_publish']:4.2f}x "
                      f"(cpu {v['encode_cpu_vs_publish_cpu']:4.2f}x) rebuild {v['rebuild_vs_memcpy']:4.2f}x "
                      f"(cpu {v['rebuild_cpu_vs_memcpy_cpu']:4.2f}x){'' if v['exact'] else ' NOT EXACT'}"
                      for e, v in r["enc"].items())
    print(f"lr {r['lr']:g} step {r['step']:2d} loss {r['loss']:.3f} changed {r['changed'] * 100:5.2f}% "
          f"bound {r['bound'] * 100:5.2f}%  full {r['full_bytes'] / 1e6:.1f} MB publish "
          f"{r['publish_s'] * 1e3:.0f} ms memcpy {r['memcpy_s'] * 1e3:.0f} ms  {sizes}", flush=True)


def summarize(rows: list[dict], args) -> dict:
    first_lr = args.lrs[0]
    mine = [r for r in rows if r["lr"] == first_lr]
    last = mine[-1]
    med = statistics.median
    per_enc = {e: {"ratio_last": round(last["enc"][e]["ratio"], 5),
                   "encode_vs_full_publish": round(med(r["enc"][e]["encode_vs_publish"] for r in mine), 3),
                   "reconstruct_vs_memcpy": round(med(r["enc"][e]["rebuild_vs_memcpy"] for r in mine), 3),
                   "encode_s": round(med(r["enc"][e]["encode_s"] for r in mine), 4),
                   "reconstruct_s": round(med(r["enc"][e]["rebuild_s"] for r in mine), 4),
                   "encode_cpu_vs_full_publish_cpu": round(med(r["enc"][e]["encode_cpu_vs_publish_cpu"]
                                                               for r in mine), 3),
                   "reconstruct_cpu_vs_memcpy_cpu": round(med(r["enc"][e]["rebuild_cpu_vs_memcpy_cpu"]
                                                              for r in mine), 3)}
               for e in delta.ENCODINGS}
    best = min(per_enc, key=lambda e: per_enc[e]["ratio_last"])
    by_lr = {}
    for lr in args.lrs:
        lr_rows = [r for r in rows if r["lr"] == lr]
        by_lr[f"{lr:g}"] = {"changed_last": round(lr_rows[-1]["changed"], 5),
                            "bound_last": round(lr_rows[-1]["bound"], 5),
                            **{f"ratio_last_{e}": round(lr_rows[-1]["enc"][e]["ratio"], 5) for e in delta.ENCODINGS}}
    return {"params": last["params"], "lr": first_lr, "lrs": args.lrs, "steps": args.steps,
            "full_bytes": last["full_bytes"], "shipped_encoding": SHIPPED,
            "delta_ratio_last": per_enc[SHIPPED]["ratio_last"],
            "best_encoding": best, "best_encoding_ratio_last": per_enc[best]["ratio_last"],
            "shipped_vs_best": round(per_enc[SHIPPED]["ratio_last"] / per_enc[best]["ratio_last"], 3),
            "changed_last": round(last["changed"], 5), "entropy_bound_last": round(last["bound"], 5),
            "encode_vs_full_publish": per_enc[SHIPPED]["encode_vs_full_publish"],
            "reconstruct_vs_memcpy": per_enc[SHIPPED]["reconstruct_vs_memcpy"],
            "publish_s": round(med(r["publish_s"] for r in mine), 4),
            "memcpy_s": round(med(r["memcpy_s"] for r in mine), 4),
            "publish_cpu_s": round(med(r["publish_cpu_s"] for r in mine), 4),
            "memcpy_cpu_s": round(med(r["memcpy_cpu_s"] for r in mine), 4),
            "all_exact": all(v["exact"] for r in rows for v in r["enc"].values()),
            "encodings": per_enc, "by_lr": by_lr, "threads": args.threads, "repeats": args.repeats,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate")
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-6, 1e-5],
                   help="comma list; the first is the one the summary reports")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timings per step (interleaved); each figure is their median")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="encode and rebuild threads (the pull worker's decoder pool has min(4, CPUs))")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where the base and rebuilt files go")
    p.add_argument("--out", type=Path, default=RESULTS / "delta.json")
    args = p.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}, {os.cpu_count()} CPUs, "
          f"{args.threads} codec threads", flush=True)
    rows: list[dict] = []
    with ThreadPoolExecutor(args.threads) as pool, tempfile.TemporaryDirectory(dir=args.tmp_dir,
                                                                                prefix="rolloutd-bench-delta.") as t:
        for lr in args.lrs:
            rows += run_lr(lr, args, pool, Path(t))
    summary = summarize(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    return 0 if summary["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
