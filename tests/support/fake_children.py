"""Small fake servers for the tests of :class:`rolloutd.supervise.child.Child`, each named for
what it fakes, and the log lines a child forwards."""

from __future__ import annotations

import sys
import textwrap

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
