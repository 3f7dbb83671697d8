#!/usr/bin/env bash
# Local single-node Apache Cassandra 5.0, run from the official Maven Central
# artifacts (this project's hosts have no Docker engine and no tarball mirror).
#
#   cassandra.sh fetch    resolve cassandra-all + runtime deps into $STATE_DIR/cassandra/lib (once)
#   cassandra.sh start    start CassandraDaemon in the background, pid in $STATE_DIR/run/cassandra.pid
#   cassandra.sh wait     wait until a CQL query succeeds (deadline $CASSANDRA_READY_DEADLINE s)
#   cassandra.sh stop     stop the pid we started (TERM, then KILL after 30 s); nothing else
#   cassandra.sh status   one line: running or not, pid, CQL port
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
STATE_DIR="${STATE_DIR:-$root/.state}"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
CASSANDRA_HEAP="${CASSANDRA_HEAP:-1G}"
CASSANDRA_READY_DEADLINE="${CASSANDRA_READY_DEADLINE:-90}"
CQL_PORT=9042

lib="$STATE_DIR/cassandra/lib"
pidfile="$STATE_DIR/run/cassandra.pid"
logdir="$STATE_DIR/logs/cassandra"

die() { echo "cassandra: $*" >&2; exit 1; }

running_pid() {
    # Prints our pid if that process is alive and is really our CassandraDaemon.
    [[ -f "$pidfile" ]] || return 1
    local pid; pid="$(cat "$pidfile")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    grep -q "CassandraDaemon" "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

check_java() {
    command -v java >/dev/null || die "java not found: install a Java 17 JDK (Debian: apt-get install openjdk-17-jdk-headless)"
    local v; v="$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')"
    [[ "${v%%.*}" == "17" ]] || die "Java 17 is required (Cassandra 5.0 supports 11 and 17; this launcher uses the Java 17 flags); found java $v at $(command -v java)"
}

fetch() {
    local stamp="$lib/.resolved"
    if [[ -f "$stamp" && "$stamp" -nt "$here/pom.xml" ]]; then
        return 0
    fi
    command -v mvn >/dev/null || die "mvn not found: install Maven (Debian: apt-get install maven) to resolve cassandra-all from Maven Central"
    echo "cassandra: resolving cassandra-all and its runtime dependencies from Maven Central (once)..."
    rm -rf "$lib"; mkdir -p "$lib"
    mvn -q -B -Dstyle.color=never -f "$here/pom.xml" dependency:copy-dependencies -DoutputDirectory="$lib" \
        || die "Maven could not resolve cassandra-all (see the output above)"
    ls "$lib"/cassandra-all-*.jar >/dev/null 2>&1 || die "cassandra-all jar missing from $lib after Maven ran"
    touch "$stamp"
}

start() {
    check_java
    fetch
    if pid="$(running_pid)"; then
        echo "cassandra: already running (pid $pid)"
        return 0
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$CQL_PORT") 2>/dev/null; then
        die "port 127.0.0.1:$CQL_PORT is already in use by a process this project did not start; stop it or point the gateway at it (see README)"
    fi
    mkdir -p "$STATE_DIR/cassandra" "$STATE_DIR/run" "$logdir"
    local jamm; jamm="$(ls "$lib"/jamm-*.jar | head -n1)"
    local -a jvm17; mapfile -t jvm17 < <(grep -v '^\s*#' "$here/jvm17-server.options" | sed '/^\s*$/d' | tr ' ' '\n')
    # Heap fixed at about 1 GB: the box is small and shared with the gateway and tests.
    setsid java \
        -Xms"$CASSANDRA_HEAP" -Xmx"$CASSANDRA_HEAP" -Xss256k \
        -XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxTenuringThreshold=1 \
        -XX:G1HeapRegionSize=16m -XX:G1RSetUpdatingPauseTimePercent=5 -XX:MaxGCPauseMillis=300 \
        -XX:InitiatingHeapOccupancyPercent=70 -XX:+UseTLAB -XX:+ResizeTLAB -XX:+PerfDisableSharedMem \
        -XX:+HeapDumpOnOutOfMemoryError -XX:+ExitOnOutOfMemoryError -XX:HeapDumpPath="$STATE_DIR/cassandra" \
        -ea -da:net.openhft... -Djava.net.preferIPv4Stack=true \
        -Dio.netty.tryReflectionSetAccessible=true -Dio.netty.allocator.useCacheForAllThreads=true \
        -Dio.netty.allocator.maxOrder=11 \
        "${jvm17[@]}" \
        -javaagent:"$jamm" \
        -Dcassandra-foreground=yes \
        -Dcassandra.config="file://$here/cassandra.yaml" \
        -Dcassandra.storagedir="$STATE_DIR/cassandra" \
        -Dcassandra.logdir="$logdir" \
        -Dlogback.configurationFile="$here/logback.xml" \
        -Dcassandra.jmx.local.port=7199 \
        -Dcassandra.skip_wait_for_gossip_to_settle=0 \
        -Dcassandra.ring_delay_ms=1000 \
        -cp "$lib/*" \
        org.apache.cassandra.service.CassandraDaemon \
        >>"$logdir/console.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    echo "cassandra: started (pid $!), log $logdir/system.log"
}

wait_ready() {
    local pid
    pid="$(running_pid)" || die "not running (no live pid in $pidfile); see $logdir/console.log"
    "$PYTHON" "$here/wait_ready.py" --port "$CQL_PORT" --deadline "$CASSANDRA_READY_DEADLINE" \
        --pid "$pid" --log "$logdir/system.log" --console "$logdir/console.log"
}

stop() {
    local pid
    if ! pid="$(running_pid)"; then
        rm -f "$pidfile"
        echo "cassandra: not running"
        return 0
    fi
    kill -TERM "$pid"
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; echo "cassandra: stopped (pid $pid)"; return 0; }
        sleep 0.5
    done
    echo "cassandra: pid $pid did not stop within 30 s, killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

status() {
    local pid
    if pid="$(running_pid)"; then
        if (exec 3<>"/dev/tcp/127.0.0.1/$CQL_PORT") 2>/dev/null; then
            echo "cassandra: running (pid $pid), CQL on 127.0.0.1:$CQL_PORT"
        else
            echo "cassandra: starting (pid $pid), CQL port $CQL_PORT not open yet"
        fi
    else
        echo "cassandra: not running"
        return 3
    fi
}

# nodetool from the same jars, over the local JMX port (tests flush and compact with it).
nodetool() {
    running_pid >/dev/null || die "not running (no live pid in $pidfile)"
    local -a jvm17; mapfile -t jvm17 < <(grep -v '^\s*#' "$here/jvm17-server.options" | sed '/^\s*$/d' | tr ' ' '\n')
    # Its command history goes to the tools output directory: keep it in .state/.
    java "${jvm17[@]}" -Xmx128m -cp "$lib/*" -Dlogback.configurationFile="$here/logback.xml" \
        -Dcassandra.logdir="$logdir" -Duser.home="$STATE_DIR/cassandra" \
        org.apache.cassandra.tools.NodeTool -h 127.0.0.1 -p 7199 "$@"
}

case "${1:-}" in
    fetch) check_java; fetch ;;
    start) start ;;
    wait) wait_ready ;;
    stop) stop ;;
    status) status ;;
    nodetool) shift; nodetool "$@" ;;
    *) echo "usage: $0 fetch|start|wait|stop|status|nodetool ARGS..." >&2; exit 2 ;;
esac
