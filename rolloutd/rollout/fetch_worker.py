"""A pull worker: a child process of the daemon that moves a version's bytes into the mirror.

``python -m rolloutd.rollout.fetch_worker``, started by :mod:`rolloutd.rollout.fetch_pool`.
Network reads, digests and writes happen here, in threads of their own process, so that pull
work never shares an interpreter lock or an event loop with the daemon's gateway, heartbeats
or admin API. Standard library and xxhash only (until a delta pull's first rebuild): it starts
in a few tens of milliseconds.

Protocol, one JSON object per line. On stdin, first ``{"hello": {"streams", "piece_bytes",
"request_bytes", "priority", "progress_bytes", "beat_s"}}``, then any number of ``{"job": {"id",
"source", "version", "name", "path", "start", "end", "hash", "digest", "timeout_s",
"allocate"}}``: fetch bytes [start, end) of file ``name`` of ``version`` from ``source`` (a
:class:`~rolloutd.rollout.sources.SourceSpec`), write them at the same offsets into ``path`` (a
file of the mirror's partial directory, already at full size), and check them against
``digest``, all within ``timeout_s`` if given (a peer slower than that is as good as gone);
``allocate`` (default true) says to allocate the range's pages first, false that they exist
(a recycled file's). A delta pull's rebuild is the other kind of job, ``{"job": {"id",
"apply": {"version", "name", "base", "delta", "target", "hash", "chunk_bytes", "digests"}}}``:
rebuild target file ``name`` into ``target`` (the partial directory's file) from the base
version's files (``base``: file name -> path, read only) and the delta file at ``delta``,
checking every chunk it writes against ``digests``
(:func:`rolloutd.wire.delta.apply_and_verify`, imported at the first such job: numpy and
zstandard cost a chunk fetch nothing). On stdout:
``{"ready": pid}`` once, then per job ``{"id", "bytes"}`` as bytes are written, and one
``{"id", "done": true}`` or ``{"id", "error": {"kind", "message", "status", "body"}}``; kinds:
``unavailable``, ``http`` (the source's error reply), ``corrupt`` (digest or length),
``write`` (the mirror's file), and for a rebuild ``delta`` (a delta that cannot be applied)
and ``mismatch`` (a rebuilt chunk differs from the target's digest; ``chunk`` its index);
and ``{"beat": n}`` every ``beat_s``, busy or not, so that the daemon can tell a stopped or
hung worker from a quiet one. No line is longer than ``MAX_EVENT_BYTES``: an error that would
make one longer is cut to its kind, status, error code and the start of its message (a source
can answer with any amount of JSON; the daemon reads lines up to a limit). The worker never
creates, renames or removes anything: the daemon owns the mirror's directories.

It exits at once when stdin ends: the daemon closed it, or died (its end of the pipe closes
with it), so a worker never outlives the daemon.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rolloutd.rollout.sources import MESSAGE_CHARS, Source, SourceError, SourceSpec, compact_body
from rolloutd.wire.hashes import new_hasher

MiB = 1 << 20
KEPT_SOURCES = 8  # per stream: the places it fetched from last, their connections kept open
MAX_EVENT_BYTES = 16 << 10  # longest line a worker writes; below the daemon's reader limit (fetch_pool)


class _Corrupt(Exception):
    pass


class Worker:
    def __init__(self, hello: dict, out=sys.stdout):
        self.piece_bytes = int(hello["piece_bytes"])
        self.request_bytes = int(hello["request_bytes"])
        self.progress_bytes = int(hello.get("progress_bytes", 8 * MiB))
        self.beat_s = float(hello.get("beat_s", 0))  # 0: no beats (a test's worker)
        self.jobs: queue.Queue[dict] = queue.Queue()
        self._out, self._out_lock = out, threading.Lock()
        self._decoders: ThreadPoolExecutor | None = None  # a rebuild's segments, made at the first
        self._decoders_lock = threading.Lock()
        for i in range(int(hello["streams"])):
            threading.Thread(target=self._stream, name=f"stream-{i}", daemon=True).start()

    def start_beats(self) -> None:
        if self.beat_s > 0:
            threading.Thread(target=self._beat, name="beat", daemon=True).start()

    def _beat(self) -> None:
        """A line every ``beat_s``: the daemon's sign that this process still runs."""
        n = 0
        while True:
            time.sleep(self.beat_s)
            n += 1
            self.emit({"beat": n})

    def emit(self, event: dict) -> None:
        line = _bounded(json.dumps(event, separators=(",", ":")), event) + "\n"
        with self._out_lock:
            self._out.write(line)
            self._out.flush()

    def _stream(self) -> None:
        """Jobs one after another; the sources it used last stay open (their connections)."""
        sources: dict[SourceSpec, Source] = {}
        while True:
            job = self.jobs.get()
            if "apply" in job:
                self._rebuild(job)
                continue
            try:
                self._fetch(self._source(sources, SourceSpec.from_json(job["source"])), job)
                self.emit({"id": job["id"], "done": True})
            except SourceError as e:
                self.emit({"id": job["id"], "error": e.as_json()})
            except _Corrupt as e:
                self.emit({"id": job["id"], "error": {"kind": "corrupt", "message": str(e)}})
            except OSError as e:
                self.emit({"id": job["id"], "error": {"kind": "write", "message": f"{job['path']}: {e}"}})
            except Exception as e:  # a bug: say so, and keep the worker for the next job
                self.emit({"id": job["id"], "error": {"kind": "bug", "message": f"{type(e).__name__}: {e}"}})

    def _rebuild(self, job: dict) -> None:
        """One target file of a delta pull, rebuilt and checked; its outcome emitted."""
        try:
            from rolloutd.wire import delta as codec  # numpy and zstandard: only a rebuild needs them
        except ImportError as e:  # an install without them: the pull goes whole, the thread lives on
            self.emit({"id": job["id"], "error": {"kind": "delta", "message": f"cannot rebuild: {e}"}})
            return
        spec = job["apply"]
        try:
            with ProgressBatcher(lambda n: self.emit({"id": job["id"], "bytes": n}), self.progress_bytes) as report:
                codec.apply_and_verify({k: Path(v) for k, v in spec["base"].items()}, Path(spec["delta"]),
                                       Path(spec["target"]), hash_name=spec["hash"],
                                       chunk_bytes=int(spec["chunk_bytes"]), digests=list(spec["digests"]),
                                       progress=report, pool=self._decoder_pool())
            self.emit({"id": job["id"], "done": True})
        except codec.TargetMismatch as e:
            self.emit({"id": job["id"], "error": {"kind": "mismatch", "message": str(e),
                                                  "chunk": getattr(e, "chunk", None)}})
        except codec.DeltaError as e:
            self.emit({"id": job["id"], "error": {"kind": "delta", "message": str(e)}})
        except OSError as e:  # the base's files (gone?) or the partial's: the error names which
            self.emit({"id": job["id"], "error": {"kind": "write", "message": str(e)}})
        except Exception as e:  # a bug: say so, and keep the worker for the next job
            self.emit({"id": job["id"], "error": {"kind": "bug", "message": f"{type(e).__name__}: {e}"}})

    def _decoder_pool(self) -> ThreadPoolExecutor:
        """Threads that decode a rebuild's segments ahead of its writes (zstandard and numpy
        release the interpreter lock), shared by the worker's streams."""
        with self._decoders_lock:
            if self._decoders is None:
                self._decoders = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                                                    thread_name_prefix="decode")
            return self._decoders

    def _source(self, sources: dict[SourceSpec, Source], spec: SourceSpec) -> Source:
        source = sources.pop(spec, None)
        if source is None:
            source = spec.open(self.piece_bytes)
            if len(sources) >= KEPT_SOURCES:
                sources.pop(next(iter(sources))).close()  # the one used longest ago
        sources[spec] = source  # now the newest
        return source

    def _fetch(self, source: Source, job: dict) -> None:
        start, end = int(job["start"]), int(job["end"])
        deadline = time.monotonic() + float(job["timeout_s"]) if job.get("timeout_s") else None
        hasher = new_hasher(job["hash"])
        fd = os.open(job["path"], os.O_RDWR | os.O_CLOEXEC)
        try:
            # The chunk's pages in one call, here at the worker's priority: the mirror left the
            # file sparse (allocating it there would be the daemon's CPU time). Not over pages
            # that exist: posix_fallocate walks each of them all the same (bench/README.md).
            if job.get("allocate", True):
                os.posix_fallocate(fd, start, end - start)
            with ChunkWriter(fd, start, end, hasher, lambda n: self.emit({"id": job["id"], "bytes": n}),
                             self.progress_bytes, deadline=deadline) as sink:
                for req_start in range(start, end, self.request_bytes):
                    source.fetch(int(job["version"]), job["name"], req_start, min(end, req_start + self.request_bytes),
                                 sink, deadline)
        finally:
            os.close(fd)
        if sink.offset != end:
            raise _Corrupt(f"got {sink.offset - start} bytes of {end - start}")
        if (got := hasher.hexdigest()) != job["digest"]:
            raise _Corrupt(f"digest {got} does not match the manifest's {job['digest']}")


class ChunkWriter:
    """A chunk's region of a mirror file, as a source's sink: every piece hashed, in order,
    while it is in cache, then written at its offset."""

    def __init__(self, fd: int, start: int, end: int, hasher, report, report_every: int,
                 deadline: float | None = None):
        self.fd, self.offset, self._start, self._end = fd, start, start, end
        self._deadline = deadline
        self._hasher, self._report, self._every, self._unreported = hasher, report, report_every, 0

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._unreported:
            self._report(self._unreported)

    def write(self, piece: memoryview) -> None:
        if self.offset + len(piece) > self._end:
            raise _Corrupt(f"the source sent more than the {self._end - self._start} bytes asked for")
        self._hasher.update(piece)  # xxhash and hashlib release the GIL for large pieces
        done = 0
        while done < len(piece):  # a regular file takes it all at once, unless it is full
            done += os.pwrite(self.fd, piece[done:], self.offset + done)
        self._advance(done)

    def _advance(self, n: int) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise SourceError("unavailable", "the chunk was not done in time")
        self.offset += n
        self._unreported += n
        if self._unreported >= self._every:
            self._report(self._unreported)
            self._unreported = 0


class ProgressBatcher:
    """Bytes reported in batches of at least ``every`` (the rest when the block ends)."""

    def __init__(self, report, every: int):
        self._report, self._every, self._unreported = report, every, 0

    def __enter__(self) -> ProgressBatcher:
        return self

    def __exit__(self, *exc) -> None:
        if self._unreported:
            self._report(self._unreported)

    def __call__(self, n: int) -> None:
        self._unreported += n
        if self._unreported >= self._every:
            self._report(self._unreported)
            self._unreported = 0


def _bounded(line: str, event: dict) -> str:
    """``line`` if it is short enough; else the event cut down (only an error can be long)."""
    if len(line) <= MAX_EVENT_BYTES:
        return line
    error = event.get("error") if isinstance(event.get("error"), dict) else {}
    cut = {"id": event.get("id"), "error": {"kind": error.get("kind", "bug"), "status": error.get("status"),
                                            "message": str(error.get("message", ""))[:MESSAGE_CHARS],
                                            "body": compact_body(error.get("body"))}}
    line = json.dumps(cut, separators=(",", ":"))
    if len(line) <= MAX_EVENT_BYTES:
        return line
    return json.dumps({"id": event.get("id"), "error": {"kind": "bug", "message": f"an event of {len(line)} bytes"}})


def lower_priority(level: str) -> None:
    """Put this process behind generation and the gateway when the CPU is contended: ``idle``
    (SCHED_IDLE: any other task that wakes up preempts it at once), ``low`` (nice 10). Done
    before the stream threads start, which inherit it. Without systemd, the kernel may group a
    session's processes for scheduling (autogroup) so that nice between sessions means
    nothing; the worker's own session group is lowered too."""
    if level == "normal":
        return
    try:
        if level == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.nice(19 if level == "idle" else 10)
        if os.path.exists("/proc/self/autogroup"):
            with open("/proc/self/autogroup", "w") as f:
                f.write("19" if level == "idle" else "10")
    except OSError as e:  # a sandbox may forbid it: pull at the daemon's priority then
        print(f"rolloutd pull worker {os.getpid()}: cannot lower its priority to {level}: {e}", file=sys.stderr)


def main() -> None:
    hello = json.loads(sys.stdin.readline() or "null")
    if not isinstance(hello, dict) or "hello" not in hello:
        sys.exit("rolloutd pull worker: expected a hello line on stdin")
    hello = hello["hello"]
    lower_priority(hello.get("priority", "normal"))
    worker = Worker(hello)
    worker.emit({"ready": os.getpid()})
    worker.start_beats()
    for line in sys.stdin:
        worker.jobs.put(json.loads(line)["job"])
    os._exit(0)  # stdin ended: the daemon closed it or died; threads mid-job end with us


if __name__ == "__main__":
    main()
