"""The node config: the example file, defaults, helpers, every kind of bad file (each error names the
key path and the line), ``rolloutd check-config`` as a process, and random mutations of the
example that must only ever raise ``ConfigError`` in the ``FILE:LINE: path: message`` form."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rolloutd import config as config_mod
from rolloutd.config import Config, ConfigError, load_config, parse_config, read_token

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # the config doc generator is a dev tool, not installed
from configdoc import REGENERATE, example_yaml, reference_md  # noqa: E402

from tests.conftest import run_cli  # noqa: E402

EXAMPLE = ROOT / "etc" / "rolloutd.yaml"
REFERENCE = ROOT / "docs" / "config.md"
GiB, MiB = 1 << 30, 1 << 20

# Line numbers in the cases below count from here: line 1 is `registry:`.
BASE = """\
registry:
  url: http://trainer:8700
admin:
  port: 9100
servers:
  - name: gpu0
    model: /m
    public_port: 9001
    gpus: [0]
  - name: gpu1
    model: /m
    public_port: 9002
    gpus: [1]
"""


def edit(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new, 1)


def problems(text: str, source: str = "c.yaml") -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(text, source)
    assert str(e.value) == "\n".join(e.value.lines)
    return e.value.lines


# -- the example and the reference ----------------------------------------------------------------

def test_example_file_is_generated_from_the_model():
    assert EXAMPLE.read_text() == example_yaml(), f"etc/rolloutd.yaml is stale: run `{REGENERATE}`"


def test_reference_is_generated_from_the_model():
    assert REFERENCE.read_text() == reference_md(), f"docs/config.md is stale: run `{REGENERATE}`"


def test_example_loads_two_servers_on_two_gpus():
    cfg = load_config(EXAMPLE)
    assert [(s.name, s.public_port, s.cuda_visible_devices) for s in cfg.servers] == [("gpu0", 9001, "0"),
                                                                                      ("gpu1", 9002, "1")]
    assert cfg.registry.url == "http://trainer:8700"
    # Every key is written out with its default, so the example equals the defaults plus its servers.
    defaults = parse_config(BASE)
    assert cfg.model_dump(exclude={"registry", "servers", "admin"}) == defaults.model_dump(
        exclude={"registry", "servers", "admin"})


def test_every_key_is_in_the_example_and_the_reference():
    text, doc = EXAMPLE.read_text(), REFERENCE.read_text()
    for section, field in Config.model_fields.items():
        assert re.search(rf"^{section}:", text, re.M), section
        sub = getattr(field.annotation, "model_fields", None) or (
            config_mod.Server.model_fields if section == "servers" else {})
        for key, f in sub.items():
            assert re.search(rf"^ +(- )?{key}:", text, re.M), f"{section}.{key}"
            path = f"servers[].{key}" if section == "servers" else f"{section}.{key}"
            assert f"| `{path}` |" in doc and f.description in doc, path


# -- defaults and helpers -----------------------------------------------------------------------

def test_defaults():
    cfg = parse_config(BASE)
    assert cfg.node.name is None and cfg.node.advertise_host is None
    assert cfg.registry.token_file is None
    assert (cfg.registry.connect_timeout_s, cfg.registry.request_timeout_s, cfg.registry.long_poll_s) == (5, 15, 30)
    assert (cfg.registry.retry_initial_s, cfg.registry.retry_max_s) == (1, 30)
    assert (cfg.admin.host, cfg.admin.port, cfg.admin.token_file) == ("127.0.0.1", 9100, None)
    assert cfg.state_dir == Path("/var/lib/rolloutd")
    assert cfg.mirror.dir == Path("/dev/shm/rolloutd") and cfg.mirror.max_bytes == 32 * GiB
    assert (cfg.pull.streams, cfg.pull.request_bytes, cfg.pull.max_chunk_retries) == (None, 16 * MiB, 3)
    assert (cfg.pull.workers, cfg.pull.cpu_priority) == (None, "low")
    assert cfg.pull.worker_count() == min(os.cpu_count(), 16) and cfg.pull.stream_count() == 2 * cfg.pull.worker_count()
    assert (cfg.pull.lease_ttl_s, cfg.pull.read_timeout_s, cfg.pull.timeout_s) == (60, 30, 3600)
    u = cfg.update
    assert (u.pause_mode, u.min_version_lag, u.max_update_delay_s, u.strategy, u.max_unavailable) == (
        "keep", 1, 300, "all_at_once", 1)
    assert (u.pause_timeout_s, u.start_timeout_s, u.load_timeout_s, u.finish_timeout_s, u.resume_timeout_s,
            u.max_reapply) == (60, 30, 600, 60, 30, 1)
    assert (cfg.heartbeat.interval_s, cfg.heartbeat.timeout_s) == (5, 5)
    assert (cfg.health.interval_s, cfg.health.timeout_s, cfg.health.failures) == (5, 5, 3)
    r = cfg.restart
    assert (r.start_timeout_s, r.backoff_initial_s, r.backoff_max_s, r.backoff_factor, r.max_retries,
            r.stable_after_s) == (900, 1, 60, 2, 5, 300)
    s = cfg.shutdown
    assert (s.server_grace_s, s.kill_wait_s, s.deregister_timeout_s, s.admin_grace_s) == (20, 10, 5, 2)
    assert (cfg.vllm.command, cfg.vllm.args, cfg.vllm.env) == (["vllm", "serve"], [], {})
    assert (cfg.servers[0].args, cfg.servers[0].env) == ([], {})


def test_host_name_fallback(monkeypatch):
    monkeypatch.setattr(config_mod.socket, "gethostname", lambda: "node-7")
    cfg = parse_config(BASE)
    assert (cfg.node_name, cfg.advertise_host) == ("node-7", "node-7")
    cfg = parse_config(BASE + "node:\n  name: a\n  advertise_host: a.example\n")
    assert (cfg.node_name, cfg.advertise_host) == ("a", "a.example")


def test_cuda_visible_devices_and_server_lookup():
    cfg = parse_config(edit("gpus: [0]", "gpus: [2, 0]").replace("    gpus: [1]\n", ""))
    assert cfg.server("gpu0").cuda_visible_devices == "2,0"
    assert cfg.server("gpu1").gpus == [] and cfg.server("gpu1").cuda_visible_devices is None
    with pytest.raises(KeyError, match="gpu9"):
        cfg.server("gpu9")


def test_cpus_may_be_shared_between_servers():
    text = edit("gpus: [0]", "gpus: [0]\n    cpus: [0, 1]").replace("gpus: [1]", "gpus: [1]\n    cpus: [1]")
    cfg = parse_config(text)
    assert (cfg.server("gpu0").cpus, cfg.server("gpu1").cpus) == ([0, 1], [1])


# -- a server's parallel shape --------------------------------------------------------------------

@pytest.mark.parametrize("args, shape", [
    ([], (1, 1, 1)),
    (["--tensor-parallel-size", "2"], (2, 1, 1)),
    (["-tp", "4", "-pp=2", "--data_parallel_size=3"], (4, 2, 3)),
    (["--tensor-parallel-size", "2", "--max-model-len", "8", "-tp", "8"], (8, 1, 1)),  # the last one wins
])
def test_the_parallel_shape_is_read_from_vllm_args(args, shape):
    got = config_mod.parallel_shape(args)
    assert (got.tensor, got.pipeline, got.data) == shape
    assert got.workers == shape[0] * shape[1] * shape[2]


def test_the_shape_counts_vllm_args_and_the_servers_own():
    cfg = parse_config(edit("gpus: [0]", "gpus: [0, 2]\n    args: [-tp, 2]")
                       + "vllm:\n  args: [--data-parallel-size, 1]\n  env: {}\n")
    assert str(cfg.shape(cfg.server("gpu0"))) == "tensor=2 parallel, 2 workers"
    bad = parse_config(BASE).model_dump()
    bad["vllm"]["args"] = ["--tensor-parallel-size", "2"]
    with pytest.raises(ValidationError, match="lists 1 GPU\\(s\\) for a server of tensor=2 parallel, 2 workers"):
        Config(**bad)


def test_gpus_and_cpus_must_fit_the_parallel_shape():
    text = edit("gpus: [0]", "gpus: [0]\n    args: [--tensor-parallel-size, 2]").replace(
        "gpus: [1]", "gpus: [1, 2]\n    cpus: [0, 1]\n    args: [-dp, 2, -tp, 2]")
    assert problems(text) == [
        "c.yaml:9: servers[0].gpus: lists 1 GPU(s) for a server of tensor=2 parallel, 2 workers: list at least 2, "
        "one per worker",
        "c.yaml:14: servers[1].gpus: lists 2 GPU(s) for a server of tensor=2 x data=2 parallel, 4 workers: list at "
        "least 4, one per worker",
        "c.yaml:15: servers[1].cpus: lists 2 core(s) for a server of tensor=2 x data=2 parallel, 4 workers: list at "
        "least one per worker, whose threads are bound to their own cores"]
    assert problems(edit("gpus: [0]", "args: [-tp, two]")) == [
        "c.yaml:9: servers[0].args: -tp takes a positive integer, got 'two'"]
    assert problems(edit("gpus: [0]", "args: [--tensor-parallel-size=0]")) == [
        "c.yaml:9: servers[0].args: --tensor-parallel-size takes a positive integer, got '0'"]


def test_a_server_spanning_several_nodes_is_refused():
    text = edit("gpus: [0]", "args: [-dp, 4, --data-parallel-size-local=2, -dpa, 10.0.0.1]") + (
        "vllm:\n  args: [--headless]\n")
    assert [line.split(" is refused")[0] for line in problems(text)] == [
        "c.yaml:9: servers[0].args[2]: --data-parallel-size-local", "c.yaml:9: servers[0].args[3]: -dpa",
        "c.yaml:15: vllm.args[0]: --headless"]
    assert problems(edit("gpus: [0]", "args: [--nnodes, 2]"))[0].endswith(
        "a server whose engines span several nodes is not supported (rolloutd supervises, pauses and updates each "
        "server of its node whole)")


@pytest.mark.parametrize("cpus, workers, bind", [
    ([0], 1, "0"), ([1, 0], 2, "0|1"), ([0, 1, 2], 2, "0,1|2"), ([4, 5, 6, 7], 2, "4,5|6,7"),
    ([0, 1, 2, 3, 4], 4, "0,1|2|3|4")])
def test_each_worker_is_bound_to_its_own_cores(cpus, workers, bind):
    assert config_mod.omp_threads_bind(cpus, workers) == bind


def test_the_daemon_binds_the_workers_unless_env_does():
    text = edit("gpus: [0]", "cpus: [0, 1]\n    args: [-tp, 2]").replace("gpus: [1]", "cpus: [1]")
    cfg = parse_config(text)
    assert (cfg.omp_threads_bind(cfg.server("gpu0")), cfg.omp_threads_bind(cfg.server("gpu1"))) == ("0|1", "1")
    own = parse_config(text.replace("args: [-tp, 2]", "args: [-tp, 2]\n    env: {VLLM_CPU_OMP_THREADS_BIND: '1|0'}"))
    assert own.omp_threads_bind(own.server("gpu0")) is None
    assert parse_config(BASE).omp_threads_bind(parse_config(BASE).server("gpu0")) is None  # no cpus: vLLM's own


def test_a_bind_of_another_shape_is_refused():
    text = edit("gpus: [0]", "args: [-tp, 2]\n    env: {VLLM_CPU_OMP_THREADS_BIND: 0-1}").replace("gpus: [1]", "")
    assert problems(text) == [
        "c.yaml:10: servers[0].env.VLLM_CPU_OMP_THREADS_BIND: gives 1 core list(s) ('|' between them) for "
        "servers[0] (gpu0), a server of tensor=2 parallel, 2 workers: give one per worker, or leave it out and "
        "list the cores in cpus (rolloutd then splits them between the workers)"]
    assert len(problems(BASE.replace("    gpus: [0]\n", "    args: [-tp, 2]\n").replace("    gpus: [1]\n", "")
                        + "vllm:\n  env: {VLLM_CPU_OMP_THREADS_BIND: '0|1|2'}\n")) == 2  # for each server
    for word in ("auto", "nobind", "0|1"):
        parse_config(text.replace("0-1}", f"'{word}'}}"))


def test_command_string_is_split_like_a_shell():
    cfg = parse_config(BASE + "vllm:\n  command: \"/opt/venv/bin/python -m vllm.entrypoints.cli.main 'serve'\"\n")
    assert cfg.vllm.command == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve"]
    assert parse_config(BASE + "vllm:\n  command: [vllm, serve]\n").vllm.command == ["vllm", "serve"]


def test_numbers_in_args_and_env_are_text_and_ints_are_floats():
    cfg = parse_config(BASE + "vllm:\n  args: [--max-model-len, 8192, --gpu-memory-utilization, 0.9]\n"
                              "  env: {OMP_NUM_THREADS: 4}\nheartbeat:\n  interval_s: 2\n"
                              "mirror:\n  max_bytes: 500MB\npull:\n  request_bytes: 1048576\n")
    assert cfg.vllm.args == ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]
    assert cfg.vllm.env == {"OMP_NUM_THREADS": "4"}
    assert cfg.heartbeat.interval_s == 2.0 and isinstance(cfg.heartbeat.interval_s, float)
    assert (cfg.mirror.max_bytes, cfg.pull.request_bytes) == (500_000_000, MiB)


def test_registry_url_loses_its_trailing_slash():
    assert parse_config(edit("http://trainer:8700", "https://trainer:8700/reg/")).registry.url == \
        "https://trainer:8700/reg"


def test_empty_section_takes_its_defaults():
    cfg = parse_config(BASE + "heartbeat:\n  # interval_s: 1\nhealth:\n")
    assert (cfg.heartbeat.interval_s, cfg.health.failures) == (5, 3)


def test_config_is_frozen_and_checked_when_built_in_code():
    cfg = parse_config(BASE)
    with pytest.raises(ValidationError):
        cfg.admin.port = 1
    data = yaml.safe_load(edit("public_port: 9002", "public_port: 9001"))
    with pytest.raises(ValidationError, match=r"servers\[1\]\.public_port: 9001 is also the public_port of "
                                              r"servers\[0\]"):
        Config.model_validate(data)


def test_read_token(tmp_path):
    assert read_token(None) is None
    f = tmp_path / "token"
    f.write_text("  s3cret\n")
    assert read_token(f) == "s3cret"
    f.write_text(" \n")
    with pytest.raises(ConfigError, match=rf"token file {f}: is empty"):
        read_token(f)
    with pytest.raises(ConfigError, match=rf"token file {tmp_path / 'nope'}: not found"):
        read_token(tmp_path / "nope")
    with pytest.raises(ConfigError, match=rf"token file {tmp_path}: is a directory"):
        read_token(tmp_path)
    f.write_bytes(b"s3cret\xff")
    with pytest.raises(ConfigError) as e:
        read_token(f)
    assert "s3cret" not in str(e.value) and str(f) in str(e.value)


def test_check_files_names_the_key_and_line(tmp_path):
    token = tmp_path / "token"
    text = edit("  port: 9100\n", f"  port: 9100\n  token_file: {token}\n")
    assert parse_config(text).admin.token_file == token  # only a check_files load reads it
    with pytest.raises(ConfigError) as e:
        parse_config(text, "c.yaml", check_files=True)
    assert e.value.lines == [f"c.yaml:5: admin.token_file: token file {token}: not found"]
    token.write_text("hunter2\n")
    assert parse_config(text, check_files=True).admin.token_file == token


# -- bad configs: the key path and the line --------------------------------------------------------

BAD = {
    "unknown top-level key": (BASE + "bogus: 1\n", 14, "bogus", "unknown key"),
    "unknown nested key": (edit("  port: 9100", "  prot: 9100"), 4, "admin.prot", "did you mean 'port'?"),
    "unknown server key": (edit("    gpus: [1]", "    gpu: [1]"), 13, "servers[1].gpu", "did you mean 'gpus'?"),
    "string for a port": (edit("public_port: 9002", 'public_port: "9002"'), 12, "servers[1].public_port",
                          "valid integer"),
    "bool for an int": (BASE + "pull:\n  streams: true\n", 15, "pull.streams", "valid integer"),
    "bool for a float": (BASE + "health:\n  timeout_s: yes\n", 15, "health.timeout_s", "valid number"),
    "port out of range": (edit("public_port: 9002", "public_port: 70000"), 12, "servers[1].public_port",
                          "less than or equal to 65535"),
    "zero timeout": (BASE + "shutdown:\n  kill_wait_s: 0\n", 15, "shutdown.kill_wait_s", "greater than 0"),
    "long poll too long": (edit("  url: http://trainer:8700", "  url: http://t\n  long_poll_s: 301"), 3,
                           "registry.long_poll_s", "less than or equal to 300"),
    "infinite timeout": (BASE + "pull:\n  timeout_s: .inf\n", 15, "pull.timeout_s", "finite number"),
    "unknown pause mode": (BASE + "update:\n  pause_mode: drop\n", 15, "update.pause_mode", "'abort', 'wait'"),
    "missing registry.url": (edit("  url: http://trainer:8700", "  connect_timeout_s: 1"), 1, "registry.url",
                             "Field required"),
    "missing registry": (BASE.replace("registry:\n  url: http://trainer:8700\n", ""), 1, "registry",
                         "Field required"),
    "missing server port": (edit("    public_port: 9001\n", ""), 6, "servers[0].public_port", "Field required"),
    "vLLM's port, a key of the past": (edit("    public_port: 9001", "    port: 8001"), 8, "servers[0].port",
                                       "no longer taken: vLLM listens on a UNIX socket"),
    "state_dir too long for a socket": (BASE + "state_dir: /" + "s" * 90 + "\n", 14, "state_dir",
                                        "longer than a UNIX socket's may be (107 bytes)"),
    "URL with another scheme": (edit("http://trainer:8700", "ftp://trainer"), 2, "registry.url",
                                "http:// or https:// URL"),
    "URL without a host": (edit("http://trainer:8700", "http://:8700"), 2, "registry.url", "with a host"),
    "URL with a bad port": (edit("http://trainer:8700", "http://trainer:99999"), 2, "registry.url", "Port"),
    "bad server name": (edit("name: gpu1", "name: GPU-1"), 10, "servers[1].name", "should match pattern"),
    "duplicate server name": (edit("name: gpu1", "name: gpu0"), 10, "servers[1].name",
                              "'gpu0' is also the name of servers[0]"),
    "duplicate port": (edit("public_port: 9002", "public_port: 9001"), 12, "servers[1].public_port",
                       "also the public_port of servers[0]"),
    "port is the admin port": (edit("public_port: 9001", "public_port: 9100"), 8, "servers[0].public_port",
                               "admin.port"),
    "GPU in two servers": (edit("gpus: [1]", "gpus: [1, 0]"), 13, "servers[1].gpus[1]",
                           "GPU 0 is also used by servers[0]"),
    "GPU twice in one server": (edit("gpus: [0]", "gpus: [0, 0]"), 9, "servers[0].gpus[1]", "listed twice"),
    "negative GPU": (edit("gpus: [0]", "gpus: [-1]"), 9, "servers[0].gpus[0]", "greater than or equal to 0"),
    "CPU twice in one server": (edit("gpus: [0]", "gpus: [0]\n    cpus: [3, 3]"), 10, "servers[0].cpus[1]",
                                "CPU 3 is listed twice"),
    "CPUs as a string": (edit("gpus: [0]", "gpus: [0]\n    cpus: 0-3"), 10, "servers[0].cpus", "list"),
    "owned flag": (BASE + "vllm:\n  args:\n    - --max-model-len\n    - 4096\n    - --port\n    - 1\n", 18,
                   "vllm.args[2]", "--port is set by rolloutd"),
    "owned flag=value": (edit("    gpus: [0]", "    gpus: [0]\n    args: [--enforce-eager, --host=0.0.0.0]"), 10,
                         "servers[0].args[1]", "--host is set by rolloutd"),
    "a socket of one's own": (BASE + "vllm:\n  args: [--uds, /tmp/v.sock]\n", 15, "vllm.args[0]",
                              "--uds is set by rolloutd"),
    "a gRPC port": (BASE + "vllm:\n  args: ['--grpc-port=50051']\n", 15, "vllm.args[0]",
                    "--grpc-port is refused: it opens a TCP port on loopback"),
    "owned flag with underscores": (BASE + "vllm:\n  args: ['--weight_transfer_config={}']\n", 15, "vllm.args[0]",
                                    "--weight_transfer_config is set by rolloutd"),
    "scale-out flag": (BASE + "vllm:\n  args: [--enable-scale-out]\n", 15, "vllm.args[0]", "is set by rolloutd"),
    "CUDA_VISIBLE_DEVICES in env": (edit("    gpus: [1]", "    gpus: [1]\n    env:\n      CUDA_VISIBLE_DEVICES: '1'"),
                                    15, "servers[1].env.CUDA_VISIBLE_DEVICES", "use the server's `gpus`"),
    "dev mode in env": (BASE + "vllm:\n  env: {VLLM_SERVER_DEV_MODE: '0'}\n", 15, "vllm.env.VLLM_SERVER_DEV_MODE",
                        "set by rolloutd"),
    "bad env name": (BASE + "vllm:\n  env:\n    A: x\n    'B C': y\n", 17, 'vllm.env["B C"]',
                     "not a valid environment variable name"),
    "bool env value": (BASE + "vllm:\n  env:\n    A: true\n", 16, "vllm.env.A", "valid string"),
    "empty command": (BASE + "vllm:\n  command: ''\n", 15, "vllm.command", "at least 1 item"),
    "backoff max below initial": (BASE + "restart:\n  backoff_initial_s: 10\n  backoff_max_s: 5\n", 16,
                                  "restart.backoff_max_s", "at least backoff_initial_s (10.0)"),
    "retry max below initial": (edit("  url: http://trainer:8700", "  url: http://t\n  retry_max_s: 0.5"), 3,
                                "registry.retry_max_s", "at least retry_initial_s (1.0)"),
    "bad byte size": (BASE + "mirror:\n  max_bytes: 32 gigs\n", 15, "mirror.max_bytes", "byte unit"),
    "negative byte size": (BASE + "mirror:\n  max_bytes: -5GiB\n", 15, "mirror.max_bytes",
                           "a size must be positive, got '-5GiB'"),
    "negative byte size in bytes": (BASE + "gateway:\n  max_body_bytes: '-1'\n", 15, "gateway.max_body_bytes",
                                    "a size must be positive, got '-1'"),
    "byte size below its minimum": (BASE + "pull:\n  request_bytes: 1KiB\n", 15, "pull.request_bytes",
                                    "greater than or equal to 65536"),
    "empty servers list": (BASE[:BASE.index("servers:")] + "servers: []\n", 5, "servers", "at least 1 item"),
    "public admin without a token": (edit("  port: 9100", "  port: 9100\n  host: 0.0.0.0"), 3, "admin.token_file",
                                     "required when admin.host (0.0.0.0) is not loopback"),
    "section not a mapping": (BASE + "update: 5\n", 14, "update", "Input should be a mapping of keys"),
    "section a list": (BASE + "node: [a]\n", 14, "node", "Input should be a mapping of keys"),
    "server not a mapping": (edit("  - name: gpu1\n    model: /m\n    public_port: 9002\n    gpus: [1]\n",
                                  "  - gpu1\n"), 10,
                             "servers[1]", "Input should be a mapping of keys"),
    "path not text": (BASE + "state_dir: 5\n", 14, "state_dir", "Input should be a path (text)"),
    "relative path": (BASE + "mirror:\n  dir: shm/rolloutd\n", 15, "mirror.dir",
                      "must be an absolute path, got 'shm/rolloutd'"),
    "unbalanced quote in command": (BASE + "vllm:\n  command: \"vllm 'serve\"\n", 15, "vllm.command",
                                    ": No closing quotation"),
    "duplicate YAML key": (edit("  url: http://trainer:8700", "  url: http://a\n  url: http://b"), 3,
                           "registry.url", "duplicate key (first on line 2)"),
    "duplicate YAML key in a server": (edit("    public_port: 9002", "    public_port: 9002\n    public_port: 9003"),
                                       13, "servers[1].public_port", "duplicate key (first on line 12)"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_config_names_key_path_and_line(case):
    text, line, path, fragment = BAD[case]
    lines = problems(text)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"c.yaml:{line}: {path}: "), lines[0]
    assert fragment in lines[0]


def test_several_problems_one_line_each_in_file_order():
    text = edit("public_port: 9002", "public_port: 0").replace("  port: 9100", "  port: nine")
    assert [p.split(": ")[0:2] for p in problems(text)] == [["c.yaml:4", "admin.port"],
                                                             ["c.yaml:12", "servers[1].public_port"]]


@pytest.mark.parametrize("text, expected", [
    ("", "c.yaml: is empty"),
    ("# nothing yet\n\n", "c.yaml: is empty"),
    ("- registry\n- servers\n", "c.yaml:1: the top level must be a mapping of sections (registry, servers, ...), "
                                "not a list"),
    ("just words\n", "c.yaml:1: the top level must be a mapping of sections (registry, servers, ...), not a string"),
    ("42\n", "c.yaml:1: the top level must be a mapping of sections (registry, servers, ...), not a number"),
    ("registry:\n  url: [http://x\nservers: []\n", "c.yaml:3:8: YAML syntax error: "),
    ("registry:\n\turl: x\n", "c.yaml:2:1: YAML syntax error: found character '\\t'"),
    ("a: 1\n---\nb: 2\n", "c.yaml:2:1: YAML syntax error: but found another document"),
    ("a: !!python/object:os.system x\n", "c.yaml:1:4: YAML syntax error: could not determine a constructor"),
])
def test_unreadable_yaml_is_one_clear_line(text, expected):
    lines = problems(text)
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_file_problems(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'none.yaml'}: no such file$"):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: is a directory, not a config file$"):
        load_config(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"registry: \xff\n")
    with pytest.raises(ConfigError, match=r"bin.yaml: not UTF-8 text \(byte 10\)$"):
        load_config(tmp_path / "bin.yaml")
    (tmp_path / "c.yaml").write_text(edit("public_port: 9002", "public_port: 70000"))
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'c.yaml'}:12: servers\[1\]\.public_port: "):
        load_config(str(tmp_path / "c.yaml"))


# -- rolloutd check-config ---------------------------------------------------------------------------

def check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutd.cli", "check-config", "-c", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("where", [pytest.param("process", marks=[pytest.mark.slow, pytest.mark.parallel]),
                                   "in-process"])
def test_check_config_valid(tmp_path, capsys, where):
    token = tmp_path / "registry.token"
    token.write_text("top-secret-token\n")
    path = tmp_path / "rolloutd.yaml"
    path.write_text(EXAMPLE.read_text().replace("  token_file: null", f"  token_file: {token}", 1))
    r = check_config(path) if where == "process" else run_cli(capsys, "check-config", "-c", str(path))
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout == f"rolloutd: {path} is valid: 2 servers (gpu0, gpu1), registry http://trainer:8700\n"
    assert "top-secret-token" not in r.stdout + r.stderr


@pytest.mark.parametrize("text, message", [
    (edit("public_port: 9002", "public_port: 70000"),
     "{path}:12: servers[1].public_port: Input should be less than or equal to 65535\n"),
    ("registry: [\n", "{path}:2:1: YAML syntax error: "),
    (edit("  port: 9100\n", "  port: 9100\n  token_file: /nonexistent/admin.token\n"),
     "{path}:5: admin.token_file: token file /nonexistent/admin.token: not found\n"),
    (edit("  port: 9100\n", "  port: 9100\n  host: 0.0.0.0\n"),
     "{path}:3: admin.token_file: required when admin.host (0.0.0.0) is not loopback: set a token file, or "
     "admin.allow_unauthenticated: true"),
    (None, "{path}: no such file\n"),
])
def test_check_config_invalid(tmp_path, capsys, text, message):
    path = tmp_path / "rolloutd.yaml"
    if text is not None:
        path.write_text(text)
    r = run_cli(capsys, "check-config", "-c", str(path))  # in this process; a process in the case above
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(message.format(path=path)), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("extra, actions", [
    ("  host: 0.0.0.0\n  allow_unauthenticated: true\n", "open to anyone"),
    ("  host: 0.0.0.0\n  token_file: {token}\n", "token_file"),
    ("", "generated token"),
])
def test_admin_off_loopback_needs_a_token_or_says_it_is_open(tmp_path, capsys, extra, actions):
    """``admin.host`` other than loopback passes check-config only with a token file or an
    explicit ``allow_unauthenticated``; on loopback, no token file is needed (the daemon makes one)."""
    token = tmp_path / "admin.token"
    token.write_text("admin-secret\n")
    path = tmp_path / "rolloutd.yaml"
    path.write_text(edit("  port: 9100\n", "  port: 9100\n" + extra.format(token=token)))
    r = run_cli(capsys, "check-config", "-c", str(path))
    assert (r.returncode, r.stderr) == (0, ""), (actions, r.stderr)


# -- random mutations of the example -------------------------------------------------------------------

SOURCE = "m.yaml"
QUOTED = r'\["(?:[^"\\]|\\.)*"\]'  # a key that is not a plain word: ["a b"]
PATH = rf"(?:[A-Za-z0-9_-]+|{QUOTED})(?:\.[A-Za-z0-9_-]+|\[\d+\]|{QUOTED})*"
PROBLEM = re.compile(rf"{re.escape(SOURCE)}:(\d+): ({PATH}): \S.*")
EXAMPLE_TREE = yaml.safe_load(EXAMPLE.read_text()) if EXAMPLE.exists() else {}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 40), 1 << 40), st.floats(), st.text(max_size=12))
keys = st.one_of(st.text(min_size=1, max_size=10),
                 st.sampled_from(["port", "public_port", "name", "url", "gpus", "servers"]), st.integers(0, 5))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(keys, scalars, max_size=3))


def containers(tree, path=()):
    """Every mapping and list in the tree, with its path."""
    if isinstance(tree, dict | list):
        yield path, tree
        for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            yield from containers(v, path + (k,))


def mutate(tree, data) -> None:
    path, node = data.draw(st.sampled_from(list(containers(tree))))
    slots = list(node) if isinstance(node, dict) else list(range(len(node)))
    op = data.draw(st.sampled_from(["delete", "replace", "add"] if slots else ["add"]))
    if op == "add":
        if isinstance(node, dict):
            node[data.draw(keys)] = data.draw(values)
        else:
            node.append(data.draw(values))
        return
    slot = data.draw(st.sampled_from(slots))
    if op == "delete":
        del node[slot]
    else:
        node[slot] = data.draw(values)


def test_mutations_only_raise_config_error_with_a_line_and_a_path(cases):
    @settings(max_examples=cases(200), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.data())
    def case(data):
        tree = copy.deepcopy(EXAMPLE_TREE)
        for _ in range(data.draw(st.integers(1, 3))):
            mutate(tree, data)
        text = yaml.safe_dump(tree, sort_keys=False)
        try:
            parse_config(text, SOURCE)
        except ConfigError as e:
            assert e.lines
            n_lines = text.count("\n") + 1
            for line in e.lines:
                m = PROBLEM.fullmatch(line)
                assert m, line
                assert 1 <= int(m[1]) <= n_lines, line

    case()


def test_the_peer_listener_needs_a_port_of_its_own():
    text = ("registry: {url: 'http://trainer:8700'}\nadmin: {port: 9300}\npeers: {enabled: true}\n"
            "servers: [{name: gpu0, model: /m, public_port: 9001}]\n")
    with pytest.raises(ConfigError, match=r"peers\.port: 9300 is also the admin API's port"):
        parse_config(text)
    assert parse_config(text.replace("enabled: true", "enabled: false")).peers.port == 9300  # off: unused


def test_a_value_with_a_newline_is_reported_on_one_line():
    """Found by the mutation test: one problem is one line, whatever the value held."""
    text = ("registry: {url: 'http://trainer:8700'}\nstate_dir: \"\\n\"\n"
            "servers: [{name: gpu0, model: /m, public_port: 9001}]\n")
    with pytest.raises(ConfigError) as info:
        parse_config(text, "m.yaml")
    assert info.value.lines == ["m.yaml:2: state_dir: must be an absolute path, got '\\n'"]
