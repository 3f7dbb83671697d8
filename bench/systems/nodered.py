"""Node-RED: mqtt-in (QoS 1) → function node with cassandra-driver
(bench/nodered/), installed with npm into bench/.node-red on first use. Its MQTT
client acknowledges on receipt, before the function node writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import rows
from benchlib import BENCH, Proc
from harness import Bench
from phases.sustained import drain

NODE_DIR = BENCH / ".node-red"
NODE_RED_VERSION = "4.1.8"
CASSANDRA_DRIVER_JS_VERSION = "4.10.0"


def run(bench: Bench) -> None:
    reason = install_node_red(bench.say)
    if reason is not None:
        bench.results["systems"]["nodered"] = {"status": f"not measured: {reason}"}
        bench.say(f"Node-RED not measured: {reason}")
        return
    user = NODE_DIR / "user"
    modules = NODE_DIR / "node_modules"

    def make(cid: str) -> Proc:
        write_flows(user, cid)
        env = dict(os.environ, BENCH_NODE_MODULES=str(modules), BENCH_KEYSPACE=rows.KEYSPACE)
        return Proc(
            "nodered",
            [
                "node",
                str(modules / "node-red" / "red.js"),
                "--userDir",
                str(user),
                "--settings",
                str(BENCH / "nodered" / "settings.js"),
            ],
            env,
            bench.log("nodered"),
            [re.compile("Connected to broker"), re.compile("cassandra connected")],
            re.compile(r"written=(\d+)"),
        )

    result, _ = drain(
        bench, "nodered", make, count=bench.args.nodered_count, devices=bench.args.devices
    )
    result.extra["version"] = NODE_RED_VERSION
    failed = re.findall(r"failed=(\d+)", bench.log("nodered").read_text())
    result.extra["write_failures"] = int(failed[-1]) if failed else None
    bench.results["systems"]["nodered"] = result.as_json()


def install_node_red(say: Callable[[str], None]) -> str | None:
    """Install Node-RED and cassandra-driver into bench/.node-red; the reason if not."""
    node = shutil.which("node")
    npm = shutil.which("npm")
    if node is None or npm is None:
        return "node/npm not installed (apt-get install nodejs npm)"
    wanted = {"node-red": NODE_RED_VERSION, "cassandra-driver": CASSANDRA_DRIVER_JS_VERSION}
    have = {}
    for name in wanted:
        pkg = NODE_DIR / "node_modules" / name / "package.json"
        if pkg.exists():
            have[name] = json.loads(pkg.read_text()).get("version")
    if have == wanted:
        return None
    say(f"npm install node-red@{NODE_RED_VERSION} cassandra-driver@{CASSANDRA_DRIVER_JS_VERSION}")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--save-exact", "--loglevel=error"]
        + [f"{k}@{v}" for k, v in wanted.items()],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        return f"npm install failed: {(done.stderr or done.stdout).strip()[-400:]}"
    return None


def write_flows(user: Path, client_id: str) -> None:
    code = BENCH / "nodered"
    user.mkdir(parents=True, exist_ok=True)
    flows = [
        {"id": "b0a1", "type": "tab", "label": "bench"},
        {
            "id": "b0b1",
            "type": "mqtt-broker",
            "name": "local",
            "broker": "127.0.0.1",
            "port": "1883",
            "clientid": client_id,
            "autoConnect": True,
            "usetls": False,
            "protocolVersion": "5",
            "keepalive": "60",
            "cleansession": False,
            "autoUnsubscribe": False,
            "sessionExpiry": "600",
            "birthTopic": "",
            "closeTopic": "",
            "willTopic": "",
        },
        {
            "id": "b0c1",
            "type": "mqtt in",
            "z": "b0a1",
            "name": "events",
            "topic": rows.SUBSCRIPTION,
            "qos": "1",
            "datatype": "json",
            "broker": "b0b1",
            "nl": False,
            "rap": True,
            "rh": 0,
            "inputs": 0,
            "wires": [["b0d1"]],
        },
        {
            "id": "b0d1",
            "type": "function",
            "z": "b0a1",
            "name": "writer",
            "func": (code / "on_message.js").read_text(),
            "outputs": 0,
            "timeout": 0,
            "noerr": 0,
            "initialize": (code / "on_start.js").read_text(),
            "finalize": (code / "on_stop.js").read_text(),
            "libs": [],
            "wires": [],
        },
    ]
    (user / "flows.json").write_text(json.dumps(flows, indent=1))
