"""The example ``etc/rolloutd.yaml`` and the reference ``docs/config.md``, generated from the model.

Both come from :class:`rolloutd.config.Config`'s field descriptions, types, constraints and
defaults, plus the example values below for the keys that have no default, so neither can
drift from the code; a test compares the committed files with :func:`example_yaml` and
:func:`reference_md`. After changing the model, regenerate them::

    python scripts/configdoc.py            # rewrites etc/rolloutd.yaml and docs/config.md
    python scripts/configdoc.py --check    # exit 1 when either is stale
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo

from rolloutd.config import DEFAULT_CONFIG_PATH, Config, Server

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PATH = Path("etc/rolloutd.yaml")
REFERENCE_PATH = Path("docs/config.md")
REGENERATE = "python scripts/configdoc.py"
WIDTH = 100

# Values for the keys without a default: a node with two GPUs, one server on each.
EXAMPLE_REGISTRY_URL = "http://trainer:8700"
EXAMPLE_SERVERS = [
    {"name": "gpu0", "model": "/srv/models/policy", "public_port": 9001, "gpus": [0]},
    {"name": "gpu1", "model": "/srv/models/policy", "public_port": 9002, "gpus": [1]},
]

EXAMPLE_HEADER = f"""\
rolloutd's configuration, read from {DEFAULT_CONFIG_PATH} (another file: `rolloutd run -c FILE`).

An example for a node with two GPUs and one vLLM server on each. Every key is listed with its
description and its default; only registry.url and servers have no default. Check a change with
`rolloutd check-config`, apply it with `systemctl reload rolloutd`. Reference: docs/config.md.

Generated from the model in rolloutd/config.py by `{REGENERATE}`."""

REFERENCE_INTRO = f"""\
# Configuration: `{DEFAULT_CONFIG_PATH}`

`rolloutd run` reads its configuration from `{DEFAULT_CONFIG_PATH}`; `-c FILE` names another
file. It is YAML: one mapping of sections. Only `registry.url` and `servers` are required;
every other key has the default listed below, and a section left empty (all its keys
commented out) takes all its defaults. `etc/rolloutd.yaml` is a commented example for a node
with two GPUs.

Reading is strict, so a typo cannot pass silently: an unknown key, a key given twice, or a
value of the wrong type (`"80"` or `true` for an integer) is an error. Units are in the
names: `_s` is seconds (an integer or a decimal number), `_bytes` a byte size (an integer, or a
string such as `"32GiB"` or `"500MB"`). Numbers in `command`, `args` and `env` are taken as
text, so `[--max-model-len, 8192]` needs no quotes. File and directory paths (`state_dir`,
`mirror.dir`, the token files) must be absolute: the daemon runs from `/` under systemd.

## Checking a file

```
rolloutd check-config [-c FILE]
```

exits 0 and prints a summary (`rolloutd: {DEFAULT_CONFIG_PATH} is valid: 2 servers (gpu0, gpu1),
registry http://trainer:8700`), or exits 2 and prints one line per problem, each naming the
line and the key:

```
{DEFAULT_CONFIG_PATH}:14: servers[1].public_port: Input should be less than or equal to 65535
{DEFAULT_CONFIG_PATH}:3: registry.url: Field required
```

It also checks that the token files exist and can be read (their content is never printed),
so a daemon that would fail to start fails the check first.

Rules across keys: server names are unique; servers' `public_port`s are unique and differ
from `admin.port`; no GPU is listed by two servers; `vllm.args` and a server's `args` do not
set the flags rolloutd passes itself (`--host`, `--port`, `--uds`, `--weight-transfer-config`,
`--enable-scale-out`, in either `--flag value` or `--flag=value` form) nor `--grpc-port` (it
would open a TCP port every local user can reach); `vllm.env` and a server's `env` do not set
`CUDA_VISIBLE_DEVICES` (use `gpus`) or `VLLM_SERVER_DEV_MODE`; `state_dir` is short enough
for every server's socket path (`<state_dir>/sockets/<name>.sock`, at most 107 bytes);
`registry.retry_max_s` ≥ `registry.retry_initial_s`; `restart.backoff_max_s` ≥
`restart.backoff_initial_s`.

## Reloading

`systemctl reload rolloutd` (SIGHUP), or the admin API's reload action, re-reads the file.
A file that does not validate is refused and the running configuration stays. A server
restarts only when its own entry in `servers` or the `vllm` section changed; servers added to
or removed from the list are started or stopped. `update`, `heartbeat`, `health`, `restart`,
`shutdown` and `pull.timeout_s` apply without restarting any server. `node`, `registry`,
`admin`, `mirror`, `state_dir` and the rest of `pull` take effect only when rolloutd itself
restarts (a reload that changes them says so).

This reference and `etc/rolloutd.yaml` are generated from the model in `rolloutd/config.py`
by `{REGENERATE}`."""


# -- values and types as text --------------------------------------------------------------------

def bytes_text(n: int) -> str:
    """``34359738368`` -> ``32GiB``: the largest binary unit that divides it."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def yaml_value(value: Any) -> str:
    """A value as it is written in the YAML file (lists and maps in flow style)."""
    if isinstance(value, ByteSize):
        return bytes_text(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    tp = _unwrap(field.annotation)
    if get_origin(tp) is list:
        tp = _unwrap(get_args(tp)[0])
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def type_text(tp: Any) -> str:
    """``list[int] | None`` -> ``list of integer, or null``."""
    tp = _unwrap(tp)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return ", or ".join(type_text(t) if t is not type(None) else "null" for t in get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(tp))
    if origin is list:
        return f"list of {type_text(get_args(tp)[0])}"
    if origin is dict:
        return f"map of {type_text(get_args(tp)[0])} to {type_text(get_args(tp)[1])}"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path", ByteSize: "byte size"}
    if tp in names:  # the exact class: ByteSize is an int too
        return names[tp]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return getattr(tp, "__name__", str(tp))


def constraints_text(field: FieldInfo) -> str:
    """``gt=0, le=300`` -> ``> 0, <= 300``; byte sizes in binary units."""
    show = bytes_text if _unwrap(field.annotation) is ByteSize else yaml_value
    out = []
    for c in field.metadata:
        for cls, sign, attr in ((at.Gt, ">", "gt"), (at.Ge, ">=", "ge"), (at.Lt, "<", "lt"), (at.Le, "<=", "le")):
            if isinstance(c, cls):
                out.append(f"{sign} {show(getattr(c, attr))}")
        if isinstance(c, at.MinLen):
            out.append("non-empty" if c.min_length == 1 else f"at least {c.min_length} long")
        if getattr(c, "pattern", None):
            out.append(f"matches `{c.pattern}`")
    for c in _item_metadata(field.annotation):
        if isinstance(c, at.Ge):
            out.append(f"each >= {c.ge}")
    return ", ".join(out)


def _item_metadata(tp: Any) -> list[Any]:
    """Constraints on the items of a list, e.g. ``list[Annotated[int, Field(ge=0)]]``."""
    tp = _unwrap(tp)
    if get_origin(tp) is not list or get_origin(get_args(tp)[0]) is not Annotated:
        return []
    out = []
    for m in get_args(get_args(tp)[0])[1:]:
        out += m.metadata if isinstance(m, FieldInfo) else [m]
    return out


def _default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


# -- the example YAML ------------------------------------------------------------------------------

def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                         break_on_hyphens=False)


def _section_lines(model: type[BaseModel], values: dict[str, Any], indent: str, first: str = "",
                   describe: bool = True) -> list[str]:
    """``key: value`` lines of one mapping, each under its description; ``first`` prefixes the first key."""
    lines = []
    for i, (name, field) in enumerate(model.model_fields.items()):
        value = values[name] if name in values else _default(field)
        prefix = first if i == 0 and first else indent
        if describe:
            lines += _comment(field.description, indent if i or not first else first.replace("- ", ""))
        lines.append(f"{prefix}{name}: {yaml_value(value)}")
    return lines


def example_yaml() -> str:
    """The commented example of a node with two GPUs; it passes ``load_config``."""
    lines = [("# " + line).rstrip() for line in EXAMPLE_HEADER.splitlines()]
    examples = {"registry": {"url": EXAMPLE_REGISTRY_URL}}
    for name, field in Config.model_fields.items():
        lines.append("")
        lines += _comment(field.description, "")
        if name == "servers":
            lines.append("servers:")
            for i, server in enumerate(EXAMPLE_SERVERS):
                lines += _section_lines(Server, server, "    ", "  - ", describe=i == 0)
        elif (model := _model_of(field)) is not None:
            lines.append(f"{name}:")
            lines += _section_lines(model, examples.get(name, {}), "  ")
        else:
            lines.append(f"{name}: {yaml_value(_default(field))}")
    return "\n".join(lines) + "\n"


# -- the reference ---------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        kind = type_text(field.annotation)
        if limits := constraints_text(field):
            kind += f" ({limits})"
        if _model_of(field) is not None:
            kind = kind.replace("section", f"[{'entries' if 'list' in kind else 'section'}](#{name})")
            default = "required" if field.is_required() else "see its section"
        else:
            default = "required" if field.is_required() else f"`{yaml_value(_default(field))}`"
        lines.append(f"| `{prefix}{name}` | {_cell(kind)} | {_cell(default)} | {_cell(field.description)} |")
    return lines


def reference_md() -> str:
    """``docs/config.md``: the intro, then one table per section."""
    lines = [REFERENCE_INTRO, "", "## Top level", ""] + _table(Config, "")
    for name, field in Config.model_fields.items():
        model = _model_of(field)
        if model is None:
            continue
        heading = name if model is not Server else "servers"
        lines += ["", f"## {heading}", "", field.description[0].upper() + field.description[1:] + "."]
        if model is Server:
            lines[-1] += " Each entry of the list has these keys."
        lines += [""] + _table(model, f"{name}[]." if model is Server else f"{name}.")
    return "\n".join(lines) + "\n"


# -- writing them ----------------------------------------------------------------------------------

def generated() -> dict[Path, str]:
    return {EXAMPLE_PATH: example_yaml(), REFERENCE_PATH: reference_md()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/configdoc.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the files are up to date")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: %(default)s)")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in generated().items():
        path = args.root / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(rel))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run `{REGENERATE}`", file=sys.stderr)
        return 1
    print(f"{'rewrote' if stale else 'up to date'}: {', '.join(stale) or ', '.join(map(str, generated()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
