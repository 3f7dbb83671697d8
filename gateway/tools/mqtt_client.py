"""The tools' MQTT client: ``gateway check``, ``gateway forget-session``, ``gateway simulate``.

aiomqtt 2 through its public API only. The gateway's own receive path does not
use it (gateway/ingest/connection.py): the tools need no acknowledge-after-
durable, no pausable reads and no per-message speed, and a publisher is what
aiomqtt does well.
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
    max_inflight: int | None = None,
    timeout: float = 10,
) -> aiomqtt.Client:
    """An MQTT v5 client for the configured broker: address, credentials, TLS.

    One place for what the tools' connections share; the password is only
    read here and in the receiver's ConnectOptions. ``max_inflight`` bounds our own unacknowledged
    QoS 1 publishes (the simulator's).
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
        max_inflight_messages=max_inflight,
    )
