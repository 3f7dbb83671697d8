// Function node "On Start": connect to Cassandra, prepare the writer state.
// A typical Node-RED flow: the function node writes each message's rows with
// the DataStax cassandra-driver (prepared statements), at most MAX_IN_FLIGHT
// messages at a time (without a cap a backlog would queue unbounded requests).
const cassandra = global.get("cassandra");
const keyspace = env.get("BENCH_KEYSPACE");
const client = new cassandra.Client({
    contactPoints: ["127.0.0.1:9042"],
    localDataCenter: "datacenter1",
    keyspace: keyspace,
    queryOptions: { prepare: true, consistency: cassandra.types.consistencies.localQuorum },
});
await client.connect();
const st = {
    client: client,
    queue: [],
    inFlight: 0,
    written: 0,
    failed: 0,
    shown: -1,
    indexed: new Set(),
    timer: null,
};
st.timer = setInterval(() => {
    if (st.written !== st.shown) {
        st.shown = st.written;
        node.log(`written=${st.written} failed=${st.failed}`);
    }
}, 50);
context.set("st", st);
node.log("cassandra connected");
