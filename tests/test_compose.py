"""Static checks of the Docker deployment files (compose.yaml, Dockerfile, mosquitto/docker.conf).

No Docker engine or service is needed: the files are parsed, and every local path they
reference must exist in the repository, so a renamed file breaks this test rather than
the first `docker compose up` on a deployment host.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Config, load_config
from gateway.ingest.topics import TopicMatcher

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
MOSQUITTO_CONF = ROOT / "mosquitto" / "docker.conf"

SERVICES = {"cassandra", "mosquitto", "schema-init", "gateway"}

# Directives of mosquitto.conf(5) for Mosquitto 2.0: general, listener, TLS and bridge
# settings. A typo or a directive from another version makes the broker refuse to start.
MOSQUITTO_DIRECTIVES = frozenset(
    {
        # General / persistence / limits
        "acl_file",
        "allow_anonymous",
        "allow_duplicate_messages",
        "allow_zero_length_clientid",
        "auth_plugin",
        "auto_id_prefix",
        "autosave_interval",
        "autosave_on_changes",
        "check_retain_source",
        "clientid_prefixes",
        "include_dir",
        "max_inflight_bytes",
        "max_inflight_messages",
        "max_keepalive",
        "max_packet_size",
        "max_queued_bytes",
        "max_queued_messages",
        "memory_limit",
        "message_size_limit",
        "password_file",
        "per_listener_settings",
        "persistence",
        "persistence_file",
        "persistence_location",
        "persistent_client_expiration",
        "pid_file",
        "plugin",
        "psk_file",
        "queue_qos0_messages",
        "retain_available",
        "set_tcp_nodelay",
        "sys_interval",
        "upgrade_outgoing_qos",
        "user",
        # Logging
        "connection_messages",
        "log_dest",
        "log_facility",
        "log_timestamp",
        "log_timestamp_format",
        "log_type",
        "websockets_log_level",
        # Listeners
        "bind_address",
        "bind_interface",
        "http_dir",
        "listener",
        "max_connections",
        "max_qos",
        "max_topic_alias",
        "mount_point",
        "port",
        "protocol",
        "socket_domain",
        "use_username_as_clientid",
        "websockets_headers_size",
        # TLS / PSK
        "cafile",
        "capath",
        "certfile",
        "ciphers",
        "ciphers_tls1.3",
        "crlfile",
        "dhparamfile",
        "keyfile",
        "psk_hint",
        "require_certificate",
        "tls_engine",
        "tls_engine_kpass_sha1",
        "tls_keyform",
        "tls_version",
        "use_identity_as_username",
        "use_subject_as_username",
        # Bridges (most bridge options share the bridge_ prefix, see below)
        "address",
        "addresses",
        "cleansession",
        "connection",
        "idle_timeout",
        "keepalive_interval",
        "local_cleansession",
        "local_clientid",
        "local_password",
        "local_username",
        "notification_topic",
        "notifications",
        "notifications_local_only",
        "remote_clientid",
        "remote_password",
        "remote_username",
        "restart_timeout",
        "round_robin",
        "start_type",
        "threshold",
        "topic",
        "try_private",
    }
)
MOSQUITTO_DIRECTIVE_PREFIXES = ("bridge_", "plugin_opt_", "auth_opt_")

LOG_DESTS = {"stdout", "stderr", "syslog", "topic", "file", "dlt", "none"}
LOG_TYPES = {
    "debug",
    "error",
    "warning",
    "notice",
    "information",
    "subscribe",
    "unsubscribe",
    "websockets",
    "none",
    "all",
}


def _load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict), "compose.yaml must be a mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    found = compose.get("services")
    assert isinstance(found, dict), "compose.yaml has no services mapping"
    return found


def _is_local_path(source: str) -> bool:
    return source.startswith(("./", "../", "/")) or source in {".", ".."}


def _bind_sources(service: dict[str, Any]) -> list[str]:
    """Host-side sources of the service's volumes that are paths (not named volumes)."""
    sources: list[str] = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source = volume.split(":", 1)[0]
        else:
            source = str(volume.get("source", ""))
            if volume.get("type") == "bind":
                sources.append(source)
                continue
        if _is_local_path(source):
            sources.append(source)
    return sources


def _named_volumes(service: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source = volume.split(":", 1)[0] if ":" in volume else ""
        elif volume.get("type", "volume") == "volume":
            source = str(volume.get("source", ""))
        else:
            continue
        if source and not _is_local_path(source):
            names.append(source)
    return names


def _build_paths(service: dict[str, Any]) -> tuple[Path, Path] | None:
    """(context directory, Dockerfile) of a service with a `build`, else None."""
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        context, dockerfile = build, "Dockerfile"
    else:
        context = str(build.get("context", "."))
        dockerfile = str(build.get("dockerfile", "Dockerfile"))
    context_dir = (ROOT / context).resolve()
    return context_dir, context_dir / dockerfile


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    return instructions


def _copy_sources(args: str) -> list[str] | None:
    """Build-context sources of a COPY, or None when it copies from another stage/image."""
    if args.startswith("["):
        parts: list[str] = json.loads(args)
    else:
        parts = shlex.split(args)
    flags = [p for p in parts if p.startswith("--")]
    if any(flag.startswith("--from=") for flag in flags):
        return None
    paths = [p for p in parts if not p.startswith("--")]
    assert len(paths) >= 2, f"COPY needs a source and a destination: {args!r}"
    return paths[:-1]


def _dockerignore_entries(context_dir: Path) -> set[str]:
    path = context_dir / ".dockerignore"
    if not path.exists():
        return set()
    entries = set()
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", "!")):
            entries.add(line.strip("/"))
    return entries


def _mosquitto_lines() -> list[tuple[int, str, list[str]]]:
    """(line number, directive, values) of every non-comment line of docker.conf."""
    lines: list[tuple[int, str, list[str]]] = []
    for number, raw in enumerate(MOSQUITTO_CONF.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        directive, *values = line.split()
        lines.append((number, directive, values))
    return lines


def test_expected_services(services: dict[str, Any]) -> None:
    assert set(services) >= SERVICES, f"missing services: {sorted(SERVICES - set(services))}"


def test_images(services: dict[str, Any]) -> None:
    assert services["cassandra"]["image"] == "cassandra:5.0"
    assert services["mosquitto"]["image"] == "eclipse-mosquitto:2"


def test_bind_mount_sources_exist(services: dict[str, Any]) -> None:
    referenced = [
        (name, source) for name, service in services.items() for source in _bind_sources(service)
    ]
    assert ("mosquitto", "./mosquitto/docker.conf") in referenced
    assert ("gateway", "./gateway.example.toml") in referenced
    missing = [f"{name}: {source}" for name, source in referenced if not (ROOT / source).exists()]
    assert not missing, f"bind-mount sources not in the repository: {missing}"


def test_named_volumes_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = {volume for service in services.values() for volume in _named_volumes(service)}
    assert used, "expected named volumes for the Cassandra and Mosquitto data"
    assert used <= declared, f"named volumes not declared at top level: {sorted(used - declared)}"


def test_build_contexts_and_dockerfiles_exist(services: dict[str, Any]) -> None:
    built = {name: _build_paths(service) for name, service in services.items()}
    assert built["gateway"] is not None
    assert built["schema-init"] is not None
    for name, paths in built.items():
        if paths is None:
            continue
        context_dir, dockerfile = paths
        assert context_dir.is_dir(), f"{name}: build context {context_dir} does not exist"
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"


def test_dockerfile_copy_sources_exist(services: dict[str, Any]) -> None:
    dockerfiles = {paths for s in services.values() if (paths := _build_paths(s)) is not None}
    assert dockerfiles
    problems: list[str] = []
    for context_dir, dockerfile in dockerfiles:
        ignored = _dockerignore_entries(context_dir)
        instructions = _dockerfile_instructions(dockerfile)
        copies = [args for keyword, args in instructions if keyword == "COPY"]
        assert copies, f"{dockerfile} has no COPY"
        for args in copies:
            for source in _copy_sources(args) or []:
                if not (context_dir / source).exists():
                    problems.append(f"{dockerfile.name}: COPY source {source!r} does not exist")
                if source.strip("/").split("/", 1)[0] in ignored:
                    problems.append(f"{dockerfile.name}: COPY source {source!r} is .dockerignored")
    assert not problems, problems


def test_dockerfile_runs_unprivileged() -> None:
    instructions = _dockerfile_instructions(ROOT / "Dockerfile")
    assert instructions[0] == ("FROM", "python:3.11-slim")
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users, "the image must not run as root"
    assert users[-1] == "gateway"
    assert not any(keyword == "ENTRYPOINT" for keyword, _ in instructions)
    cmd = [args for keyword, args in instructions if keyword == "CMD"]
    assert cmd
    assert json.loads(cmd[-1]) == ["gateway", "run"]


def test_startup_order(services: dict[str, Any]) -> None:
    schema_init = services["schema-init"]
    assert schema_init["depends_on"]["cassandra"]["condition"] == "service_healthy"
    # A bare `no` would load as False, which Compose rejects.
    assert schema_init["restart"] == "no"
    gateway = services["gateway"]
    depends = gateway["depends_on"]
    assert depends["mosquitto"]["condition"] == "service_started"
    assert depends["schema-init"]["condition"] == "service_completed_successfully"
    assert gateway["environment"]["GATEWAY_MQTT__HOST"] == "mosquitto"
    assert gateway["environment"]["GATEWAY_CASSANDRA__CONTACT_POINTS"] == "cassandra"
    assert schema_init["environment"]["GATEWAY_CASSANDRA__CONTACT_POINTS"] == "cassandra"
    healthcheck = services["cassandra"]["healthcheck"]
    assert "cqlsh" in healthcheck["test"]


def test_ports_published_on_loopback_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name}: port {port!r} is not bound to loopback"


def test_mosquitto_directives_known() -> None:
    unknown = [
        f"line {number}: {directive}"
        for number, directive, _ in _mosquitto_lines()
        if directive not in MOSQUITTO_DIRECTIVES
        and not directive.startswith(MOSQUITTO_DIRECTIVE_PREFIXES)
    ]
    assert not unknown, f"not Mosquitto 2.0 directives: {unknown}"


def test_mosquitto_docker_conf_values() -> None:
    text = MOSQUITTO_CONF.read_text(encoding="utf-8")
    assert not re.search(r"@[A-Z_]+@", text), "template placeholders left in docker.conf"
    lines = _mosquitto_lines()
    directives = {directive: values for _, directive, values in lines}
    assert "user" not in directives, "the image already drops privileges to `mosquitto`"
    assert directives["listener"] == ["1883", "0.0.0.0"]
    assert directives["persistence"] == ["true"]
    assert directives["persistence_location"] == ["/mosquitto/data/"]
    assert directives["allow_anonymous"] == ["true"]
    dests = [values for _, directive, values in lines if directive == "log_dest"]
    assert dests == [["stdout"]]
    for _, directive, values in lines:
        if directive == "log_type":
            assert values[0] in LOG_TYPES, f"unknown log_type {values[0]!r}"
        if directive == "log_dest":
            assert values[0] in LOG_DESTS


# --- profile "cluster": three Cassandra nodes, two gateways with disjoint shards ---

CLUSTER_NODES = ["cassandra-1", "cassandra-2", "cassandra-3"]
CLUSTER_GATEWAYS = ["gateway-a", "gateway-b"]


def _megabytes(size: str) -> float:
    """A JVM size as Cassandra's env script takes it (768M, 1G)."""
    number, unit = size[:-1], size[-1].upper()
    return float(number) * {"M": 1, "G": 1024}[unit]


def _config_of(service: dict[str, Any]) -> Config:
    """The gateway configuration a service's GATEWAY_* environment gives (validated)."""
    env = {k: str(v) for k, v in service["environment"].items() if k.startswith("GATEWAY_")}
    return load_config(None, env)


def _filters_overlap(one: str, two: str) -> bool:
    """Whether some topic matches both MQTT filters."""
    a, b = one.split("/"), two.split("/")
    for x, y in zip(a, b, strict=False):
        if "#" in (x, y):
            return True
        if x != y and "+" not in (x, y):
            return False
    # Every common level is compatible; the longer filter's rest must match
    # nothing more ("t/a/#" matches "t/a" too).
    rest = (a if len(a) > len(b) else b)[min(len(a), len(b)) :]
    return rest in ([], ["#"])


def test_filters_overlap_helper() -> None:
    assert _filters_overlap("t/acme/d/+/e", "t/+/d/+/e")
    assert not _filters_overlap("t/acme/d/+/e", "t/globex/d/+/e")
    assert _filters_overlap("t/#", "t/acme/d/+/e")
    assert _filters_overlap("t/acme", "t/acme/#")
    assert not _filters_overlap("t/acme", "t/acme/x")


def test_the_default_stack_has_no_profile(services: dict[str, Any]) -> None:
    # `docker compose up` starts exactly the one-node stack, as before.
    for name in SERVICES:
        assert "profiles" not in services[name], f"{name} must stay in the default stack"


def test_cluster_profile_services(services: dict[str, Any]) -> None:
    cluster = {n for n, s in services.items() if "cluster" in s.get("profiles", [])}
    assert cluster == {*CLUSTER_NODES, "schema-init-cluster", *CLUSTER_GATEWAYS}


def test_cluster_nodes(services: dict[str, Any]) -> None:
    nodes = [services[n] for n in CLUSTER_NODES]
    names = {n["environment"]["CASSANDRA_CLUSTER_NAME"] for n in nodes}
    assert len(names) == 1, "all nodes in one cluster"
    assert names != {services["cassandra"]["environment"]["CASSANDRA_CLUSTER_NAME"]}
    for name, node in zip(CLUSTER_NODES, nodes, strict=True):
        env = node["environment"]
        assert node["image"] == "cassandra:5.0"
        # Both or neither (Cassandra's env script refuses one alone), at most 768 MB.
        assert _megabytes(env["MAX_HEAP_SIZE"]) <= 768, name
        assert _megabytes(env["HEAP_NEWSIZE"]) < _megabytes(env["MAX_HEAP_SIZE"]), name
        seeds = env["CASSANDRA_SEEDS"].split(",")
        assert set(seeds) <= set(CLUSTER_NODES), f"{name}: seeds {seeds}"
        assert "cqlsh" in node["healthcheck"]["test"], name
    assert len({n["environment"]["CASSANDRA_SEEDS"] for n in nodes}) == 1, "one seed list"
    # Distinct data volumes.
    volumes = [_named_volumes(n) for n in nodes]
    assert all(len(v) == 1 for v in volumes)
    assert len({v[0] for v in volumes}) == 3
    # One at a time: each node waits until the previous one serves queries.
    assert "depends_on" not in nodes[0]
    for previous, name in itertools.pairwise(CLUSTER_NODES):
        assert services[name]["depends_on"] == {previous: {"condition": "service_healthy"}}


def test_cluster_keyspace_has_three_replicas(services: dict[str, Any]) -> None:
    init = services["schema-init-cluster"]
    assert init["command"] == ["gateway", "schema", "apply"]
    assert init["depends_on"] == {CLUSTER_NODES[-1]: {"condition": "service_healthy"}}
    config = _config_of(init)
    assert config.cassandra.replication == "SimpleStrategy"
    assert config.cassandra.replication_factor == 3
    assert config.cassandra.contact_points == CLUSTER_NODES
    assert config.cassandra.consistency == "LOCAL_QUORUM"


def test_cluster_gateways_have_their_own_sessions_and_disjoint_shards(
    services: dict[str, Any],
) -> None:
    configs = {name: _config_of(services[name]) for name in CLUSTER_GATEWAYS}
    ids = [c.mqtt.client_id for c in configs.values()]
    assert len(set(ids)) == len(ids), f"client ids must differ: {ids}"
    assert "mqtt-cassandra-gateway" not in ids  # the one-node stack's default id
    filters = {name: TopicMatcher(c.topics, c.limits).subscriptions for name, c in configs.items()}
    a, b = (filters[name] for name in CLUSTER_GATEWAYS)
    assert a
    assert b
    overlapping = [(x, y) for x in a for y in b if _filters_overlap(x, y)]
    assert not overlapping, f"a message would reach both gateways: {overlapping}"
    for name, config in configs.items():
        service = services[name]
        assert config.mqtt.host == "mosquitto"
        assert config.mqtt.share_group is None
        assert config.cassandra.contact_points == CLUSTER_NODES
        assert service["depends_on"]["schema-init-cluster"] == {
            "condition": "service_completed_successfully"
        }
        assert service["depends_on"]["mosquitto"] == {"condition": "service_started"}
    # Both may run the roll-up worker: one holds its lease, the other stands by.
    assert all(c.rollups.worker for c in configs.values())
