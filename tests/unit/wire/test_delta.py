"""The delta codec (rolloutd/wire/delta.py): every encoding rebuilds the target byte for byte,
checked against bytes the test made itself; any damage is an error, never wrong bytes."""

from __future__ import annotations

import io
import json
import random
import threading
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zstandard

from rolloutd.wire import delta
from rolloutd.wire.manifest import DeltaEncoding, hash_chunks

CHUNK = 64 << 10
torch: typing.Any = None  # torch, and safetensors' save: imported by _import_torch
save: typing.Any = None


@pytest.fixture(autouse=True, scope="module")
def _import_torch():
    """torch when a test of this file runs, not when the file is collected: each worker of the fast
    tier collects every file, and only the one that runs these tests needs torch (1.4 CPU-s)."""
    global torch, save
    import torch as imported
    from safetensors.torch import save as imported_save
    torch, save = imported, imported_save


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": (torch.randn(300, 64, generator=g) * 0.02).bfloat16(),
            "layers.0.mlp.weight": (torch.randn(256, 64, generator=g) * 0.02).bfloat16(),
            "layers.0.norm.weight": torch.ones(64, dtype=torch.float32),
            "layers.1.mlp.weight": (torch.randn(256, 64, generator=g) * 0.02).bfloat16()}


def _step(tensors: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """Like an RL step in bf16: a small fraction of the elements move by one bf16 step or so."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        bump = (torch.rand(t.shape, generator=g) < fraction).to(t.dtype) * t.abs().clamp_min(1e-3) * 0.01
        out[name] = (t.float() + bump.float()).to(t.dtype)
    return out


def _rebuild(tmp_path: Path, bases: dict[str, bytes], target: bytes, encoding: str, *,
             pool=None, name: str = "model.safetensors") -> tuple[bytes, delta.EncodeStats]:
    buf = io.BytesIO()
    stats = delta.encode_file(bases, target, buf, encoding=encoding, pool=pool, target_name=name)
    base_paths = {}
    for fname, data in bases.items():
        (tmp_path / f"base-{fname}").write_bytes(data)
        base_paths[fname] = tmp_path / f"base-{fname}"
    (tmp_path / "d.delta").write_bytes(buf.getvalue())
    out = tmp_path / "target"
    out.write_bytes(b"")
    delta.apply_and_verify(base_paths, tmp_path / "d.delta", out, hash_name="xxh3-128", chunk_bytes=CHUNK,
                           digests=hash_chunks(target, CHUNK, "xxh3-128"), pool=pool)
    return out.read_bytes(), stats


@pytest.mark.parametrize("encoding", delta.ENCODINGS)
def test_every_encoding_rebuilds_a_step_exactly_and_small(tmp_path, encoding):
    base = _checkpoint()
    target = _step(base, 0.02)
    base_bytes, target_bytes = save(base), save(target)
    with ThreadPoolExecutor(2) as pool:
        rebuilt, stats = _rebuild(tmp_path, {"model.safetensors": base_bytes}, target_bytes, encoding, pool=pool)
    assert rebuilt == target_bytes
    assert (tmp_path / "base-model.safetensors").read_bytes() == base_bytes  # the base is never written
    assert stats.delta_bytes < 0.25 * len(target_bytes), stats
    assert stats.tensors_changed == 4 and stats.tensors_whole == 0


def test_new_removed_and_reshaped_tensors_travel_whole_and_are_listed(tmp_path):
    base = _checkpoint()
    target = _step(base, 0.01)
    target["layers.1.mlp.weight"] = target["layers.1.mlp.weight"].reshape(64, 256).contiguous()  # shape changed
    target["layers.0.norm.weight"] = target["layers.0.norm.weight"].bfloat16()  # dtype changed
    target["lm_head.weight"] = torch.randn(10, 64).bfloat16()  # new
    del target["embed.weight"]  # removed
    base_bytes, target_bytes = save(base), save(target)
    rebuilt, stats = _rebuild(tmp_path, {"a.safetensors": base_bytes}, target_bytes, "xor-planes-zstd")
    assert rebuilt == target_bytes
    assert stats.tensors_whole == 3 and stats.tensors_changed == 1
    assert delta.removed_tensors({"a": base_bytes}, {"b": target_bytes}) == ["embed.weight"]


def test_tensors_are_found_in_any_base_file_and_other_files_by_name(tmp_path):
    base = _checkpoint()
    first = {k: v for k, v in base.items() if k.startswith("layers.0")}
    second = {k: v for k, v in base.items() if not k.startswith("layers.0")}
    bases = {"a.safetensors": save(first), "b.safetensors": save(second)}
    target = save(_step(base, 0.05))  # all tensors in one file now
    rebuilt, stats = _rebuild(tmp_path, bases, target, "xor-zstd")
    assert rebuilt == target and stats.tensors_whole == 0
    # A file that is not safetensors: against the base file of the same name and size, else whole.
    config = bytes(random.Random(0).randbytes(5000))
    changed = config[:100] + b"x" + config[101:]
    rebuilt, stats = _rebuild(tmp_path, {"config.bin": config}, changed, "xor-planes-zstd", name="config.bin")
    assert rebuilt == changed and stats.delta_bytes < 200
    rebuilt, stats = _rebuild(tmp_path, {"config.bin": config}, changed + b"!", "xor-planes-zstd", name="config.bin")
    assert rebuilt == changed + b"!" and stats.tensors_whole == 1


def test_large_tensors_are_cut_in_segments_and_applied_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setattr(delta, "SEGMENT_BYTES", 4096)
    base = {"w": torch.randn(1000, 33).bfloat16()}  # 66,000 bytes: 17 segments
    target = _step(base, 0.1)
    with ThreadPoolExecutor(2) as pool:
        rebuilt, _ = _rebuild(tmp_path, {"m.safetensors": save(base)}, save(target), "index-value-zstd", pool=pool)
    assert rebuilt == save(target)


def _staged(tmp_path: Path) -> bytes:
    """A base, a step's delta on it and an empty target file in ``tmp_path`` (base, d, out); the
    target's bytes."""
    base_bytes = save(_checkpoint())
    target_bytes = save(_step(_checkpoint(), 0.02))
    buf = io.BytesIO()
    delta.encode_file({"m.safetensors": base_bytes}, target_bytes, buf)
    (tmp_path / "base").write_bytes(base_bytes)
    (tmp_path / "d").write_bytes(buf.getvalue())
    (tmp_path / "out").write_bytes(b"")
    return target_bytes


def test_a_target_chunk_that_differs_is_named(tmp_path):
    target_bytes = _staged(tmp_path)
    digests = hash_chunks(target_bytes, CHUNK, "xxh3-128")
    digests[1] = "0" * 32
    with pytest.raises(delta.TargetMismatch, match="rebuilt chunk 1 ") as e:
        delta.apply_and_verify({"m.safetensors": tmp_path / "base"}, tmp_path / "d", tmp_path / "out",
                               hash_name="xxh3-128", chunk_bytes=CHUNK, digests=digests)
    assert e.value.chunk == 1
    # Against another base (the delta of a wrong base): the rebuilt bytes cannot match.
    (tmp_path / "other").write_bytes(save(_checkpoint(seed=7)))
    with pytest.raises(delta.TargetMismatch):
        delta.apply_and_verify({"m.safetensors": tmp_path / "other"}, tmp_path / "d", tmp_path / "out",
                               hash_name="xxh3-128", chunk_bytes=CHUNK,
                               digests=hash_chunks(target_bytes, CHUNK, "xxh3-128"))


def test_damaged_or_foreign_delta_files_are_errors(tmp_path):
    base_bytes = save(_checkpoint())
    target_bytes = save(_step(_checkpoint(), 0.02))
    buf = io.BytesIO()
    delta.encode_file({"m.safetensors": base_bytes}, target_bytes, buf)
    good = buf.getvalue()
    (tmp_path / "base").write_bytes(base_bytes)
    digests = hash_chunks(target_bytes, CHUNK, "xxh3-128")

    def apply(data: bytes, bases=None) -> None:
        (tmp_path / "d").write_bytes(data)
        (tmp_path / "out").write_bytes(b"")
        delta.apply_and_verify(bases or {"m.safetensors": tmp_path / "base"}, tmp_path / "d", tmp_path / "out",
                               hash_name="xxh3-128", chunk_bytes=CHUNK, digests=digests)

    with pytest.raises(delta.DeltaError, match="not a rolloutd delta file"):
        apply(b"garbage" * 10)
    with pytest.raises(delta.DeltaError, match="header accounts for"):
        apply(good[:-10])
    with pytest.raises(delta.DeltaError, match="base has no file"):
        apply(good, {"other.safetensors": tmp_path / "base"})
    with pytest.raises(delta.DeltaError, match="does not decompress"):
        apply(good[:-40] + bytes(b ^ 0xFF for b in good[-40:-30]) + good[-30:])
    # Random damage anywhere: an error every time, never a target that passes with wrong bytes.
    rng = random.Random(1)
    for _ in range(60):
        bad = bytearray(good)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        try:
            apply(bytes(bad))
        except delta.DeltaError:
            continue
        assert (tmp_path / "out").read_bytes() == target_bytes  # a flip the format ignores (JSON spacing)


def test_index_value_is_idempotent(tmp_path):
    base = {"w": torch.randn(500, 8).bfloat16()}
    target = _step(base, 0.05)
    buf = io.BytesIO()
    delta.encode_file({"m": save(base)}, save(target), buf, encoding="index-value-zstd")
    (tmp_path / "d").write_bytes(buf.getvalue())
    (tmp_path / "t").write_bytes(save(target))  # applied over the target itself: still the target
    (tmp_path / "out").write_bytes(b"")
    delta.apply_and_verify({"m": tmp_path / "t"}, tmp_path / "d", tmp_path / "out", hash_name="sha256",
                           chunk_bytes=CHUNK, digests=hash_chunks(save(target), CHUNK, "sha256"))
    assert (tmp_path / "out").read_bytes() == save(target)


def test_delta_file_names_never_clash():
    assert delta.delta_file_name("model.safetensors", set()) == "model.safetensors.delta"
    taken = {"model.safetensors.delta", "delta-00000.delta"}
    assert delta.delta_file_name("model.safetensors", taken) == "delta-00001.delta"
    assert delta.delta_file_name("x" * 199, set()) == "delta-00000.delta"


def _frames(data: bytes) -> tuple[dict, list[bytes]]:
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + n])
    frames, at = [], 16 + n
    for seg in header["segments"]:
        frames.append(data[at:at + seg[6]])
        at += seg[6]
    return header, frames


def _delta_file(header: dict, frames: list[bytes]) -> bytes:
    for seg, frame in zip(header["segments"], frames, strict=True):
        seg[6] = len(frame)
    body = json.dumps(header).encode()
    return delta.MAGIC + len(body).to_bytes(8, "little") + body + b"".join(frames)


def test_sparse_xor_is_smaller_on_a_sparse_step_and_goes_dense_where_most_elements_changed(tmp_path):
    g = torch.Generator().manual_seed(3)
    base = {"sparse": (torch.randn(512, 512, generator=g) * 0.02).bfloat16(),
            "dense": (torch.randn(64, 64, generator=g) * 0.02).bfloat16()}
    target = {"sparse": _step({"w": base["sparse"]}, 0.01)["w"], "dense": _step({"w": base["dense"]}, 0.9)["w"]}
    rebuilt, stats = _rebuild(tmp_path, {"m.safetensors": save(base)}, save(target), "xor-sparse-zstd")
    assert rebuilt == save(target)
    buf = io.BytesIO()
    delta.encode_file({"m.safetensors": save(base)}, save(target), buf, encoding="xor-sparse-zstd")
    header, _ = _frames(buf.getvalue())
    assert [seg[0] for seg in header["segments"]] == ["raw", "xor", "sx"]  # dense first (sorted by name)
    sparse_only = {"w": base["sparse"]}, {"w": target["sparse"]}
    sizes = {}
    for encoding in ("xor-sparse-zstd", "xor-planes-zstd"):
        buf = io.BytesIO()
        sizes[encoding] = delta.encode_file({"m": save(sparse_only[0])}, save(sparse_only[1]), buf,
                                            encoding=encoding).delta_bytes
    assert sizes["xor-sparse-zstd"] < 0.8 * sizes["xor-planes-zstd"], sizes


def test_a_sparse_segment_that_points_outside_its_tensor_is_an_error(tmp_path):
    base = {"w": torch.randn(100, 8).bfloat16()}
    target = _step(base, 0.05)
    buf = io.BytesIO()
    delta.encode_file({"m": save(base)}, save(target), buf, encoding="xor-sparse-zstd")
    header, frames = _frames(buf.getvalue())
    assert header["segments"][1][0] == "sx"
    (tmp_path / "base").write_bytes(save(base))
    digests = hash_chunks(save(target), CHUNK, "xxh3-128")
    for gap, match in ((800, "points outside its tensor"), (0, "points outside its tensor")):
        gaps = np.array([1, gap], dtype="<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
        payload = (2).to_bytes(8, "little") + gaps + bytes(4)
        frames[1] = zstandard.ZstdCompressor().compress(payload)
        (tmp_path / "d").write_bytes(_delta_file(header, frames))
        (tmp_path / "out").write_bytes(b"")
        with pytest.raises(delta.DeltaError, match=match):
            delta.apply_and_verify({"m": tmp_path / "base"}, tmp_path / "d", tmp_path / "out", hash_name="xxh3-128",
                                   chunk_bytes=CHUNK, digests=digests)
    frames[1] = zstandard.ZstdCompressor().compress((1).to_bytes(8, "little") + bytes(5))  # one byte short
    (tmp_path / "d").write_bytes(_delta_file(header, frames))
    with pytest.raises(delta.DeltaError, match="not a valid index list"):
        delta.apply_and_verify({"m": tmp_path / "base"}, tmp_path / "d", tmp_path / "out", hash_name="xxh3-128",
                               chunk_bytes=CHUNK, digests=digests)


def test_the_manifest_accepts_exactly_the_codec_s_encodings():
    assert set(typing.get_args(DeltaEncoding)) == set(delta.ENCODINGS)
    assert delta.DEFAULT_ENCODING in delta.ENCODINGS


def test_a_delta_rebuilding_another_size_is_refused_before_the_file_grows(tmp_path):
    _staged(tmp_path)
    with pytest.raises(delta.TargetMismatch, match="the manifest lists 1"):
        delta.apply_and_verify({"m.safetensors": tmp_path / "base"}, tmp_path / "d", tmp_path / "out",
                               hash_name="xxh3-128", chunk_bytes=CHUNK, digests=["0" * 32])
    assert (tmp_path / "out").stat().st_size == 0


class fake_held_pool:
    """A real pool whose tasks, all but the first, wait for ``release`` before they run: the first
    one's error reaches apply_and_verify while the others are still under way."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool, self.running, self.submitted = pool, 0, 0
        self.lock, self.release = threading.Lock(), threading.Event()

    def submit(self, fn, *args):
        first = self.submitted == 0
        self.submitted += 1

        def run():
            with self.lock:
                self.running += 1
            try:
                if not first:
                    self.release.wait(10)
                return fn(*args)
            finally:
                with self.lock:
                    self.running -= 1
        return self.pool.submit(run)


def test_a_failed_rebuild_returns_only_once_no_segment_is_still_being_written(tmp_path, monkeypatch):
    monkeypatch.setattr(delta, "SEGMENT_BYTES", 4096)
    base = {"w": torch.randn(1000, 33).bfloat16()}
    target = _step(base, 0.1)
    buf = io.BytesIO()
    delta.encode_file({"m": save(base)}, save(target), buf)
    header, frames = _frames(buf.getvalue())
    frames[0] = b"not zstd"  # the first segment (the safetensors header) fails at once
    (tmp_path / "d").write_bytes(_delta_file(header, frames))
    (tmp_path / "base").write_bytes(save(base))
    (tmp_path / "out").write_bytes(b"")
    with ThreadPoolExecutor(2) as real:
        pool = fake_held_pool(real)
        threading.Timer(0.3, pool.release.set).start()  # the held segments go on after the error
        with pytest.raises(delta.DeltaError, match="segment 0 does not decompress"):
            delta.apply_and_verify({"m": tmp_path / "base"}, tmp_path / "d", tmp_path / "out",
                                   hash_name="xxh3-128", chunk_bytes=CHUNK,
                                   digests=hash_chunks(save(target), CHUNK, "xxh3-128"), pool=pool)
        assert pool.running == 0  # nothing writes through the closed descriptor, or a reused one
        assert pool.submitted > 2


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
def test_byte_planes_interleave_back_exactly(itemsize):
    x = np.random.default_rng(itemsize).integers(0, 256, itemsize * 1001, dtype=np.uint8)
    assert np.array_equal(delta._unplanes(delta._planes(x, itemsize).reshape(-1), itemsize), x)


def test_pieces_across_segments_and_chunks_are_each_checked_and_written_in_place(tmp_path, monkeypatch):
    """The rebuild hashes and writes in pieces that end neither where segments nor where
    chunks do: the file comes out exact, and a chunk that differs is named all the same."""
    monkeypatch.setattr(delta, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(delta, "_PIECE_BYTES", 1000)
    base = {"w": torch.randn(1000, 33).bfloat16()}  # 66,000 bytes: 17 segments, 14 chunks
    target = save(_step(base, 0.1))
    buf = io.BytesIO()
    delta.encode_file({"m": save(base)}, target, buf)
    (tmp_path / "d").write_bytes(buf.getvalue())
    (tmp_path / "base").write_bytes(save(base))
    digests = hash_chunks(target, 5000, "xxh3-128")
    with ThreadPoolExecutor(2) as pool:
        (tmp_path / "out").write_bytes(b"")
        delta.apply_and_verify({"m": tmp_path / "base"}, tmp_path / "d", tmp_path / "out", hash_name="xxh3-128",
                               chunk_bytes=5000, digests=digests, pool=pool)
        assert (tmp_path / "out").read_bytes() == target
        digests[7] = "0" * 32
        with pytest.raises(delta.TargetMismatch, match="rebuilt chunk 7 ") as e:
            delta.apply_and_verify({"m": tmp_path / "base"}, tmp_path / "d", tmp_path / "out",
                                   hash_name="xxh3-128", chunk_bytes=5000, digests=digests, pool=pool)
    assert e.value.chunk == 7
