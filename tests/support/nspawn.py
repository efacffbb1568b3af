"""A real systemd, booted by ``systemd-nspawn``, for tests of the unit and the package.

Two kinds of root file system:

* ``debian_root()``: a clean Debian 12 made once by ``debootstrap`` (about a minute) and kept
  under ``build/nspawn/``; every boot sees it through a throw-away overlay, so it stays clean.
* ``host_root()``: this machine's own ``/``, bound read-only and booted with the same overlay,
  so vLLM's environment and the checkout are visible inside, unchanged outside.

The machine is driven with ``nsenter`` into the container's namespaces (``machinectl`` needs a
registered machine, which these machines cannot do). Each container starts in a cgroup of its
own, removed when it stops: ``--keep-unit`` splits the cgroup it starts in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "nspawn"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_HIERARCHIES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified")

# What the clean root holds besides Debian's minimal base; its cache is keyed by this list.
DEBIAN_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "curl", "iproute2", "procps")
# Timers that would start apt or other maintenance inside a booted guest.
MASKED_ALWAYS = ("apt-daily.timer", "apt-daily-upgrade.timer")


class GuestError(AssertionError):
    """A command inside the guest failed where the test needed it to succeed."""


def require_tools() -> None:
    """Fail (never skip) with the way out when the machine cannot boot a container."""
    missing = [tool for tool in ("systemd-nspawn", "debootstrap", "nsenter") if not shutil.which(tool)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found: run scripts/bootstrap as root, or "
                           "apt-get install systemd-container debootstrap util-linux")
    if os.geteuid() != 0:
        raise RuntimeError("booting a container needs root")


def _debian_root_path() -> Path:
    return CACHE / f"bookworm-{uuid.uuid5(uuid.NAMESPACE_URL, ','.join(DEBIAN_PACKAGES)).hex[:8]}"


def debian_root_made() -> bool:
    """Whether :func:`debian_root` is made already (scripts/bootstrap makes it)."""
    return (_debian_root_path() / "etc" / "os-release").exists()


def debian_root() -> Path:
    """A clean Debian 12 root file system (cached; made with debootstrap by scripts/bootstrap, or
    on first use)."""
    root = _debian_root_path()
    if debian_root_made():
        return root
    require_tools()
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix="bookworm.", dir=CACHE))
    log = CACHE / "debootstrap.log"
    with log.open("w") as out:
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
             "bookworm", str(partial), _debian_mirror()],
            stdout=out, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"debootstrap failed ({done.returncode}); see {log}")
    for unit in MASKED_ALWAYS:
        (partial / "etc/systemd/system" / unit).symlink_to("/dev/null")
    partial.rename(root)
    return root


def _debian_mirror() -> str:
    """The Debian mirror apt already uses on this machine."""
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for line in source.read_text().splitlines():
                words = line.split()
                if words[:1] == ["URIs:"] and "security" not in words[1]:
                    return words[1]
                if words[:1] == ["deb"] and "security" not in line:
                    return next(w for w in words[1:] if "://" in w)
    return "http://deb.debian.org/debian"


@contextlib.contextmanager
def host_root() -> Iterator[Path]:
    """This machine's ``/``, bound read-only at a temporary mount point."""
    require_tools()
    point = Path(tempfile.mkdtemp(prefix="rolloutd-hostroot."))
    subprocess.run(["mount", "--bind", "/", str(point)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(point)], check=True)
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


def enabled_host_units() -> list[str]:
    """Units this machine's own systemd would start at boot (masked in a guest of its root)."""
    units = []
    for wants in ("multi-user.target.wants", "timers.target.wants"):
        units += sorted(p.name for p in Path("/etc/systemd/system", wants).glob("*.*")
                        if p.suffix in (".service", ".timer"))
    return units


class Machine:
    """One booted container; ``run`` executes a command inside it as root."""

    def __init__(self, root: Path, log: Path, *, private_network: bool = False,
                 binds_ro: Sequence[tuple[Path, str]] = (), masked: Sequence[str] = ()):
        self.root = root
        self.log = log
        self.private_network = private_network
        self.binds_ro = list(binds_ro)
        self.masked = [*MASKED_ALWAYS, *masked]
        self.own_cgroup = f"rolloutd-test-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None
        self.leader = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def boot(self, timeout_s: float = 180) -> Machine:
        """Start the guest and wait for its systemd; on any failure nothing is left running."""
        require_tools()
        try:
            return self._boot(timeout_s)
        except BaseException:
            self.halt()
            raise

    def _boot(self, timeout_s: float) -> Machine:
        for hierarchy in CGROUP_HIERARCHIES:
            os.mkdir(f"{hierarchy}/{self.own_cgroup}")
        argv = ["systemd-nspawn", "-b", "-D", str(self.root), "--register=no", "--keep-unit",
                "--console=read-only", "--volatile=overlay"]
        if self.private_network:
            argv.append("--private-network")
        argv += [f"--bind-ro={src}:{dest}" for src, dest in self.binds_ro]
        argv += [f"systemd.mask={unit}" for unit in self.masked]
        env = {"PATH": GUEST_PATH, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        cgroup = self.own_cgroup

        def into_own_cgroup() -> None:  # runs in the child, before exec
            for hierarchy in CGROUP_HIERARCHIES:
                with open(f"{hierarchy}/{cgroup}/cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))

        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True, preexec_fn=into_own_cgroup)
        deadline = time.monotonic() + timeout_s
        while not self.leader:
            self._check_running()
            # The guest's systemd: nspawn's child that runs it (nspawn forks short-lived helpers too,
            # and a helper taken for the guest leaves every later nsenter without a target).
            children = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-x", "systemd"], capture_output=True,
                                      text=True).stdout
            self.leader = int(children.split()[0]) if children.split() else 0
            if time.monotonic() > deadline:
                raise RuntimeError(f"container did not start in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)
        while True:  # the bus comes up a moment after PID 1
            state = self.run("systemctl", "is-system-running", "--wait", check=False, timeout_s=timeout_s)
            if state.stdout.strip() in ("running", "degraded"):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"guest systemd not running ({state.stdout.strip()!r}):\n{self.log_tail()}")
            time.sleep(0.2)

    def halt(self, timeout_s: float = 30) -> None:
        """Stop the guest's systemd cleanly (SIGKILL after ``timeout_s``), remove its cgroups."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for hierarchy in CGROUP_HIERARCHIES:
            _remove_cgroup(Path(hierarchy, self.own_cgroup))

    def __enter__(self) -> Machine:
        return self.boot()

    def __exit__(self, *exc) -> None:
        self.halt()

    def _check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # -- inside ---------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout_s: float = 120, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``argv`` as root inside the guest, with a clean environment (nothing of the host's)."""
        self._check_running()
        clean = [f"PATH={GUEST_PATH}", "LANG=C.UTF-8", *(f"{k}={v}" for k, v in (env or {}).items())]
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "env", "-i", *clean, *argv],
                              capture_output=True, text=True, timeout=timeout_s, input=input)
        if check and done.returncode != 0:
            raise GuestError(f"{' '.join(argv)} exited with {done.returncode}\n"
                             f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}")
        return done

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("sh", "-ec", script, **kw)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show`` properties of a unit."""
        out = self.run("systemctl", "show", "--all", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        self.run("sh", "-ec", f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode} "$1"', "sh", path, input=text)

    def unit_pids(self, unit: str) -> list[int]:
        """Processes of the unit's cgroup and the cgroups below it (pids as the guest sees them)."""
        cgroup = self.show(unit, "ControlGroup")["ControlGroup"]
        if not cgroup:
            return []
        out = self.run("sh", "-c", f'find "/sys/fs/cgroup{cgroup}" -name cgroup.procs -exec cat {{}} + 2>/dev/null',
                       check=False).stdout
        return sorted(int(p) for p in out.split())

    def cgroup(self, pid: int | str) -> str | None:
        """The cgroup (v2) of a guest process, as the guest names it; None once it is gone."""
        out = self.run("cat", f"/proc/{pid}/cgroup", check=False).stdout
        return next((line[3:] for line in out.splitlines() if line.startswith("0::")), None)

    def processes(self, pattern: str) -> list[str]:
        """``pid args`` of every guest process whose command line matches ``pattern`` (a regex)."""
        out = self.run("pgrep", "-a", "-f", pattern, check=False).stdout
        return [line for line in out.splitlines() if line.strip()]


def _remove_cgroup(path: Path) -> None:
    if not path.exists():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def build_deb(out: Path, revision: str = "1") -> Path:
    """The package, built by the same command a user runs (``packaging/build-deb``)."""
    import sys
    done = subprocess.run([str(ROOT / "packaging" / "build-deb"), "--out", str(out), "--revision", revision],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    if done.returncode != 0:
        raise RuntimeError(f"packaging/build-deb failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


DEBS = ROOT / "build" / "test-debs"


def deb_folder() -> Path:
    """``build/test-debs/<digest>``: the digest of the package's sources as they are now (the
    files git tracks or would, under the paths ``packaging/build-deb --sources`` names), so that a
    package is built once per state of them, not once per run and worker."""
    import hashlib
    sources = subprocess.run([ROOT / "packaging" / "build-deb", "--sources"], capture_output=True, text=True,
                             check=True).stdout.split()
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *sources],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    digest = hashlib.sha256()
    for name in sorted(n for n in names if n):
        path = ROOT / name.decode()
        if path.is_file():
            digest.update(name + b"\0" + path.read_bytes() + b"\0")
    return DEBS / digest.hexdigest()[:16]


def build_deb_once(folder: Path, revision: str) -> Path:
    """The package of ``revision`` in ``folder``, built there unless it is already; one builder
    at a time (a lock file beside the folder), so two workers asking together build it once.
    Packages of other states of the sources, an hour old, are removed."""
    import fcntl
    DEBS.mkdir(parents=True, exist_ok=True)
    with open(DEBS / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = sorted(folder.glob(f"rolloutd_*-{revision}_*.deb"))
        if built:
            return built[0]
        for stale in DEBS.iterdir():  # an hour old: not one a guest of a run going on still binds
            if stale.is_dir() and stale != folder and time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        folder.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=DEBS) as scratch:  # no half-written package is ever found
            deb = build_deb(Path(scratch), revision)
            return deb.rename(folder / deb.name)
