// Node-RED settings for the benchmark (bench/run.py): headless (no editor, no
// admin API, no HTTP nodes, so no HTTP server at all), console logging only,
// and the cassandra-driver package handed to function nodes through the
// global context. BENCH_NODE_MODULES is where bench/run.py installed it.
const path = require("path");
const modules = process.env.BENCH_NODE_MODULES;

module.exports = {
    uiHost: "127.0.0.1",
    httpAdminRoot: false,
    httpNodeRoot: false,
    flowFile: "flows.json",
    flowFilePretty: true,
    credentialSecret: false,
    functionGlobalContext: {
        cassandra: require(path.join(modules, "cassandra-driver")),
        crypto: require("crypto"),
        zlib: require("zlib"),
    },
    functionExternalModules: false,
    logging: { console: { level: "info", metrics: false, audit: false } },
    diagnostics: { enabled: false, ui: false },
    runtimeState: { enabled: false, ui: false },
    telemetry: { enabled: false },
    editorTheme: { tours: false },
};
