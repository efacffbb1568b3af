"""rolloutd: keeps a node's vLLM servers on a trainer's newest policy weights (one subcommand per job)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from rolloutd import __version__
from rolloutd.units import size
from rolloutd.wire import errors

log = logging.getLogger("rolloutd")


def setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if _stderr_is_journal() else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


class JournalFormatter(logging.Formatter):
    """For stderr connected to journald: no timestamp (the journal has its own), and a
    ``<N>`` syslog priority prefix, so ``journalctl -p warning`` finds warnings and errors."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self.PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


def _stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM=<dev>:<inode> of the stream it connected to the journal."""
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return os.environ.get("JOURNAL_STREAM") == f"{st.st_dev}:{st.st_ino}"


# -- rolloutd registry ---------------------------------------------------------------------------

def _registry_args(p: argparse.ArgumentParser) -> None:
    from rolloutd.registry.settings import RegistrySettings
    for name, field in RegistrySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:  # a switch: --allow-unauthenticated, not --allow-unauthenticated true
            on = field.default is True  # on by default: --delta / --no-delta
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=field.description,
                           action=argparse.BooleanOptionalAction if on else "store_true")
            continue
        p.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(),
                       help=f"{field.description} (default: {field.default})")


def cmd_registry(args: argparse.Namespace) -> int:
    from rolloutd.registry.settings import RegistrySettings
    values = {k: v for k, v in vars(args).items() if k in RegistrySettings.model_fields}
    settings = RegistrySettings.model_validate(values, strict=False)
    from rolloutd.httpserver import raise_open_files_limit, reuse_freed_memory, run
    reuse_freed_memory()  # uploads: bodies through reused buffers, not fresh pages
    before, after = raise_open_files_limit()  # a connection per node, and more
    if after < 4096:
        log.warning("open files limited to %d (hard limit): a registry needs about one per node; raise it "
                    "(ulimit -n, or LimitNOFILE= in a systemd unit)", after)
    elif after != before:
        log.debug("open files limit raised from %d to %d", before, after)
    return run(serve_registry(settings))


async def serve_registry(settings) -> int:
    from rolloutd.httpserver import QuietServer, bind, server_config
    from rolloutd.registry.app import create_app
    from rolloutd.registry.service import RegistryService

    service = RegistryService(settings)
    sock = bind(settings.host, settings.port)
    server = QuietServer(server_config(create_app(service), timeout_keep_alive=settings.keep_alive_s),
                         before_shutdown=[service.close])
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # handlers only ask the server to stop
        loop.add_signal_handler(sig, server.exit)
    log.info("serve registry on %s:%d (instance %s, bytes in %s, auth %s)", *sock.getsockname()[:2],
             service.store.instance, service.blobs.describe(), "on" if service.token else "off")
    if service.token is None and settings.allow_unauthenticated:
        log.warning("registry: allow_unauthenticated: anyone who can reach %s:%d can publish, retire and read "
                    "versions", *sock.getsockname()[:2])
    await server.serve(sockets=[sock])
    log.info("stop registry")
    return 0


# -- rolloutd publish --------------------------------------------------------------------------------

class ProgressLine:
    """Prints ``done/total, rate, ETA`` to stderr at most every ``every_s`` seconds."""

    def __init__(self, label: str, every_s: float = 0.5):
        self.label, self.every_s = label, every_s
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-6)
        eta = (total - done) / rate if rate > 0 else float("inf")
        print(f"{self.label}: {size(done)} / {size(total)} ({100 * done / max(total, 1):.0f}%), "
              f"{size(rate)}/s, ETA {eta:.0f} s", file=sys.stderr, flush=True)


def cmd_publish(args: argparse.Namespace) -> int:
    from rolloutd.trainer.options import PublishOptions
    from rolloutd.trainer.publish import RegistryHTTP
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    metadata = dict(kv.split("=", 1) for kv in args.metadata)
    canary = None
    if args.canary:
        from pydantic import ValidationError

        from rolloutd.trainer.canary import load_canary
        try:
            canary = load_canary(args.canary)
        except (OSError, ValidationError) as e:
            print(f"rolloutd publish: --canary {args.canary}: {e}", file=sys.stderr)
            return 2
    store = None
    if args.to:
        from rolloutd.objstore import ObjectStoreError, ObjectStoreSettings, parse_source
        try:
            parse_source(args.to)
        except ObjectStoreError as e:
            print(f"rolloutd publish: --to: {e}", file=sys.stderr)
            return 2
        store = ObjectStoreSettings(endpoint=args.s3_endpoint, region=args.s3_region,
                                    credentials_file=args.s3_credentials)
    options = PublishOptions(chunk_bytes=args.chunk_bytes, metadata=metadata, canary=canary, partial=args.partial,
                             to=args.to, store=store, prune=not args.keep_objects, hash_name=args.hash,
                             delta=not args.full)
    reg = RegistryHTTP(args.registry, token, timeout_s=args.timeout_s)
    try:
        manifest = reg.publish_dir(args.version, Path(args.directory), options,
                                   progress=ProgressLine(f"upload v{args.version}"))
        how = _how_published(reg, manifest)
    finally:
        reg.close()
    where = f" at {manifest.source}" if manifest.source else ""
    print(f"published version {manifest.version}{where}{how}: {len(manifest.files)} files, "
          f"{size(manifest.total_bytes)}, digest {manifest.digest}")
    return 0


def _how_published(reg, manifest) -> str:
    """" as a delta on M (X, Y% of the full size)", from the registry's copy of the manifest;
    "" for a full version."""
    from rolloutd.units import percent
    try:
        delta = reg.manifest(manifest.version).delta
    except errors.RegistryError:  # published, then retired already: nothing more to say
        return ""
    if delta is None:
        return ""
    return (f" as a delta on version {delta.base_version} ({size(delta.total_bytes)}, "
            f"{percent(delta.total_bytes / max(manifest.total_bytes, 1))} of the full size)")


def _metadata(value: str) -> str:
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return value


# -- rolloutd check-config ---------------------------------------------------------------------------

def add_config_arg(p: argparse.ArgumentParser) -> None:
    """``-c/--config FILE``, for every subcommand that reads the node's config."""
    from rolloutd.config import DEFAULT_CONFIG_PATH
    p.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG_PATH, metavar="FILE",
                   help="config file (default: %(default)s)")


def cmd_check_config(args: argparse.Namespace) -> int:
    from rolloutd.config import ConfigError, load_config
    try:
        cfg = load_config(args.config, check_files=True)  # a token the daemon could not read fails here too
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    names = ", ".join(s.name for s in cfg.servers)
    count = f"{len(cfg.servers)} server{'s' if len(cfg.servers) != 1 else ''}"
    print(f"rolloutd: {args.config} is valid: {count} ({names}), registry {cfg.registry.url}")
    return 0


# -- rolloutd run ------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    """The node daemon (what systemd runs): supervise the configured servers until SIGTERM."""
    import faulthandler

    from rolloutd.config import ConfigError, load_config
    from rolloutd.node import stacks
    from rolloutd.node.daemon import run_daemon
    # A frozen daemon gets SIGABRT from systemd's watchdog: its Python stacks go to the journal.
    faulthandler.enable()
    stacks.threads_only()  # SIGUSR1 shows them too, and never kills it
    try:
        cfg = load_config(args.config, check_files=True)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return run_daemon(cfg, args.config)


# -- entry point -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"rolloutd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("registry", help="run a standalone weight registry")
    _registry_args(p)
    p.set_defaults(func=cmd_registry)

    p = sub.add_parser("publish", help="publish a directory of safetensors files as a version")
    p.add_argument("version", type=int, help="version number (newer than every published one)")
    p.add_argument("directory", help="directory holding *.safetensors")
    p.add_argument("--registry", required=True, help="registry URL, e.g. http://trainer:8700")
    p.add_argument("--token-file", help="file holding the registry's bearer token")
    p.add_argument("--chunk-bytes", type=int, default=64 << 20, help="digest chunk size")
    p.add_argument("--hash", choices=["xxh3-128", "blake3", "sha256"], default="xxh3-128",
                   help="chunk digest: xxh3-128 (fastest; nodes take the version from its origin only) or "
                   "blake3/sha256 (cryptographic: nodes may take it from their peers)")
    p.add_argument("--metadata", type=_metadata, action="append", default=[], metavar="KEY=VALUE",
                   help="label stored in the manifest (repeatable)")
    p.add_argument("--partial", action="store_true", help="the files carry only some of the model's tensors on "
                   "purpose (the rest keeps its weights); without it a version lacking a tensor fails to load")
    p.add_argument("--canary", metavar="FILE.json", help="canary to attach (JSON: prompt_ids, continuation_ids, "
                   "logprobs, tolerance; rolloutd.trainer.canary.save_canary writes one)")
    p.add_argument("--to", metavar="s3://BUCKET/PREFIX", help="put the files in this object store (under "
                   "PREFIX/VERSION/) instead of the registry, which keeps the manifest, leases and the source")
    p.add_argument("--s3-endpoint", metavar="URL", help="with --to: the S3-compatible service (default: AWS)")
    p.add_argument("--s3-region", default="us-east-1", help="with --to: the bucket's region")
    p.add_argument("--s3-credentials", metavar="FILE", help="with --to: JSON or YAML file with access_key_id and "
                   "secret_access_key (default: the AWS_* environment variables)")
    p.add_argument("--keep-objects", action="store_true", help="with --to: leave the objects of earlier "
                   "versions the registry no longer holds (default: delete them once this version is published)")
    p.add_argument("--full", action="store_true", help="publish a full version, never a delta on the registry's "
                   "newest version (by default the registry publishes a delta when it is smaller)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("run", help="run the node daemon: supervise the configured vLLM servers (systemd runs this)")
    add_config_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check-config", help="validate the node's config file and exit (0: valid, 2: not)")
    add_config_arg(p)
    p.set_defaults(func=cmd_check_config)

    from rolloutd.node.adminctl import add_parsers as add_admin
    add_admin(sub)
    from rolloutd.fleetctl import add_parser as add_fleet
    add_fleet(sub)
    from rolloutd.demo.rl import add_parser as add_rl
    from rolloutd.demo.serve import add_parser as add_demo
    from rolloutd.demo.trl import add_parser as add_trl
    demos = add_demo(sub)
    add_rl(demos)  # `rolloutd demo rl` under `rolloutd demo`
    add_trl(demos)  # `rolloutd demo trl`
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")  # a check of several fields has no location
            print(f"rolloutd: invalid {loc}: {msg}" if loc else f"rolloutd: {msg}", file=sys.stderr)
        return 2
    except errors.RegistryError as e:
        print(f"rolloutd: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rolloutd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
