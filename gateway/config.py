"""Typed configuration, validated once at start-up.

Where a value comes from, the first that sets it winning:
``GATEWAY_<SECTION>__<KEY>`` environment variables (``GATEWAY_MQTT__HOST``,
``GATEWAY_TENANTS__ACME__STATE_BUCKETS``), then the TOML file (``--config`` or
``GATEWAY_CONFIG``), then the defaults below. ``GATEWAY_CONFIG``,
``GATEWAY_LOG_LEVEL`` and the build's ``GATEWAY_COMPILE`` are not keys. Nothing else
in the package reads the environment. Unknown keys are errors, and every error
names the key and where it came from, e.g.
``mqtt.port (from GATEWAY_MQTT__PORT): Input should be less than or equal to 65535``.
Secrets are ``SecretStr`` (masked in reprs and logs) and can come from files
that only the service user may read.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import math
import os
import re
import ssl
import stat
import tomllib
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .topic_filters import covers, filter_levels, is_topic_level, meets, overlap
from .units import duration_text, parse_duration, parse_size, parse_whole_seconds, size_text

log = logging.getLogger(__name__)

ENV_PREFIX = "GATEWAY_"
ENV_CONFIG_PATH = "GATEWAY_CONFIG"
# The CLI's --log-level from the environment (not a config key).
ENV_LOG_LEVEL = "GATEWAY_LOG_LEVEL"
# The build's switch for compiled modules (setup.py, Makefile), not a config key:
# make passes it on to every command a target runs.
ENV_BUILD = "GATEWAY_COMPILE"
DEFAULT_TEMPLATE = "tenants/{tenant}/devices/{device_id}/events"

_IDENTIFIER = r"^[a-z][a-z0-9_]{0,47}$"
# Readers look this far back before a range for the bucket that contains its start.
MAX_BUCKET_SECONDS = 7 * 86400


def _split_list(value: object) -> object:
    # Environment variables carry lists as "a,b,c"; one that starts like a
    # TOML list but does not parse is left whole, for the error to say so.
    if isinstance(value, str) and not isinstance(value, _NotToml):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


# Bounded: a month covers every timeout and interval; longer spans (session
# expiry, TTL) say so with their own bound.
Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=31 * 86400)]
# A duration that may be zero.
Wait = Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=3600)]
MAX_TTL_SECONDS = 20 * 365 * 86400
LongDuration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=20 * 365 * 86400)]
Port = Annotated[int, Field(ge=1, le=65535)]
# Bytes: 65536, or with a unit ("64KiB", "1GiB", "500MB").
Bytes = Annotated[int, BeforeValidator(parse_size)]


class _Model(BaseModel):
    # coerce_numbers_to_str: GATEWAY_MQTT__PASSWORD=123456 is a string, not an error.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode takes true for 1: "queue_size = true" loaded as a
        # queue of one message, "target_rate = true" as 1 msg/s.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _is_number(field.annotation):
            return _not_bool(value)
        return value


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def _read_secret_file(path: Path, key: str) -> SecretStr:
    try:
        info = path.stat()
    except OSError as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{key}: {path} is not a regular file")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{key}: {path} is readable by other users (mode {stat.filemode(info.st_mode)}); "
            "make it readable only by the service user (chmod 600)"
        )
    try:
        return SecretStr(path.read_text().rstrip("\n"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc}") from None


def _load_password(section: MqttConfig | CassandraConfig, name: str) -> None:
    """password_file -> password (a frozen model, so set during validation)."""
    if section.password_file is None:
        return
    if section.password is not None:
        raise ValueError(f"set {name}.password or {name}.password_file, not both")
    secret = _read_secret_file(section.password_file, f"{name}.password_file")
    object.__setattr__(section, "password", secret)


class TlsConfig(_Model):
    """TLS for a connection. Off unless enabled; hostname verification on by default."""

    enabled: bool = False
    # CA bundle that signed the server's certificate (default: the system's).
    ca_file: Path | None = None
    # Client certificate and key, for servers that require one.
    cert_file: Path | None = None
    key_file: Path | None = None
    verify_hostname: bool = True

    @model_validator(mode="after")
    def _files(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("set both cert_file and key_file, or neither")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        try:
            self.context()  # a CA or key that is not PEM: said now, not at connect
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def context(self) -> ssl.SSLContext | None:
        """An SSLContext, or None when TLS is off. Built at connect time, so
        that renewed files are used; ConfigError names the file it cannot load."""
        if not self.enabled:
            return None
        try:
            ctx = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file is not None else None
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"ca_file: cannot load {self.ca_file}: {exc}") from None
        ctx.check_hostname = self.verify_hostname
        if self.cert_file is not None and self.key_file is not None:
            try:
                ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cert_file/key_file: cannot load {self.cert_file} with {self.key_file}: {exc}"
                ) from None
        return ctx


# A host name or address; never empty (an empty api.host listened on every interface).
Host = Annotated[str, Field(min_length=1, max_length=253)]


def _a_file(value: Path) -> Path:
    if not value.name:  # "" reads as ".", and "/" has no name either
        raise ValueError(f"expected the path of a file, got {str(value)!r}")
    if value.is_dir():
        raise ValueError(f"{value} is a directory: name a file in it")
    return value


FilePath = Annotated[Path, AfterValidator(_a_file)]


class MqttConfig(_Model):
    host: Host = "127.0.0.1"
    port: Port = 1883
    # Fixed client id: the broker keeps this id's persistent session (and its
    # backlog) while the gateway is away.
    client_id: str = Field(default="mqtt-cassandra-gateway", min_length=1, max_length=128)
    keepalive: Annotated[int, BeforeValidator(parse_whole_seconds), Field(ge=5, le=3600)] = 30
    # How long the broker keeps our session and backlog after we disconnect.
    session_expiry: Annotated[
        float, BeforeValidator(parse_duration), Field(ge=1, le=4_294_967_295)
    ] = 7 * 86400.0
    # MQTT v5 Receive Maximum: the broker sends at most this many unacknowledged
    # QoS 1 messages. It is the gateway's flow control and memory bound.
    receive_maximum: int = Field(default=1000, ge=1, le=65535)
    reconnect_min: Duration = 0.5
    reconnect_max: Duration = 30.0
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)
    # MQTT v5 shared subscriptions: every filter becomes $share/<group>/<filter>,
    # and the broker hands each message to one member of the group. Off by
    # default: on Mosquitto 2.x the QoS 1 messages in flight to a member that
    # disconnects are not given to another member (eclipse/mosquitto#2662);
    # topic-filter shards are the default way to run several instances
    # (README, "Scaling out").
    share_group: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("share_group")
    @classmethod
    def _share_name(cls, value: str | None) -> str | None:
        # MQTT 5 §4.8.2: a ShareName must not contain "/", "+" or "#".
        if value is not None and any(ch in value for ch in "/+#"):
            raise ValueError(f"mqtt.share_group {value!r} must not contain '/', '+' or '#'")
        return value

    @model_validator(mode="after")
    def _password_from_file(self) -> MqttConfig:
        _load_password(self, "mqtt")
        if self.reconnect_min > self.reconnect_max:
            raise ValueError(
                f"mqtt.reconnect_min ({self.reconnect_min:g} s) is above mqtt.reconnect_max "
                f"({self.reconnect_max:g} s): the first wait must not be the longest"
            )
        return self

    def subscription(self, topic_filter: str) -> str:
        """The filter as subscribed: inside the share group, if one is set."""
        if self.share_group is None:
            return topic_filter
        return f"$share/{self.share_group}/{topic_filter}"


# Most tenants one template may list: one subscription each.
MAX_TEMPLATE_TENANTS = 1000


def _check_tenant_level(key: str, name: str) -> None:
    """A tenant named in config must be one topic level, as topics carry it."""
    if not is_topic_level(name):
        raise ValueError(
            f"{key}: {name!r} is not a topic level (empty, or holds '/', '+', '#' "
            "or a control character)"
        )


_NAMED_LEVELS = ("{tenant}", "{device_id}", "{_}")


class TopicTemplate(_Model):
    template: str = DEFAULT_TEMPLATE
    # Fixed tenant for a tree without a {tenant} level, e.g. site/{device_id}/events.
    tenant: str | None = None
    # Only these tenants, for a template with a {tenant} level: one subscription
    # per tenant (tenants/acme/devices/+/events, ...) instead of a '+'. This is
    # how an instance takes its shard of the tenants (README, "Scaling out").
    tenants: list[str] = Field(default_factory=list, max_length=MAX_TEMPLATE_TENANTS)

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        if value is not None:
            _check_tenant_level("tenant", value)
        return value

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_tenant_level("tenants", name)
        if len(set(value)) != len(value):
            dupes = sorted({name for name in value if value.count(name) > 1})
            raise ValueError(f"tenants: {', '.join(map(repr, dupes))} listed twice")
        return value

    @model_validator(mode="after")
    def _check(self) -> TopicTemplate:
        levels = self.template.split("/")
        names = [lvl[1:-1] for lvl in levels if lvl.startswith("{") and lvl.endswith("}")]
        if levels[0] in ("$share", "$queue"):
            raise ValueError(
                f"template {self.template!r}: a shared subscription is not a template level; "
                "set mqtt.share_group instead"
            )
        for level in levels:
            if not level:
                raise ValueError(f"template {self.template!r} has an empty level")
            named = level in _NAMED_LEVELS
            if not named and any(ch in level for ch in "+#{}"):
                raise ValueError(
                    f"template {self.template!r}: level {level!r} must be a fixed word, "
                    "{tenant}, {device_id} or {_} (any value, ignored)"
                )
        if names.count("device_id") != 1:
            raise ValueError(f"template {self.template!r} needs exactly one {{device_id}} level")
        has_tenant = names.count("tenant")
        if has_tenant > 1:
            raise ValueError(f"template {self.template!r} has more than one {{tenant}} level")
        if has_tenant == 0 and not self.tenant:
            raise ValueError(
                f"template {self.template!r} has no {{tenant}} level: set a fixed tenant"
            )
        if has_tenant == 1 and self.tenant:
            raise ValueError(
                f"template {self.template!r} has a {{tenant}} level and a fixed tenant"
            )
        if has_tenant == 0 and self.tenants:
            raise ValueError(
                f"template {self.template!r}: tenants lists the tenants a {{tenant}} level "
                "may take, and this template has none (its tenant is fixed)"
            )
        return self

    def pattern(self) -> tuple[str, ...]:
        """Its levels as one filter's: named levels as '+'."""
        return tuple("+" if part in _NAMED_LEVELS else part for part in self.template.split("/"))

    def filters(self) -> list[str]:
        """Its topic filters: the pattern, or one per listed tenant."""
        parts = self.pattern()
        if not self.tenants:
            return ["/".join(parts)]
        at = self.template.split("/").index("{tenant}")
        return ["/".join([*parts[:at], name, *parts[at + 1 :]]) for name in self.tenants]


DEFAULT_MIN_IN_FLIGHT = 64

Consistency = Literal["ONE", "LOCAL_ONE", "QUORUM", "LOCAL_QUORUM", "EACH_QUORUM", "ALL"]


class CassandraConfig(_Model):
    contact_points: Annotated[list[str], BeforeValidator(_split_list)] = Field(
        default_factory=lambda: ["127.0.0.1"], min_length=1
    )
    port: Port = 9042
    keyspace: str = Field(default="gateway", pattern=_IDENTIFIER)
    local_dc: Annotated[str, Field(min_length=1)] | None = None
    # Used by `gateway schema apply` when it creates the keyspace.
    replication: Literal["SimpleStrategy", "NetworkTopologyStrategy"] = "SimpleStrategy"
    replication_factor: int = Field(default=1, ge=1, le=10)
    # Replicas per datacentre, by its name as Cassandra spells it (names are
    # case-sensitive; from the environment set the whole table:
    # GATEWAY_CASSANDRA__DATACENTERS='{DC1 = 3}').
    datacenters: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")],
        # A number inside the table is not a field of its own: refused here.
        Annotated[int, BeforeValidator(_not_bool), Field(ge=1, le=10)],
    ] = Field(default_factory=dict)
    consistency: Consistency = "LOCAL_QUORUM"
    connect_timeout: Duration = 10.0
    request_timeout: Duration = 10.0
    # Requests to Cassandra in flight at once (gateway/store/limit.py): the
    # limit adapts to the measured latency, from its floor at start-up, between
    # min_in_flight and this hard cap (a 100 ms link at 4,000 msg/s needs about
    # 1,400; memory stays bounded by the queue and mqtt.receive_maximum).
    # The floor (unset: 64 with acsylla, the old fixed cap; 256 with the Python
    # driver, whose requests queue in the client under load; or max_in_flight
    # if lower): on a busy host the measured latency includes the gateway's own
    # scheduling delays, and a lower floor cost throughput there
    # (bench/results/slow_link.md, slow_link_python.md). adaptive_in_flight = false pins the limit
    # at max_in_flight.
    max_in_flight: int = Field(default=2048, ge=1, le=4096)
    min_in_flight: int | None = Field(default=None, ge=1, le=4096)
    adaptive_in_flight: bool = True
    # Protocol compression of request and response bodies: "lz4" (python
    # driver only, needs the lz4 package) or "none".
    compression: Literal["none", "lz4"] = "none"
    # A write failing with timeouts/unavailable is retried with capped backoff.
    # After this long without success the gateway stops with an error (with
    # the spool on, it closes and spools until Cassandra answers); nothing is
    # lost because unwritten messages were never acknowledged to the broker
    # (or are in the spool).
    give_up_after: Duration = 600.0
    # acsylla only: after its requests have found no host for this long, a new
    # driver session replaces the one in use, at most one try per period. The
    # C++ driver gives a host's connections up for good after one
    # authentication, protocol-version or keyspace error while reconnecting
    # (a password-protected node restarting answers "bad credentials" until
    # it can read system_auth), and then answers "no hosts available" until
    # the process ends. Its own reconnection waits at most 10 s
    # (write_session._create_cluster), so past that it is not coming back.
    renew_after: Duration = 15.0
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)
    # Driver the gateway writes through (gateway/store/write_session.py): "auto" is
    # acsylla (the C++ driver, about 4x less CPU per row) when it is installed
    # and TLS is off, else the Python driver. The CLI always reads with the latter.
    driver: Literal["auto", "acsylla", "python"] = "auto"

    def in_flight_floor(self, driver_floor: int = DEFAULT_MIN_IN_FLIGHT) -> int:
        """min_in_flight, or the driver's floor (64 for acsylla, 256 for the
        Python driver: WriteSession.in_flight_floor), or max_in_flight if lower."""
        if self.min_in_flight is not None:
            return self.min_in_flight
        return min(driver_floor, self.max_in_flight)

    @model_validator(mode="after")
    def _check(self) -> CassandraConfig:
        if self.replication == "NetworkTopologyStrategy" and not self.datacenters:
            raise ValueError(
                "cassandra.datacenters is required with cassandra.replication = "
                '"NetworkTopologyStrategy", e.g. {dc1 = 3}'
            )
        if self.replication == "SimpleStrategy" and self.datacenters:
            raise ValueError(
                "cassandra.datacenters is used only with cassandra.replication = "
                '"NetworkTopologyStrategy"; SimpleStrategy takes replication_factor'
            )
        if self.datacenters and self.local_dc is not None and self.local_dc not in self.datacenters:
            raise ValueError(
                f"cassandra.local_dc {self.local_dc!r} is not one of cassandra.datacenters "
                f"({', '.join(sorted(self.datacenters))}); names are case-sensitive"
            )
        if len(self.datacenters) > 1 and self.local_dc is None:
            raise ValueError(
                "cassandra.local_dc is required when cassandra.datacenters names more than "
                f"one ({', '.join(sorted(self.datacenters))}): the datacentre of this "
                "gateway's nodes, so that its requests, and LOCAL_QUORUM, stay in it"
            )
        _load_password(self, "cassandra")
        if self.min_in_flight is not None and self.min_in_flight > self.max_in_flight:
            raise ValueError(
                f"cassandra.min_in_flight ({self.min_in_flight}) is above "
                f"cassandra.max_in_flight ({self.max_in_flight})"
            )
        if self.compression != "none" and self.driver == "acsylla":
            raise ValueError(
                f'cassandra.compression = "{self.compression}" needs driver = "python": '
                "acsylla (the C++ driver) has no protocol compression"
            )
        if self.driver == "acsylla" and self.tls.enabled and self.tls.ca_file is None:
            raise ValueError(
                'cassandra.driver = "acsylla" with TLS needs cassandra.tls.ca_file '
                '(the C++ driver has no system CA store), or set driver = "python"'
            )
        return self


class PipelineConfig(_Model):
    # Bounded queue between decode and the Cassandra writer. When it is full
    # the receiver stops reading; the broker then stops sending once
    # mqtt.receive_maximum messages are unacknowledged. It also bounds the
    # devices waiting for their newest write to be read ahead (store/latest.py).
    queue_size: int = Field(default=2000, ge=1, le=1_000_000)
    # The writer takes up to this many messages at a time (a chunk) and groups
    # their rows by partition. Of several events of one device in a chunk only
    # the newest writes the latest tables, so a backlog (a queue that stays
    # full) costs fewer writes in larger chunks: draining 60,000 events from
    # 1,000 devices, 2,000 (the queue's size) sent a quarter fewer requests
    # than 500 did, at about 0.8x the gateway's CPU and 0.6x Cassandra's per
    # event (bench/PERFORMANCE.md). A live stream's chunks stay small.
    batch_max_events: int = Field(default=2000, ge=1, le=100_000)
    # Wait this long for a fuller chunk while writes are in flight, or while
    # the last second's messages came at least one per this long; 0 disables.
    linger: Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=1)] = 0.005
    # Rows per unlogged batch (only rows of one partition are batched).
    batch_max_rows: int = Field(default=32, ge=1, le=1000)
    status_interval: Duration = 5.0
    # Every event deletes the device from each other state its tenant knows, so
    # the number of states per tenant is bounded; past it, events with a new
    # state are rejected with reason "too_many_states".
    max_states_per_tenant: int = Field(default=32, ge=2, le=1024)
    # Re-read the states each tenant knows, and its state partitions'
    # generations, this often (other gateway instances may add states or
    # rotate partitions).
    states_refresh: Duration = 10.0
    # State generations (gateway/store/rotate.py): a state partition is copied
    # into a fresh generation, and the old one dropped, once this many devices
    # have been deleted from it (and at least half as many as it holds), so
    # its tombstones never reach Cassandra's tombstone_warn_threshold (1000
    # per read). 0 turns rotation off.
    rotate_after_deletes: int = Field(default=500, ge=0, le=50_000)
    # How long a rotation waits between announcing the next generation and
    # copying into it: every gateway instance must have re-read the
    # generations (states_refresh) and dual-write by then. None: states_refresh
    # plus 2 s. A single gateway instance may use 0.
    rotation_wait: Wait | None = None
    # How many (device, time bucket) raw-telemetry partitions are remembered as
    # already indexed; past it the oldest are forgotten and indexed again.
    partition_cache_size: int = Field(default=100_000, ge=100, le=10_000_000)
    # Devices whose newest state this process remembers (LRU); a forgotten
    # device costs one read when an old event for it arrives (see state.py).
    device_cache_size: int = Field(default=100_000, ge=100, le=10_000_000)
    # Bad messages are logged at most this many per second (all are counted).
    reject_log_per_s: float = Field(default=5.0, ge=0)
    # On SIGTERM: stop reading, write and acknowledge what was read, within this.
    shutdown_deadline: Duration = 10.0


class LimitsConfig(_Model):
    max_payload_bytes: Bytes = Field(default=64 * 1024, ge=64, le=16 * 1024 * 1024)
    max_metrics: int = Field(default=64, ge=0, le=10_000)
    max_tags: int = Field(default=32, ge=0, le=10_000)
    max_key_length: int = Field(default=64, ge=1, le=1024)
    max_state_length: int = Field(default=64, ge=1, le=1024)
    max_text_length: int = Field(default=1024, ge=1, le=65536)
    max_topic_level_length: int = Field(default=128, ge=1, le=1024)
    # Devices with a fast clock: timestamps further ahead than this are rejected.
    max_future_skew: Duration = 300.0
    # Old timestamps are legitimate (backfill); only implausible ones are rejected.
    min_timestamp: datetime = datetime(2000, 1, 1, tzinfo=UTC)
    # Rejected payloads are stored truncated to this many bytes.
    rejected_payload_bytes: Bytes = Field(default=2048, ge=0, le=1024 * 1024)

    @field_validator("min_timestamp")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        return value if value.tzinfo else value.replace(tzinfo=UTC)


class TenantConfig(_Model):
    # Solution 5's artificial buckets per state partition; 1 is Solution 3.
    # Choose before data arrives: the first gateway that writes the tenant
    # records it in Cassandra, and every reader and writer uses that number.
    state_buckets: int = Field(default=1, ge=1, le=1024)
    # Raw telemetry partition size: one partition per device and time bucket.
    telemetry_bucket: Duration = 3600.0
    # Adaptive bucket size by device rate (the reference's classes): above
    # fast_above msg/s a device gets fast_bucket, below slow_below slow_bucket,
    # otherwise telemetry_bucket. Readers find every size via telemetry_partitions.
    adaptive_buckets: bool = True
    fast_bucket: Duration = 900.0
    slow_bucket: Duration = 21600.0
    fast_above: float = Field(default=1.0, gt=0)
    slow_below: float = Field(default=1 / 60, gt=0)
    # Cassandra's TTL is whole seconds, at most 20 years.
    ttl: Annotated[LongDuration, Field(ge=60)] = 30 * 86400.0
    # Roll-up rows (gateway/store/rollups.py) outlive the raw rows they summarise.
    # At least 2 h: an hour is merged from its minutes, and under an hour's
    # worth of them the merge of a live hour lost the expired ones.
    rollup_ttl_1m: Annotated[LongDuration, Field(ge=7200)] = 90 * 86400.0
    rollup_ttl_1h: Annotated[LongDuration, Field(ge=3600)] = 2 * 365 * 86400.0

    @field_validator("telemetry_bucket", "fast_bucket", "slow_bucket")
    @classmethod
    def _whole_seconds(cls, value: float) -> float:
        if value < 60 or value > MAX_BUCKET_SECONDS or value != int(value):
            raise ValueError("a bucket must be a whole number of seconds between 1m and 7d")
        return value

    @model_validator(mode="after")
    def _classes(self) -> TenantConfig:
        if self.slow_below >= self.fast_above:
            raise ValueError("slow_below must be lower than fast_above")
        if self.adaptive_buckets and self.fast_bucket > self.slow_bucket:
            raise ValueError(
                f"fast_bucket ({self.fast_bucket:.0f} s) is above slow_bucket "
                f"({self.slow_bucket:.0f} s): the faster a device, the smaller its partitions"
            )
        # The partition index outlives its rows by one bucket (telemetry.py),
        # and Cassandra refuses a TTL over 20 years (630,720,000 s).
        longest = max(self.telemetry_bucket, self.fast_bucket, self.slow_bucket)
        if self.ttl + longest > MAX_TTL_SECONDS:
            raise ValueError(
                f"ttl plus the largest bucket ({longest:.0f} s) must stay within Cassandra's "
                f"{MAX_TTL_SECONDS} s (20 years): lower ttl"
            )
        return self


class HotPartitionConfig(_Model):
    # Writes per partition are counted over each window; a partition above the
    # threshold is logged once per window and counted.
    window: Duration = 10.0
    threshold: int = Field(default=1000, ge=1)
    # A device whose raw-telemetry partition stays hot is split over up to
    # this many sub-partitions (shards), doubling per hot window, halving per
    # cool one. Readers find the shards through telemetry_partitions.
    max_shards: int = Field(default=16, ge=1, le=256)
    # Partitions counted per window; writes to partitions beyond it are not
    # tracked (counted in gateway_hot_partitions_untracked_writes_total).
    max_tracked: int = Field(default=100_000, ge=100, le=10_000_000)


class RollupsConfig(_Model):
    # 1-minute and 1-hour aggregates per device and numeric metric
    # (gateway/store/rollups.py). Off: no marks written, no worker.
    enabled: bool = True
    # A minute's dirty marks are read this long after the minute ends: time for
    # the raw writes sent with them to land (and for other instances' clocks).
    grace: Annotated[float, BeforeValidator(parse_duration), Field(ge=1, le=3600)] = 30.0
    # Run the worker in this process. With several gateway instances, those
    # with it on take turns: one holds a lease in Cassandra and works, the
    # others stand by and take over once it stops (gateway/store/lease.py).
    # Marks are written either way.
    worker: bool = True
    # How long the worker's lease lasts without a renewal (renewed every
    # third of it; a standby tries every third of it): a standby takes over
    # within 4/3 of it once the worker's instance died or lost its link to
    # Cassandra, and within a third of it after a stop.
    lease: Annotated[float, BeforeValidator(parse_duration), Field(ge=3, le=3600)] = 30.0
    # How often the worker looks for minutes that came due.
    interval: Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=600)] = 5.0
    # A minute that comes due is recomputed over this long, its groups of 100
    # windows evenly spaced, not in one burst: the burst's reads slowed the
    # writes beside it (p99 receipt to write sent 134 ms against 27 ms with
    # roll-ups off at 3,000 msg/s; bench/PERFORMANCE.md, "The load generator"). A minute
    # found late (a restart) gets what is left before the next one comes due,
    # if that is less; once the next is due too (an outage), full speed. While
    # the write path is behind (a backlog drains), every minute gets this
    # long however late (store/rollups.py). 50 s measured no better than 20.
    # "0s" turns the spreading off.
    spread: Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=50)] = 20.0
    # (device, window, minute) marks this process remembers as written (LRU);
    # past it one is forgotten, which costs one more idempotent mark write.
    mark_cache_size: int = Field(default=100_000, ge=100, le=10_000_000)
    # Batches of roll-up rows the worker writes at once (each up to 10
    # windows); its reads go 100 devices to a request, a group of 100
    # windows at a time (gateway/store/rollups.py).
    concurrency: int = Field(default=16, ge=1, le=1024)


class MetadataConfig(_Model):
    # Metric names, tag keys and values, and devices by tag value
    # (gateway/store/metadata.py), maintained on ingest.
    enabled: bool = True
    # Entries this process remembers as stored (LRU); one not in it costs one
    # read of its row when it is seen (after a restart too).
    cache_size: int = Field(default=100_000, ge=100, le=10_000_000)
    # Entries one tenant may have, counted in Cassandra (meta_entry_counts):
    # across restarts and shared by every instance. Beyond, new entries are
    # not written and are counted (gateway_metadata_capped_total).
    max_per_tenant: int = Field(default=10_000, ge=1, le=10_000_000)


class SpoolConfig(_Model):
    # Write-ahead spool on local disk (gateway/ingest/spool.py): messages are
    # acknowledged once spooled, so an edge host keeps taking them while
    # Cassandra is away. Off by default.
    enabled: bool = False
    path: FilePath = Path("gateway-spool.sqlite")
    max_records: int = Field(default=1_000_000, ge=1, le=1_000_000_000)
    max_bytes: Bytes = Field(default=1024**3, ge=1024, le=1024**4)
    # How long a message may wait for others to share its commit (and its
    # acknowledgement): every commit rewrites a few 4 KiB pages, so one message
    # a commit wrote 14 KB per message (an SD card's wear; README, "Running on
    # an edge host"). 0 commits each at once. 256, or mqtt.receive_maximum,
    # waiting commit at once: behind a broker that sends fewer unacknowledged
    # (an in-flight limit of its own), set mqtt.receive_maximum to that limit.
    commit_delay: Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=1)] = 0.1


class ApiConfig(_Model):
    # The HTTP port of `gateway run`: /metrics (Prometheus), /healthz, /noisy,
    # the read API and the page; enabled = false turns them all off.
    # `gateway serve` ignores it: serving is all it does.
    enabled: bool = True
    host: Host = "127.0.0.1"
    port: int = Field(default=9108, ge=0, le=65535)  # 0: any free port
    # Read tokens of the HTTP API (gateway/web/tokens.py), written by `gateway
    # token add/revoke`: ids, tenants and sha256 hashes, never the tokens.
    # Relative paths are from the working directory, as spool.path; give the
    # server and the `gateway token` commands the same absolute path.
    tokens_file: FilePath = Path("gateway-tokens.jsonl")


# -- [sampling] (gateway/ingest/sampling.py) ---------------------------------

# Messages per second.
Rate = Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)]
# Seconds; "30s", "1m", "250ms" are accepted as in the rest of the config.
Seconds = Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=86400)]
Threshold = Annotated[float, Field(allow_inf_nan=False)]


class ImportantRule(_Model):
    """Events whose ``metric`` is above ``above`` or below ``below`` are never sampled out.

    So is the first event in which the metric is back within bounds, so that
    the return to normal is recorded too.
    """

    metric: str = Field(min_length=1, max_length=1024)
    above: Threshold | None = None
    below: Threshold | None = None

    @model_validator(mode="after")
    def _check(self) -> ImportantRule:
        if self.above is None and self.below is None:
            raise ValueError(f"important rule for metric {self.metric!r} needs above or below")
        if self.above is not None and self.below is not None and self.below >= self.above:
            raise ValueError(
                f"important rule for metric {self.metric!r}: below ({self.below}) must be "
                f"less than above ({self.above}), or every value would be important"
            )
        return self


class Override(_Model):
    """Sampling settings for devices whose topic matches an MQTT filter (first match wins)."""

    topic_filter: str = Field(min_length=1, max_length=1024)
    noisy_above: Rate | None = None
    noisy_for: Seconds | None = None
    target_rate: Rate | None = None

    @field_validator("topic_filter")
    @classmethod
    def _valid_filter(cls, value: str) -> str:
        filter_levels(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> Override:
        if self.noisy_above is None and self.noisy_for is None and self.target_rate is None:
            raise ValueError(
                f"override for {self.topic_filter!r} sets none of noisy_above, noisy_for "
                "and target_rate"
            )
        return self


class TenantSampling(_Model):
    """One tenant's settings: what its section leaves unset comes from
    [sampling.tenants.default] (Config._tenants_inherit), then from the
    global [sampling] values.

    ``max_rate``/``burst`` and ``max_devices_per_tenant`` are off unless set;
    0 sets them off for one tenant when the default section sets them.
    """

    noisy_above: Rate | None = None
    noisy_for: Seconds | None = None
    target_rate: Rate | None = None
    max_rate: Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)] | None = None
    # Tokens the bucket holds; defaults to one second of max_rate (at least 1).
    burst: Annotated[float, Field(ge=1, le=1_000_000_000, allow_inf_nan=False)] | None = None
    max_devices_per_tenant: Annotated[int, Field(ge=0, le=10_000_000)] | None = None

    @field_validator("max_rate", "max_devices_per_tenant")
    @classmethod
    def _zero_is_none(cls, value: float | None) -> float | None:
        return None if value == 0 else value


class SamplingConfig(_Model):
    """The [sampling] section. Rates are messages per second, durations seconds."""

    enabled: bool = True
    # Half-life of the rate estimate: how fast it follows a change of rate.
    half_life: Annotated[Seconds, Field(gt=0, le=3600)] = 5.0
    noisy_above: Rate = 5.0
    # How long the estimate must stay above noisy_above before the device is
    # noisy (0: at once). The estimate fluctuates with the spacing of the
    # messages: devices whose messages arrive at random, at a steady 4 msg/s,
    # were all noisy within 10 minutes at 0 and 3% of them at "10s"; a device
    # that really is noisy is stored whole that much longer (README, Known
    # limits; bench/noisy_threshold.py).
    noisy_for: Seconds = 10.0
    target_rate: Rate = 1.0
    quiet_below: Rate = 2.0
    quiet_for: Seconds = 30.0
    # 0 (the default): every event that is its device's newest updates the
    # latest tables (several in one chunk still coalesce to the newest). Above
    # 0, a noisy device's unchanged-state updates go out at most this often:
    # fewer writes, but the device's newest ts/value may never reach the
    # latest tables, and after a restart a late event can show an older state
    # until the device's next event (README, known limits).
    latest_interval: Seconds = 0.0
    # Events whose timestamp is this much older than their arrival are
    # back-fill (a device catching up, or the broker replaying a backlog after
    # an outage): they bypass sampling and the tenant rate and are all kept
    # (within the device quota), so a burst of old events never makes a device
    # look noisy. The ingest stage applies it.
    # At least 1 s: at 0 every event with a timestamp (all but the newest
    # millisecond) was back-fill, so nothing was sampled nor held to max_rate.
    backfill_after: Annotated[Seconds, Field(ge=1)] = 30.0
    max_devices: int = Field(default=100_000, ge=1, le=10_000_000)
    # Tenants without a section of their own that are tracked at once (LRU).
    max_tenants: int = Field(default=10_000, ge=1, le=10_000_000)
    important: list[ImportantRule] = Field(default_factory=list, max_length=256)
    overrides: list[Override] = Field(default_factory=list, max_length=1024)
    # [sampling.tenants.default] applies to every tenant; [sampling.tenants.NAME]
    # changes what it sets for that one (0 for max_rate or max_devices_per_tenant: none).
    tenants: dict[str, TenantSampling] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        q = self.quiet_below
        if q >= self.noisy_above:
            raise ValueError(
                f"quiet_below ({q}) must be below noisy_above ({self.noisy_above}): "
                "the gap between them is the hysteresis"
            )
        # A single message moves the estimate by ln2/half_life; centred, half of
        # that. If that alone reached quiet_below, a device could never go quiet.
        step = math.log(2) / self.half_life / 2
        if step >= q:
            raise ValueError(
                f"half_life ({self.half_life} s) is too short for quiet_below ({q}): one "
                f"message alone would count as {step:.3g} msg/s; use a half_life of at "
                f"least {math.log(2) / (2 * q):.3g} s"
            )
        for name, section in self.tenants.items():
            if section.noisy_above is not None and section.noisy_above <= q:
                raise ValueError(
                    f"tenants.{name}.noisy_above ({section.noisy_above}) must be above "
                    f"quiet_below ({q})"
                )
            if section.burst is not None and "max_rate" not in section.model_fields_set:
                # A max_rate of 0 (off for this tenant) leaves an inherited burst unused.
                raise ValueError(f"tenants.{name}.burst is set but max_rate is not")
        for i, override in enumerate(self.overrides):
            if override.noisy_above is not None and override.noisy_above <= q:
                raise ValueError(
                    f"overrides[{i}].noisy_above ({override.noisy_above}) must be above "
                    f"quiet_below ({q})"
                )
        return self


class Config(_Model):
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    cassandra: CassandraConfig = Field(default_factory=CassandraConfig)
    topics: list[TopicTemplate] = Field(default_factory=lambda: [TopicTemplate()], min_length=1)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    hot_partitions: HotPartitionConfig = Field(default_factory=HotPartitionConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollups: RollupsConfig = Field(default_factory=RollupsConfig)
    metadata: MetadataConfig = Field(default_factory=MetadataConfig)
    # [tenants.default] applies to every tenant; [tenants.NAME] changes what
    # it sets for that tenant (so does [sampling.tenants.NAME] over
    # [sampling.tenants.default]).
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _tenants_inherit(cls, data: Any) -> Any:
        """A tenant's section takes what it does not set from the default
        section. It used to replace it: ``[sampling.tenants.acme] noisy_for =
        "0s"`` took acme out of ``[sampling.tenants.default]``'s device quota."""
        if not isinstance(data, Mapping):
            return data
        data = {**data, "tenants": _inherit(data.get("tenants"))}
        sampling = data.get("sampling")
        if isinstance(sampling, Mapping):
            data["sampling"] = {**sampling, "tenants": _inherit(sampling.get("tenants"))}
        return data

    @model_validator(mode="after")
    def _queue_holds_receive_maximum(self) -> Config:
        if self.pipeline.queue_size < self.mqtt.receive_maximum:
            raise ValueError(
                f"pipeline.queue_size ({self.pipeline.queue_size}) must be at least "
                f"mqtt.receive_maximum ({self.mqtt.receive_maximum}): the broker may send "
                "that many messages before the gateway acknowledges any"
            )
        if self.mqtt.share_group is not None:
            # Each member of a share group gets only part of a device's
            # messages, so it takes a change back for no change (one member
            # gets on, another off, the first on again): the sampler would
            # sample it out, and a tenant's rate limit drop it.
            if self.sampling.enabled:
                raise ValueError(
                    "mqtt.share_group needs sampling.enabled = false: a member sees only part "
                    "of a device's messages, so it cannot tell a state change (on, off, on "
                    "looked like no change to the member that got both ons) and sampled it "
                    "out; in a share group noisy devices are stored whole"
                )
            limited = sorted(n for n, t in self.sampling.tenants.items() if t.max_rate)
            if limited:
                raise ValueError(
                    f"mqtt.share_group cannot go with a tenant's max_rate (sampling.tenants."
                    f"{limited[0]}.max_rate): a member sees only part of a device's messages, "
                    "so it cannot tell a state change, and the rate limit would drop one"
                )
        _no_partial_overlap(self.topics)
        _overrides_match_topics(self.sampling.overrides, self.topics)
        longest = self.limits.max_topic_level_length
        for i, template in enumerate(self.topics):
            fixed = [template.tenant] if template.tenant is not None else []
            for name in [*template.tenants, *fixed]:
                if len(name) > longest:
                    key, why = (
                        ("tenant", "a tenant name must fit it")
                        if name in fixed
                        else ("tenants", "no topic would match it")
                    )
                    raise ValueError(
                        f"topics.{i}.{key}: {name[:32]!r}... is longer than "
                        f"limits.max_topic_level_length ({longest}): {why}"
                    )
        return self

    def tenant(self, name: str) -> TenantConfig:
        found = self.tenants.get(name) or self.tenants.get("default")
        return found if found is not None else _DEFAULT_TENANT


_DEFAULT_TENANT = TenantConfig()


def _inherit(sections: Any) -> Any:
    """Each named section (a table, as read from TOML and the environment)
    over the ``default`` one."""
    if not isinstance(sections, Mapping):
        return {} if sections is None else sections
    default = sections.get("default")
    if not isinstance(default, Mapping):
        return sections
    return {
        name: {**default, **section}
        if name != "default" and isinstance(section, Mapping)
        else section
        for name, section in sections.items()
    }


def _no_partial_overlap(topics: list[TopicTemplate]) -> None:
    """Two subscriptions that share topics make the broker (Mosquitto) deliver
    such a message once for each. One that covers the other is fine: only
    the wider one is subscribed (ingest/topics.py); overlapping otherwise,
    neither can go, so the config is refused, naming a topic both match."""
    for i, j in itertools.combinations(range(len(topics)), 2):
        if overlap(topics[i].pattern(), topics[j].pattern()) is None:
            continue  # no topic fits both templates (the usual case: one check)
        for a, b in itertools.product(_levels(topics[i]), _levels(topics[j])):
            if covers(a, b) or covers(b, a) or (topic := overlap(a, b)) is None:
                continue
            raise ValueError(
                f"topics.{j} ({'/'.join(b)}) and topics.{i} ({'/'.join(a)}) both match "
                f"topics such as {topic!r}: the broker would deliver each such message "
                "twice. Make one template cover the other, or tell them apart by a "
                "fixed word"
            )


def _overrides_match_topics(overrides: list[Override], topics: list[TopicTemplate]) -> None:
    """An override whose filter no template's topic can match never applies:
    a typo in it (``tenant/`` for ``tenants/``) left the device unthrottled
    and said nothing. Against each template's pattern, its tenant level any
    tenant: a shard's ``tenants`` list (README, "Scaling out") must not refuse
    a config shared with the other shards, whose tenants' old sessions may
    still deliver here."""
    subscribed = [template.pattern() for template in topics]
    for i, override in enumerate(overrides):
        levels = filter_levels(override.topic_filter)
        if not any(meets(levels, topic) for topic in subscribed):
            raise ValueError(
                f"sampling.overrides[{i}].topic_filter {override.topic_filter!r} matches no "
                f"topic the gateway subscribes to ({', '.join(t.template for t in topics)}), "
                "so it would never apply"
            )


def _levels(template: TopicTemplate) -> list[tuple[str, ...]]:
    return [tuple(f.split("/")) for f in template.filters()]


def _env_overlay(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    tree: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in (ENV_CONFIG_PATH, ENV_LOG_LEVEL, ENV_BUILD):
            continue
        path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__"))
        if not all(path):
            raise ConfigError(f"{name}: malformed variable name (use GATEWAY_SECTION__KEY)")
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {'.'.join(path)} conflicts with another variable")
            node = child
        text = _takes_text(path)
        if text and len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            # Read as TOML until now: a quoted value lost its quotes.
            log.warning(
                "%s is in quotes, and they are part of its value (a text key takes its "
                "variable as written)",
                name,
            )
        node[path[-1]] = raw if text else _env_value(raw)
        origin[path] = name
    return tree, origin


_BOUNDS = {
    "less_than_equal": "at most",
    "less_than": "under",
    "greater_than_equal": "at least",
    "greater_than": "over",
}


def _is_duration(text: str) -> bool:
    """A duration with its unit ("40d"): a bare number may be a port or a count."""
    if not text.strip()[-1:].isalpha():
        return False
    try:
        parse_duration(text)
    except ValueError:
        return False
    return True


_TEXT_TYPES = (str, SecretStr, Path)


def _takes_text(path: tuple[str, ...]) -> bool:
    """Whether the key at ``path`` holds text (a name, password, path): its
    variable's value is then taken as written. Read as TOML, 0x1F became
    '31', 1e3 '1000.0', a quoted value lost its quotes, and "123 #x" was cut
    at the '#': a password that failed with nothing to say why."""
    model, named = _table_at(path[:-1])
    field = model.model_fields.get(path[-1]) if model is not None and not named else None
    if field is None or _model_of(field.annotation) != (None, False):
        return False
    annotation = field.annotation
    union = get_origin(annotation) in (Union, UnionType)
    choices = [a for a in (get_args(annotation) if union else (annotation,)) if a is not NoneType]
    return bool(choices) and all(_is_text(a) for a in choices)


def _is_text(annotation: Any) -> bool:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return isinstance(annotation, type) and issubclass(annotation, _TEXT_TYPES)


class _NotToml(str):
    """An environment value that starts like a TOML list or table but does not
    parse: kept as the string it is (a password may start with '['), with the
    parser's complaint for the message if a list or table was wanted there."""

    problem = ""


def _env_value(raw: str) -> Any:
    # TOML syntax for a value ("8", "true", "[1, 2]", "{dc1 = 3}"); else a string.
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if raw.lstrip()[:1] in ("[", "{"):
            value = _NotToml(raw)
            value.problem = str(exc)
            return value
        return raw


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(exc: ValidationError, origin: Mapping[tuple[str, ...], str], file: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        key = ".".join(loc) or "(top level)"
        source = next((origin[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in origin), None)
        message = err["msg"].removeprefix("Value error, ")
        if source is None and loc and (keys := _keys_named(loc, message)):
            # A whole-section check that names its keys: what set those (a
            # variable that set another key of the section is not to blame).
            source = _sources_of(keys, origin, file)
        elif source is None and loc:
            # A whole-section check: name the variables that fed that section.
            under = sorted(name for path, name in origin.items() if path[: len(loc)] == loc)
            source = ", ".join(under) if under else file
        elif source is None:
            source = _sources_named(message, origin, file)
        given = err.get("input")
        bound = _BOUNDS.get(err["type"])
        limit = next(iter(err.get("ctx", {}).values()), 0)  # the bound's number, if one
        if bound is not None and isinstance(given, str) and _is_duration(given):
            # "less than or equal to 2678400" for "40d": say it in the units given.
            message = f"must be {bound} {duration_text(float(limit))} (got {given.strip()!r})"
        elif bound is not None and loc[-1:] and loc[-1].endswith("_bytes"):
            message = f"must be {bound} {size_text(int(limit))}, {limit} bytes (got {given})"
        elif isinstance(given, _NotToml):
            # "Input should be a valid list" hid a missing bracket or quote.
            message += f" (the value is not valid TOML: {given.problem})"
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _nearest_key(loc, source)
        lines.append(f"{key} (from {source}): {message}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


# A dotted key in a message ("mqtt.receive_maximum", "topics.1",
# "overrides[0].noisy_above"), not part of a topic ("a/mqtt.x").
_KEY_IN_MESSAGE = re.compile(r"(?<![\w./'-])([a-z_]+(?:(?:\.[\w-]+)|\[\d+\])+)")


def _keys_named(loc: tuple[str, ...], message: str) -> list[tuple[str, ...]]:
    """The keys a section's own check names in its message: dotted
    (``cassandra.min_in_flight``), or the section's keys by their bare names
    (``slow_below must be lower than fast_above``)."""
    keys = _dotted_keys(message)
    model, named = _table_at(loc)
    if model is not None and not named:
        keys += [(*loc, f) for f in model.model_fields if re.search(rf"\b{f}\b", message)]
    return keys


def _dotted_keys(message: str) -> list[tuple[str, ...]]:
    keys = [
        tuple(re.sub(r"\[(\d+)\]", r".\1", found).split("."))
        for found in _KEY_IN_MESSAGE.findall(message)
    ]
    return [key for key in keys if key[0] in Config.model_fields]


def _sources_named(message: str, origin: Mapping[tuple[str, ...], str], file: str) -> str:
    """For a check on the whole config (no one key to blame): the variables
    that set the keys the message names, and the file (or "defaults") if it
    names a key no variable set. If it names none: every variable, and the file."""
    keys = _dotted_keys(message)
    if not keys:
        return ", ".join([*sorted(origin.values()), file])
    return _sources_of(keys, origin, file)


def _sources_of(
    keys: list[tuple[str, ...]], origin: Mapping[tuple[str, ...], str], file: str
) -> str:
    """The variables that set ``keys`` (or a table holding one), and the
    file (or "defaults") if a key was set by no variable."""
    names: set[str] = set()
    from_file = False
    for key in keys:
        # A variable for the key or a table that holds it (GATEWAY_TOPICS for
        # topics.1), or for a key inside it.
        setting = [
            name
            for path, name in origin.items()
            if key[: len(path)] == path or path[: len(key)] == key
        ]
        names.update(setting)
        from_file = from_file or not any(key[: len(p)] == p for p in origin)
    return ", ".join([*sorted(names), *([file] if from_file else [])])


def _table_at(loc: tuple[str, ...]) -> tuple[type[BaseModel] | None, bool]:
    """The model of the table at ``loc`` (None if no table is there), and
    whether it is a table of them by name, whose next part is a name."""
    model: type[BaseModel] | None = Config
    named = False  # the part after a table of tables ([tenants.acme]) is a name
    for part in loc:
        if named:
            named = False
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None, False
        model, named = _model_of(field.annotation)
    return model, named


def _nearest_key(loc: tuple[str, ...], source: str) -> str:
    """For an unknown key: the nearest key the same table has, or the two
    underscores a GATEWAY_ variable's section needs; else nothing."""
    model, named = _table_at(loc[:-1])
    if model is None or named:
        return ""
    name = loc[-1]
    if len(loc) == 1 and source.startswith(ENV_PREFIX):
        # GATEWAY_CASSANDRA_PORT: a section, one underscore, a key of it (the
        # longest section that fits: hot_partitions before hot).
        for section in sorted(Config.model_fields, key=len, reverse=True):
            key = name.removeprefix(f"{section}_")
            if key != name and key:
                return (
                    f"; {ENV_PREFIX}<SECTION>__<KEY> takes two underscores: "
                    f"{ENV_PREFIX}{section.upper()}__{key.upper()}?"
                )
    near = difflib.get_close_matches(name, list(model.model_fields), n=1, cutoff=0.75)
    if near:
        return f"; did you mean {'.'.join((*loc[:-1], near[0]))}?"
    return ""


def _is_number(annotation: Any) -> bool:
    """Whether a field holds a number (an int or float, optional or not)."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        return any(_is_number(a) for a in get_args(annotation) if a is not NoneType)
    return annotation in (int, float)


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds, and whether it is a table of them by name
    (``tenants``: a dict of models)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args: tuple[Any, ...] = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is dict and len(args) == 2:
        return _model_of(args[1])[0], True
    if getattr(annotation, "__origin__", None) is list and len(args) == 1:
        return _model_of(args[0])[0], True  # [[topics]]: the next part is an index
    return None, False


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read the file, overlay the environment, validate. Raises ConfigError."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_CONFIG_PATH):
        path = Path(env[ENV_CONFIG_PATH])
    data: dict[str, Any] = {}
    file = "defaults"
    if path is not None:
        file = str(path)
        try:
            raw = path.read_bytes()
            data = tomllib.loads(raw.decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {path} is not UTF-8 (byte 0x{raw[exc.start]:02x} on line {line}; "
                "TOML is UTF-8): save it as UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    overlay, origin = _env_overlay(env)
    try:
        return Config.model_validate(_merge(data, overlay))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origin, file)) from None
