"""The payload's pydantic model: decode.py's slow path, which names the bad
field of a payload its fast checks did not accept.

The model is a class made per config (its limits are in the field types).
It lives apart from decode.py because decode.py is compiled (mypyc, setup.py),
and mypyc compiles no class made inside a function.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from ..config import LimitsConfig

# The longest text timestamp (RFC 3339 with nanoseconds and an offset is 35).
MAX_TS_TEXT = 64


def payload_model(limits: LimitsConfig) -> type[Any]:
    """A pydantic model of one event under ``limits`` (a ``BaseModel`` subclass;
    ``type[Any]`` lets decode.py read its fields)."""
    key = Annotated[StrictStr, Field(min_length=1, max_length=limits.max_key_length)]
    text = Annotated[StrictStr, Field(max_length=limits.max_text_length)]
    number = Annotated[StrictInt | StrictFloat, Field(allow_inf_nan=False)]

    class Payload(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
        ts: StrictInt | Annotated[StrictStr, Field(max_length=MAX_TS_TEXT)] | None = None
        state: (
            Annotated[StrictStr, Field(min_length=1, max_length=limits.max_state_length)] | None
        ) = None
        value: text | number | None = None
        # None (null) is as if left out, as for every field.
        metrics: Annotated[dict[key, number], Field(max_length=limits.max_metrics)] | None = None
        tags: Annotated[dict[key, text], Field(max_length=limits.max_tags)] | None = None
        sent_at: number | None = None

    return Payload
