"""The report: bench/results/latest.json, latest.md and, with matplotlib
installed (the bench extra), throughput_vs_devices.png and latency_cdf.png."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchlib import QUIET_CORES, QUIET_WINDOW_S
from harness import SYSTEMS, Bench

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pip install matplotlib (the bench extra)
    # The ignore is used only where matplotlib is installed (plt is then a module).
    plt = None  # type: ignore[assignment, unused-ignore]

LABELS = {
    "broker": "Broker ceiling (paho QoS 1 subscriber, no database)",
    "cassandra": (
        "Cassandra ceiling (direct writer, same rows and driver as the gateway, "
        "10 rows per request)"
    ),
    "naive": "Naive bridge (paho on_message + cassandra-driver session.execute per row)",
    "nodered": "Node-RED (mqtt in → function node + cassandra-driver)",
    "gateway": "Gateway (defaults)",
}


PLOT_LABELS = {
    "broker": "broker only (publish → received)",
    "cassandra": "Cassandra ceiling",
    "naive": "naive bridge",
    "nodered": "Node-RED",
    "gateway": "gateway",
}


def run(bench: Bench) -> None:
    """The run's duration and closing load, then the files."""
    bench.results["duration_s"] = time.monotonic() - bench.progress.start
    bench.results["machine"] = bench.results.get("machine", {}) | {"loadavg_end": os.getloadavg()}
    write_report(bench.results, bench.latencies, bench.args.out)


def _store(mb: float | None) -> str:
    return "not found (or an older run)" if mb is None else f"{mb:,.1f} MB"


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ratios: dict[str, float | None], key: str) -> str:
    value = ratios.get(f"gateway/{key}")
    return "-" if value is None else f"{value:.2f}x"


def write_report(results: dict[str, Any], latencies: dict[str, list[float]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    systems = results["systems"]
    gw = systems.get("gateway", {}).get("msg_per_s")
    results["ratios"] = {
        f"gateway/{key}": (gw / systems[key]["msg_per_s"])
        if gw and systems.get(key, {}).get("msg_per_s")
        else None
        for key in ("cassandra", "broker", "naive", "nodered")
    }
    plots = plot(results, latencies, out)
    (out / "latest.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "latest.md").write_text("\n".join(markdown(results, plots)) + "\n")


def markdown(results: dict[str, Any], plots: list[str]) -> Iterator[str]:
    m = results.get("machine", {})
    p = results["params"]
    systems = results["systems"]
    yield "# Benchmark results"
    yield ""
    yield (
        f"Run {results['run_id']} started {results['started']}, took "
        f"{results.get('duration_s', 0) / 60:.1f} min: `{results['command']}`"
    )
    yield ""
    yield (
        f"Machine: {m.get('cores')} cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB RAM, "
        f"Linux {m.get('kernel')}; Cassandra {m.get('cassandra')} (1 node, same host), "
        f"{m.get('mosquitto')}, Python {m.get('python')} (gateway and ceiling write through "
        f"{m.get('write_driver')}; the naive bridge uses cassandra-driver "
        f"{m.get('python_driver')}), Node.js {m.get('node')}; gateway at "
        f"{m.get('gateway_commit')}. Load average at start "
        f"{_load(m.get('loadavg_start'))}, at end {_load(m.get('loadavg_end'))} "
        "(other work on the box shows up here). Mosquitto's store at start: "
        f"{_store(m.get('broker_store_mb'))} (each of its autosaves, every 5,000 "
        "changes, rewrites it and stalls every client: bench/publish_acks.py)."
    )
    yield ""
    yield (
        f"Load: gateway.simulate fleet, {p['devices']:,} devices, JSON, QoS 1, one backlog of "
        f"{p['count']:,} messages per system (naive bridge: {p['naive_count']:,}; "
        f"Node-RED: {p['nodered_count']:,}), each system in its own tenant and MQTT session."
    )
    yield ""
    yield (
        "| System | Backlog | Sustained msg/s | Stored = published | Latency p50 / p99 / max (ms) "
        "| CPU s / 1k msgs | Peak RSS (MB) |"
    )
    yield "|---|---:|---:|---|---:|---:|---:|"
    for key in SYSTEMS:
        s = systems.get(key)
        label = LABELS[key]
        if s is None:
            yield f"| {label} | skipped | | | | | |"
            continue
        if "msg_per_s" not in s or s.get("msg_per_s") is None:
            yield f"| {label} | {s.get('status', 'not measured')} | | | | | |"
            continue
        if key == "cassandra":
            label += f", best at {s['best_concurrency']} in flight"
        lat = s.get("latency") or {}
        latency = (
            f"{_f(lat.get('p50'), 1)} / {_f(lat.get('p99'), 1)} / {_f(lat.get('max'), 1)}"
            if lat.get("n")
            else "n/a"
        )
        check = s.get("check", {}).get("text", "n/a (no database)")
        if lat.get("check"):
            check += f"; latency run {lat['check']['text']}"
        if s.get("gateway_dropped"):
            check += (
                " (gateway counted "
                + ", ".join(f"{k}={v}" for k, v in s["gateway_dropped"].items())
                + ")"
            )
        status = f" ({s['status']})" if s.get("status") else ""
        yield (
            f"| {label}{status} | {s.get('backlog', 0):,} | {_f(s.get('msg_per_s'))} | {check} "
            f"| {latency} | {_f(s.get('cpu_s_per_1k_msgs'), 2)} | {_f(s.get('peak_rss_mb'))} |"
        )
    yield ""
    r = results.get("ratios", {})
    yield (
        f"Gateway throughput ratios: gateway/Cassandra ceiling {_ratio(r, 'cassandra')}, "
        f"gateway/broker ceiling {_ratio(r, 'broker')}, gateway/naive {_ratio(r, 'naive')}, "
        f"gateway/Node-RED {_ratio(r, 'nodered')}."
    )
    yield from cores_used(results, m.get("cores"))
    by_rate = systems.get("gateway", {}).get("latency_by_rate") or []
    if by_rate:
        yield ""
        yield (
            "Gateway latency by offered rate (live runs after the drain, same fleet; "
            "publish → write sent, as above):"
        )
        yield ""
        yield "| Offered msg/s | Achieved msg/s | p50 / p99 / max (ms) | Stored |"
        yield "|---:|---:|---:|---|"
        for lat in by_rate:
            yield (
                f"| {lat['offered_msg_per_s']:,.0f} | {lat['achieved_msg_per_s']:,.0f} | "
                f"{lat.get('p50', 0):.1f} / {lat.get('p99', 0):.1f} / {lat.get('max', 0):.1f} | "
                f"{lat.get('check', {}).get('text', '?')} |"
            )
    yield ""
    cas = systems.get("cassandra", {})
    if cas.get("levels"):
        yield "Cassandra ceiling by concurrency (statements in flight):"
        yield ""
        yield "| In flight | msg/s | statements/s | CPU s / 1k msgs | failures | stored |"
        yield "|---:|---:|---:|---:|---:|---|"
        for lv in cas["levels"]:
            yield (
                f"| {lv['concurrency']} | {_f(lv['msg_per_s'])} | {_f(lv['statements_per_s'])} "
                f"| {_f(lv['cpu_s_per_1k_msgs'], 2)} | {lv['failures']} | {lv['check']['text']} |"
            )
        yield ""
    scaling = results.get("scaling")
    if scaling:
        yield "Gateway throughput by fleet size:"
        yield ""
        yield "| Devices | Backlog | msg/s | CPU s / 1k msgs | Peak RSS (MB) | Stored |"
        yield "|---:|---:|---:|---:|---:|---|"
        for row in scaling:
            yield (
                f"| {row['devices']:,} | {row['backlog']:,} | {_f(row['msg_per_s'])} "
                f"| {_f(row['cpu_s_per_1k_msgs'], 2)} | {_f(row['peak_rss_mb'])} | {row['check']} |"
            )
        yield ""
    overload = results.get("overload")
    if overload and overload.get("segments"):
        yield (
            "Gateway under overload (offered load a multiple of its sustained "
            f"{overload['sustained_msg_per_s']:,.0f} msg/s, then drained):"
        )
        yield ""
        yield (
            "| Target | Offered msg/s (achieved) | Publishers | Published | Stored raw "
            "| Sampled out (counted) | Drain after publishing (s) | Peak RSS (MB) |"
        )
        yield "|---|---:|---:|---:|---:|---:|---:|---:|"
        for seg in overload["segments"]:
            yield (
                f"| {seg['factor']:g}x for {seg['seconds']:.0f} s ({_f(seg['target_msg_per_s'])}"
                f" msg/s) | {_f(seg['offered_msg_per_s'])} | {seg['publishers']} "
                f"| {seg['published']:,} | {seg['stored']:,} "
                f"| {seg.get('sampled_out', 0):,}{' ok' if seg['ok'] else ' MISMATCH'} "
                f"| {_f(seg['drain_after_publish_s'], 1)} | {_f(seg['peak_rss_mb'])} |"
            )
        yield ""
        yield (
            "ok: every published message is a stored raw row or was sampled out by the "
            "adaptive sampler (noisy devices, gateway/ingest/sampling.py; their latest state is "
            "still written), and the stored rows equal the gateway's own written count."
        )
        yield ""
    elif overload:
        yield f"Overload: {overload.get('status')}"
        yield ""
    states = results.get("devices_in_state")
    if states:
        buckets = sorted({row["buckets"] for row in states})
        yield (
            "`gateway devices --state S` (gateway.queries.devices_in_state), median of "
            f"{p['state_runs']} runs, ms:"
        )
        yield ""
        yield "| Devices in the state | " + " | ".join(f"{b} bucket(s)" for b in buckets) + " |"
        yield "|---:|" + "---:|" * len(buckets)
        for n in sorted({row["devices"] for row in states}):
            cells = []
            for b in buckets:
                row = next((x for x in states if x["devices"] == n and x["buckets"] == b), None)
                cells.append(
                    "-" if row is None else f"{row['median_ms']:.1f}{'' if row['ok'] else ' (!)'}"
                )
            yield f"| {n:,} | " + " | ".join(cells) + " |"
        yield ""
    for name in plots:
        yield f"![{name}]({name})"
    if plots:
        yield ""
    yield "How it is measured:"
    yield ""
    for note in NOTES:
        yield f"- {note}"
    half = p.get("latency_seconds")
    if half:
        fixed = p.get("fixed_latency_seconds")
        at_rates = f" and {fixed:.0f} s at each fixed rate" if p.get("latency_rates") else ""
        yield (
            f"- Latency runs lasted {half:.0f} s at half the sustained rate{at_rates}. The "
            "gateway's roll-up worker recomputes each minute over rollups.spread (20 s by "
            "default), starting rollups.grace (30 s) after it ends: a run of 60 s holds one "
            "minute's share of that work whatever second it starts at, a 10 s run all of it "
            "or none, by chance."
        )
    warm = results.get("cassandra_warm_up")
    if warm:
        yield (
            f"- Before anything was measured, {warm['events']:,} events' rows were written "
            f"through the ceiling writer, unmeasured, in {warm['seconds']} s: a Cassandra "
            "started minutes before is not yet compiled (its JIT), and measures slow."
        )
    rtt = results.get("cassandra_write_rtt_ms") or {}
    if rtt.get("p50") is not None:
        yield (
            f"- One Cassandra write's round trip from Python, sequential on the idle cluster "
            f"at setup: p50 {rtt['p50']:.2f} ms, p99 {rtt['p99']:.2f} ms ({rtt['n']} writes)."
        )
    failures = results.get("phase_failures") or {}
    for name, reason in failures.items():
        yield f"- Phase {name} failed: {reason}"
    if results.get("skipped"):
        yield f"- Skipped phases: {', '.join(results['skipped'])}"


def _load(value: Any) -> str:
    return "/".join(f"{x:.2f}" for x in value) if value else "?"


def cores_used(results: dict[str, Any], cores: int | None) -> Iterator[str]:
    """What each drain cost the box: the system's own CPU per message, and
    Cassandra's and Mosquitto's over the same drain; and the rate at which
    that cost alone would fill every core."""
    systems = results["systems"]
    rows = []
    for key in SYSTEMS:
        s = systems.get(key) or {}
        services = s.get("services_cpu_us_per_msg")
        if not services or s.get("cpu_s_per_1k_msgs") is None:
            continue
        own = s["cpu_s_per_1k_msgs"] * 1000
        cassandra, mosquitto = services.get("Cassandra"), services.get("Mosquitto")
        total = own + (cassandra or 0) + (mosquitto or 0)
        allowed = cores * 1e6 / total if cores and total else None
        rows.append(
            f"| {PLOT_LABELS[key]} | {_f(own)} | {_f(cassandra)} | {_f(mosquitto)} | {_f(total)} "
            f"| {_f(allowed)} | {_f(s.get('msg_per_s'))} |"
        )
    if not rows:
        return
    yield ""
    yield (
        "CPU per message while each system drained (µs): its own (the table above), "
        "and the local Cassandra's and Mosquitto's over the same drain; the last but one "
        f"column is the rate at which that CPU alone fills the box's {cores} cores:"
    )
    yield ""
    yield (
        "| System | itself | Cassandra | Mosquitto | together "
        "| msg/s that fills the cores | measured msg/s |"
    )
    yield "|---|---:|---:|---:|---:|---:|---:|"
    yield from rows
    settled = results.get("settled") or {}
    waits = [
        f"{PLOT_LABELS.get(key, key)} {w['waited_s']:.0f} s"
        for key, w in settled.items()
        if w.get("cores") is not None
    ]
    if waits:
        yield ""
        yield (
            "Before each drain (and each of the ceiling's levels) the bench flushed "
            "Cassandra's memtables and waited for it to settle (under "
            f"{QUIET_CORES} of a core over {QUIET_WINDOW_S:.0f} s, at most 120 s: the "
            "flush and the compactions of what earlier phases wrote): " + ", ".join(waits) + "."
        )


NOTES = [
    "Sustained msg/s: a backlog is published while the system is away (its persistent "
    "session holds it), then the system starts and drains it; the rate is the messages "
    "handled (stored rows, plus those the gateway sampled out) over the span between the "
    "first and the last WRITETIME of the telemetry rows (the broker ceiling: first to last "
    "message received; the Cassandra ceiling: its own clock around the writes).",
    "Stored = published: the run's telemetry rows are read back as `gateway history` "
    "reads them (telemetry_partitions → each partition once, one copy per event) and "
    "matched to the published (device, ts); the latest tables must hold each device's "
    "newest event, in exactly one state partition. Events the gateway reports it sampled "
    "out (a device over sampling.noisy_above, its status line's sampled_out) are counted, "
    "not identified: stored + sampled out must equal published, shown as "
    '"stored + N sampled out/published".',
    "Latency: a second, live run at half the sustained rate; latency = WRITETIME of the "
    "telemetry row - sent_at in the payload. The drivers stamp writes client-side when "
    "they send them, so this is publish → write sent to Cassandra; the write's round trip "
    "is not included (see the measured round trip below). Broker ceiling: publish → "
    "received by the subscriber.",
    "CPU and RSS: utime+stime and VmHWM of the process under test from /proc. CPU per "
    "1k messages is its CPU at the end of the drain minus its start-up CPU (measured on a "
    "separate start with an empty session), over the messages drained. The Cassandra "
    "ceiling measures its own write loop; its RSS includes the pre-decoded events it holds.",
    "Node-RED's MQTT client acknowledges QoS 1 messages on receipt, before the function "
    "node writes them (a crash loses them); the naive bridge and the gateway acknowledge "
    "after the write. The naive bridge and Node-RED write the same rows (same tables, "
    "keys and write timestamps) but without the gateway's validation, batching and "
    "coalescing; Node-RED's function node caps itself at 128 messages in flight.",
    "The Cassandra ceiling sends 10 rows per request (an UNLOGGED batch of different "
    "partitions, as the gateway packs them on one node); the gateway also skips "
    "latest-table writes that a newer event of the same device in the same chunk "
    "supersedes, so it can come out above this 'ceiling'.",
    "Cassandra's and Mosquitto's CPU per message: utime+stime of `make up`'s processes "
    "(their pidfiles) from the system's start to the end of its drain (the Cassandra "
    "ceiling: around each level's writes), over the messages drained; it includes their "
    "background work meanwhile (compaction of earlier phases' rows, the system's start-up "
    "while they idle), and is '-' for services `make up` did not start.",
    "Every system, the broker, Cassandra and the publisher share the same cores, so "
    "figures are lower than on a dedicated box and vary with other load.",
]


def plot(results: dict[str, Any], latencies: dict[str, list[float]], out: Path) -> list[str]:
    if plt is None:
        results["notes"].append("matplotlib not installed: no plots")
        return []
    made = []
    scaling = [r for r in results.get("scaling", []) if r.get("msg_per_s")]
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["devices"] for r in scaling]
        ax.plot(xs, [r["msg_per_s"] for r in scaling], "o-", label="gateway")
        ceiling = results["systems"].get("cassandra", {}).get("msg_per_s")
        if ceiling:
            ax.axhline(ceiling, ls="--", color="grey", label="Cassandra ceiling (1k devices)")
        ax.set_xscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel("sustained messages/s")
        top = max([r["msg_per_s"] for r in scaling] + [ceiling or 0])
        ax.set_ylim(0, top * 1.2)
        ax.set_title("Gateway throughput vs fleet size")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_devices.png", dpi=100)
        plt.close(fig)
        made.append("throughput_vs_devices.png")
    if latencies:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in SYSTEMS:
            values = sorted(v for v in latencies.get(key, []) if v > 0)
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, ys, label=PLOT_LABELS[key])
        ax.set_xscale("log")
        ax.set_xlabel("publish → stored latency (ms)")
        ax.set_ylabel("fraction of messages")
        ax.set_title("Latency CDF at half the sustained rate")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "latency_cdf.png", dpi=100)
        plt.close(fig)
        made.append("latency_cdf.png")
    return made
