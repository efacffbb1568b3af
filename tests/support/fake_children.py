"""Small fake servers for the tests of :class:`rolloutd.supervise.child.Child`, each named for
what it fakes, and the log lines a child forwards."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from rolloutd.supervise.child import Child
from tests.support.waiting import until

PY = sys.executable
# A server that prints some lines: one long, one not UTF-8, the last without its newline.
TALKER = [PY, "-c", textwrap.dedent("""
    import sys
    w = sys.stdout.buffer.write
    w(b"first line\\n" + b"x" * (200 * 1024) + b"\\n" + b"bad \\xff byte\\n" + b"no newline at the end")
""")]
# A server that exits at once with status 3.
EXITS_3 = ["sh", "-c", "exit 3"]
# Servers that die of a signal (OOM-killed, crashed).
KILLED = ["sh", "-c", "kill -KILL $$"]
SEGFAULTS = ["sh", "-c", "kill -SEGV $$"]
# A cooperative server: exits on SIGTERM.
COOPERATIVE = [PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
# A server that ignores SIGTERM (after saying "ready", so the test never signals it too early).
IGNORES_TERM = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(60)"]
# A cooperative server whose own child (vLLM's engine core, say) ignores SIGTERM.
GRANDCHILD_IGNORES_TERM = ["sh", "-c", f"{IGNORES_TERM[0]} -c \"{IGNORES_TERM[2]}\" & wait"]


def lines_of(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == f"rolloutd.server.{name}"]


async def spawned_ready(make, caplog, name: str, argv: list[str], **kw) -> Child:
    child = make(name, argv, **kw)
    await child.spawn()
    await until(lambda: f"{name}[{child.pid}]: ready" in lines_of(caplog, name), what=f"{name} ready")
    return child


# A server whose segments no pattern knows (vLLM's CPU tensor-parallel ``vllm_dist_*-cpushm_*``):
# it creates and maps each name given, also one in a directory of /dev/shm (as the mirror's files
# are), and opens one that was there before it.
HOLDS_NAMED = textwrap.dedent("""
    import mmap, os, sys, time
    maps = []
    for name in sys.argv[2:]:
        fd = os.open(os.path.join(sys.argv[1], name), os.O_CREAT | os.O_RDWR, 0o600)
        if not (size := os.fstat(fd).st_size):
            os.ftruncate(fd, size := 4 << 20)
        maps.append(mmap.mmap(fd, size))
    print("ready", flush=True)
    time.sleep(60)
""")


def held_decoy(shm: Path, name: str) -> subprocess.Popen:
    """Another program's segment, made and held by a process outside every server's group."""
    decoy = subprocess.Popen([sys.executable, "-c", HOLDS_NAMED, str(shm), name], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert decoy.stdout.readline().strip() == "ready"
    return decoy
