"""The tools' MQTT client: ``gateway check`` and ``gateway forget-session``.

aiomqtt 2 through its public API only. The gateway's own receive path does not
use it (gateway/ingest/connection.py): these tools need no acknowledge-after-
durable, no pausable reads and no per-message speed. ``gateway simulate``
publishes over the receive path's connection instead, because a load
generator on the gateway's own cores has to cost little (gateway/tools/simulate.py).
"""

from __future__ import annotations

import logging

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..config import MqttConfig


def mqtt_client(
    cfg: MqttConfig,
    *,
    identifier: str | None = None,
    clean_start: bool = False,
    session_expiry: int | None = None,
    receive_maximum: int | None = None,
    timeout: float = 10,
) -> aiomqtt.Client:
    """An MQTT v5 client for the configured broker: address, credentials, TLS.

    One place for what the tools' connections share; the password is only
    read here and in ConnectOptions.for_broker (gateway/ingest/connection.py).
    """
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    if session_expiry is not None:
        props.SessionExpiryInterval = session_expiry
    if receive_maximum is not None:
        props.ReceiveMaximum = receive_maximum
    return aiomqtt.Client(
        cfg.host,
        cfg.port,
        identifier=identifier or cfg.client_id,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=clean_start,
        properties=props,
        keepalive=cfg.keepalive,
        username=cfg.username,
        password=cfg.password.get_secret_value() if cfg.password else None,
        tls_context=cfg.tls.context(),
        timeout=timeout,
        logger=logging.getLogger(f"{__name__}.paho"),
    )
