// Function node body: queue the message; write up to MAX_IN_FLIGHT at once.
// The rows are the gateway's (gateway/state.py, gateway/telemetry.py): raw
// telemetry (+ its partition index once per device and hour), the latest
// event per device, and the state partitions with insert-plus-delete, all
// with the same USING TIMESTAMP (event time in µs plus a hash tie-break).
const MAX_IN_FLIGHT = 128;
const BUCKET_MS = 3600 * 1000;
const TTL = 30 * 86400;
const STATES = ["on", "off"];
const cassandra = global.get("cassandra");
const crypto = global.get("crypto");
const zlib = global.get("zlib");
const Long = cassandra.types.Long;
const unset = cassandra.types.unset;
const st = context.get("st");
const ks = env.get("BENCH_KEYSPACE");

function rows(m) {
    const parts = m.topic.split("/");
    const tenant = parts[1], device = parts[3];
    const e = m.payload;
    const received = new Date();
    const value = e.value === undefined ? null : e.value;
    const valueText = typeof value === "string" ? value : null;
    const valueNum = typeof value === "number" ? value : null;
    const metrics = e.metrics || {};
    const tags = e.tags || {};
    const state = e.state === undefined ? null : e.state;
    const digest = crypto.createHash("blake2b512")
        .update(JSON.stringify([tenant, device, e.ts, state, value, metrics, tags]))
        .digest();
    const id = digest.readBigInt64BE(0);
    const writeTs = BigInt(e.ts) * 1000n + (((id % 1000n) + 1000n) % 1000n);
    const eventId = Long.fromString(id.toString());
    const wts = Long.fromString(writeTs.toString());
    const ts = new Date(e.ts);
    const start = new Date(e.ts - (e.ts % BUCKET_MS));
    const out = [
        [`INSERT INTO ${ks}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, ` +
         `state, value, value_num, metrics, tags, received_at) ` +
         `VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?`,
         [tenant, device, start, 0, ts, eventId, state === null ? unset : state,
          valueText === null ? unset : valueText, valueNum === null ? unset : valueNum,
          metrics, tags, received, TTL]],
    ];
    const key = tenant + "\u0000" + device + "\u0000" + start.getTime();
    if (!st.indexed.has(key)) {
        st.indexed.add(key);
        out.push([`INSERT INTO ${ks}.telemetry_partitions (tenant, device_id, bucket_start, ` +
                  `shard, bucket_seconds) VALUES (?, ?, ?, ?, ?) USING TTL ?`,
                  [tenant, device, start, 0, BUCKET_MS / 1000, TTL + BUCKET_MS / 1000]]);
    }
    out.push([`INSERT INTO ${ks}.latest_events_by_device (tenant, device_id, state, ts, value, ` +
              `value_num, metrics, tags) VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?`,
              [tenant, device, state === null ? unset : state, ts, valueText, valueNum,
               metrics, tags, wts]]);
    if (state !== null) {
        // latest_events_by_state keeps the value as JSON (gateway/store/latest.py
        // state_value), in generation 0: this writer never rotates a partition.
        // Rows are clustered by device_hash first (gateway/identity.py
        // device_hash: CRC-32 of the id as a signed 32-bit int).
        const hash = zlib.crc32(Buffer.from(device, "utf8")) - 2147483648;
        out.push([`INSERT INTO ${ks}.latest_events_by_state (tenant, state, bucket, gen, ` +
                  `device_hash, device_id, ts, value, tags) ` +
                  `VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?`,
                  [tenant, state, 0, 0, hash, device, ts, JSON.stringify(value), tags, wts]]);
        for (const other of STATES) {
            if (other !== state) {
                out.push([`DELETE FROM ${ks}.latest_events_by_state USING TIMESTAMP ? ` +
                          `WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? ` +
                          `AND device_hash = ? AND device_id = ?`,
                          [wts, tenant, other, 0, 0, hash, device]]);
            }
        }
    }
    return out;
}

function pump() {
    while (st.inFlight < MAX_IN_FLIGHT && st.queue.length > 0) {
        const m = st.queue.shift();
        st.inFlight += 1;
        let writes;
        try {
            writes = rows(m).map(([q, p]) => st.client.execute(q, p, { prepare: true }));
        } catch (err) {
            writes = [Promise.reject(err)];
        }
        Promise.all(writes).then(() => {
            st.written += 1;
        }, (err) => {
            st.failed += 1;
            if (st.failed <= 5) node.error(`write failed: ${err}`);
        }).finally(() => {
            st.inFlight -= 1;
            pump();
        });
    }
}

st.queue.push(msg);
pump();
return null;
