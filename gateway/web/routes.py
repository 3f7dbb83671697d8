"""The read API's routes: each path, the ReadApi method that answers it
(gateway/web/api.py), the query parameters it takes and what its answer is.
The server routes and checks parameters from this table, and the OpenAPI
document (gateway/web/openapi.py) is built from it: a new endpoint starts here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..store import queries
from ..store.rollups import VALUE_METRIC

PREFIX = "/api/v1"
DEFAULT_LIMIT = 100
# A roll-up query's window and metric when it names none (`gateway rollup` says the same).
DEFAULT_STEP = "1m"
DEFAULT_METRIC = VALUE_METRIC
MAX_LIMIT = 500
MAX_PARAM = 512  # characters in any query parameter but a cursor
# A cursor the server gave out: a device cursor holds a device id (up to
# limits.max_topic_level_length characters, 3 bytes each in UTF-8, then base64).
MAX_CURSOR = 6000
# A tag filter: a key (limits.max_key_length, 64 by default; its ':' '=' '\\'
# escaped) and a value (limits.max_text_length, 1,024 by default), with room
# to spare: a value of 513 to 1,024 characters was over MAX_PARAM, so no
# filter could find it. Fixed, not from the config: limits raised past it
# store longer tags that no filter can name (README, Known limits).
MAX_TAG = 4096


def max_length(name: str) -> int:
    """How many characters the query parameter ``name`` may hold."""
    return MAX_CURSOR if name == "cursor" else MAX_TAG if name == "tag" else MAX_PARAM


@dataclass(frozen=True, slots=True)
class Param:
    """A query parameter a route takes. The server refuses any other
    (``_check_params``) and the OpenAPI document declares exactly these."""

    name: str
    description: str
    schema: Mapping[str, Any]
    required: bool = False
    example: str | int | None = None


_TIME_FORMS = (
    "an RFC 3339 time (without an offset: UTC) or a duration ago with its unit "
    "(30m, 2h, 7d; a bare number is a 400)"
)
LIMIT = Param(
    "limit",
    f"How many at most (1-{MAX_LIMIT}, default {DEFAULT_LIMIT}).",
    {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
    example=10,
)
CURSOR = Param(
    "cursor",
    "Where to go on from: the next_cursor of the previous page (opaque; absent or empty: "
    "the first page; one given out for another tenant, state, device or filter is a 400).",
    {"type": "string"},
)
SINCE = Param(
    "since",
    f"From this time: {_TIME_FORMS}. Default 24 h ago.",
    {"type": "string"},
    example="2h",
)
HISTORY_UNTIL = Param(
    "until",
    f"Up to this time: {_TIME_FORMS}. Default now plus limits.max_future_skew (5 min unless "
    "configured): events a device's clock dated ahead are shown too.",
    {"type": "string"},
    example="30m",
)
UNTIL = Param(
    "until",
    f"Up to this time: {_TIME_FORMS}. Default now.",
    {"type": "string"},
    example="30m",
)
LIST_PARAMS = (
    LIMIT,
    CURSOR,
    Param(
        "prefix",
        "Only devices whose id starts with this (a filter: a page may come back short, "
        "with a cursor, when many rows were read without filling it).",
        {"type": "string"},
        example="f3-",
    ),
    Param(
        "tag",
        "Only devices whose latest event carries this tag value: KEY:VALUE or KEY=VALUE "
        "(split at the first : or = of the key; a key that holds : = or \\ writes them "
        "\\: \\= \\\\).",
        {"type": "string"},
        example="floor:3",
    ),
)
FIND_PARAMS = (
    Param(
        "prefix",
        "The start of a device id, whatever the case (required).",
        {"type": "string"},
        required=True,
        example="lobby",
    ),
    LIMIT,
)
HISTORY_PARAMS = (SINCE, HISTORY_UNTIL, LIMIT, CURSOR)
ROLLUP_PARAMS = (
    SINCE,
    UNTIL,
    Param(
        "step",
        "The window: 1m or 1h (default 1m).",
        {"type": "string", "enum": list(queries.ROLLUP_STEPS), "default": DEFAULT_STEP},
        example="1h",
    ),
    Param(
        "metric",
        "The metric (default value: the event's numeric value).",
        {"type": "string", "default": DEFAULT_METRIC},
        example="temperature",
    ),
)
META_DEVICES_PARAMS = (
    Param(
        "tag",
        "The tag value: KEY=VALUE or KEY:VALUE (split at the first : or = of the key; a "
        "key that holds : = or \\ writes them \\: \\= \\\\).",
        {"type": "string"},
        required=True,
        example="floor=3",
    ),
)
REJECTED_PARAMS = (
    Param(
        "since",
        f"From this time: {_TIME_FORMS}. Default 1 h ago; at most "
        f"{queries.MAX_REJECTED_HOURS // 24} days back (older ones are not kept).",
        {"type": "string"},
        example="2h",
    ),
    LIMIT,
)


@dataclass(frozen=True, slots=True)
class Route:
    """A route under PREFIX: the ReadApi method that answers it, the query
    parameters it takes, and for the OpenAPI document what it says, its 200
    answer (a schema under components) and, if it has one, its own 404."""

    template: str
    handler: str
    params: tuple[Param, ...]
    summary: str
    answer: str
    not_found: str = ""
    description: str = ""


# Each route and the query parameters it takes: any other (a typo such as
# "tags" or "Limit") is a 400, never silently unfiltered data.
ROUTES = (
    Route("/me", "_me", (), "The tenants this token reads", "Me"),
    Route("/tenants/{tenant}/states", "_states", (), "States and their device counts", "States"),
    Route(
        "/tenants/{tenant}/states/{state}/devices",
        "_devices",
        LIST_PARAMS,
        "One page of the devices in a state",
        "DevicePage",
    ),
    Route(
        "/tenants/{tenant}/devices",
        "_find",
        FIND_PARAMS,
        "Devices whose id starts with a prefix, in any state",
        "FoundDevices",
        description="The device named exactly first (read by its key: a device with no state "
        "is found by its exact id only), then by id. The states share "
        f"{queries.FIND_ROWS:,} rows read (at least {queries.FIND_STATE_ROWS} each): complete "
        "is false when more match than limit, or a state's search stopped at its share "
        "(cut_short names those states; a state's own list, with prefix, goes on from there). "
        "Each state's matches come in the table's order, so an incomplete answer holds some "
        "of them, not the first ids.",
    ),
    Route(
        "/tenants/{tenant}/devices/{device_id}",
        "_device",
        (),
        "A device's latest event",
        "LatestEvent",
        not_found="no such device in the tenant",
    ),
    Route(
        "/tenants/{tenant}/devices/{device_id}/history",
        "_history",
        HISTORY_PARAMS,
        "A device's raw events, newest first",
        "History",
        not_found="no such device in the tenant (an empty first page of one that is: [])",
    ),
    Route(
        "/tenants/{tenant}/devices/{device_id}/rollups",
        "_rollups",
        ROLLUP_PARAMS,
        "A device's 1-minute or 1-hour aggregates of one metric, oldest first",
        "Rollups",
        not_found="no such device in the tenant, or, with no windows to answer, a metric no "
        "device of the tenant has sent (by its metadata, when on and not capped)",
        description=f"since to until spans at most {queries.MAX_ROLLUP_WINDOWS} windows; "
        "the window holding since is returned too",
    ),
    Route(
        "/tenants/{tenant}/meta/metrics", "_meta", (), "Metric names the tenant uses", "MetaMetrics"
    ),
    Route("/tenants/{tenant}/meta/tags", "_meta", (), "Tag keys the tenant uses", "MetaTags"),
    Route(
        "/tenants/{tenant}/meta/tags/{key}/values",
        "_meta",
        (),
        "The values a tag key has had",
        "MetaTagValues",
    ),
    Route(
        "/tenants/{tenant}/meta/devices",
        "_meta",
        META_DEVICES_PARAMS,
        "Devices that have carried a tag value",
        "MetaDevices",
    ),
    Route(
        "/tenants/{tenant}/rejected",
        "_rejected",
        REJECTED_PARAMS,
        "Messages the gateway rejected, and why, newest first",
        "Rejected",
    ),
)
