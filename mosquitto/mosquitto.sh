#!/usr/bin/env bash
# Local Mosquitto broker (Debian package), started in the background with a pid file.
#
#   mosquitto.sh install  apt-get install mosquitto mosquitto-clients when missing
#   mosquitto.sh start    render the config into $STATE_DIR/mosquitto and start the broker
#   mosquitto.sh stop     stop the pid we started; nothing else
#   mosquitto.sh status   one line
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
STATE_DIR="${STATE_DIR:-$root/.state}"
MQTT_PORT="${MQTT_PORT:-1883}"
CONF_TEMPLATE="${MOSQUITTO_CONF:-$here/mosquitto.conf.in}"

pidfile="$STATE_DIR/run/mosquitto.pid"
conf="$STATE_DIR/mosquitto/mosquitto.conf"

die() { echo "mosquitto: $*" >&2; exit 1; }

running_pid() {
    [[ -f "$pidfile" ]] || return 1
    local pid; pid="$(cat "$pidfile")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    grep -q "mosquitto" "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

install() {
    if command -v mosquitto >/dev/null 2>&1 || [[ -x /usr/sbin/mosquitto ]]; then
        command -v mosquitto_pub >/dev/null 2>&1 && return 0
    fi
    local sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    echo "mosquitto: installing the Debian packages mosquitto and mosquitto-clients..."
    $sudo apt-get update -qq || die "apt-get update failed"
    # The package's service is not ours to run: we start our own broker below.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        mosquitto mosquitto-clients >/dev/null || die "apt-get install mosquitto mosquitto-clients failed"
}

binary() {
    command -v mosquitto 2>/dev/null || { [[ -x /usr/sbin/mosquitto ]] && echo /usr/sbin/mosquitto; } \
        || die "mosquitto not installed (run: make up)"
}

start() {
    install
    if pid="$(running_pid)"; then
        echo "mosquitto: already running (pid $pid)"
        return 0
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$MQTT_PORT") 2>/dev/null; then
        die "port 127.0.0.1:$MQTT_PORT is already in use by a process this project did not start (a system mosquitto service? stop it, or set MQTT_PORT)"
    fi
    mkdir -p "$STATE_DIR/mosquitto" "$STATE_DIR/run" "$STATE_DIR/logs"
    sed -e "s|@STATE_DIR@|$STATE_DIR|g" -e "s|@USER@|$(id -un)|g" -e "s|@PORT@|$MQTT_PORT|g" \
        "$CONF_TEMPLATE" >"$conf"
    setsid "$(binary)" -c "$conf" >>"$STATE_DIR/logs/mosquitto.console.log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$pidfile"
    for _ in $(seq 1 50); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$MQTT_PORT") 2>/dev/null; then
            echo "mosquitto: running (pid $pid) on 127.0.0.1:$MQTT_PORT"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    tail -n 20 "$STATE_DIR/logs/mosquitto.console.log" "$STATE_DIR/logs/mosquitto.log" >&2 2>/dev/null || true
    die "broker did not open 127.0.0.1:$MQTT_PORT within 5 s (log above)"
}

stop() {
    local pid
    if ! pid="$(running_pid)"; then
        rm -f "$pidfile"
        echo "mosquitto: not running"
        return 0
    fi
    # TERM makes Mosquitto save its persistence file before exiting.
    kill -TERM "$pid"
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; echo "mosquitto: stopped (pid $pid)"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    echo "mosquitto: pid $pid killed after 10 s" >&2
}

status() {
    local pid
    if pid="$(running_pid)"; then
        echo "mosquitto: running (pid $pid) on 127.0.0.1:$MQTT_PORT"
    else
        echo "mosquitto: not running"
        return 3
    fi
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
