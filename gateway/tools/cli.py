"""Command line: ``gateway init | run | serve | schema apply|migrate|print | check | devices |
device | history | rollup | meta | rejected | noisy | forget-session | simulate | token
add/list/revoke``. The only place that configures logging and reads argv.

Exit codes: 0 success (an empty list too: no device in a state, no event in
a range, which a hint on stderr explains when the tenant or state is unknown),
1 runtime failure (service unreachable, write refused, ``device`` of a device
that does not exist), 2 usage or configuration error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import importlib.metadata
import importlib.resources
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO, cast

import orjson
import uvloop

from ..config import ENV_CONFIG_PATH, ENV_LOG_LEVEL, Config, load_config
from ..errors import BrokerError, ConfigError, GatewayError, QueryError
from ..repeats import Repeats
from ..sd_notify import Notifier
from ..store import queries, quota, schema
from ..store.database import Database, connect, unanswered
from ..topic_filters import INVISIBLE
from ..units import epoch_ms
from ..web import tokens
from ..web.routes import MAX_TAG

# `gateway run` and `serve` (the app: aiohttp, both drivers, the pipeline),
# `check`, `forget-session` and `simulate` (MQTT clients) import what they
# need when they run: every other command, a typo included, then answers in
# about half the time (0.7 s against 1.5 s for `gateway token add` here).

log = logging.getLogger("gateway")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TENANT_HELP = "the tenant, as named in the topics"
# The longest name a command takes (the read API's limit for a parameter).
MAX_ARG = 512
# simulate builds its whole fleet first, about 0.75 KB a device: 1M is 750 MB
# (an unbounded --devices 1000000000 grew to 22 GB before the kernel killed it).
MAX_SIM_DEVICES = 1_000_000
# --limit of history and rejected (the API pages by 1 to 500 instead).
MAX_CLI_LIMIT = 100_000


# Python's levels as syslog priorities, for the journal.
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}


class _JournalFormatter(logging.Formatter):
    """For stderr connected to the journal: no time of our own (the journal
    stamps every line), and a ``<N>`` syslog priority prefix, which journald
    reads as the line's level."""

    def __init__(self) -> None:
        super().__init__("%(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelno, 7)}>{super().format(record)}"


def _stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to the device and inode of the stream it
    connected; it is inherited, so compare it with our own stderr."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def _driver_without_traceback(record: logging.LogRecord) -> bool:
    """cassandra-driver logs a failed connect or prepare with a traceback
    (before our own one-line error says what failed and what to do): keep its
    message and the exception's own line, not the traceback."""
    if record.exc_info and record.name.startswith("cassandra"):
        exc = record.exc_info[1]
        record.msg = f"{record.getMessage().rstrip(': ')}: {type(exc).__name__}: {exc}"
        record.args = None
        record.exc_info = record.exc_text = None
    return True


class _DriverRepeats(logging.Filter):
    """cassandra-driver's warnings (a pool that cannot reconnect, a host
    marked down), each kind once a minute, as the C++ driver's are
    (repeats.py): through an outage the read API's session said one every
    1 to 10 s, 360 an hour, beside the gateway's own line a minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._repeats = Repeats(clock=clock)
        self._lock = threading.Lock()  # the driver logs from its own threads too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not (
            record.name == "cassandra" or record.name.startswith("cassandra.")
        ):
            return True
        with self._lock:
            said = self._repeats.say(record.getMessage())
        if said is None:
            return False
        record.msg, record.args = said, None
        return True


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if _stderr_is_journal():
        handler.setFormatter(_JournalFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
            )
        )
    handler.addFilter(_driver_without_traceback)
    handler.addFilter(_DriverRepeats())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    # The driver is chatty at INFO (topology events); its warnings still show.
    logging.getLogger("cassandra").setLevel(logging.WARNING)


# `gateway COMMAND --help` ends with these, then the exit status.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "init": (
        "gateway init gateway.toml",
        "sudo gateway init --edge /etc/gateway/gateway.toml",
        "sudo gateway init --systemd /etc/systemd/system/gateway.service",
    ),
    "check": ("gateway check --config gateway.toml",),
    "devices": (
        "gateway devices --tenant demo --state on",
        "gateway devices --tenant demo --state off --json",
        "gateway devices --tenant demo --prefix lobby",
    ),
    "device": ("gateway device --tenant demo dev-000001",),
    "history": (
        "gateway history --tenant demo dev-000001 --since 10m",
        "gateway history --tenant demo dev-000001 --since 2026-11-27T08:00:00Z --until 1h --json",
    ),
    "rollup": (
        "gateway rollup --tenant demo dev-000001 --metric temperature --since 2h",
        "gateway rollup --tenant demo dev-000001 --step 1h --since 7d --json",
    ),
    "rebuild-rollups": (
        "gateway rebuild-rollups --tenant demo --since 2026-11-27T10:00:00Z --until 3h",
        "gateway rebuild-rollups --tenant demo dev-000001 dev-000002 --since 7d",
    ),
    "meta": (
        "gateway meta tags --tenant demo",
        "gateway meta values site --tenant demo",
        "gateway meta devices site=site-0 --tenant demo",
    ),
    "quota": ("gateway quota --tenant acme", "gateway quota --tenant acme --release dev-7 dev-8"),
    "rejected": (
        "gateway rejected --tenant demo --since 30m",
        "gateway rejected --tenant ''        # topics that named no tenant",
    ),
    "token": ("gateway token add --tenant acme", "gateway token list", "gateway token revoke ID"),
}
EXIT_STATUS = (
    "exit status: 0 done, 1 failed (unreachable, not found),\n"
    "             2 usage or configuration error, 130 interrupted"
)


class UsageError(ConfigError):
    """An argument that parsed but does not hold (a --since with no unit,
    --until before --since): checked after argparse, reported in its format
    (the command's usage line, then ``gateway history: error: ...``), exit 2."""


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does, shows examples and the
    exit status. It is the one whose usage a :class:`UsageError` shows."""
    kwargs.setdefault("description", kwargs.get("help"))
    examples = "".join(f"  {line}\n" for line in EXAMPLES.get(name, ()))
    epilog = (f"examples:\n{examples}\n" if examples else "") + EXIT_STATUS
    parser: argparse.ArgumentParser = sub.add_parser(
        name, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )
    parser.set_defaults(usage_parser=parser)
    return parser


def _action(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """An action of a command (``schema apply``, ``token add``): its --help
    says what it does, as a command's does."""
    kwargs.setdefault("description", kwargs.get("help"))
    parser: argparse.ArgumentParser = sub.add_parser(name, **kwargs)
    parser.set_defaults(usage_parser=parser)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("mqtt-cassandra-gateway")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    # --config and --log-level work before or after the command
    # (`gateway --config f.toml run` and `gateway run --config f.toml`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        type=_file_path,
        default=argparse.SUPPRESS,
        help="TOML config file (or GATEWAY_CONFIG)",
    )
    common.add_argument(
        "--log-level",
        type=_checked(_log_level),
        default=argparse.SUPPRESS,
        help=f"{', '.join(LOG_LEVELS)} (default INFO, or {ENV_LOG_LEVEL})",
    )
    parser = argparse.ArgumentParser(
        prog="gateway",
        description="MQTT edge-to-cloud gateway: device events from Mosquitto into Cassandra.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ini = _command(
        sub,
        "init",
        parents=[common],
        help="write a commented config (every key, its default) to start from",
    )
    ini.add_argument(
        "path",
        nargs="?",
        type=_file_path,
        help="where to write it (default $GATEWAY_CONFIG if set, else gateway.toml; "
        "--config FILE names it too; with --systemd, default gateway.service)",
    )
    ini.add_argument("--force", action="store_true", help="replace an existing file")
    profile = ini.add_mutually_exclusive_group()
    profile.add_argument(
        "--edge",
        action="store_true",
        help="the edge profile: spool on, state in /var/lib/gateway (the service's directory)",
    )
    profile.add_argument(
        "--systemd",
        action="store_true",
        help="write the systemd unit instead (the one in deploy/systemd/: it ships in the "
        "package, for a host that has only the wheel)",
    )

    _command(sub, "run", parents=[common], help="run the gateway until SIGTERM/SIGINT")
    _command(
        sub,
        "serve",
        parents=[common],
        help="serve only the read side (page, /api/v1): no MQTT, reads Cassandra",
    )

    sch = _command(sub, "schema", parents=[common], help="manage the Cassandra schema")
    sch_sub = sch.add_subparsers(dest="schema_command", required=True, metavar="ACTION")
    _action(
        sch_sub,
        "apply",
        parents=[common],
        help="create the keyspace and tables (idempotent)",
    )
    _action(sch_sub, "print", parents=[common], help="print the CQL that apply would run")
    mig = _action(
        sch_sub,
        "migrate",
        parents=[common],
        help="rebuild latest_events_by_state in the current layout (once; gateways stopped)",
    )
    mig.add_argument(
        "--force",
        action="store_true",
        help="rebuild even when the keyspace already has the current layout",
    )

    _command(
        sub,
        "check",
        parents=[common],
        help="exit non-zero if the broker or Cassandra is unreachable, the schema is missing, "
        "a read at cassandra.consistency fails (replicas down), the spool cannot take "
        "messages (unwritable, disk or spool full, or left holding messages with the spool "
        "off), or this host's clock is further off Cassandra's than limits.max_future_skew",
    )

    dev = _command(
        sub, "devices", parents=[common], help="devices currently in a state, or by id prefix"
    )
    dev.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    dev.add_argument(
        "--state",
        type=_state,
        help="a state the devices report, e.g. on (spaces at its ends dropped, as stored)",
    )
    dev.add_argument(
        "--prefix",
        type=_name,
        help="only devices whose id starts with this, whatever the case; without --state, "
        f"in any state ({queries.MAX_PAGE:,} at most; a device with no state by its exact "
        "id only, first)",
    )
    dev.add_argument("--json", action="store_true", help="print a JSON array")

    one = _command(sub, "device", parents=[common], help="a device's latest event")
    one.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    one.add_argument("device_id", type=_name)
    one.add_argument("--json", action="store_true", help="print JSON")

    his = _command(
        sub, "history", parents=[common], help="a device's raw events in a time range, newest first"
    )
    his.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    his.add_argument("device_id", type=_name)
    his.add_argument(
        "--since",
        help="RFC 3339 time (UTC without an offset) or a duration ago like 2h "
        "(ms, s, m, h, d; default 24h)",
    )
    his.add_argument(
        "--until",
        help="RFC 3339 time (UTC without an offset) or a duration ago (default now plus "
        "limits.max_future_skew: events a device's fast clock dated ahead are shown too)",
    )
    _add_limit(his, "events")
    his.add_argument("--json", action="store_true", help="print a JSON array")

    rol = _command(
        sub,
        "rollup",
        parents=[common],
        help="a device's 1-minute or 1-hour aggregates, oldest first",
    )
    rol.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    rol.add_argument("device_id", type=_name)
    rol.add_argument(
        "--metric", type=_name, default="value", help="a metrics key, or value (the default)"
    )
    rol.add_argument("--step", default="1m", help="1m or 1h (default 1m, as the API)")
    _add_range(rol)
    rol.add_argument("--json", action="store_true", help="print a JSON array")

    reb = _command(
        sub,
        "rebuild-rollups",
        parents=[common],
        help="recompute roll-ups from the raw rows over a range, with progress on stderr",
    )
    reb.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    reb.add_argument(
        "device_id",
        type=_name,
        nargs="*",
        help="the devices (default: every device of the tenant with raw rows)",
    )
    _add_range(reb)

    meta = _command(
        sub, "meta", parents=[common], help="metric names, tag keys and values, devices by tag"
    )
    meta_sub = meta.add_subparsers(dest="meta_command", required=True, metavar="WHAT")
    for name, what in (("metrics", "metric names"), ("tags", "tag keys")):
        one_meta = _action(meta_sub, name, parents=[common], help=f"the tenant's {what}")
        one_meta.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
        one_meta.add_argument("--json", action="store_true", help="print JSON")
    values = _action(meta_sub, "values", parents=[common], help="the values of a tag key")
    values.add_argument("key", type=_name, metavar="KEY")
    values.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    values.add_argument("--json", action="store_true", help="print JSON")
    tagged = _action(
        meta_sub, "devices", parents=[common], help="devices that carry a tag value (KEY=VALUE)"
    )
    tagged.add_argument(
        "tag",
        type=_tag,
        metavar="KEY=VALUE",
        help="KEY=VALUE or KEY:VALUE; a key that holds : = or \\ writes them \\: \\= \\\\",
    )
    tagged.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    tagged.add_argument("--json", action="store_true", help="print JSON")
    counted = _action(
        meta_sub,
        "count",
        parents=[common],
        help="entries the tenant has taken against metadata.max_per_tenant",
    )
    counted.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    counted.add_argument("--json", action="store_true", help="print JSON")
    counted.add_argument(
        "--recount",
        action="store_true",
        help="set the count to the entries the tables hold (entries counted and never "
        "written, after a crash or a retried compare-and-set, are given back); one read per "
        "tag value, with progress on stderr. Run it while no gateway adds entries for the tenant",
    )

    quo = _command(
        sub,
        "quota",
        parents=[common],
        help="devices a tenant's device quota admitted (max_devices_per_tenant); --release",
    )
    quo.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    change = quo.add_mutually_exclusive_group()
    change.add_argument(
        "--release",
        nargs="+",
        type=_name,
        metavar="DEVICE",
        help="take these devices out of the quota, giving their slots back",
    )
    change.add_argument(
        "--recount",
        action="store_true",
        help="set the count to the devices listed (slots a stopped gateway took and never "
        "used); run it while no gateway admits new devices of the tenant",
    )
    quo.add_argument(
        "--json",
        action="store_true",
        help='print JSON; "listed" (the devices in the quota\'s list) only when they were '
        "counted, for a tenant at its quota or with none set: null if Cassandra could not "
        "count them in time",
    )

    rej = _command(sub, "rejected", parents=[common], help="recently rejected messages and why")
    rej.add_argument(
        "--tenant",
        type=_any_tenant,
        required=True,
        # Required: its default of '' read as "every tenant" and listed only
        # the messages whose topic named none (CLI probe).
        help="tenant ('' for the messages whose topic named none)",
    )
    back = rej.add_mutually_exclusive_group()
    back.add_argument(
        "--since",
        help="RFC 3339 time or a duration ago like 30m (default 1h; they are kept 7 days)",
    )
    back.add_argument(
        "--hours", type=_hours, help="how many hours back (default 1, at most 168; kept 7 days)"
    )
    _add_limit(rej, "messages")
    rej.add_argument("--json", action="store_true", help="print JSON")

    _command(
        sub,
        "forget-session",
        parents=[common],
        help="end the broker's persistent session of mqtt.client_id (retiring a gateway)",
    )

    noi = _command(
        sub, "noisy", parents=[common], help="noisy devices of a tenant, from the running gateway"
    )
    noi.add_argument("--tenant", type=_tenant, required=True, help=TENANT_HELP)
    noi.add_argument("--json", action="store_true", help="print JSON")

    tok = _command(
        sub, "token", parents=[common], help="read tokens of the HTTP API (api.tokens_file)"
    )
    tok_sub = tok.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    add = _action(
        tok_sub,
        "add",
        parents=[common],
        help="make a read token; it is printed once, as the last line of the output",
    )
    scope = add.add_mutually_exclusive_group(required=True)
    scope.add_argument("--tenant", type=_tenant, help="the tenant it reads")
    scope.add_argument("--admin", action="store_true", help="a token that reads every tenant")
    add.add_argument(
        "--label", type=_checked(tokens.check_label), default="", help="who or what it is for"
    )
    lst = _action(tok_sub, "list", parents=[common], help="the tokens (never their secrets)")
    lst.add_argument("--json", action="store_true", help="print JSON")
    rev = _action(tok_sub, "revoke", parents=[common], help="revoke a token by its id")
    rev.add_argument(
        "token_id",
        metavar="ID",
        type=_checked(tokens.check_token_id),
        help="the id `gateway token list` shows",
    )

    sim = _command(
        sub, "simulate", parents=[common], help="publish events from a simulated device fleet"
    )
    sim.add_argument(
        "--devices",
        type=lambda t: _whole(t, 1, MAX_SIM_DEVICES, "a whole number of devices"),
        default=100,
        help=f"fleet size, 1 to {MAX_SIM_DEVICES} (default 100; about 0.75 KB of memory each)",
    )
    sim.add_argument(
        "--rate",
        type=lambda t: _number(t, 0, 1_000_000, "messages per second", above=True),
        default=50.0,
        help="messages per second, fleet-wide, up to 1,000,000 (default 50)",
    )
    sim.add_argument(
        "--format",
        choices=("json", "msgpack"),
        default="json",
        help="payload encoding (default json)",
    )
    sim.add_argument(
        "--noisy",
        type=lambda t: _number(t, 0, 1, "a fraction of the devices"),
        default=0.0,
        help="fraction of noisy devices (50x)",
    )
    sim.add_argument(
        "--tenant",
        type=_checked(tokens.check_tenant),
        default="demo",
        help="the tenant in the topics (default demo)",
    )
    sim.add_argument(
        "--count",
        type=lambda t: _whole(t, 1, 10**12, "a whole number of messages"),
        help="stop after this many messages",
    )
    sim.add_argument("--duration", type=_seconds_arg, help="stop after this many seconds")
    sim.add_argument("--seed", type=int, default=1, help="same seed, same fleet and events")
    return parser


def _checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type from a checker raising ValueError: the error names the argument."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _time_arg(name: str, text: str | None, default: datetime, now: datetime) -> datetime:
    """``--since`` or ``--until``; a duration is ago from ``now``, the same
    for both ends (``--since 5m --until 5m`` was an empty range, not refused)."""
    if text is None:
        return default
    try:
        return queries.parse_time(name, text, now)
    except QueryError as exc:
        raise UsageError(str(exc)) from None


# What `gateway init --edge` changes in the example config: the spool on
# (README, "Running on an edge host", why it is worth it there; what it costs:
# bench/PERFORMANCE.md, "The edge spool: what it costs"), and the spool and
# tokens in the service unit's StateDirectory.
EDGE_HEADER = (
    "# Edge profile (`gateway init --edge`): the example config with the spool on\n"
    "# and the state in /var/lib/gateway (deploy/systemd/gateway.service).\n"
)
EDGE_CHANGES = (
    (
        'enabled = false\npath = "gateway-spool.sqlite"\n',
        "# On for the edge profile: a reboot during an outage still takes messages,\n"
        "# and the broker's queue need not hold an outage. It writes a few KB to\n"
        '# disk per message (README, "Running on an edge host").\n'
        'enabled = true\npath = "/var/lib/gateway/spool.sqlite"\n',
    ),
    ('tokens_file = "gateway-tokens.jsonl"\n', 'tokens_file = "/var/lib/gateway/tokens.jsonl"\n'),
)


def edge_config(example: str) -> str:
    """The example config with the edge profile's changes."""
    for old, new in EDGE_CHANGES:
        # The example config is ours: a change that no longer applies is a bug
        # (tests/test_edge.py writes and validates the edge profile).
        assert example.count(old) == 1, f"example.toml no longer has {old!r} once"
        example = example.replace(old, new)
    return EDGE_HEADER + example


def _init(path: Path, force: bool, edge: bool = False) -> int:
    # The example config ships in the package (gateway/example.toml, a link to
    # gateway.example.toml in a checkout): one source for the README, the
    # tests and this.
    text = importlib.resources.files("gateway").joinpath("example.toml").read_text()
    if edge:
        text = edge_config(text)
    if code := _write_new(path, text, force):
        return code
    spool = "" if edge else " (and [spool] on an edge host)"
    print(f"wrote {path}: set [mqtt] and [cassandra]{spool}, then: gateway check --config {path}")
    return 0


def _init_unit(path: Path, force: bool) -> int:
    """The systemd unit (gateway/gateway.service, a link to
    deploy/systemd/gateway.service in a checkout): a host with only the
    wheel had no way to the file the README told it to copy."""
    text = importlib.resources.files("gateway").joinpath("gateway.service").read_text()
    if code := _write_new(path, text, force):
        return code
    print(
        f"wrote {path}: its ExecStart runs /opt/gateway/bin/gateway with "
        "/etc/gateway/gateway.toml (edit it for other paths), then: "
        "systemctl daemon-reload && systemctl enable --now gateway"
    )
    return 0


def _write_new(path: Path, text: str, force: bool) -> int:
    """Write ``text`` to ``path``, not over an existing file unless ``force``:
    0, or the exit status, said why (2: a directory given, 1: not written)."""
    if not str(path) or path.is_dir():
        # Path("") is "."; `init DIR` said "DIR exists", and --force then failed.
        print(
            f"gateway: init writes a file; {str(path) or 'the empty path'!r} is a directory "
            "(give a file name, such as gateway.toml)",
            file=sys.stderr,
        )
        return 2
    try:
        with path.open("w" if force else "x") as out:
            out.write(text)
    except FileExistsError:
        print(f"gateway: {path} exists; not replacing it (--force to do so)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gateway: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _first_names(names: list[str]) -> str:
    """The first of ``names`` in order, for a hint after a misspelt name."""
    return queries.first_names(names, show=_shown)


# Control characters a device may have sent in a value, a tag, a metric's name
# or a topic (C0, DEL, C1): shown escaped, so that a row stays one line (cut
# -f takes the tab-separated fields) and no escape sequence it carries reaches
# the terminal. JSON escapes C0 itself; DEL and C1 are escaped there too. So
# are the invisible characters states and ids may not hold (topic_filters):
# a direction override turned "\u202eevil" into "live" (page probe).
_INVISIBLE_ESCAPES = {c: f"\\u{c:04x}" for c in INVISIBLE}
_TEXT_ESCAPES = (
    {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
    | {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    | _INVISIBLE_ESCAPES
)
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in range(0x7F, 0xA0)} | _INVISIBLE_ESCAPES


def _shown(text: object) -> str:
    """Device-supplied text for a line of output, control characters escaped."""
    return str(text).translate(_TEXT_ESCAPES)


def _payload_shown(row: queries.RejectedRow) -> str:
    """A rejected message's kept payload for a line: its text, or the bytes
    as Python writes them (b'\\x81...') when it is not UTF-8; "..." after it
    when more was sent than kept (limits.rejected_payload_bytes)."""
    if row.payload is None:
        return ""
    text = row.payload_text()
    shown = _shown(text) if text is not None else repr(row.payload)
    return shown + ("..." if row.payload_truncated() else "")


def _json_text(value: Any, option: int | None = None) -> str:
    """``value`` as JSON, DEL and C1 control characters escaped too."""
    return orjson.dumps(value, option=option).decode().translate(_JSON_ESCAPES)


def _print_json(value: Any) -> None:
    sys.stdout.write(_json_text(value, orjson.OPT_INDENT_2) + "\n")


def _print_listing(
    args: argparse.Namespace,
    summary: str,
    said: bool,
    value: Callable[[], Any],
    lines: Iterable[str],
) -> None:
    """A list as JSON (``--json``: ``value()``, the summary on stderr only
    when ``said``, something worth a word) or as lines, then its summary on
    stderr."""
    if args.json:
        if said:
            print(summary, file=sys.stderr)
        _print_json(value())
        return
    for line in lines:
        print(line)
    print(summary, file=sys.stderr)


async def _serve(config: Config) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from .. import app

    await app.serve_read_side(config, stop)
    return 0


# Where the drivers report a failed connect (cassandra-driver under
# "cassandra", the C++ driver through acsylla under the write session's).
_DRIVER_LOGGERS = ("cassandra", "gateway.store.write_session")


def _not_from_a_driver(record: logging.LogRecord) -> bool:
    return not any(record.name == n or record.name.startswith(n + ".") for n in _DRIVER_LOGGERS)


def _hide_drivers() -> None:
    # On the handlers: a filter on a logger misses its children's records.
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_from_a_driver)


def _hear_drivers() -> None:
    for handler in logging.getLogger().handlers:
        handler.removeFilter(_not_from_a_driver)


@contextlib.contextmanager
def _drivers_hidden(hidden: bool) -> Iterator[None]:
    """:func:`_hide_drivers` meanwhile, if ``hidden``."""
    if hidden:
        _hide_drivers()
    try:
        yield
    finally:
        if hidden:
            _hear_drivers()


class _HearDriversWhenReady(Notifier):
    """systemd's notifier for `gateway run`, which hides the drivers' reports
    of its first connect: a failed one is said in one line (``gateway: cannot
    connect to Cassandra at ...``, or the spool's "taking messages into the
    spool"), and theirs came first, four of them. The gateway sends READY=1
    once it is open (Gateway.run) or spooling (spooling.py), and the drivers
    are heard from then on, or once the run ends."""

    def notify(self, *fields: str) -> None:
        if "READY=1" in fields:
            _hear_drivers()
        super().notify(*fields)


# Python's cyclic collector, for `gateway run`: the young generation is
# collected every GC_YOUNG net allocations of containers instead of 700. The
# write path allocates a dozen short-lived rows, tuples and dicts per message
# and almost no cycles (reference counting frees them), so at the default the
# collector took about a fifth of the gateway's CPU in a drain of 30,000
# messages (1.35 s of 7 s); at 50,000, 0.1 s, for about 14 MB more peak memory.
# And at least GC_PER_EVENT per message of a chunk (pipeline.batch_max_events):
# a chunk and its writes are alive together, and a threshold below that made
# nearly every full chunk a collection that walked it all (chunks of 2,000 at
# 50,000: 8 to 15 collections of about 20 ms each in a drain of 60,000
# messages; at 100,000, one; peak memory the same).
GC_YOUNG = 50_000
GC_PER_EVENT = 50


async def _run(config: Config) -> int:
    from .. import app

    # What start-up loaded stays for good: out of every collection.
    gc.freeze()
    gc.set_threshold(max(GC_YOUNG, GC_PER_EVENT * config.pipeline.batch_max_events), 10, 10)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "gateway starting: mqtt %s:%d, cassandra %s keyspace %s",
        config.mqtt.host,
        config.mqtt.port,
        ",".join(config.cassandra.contact_points),
        config.cassandra.keyspace,
    )
    notifier = _HearDriversWhenReady.from_environ(os.environ)
    # With the spool too: its own attempts are quiet (spooling.py), but the
    # first, app.run's, logged cassandra-driver's ERROR at every start during
    # an outage, beside the spool's own line (field-engineer probe).
    _hide_drivers()
    task = asyncio.create_task(
        app.run(
            config, stop, shutdown_deadline=config.pipeline.shutdown_deadline, notifier=notifier
        )
    )
    task.add_done_callback(lambda _: _hear_drivers())
    await asyncio.wait(
        (task, asyncio.ensure_future(stop.wait())), return_when=asyncio.FIRST_COMPLETED
    )
    if not task.done():
        notifier.notify("STOPPING=1")
        # Said at once: during an outage the writes under way may take the
        # whole deadline, and a Ctrl-C met 10 s of silence (field probe).
        log.info(
            "stopping: finishing the writes under way (up to %.0f s, "
            "pipeline.shutdown_deadline); what is not written %s",
            config.pipeline.shutdown_deadline,
            _unwritten(config.spool.enabled),
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _exit_now, config.spool.enabled)
        started = time.monotonic()
        try:
            # The pipeline has its own deadline; this one is the backstop.
            async with asyncio.timeout(config.pipeline.shutdown_deadline + 5):
                await asyncio.shield(task)
        except TimeoutError:
            log.error("shutdown took over %.0f s; cancelling", time.monotonic() - started)
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):  # stopped: nothing is cut short now
            loop.add_signal_handler(sig, stop.set)
    try:
        await task
    except asyncio.CancelledError:
        return 1
    return 0


def _exit_now(spooled: bool) -> None:
    """A second SIGINT or SIGTERM while `gateway run` stops: exit at once,
    as after SIGKILL, which loses nothing (a message is acknowledged only
    once written, or once in the spool). Waiting out the writes under way
    (up to pipeline.shutdown_deadline, more during an outage) is what the
    first one asked for."""
    log.warning(
        "second signal: exiting now, without waiting for the writes under way; what is "
        "not written %s",
        _unwritten(spooled),
    )
    logging.shutdown()
    os._exit(130)


def _unwritten(spooled: bool) -> str:
    """Where what is not written goes when `gateway run` stops."""
    return (
        "stays in the spool"
        if spooled
        else "is not acknowledged: the broker keeps it for the next start"
    )


def _add_limit(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--limit",
        type=_limit,
        default=1000,
        help=f"at most this many {what}, 1 to {MAX_CLI_LIMIT} (default 1000)",
    )


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}{_s(n)}"


def _more(more: bool) -> str:
    """What a summary line adds when ``--limit`` left some out."""
    return "; more than --limit, the rest left out" if more else ""


def _seconds_arg(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"a positive number of seconds (got {text!r})")
    return seconds


def _tenant(text: str) -> str:
    """A tenant (``--tenant``): a name (:func:`_name`) that is one topic level
    (the check a token's tenant passes). No topic can carry another, so
    another found nothing, or, for ``quota``, counted slots of a tenant that
    cannot send. Not empty: Cassandra refuses an empty key (a traceback)."""
    if not text:
        raise argparse.ArgumentTypeError(
            "must not be empty (only `gateway rejected --tenant ''` takes it: "
            "messages whose topic named no tenant)"
        )
    return _any_tenant(text)


def _any_tenant(text: str) -> str:
    """:func:`_tenant`, or empty: ``rejected`` lists the messages whose topic
    named no tenant under ''."""
    return _checked(tokens.check_tenant)(_name(text)) if text else text


def _add_range(parser: argparse.ArgumentParser) -> None:
    """--since and --until of a range up to now (the last 24 h by default)."""
    parser.add_argument(
        "--since",
        help="RFC 3339 time (UTC without an offset) or a duration ago like 2h "
        "(ms, s, m, h, d; default 24h)",
    )
    parser.add_argument(
        "--until", help="RFC 3339 time (UTC without an offset) or a duration ago (default now)"
    )


def _file_path(text: str) -> Path:
    """A file's path: not empty (Path('') is '.', and `init ''` said "'.'
    is a directory")."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def _name(text: str) -> str:
    """A tenant, device, state, metric or tag given on the command line: valid
    UTF-8 (a terminal in another encoding gives bytes that are not) and at
    most MAX_ARG characters, as the read API takes (Cassandra refuses keys
    over 64 KiB, with a traceback). Not empty: no device, state or key is
    (an empty one was looked up, and found missing, or "not admitted: ")."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return _argument(text, MAX_ARG)


def _state(text: str) -> str:
    """A state (``--state``): a name (:func:`_name`), trimmed as stored."""
    try:
        return queries.asked_state(_name(text))
    except QueryError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("state: ")) from None


def _tag(text: str) -> str:
    """A KEY=VALUE tag: as long as the read API's tag parameter (MAX_TAG: a
    value of up to 1,024 characters and its key)."""
    return _argument(text, MAX_TAG)


def _argument(text: str, most: int) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 ({ascii(text)[:60]}): check the terminal's encoding"
        ) from None
    if len(text) > most:
        raise argparse.ArgumentTypeError(
            f"longer than {most} characters ({len(text)}: {text[:40]!r}...)"
        )
    return text


def _whole(text: str, low: int, high: int, what: str) -> int:
    """An argparse integer in [low, high]; the error says what it takes."""
    try:
        number = int(text)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"{what} from {low} to {high} (got {text!r})")
    return number


def _number(text: str, low: float, high: float, what: str, *, above: bool = False) -> float:
    """An argparse number in [low, high] ((low, high] when ``above``); the
    error names what it takes (``simulate --rate 0`` said "rate must be",
    not which option)."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not (low < number <= high if above else low <= number <= high):
        low_text, high_text = (f"{x:,.0f}" if x == int(x) else f"{x:g}" for x in (low, high))
        bounds = f"above {low_text}" if above else f"from {low_text}"
        raise argparse.ArgumentTypeError(f"{what} {bounds} to {high_text} (got {text!r})")
    return number


def _hours(text: str) -> int:
    # Rejected messages are kept 7 days (the table's TTL).
    return _whole(text, 1, queries.MAX_REJECTED_HOURS, "a whole number of hours")


def _limit(text: str) -> int:
    return _whole(text, 1, MAX_CLI_LIMIT, "a whole number")


class _Progress:
    """A command's progress on stderr. On a terminal one line, rewritten in
    place; elsewhere (a log file, a pipe: a cron job, a CI log) a whole line
    at most every :attr:`EVERY` seconds, and the last, instead of one long
    line of carriage returns. Use as ``with``: ends the line."""

    EVERY = 10.0

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._shown = False  # on a terminal: a line to end
        self._unsaid: str | None = None  # elsewhere: the latest, not yet printed
        self._said_at = -math.inf

    def __call__(self, text: str) -> None:
        if self._tty:
            # Flushed: stderr is line-buffered, and a line rewritten in place
            # has no newline, so it showed only at the end.
            # Erased to the line's end: a shorter line left the longer one's tail.
            print(f"\r{text}\x1b[K", end="", file=sys.stderr, flush=True)
            self._shown = True
            return
        now = time.monotonic()
        if now - self._said_at >= self.EVERY:
            print(text, file=sys.stderr, flush=True)
            self._said_at, self._unsaid = now, None
        else:
            self._unsaid = text

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._shown:
            print(file=sys.stderr, flush=True)
        elif self._unsaid is not None:
            print(self._unsaid, file=sys.stderr, flush=True)


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        levels = ", ".join(LOG_LEVELS[:-1]) + f" or {LOG_LEVELS[-1]}"
        raise ValueError(f"expected {levels} (got {text!r})")
    return text.upper()


async def _schema_migrate(config: Config, force: bool) -> int:
    async with connect(config.cassandra) as db:
        if not force and not await schema.old_state_layout(db):
            # Rewriting every state row of a current keyspace is heavy, and the
            # default keyspace is one missing --config away.
            print(
                f"schema migrate: keyspace {config.cassandra.keyspace!r} already has the "
                "current layout; nothing to migrate (--force rebuilds it anyway)",
                file=sys.stderr,
            )
            return 0
        with _Progress() as say:
            rows = await schema.migrate(
                db,
                lambda t: config.tenant(t).state_buckets,
                lambda rows: say(f"schema migrate: {rows} state rows rebuilt"),
            )
    print(
        f"schema migrate: latest_events_by_state rebuilt from latest_events_by_device ({rows} rows)"
    )
    return 0


async def _schema_apply(config: Config) -> int:
    async with connect(config.cassandra, keyspace=False) as db:
        count = await schema.apply(db)
        mismatch = await schema.replication_mismatch(db)
    print(
        f"schema: {count} statements applied to keyspace {config.cassandra.keyspace!r} (idempotent)"
    )
    if mismatch is not None:
        print(f"schema: warning: {mismatch}", file=sys.stderr)
    return 0


async def _check(config: Config) -> int:
    from . import check

    return await check.run(config)


async def _devices(config: Config, args: argparse.Namespace) -> int:
    if args.state is None:
        if args.prefix is None:
            raise UsageError("give --state, or --prefix to find devices in any state")
        return await _found_devices(config, args)
    async with connect(config.cassandra) as db:
        rows = await queries.devices_in_state(
            db, config, args.tenant, args.state, prefix=args.prefix or ""
        )
        known = await queries.known_states(db, args.tenant) if not rows else [args.state]
    hint = ""
    if not known:
        hint = ": the tenant has no states yet; a misspelt --tenant?"
    elif args.state not in known:
        # Likely a misspelt --state: say which ones the tenant has.
        hint = f": the tenant has no such state; its states: {_first_names(known)}"
    starting = "" if args.prefix is None else f" whose id starts with {args.prefix!r}"
    summary = (
        f"({_count(len(rows), 'device')}{starting} in state {args.state!r} "
        f"for tenant {args.tenant!r}{hint})"
    )
    lines = (
        f"{r.device_id}\t{queries.iso(r.ts)}\t{'' if r.value is None else _shown(r.value)}"
        for r in rows
    )
    _print_listing(args, summary, bool(hint), lambda: [r.as_json() for r in rows], lines)
    return 0


async def _found_devices(config: Config, args: argparse.Namespace) -> int:
    """``devices --prefix`` without ``--state``: in any state (queries.find_devices)."""
    async with connect(config.cassandra) as db:
        found = await queries.find_devices(
            db, config, args.tenant, args.prefix, limit=queries.MAX_PAGE
        )
    rows = found.devices
    more = ""
    if found.cut_short:
        more = (
            f"; not every device searched: state{_s(len(found.cut_short))} "
            f"{_first_names(found.cut_short)} hold more than a search of every state reads "
            "at once: add --state to search one whole"
        )
    elif not found.complete:
        more = f"; {len(rows):,} of them shown"
    summary = (
        f"({_count(len(rows), 'device')} whose id starts with {args.prefix!r} "
        f"for tenant {args.tenant!r}, in any state{more})"
    )

    def line(r: queries.LatestRow) -> str:
        state, value = ("—" if v is None else _shown(v) for v in (r.state, r.value))
        return f"{r.device_id}\t{state}\t{queries.iso(r.ts)}\t{value}"

    _print_listing(args, summary, bool(more), found.as_json, map(line, rows))
    return 0


async def _device(config: Config, args: argparse.Namespace) -> int:
    async with connect(config.cassandra) as db:
        row = await queries.latest_event(db, args.tenant, args.device_id)
    if row is None:
        print(
            f"gateway: no events for device {args.device_id!r} of tenant {args.tenant!r}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        _print_json(row.as_json())
    else:
        # "—" for none, not Python's None.
        state, value = ("—" if v is None else _shown(v) for v in (row.state, row.value))
        print(f"{row.device_id}  state={state}  ts={queries.iso(row.ts)}  value={value}")
        # As history prints them: JSON, not Python's repr.
        metrics, tags = _json_text(row.metrics), _json_text(row.tags)
        print(f"  metrics={metrics}  tags={tags}")
    return 0


def _time_range(
    args: argparse.Namespace, now: datetime, ahead: float = 0
) -> tuple[datetime, datetime]:
    """--since and --until (the last 24 h unless given, up to ``ahead``
    seconds past now, as the API's), in order."""
    since = _time_arg("--since", args.since, now - timedelta(hours=24), now)
    until = _time_arg("--until", args.until, now + timedelta(seconds=ahead), now)
    try:
        queries.check_order(
            since,
            until,
            since_given=bool(args.since),
            flag="--",
            until_given=args.until is not None,
            ahead=ahead,
        )
    except QueryError as exc:
        raise UsageError(str(exc)) from None
    return since, until


async def _history(config: Config, args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    since, until = _time_range(args, now, config.limits.max_future_skew)
    async with connect(config.cassandra) as db:
        # One more than asked: whether the limit left any out.
        rows = await queries.history(db, args.tenant, args.device_id, since, until, args.limit + 1)
        hint, missing = (
            ("", False) if rows else await _empty_device_hint(db, args.tenant, args.device_id)
        )
    more, rows = len(rows) > args.limit, rows[: args.limit]
    if args.json:
        _print_json([r.as_json() for r in rows])
    else:
        for r in rows:
            value = "" if r.value is None else _shown(r.value)
            print(f"{queries.iso(r.ts)}\t{r.state or ''}\t{value}\t{_json_text(r.metrics)}")
    if more or hint or not args.json:  # with --json, said only when cut or explained
        print(f"({_count(len(rows), 'event')}{_more(more)}{hint})", file=sys.stderr)
    # A device the tenant never had is "not found" (1), as for `gateway
    # device`; an empty range of a known one is an answer (0).
    return 1 if missing else 0


async def _empty_device_hint(db: Database, tenant: str, device_id: str) -> tuple[str, bool]:
    """Why a device's range is empty: no such device (a misspelt id or
    --tenant; then True), or none in the range, and when its newest event was."""
    newest = await queries.latest_event(db, tenant, device_id)
    if newest is not None:
        return f": none in the range; its newest event is at {queries.iso(newest.ts)}", False
    if await queries.device_has_rows(db, tenant, device_id):
        # Rows written around the gateway (no latest event): a device it has, as the API says.
        return ": none in the range", False
    return _no_device_hint(tenant, device_id), True


def _no_device_hint(tenant: str, device_id: str) -> str:
    return f": tenant {tenant!r} has no device {device_id!r}; a misspelt id or --tenant?"


async def _rollup(config: Config, args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    since, until = _time_range(args, now)
    try:
        step = queries.parse_step(args.step)
    except QueryError as exc:
        raise UsageError(f"--{exc}") from None
    try:
        queries.check_rollup_range(step, since, until, since_given=bool(args.since))
    except QueryError as exc:
        raise UsageError(f"--{exc}") from None
    async with connect(config.cassandra) as db:
        rows = await queries.rollups(
            db, args.tenant, args.device_id, args.metric, step, since, until
        )
        known = await queries.meta_metrics(db, args.tenant) if not rows else []
        # A device the tenant never had fails as history's does, whatever
        # --metric says (a misspelt metric beside it hid it: exit 0).
        # As history decides it (its hint is history's; this one's comes below).
        _, missing = (
            await _empty_device_hint(db, args.tenant, args.device_id) if not rows else ("", False)
        )
        hint = ""
        if known and args.metric not in known:
            # Likely a misspelt --metric: say which ones the tenant's devices send.
            hint = (
                f": tenant {args.tenant!r} has no such metric; its metrics: {_first_names(known)}"
            )
        elif not rows and not known and args.metric != "value" and config.metadata.enabled:
            # No metric at all (metadata records every name): likely a misspelt --tenant.
            hint = f": tenant {args.tenant!r} has no metrics recorded; a misspelt --tenant?"
        elif missing:
            hint = _no_device_hint(args.tenant, args.device_id)
        done, worker = await asyncio.gather(
            queries.rollups_done_until(db), _rollup_worker_or_none(db)
        )
        progress, stalled = rollup_progress(done, until, now, config.rollups.grace, worker)
    summary = f"({_count(len(rows), 'window')} of {args.step} for {args.metric!r}{hint}{progress})"

    def line(r: queries.RollupRow) -> str:
        # 12 significant digits: a sum of 0.1 and 0.2 reads 0.3 (--json
        # keeps every digit of the stored double).
        total = "out-of-range" if r.sum is None else f"{r.sum:.12g}"
        return (
            f"{queries.iso(r.start)}\tcount={r.count}\tmin={r.min:.12g}\tmax={r.max:.12g}"
            f"\tsum={total}\tlast={r.last:.12g}"
        )

    _print_listing(
        args, summary, bool(hint) or stalled, lambda: [r.as_json() for r in rows], map(line, rows)
    )
    return 1 if missing else 0  # as history's


async def _rebuild_rollups(config: Config, args: argparse.Namespace) -> int:
    """Every 1-minute window of the devices that holds raw rows in the range
    recomputed, and its hour (store/rollups.py, RollupWorker.rebuild)."""
    from ..stats import Stats
    from ..store.rollups import RollupWorker
    from ..store.write_session import open_write_session

    since, until = _time_range(args, datetime.now(UTC))
    since_ms, until_ms = epoch_ms(since), epoch_ms(until)
    span = f"from {queries.iso(since)} to {queries.iso(until)}"
    devices = sorted(set(args.device_id))
    if not devices:
        async with connect(config.cassandra) as db:
            devices = await queries.devices_with_rows(db, args.tenant)
    if not devices:
        print(f"(tenant {args.tenant!r} has no raw rows; a misspelt --tenant?)", file=sys.stderr)
        return 1
    with _Progress() as say:

        def progress(done: int, windows: int, day_ms: int | None) -> None:
            day = None if day_ms is None else datetime.fromtimestamp(day_ms / 1000, UTC)
            at = "" if day is None else f", reading {day:%Y-%m-%d}"
            say(
                f"rebuild-rollups: {done:,} of {len(devices):,} device{_s(len(devices))}, "
                f"{windows:,} window{_s(windows)} recomputed{at}"
            )

        async with open_write_session(config.cassandra) as session:
            worker = RollupWorker(session, config, Stats())
            await worker.prepare()
            windows, seen = await worker.rebuild(args.tenant, devices, since_ms, until_ms, progress)
    # A device named and not found is said. It fails the command when the
    # tenant never had it (a misspelt id), or when no device named had a
    # window to recompute (nothing was done); one quiet in the range beside
    # another that had windows does not.
    unknown = []
    if missing := sorted(set(args.device_id) - seen):
        async with connect(config.cassandra) as db:
            for device in missing:
                # Raw rows at any time (rows written around the gateway have
                # no latest row): the same index the device list comes from.
                if await queries.device_has_rows(db, args.tenant, device):
                    print(f"({device}: no raw rows {span})", file=sys.stderr)
                else:
                    unknown.append(device)
                    print(f"({_no_device_hint(args.tenant, device)[2:]})", file=sys.stderr)
    if windows:
        print(
            f"recomputed {windows:,} 1-minute window{_s(windows)} and "
            f"{'its hour' if windows == 1 else 'their hours'}, of "
            f"{len(seen):,} device{_s(len(seen))} of tenant {args.tenant!r}, {span}"
        )
    elif not args.device_id:
        print(f"(no raw rows {span} for tenant {args.tenant!r})", file=sys.stderr)
    return 1 if unknown or (args.device_id and not windows) else 0


async def _rollup_worker_or_none(db: Database) -> str | None:
    """The worker's holder for the hint, or None when it cannot be read (a
    keyspace from before `worker_leases`): the hint never fails the answer."""
    try:
        return await queries.rollup_worker(db)
    except Exception as exc:
        log.debug("the roll-up worker's lease could not be read: %s", exc)
        return None


def rollup_progress(
    done: datetime | None, until: datetime, now: datetime, grace: float, worker: str | None
) -> tuple[str, bool]:
    """What a roll-up answer should say about the worker's progress, and
    whether that is trouble (no worker, or one far behind): windows after its
    cursor are not there yet, which an answer without them did not say.
    ``worker``: the instance holding the worker's lease, if any."""
    if done is None:
        return "; no roll-up worker has run in this keyspace (rollups.worker on a gateway)", True
    behind = queries.rollup_behind_s(done.timestamp() * 1000, now.timestamp() * 1000, grace)
    if behind >= queries.ROLLUP_BEHIND_S:
        where = (
            f"it runs on {worker!r}: gateway_rollup_lag_seconds and the log there"
            if worker
            else "no gateway runs it: is one with rollups.worker = true running?"
        )
        return (
            f"; the roll-up worker is {int(behind // 60)} min behind, done up to "
            f"{queries.iso(done)}; {where}",
            True,
        )
    if until > done:
        return f"; done up to {queries.iso(done)}, each minute about 2 min after it began", False
    return "", False


async def _meta(config: Config, args: argparse.Namespace) -> int:
    what = args.meta_command
    if what == "devices":
        try:
            key, value = queries.parse_tag(args.tag)
        except QueryError as exc:
            # The CLI's name for it is the positional KEY=VALUE, not "tag".
            raise UsageError(f"KEY=VALUE{str(exc).removeprefix('tag')}") from None
    async with connect(config.cassandra) as db:
        if what == "count":
            cap = config.metadata.max_per_tenant
            out: dict[str, Any] = {"tenant": args.tenant}
            if args.recount:
                before, count = await _recount_metadata(db, args.tenant)
                out["recounted"] = {"before": before, "after": count}
            else:
                count = await queries.meta_entry_count(db, args.tenant)
            if args.json:
                _print_json(out | {"entries": count, "cap": cap})
            else:
                if args.recount:
                    print(f"recounted: {before} -> {count}")
                print(f"{count} of {cap} (metadata.max_per_tenant) for tenant {args.tenant!r}")
            return 0
        if what == "metrics":
            found = await queries.meta_metrics(db, args.tenant)
        elif what == "tags":
            found = await queries.meta_tag_keys(db, args.tenant)
        elif what == "values":
            found = await queries.meta_tag_values(db, args.tenant, args.key)
        else:
            found = await queries.meta_tag_devices(db, args.tenant, key, value)
        asked_key = args.key if what == "values" else key if what == "devices" else None
        asked_value = value if what == "devices" else None
        hint = (
            "" if found else await _empty_meta_hint(db, args.tenant, asked_key, config, asked_value)
        )
        if await queries.meta_capped(db, args.tenant, config):
            hint += (
                f"; the tenant is at metadata.max_per_tenant "
                f"({config.metadata.max_per_tenant:,} entries): entries since are not "
                "recorded, so this list may be incomplete"
            )
    found, cut = queries.meta_cut(found)
    if args.json:
        _print_json(found)
    else:
        for entry in found:
            print(_shown(entry))
    if cut or hint or not args.json:  # with --json, said only when cut or explained
        more = f"; the list is longer, cut at {queries.MAX_META:,}" if cut else ""
        noun = {"metrics": "metric", "tags": "tag", "values": "value"}.get(what, "device")
        print(
            f"({_count(len(found), noun)} for tenant {args.tenant!r}{more}{hint})", file=sys.stderr
        )
    return 0


async def _recount_metadata(db: Database, tenant: str) -> tuple[int, int]:
    """The tenant's metadata entry count set to what the tables hold, by
    compare-and-set (store/reservations.py), with progress on stderr."""
    from ..store import reservations

    with _Progress() as say:

        def progress(done: int, of: int) -> None:
            if of:
                say(f"meta count: {done} of {of} tag values counted")

        return await reservations.recount(
            db,
            "meta_entry_counts",
            "reserved",
            tenant,
            lambda: queries.meta_entry_count(db, tenant),
            lambda: queries.meta_entries(db, tenant, progress),
            "metadata entries",
        )


async def _empty_meta_hint(
    db: Database, tenant: str, key: str | None, config: Config, value: str | None = None
) -> str:
    """Why a metadata list is empty: metadata off, a tenant with nothing
    recorded (a misspelt --tenant?), a tag ``key`` it does not have, or a
    ``value`` that key never had (``meta devices``: it said nothing)."""
    if not config.metadata.enabled:
        return ": metadata.enabled is false, so nothing is recorded"
    keys = await queries.meta_tag_keys(db, tenant)
    if not keys and not await queries.meta_metrics(db, tenant):
        return ": nothing recorded for the tenant; a misspelt --tenant?"
    if key is not None and key not in keys:
        return f": the tenant has no tag {key!r}; its tags: {_first_names(keys) or 'none'}"
    if key is not None and value is not None:
        values = await queries.meta_tag_values(db, tenant, key)
        if value not in values:
            return f": tag {key!r} has no value {value!r}; its values: {_first_names(values)}"
    return ""


async def _quota(config: Config, args: argparse.Namespace) -> int:
    tenant = args.tenant
    section = config.sampling.tenants.get(tenant) or config.sampling.tenants.get("default")
    cap = None if section is None else section.max_devices_per_tenant
    released: quota.Released | None = None
    recounted: tuple[int, int] | None = None
    listed: int | None = None
    looked = False  # whether the devices listed were counted (listed: None if not in time)
    async with connect(config.cassandra) as db:
        if args.release is not None:
            released = await quota.release(db, tenant, args.release)
        elif args.recount:
            recounted = await quota.recount(db, tenant)
        count = await queries.quota_admitted(db, tenant)
        if cap is None or count >= cap:
            # Whether slots went to devices never written: 16 counting reads,
            # only where the answer matters (a tenant at its quota).
            listed = await queries.quota_listed(db, tenant, quota.QUOTA_BUCKETS)
            looked = True
    if args.json:
        out: dict[str, Any] = {"tenant": tenant, "admitted": count, "quota": cap}
        if looked:
            out["listed"] = listed
        if released is not None:
            out |= {"released": released.released, "not_admitted": released.not_admitted}
        if recounted is not None:
            out["recounted"] = {"before": recounted[0], "after": recounted[1]}
        _print_json(out)
        return 0
    if released is not None:
        if released.released:
            n = len(released.released)
            print(f"released {n} device{'' if n == 1 else 's'} ({', '.join(released.released)})")
        if released.not_admitted:
            print(f"not admitted: {', '.join(released.not_admitted)}")
    if recounted is not None:
        print(f"recounted: {recounted[0]} -> {recounted[1]}")
    if cap is None:
        print(
            f"{count} devices admitted for tenant {tenant!r}; this config sets no quota for it "
            f"(sampling.tenants.{tenant}.max_devices_per_tenant)"
        )
    else:
        print(f"{count} of {cap} devices admitted for tenant {tenant!r} (max_devices_per_tenant)")
    if listed is None and cap is not None and count >= cap:
        print("(the devices listed could not be counted in time)")
    elif listed is not None and listed < count:
        print(
            f"{listed} listed: {count - listed} slots were taken for devices never written "
            f"(a gateway stopped meanwhile); `gateway quota --tenant {tenant} --recount` "
            "gives them back, while no gateway admits new devices of the tenant"
        )
    devices = count if listed is None else min(count, listed)
    if cap is not None and devices > cap:
        print(f"{devices - cap} over: the quota was lowered; --release devices to get under it")
    return 0


async def _rejected(config: Config, args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    if args.since is not None:
        since = _time_arg("--since", args.since, now, now)
        try:
            queries.check_rejected_since(since, now, flag="--")
        except QueryError as exc:
            raise UsageError(str(exc)) from None
        span = f"since {queries.iso(since)}"
        kept = now - timedelta(hours=queries.MAX_REJECTED_HOURS)
        if since < kept:
            # The table keeps 7 days (its TTL): say what was read.
            span = f"since {queries.iso(kept)}, as far back as they are kept (7 days)"
            since = kept
    else:
        hours = args.hours or 1
        since = now - timedelta(hours=hours)
        span = f"in the last {hours} h"
    async with connect(config.cassandra) as db:
        out = await queries.rejected(db, args.tenant, since, limit=args.limit + 1)
    more, out = len(out) > args.limit, out[: args.limit]
    if args.json:
        _print_json([r.as_json() for r in out])
    else:
        for r in out:
            print(
                f"{queries.iso(r.received_at)}\t{r.reason}\t{_shown(r.topic)}"
                f"\t{_shown(r.detail)}\t{_payload_shown(r)}"
            )
    if more or not args.json:  # with --json, said only when the list is cut
        print(
            f"({len(out)} rejected {span} for tenant {args.tenant!r}{_more(more)})",
            file=sys.stderr,
        )
    return 0


def _noisy(config: Config, args: argparse.Namespace) -> int:
    # Sampling state lives in the running gateway: ask its API.
    query = urllib.parse.urlencode({"tenant": args.tenant})
    url = f"http://{config.api.host}:{config.api.port}/noisy?{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            devices = orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        # Something answers there, but not `gateway run` (`gateway serve` has no /noisy).
        raise GatewayError(
            f"{url} answered {exc.code} {exc.reason}: not a running `gateway run` "
            "(gateway serve has no sampler to ask); do api.host/api.port name it?"
        ) from None
    except http.client.HTTPException as exc:
        # Another service on that port (BadStatusLine: Cassandra's, say).
        raise GatewayError(
            f"what answers at {url} does not speak HTTP ({type(exc).__name__}); "
            "do api.host/api.port name the running gateway?"
        ) from None
    except (OSError, ValueError) as exc:
        # URLError wraps the socket's error: say that one ("connection refused").
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        said = (
            reason.strerror.lower()
            if isinstance(reason, OSError) and reason.strerror
            else f"{type(reason).__name__}: {reason}"
        )
        raise GatewayError(
            f"cannot reach the running gateway at {url}: {said}; "
            "is `gateway run` up with api.enabled, and do api.host/api.port match?"
        ) from None
    if args.json:
        _print_json(devices)
        return 0
    for d in devices:
        print(
            f"{d['device_id']}\tobserved={d['observed_rate']:.1f}/s\tkept={d['kept_rate']:.2f}/s"
            f"\tsince={d['since']}\tsampled_out={d['sampled_out']}"
        )
    print(f"({_count(len(devices), 'noisy device')} for tenant {args.tenant!r})", file=sys.stderr)
    return 0


def _token(config: Config, args: argparse.Namespace) -> int:
    # Only this prints a token, and only to stdout: never logged.
    store = tokens.TokenStore(config.api.tokens_file.absolute())
    if args.token_command == "add":
        longest = config.limits.max_topic_level_length
        if args.tenant is not None and len(args.tenant) > longest:
            # No topic can name it: the token would read a tenant that never sends.
            raise UsageError(
                f"--tenant: {len(args.tenant)} characters, over "
                f"limits.max_topic_level_length ({longest}): no topic can name that tenant"
            )
        new = store.add(tenant=args.tenant, admin=args.admin, label=args.label)
        scope = "every tenant (admin)" if args.admin else f"tenant {args.tenant!r}"
        try:
            print(
                f"Token for {scope} (id {new.info.id}), its hash stored in {store.path}. "
                "It is shown once; store it now:"
            )
            print(new.token, flush=True)
        except OSError as exc:
            # Nobody saw it, and it is never shown again: a token nobody
            # has is revoked, not left valid in the file.
            store.revoke(new.info.id)
            _stdout_gone()
            print(
                f"gateway token add: cannot write the token ({exc.strerror or exc}); "
                f"token {new.info.id} revoked: run it again with an output that can be written",
                file=sys.stderr,
            )
            return 1
    elif args.token_command == "revoke":
        info = store.revoke(args.token_id)
        scope = "*admin*" if info.tenant is None else repr(info.tenant)
        print(f"token {info.id} ({scope}) revoked; a running server refuses it within a second")
    else:
        infos = store.list()
        if args.json:
            _print_json([info.as_json() for info in infos])
            return 0
        for info in infos:
            tenant = "*admin*" if info.tenant is None else info.tenant
            print(f"{info.id}\t{tenant}\t{info.label}\t{info.as_json()['created']}")
        print(f"({_count(len(infos), 'token')} in {store.path})", file=sys.stderr)
    return 0


def _running_gateway(config: Config) -> str | None:
    """The /healthz URL of a gateway of this config's client id, if one
    answers at api.host/api.port (the usual case: the service's own config on
    its own host); None when nothing does, or another client id."""
    if not config.api.enabled:
        return None
    url = f"http://{config.api.host}:{config.api.port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body = orjson.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 while degraded: still a gateway
        try:
            body = orjson.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    checks = body.get("checks") if isinstance(body, dict) else None
    if isinstance(checks, dict) and checks.get("mqtt_client_id") == config.mqtt.client_id:
        return url
    return None


async def _forget_session(config: Config) -> int:
    # A session whose client never returns keeps queueing every matching
    # message (until persistent_client_expiration): end it explicitly.
    import aiomqtt

    from .mqtt_client import mqtt_client

    cfg = config.mqtt
    running = _running_gateway(config)
    if running is not None:
        raise GatewayError(
            f"a gateway with client id {cfg.client_id!r} is running ({running} answers): "
            "ending its session would disconnect it and drop what the broker holds for it; "
            "stop it first (forget-session retires a gateway that is gone)"
        )
    try:
        async with mqtt_client(cfg, clean_start=True, session_expiry=0):
            pass
    except aiomqtt.MqttError as exc:
        raise GatewayError(f"cannot reach the broker at {cfg.host}:{cfg.port}: {exc}") from None
    print(f"session of client id {cfg.client_id!r} ended; its queued messages are dropped")
    # The broker cannot be asked whether a client of this id is connected;
    # only this config's api.host:api.port could be (CLI probe: a gateway on
    # another port lost its session). Say so, for whoever ran the wrong id.
    asked = (
        f"no gateway of this client id answered at {config.api.host}:{config.api.port}"
        if config.api.enabled
        else "api.enabled is false, so no running gateway could be asked"
    )
    print(
        f"({asked}; had one of this client id been running elsewhere, or on another "
        "api.port, it was disconnected and lost what the broker held for it)",
        file=sys.stderr,
    )
    return 0


async def _simulate(config: Config, args: argparse.Namespace) -> int:
    from .simulate import FleetSpec, publish

    try:
        spec = FleetSpec(
            devices=args.devices,
            rate=args.rate,
            fmt=args.format,
            noisy=args.noisy,
            tenant=args.tenant,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    acked = 0  # for the summary of an interrupted run

    def on_sent(topic: str, event: dict[str, Any]) -> None:
        nonlocal acked
        acked += 1

    started = time.monotonic()
    task = asyncio.create_task(
        publish(
            spec,
            config.mqtt,
            count=args.count,
            duration=args.duration,
            on_sent=on_sent,
        )
    )
    loop = asyncio.get_running_loop()
    stopped_by: list[int] = []

    def stop(sig: int) -> None:
        stopped_by.append(sig)
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    try:
        stats = await task
    except BrokerError as lost:
        # Refused at start, or the broker went away mid-run: one line, not a traceback.
        where = f"{config.mqtt.host}:{config.mqtt.port}"
        raise GatewayError(f"simulate: lost or no broker at {where}: {lost}") from None
    except asyncio.CancelledError:
        took = time.monotonic() - started
        print(
            f"simulate: interrupted; sent {_count(acked, 'message')} in {took:.1f} s (acknowledged)"
        )
        # 128 + the signal, as a shell reports it (130 for Ctrl-C): it was
        # 0, and `simulate ... && next` went on as if the run had finished.
        return 128 + (stopped_by[0] if stopped_by else signal.SIGINT)
    print(
        f"simulate: sent {_count(stats.sent, 'message')} in {stats.elapsed_s:.1f} s "
        f"({stats.rate:.0f}/s)"
    )
    if stats.refused:
        print(f"simulate: the broker refused {stats.refused} publishes (see the log for why)")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gateway`` command. A reader that goes away (``gateway devices ... |
    head``) ends any command quietly with 141, the status of a process killed
    by SIGPIPE, as other command-line tools do (the Python documentation's
    recipe: stdout is flushed here, so the error cannot surface at exit)."""
    out = sys.stdout
    watched = _Watched(out)
    sys.stdout = cast(TextIO, watched)
    try:
        try:
            code = _main(argv)
        finally:
            # Also when argparse exits (--help) with its output still buffered.
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()
        return 141
    except OSError as exc:
        # The output cannot be written (`> /dev/full`, a full disk): one line,
        # not a traceback. Any other OSError is not this one's to word.
        if not watched.failed:
            raise
        _stdout_gone()
        print(f"gateway: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = out
    return code


class _Watched:
    """sys.stdout, noting whether writing to it failed: then an OSError is
    the output's, not a command's."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self.failed = False

    def write(self, text: str) -> int:
        try:
            return self._out.write(text)
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self._out.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def _stdout_gone() -> None:
    """Python flushes stdout again at exit: point it at /dev/null so that
    flush cannot fail too."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# Options that take a time: `--since -5m` (5m ago, as 5m) is joined into
# `--since=-5m`, which argparse otherwise read as a second option ("expected
# one argument").
_TIME_OPTIONS = frozenset(("--since", "--until"))
_MINUS_DURATION = re.compile(r"-[0-9.]")


def _joined_times(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":  # the rest is positional
            return [*out, arg, *args]
        if arg in _TIME_OPTIONS:
            value = next(args, None)
            if value is not None and _MINUS_DURATION.match(value):
                out.append(f"{arg}={value}")
                continue
            out += [arg] if value is None else [arg, value]
            continue
        out.append(arg)
    return out


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(_joined_times(sys.argv[1:] if argv is None else argv))
    if unknown:
        # argparse's parse_args() reports these with the top-level usage
        # (`gateway [-h] ... COMMAND ...`): the command's names its options.
        where: argparse.ArgumentParser = getattr(args, "usage_parser", parser)
        where.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "init":
        # Before any config exists to load. --config names the file to
        # write, as every other command's names the file to read.
        named: Path | None = getattr(args, "config", None)
        if args.path is not None and named is not None and args.path != named:
            print(
                f"gateway init: two places to write, {args.path} and --config {named}: give one",
                file=sys.stderr,
            )
            return 2
        if args.systemd:
            if named is not None:
                # It is not the unit's path: the unit runs with /etc/gateway/gateway.toml.
                print(
                    "gateway init: --systemd writes the unit to PATH; --config names a config "
                    "file, which this would overwrite: give the unit's path as PATH",
                    file=sys.stderr,
                )
                return 2
            return _init_unit(args.path or Path("gateway.service"), args.force)
        env_path = os.environ.get(ENV_CONFIG_PATH) or None
        target = args.path or named or (Path(env_path) if env_path else Path("gateway.toml"))
        return _init(target, args.force, args.edge)
    level = getattr(args, "log_level", None)
    if level is None:
        try:
            level = _log_level(os.environ.get(ENV_LOG_LEVEL) or "INFO")
        except ValueError as exc:
            print(f"gateway: {ENV_LOG_LEVEL}: {exc}", file=sys.stderr)
            return 2
    _setup_logging(level)
    try:
        config = load_config(getattr(args, "config", None))
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    commands: dict[str, Any] = {
        "run": lambda: _run(config),
        "serve": lambda: _serve(config),
        "check": lambda: _check(config),
        "devices": lambda: _devices(config, args),
        "device": lambda: _device(config, args),
        "history": lambda: _history(config, args),
        "rejected": lambda: _rejected(config, args),
        "rollup": lambda: _rollup(config, args),
        "rebuild-rollups": lambda: _rebuild_rollups(config, args),
        "meta": lambda: _meta(config, args),
        "quota": lambda: _quota(config, args),
        "simulate": lambda: _simulate(config, args),
        "forget-session": lambda: _forget_session(config),
    }
    if args.command in ("noisy", "token"):
        try:
            return _noisy(config, args) if args.command == "noisy" else _token(config, args)
        except GatewayError as exc:
            print(f"gateway: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ConfigError) else 1
    if args.command == "schema":
        if args.schema_command == "print":
            for name, stmt in schema.statements(config.cassandra):
                print(f"-- {name}\n{stmt};\n")
            return 0
        coro: Coroutine[Any, Any, int] = (
            _schema_migrate(config, args.force)
            if args.schema_command == "migrate"
            else _schema_apply(config)
        )
    else:
        coro = commands[args.command]()
    if args.command not in ("run", "serve", "simulate"):  # those stop gracefully
        signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        # A command that asks once reports every failure itself, in one line
        # ("cannot connect to Cassandra at ..."); the drivers' own reports
        # (tracebacks included) would come before it. The long-running ones
        # keep the drivers' warnings (run hides only its first connect's).
        with _drivers_hidden(args.command not in ("run", "serve")):
            return uvloop.run(coro)
    except KeyboardInterrupt:
        return 130
    except _unavailable() as exc:
        # A read or write after connecting that Cassandra could not answer
        # (two of three nodes down: a traceback of NoHostAvailable, probe).
        print(f"gateway: Cassandra could not answer: {unanswered(exc)}", file=sys.stderr)
        return 1
    except (GatewayError, BaseExceptionGroup) as exc:
        # Errors raised inside a TaskGroup arrive wrapped in a group.
        errors = _gateway_errors(exc)
        if not errors:
            raise
        for err in errors:
            if isinstance(err, UsageError):
                # argparse's own format: what parser.error() prints, but returned.
                args.usage_parser.print_usage(sys.stderr)
                print(f"{args.usage_parser.prog}: error: {err}", file=sys.stderr)
            else:
                print(f"gateway: {err}", file=sys.stderr)
        return 2 if any(isinstance(err, ConfigError) for err in errors) else 1


def _unavailable() -> tuple[type[BaseException], ...]:
    """The drivers' errors of a request Cassandra could not answer; looked up
    only when an error reaches the handler (the write session's module is
    not loaded by commands that do not write)."""
    from ..store.write_session import unavailable_errors

    return unavailable_errors()


def _exit_interrupted(signum: int, frame: object) -> None:
    """Ctrl-C in a command that reads, checks or sets up: stop now, 130. Not
    by cancelling: the C++ driver (acsylla) blocks the whole process for
    ever when a connect in progress is cancelled (a Cassandra that accepts
    the connection and never answers), and there is nothing to finish."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    print("\ngateway: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _gateway_errors(exc: BaseException) -> list[GatewayError]:
    if isinstance(exc, GatewayError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        found: list[GatewayError] = []
        for inner in exc.exceptions:
            more = _gateway_errors(inner)
            if not more:
                return []
            found += more
        return found
    return []


if __name__ == "__main__":
    sys.exit(main())
