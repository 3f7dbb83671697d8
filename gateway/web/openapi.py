"""The read API as an OpenAPI 3.1 document (/api/v1/openapi.json), built
from the route table (gateway/web/routes.py): every route's query
parameters, with the bounds the server applies, its answer's schema, the
ETag/If-None-Match 304 and the errors."""

from __future__ import annotations

import re
from typing import Any

from ..store import queries
from .routes import (
    MAX_CURSOR,
    MAX_LIMIT,
    MAX_PARAM,
    MAX_TAG,
    PREFIX,
    ROUTES,
    Param,
    Route,
    max_length,
)


def _query_parameter(param: Param) -> dict[str, Any]:
    schema = dict(param.schema)
    if schema.get("type") == "string":
        # As _check_params bounds them.
        schema["maxLength"] = max_length(param.name)
    out: dict[str, Any] = {
        "name": param.name,
        "in": "query",
        "required": param.required,
        "description": param.description,
        "schema": schema,
    }
    if param.example is not None:
        out["example"] = param.example
    return out


def _operation(route: Route) -> dict[str, Any]:
    names = re.findall(r"\{(\w+)\}", route.template)
    parameters = [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
    ]
    parameters += [_query_parameter(p) for p in route.params]
    parameters.append({"$ref": "#/components/parameters/IfNoneMatch"})
    responses: dict[str, Any] = {
        "200": {
            "description": "The answer, with its ETag",
            "headers": {
                "ETag": {"$ref": "#/components/headers/ETag"},
                "Cache-Control": {"$ref": "#/components/headers/CacheControl"},
            },
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{route.answer}"}}
            },
        },
        "304": {"$ref": "#/components/responses/NotModified"},
        "400": {"$ref": "#/components/responses/BadParameter"},
        "401": {"$ref": "#/components/responses/Unauthorized"},
    }
    if "tenant" in names:
        responses["403"] = {"$ref": "#/components/responses/Forbidden"}
    if route.not_found:
        responses["404"] = {
            "description": route.not_found,
            "content": _ERROR_CONTENT,
        }
    responses["503"] = {"$ref": "#/components/responses/Unavailable"}
    operation: dict[str, Any] = {
        "summary": route.summary,
        "description": route.description,
        "operationId": "get" + route.answer,
        "security": [{"bearer": []}],
        "parameters": parameters,
        "responses": responses,
    }
    return {"get": operation}


def _object(description: str, **properties: Any) -> dict[str, Any]:
    """An object schema with every property present in each answer."""
    return {
        "type": "object",
        "description": description,
        "required": list(properties),
        "properties": properties,
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _list(items: Any) -> dict[str, Any]:
    return {"type": "array", "items": items}


_STRING = {"type": "string"}
_TIME = {"type": "string", "format": "date-time", "description": "RFC 3339, UTC, milliseconds"}
_VALUE = {"type": ["number", "string", "null"], "description": "the event's value"}
_TAGS = {"type": "object", "additionalProperties": {"type": "string"}}
_METRICS = {"type": "object", "additionalProperties": {"type": "number"}}
_NEXT = {"type": ["string", "null"], "description": "the next page's cursor; null: no more"}
_TRUNCATED = {
    "type": "boolean",
    "description": f"true when the list stopped at {queries.MAX_META} entries and there are more",
}
_CAPPED = {
    "type": "boolean",
    "description": "true when the tenant has reached metadata.max_per_tenant: entries"
    " since are not recorded, so the list may be incomplete",
}
_ERROR_CONTENT = {"application/json": {"schema": _ref("Error")}}
_SCHEMAS: dict[str, Any] = {
    "Error": _object(
        "Every error under /api/v1",
        error={
            "type": "string",
            "description": "a code: bad_parameter, unauthorized, forbidden, not_found, "
            "method_not_allowed, unavailable, busy (too many requests at once), "
            "internal_error",
        },
        detail={"type": "string", "description": "what went wrong, for a person"},
    ),
    "Me": _object(
        "What the token reads",
        admin={"type": "boolean"},
        tenants=_list(_STRING),
    ),
    "States": _object(
        "A tenant's states and how many devices are in each, most devices first",
        tenant=_STRING,
        as_of=_TIME | {"description": "when these counts were taken"},
        cached_for_s={"type": "number", "description": "how long these counts are kept"},
        states=_list(_object("A state", state=_STRING, devices={"type": "integer"})),
    ),
    "DeviceInState": _object(
        "A device in a state: its latest event",
        device_id=_STRING,
        ts=_TIME,
        value=_VALUE,
        tags=_TAGS,
    ),
    "DevicePage": _object(
        "One page of a state's devices, in the table's order, each page sorted by id",
        tenant=_STRING,
        state=_STRING,
        devices=_list(_ref("DeviceInState")),
        next_cursor=_NEXT,
    ),
    "FoundDevices": _object(
        "Devices whose id starts with a prefix, in any state: the one named exactly first",
        tenant=_STRING,
        prefix=_STRING,
        devices=_list(
            _object(
                "A device found: its latest event",
                device_id=_STRING,
                state={"type": ["string", "null"], "description": "null: its events carry none"},
                ts=_TIME,
                value=_VALUE,
                tags=_TAGS,
            )
        ),
        complete={
            "type": "boolean",
            "description": "false when more match than limit, or a state's search stopped "
            "at its share of the rows one search reads (cut_short)",
        },
        cut_short=_list(_STRING)
        | {"description": "the states whose search stopped before reading them whole"},
    ),
    "LatestEvent": _object(
        "A device's latest event",
        device_id=_STRING,
        state={"type": ["string", "null"]},
        ts=_TIME,
        value=_VALUE,
        metrics=_METRICS,
        tags=_TAGS,
    ),
    "Event": _object(
        "One raw event",
        ts=_TIME,
        state={"type": ["string", "null"]},
        value=_VALUE,
        metrics=_METRICS,
        tags=_TAGS,
    ),
    "History": _object(
        "A page of a device's events, newest first, de-duplicated",
        tenant=_STRING,
        device_id=_STRING,
        events=_list(_ref("Event")),
        next_cursor=_NEXT,
    ),
    "Rollup": _object(
        "One window's aggregate",
        start=_TIME | {"description": "the window's start"},
        count={"type": "integer"},
        min={"type": "number"},
        max={"type": "number"},
        sum={"type": ["number", "null"], "description": "null: beyond the range of a double"},
        last={"type": "number"},
    ),
    "Rollups": _object(
        "A device's windows of one metric, oldest first",
        tenant=_STRING,
        device_id=_STRING,
        metric=_STRING,
        step={"type": "string", "enum": list(queries.ROLLUP_STEPS)},
        rollups=_list(_ref("Rollup")),
        done_until=_TIME
        | {
            "type": ["string", "null"],
            "description": "the roll-up worker's progress: what was written from then on is"
            " not rolled up yet (each minute about 2 min after it began); null when no"
            " worker has run",
        },
    ),
    "MetaMetrics": _object(
        "Metric names the tenant's devices use",
        tenant=_STRING,
        metrics=_list(_STRING),
        truncated=_TRUNCATED,
        capped=_CAPPED,
    ),
    "MetaTags": _object(
        "Tag keys the tenant's devices use",
        tenant=_STRING,
        tags=_list(_STRING),
        truncated=_TRUNCATED,
        capped=_CAPPED,
    ),
    "MetaTagValues": _object(
        "The values a tag key has had",
        tenant=_STRING,
        tag=_STRING,
        values=_list(_STRING),
        truncated=_TRUNCATED,
        capped=_CAPPED,
    ),
    "MetaDevices": _object(
        "Devices that have carried a tag value",
        tenant=_STRING,
        tag=_STRING,
        value=_STRING,
        devices=_list(_STRING),
        truncated=_TRUNCATED,
        capped=_CAPPED,
    ),
    "RejectedMessage": _object(
        "A message the gateway did not store, and why",
        received_at=_TIME,
        topic=_STRING,
        device_id={"type": ["string", "null"]},
        reason=_STRING,
        detail=_STRING,
        payload_size={"type": ["integer", "null"]},
        payload={
            "type": ["string", "null"],
            "description": "the payload as kept (its first `limits.rejected_payload_bytes`, "
            "2,048 by default): the text when it is UTF-8, else base64",
        },
        payload_encoding={"type": ["string", "null"], "enum": ["utf-8", "base64", None]},
        payload_truncated={
            "type": "boolean",
            "description": "true when the payload was longer than what was kept",
        },
    ),
    "Rejected": _object(
        f"The tenant's rejected messages, newest first (kept "
        f"{queries.MAX_REJECTED_HOURS // 24} days)",
        tenant=_STRING,
        rejected=_list(_ref("RejectedMessage")),
        truncated={
            "type": "boolean",
            "description": "true when the limit left older ones (since `since`) out",
        },
    ),
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "MQTT gateway read API",
        "version": "1",
        "description": (
            "Every route is GET with Authorization: Bearer <token>. Every 200 answer "
            "carries an ETag; send it back in If-None-Match and an unchanged answer is "
            'a 304 with no body (poll with it). Errors are {"error", "detail"}. A '
            "query parameter a route does not take, or one given twice, is a 400; "
            f"a parameter may be {MAX_PARAM} characters long, a tag {MAX_TAG}, a cursor "
            f"{MAX_CURSOR}."
        ),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": _SCHEMAS,
        "parameters": {
            "IfNoneMatch": {
                "name": "If-None-Match",
                "in": "header",
                "required": False,
                "description": "ETags of answers already held: if this answer's is one, "
                "the answer is a 304 with no body",
                "schema": {"type": "string"},
            }
        },
        "headers": {
            "ETag": {
                "description": "A hash of the answer's body (for the states: of all but "
                "as_of, so unchanged counts are a 304)",
                "schema": {"type": "string"},
            },
            "CacheControl": {
                "description": "no-cache: ask again, with If-None-Match",
                "schema": {"type": "string"},
            },
            "RetryAfter": {
                "description": "Seconds to wait before asking again",
                "schema": {"type": "integer"},
            },
            "WWWAuthenticate": {
                "description": "Bearer",
                "schema": {"type": "string"},
            },
        },
        "responses": {
            "NotModified": {
                "description": "Unchanged: If-None-Match held this answer's ETag (no body)",
                "headers": {"ETag": {"$ref": "#/components/headers/ETag"}},
            },
            "BadParameter": {
                "description": "bad_parameter: a bad query parameter, named first in detail "
                f"(limit: must be between 1 and {MAX_LIMIT} (got 0)); a parameter the "
                "route does not take, one given twice or one too long is a 400 too",
                "content": _ERROR_CONTENT,
            },
            "Unauthorized": {
                "description": "unauthorized: no token, or an unknown or revoked one",
                "headers": {"WWW-Authenticate": {"$ref": "#/components/headers/WWWAuthenticate"}},
                "content": _ERROR_CONTENT,
            },
            "Forbidden": {
                "description": "forbidden: a token of another tenant",
                "content": _ERROR_CONTENT,
            },
            "Unavailable": {
                "description": "unavailable: Cassandra did not answer, the tokens file cannot "
                "be read now, or the gateway is only spooling; busy: too many requests at "
                "once. Ask again after Retry-After",
                "headers": {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}},
                "content": _ERROR_CONTENT,
            },
        },
    },
    "paths": {PREFIX + route.template: _operation(route) for route in ROUTES},
}
