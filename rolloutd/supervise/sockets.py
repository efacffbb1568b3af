"""Where vLLM children listen: one UNIX socket each, in a directory only the daemon's user can enter.

vLLM's pause and weight routes and ``/collective_rpc`` have no authentication, and a loopback
TCP port is reachable by every local user. So every child runs with ``--uds
<state_dir>/sockets/<name>.sock`` (``Config.socket_path``) and opens no port for its routes; the
daemon's probes, update calls, gate and gateway connect to that socket.

- :func:`prepare_socket_dir` makes the directory mode 0700 and refuses one that is not a plain
  directory of the daemon's user (a directory another user controls could swap the socket);
  connecting then needs the daemon's uid (or root), whatever mode vLLM gives the socket file.
- :func:`remove_stale` removes a socket file a crashed run left at a path before a child binds it
  (vLLM's bind fails on an existing path), and the socket of a child that stopped; anything at
  that path that is not a socket is refused, never removed.
- The path's length (at most 107 bytes) is checked with the config.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SocketDirError(OSError):
    """The socket directory or a socket path cannot be used as it is."""


def prepare_socket_dir(path: Path) -> Path:
    """Make ``path`` (mode 0700) or check it; SocketDirError when it is not safely the daemon's."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        raise SocketDirError(f"socket directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):  # a symbolic link included: it could point anywhere
        raise SocketDirError(f"socket directory {path}: not a directory")
    if st.st_uid != os.geteuid():
        raise SocketDirError(f"socket directory {path}: owned by uid {st.st_uid}, not by rolloutd's user "
                             f"(uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:  # ours: close it to every other user
        os.chmod(path, 0o700)
    return path


def remove_stale(path: Path) -> bool:
    """Remove the socket file at ``path`` if there is one (True); SocketDirError for anything else
    that is there. Only called while no child of ours listens on it."""
    try:
        st = Path(path).lstat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise SocketDirError(f"socket {path}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketDirError(f"socket {path}: something else is there (not a socket); remove it")
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise SocketDirError(f"socket {path}: cannot remove it: {e.strerror or e}") from None
    return True
