#!/usr/bin/env bash
# Local Apache Cassandra 5.0, run from the official Maven Central artifacts
# (this project's hosts have no Docker engine and no tarball mirror): one node
# (the default), or CASSANDRA_NODES=3 nodes on 127.0.0.1..3 as ccm runs them
# (same ports on each address, JMX on 7000 + 100*i, data, logs and pid per node).
#
#   cassandra.sh fetch    resolve cassandra-all + runtime deps into $STATE_DIR/cassandra/lib (once)
#   cassandra.sh start    start the node(s) in the background, one at a time (each once
#                         the one before answers CQL): the seed 127.0.0.2 first, 127.0.0.1
#                         last; pids in $STATE_DIR/run/
#   cassandra.sh start-others   a cluster's nodes but 127.0.0.1, the same way: they can
#                         start while the single node still runs (make test does so)
#   cassandra.sh wait     wait until every node answers CQL (deadline $CASSANDRA_READY_DEADLINE s each)
#   cassandra.sh stop     stop the pids we started (TERM, then KILL after 30 s); nothing else
#   cassandra.sh status   a line per node: running or not, pid, CQL address; non-zero if one is down
#   cassandra.sh start-node I | stop-node I | kill-node I    one node of the cluster (the
#                         cluster's fault tests); kill-node is SIGKILL
#   cassandra.sh nodetool ARGS...   on node $CASSANDRA_NODE (default 1)
# CASSANDRA_HEAP sets each node's heap, CASSANDRA_GC its collector (g1; zgc and
# shenandoah for measuring: README, "Tried and not kept: ZGC").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
STATE_DIR="${STATE_DIR:-$root/.state}"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
CASSANDRA_NODES="${CASSANDRA_NODES:-1}"
[[ "$CASSANDRA_NODES" =~ ^[1-9]$ ]] || { echo "cassandra: CASSANDRA_NODES must be 1 to 9, not '$CASSANDRA_NODES'" >&2; exit 2; }
# About 1 GB for one node; 768 MB each for a cluster (three of them share this host).
if [[ "$CASSANDRA_NODES" == 1 ]]; then
    CASSANDRA_HEAP="${CASSANDRA_HEAP:-1G}"
else
    CASSANDRA_HEAP="${CASSANDRA_HEAP:-768M}"
fi
CASSANDRA_READY_DEADLINE="${CASSANDRA_READY_DEADLINE:-90}"
# The collector: g1 (the default, as Cassandra ships it), zgc or shenandoah.
CASSANDRA_GC="${CASSANDRA_GC:-g1}"
case "$CASSANDRA_GC" in
    g1) gc_opts=(-XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxTenuringThreshold=1
            -XX:G1HeapRegionSize=16m -XX:G1RSetUpdatingPauseTimePercent=5 -XX:MaxGCPauseMillis=300
            -XX:InitiatingHeapOccupancyPercent=70) ;;
    zgc) gc_opts=(-XX:+UseZGC) ;;
    shenandoah) gc_opts=(-XX:+UseShenandoahGC) ;;
    *) echo "cassandra: CASSANDRA_GC must be g1, zgc or shenandoah, not '$CASSANDRA_GC'" >&2; exit 2 ;;
esac
CQL_PORT=9042

lib="$STATE_DIR/cassandra/lib"

# Where node I lives: sets addr, jmx, pidfile, logdir, storage and conf. One node
# keeps the single-node layout ($STATE_DIR/cassandra, run/cassandra.pid, JMX 7199);
# a cluster's node I is under $STATE_DIR/cassandra-cluster/nodeI, so a cluster and
# the single node never share data. Only the cluster's node 1 and the single node
# can't run together (both use 127.0.0.1), so the cluster's seed is node 2, and
# nodes 2..N can start while the single node still serves.
node() {
    local i="$1"
    [[ "$i" =~ ^[1-9]$ && "$i" -le "$CASSANDRA_NODES" ]] \
        || die "no node '$i' (CASSANDRA_NODES=$CASSANDRA_NODES)"
    addr="127.0.0.$i"
    if [[ "$CASSANDRA_NODES" == 1 ]]; then
        jmx=7199
        pidfile="$STATE_DIR/run/cassandra.pid"
        logdir="$STATE_DIR/logs/cassandra"
        storage="$STATE_DIR/cassandra"
        conf="$here/cassandra.yaml"
    else
        jmx=$((7000 + 100 * i))
        pidfile="$STATE_DIR/run/cassandra-node$i.pid"
        logdir="$STATE_DIR/logs/cassandra-node$i"
        storage="$STATE_DIR/cassandra-cluster/node$i"
        conf="$storage/cassandra.yaml"
    fi
}
node 1

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

# The other layout's node on 127.0.0.1: the single node, or the cluster's node 1.
other_layout_running() {
    local f pid
    if [[ "$CASSANDRA_NODES" == 1 ]]; then
        set -- "$STATE_DIR/run/cassandra-node1.pid"
    else
        set -- "$STATE_DIR/run/cassandra.pid"
    fi
    for f in "$@"; do
        [[ -f "$f" ]] || continue
        pid="$(cat "$f")"
        if [[ -n "$pid" ]] && grep -q CassandraDaemon "/proc/$pid/cmdline" 2>/dev/null; then
            echo "$f"
            return 0
        fi
    done
    return 1
}

# How long a node waits for the seed's gossip (twice while it joins). The seed
# (node 2) and the single node wait for nobody: 1 s. A joining node on a loaded
# box could miss the seed's gossip within 1 s ("Unable to contact any seeds":
# node 1 failed twice in one clean-clone run, 16 s a try), so it waits 3 s,
# and 6 s when started again.
ring_delay_ms() {
    if [[ "$CASSANDRA_NODES" == 1 || "$1" == 2 ]]; then
        echo 1000
    elif (("$2" == 1)); then
        echo 3000
    else
        echo 6000
    fi
}

# start_node N [attempt]
start_node() {
    node "$1"
    if pid="$(running_pid)"; then
        echo "$(label): already running (pid $pid)"
        return 0
    fi
    if (exec 3<>"/dev/tcp/$addr/$CQL_PORT") 2>/dev/null; then
        die "port $addr:$CQL_PORT is already in use by a process this project did not start; stop it or point the gateway at it (see README)"
    fi
    mkdir -p "$storage" "$STATE_DIR/run" "$logdir"
    if [[ "$CASSANDRA_NODES" != 1 ]]; then
        # This node's copy of cassandra.yaml: its own addresses, one cluster name
        # of its own (a cluster never gossips with the single node's data).
        # One token per node (num_tokens: 1), spread evenly over the Murmur3
        # ring: random single tokens can leave a node owning a sliver of it.
        local token
        token="$("$PYTHON" -c "print(-2**63 + ($1 - 1) * 2**64 // $CASSANDRA_NODES)")"
        sed -e "s/^listen_address: .*/listen_address: $addr/" \
            -e "s/^rpc_address: .*/rpc_address: $addr/" \
            -e "s/- seeds: .*/- seeds: \"127.0.0.2:7000\"/" \
            -e "s/^cluster_name: .*/cluster_name: gateway-cluster/" \
            "$here/cassandra.yaml" >"$conf"
        echo "initial_token: $token" >>"$conf"
    fi
    local jamm; jamm="$(ls "$lib"/jamm-*.jar | head -n1)"
    local -a jvm17; mapfile -t jvm17 < <(grep -v '^\s*#' "$here/jvm17-server.options" | sed '/^\s*$/d' | tr ' ' '\n')
    # Heap fixed at about 1 GB: the box is small and shared with the gateway and tests.
    # Every GC pause goes to $logdir/gc.log (3 files of 5 MB at most): a latency
    # tail is checked against it first (bench/PERFORMANCE.md, "The load generator").
    setsid java \
        -Xms"$CASSANDRA_HEAP" -Xmx"$CASSANDRA_HEAP" -Xss256k \
        "${gc_opts[@]}" \
        -Xlog:gc:file="$logdir/gc.log":time,uptime:filecount=3,filesize=5m \
        -XX:+UseTLAB -XX:+ResizeTLAB -XX:+PerfDisableSharedMem \
        -XX:+HeapDumpOnOutOfMemoryError -XX:+ExitOnOutOfMemoryError -XX:HeapDumpPath="$storage" \
        -ea -da:net.openhft... -Djava.net.preferIPv4Stack=true \
        -Dio.netty.tryReflectionSetAccessible=true -Dio.netty.allocator.useCacheForAllThreads=true \
        -Dio.netty.allocator.maxOrder=11 \
        "${jvm17[@]}" \
        -javaagent:"$jamm" \
        -Dcassandra-foreground=yes \
        -Dcassandra.config="file://$conf" \
        -Dcassandra.storagedir="$storage" \
        -Dcassandra.logdir="$logdir" \
        -Dlogback.configurationFile="$here/logback.xml" \
        -Dcassandra.jmx.local.port="$jmx" \
        -Dcassandra.skip_wait_for_gossip_to_settle=0 \
        -Dcassandra.ring_delay_ms="$(ring_delay_ms "$1" "${2:-1}")" \
        -cp "$lib/*" \
        org.apache.cassandra.service.CassandraDaemon \
        >>"$logdir/console.log" 2>&1 </dev/null &
    local started=$!
    echo "$started" >"$pidfile"
    # $! is the forked shell until it has exec'd java: running_pid (which
    # checks for CassandraDaemon) would call it not running. Seen once on a
    # loaded box, right after a restart; give the exec up to 10 s.
    local i
    for ((i = 0; i < 100; i++)); do
        running_pid >/dev/null && break
        kill -0 "$started" 2>/dev/null || break
        sleep 0.1
    done
    echo "$(label): started (pid $started), log $logdir/system.log"
}

# How lines name the node: "cassandra" alone, or "cassandra 127.0.0.2" in a cluster.
label() {
    if [[ "$CASSANDRA_NODES" == 1 ]]; then echo "cassandra"; else echo "cassandra $addr"; fi
}
# The same inside a die message ("cassandra: 127.0.0.2 not running").
where() {
    if [[ "$CASSANDRA_NODES" != 1 ]]; then echo "$addr "; fi
}

wait_node() {
    node "$1"
    local pid
    pid="$(running_pid)" || {
        echo "cassandra: $(where)not running (no live pid in $pidfile); see $logdir/console.log" >&2
        return 1
    }
    "$PYTHON" "$here/wait_ready.py" --host "$addr" --port "$CQL_PORT" --deadline "$CASSANDRA_READY_DEADLINE" \
        --pid "$pid" --log "$logdir/system.log" --console "$logdir/console.log"
}

start() {
    check_java
    fetch
    local f
    if f="$(other_layout_running)"; then
        if [[ "$CASSANDRA_NODES" == 1 ]]; then
            die "a cluster started with CASSANDRA_NODES=3 is running ($f): stop it with CASSANDRA_NODES=3 make down"
        else
            die "the single node is running ($f) on 127.0.0.1: stop it with make down first"
        fi
    fi
    if [[ "$CASSANDRA_NODES" == 1 ]]; then
        start_node 1
        return 0
    fi
    start_others
    start_joined 1
}

# A cluster's nodes 2..N, one at a time: the seed (2) first, each once the one
# before answers CQL. Node 1 is not touched, so the single node may still run.
start_others() {
    [[ "$CASSANDRA_NODES" != 1 ]] || die "start-others is for a cluster (CASSANDRA_NODES=3)"
    check_java
    fetch
    local i
    for i in $(seq 2 "$CASSANDRA_NODES"); do
        start_joined "$i"
    done
}

start_joined() {
    local i="$1" tries=1
    start_node "$i"
    until wait_node "$i"; do
        # On a loaded box a joining node can still give up on the seed's
        # gossip within its ring delay ("Unable to contact any seeds"; see
        # ring_delay_ms). It never joined, so nothing is lost: clear it and
        # start it again, with a longer delay.
        if ((tries >= 3)) || ! grep -q "Unable to contact any seeds" "$logdir/system.log"; then
            die "$(where)did not start; see $logdir/system.log"
        fi
        tries=$((tries + 1))
        echo "$(label): did not reach the seed in time; starting it again (attempt $tries of 3)"
        rm -rf "$storage"
        sleep 3
        start_node "$i" "$tries"
    done
}

wait_ready() {
    local i
    for i in $(seq 1 "$CASSANDRA_NODES"); do
        wait_node "$i"
    done
}

stop_node() {
    node "$1"
    local pid
    if ! pid="$(running_pid)"; then
        rm -f "$pidfile"
        echo "$(label): not running"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    await_exit "$pid"
}

# Waits for a TERMed node to exit (KILL after 30 s); node I's variables are set.
await_exit() {
    local pid="$1"
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; echo "$(label): stopped (pid $pid)"; return 0; }
        sleep 0.5
    done
    echo "$(label): pid $pid did not stop within 30 s, killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

kill_node() {
    node "$1"
    local pid
    pid="$(running_pid)" || die "$(where)not running"
    kill -KILL "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    rm -f "$pidfile"
    echo "$(label): killed (SIGKILL, pid $pid)"
}

stop() {
    local i pid
    local -a pids=()
    # Every node is told at once (each drains on its own), then each is waited for.
    for i in $(seq "$CASSANDRA_NODES" -1 1); do
        node "$i"
        if pid="$(running_pid)"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids[i]="$pid"
        else
            rm -f "$pidfile"
            echo "$(label): not running"
        fi
    done
    for i in $(seq "$CASSANDRA_NODES" -1 1); do
        if [[ -n "${pids[i]:-}" ]]; then
            node "$i"
            await_exit "${pids[i]}"
        fi
    done
}

status_node() {
    node "$1"
    local pid
    if pid="$(running_pid)"; then
        if (exec 3<>"/dev/tcp/$addr/$CQL_PORT") 2>/dev/null; then
            echo "$(label): running (pid $pid), CQL on $addr:$CQL_PORT"
        else
            echo "$(label): starting (pid $pid), CQL port $addr:$CQL_PORT not open yet"
            return 3
        fi
    else
        echo "$(label): not running"
        return 3
    fi
}

status() {
    local i rc=0
    for i in $(seq 1 "$CASSANDRA_NODES"); do
        status_node "$i" || rc=3
    done
    return $rc
}

# nodetool from the same jars, over the local JMX port (tests flush and compact with it).
nodetool() {
    node "${CASSANDRA_NODE:-1}"
    running_pid >/dev/null || die "$(where)not running (no live pid in $pidfile)"
    local -a jvm17; mapfile -t jvm17 < <(grep -v '^\s*#' "$here/jvm17-server.options" | sed '/^\s*$/d' | tr ' ' '\n')
    # Its command history goes to the tools output directory: keep it in .state/.
    java "${jvm17[@]}" -Xmx128m -cp "$lib/*" -Dlogback.configurationFile="$here/logback.xml" \
        -Dcassandra.logdir="$logdir" -Duser.home="$STATE_DIR/cassandra" \
        org.apache.cassandra.tools.NodeTool -h "$addr" -p "$jmx" "$@"
}

case "${1:-}" in
    fetch) check_java; fetch ;;
    start) start ;;
    start-others) start_others ;;
    wait) wait_ready ;;
    stop) stop ;;
    status) status ;;
    start-node) check_java; fetch; start_node "${2:-}"; wait_node "${2:-}" ;;
    stop-node) stop_node "${2:-}" ;;
    kill-node) kill_node "${2:-}" ;;
    nodetool) shift; nodetool "$@" ;;
    *) echo "usage: $0 fetch|start|start-others|wait|stop|status|start-node I|stop-node I|kill-node I|nodetool ARGS..." >&2; exit 2 ;;
esac
