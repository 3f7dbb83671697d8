"""Configuration loading and validation: pure unit tests, no services needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr, ValidationError

from gateway.config import (
    DEFAULT_TEMPLATE,
    Config,
    TenantConfig,
    TopicTemplate,
    load_config,
)
from gateway.errors import ConfigError
from gateway.units import parse_duration

from .helpers import self_signed

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-Pa55word"


def _write(tmp_path: Path, text: str, name: str = "gateway.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path | None = None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env or {})
    return str(info.value)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}


# --- sources and precedence -------------------------------------------------


def test_defaults_load_without_file_or_env() -> None:
    config = load_config(None, {})
    assert config.mqtt.host == "127.0.0.1"
    assert config.mqtt.port == 1883
    assert config.mqtt.client_id == "mqtt-cassandra-gateway"
    assert config.mqtt.password is None
    assert config.cassandra.contact_points == ["127.0.0.1"]
    assert config.cassandra.keyspace == "gateway"
    assert config.cassandra.replication == "SimpleStrategy"
    assert config.topics == [TopicTemplate(template=DEFAULT_TEMPLATE)]
    assert config.limits.max_payload_bytes == 64 * 1024
    assert config.limits.max_future_skew == 300.0
    assert config.limits.min_timestamp == datetime(2000, 1, 1, tzinfo=UTC)
    assert config.tenants == {}


def test_non_gateway_env_vars_are_ignored() -> None:
    config = load_config(None, {"PATH": "/bin", "MQTT__PORT": "1", "GATEWAYX": "1"})
    assert config == load_config(None, {})


def test_file_values_then_env_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[mqtt]\nhost = "broker.example"\nport = 1883\n[cassandra]\nkeyspace = "from_file"\n',
    )
    config = load_config(path, {"GATEWAY_MQTT__PORT": "1884"})
    assert config.mqtt.port == 1884  # env wins over the file
    assert config.mqtt.host == "broker.example"  # file value kept
    assert config.cassandra.keyspace == "from_file"
    assert load_config(path, {}).mqtt.port == 1883


def test_env_values_use_toml_syntax_else_plain_strings() -> None:
    config = load_config(
        None,
        {
            "GATEWAY_MQTT__HOST": "broker.example",
            "GATEWAY_MQTT__KEEPALIVE": "60",
            "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
            "GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = 3, dc2 = 2}",
            "GATEWAY_CASSANDRA__LOCAL_DC": "dc1",
            "GATEWAY_MQTT__PASSWORD": "123456",
        },
    )
    assert config.mqtt.host == "broker.example"
    assert config.mqtt.keepalive == 60
    assert config.cassandra.datacenters == {"dc1": 3, "dc2": 2}
    assert config.mqtt.password is not None
    assert config.mqtt.password.get_secret_value() == "123456"


@pytest.mark.parametrize(
    "value", ["0x1F", "1.50", "1e3", "1_000", "+5", "-0", "123 #x", '"abc"', "true", "[1,2]"]
)
def test_a_text_key_takes_the_variable_as_written(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Read as TOML, a password 0x1F became '31', 1e3 '1000.0', "123 #x" was
    cut at the '#' and quotes were dropped; true or [1,2] were refused as
    "not a valid string". The password then failed with nothing to say why.
    A value in quotes keeps them, and a warning says so (it lost them before)."""
    config = load_config(
        None,
        {
            "GATEWAY_MQTT__PASSWORD": value,
            "GATEWAY_CASSANDRA__USERNAME": value,
            "GATEWAY_MQTT__CLIENT_ID": value,
        },
    )
    assert config.mqtt.password is not None
    assert config.mqtt.password.get_secret_value() == value
    assert config.cassandra.username == value
    assert config.mqtt.client_id == value
    warned = [r.getMessage() for r in caplog.records if "are part of its value" in r.getMessage()]
    assert len(warned) == (3 if value == '"abc"' else 0), warned
    assert all(m.startswith("GATEWAY_") for m in warned)


def test_a_name_with_capitals_is_set_by_its_whole_table() -> None:
    """Variable names are case-insensitive, so GATEWAY_TENANTS__ACME__TTL is
    tenant acme; a name with capitals keeps them in a table's value."""
    config = load_config(
        None,
        {
            "GATEWAY_TENANTS__ACME__TTL": "7d",
            "GATEWAY_SAMPLING__TENANTS": "{Acme = {max_rate = 5.0}}",
            "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
            "GATEWAY_CASSANDRA__DATACENTERS": "{DC1 = 3}",
        },
    )
    assert config.tenant("acme").ttl == 7 * 86400
    assert config.sampling.tenants["Acme"].max_rate == 5.0
    assert config.cassandra.datacenters == {"DC1": 3}


def test_a_tenant_section_changes_only_what_it_sets(tmp_path: Path) -> None:
    """It replaced the default section: [sampling.tenants.acme] noisy_for =
    "0s" took acme out of [sampling.tenants.default]'s device quota."""
    path = _write(
        tmp_path,
        "[sampling.tenants.default]\nmax_devices_per_tenant = 1000\nmax_rate = 50.0\n"
        # A burst there too: 0 turned max_rate off for free, and the burst it
        # inherited was refused ("burst is set but max_rate is not").
        "burst = 200\n"
        '[sampling.tenants.acme]\nnoisy_for = "0s"\nmax_rate = 5.0\n'
        "[sampling.tenants.free]\nmax_devices_per_tenant = 0\nmax_rate = 0\n"
        '[tenants.default]\nttl = "90d"\nstate_buckets = 4\n'
        "[tenants.acme]\nstate_buckets = 8\n",
    )
    config = load_config(path, {})
    acme = config.sampling.tenants["acme"]
    assert (acme.max_devices_per_tenant, acme.max_rate, acme.noisy_for) == (1000, 5.0, 0.0)
    # 0: none for that tenant, where the default section sets one.
    free = config.sampling.tenants["free"]
    assert (free.max_devices_per_tenant, free.max_rate) == (None, None)
    assert (config.tenant("acme").ttl, config.tenant("acme").state_buckets) == (90 * 86400, 8)
    assert (config.tenant("other").ttl, config.tenant("other").state_buckets) == (90 * 86400, 4)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"GATEWAY_API__HOST": ""}, "api.host (from GATEWAY_API__HOST): String should have at"),
        ({"GATEWAY_MQTT__HOST": ""}, "mqtt.host (from GATEWAY_MQTT__HOST): String should have"),
        ({"GATEWAY_SPOOL__PATH": ""}, "spool.path (from GATEWAY_SPOOL__PATH): expected the path"),
        ({"GATEWAY_SPOOL__PATH": "/"}, "spool.path (from GATEWAY_SPOOL__PATH): expected the path"),
        ({"GATEWAY_API__TOKENS_FILE": ""}, "api.tokens_file (from GATEWAY_API__TOKENS_FILE)"),
        ({"GATEWAY_SPOOL__PATH": "/tmp"}, "spool.path (from GATEWAY_SPOOL__PATH): /tmp is a dir"),
        ({"GATEWAY_CASSANDRA__LOCAL_DC": ""}, "cassandra.local_dc (from GATEWAY_CASSANDRA__"),
        (
            {"GATEWAY_CASSANDRA__CONTACT_POINTS": '["10.0.0.5", "10.0.0.6"'},
            "Input should be a valid list (the value is not valid TOML: Unclosed array",
        ),
        (
            {"GATEWAY_MQTT__RECONNECT_MIN": "60s"},
            "mqtt.reconnect_min (60 s) is above mqtt.reconnect_max (30 s)",
        ),
        (
            {"GATEWAY_TENANTS__ACME__FAST_BUCKET": "1d"},
            "fast_bucket (86400 s) is above slow_bucket (21600 s): the faster a device",
        ),
        (
            {
                "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
                "GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = 0}",
            },
            "cassandra.datacenters.dc1 (from GATEWAY_CASSANDRA__DATACENTERS): Input should be",
        ),
        (
            {
                "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
                "GATEWAY_CASSANDRA__DATACENTERS": """{"dc'1" = 3}""",
            },
            "String should match pattern",
        ),
        (
            {"GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = 3}"},
            "cassandra.datacenters is used only with cassandra.replication",
        ),
        (
            {
                "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
                "GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = 3, dc2 = 3}",
            },
            "cassandra.local_dc is required when cassandra.datacenters names more than one "
            "(dc1, dc2)",
        ),
        (
            {
                "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
                "GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = 3}",
                "GATEWAY_CASSANDRA__LOCAL_DC": "dc9",
            },
            "cassandra.local_dc 'dc9' is not one of cassandra.datacenters (dc1)",
        ),
        (
            {"GATEWAY_CASSANDRA__GIVE_UP_AFTER": "40d"},
            "cassandra.give_up_after (from GATEWAY_CASSANDRA__GIVE_UP_AFTER): must be at most "
            "31d (got '40d')",
        ),
        (
            {"GATEWAY_SPOOL__MAX_BYTES": "2TiB"},
            "spool.max_bytes (from GATEWAY_SPOOL__MAX_BYTES): must be at most 1TiB",
        ),
        (
            {"GATEWAY_SPOOL__MAX_BYTES": "1 gigabyte"},
            "expected a size such as 65536, '64KiB' or '1GiB'",
        ),
        (
            {"GATEWAY_SAMPLING__BACKFILL_AFTER": "0s"},
            "sampling.backfill_after (from GATEWAY_SAMPLING__BACKFILL_AFTER): must be at least "
            "1s (got '0s')",
        ),
        (
            {"GATEWAY_PIPELINE__LINGER": "1500ms"},
            "pipeline.linger (from GATEWAY_PIPELINE__LINGER): must be at most 1s (got '1500ms')",
        ),
        (
            {"GATEWAY_PIPELINE__QUEUE_SIZE": "true"},
            "pipeline.queue_size (from GATEWAY_PIPELINE__QUEUE_SIZE): expected a number, got true",
        ),
        (
            {"GATEWAY_SAMPLING__TENANTS__ACME__MAX_RATE": "false"},
            "sampling.tenants.acme.max_rate (from GATEWAY_SAMPLING__TENANTS__ACME__MAX_RATE): "
            "expected a number, got false",
        ),
        (
            {
                "GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy",
                "GATEWAY_CASSANDRA__DATACENTERS": "{dc1 = true}",
            },
            "cassandra.datacenters.dc1 (from GATEWAY_CASSANDRA__DATACENTERS): expected a "
            "number, got true",
        ),
        (
            {"GATEWAY_SAMPLING__OVERRIDES": '[{topic_filter = "a/#", noisy_above = 8}]'},
            "sampling.overrides[0].topic_filter 'a/#' matches no topic the gateway subscribes "
            "to (tenants/{tenant}/devices/{device_id}/events), so it would never apply",
        ),
        (
            {
                "GATEWAY_SAMPLING__OVERRIDES": '[{topic_filter = "tenants/acme/#", '
                'noisy_above = 8}, {topic_filter = "tenant/acme/+/+/events", noisy_above = 8}]'
            },
            "sampling.overrides[1].topic_filter 'tenant/acme/+/+/events' matches no topic",
        ),
    ],
)
def test_a_value_that_cannot_work_is_refused_naming_its_key(env: dict[str, str], said: str) -> None:
    """Each of these loaded: an empty api.host listened on every interface,
    an empty spool.path crashed spool mode with a traceback, a broken list
    became hosts named '["10.0.0.5"', reconnect waits went above
    reconnect_max, a replication factor of 0 or a quote reached the CQL, and
    a range error said "less than or equal to 2678400" for "40d", true was
    taken for 1, and an override that no topic could match never applied."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, env)
    assert said in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("given", "size"),
    [("1GiB", 1 << 30), ("512MB", 512_000_000), ("64kib", 65536), ("1.5GiB", 3 << 29)],
)
def test_a_size_takes_a_unit(given: str, size: int) -> None:
    """spool.max_bytes = "1GB" was "Input should be a valid integer", where
    every duration takes its unit."""
    assert load_config(None, {"GATEWAY_SPOOL__MAX_BYTES": given}).spool.max_bytes == size


def test_a_misspelt_key_in_a_topics_entry_gets_the_nearest(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[topics]]\ntemplte = "a/{tenant}/{device_id}"\n')
    message = _error(path)
    assert "topics.0.templte" in message
    assert "unknown key; did you mean topics.0.template?" in message


def test_a_section_check_blames_what_set_its_keys(tmp_path: Path) -> None:
    """It blamed every variable of the section: a conflict in the file was
    said to come from GATEWAY_CASSANDRA__PORT."""
    path = _write(
        tmp_path,
        "[cassandra]\nmin_in_flight = 500\nmax_in_flight = 100\n"
        "[tenants.acme]\nslow_below = 10.0\nfast_above = 0.001\n",
    )
    env = {"GATEWAY_CASSANDRA__PORT": "9043", "GATEWAY_TENANTS__ACME__TTL": "90d"}
    with pytest.raises(ConfigError) as caught:
        load_config(path, env)
    said = str(caught.value)
    assert f"cassandra (from {path}): cassandra.min_in_flight (500)" in said, said
    assert f"tenants.acme (from {path}): slow_below must be lower" in said, said
    assert "GATEWAY_" not in said, said
    # A variable that set one of the keys named is blamed, beside the file.
    with pytest.raises(ConfigError) as caught:
        load_config(path, env | {"GATEWAY_CASSANDRA__MAX_IN_FLIGHT": "50"})
    assert f"cassandra (from GATEWAY_CASSANDRA__MAX_IN_FLIGHT, {path}):" in str(caught.value)


def test_gateway_config_env_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqtt]\nport = 1999\n")
    assert load_config(None, {"GATEWAY_CONFIG": str(path)}).mqtt.port == 1999


def test_the_build_switch_is_not_a_config_key() -> None:
    # `GATEWAY_COMPILE=0 make run` (README, "Compiled modules") passes the
    # variable on to every command make runs, `gateway schema apply` among them.
    assert load_config(None, {"GATEWAY_COMPILE": "0"}) == load_config(None, {})


def test_example_file_loads_and_shows_the_defaults() -> None:
    example = load_config(ROOT / "gateway.example.toml", {})
    defaults = load_config(None, {})
    # "shown values are the defaults unless marked example"
    assert example.mqtt == defaults.mqtt
    assert example.cassandra == defaults.cassandra
    assert example.topics == defaults.topics
    assert example.pipeline == defaults.pipeline
    assert example.limits == defaults.limits
    assert set(example.tenants) == {"default"}
    assert example.tenant("anyone") == TenantConfig()


def _sections(text: str) -> dict[str, str]:
    """The example file's lines by the table they are under; a commented
    table header (``# [mqtt.tls]``) counts as one."""
    header = re.compile(r"^#?\s*\[\[?([a-z_.]+)\]\]?")
    found: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if match := header.match(line):
            current = match.group(1)
        found[current] = found.get(current, "") + line + "\n"
    return found


def _tables(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield f"{prefix}{name}", field.annotation
            yield from _tables(field.annotation, f"{prefix}{name}.")


def test_example_file_lists_every_key_of_every_table() -> None:
    """`gateway init` promises every key with its default: each key of each
    table is in the example, set or commented out, under its own table."""
    sections = _sections((ROOT / "gateway.example.toml").read_text())
    missing = [
        f"{table}.{key}"
        for table, model in _tables(Config)
        for key in model.model_fields
        if not re.search(rf"^#?\s*{key}\s*=", sections.get(table, ""), re.MULTILINE)
        # a table of its own ([mqtt.tls], [[sampling.important]], [sampling.tenants.acme])
        and not any(name.startswith(f"{table}.{key}") for name in sections)
    ]
    assert missing == [], f"not in gateway.example.toml: {missing}"


def test_example_file_commented_tables_load(tmp_path: Path) -> None:
    """Each commented-out example table ("# [[sampling.overrides]]" and the
    "# key = value" lines under it), uncommented alone, is a valid config: a
    user who copies one gets no error. Files named in it are made readable
    here (a real certificate and key: TLS files are loaded when the config
    is). It once showed the topic filter "pump-+", which the loader refuses."""
    cert, private_key = self_signed(tmp_path)
    header = re.compile(r"^# (\[\[?[a-z_.]+\]\]?)")
    key = re.compile(r"^# ([a-z_]+) = ")
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in (ROOT / "gateway.example.toml").read_text().splitlines():
        if header.match(line):
            current = [line[2:]]
            blocks.append(current)
        elif current is not None and key.match(line):
            value = line[2:]
            if re.match(r"[a-z_]+_file = ", value):  # ca_file, cert_file, key_file
                name = value.split()[0]
                path = private_key if name == "key_file" else cert
                if name not in ("ca_file", "cert_file", "key_file"):
                    path = tmp_path / f"{len(blocks)}-{name}"
                    path.write_text("-")
                value = f'{name} = "{path}"'
            current.append(value)
        else:
            current = None
    assert len(blocks) >= 7, [b[0] for b in blocks]
    for block in blocks:
        path = _write(tmp_path, "\n".join(block) + "\n")
        load_config(path, {})  # raises, naming the key, if the example is wrong


def test_contact_points_from_env_are_comma_separated() -> None:
    config = load_config(None, {"GATEWAY_CASSANDRA__CONTACT_POINTS": "10.0.0.5, 10.0.0.6 ,cass-3,"})
    assert config.cassandra.contact_points == ["10.0.0.5", "10.0.0.6", "cass-3"]
    single = load_config(None, {"GATEWAY_CASSANDRA__CONTACT_POINTS": "10.0.0.7"})
    assert single.cassandra.contact_points == ["10.0.0.7"]
    toml_list = load_config(None, {"GATEWAY_CASSANDRA__CONTACT_POINTS": '["a", "b"]'})
    assert toml_list.cassandra.contact_points == ["a", "b"]


def test_empty_contact_points_rejected() -> None:
    message = _error(env={"GATEWAY_CASSANDRA__CONTACT_POINTS": " , "})
    assert "cassandra.contact_points (from GATEWAY_CASSANDRA__CONTACT_POINTS)" in message


# --- every error names the key and its source -------------------------------


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqtt]\nprot = 1884\n")
    assert f"mqtt.prot (from {path}): unknown key" in _error(path)


def test_unknown_section_in_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqttt]\nport = 1884\n")
    assert f"mqttt (from {path}): unknown key" in _error(path)


def test_unknown_key_from_env_names_the_variable() -> None:
    message = _error(env={"GATEWAY_MQTT__PROT": "1884"})
    assert "mqtt.prot (from GATEWAY_MQTT__PROT): unknown key; did you mean mqtt.port?" in message


def test_a_misspelt_key_or_section_is_told_the_nearest_one(tmp_path: Path) -> None:
    path = _write(tmp_path, '[mqtt]\nhots = "b"\n[casandra]\nport = 9042\n')
    message = _error(path)
    assert f"mqtt.hots (from {path}): unknown key; did you mean mqtt.host?" in message
    assert f"casandra (from {path}): unknown key; did you mean cassandra?" in message
    # Inside a tenant's table too; nothing near: no guess.
    path = _write(tmp_path, "[tenants.acme]\nstate_bucket = 4\nzzz = 1\n")
    message = _error(path)
    assert "tenants.acme.state_bucket (from" in message
    assert "did you mean tenants.acme.state_buckets?" in message
    assert f"tenants.acme.zzz (from {path}): unknown key\n" in message + "\n"


def test_an_env_variable_with_one_underscore_is_told_the_two() -> None:
    message = _error(env={"GATEWAY_MQTT_HOST": "broker"})
    assert (
        "mqtt_host (from GATEWAY_MQTT_HOST): unknown key; "
        "GATEWAY_<SECTION>__<KEY> takes two underscores: GATEWAY_MQTT__HOST?"
    ) in message


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        # "did you mean cassandra?" came first: the top-level name nearest.
        ("GATEWAY_CASSANDRA_PORT", "GATEWAY_CASSANDRA__PORT"),
        # A section whose name holds an underscore.
        ("GATEWAY_HOT_PARTITIONS_THRESHOLD", "GATEWAY_HOT_PARTITIONS__THRESHOLD"),
    ],
)
def test_the_two_underscores_come_before_a_near_name(variable: str, meant: str) -> None:
    message = _error(env={variable: "1"})
    assert f"takes two underscores: {meant}?" in message, message


def test_keepalive_takes_a_duration_in_whole_seconds() -> None:
    assert load_config(None, {"GATEWAY_MQTT__KEEPALIVE": "1m"}).mqtt.keepalive == 60
    assert load_config(None, {"GATEWAY_MQTT__KEEPALIVE": "45"}).mqtt.keepalive == 45
    message = _error(env={"GATEWAY_MQTT__KEEPALIVE": "2.5s"})
    assert "mqtt.keepalive (from GATEWAY_MQTT__KEEPALIVE): expected whole seconds" in message
    assert "mqtt.keepalive" in _error(env={"GATEWAY_MQTT__KEEPALIVE": "2h"})  # over 3600


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("70000", "less than or equal to 65535"),
        ("0", "greater than or equal to 1"),
        ("abc", "valid integer"),
    ],
)
def test_bad_env_value_names_key_and_variable(raw: str, fragment: str) -> None:
    message = _error(env={"GATEWAY_MQTT__PORT": raw})
    assert "mqtt.port (from GATEWAY_MQTT__PORT)" in message
    assert fragment in message


def test_bad_file_value_names_key_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pipeline]\nqueue_size = 0\n")
    assert f"pipeline.queue_size (from {path})" in _error(path)


def test_env_error_attributed_to_env_even_with_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqtt]\nport = 1883\n")
    message = _error(path, {"GATEWAY_MQTT__PORT": "99999"})
    assert "mqtt.port (from GATEWAY_MQTT__PORT)" in message
    assert str(path) not in message


def test_a_check_across_sections_names_the_variables_it_read(tmp_path: Path) -> None:
    """A check on the whole config (queue_size against receive_maximum, two
    overlapping templates) always blamed the file, or "defaults", even when
    the value came from a GATEWAY_ variable. It names the variables whose
    keys it names, and the file only if a key it names is not from one."""
    path = _write(tmp_path, "[pipeline]\nqueue_size = 2000\n")
    unrelated = {"GATEWAY_API__PORT": "0", "GATEWAY_MQTT__CLIENT_ID": "a"}
    message = _error(path, {"GATEWAY_MQTT__RECEIVE_MAXIMUM": "5000", **unrelated})
    assert (
        f"(top level) (from GATEWAY_MQTT__RECEIVE_MAXIMUM, {path}): "
        "pipeline.queue_size (2000) must be at least mqtt.receive_maximum (5000)"
    ) in message
    assert "GATEWAY_API__PORT" not in message
    assert "GATEWAY_MQTT__CLIENT_ID" not in message
    # Without a file: the defaults, named as other errors name them.
    message = _error(env={"GATEWAY_MQTT__RECEIVE_MAXIMUM": "5000"})
    assert "(top level) (from GATEWAY_MQTT__RECEIVE_MAXIMUM, defaults): " in message
    # Both keys from the environment (a whole section counts): not the file.
    message = _error(
        path, {"GATEWAY_MQTT": "{receive_maximum = 5000}", "GATEWAY_PIPELINE__QUEUE_SIZE": "100"}
    )
    assert "(top level) (from GATEWAY_MQTT, GATEWAY_PIPELINE__QUEUE_SIZE): " in message
    assert str(path) not in message
    # Both from the file: the file alone, as before.
    both = _write(tmp_path, "[mqtt]\nreceive_maximum = 5000\n", name="both.toml")
    message = _error(both, {"GATEWAY_API__PORT": "0"})
    assert f"(top level) (from {both}): pipeline.queue_size" in message
    assert "GATEWAY_" not in message
    # Overlapping templates from GATEWAY_TOPICS.
    topics = (
        '[{template = "a/{tenant}/x/{device_id}"}, '
        '{template = "a/acme/{_}/{device_id}", tenant = "acme"}]'
    )
    message = _error(path, {"GATEWAY_TOPICS": topics, **unrelated})
    assert "(top level) (from GATEWAY_TOPICS): topics.1 (a/acme/+/+) and topics.0" in message
    assert str(path) not in message
    # A topic name too long for a level set by a variable, in a template from the file.
    long = _write(
        tmp_path,
        '[[topics]]\ntemplate = "site/{device_id}/events"\ntenant = "far-too-long"\n',
        name="long.toml",
    )
    message = _error(long, {"GATEWAY_LIMITS__MAX_TOPIC_LEVEL_LENGTH": "8"})
    assert f"(top level) (from GATEWAY_LIMITS__MAX_TOPIC_LEVEL_LENGTH, {long}): " in message


def test_nested_tenant_env_error() -> None:
    message = _error(env={"GATEWAY_TENANTS__ACME__STATE_BUCKETS": "0"})
    assert "tenants.acme.state_buckets (from GATEWAY_TENANTS__ACME__STATE_BUCKETS)" in message
    assert "greater than or equal to 1" in message


def test_nested_tenant_env_sets_a_tenant() -> None:
    config = load_config(None, {"GATEWAY_TENANTS__ACME__STATE_BUCKETS": "8"})
    assert config.tenant("acme").state_buckets == 8


def test_several_errors_are_all_reported(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqtt]\nport = 0\nkeepalive = 1\n")
    message = _error(path)
    assert f"mqtt.port (from {path})" in message
    assert f"mqtt.keepalive (from {path})" in message


@pytest.mark.parametrize("name", ["GATEWAY_MQTT____PORT", "GATEWAY___PORT", "GATEWAY_MQTT__"])
def test_malformed_env_variable_name(name: str) -> None:
    message = _error(env={name: "1"})
    assert name in message
    assert "malformed" in message


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    bad = _write(tmp_path, "[[mqtt\n")
    assert f"config file {bad} is not valid TOML" in _error(bad)
    missing = tmp_path / "missing.toml"
    assert f"cannot read config file {missing}" in _error(missing)


# --- durations ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("15m", 900.0),
        ("250ms", 0.25),
        ("30s", 30.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("1.5h", 5400.0),
        (" 10 s ", 10.0),
        ("45", 45.0),
        (30, 30.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration(raw: object, seconds: float) -> None:
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["abc", "15 minutes", "-5s", "1e3", "", True, None, [1]])
def test_parse_duration_rejects(raw: object) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(raw)


def test_durations_in_config(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[mqtt]\nsession_expiry = "15m"\nreconnect_min = "250ms"\n'
        '[cassandra]\ngive_up_after = "1h"\n',
    )
    config = load_config(path, {"GATEWAY_PIPELINE__STATUS_INTERVAL": "2s"})
    assert config.mqtt.session_expiry == 900.0
    assert config.mqtt.reconnect_min == 0.25
    assert config.cassandra.give_up_after == 3600.0
    assert config.pipeline.status_interval == 2.0


def test_bad_duration_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[mqtt]\nsession_expiry = "abc"\n')
    message = _error(path)
    assert f"mqtt.session_expiry (from {path})" in message
    assert "expected a duration" in message
    assert "'abc'" in message
    assert "units ms, s, m, h, d" in message


def test_zero_duration_rejected() -> None:
    message = _error(env={"GATEWAY_PIPELINE__STATUS_INTERVAL": "0s"})
    assert "pipeline.status_interval (from GATEWAY_PIPELINE__STATUS_INTERVAL)" in message


@pytest.mark.parametrize("raw", ['"30s"', '"8d"', '"90.5"', "59"])
def test_telemetry_bucket_must_be_whole_seconds_between_1m_and_7d(tmp_path: Path, raw: str) -> None:
    path = _write(tmp_path, f"[tenants.default]\ntelemetry_bucket = {raw}\n")
    message = _error(path)
    assert f"tenants.default.telemetry_bucket (from {path})" in message
    assert "whole number of seconds between 1m and 7d" in message


@pytest.mark.parametrize(("raw", "seconds"), [('"1m"', 60.0), ('"15m"', 900.0), ('"7d"', 604800.0)])
def test_telemetry_bucket_accepted(tmp_path: Path, raw: str, seconds: float) -> None:
    path = _write(tmp_path, f"[tenants.default]\ntelemetry_bucket = {raw}\n")
    assert load_config(path, {}).tenant("x").telemetry_bucket == seconds


@pytest.mark.parametrize("raw", ["inf", "500ms"])
def test_ttl_that_cannot_be_written_is_rejected(raw: str) -> None:
    _error(env={"GATEWAY_TENANTS__DEFAULT__TTL": raw})


@pytest.mark.parametrize("raw", ["inf", "50000d"])
def test_session_expiry_out_of_mqtt_range_is_rejected(raw: str) -> None:
    _error(env={"GATEWAY_MQTT__SESSION_EXPIRY": raw})


# --- topic templates ------------------------------------------------------------


def _topics_toml(*entries: str) -> str:
    return "".join(f"[[topics]]\n{entry}\n" for entry in entries)


def test_several_templates_load(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _topics_toml(
            'template = "tenants/{tenant}/devices/{device_id}/events"',
            'template = "site/{device_id}/events"\ntenant = "site-a"',
            'template = "x/{_}/{tenant}/{device_id}"',
        ),
    )
    config = load_config(path, {})
    assert [t.template for t in config.topics] == [
        "tenants/{tenant}/devices/{device_id}/events",
        "site/{device_id}/events",
        "x/{_}/{tenant}/{device_id}",
    ]
    assert config.topics[1].tenant == "site-a"


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ('template = "tenants/{tenant}/events"', "needs exactly one {device_id} level"),
        (
            'template = "a/{device_id}/{device_id}/{tenant}"',
            "needs exactly one {device_id} level",
        ),
        ('template = "site/{device_id}/events"', "has no {tenant} level: set a fixed tenant"),
        (
            'template = "t/{tenant}/{device_id}"\ntenant = "fixed"',
            "has a {tenant} level and a fixed tenant",
        ),
        ('template = "t/{tenant}/{tenant}/{device_id}"', "more than one {tenant} level"),
        ('template = "tenants/+/devices/{device_id}/{tenant}"', "level '+' must be a fixed word"),
        ('template = "tenants/{tenant}/{device_id}/#"', "level '#' must be a fixed word"),
        ('template = "t/{tenant}/{device}"', "level '{device}' must be a fixed word"),
        ('template = "t//{tenant}/{device_id}"', "has an empty level"),
        ('template = "/{tenant}/{device_id}"', "has an empty level"),
    ],
)
def test_bad_topic_templates(tmp_path: Path, entry: str, fragment: str) -> None:
    path = _write(tmp_path, _topics_toml('template = "ok/{tenant}/{device_id}"', entry))
    message = _error(path)
    assert f"topics.1 (from {path})" in message
    assert fragment in message


def test_a_shard_of_tenants_loads(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _topics_toml(
            'template = "tenants/{tenant}/devices/{device_id}/events"\n'
            'tenants = ["acme", "globex"]',
        ),
    )
    assert load_config(path, {}).topics[0].tenants == ["acme", "globex"]
    # From the environment too: a TOML array of inline tables.
    env = {"GATEWAY_TOPICS": '[{template = "t/{tenant}/{device_id}", tenants = ["a", "b"]}]'}
    assert load_config(None, env).topics[0].tenants == ["a", "b"]


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (
            'template = "site/{device_id}/events"\ntenant = "a"\ntenants = ["b"]',
            "tenants lists the tenants a {tenant} level may take, and this template has none",
        ),
        ('template = "t/{tenant}/{device_id}"\ntenants = ["a/b"]', "'a/b' is not a topic level"),
        ('template = "t/{tenant}/{device_id}"\ntenants = ["+"]', "'+' is not a topic level"),
        ('template = "t/{tenant}/{device_id}"\ntenants = [""]', "'' is not a topic level"),
        ('template = "t/{tenant}/{device_id}"\ntenants = ["a", "a"]', "'a' listed twice"),
        # A fixed tenant too: events were stored under it, and no token could read them.
        ('template = "site/{device_id}/events"\ntenant = "a/x"', "'a/x' is not a topic level"),
        ('template = "site/{device_id}/events"\ntenant = "#"', "'#' is not a topic level"),
        ('template = "site/{device_id}/events"\ntenant = "a\\u0007"', "is not a topic level"),
        (
            'template = "$share/g/t/{tenant}/{device_id}"',
            "a shared subscription is not a template level; set mqtt.share_group instead",
        ),
    ],
)
def test_bad_tenant_shards(tmp_path: Path, entry: str, fragment: str) -> None:
    path = _write(tmp_path, _topics_toml('template = "ok/{tenant}/{device_id}"', entry))
    message = _error(path)
    assert "topics.1" in message
    assert f"(from {path})" in message
    assert fragment in message


def test_a_shard_tenant_longer_than_a_topic_level_may_be(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "[limits]\nmax_topic_level_length = 8\n"
        + _topics_toml('template = "t/{tenant}/{device_id}"\ntenants = ["ok", "far-too-long"]'),
    )
    message = _error(path)
    assert "topics.0.tenants: 'far-too-long'... is longer than" in message
    assert "limits.max_topic_level_length (8)" in message
    fixed = _write(
        tmp_path,
        "[limits]\nmax_topic_level_length = 8\n"
        + _topics_toml('template = "site/{device_id}/events"\ntenant = "far-too-long"'),
        name="fixed.toml",
    )
    message = _error(fixed)
    assert "topics.0.tenant: 'far-too-long'... is longer than" in message


def test_a_duration_too_large_for_a_float_is_a_config_error() -> None:
    """It raised OverflowError out of load_config, which promises ConfigError."""
    message = _error(env={"GATEWAY_LIMITS__MAX_FUTURE_SKEW": "1" + "0" * 400})
    assert "limits.max_future_skew (from GATEWAY_LIMITS__MAX_FUTURE_SKEW)" in message
    assert "finite duration" in message


def test_share_group(tmp_path: Path) -> None:
    config = load_config(
        None, {"GATEWAY_MQTT__SHARE_GROUP": "gateways", "GATEWAY_SAMPLING__ENABLED": "false"}
    )
    assert config.mqtt.subscription("a/+/b") == "$share/gateways/a/+/b"
    assert load_config(None, {}).mqtt.subscription("a/+/b") == "a/+/b"
    for bad in ("a/b", "a+", "#"):
        message = _error(env={"GATEWAY_MQTT__SHARE_GROUP": bad})
        assert "mqtt.share_group (from GATEWAY_MQTT__SHARE_GROUP)" in message
        assert "must not contain '/', '+' or '#'" in message
    # Each member samples its share of a device's events alone: a change back
    # another member saw the first half of looked like no change.
    message = _error(env={"GATEWAY_MQTT__SHARE_GROUP": "gateways"})
    assert "mqtt.share_group needs sampling.enabled = false" in message
    # A tenant's rate limit, inherited from the default section too, drops such a change.
    message = _error(
        env={
            "GATEWAY_MQTT__SHARE_GROUP": "gateways",
            "GATEWAY_SAMPLING__ENABLED": "false",
            "GATEWAY_SAMPLING__TENANTS": "{default = {max_rate = 100}, acme = {noisy_for = 1}}",
        }
    )
    assert "cannot go with a tenant's max_rate (sampling.tenants.acme.max_rate)" in message


def test_no_topics_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "topics = []\n")
    assert f"topics (from {path})" in _error(path)


def test_template_model_directly() -> None:
    assert TopicTemplate().template == DEFAULT_TEMPLATE
    TopicTemplate(template="site/{device_id}/events", tenant="site-a")
    with pytest.raises(ValidationError, match="fixed tenant"):
        TopicTemplate(template="site/{device_id}/events")


# --- cassandra replication --------------------------------------------------------


def test_network_topology_strategy_needs_datacenters(tmp_path: Path) -> None:
    path = _write(tmp_path, '[cassandra]\nreplication = "NetworkTopologyStrategy"\n')
    message = _error(path)
    assert f"(from {path})" in message
    assert "cassandra.datacenters is required with cassandra.replication = " in message

    ok = _write(
        tmp_path,
        '[cassandra]\nreplication = "NetworkTopologyStrategy"\ndatacenters = {dc1 = 3}\n',
        name="ok.toml",
    )
    assert load_config(ok, {}).cassandra.datacenters == {"dc1": 3}


def test_model_level_error_from_env_names_the_variable() -> None:
    message = _error(env={"GATEWAY_CASSANDRA__REPLICATION": "NetworkTopologyStrategy"})
    assert "GATEWAY_CASSANDRA__REPLICATION" in message


def test_bad_keyspace_name() -> None:
    message = _error(env={"GATEWAY_CASSANDRA__KEYSPACE": "Bad-Name"})
    assert "cassandra.keyspace (from GATEWAY_CASSANDRA__KEYSPACE)" in message


# --- secrets -----------------------------------------------------------------------


def _secret_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "mqtt-password"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_password_file_readable_by_others_rejected(tmp_path: Path, mode: int) -> None:
    secret = _secret_file(tmp_path, mode)
    path = _write(tmp_path, f'[mqtt]\npassword_file = "{secret}"\n')
    message = _error(path)
    assert "mqtt.password_file" in message
    assert str(secret) in message
    assert "chmod 600" in message
    assert SECRET not in message


def test_cassandra_password_file_rejected_too(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, 0o644)
    message = _error(env={"GATEWAY_CASSANDRA__PASSWORD_FILE": str(secret)})
    assert "cassandra.password_file" in message
    assert "chmod 600" in message


def test_password_file_0600_accepted_and_masked(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, 0o600)
    path = _write(
        tmp_path,
        f'[mqtt]\nusername = "gw"\npassword_file = "{secret}"\n'
        f'[cassandra]\npassword_file = "{secret}"\n',
    )
    config = load_config(path, {})
    assert isinstance(config.mqtt.password, SecretStr)
    assert config.mqtt.password.get_secret_value() == SECRET  # trailing newline stripped
    assert config.cassandra.password is not None
    assert config.cassandra.password.get_secret_value() == SECRET
    for text in (repr(config), str(config), repr(config.mqtt), str(config.model_dump())):
        assert SECRET not in text
    assert "**********" in repr(config.mqtt.password)


def test_inline_password_is_masked() -> None:
    config = load_config(None, {"GATEWAY_MQTT__PASSWORD": SECRET})
    assert SECRET not in repr(config)
    assert SECRET not in str(config)


def test_password_and_password_file_are_exclusive(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, 0o600)
    message = _error(
        env={"GATEWAY_MQTT__PASSWORD": "x", "GATEWAY_MQTT__PASSWORD_FILE": str(secret)}
    )
    assert "set mqtt.password or mqtt.password_file, not both" in message


def test_missing_password_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    message = _error(env={"GATEWAY_MQTT__PASSWORD_FILE": str(missing)})
    assert "mqtt.password_file" in message
    assert "cannot read" in message


def test_unreadable_password_file_is_a_config_error(tmp_path: Path) -> None:
    directory = tmp_path / "secret-dir"
    directory.mkdir(mode=0o700)
    directory.chmod(0o700)
    outcome: Exception | None = None
    try:
        load_config(None, {"GATEWAY_MQTT__PASSWORD_FILE": str(directory)})
    except (ConfigError, OSError) as exc:
        outcome = exc
    assert isinstance(outcome, ConfigError), f"got {outcome!r}"
    assert "mqtt.password_file" in str(outcome)


# --- tenants -----------------------------------------------------------------------


def test_tenant_takes_its_section_then_the_default_then_builtin(tmp_path: Path) -> None:
    builtin = load_config(None, {})
    assert builtin.tenant("anyone") == TenantConfig()
    assert builtin.tenant("anyone").state_buckets == 1
    assert builtin.tenant("anyone").telemetry_bucket == 3600.0
    assert builtin.tenant("anyone").ttl == 30 * 86400.0

    path = _write(
        tmp_path,
        '[tenants.default]\nstate_buckets = 2\nttl = "7d"\n'
        '[tenants.acme]\nstate_buckets = 8\ntelemetry_bucket = "15m"\n',
    )
    config = load_config(path, {})
    acme = config.tenant("acme")
    assert (acme.state_buckets, acme.telemetry_bucket) == (8, 900.0)
    # What a tenant's own section does not set comes from [tenants.default].
    assert acme.ttl == 7 * 86400.0
    other = config.tenant("other")
    assert (other.state_buckets, other.ttl) == (2, 7 * 86400.0)

    only_acme = Config(tenants={"acme": TenantConfig(state_buckets=4)})
    assert only_acme.tenant("acme").state_buckets == 4
    assert only_acme.tenant("other") == TenantConfig()


# --- CLI ---------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env=env or _clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def test_cli_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "[mqtt]\nprot = 1884\n", name="bad.toml")
    result = _cli("--config", str(path), "check")
    assert result.returncode == 2, result.stderr
    assert f"mqtt.prot (from {path}): unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_exits_2_for_bad_env_value() -> None:
    result = _cli("check", env=_clean_env() | {"GATEWAY_MQTT__PORT": "99999"})
    assert result.returncode == 2, result.stderr
    assert "mqtt.port (from GATEWAY_MQTT__PORT)" in result.stderr


def test_ttl_leaves_room_for_the_partition_index() -> None:
    # The index row lives ttl + one bucket; Cassandra caps a TTL at 20 years.
    with pytest.raises(ConfigError, match=r"tenants\.default.*ttl"):
        load_config(None, {"GATEWAY_TENANTS__DEFAULT__TTL": "7300d"})
    assert load_config(None, {"GATEWAY_TENANTS__DEFAULT__TTL": "7299d"}).tenant("x").ttl


def test_a_config_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    """A file saved as Latin-1 (a Windows editor's default) was a traceback
    (UnicodeDecodeError)."""
    path = tmp_path / "latin1.toml"
    path.write_bytes("[mqtt]\n# temp\u00e9rature in \u00b0C\nport = 1883\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config(path, {})
    message = str(caught.value)
    assert message.startswith(f"config file {path} is not UTF-8"), message
    assert "line 2" in message


def test_a_list_in_the_environment_that_is_not_toml_says_so() -> None:
    """GATEWAY_TOPICS with a missing bracket said only "Input should be a
    valid list"; a string value that starts with '[' (a password) still works."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"GATEWAY_TOPICS": '[{template = "x/{device_id}"'})
    message = str(caught.value)
    assert "topics (from GATEWAY_TOPICS): Input should be a valid list" in message
    assert "the value is not valid TOML: Unclosed inline table" in message
    config = load_config(None, {"GATEWAY_MQTT__PASSWORD": "[not-toml"})
    assert config.mqtt.password is not None
    assert config.mqtt.password.get_secret_value() == "[not-toml"


def test_an_override_for_another_shards_tenant_loads() -> None:
    """A shard lists its tenants (README, "Scaling out"), and the config it
    shares with the other shards may hold an override for their tenants:
    that is no typo, and the old session of a moved tenant still delivers."""
    env = {
        "GATEWAY_TOPICS": '[{template = "tenants/{tenant}/devices/{device_id}/events", '
        'tenants = ["a", "b"]}]',
        "GATEWAY_SAMPLING__OVERRIDES": "[{topic_filter = 'tenants/acme/#', noisy_above = 8}]",
    }
    config = load_config(None, env)
    assert config.sampling.overrides[0].topic_filter == "tenants/acme/#"
