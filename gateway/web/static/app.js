// The building managers' page: which devices are in which state, live.
//
// Plain ES2020, no framework, no build step, nothing fetched from elsewhere:
// it is shipped inside the Python package and must work offline on an edge host.
//
// Live updates are conditional polling: the current view's URLs are fetched
// about once a second with If-None-Match, so an unchanged view costs a 304 and
// no re-render. Polling pauses while the tab is hidden.
//
// Data from the API is only ever put into the page as text (textContent,
// text nodes, attributes set with setAttribute), never parsed as HTML.
"use strict";

(() => {
  const API_BASE = new URL("api/v1/", document.baseURI);
  const TOKEN_KEY = "gateway.token";
  const POLL_MS = 1000;
  const MAX_BACKOFF_MS = 8000;
  // "live" only while the view's data was read less than this long ago; past
  // it the status line says "stale" and how old the data is (a slow link
  // to Cassandra can keep polls succeeding, each many seconds late).
  const STALE_MS = 5000;
  // A request unanswered this long is given up and counted as a failure: a
  // connection that died without a word (a phone changing cells) otherwise
  // held the next poll back until the browser gave up, minutes later. Above
  // the server's own Cassandra timeout (10 s), which answers 503 itself.
  const REQUEST_MS = 20000;
  const PAGE_SIZE = 100;
  const HISTORY_LIMIT = 500; // the API's cap: the chart shows up to this many events
  // When a range holds more events than that, the value is charted from the
  // roll-ups of the whole range instead: 1-minute windows for a day, 1-hour
  // ones for a week (the newest events alone covered minutes of "7 days").
  const ROLLUP_STEPS = { "24h": "1m", "7d": "1h" };
  const HISTORY_ROWS = 50; // rows of the history table
  // Durations "ago", which the API takes for since=: the URL (and so its
  // ETag) stays the same from one poll to the next.
  const RANGES = ["1h", "24h", "7d"];
  const RANGE_MS = { "1h": 3600e3, "24h": 86400e3, "7d": 7 * 86400e3 };
  const DEFAULT_RANGE = "24h";
  const REJECTED_SINCE = "24h";
  // The API's cap on a list: the newest this many rejected messages are shown,
  // and the page says so when there were more.
  const REJECTED_LIMIT = 500;
  const ETAG_CACHE_SIZE = 64;

  // ------------------------------------------------------------------ DOM helpers

  const $ = (id) => document.getElementById(id);

  function h(tag, props, ...kids) {
    const el = document.createElement(tag);
    setProps(el, props);
    for (const kid of kids.flat()) {
      if (kid != null && kid !== false) el.append(typeof kid === "string" ? visibleText(kid) : kid);
    }
    return el;
  }

  const SVG_NS = "http://www.w3.org/2000/svg";
  function s(tag, props, ...kids) {
    const el = document.createElementNS(SVG_NS, tag);
    setProps(el, props);
    for (const kid of kids.flat()) if (kid != null && kid !== false) el.append(kid);
    return el;
  }

  // Characters that show as nothing or turn the text around them: direction
  // overrides, isolates and marks, zero-width space, soft hyphen, byte-order
  // mark... (the set gateway/topic_filters.py refuses in states and ids).
  // Values, tags and metric names may hold them: "\u202eevil\u202c" read
  // "live" (page probe). Every text put into the page shows them as their
  // code point instead, as the CLI escapes them.
  const UNSEEN = /[\u00ad\u061c\u115f\u1160\u180e\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufeff]/g;
  function visibleText(text) {
    return text.replace(UNSEEN,
      (c) => `⟨U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}⟩`);
  }

  function setProps(el, props) {
    for (const [key, value] of Object.entries(props || {})) {
      if (value == null || value === false) continue;
      if (key === "text") el.textContent = visibleText(String(value));
      else if (key === "title" || key === "aria-label") el.setAttribute(key, visibleText(String(value)));
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
  }

  function show(el, visible) {
    el.hidden = !visible;
  }

  // ------------------------------------------------------------------ formatting

  function tsMillis(ts) {
    if (typeof ts === "number" && Number.isFinite(ts)) return ts;
    if (typeof ts === "string") {
      const ms = Date.parse(ts);
      return Number.isNaN(ms) ? null : ms;
    }
    return null;
  }

  function isNumber(v) {
    return typeof v === "number" && Number.isFinite(v);
  }

  // Six decimals at most for everyday readings (21.500000001 shows 21.5);
  // whole numbers and huge ones as they are, small ones to six significant
  // digits: v * 1e6 overflowed past 1.8e302 (-1e308 showed as "-Infinity")
  // and rounded 5e-7 to 0 (page probe).
  function formatNumber(v) {
    if (Number.isInteger(v) || Math.abs(v) >= 1e15) return String(v);
    if (Math.abs(v) < 0.01) return String(Number(v.toPrecision(6)));
    return String(Math.round(v * 1e6) / 1e6);
  }

  // A state as the page names it: an event may carry none (null).
  function stateName(state) {
    return state == null ? "no state" : String(state);
  }

  function formatValue(v) {
    if (v === null || v === undefined) return "—";
    if (isNumber(v)) return formatNumber(v);
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  // Text longer than this is shown cut, with a tap to see the rest: a value
  // of 1,024 characters without a space made each history row thousands of
  // pixels tall on a phone, screen after screen of one column (read-side probe).
  const LONG_TEXT = 80;

  // ``text`` as it goes into a table cell: itself, or cut with its length
  // said, the whole under a tap. ``open``: whether it was open before the
  // cell was drawn again (live updates redraw the history).
  // ``note``: said after the text, cut or not, and not counted in its length.
  function textCell(text, key, open, note = "") {
    const chars = Array.from(text);
    const whole = note ? `${text} … (${note})` : text;
    if (chars.length <= LONG_TEXT) return whole;
    return h("details", { class: "long-text", "data-key": key, open: Boolean(open) },
      h("summary", { text: `${chars.slice(0, LONG_TEXT - 20).join("")}… `
        + `(${chars.length.toLocaleString()} characters${note ? `; ${note}` : ""})` }),
      h("span", { text: whole }));
  }

  // A rejected message's payload as kept (the API's payload fields): its text,
  // or base64 said as such, and whether more was sent than kept. The length
  // is the kept text's: it counted the page's own note too ("2,080 characters"
  // of 2,048 kept), and that the rest was cut showed only once opened (page probe).
  function payloadCell(m, key, open) {
    if (m.payload == null) return "";
    const text = (m.payload_encoding === "base64" ? "base64: " : "") + m.payload;
    const sent = Number.isFinite(m.payload_size) ? `${m.payload_size.toLocaleString()} bytes were sent, ` : "";
    return textCell(text, key, open.has(key),
      m.payload_truncated ? `cut: ${sent}only the start is kept` : "");
  }

  // The keys of the long texts open under ``box``, to draw them open again.
  function openTexts(box) {
    return new Set([...box.querySelectorAll("details.long-text[open]")].map((d) => d.dataset.key));
  }

  function sameDay(a, b) {
    return a.getFullYear() === b.getFullYear() && a.getMonth() === b.getMonth()
      && a.getDate() === b.getDate();
  }

  function formatTime(ms) {
    if (ms == null) return "—";
    const d = new Date(ms);
    return sameDay(d, new Date()) ? d.toLocaleTimeString() : d.toLocaleString();
  }

  function formatAge(ms, now) {
    const sec = Math.round((now - ms) / 1000);
    if (sec < -2) return `in ${formatSpan(-sec)} (clock ahead)`;
    if (sec <= 0) return "just now";
    return `${formatSpan(sec)} ago`;
  }

  function formatSpan(sec) {
    if (sec < 60) return `${sec} s`;
    if (sec < 3600) return `${Math.floor(sec / 60)} min`;
    if (sec < 48 * 3600) return `${Math.floor(sec / 3600)} h`;
    return `${Math.floor(sec / 86400)} d`;
  }

  function timeEl(ts) {
    const ms = tsMillis(ts);
    if (ms == null) return h("span", { text: ts == null ? "—" : String(ts) });
    const iso = new Date(ms).toISOString();
    return h("time", { datetime: iso, title: iso, text: formatTime(ms) });
  }

  function ageEl(ts) {
    const ms = tsMillis(ts);
    if (ms == null) return h("span", { class: "age", text: "—" });
    return h("span", { class: "age", "data-ts": ms, text: formatAge(ms, Date.now()) });
  }

  let agesDay = new Date().toDateString();

  function updateAges() {
    const now = Date.now();
    for (const el of document.querySelectorAll(".age[data-ts]")) {
      const text = formatAge(Number(el.getAttribute("data-ts")), now);
      if (el.textContent !== text) el.textContent = text;
    }
    // Past midnight a time drawn yesterday as "18:02:11" needs its date: a
    // page left open on a wall tablet showed yesterday's events as today's.
    const day = new Date(now).toDateString();
    if (day !== agesDay) {
      agesDay = day;
      for (const el of document.querySelectorAll("time[datetime]")) {
        const text = formatTime(Date.parse(el.getAttribute("datetime")));
        if (el.textContent !== text) el.textContent = text;
      }
    }
  }

  // A stable colour per state: well-known names get the colour people expect,
  // others a hue from a hash of the name. A Map, not an object: a state named
  // "constructor" or "__proto__" must not find Object.prototype's members.
  const KNOWN_HUES = new Map(Object.entries({ on: 140, ok: 140, online: 140, running: 140,
    idle: 210, standby: 210, warning: 38, warn: 38, degraded: 38, alarm: 0, error: 0, fault: 0,
    critical: 0, fail: 0, failed: 0 }));
  const GREY_STATES = new Set(["off", "offline", "unknown", "stopped", "closed"]);
  function stateColor(state) {
    const name = String(state).toLowerCase();
    if (GREY_STATES.has(name)) return "hsl(220 8% 55%)";
    let hue = KNOWN_HUES.get(name);
    if (hue === undefined) {
      let hash = 0;
      for (const ch of name) hash = (hash * 31 + ch.codePointAt(0)) >>> 0;
      hue = hash % 360;
    }
    return `hsl(${hue} 62% 42%)`;
  }

  // The same hue, dark enough under white text for 4.5:1 (WCAG AA) at any
  // hue: 28% lightness gives 4.96:1 at the worst (yellow); the 42% of the
  // tiles and the strip gave 2.4:1.
  function stateInk(state) {
    const name = String(state).toLowerCase();
    if (GREY_STATES.has(name)) return "hsl(220 8% 42%)";
    return stateColor(state).replace(" 42%)", " 28%)");
  }

  // A key or value as a chip shows it: quoted when spaces at its ends (or
  // nothing at all) would not show, so "3 " is not taken for "3".
  function visible(text) {
    return text === "" || text !== text.trim() ? JSON.stringify(text) : text;
  }

  function tagChips(tags, onPick) {
    const entries = Object.entries(tags || {}).sort(([a], [b]) => a.localeCompare(b));
    if (!entries.length) return h("span", { class: "hint", text: "—" });
    return h("ul", { class: "tags" }, entries.map(([k, v]) => {
      const text = `${visible(k)}:${visible(formatValue(v))}`;
      const filter = tagFilter(k, formatValue(v));
      return h("li", null, onPick
        ? h("button", { type: "button", class: "tag", "data-tag": filter,
          title: `Show only devices tagged ${text}`, text, onclick: (e) => {
            e.stopPropagation();
            onPick(filter);
          } })
        : h("span", { class: "tag", text }));
    }));
  }

  // ------------------------------------------------------------------ the API

  class ApiError extends Error {
    constructor(status, code, detail) {
      super(detail);
      this.status = status;
      this.code = code;
      this.detail = detail;
    }

    // The API's own words, verbatim, with the status for context.
    describe() {
      return this.status ? `${this.status} ${this.code}: ${this.detail}` : this.detail;
    }
  }

  let token = sessionStorage.getItem(TOKEN_KEY);
  let me = null; // GET /me once the token is known good
  const etagCache = new Map(); // url -> {etag, data}; insertion order = age

  // A Map as a small LRU: ``key`` set as the newest, the oldest dropped past ``most``.
  function remember(map, key, value, most) {
    map.delete(key);
    map.set(key, value);
    if (map.size > most) map.delete(map.keys().next().value);
  }

  function apiUrl(path, params) {
    const url = new URL(path, API_BASE);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, String(v));
    }
    return url.toString();
  }

  // What a non-JSON error answer says, for a line: a proxy's HTML error
  // page (nginx's "502 Bad Gateway") went into the banner as markup (page
  // probe): its title, else its text without the tags, cut.
  function plainText(text) {
    if (!text) return "";
    if (/^\s*</.test(text)) {
      const doc = new DOMParser().parseFromString(text, "text/html");
      for (const el of doc.querySelectorAll("script, style")) el.remove();
      const said = (doc.title || doc.body?.textContent || "").replace(/\s+/g, " ").trim();
      return said.slice(0, 200);
    }
    return text.replace(/\s+/g, " ").trim().slice(0, 200);
  }

  function pathOf(...segments) {
    return segments.map(encodeURIComponent).join("/");
  }

  // GET a JSON resource. Returns {data, changed}: changed is false when the
  // server answered 304 to our If-None-Match and the cached body still holds.
  // A view drawn afresh must draw from the data even when it did not change.
  async function api(path, params, signal) {
    const url = apiUrl(path, params);
    const cached = etagCache.get(url);
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    if (cached) headers["If-None-Match"] = cached.etag;
    // Aborted by the caller (a new view) or by REQUEST_MS, whichever first.
    const timed = new AbortController();
    const giveUp = setTimeout(() => timed.abort(), REQUEST_MS);
    const follow = () => timed.abort();
    if (signal) {
      if (signal.aborted) timed.abort();
      else signal.addEventListener("abort", follow, { once: true });
    }
    let response;
    let text;
    try {
      // no-store: our own If-None-Match decides; the browser cache must not
      // answer for us (nor keep data that needs a token).
      response = await fetch(url, {
        headers, signal: timed.signal, cache: "no-store", credentials: "omit" });
      text = response.status === 304 ? "" : await response.text();
    } catch (err) {
      if (signal && signal.aborted) throw err;
      if (err.name === "AbortError") {
        throw new ApiError(0, "timeout", `No answer in ${REQUEST_MS / 1000} s; retrying.`);
      }
      throw new ApiError(0, "network", "Cannot reach the gateway; retrying.");
    } finally {
      clearTimeout(giveUp);
      if (signal) signal.removeEventListener("abort", follow);
    }
    if (response.status === 304 && cached) {
      remember(etagCache, url, cached, ETAG_CACHE_SIZE);
      return { data: cached.data, changed: false };
    }
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch {
      body = null;
    }
    if (!response.ok) {
      const code = (body && body.error) || response.statusText || "error";
      const detail = (body && (body.detail || body.error)) || plainText(text)
        || `HTTP ${response.status}`;
      throw new ApiError(response.status, code, detail);
    }
    if (body === null) throw new ApiError(response.status, "bad response", "The answer was not JSON.");
    const etag = response.headers.get("ETag");
    if (etag) remember(etagCache, url, { etag, data: body }, ETAG_CACHE_SIZE);
    else etagCache.delete(url);
    return { data: body, changed: true };
  }

  // ------------------------------------------------------------------ routing

  // #/                         tenant picker (or straight to the only tenant)
  // #/t/{tenant}               state tiles
  // #/t/{tenant}/s/{state}?prefix=&tag=&cursor=&p=   device table
  // #/t/{tenant}/d/{device}?range=                   device detail
  // #/t/{tenant}/rejected      rejected messages
  function parseHash() {
    const raw = location.hash.replace(/^#\/?/, "");
    const q = raw.indexOf("?");
    const path = q < 0 ? raw : raw.slice(0, q);
    const query = new URLSearchParams(q < 0 ? "" : raw.slice(q + 1));
    let segs;
    try {
      segs = path.split("/").filter(Boolean).map(decodeURIComponent);
    } catch {
      return { name: "home" };
    }
    if (segs[0] !== "t" || segs.length < 2) return { name: "home" };
    const tenant = segs[1];
    if (segs.length === 2) return { name: "states", tenant };
    if (segs.length === 4 && segs[2] === "s") {
      return { name: "devices", tenant, state: segs[3], prefix: query.get("prefix") || "",
        tag: query.get("tag") || "", cursor: query.get("cursor") || "",
        page: Math.max(1, Number.parseInt(query.get("p") || "1", 10) || 1) };
    }
    if (segs.length === 4 && segs[2] === "d") {
      const range = query.get("range");
      return { name: "device", tenant, device: segs[3],
        range: RANGES.includes(range) ? range : DEFAULT_RANGE,
        // ?range=99y showed 24 hours with 99y left in the address (page probe).
        badRange: range !== null && !RANGES.includes(range) };
    }
    if (segs.length === 3 && segs[2] === "rejected") return { name: "rejected", tenant };
    return { name: "home" };
  }

  function href(segments, query) {
    let out = `#/${segments.map(encodeURIComponent).join("/")}`;
    if (query) {
      const params = new URLSearchParams();
      for (const [k, v] of Object.entries(query)) if (v !== "" && v != null) params.set(k, String(v));
      const qs = params.toString();
      if (qs) out += `?${qs}`;
    }
    return out;
  }

  function go(hash, { replace = false } = {}) {
    if (location.hash === hash) return;
    if (replace) {
      history.replaceState(null, "", hash);
      route();
    } else {
      location.hash = hash;
    }
  }

  // ------------------------------------------------------------------ polling

  let current = null; // {route, refresh(signal)}
  let timer = null;
  let inflight = null; // AbortController of the refresh under way
  let generation = 0; // bumped by every route change: late answers are dropped
  let failures = 0;
  let halted = null; // the ApiError that stopped the view's polling, if any
  let lastOk = null; // when the current view's newest good answer was asked for
  let viewSince = 0; // when the current view was opened

  function stopPolling() {
    generation += 1;
    clearTimeout(timer);
    timer = null;
    if (inflight) inflight.abort();
    inflight = null;
  }

  async function tick() {
    timer = null;
    if (!current || document.hidden || inflight) return;
    const gen = generation;
    const controller = new AbortController();
    const asked = Date.now(); // the data is as fresh as the question, not the answer
    inflight = controller;
    try {
      if (!me) {
        // Who we are decides the breadcrumbs ("Tenants" only for several).
        await ensureMe(controller.signal).catch((err) => {
          if (err.name === "AbortError" || (err instanceof ApiError && err.status === 401)) throw err;
        });
        if (me && gen === generation) setCrumbs(current.crumbs());
      }
      await current.refresh(controller.signal);
      if (gen !== generation) return;
      failures = 0;
      lastOk = asked;
      showError(null);
    } catch (err) {
      if (gen !== generation || err.name === "AbortError") return;
      if (loggedOutBy(err)) return;
      if (err instanceof ApiError && isPermanent(err)) {
        halt(err);
        return;
      }
      failures += 1;
      showError(err instanceof ApiError ? err.describe() : String(err),
        plainWords(err, lastOk !== null));
      // A view never drawn says it could not be loaded, not "Loading…".
      if (current.failed) current.failed();
      if (!(err instanceof ApiError)) console.error(err);
    } finally {
      if (inflight === controller) inflight = null;
      // A request of the tick still under way (the other of a pair, when one
      // failed) is dropped, not left to hold one of the browser's connections.
      controller.abort();
    }
    renderLive();
    if (gen === generation && !document.hidden && !halted) {
      const delay = failures ? Math.min(POLL_MS * 2 ** failures, MAX_BACKOFF_MS) : POLL_MS;
      timer = setTimeout(tick, delay);
    }
  }

  // The status line at the top of the window, wherever the reader has
  // scrolled to: live (and the time of the data), stale (and its age),
  // reconnecting (how old the data is, then what failed), or paused in a
  // hidden tab.
  function renderLive() {
    const bar = $("status");
    const live = $("live");
    if (!current) {
      show(bar, false);
      return;
    }
    show(bar, true);
    const now = Date.now();
    const age = (ms) => formatSpan(Math.max(0, Math.round((now - ms) / 1000)));
    const since = lastOk ? `last update ${age(lastOk)} ago` : "";
    let kind;
    let text;
    let time = "";
    let detail = "";
    if (halted) {
      [kind, text] = ["stopped", "stopped"];
      detail = "this page cannot be shown; not asking again";
    } else if (document.hidden) {
      [kind, text] = ["paused", "paused"];
    } else if (failures) {
      // How old the data on screen is goes in the part never cut short; the
      // error after it may be, on a phone ("503 unavailable: Cass…").
      [kind, text] = ["down", "reconnecting…"];
      if (since) time = ` · ${since}`;
      detail = lastError || "";
    } else if (lastOk && now - lastOk <= STALE_MS) {
      [kind, text] = ["up", "live"];
      time = ` · ${new Date(lastOk).toLocaleTimeString()}`;
    } else if (lastOk) {
      [kind, text] = ["stale", "stale"];
      time = ` · ${since}`;
      detail = "slow answers";
    } else if (now - viewSince > STALE_MS) {
      [kind, text] = ["stale", "waiting"];
      time = ` · no answer for ${age(viewSince)}`;
    } else {
      [kind, text] = ["wait", "connecting…"];
    }
    // Where the line is too narrow, the detail goes first, then the word
    // ("reconn…"): the time or age is always shown whole (style.css).
    if (live.textContent !== text + time) {
      live.replaceChildren(h("span", { class: "live-word", text }));
      if (time) live.append(h("span", { class: "live-time", text: time }));
    }
    live.className = `live ${kind}`;
    bar.className = `status ${kind}`;
    if ($("status-detail").textContent !== detail) $("status-detail").textContent = detail;
    // For screen readers, once per change of kind (the line itself changes
    // every second): "Updates stopped: reconnecting", "Live again".
    const said = ANNOUNCE[kind];
    const announce = $("status-announce");
    if (said && announce.dataset.kind !== kind) {
      const first = !announce.dataset.kind;
      announce.dataset.kind = kind;
      if (!first || kind !== "up") announce.textContent = said;
    }
  }

  const ANNOUNCE = {
    up: "Live again: the page updates by itself.",
    stale: "The data is getting old: the gateway answers slowly.",
    down: "Updates stopped: reconnecting to the gateway.",
    paused: "",
    stopped: "Updates stopped: this page cannot be shown.",
  };

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      clearTimeout(timer);
      timer = null;
    } else if (current && !timer && !inflight && !halted) {
      tick();
    }
    renderLive();
  });

  // An answer that asking again will not change: bad input (400), another
  // tenant (403), no such thing (404)... Not 401 (log in again), nor 408 and
  // 429 (later may work).
  function isPermanent(err) {
    return err.status >= 400 && err.status < 500 && ![401, 408, 429].includes(err.status);
  }

  // Show the problem in place of the view, stop polling it, offer a way back.
  function halt(err) {
    halted = err;
    failures = 0;
    clearTimeout(timer);
    timer = null;
    showError(null);
    const active = document.activeElement;
    showView("problem");
    const r = current.route;
    // First what a building manager can do about it, then the API's words
    // ("403 forbidden: this token does not read tenant ..." alone: page probe).
    $("problem-hint").textContent = problemWords(err, r);
    $("problem-message").textContent = err.describe();
    const [label, link] = (current.recover && current.recover(err)) || wayBack(r, err);
    $("problem-link").textContent = label;
    $("problem-link").setAttribute("href", link);
    // The focus was in the view just hidden: give it to the message's heading.
    if (!active || active === document.body || active.closest("[hidden]")) {
      $("problem-title").setAttribute("tabindex", "-1");
      $("problem-title").focus({ preventScroll: true });
    }
    renderLive();
  }

  // A 401: the token is no longer good; log out (true), or nothing (false).
  function loggedOutBy(err) {
    if (!(err instanceof ApiError) || err.status !== 401) return false;
    logOut(`Your token was not accepted (401): ${err.detail}`);
    return true;
  }

  function problemWords(err, r) {
    if (err.status === 403) {
      return `Your token does not give access to ${r.tenant ? `tenant ${r.tenant}` : "this"}. `
        + "Whoever runs the gateway can give you one that does.";
    }
    if (err.status === 404) return "Nothing is known at this address: is a name in it misspelt?";
    if (err.status === 400) {
      return "This address holds something the gateway cannot use, such as a page of "
        + "another list or a filter it cannot read.";
    }
    return "";
  }

  function wayBack(r, err) {
    if (err.status === 403 || !r.tenant) {
      const own = me && !me.admin && (me.tenants || []).length === 1 ? me.tenants[0] : null;
      return own ? [`Back to ${own}`, href(["t", own])] : ["Back to your tenants", "#/"];
    }
    return [`Back to the states of ${r.tenant}`, href(["t", r.tenant])];
  }

  let lastError = null; // the last failure's message, for the status line

  // The banner: first what a building manager can make of a failure, then
  // the API's own words for whoever runs the gateway. (The status line keeps
  // the short technical part.)
  function showError(message, plain = null) {
    const el = $("error");
    lastError = message || null;
    const text = message && plain ? `${plain} (${message})` : message || "";
    // Set only when it changes: an alert is announced again on every change.
    if (el.textContent !== text) el.textContent = text;
    show(el, Boolean(message));
  }

  // ``shown``: whether this view has had an answer (a view never loaded read
  // "what is shown may be out of date" over nothing shown: page probe).
  function plainWords(err, shown) {
    if (!(err instanceof ApiError)) return null;
    const state = shown ? "what is shown may be out of date" : "nothing could be loaded yet";
    if (err.status === 503 && err.code === "busy") {
      // Too many requests at once, not an outage (page probe).
      return `The gateway is busy answering other requests: ${state}. `
        + "The page will try again by itself.";
    }
    if (err.status === 503) {
      return `The gateway cannot reach its database right now: ${state}. `
        + "The page will try again by itself.";
    }
    if (err.status >= 500) {
      return "The gateway failed to answer. The page will try again by itself.";
    }
    return null;
  }

  // ------------------------------------------------------------------ login

  function showView(name) {
    for (const section of document.querySelectorAll("main > .view")) {
      show(section, section.id === `view-${name}`);
    }
  }

  function showLogin(message) {
    stopPolling();
    current = null;
    renderLive();
    showError(null);
    setCrumbs([]);
    show($("logout"), false);
    showView("login");
    document.title = "Log in · Device states";
    $("login-message").textContent = message || "";
    $("token").focus();
  }

  function logOut(message) {
    token = null;
    me = null;
    etagCache.clear();
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(message);
  }

  // The tabs of this page in one browser share the login: sessionStorage is
  // the tab's own, so a device opened with Ctrl-click, a bookmark or a pasted
  // address landed at the login (page probe). A tab without a token asks the
  // others over a BroadcastChannel (this origin only) and takes the one a
  // logged-in tab holds; a login logs in the tabs waiting at theirs, and
  // "Log out" logs out every tab of that token. A token the API refuses
  // (401) logs out only the tab that met it: the others meet it themselves.
  const tabs = "BroadcastChannel" in window ? new BroadcastChannel("gateway.login") : null;
  const ASK_TABS_MS = 300; // how long a new tab waits for an answer before its login
  let askingTabs = false;
  // Answers name the question: another tab at its login (logged out, or
  // refused with a 401) must not take a token meant for a new tab.
  const askId = Math.random().toString(36).slice(2);

  function takeToken(value) {
    askingTabs = false;
    token = value;
    me = null;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("login-message").textContent = "";
    $("token").value = "";
    route({ focus: true });
  }

  if (tabs) {
    tabs.onmessage = ({ data }) => {
      if (!data) return;
      if (data.kind === "ask") {
        // Only a token a login accepted is given out, not one being tried.
        const held = sessionStorage.getItem(TOKEN_KEY);
        if (held) tabs.postMessage({ kind: "token", token: held, to: data.id });
      } else if (typeof data.token !== "string") {
        // nothing else comes without a token
      } else if (data.kind === "logout") {
        if (token === data.token) logOut("You logged out in another tab.");
      } else if (data.kind === "token") {
        if (askingTabs && data.to === askId) takeToken(data.token);
      } else if (data.kind === "login" && !token) {
        takeToken(data.token); // a login elsewhere logs in the tabs at theirs
      }
    };
    if (!token) {
      askingTabs = true;
      tabs.postMessage({ kind: "ask", id: askId });
      setTimeout(() => {
        if (!askingTabs) return;
        askingTabs = false;
        route({ focus: true });
      }, ASK_TABS_MS);
    }
  }

  $("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = $("token");
    const value = input.value.trim().replace(/^Bearer\s+/i, "");
    if (!value) return;
    const button = $("login");
    button.disabled = true;
    $("login-message").textContent = "";
    token = value;
    try {
      me = (await api("me")).data;
    } catch (err) {
      token = null;
      // The login asks once: say so, rather than "retrying" (which polling does).
      let text = String(err);
      if (err instanceof ApiError && err.status === 401) text = `Token not accepted (401): ${err.detail}`;
      else if (err instanceof ApiError && err.status === 0) {
        text = "Cannot reach the gateway. Check the connection, then press Log in again.";
      } else if (err instanceof ApiError) text = `${err.describe()} Press Log in to try again.`;
      $("login-message").textContent = text;
      return;
    } finally {
      button.disabled = false;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    input.value = "";
    if (tabs) tabs.postMessage({ kind: "login", token });
    route({ focus: true });
  });

  $("logout").addEventListener("click", () => {
    history.replaceState(null, "", "#/");
    if (tabs && token) tabs.postMessage({ kind: "logout", token });
    logOut("You are logged out.");
  });

  async function ensureMe(signal) {
    if (!me) me = (await api("me", null, signal)).data;
    return me;
  }

  function severalTenants() {
    return Boolean(me && (me.admin || (me.tenants || []).length > 1));
  }

  // ------------------------------------------------------------------ chrome

  function setCrumbs(items) {
    const nav = $("crumbs");
    const list = h("ol");
    items.forEach(([label, link], i) => {
      const last = i === items.length - 1;
      list.append(h("li", null, last
        ? h("span", { "aria-current": "page", text: label })
        : h("a", { href: link, text: label })));
    });
    nav.replaceChildren(list);
  }

  function tenantCrumbs(r, ...more) {
    const items = [];
    if (severalTenants()) items.push(["Tenants", "#/"]);
    items.push([r.tenant, href(["t", r.tenant])]);
    return items.concat(more);
  }

  // Replace a list's children, keeping the element that has the focus focused.
  // If it was in a child rebuilt anew, twin(old) finds its successor.
  function replaceKeepingFocus(parent, children, twin) {
    const active = document.activeElement;
    const inside = active && parent.contains(active);
    const find = inside && twin ? twin(active) : null;
    parent.replaceChildren(...children);
    if (!active || active === document.activeElement) return;
    const target = active.isConnected ? active : find && find();
    if (target) target.focus({ preventScroll: true });
  }

  // The same link or tag chip in the new row of the same device.
  function deviceRowTwin(tbody) {
    return (el) => {
      const row = el.closest("tr[data-device]");
      const sel = el.matches(".device-link") ? ".device-link"
        : el.dataset.tag ? `[data-tag="${CSS.escape(el.dataset.tag)}"]` : null;
      if (!row || !sel) return null;
      const device = row.dataset.device;
      return () => {
        const fresh = [...tbody.rows].find((r) => r.dataset.device === device);
        return fresh && fresh.querySelector(sel);
      };
    };
  }

  function focusHeading(id) {
    const heading = $(id);
    heading.setAttribute("tabindex", "-1");
    heading.focus({ preventScroll: true });
  }

  // Disable a button; if it had the focus, hand it to the heading rather
  // than let it fall to the body.
  function disableKeepingFocus(button, disabled, headingId) {
    const had = document.activeElement === button;
    button.disabled = disabled;
    if (had && disabled) focusHeading(headingId);
  }

  function flash(el) {
    el.classList.remove("changed");
    void el.offsetWidth; // restart the animation
    el.classList.add("changed");
  }

  // ------------------------------------------------------------------ views

  function homeView() {
    showView("tenants");
    document.title = "Tenants · Device states";
    let drawn = false;
    return {
      crumbs: () => [["Tenants", "#/"]],
      async refresh(signal) {
        const { data, changed } = await api("me", null, signal);
        me = data;
        // Someone went elsewhere while this was on its way: don't take them back.
        if (signal.aborted) return;
        if (!changed && drawn) return;
        drawn = true;
        const tenants = [...(data.tenants || [])].sort();
        if (!data.admin && tenants.length === 1) {
          // Only if the address still says home: a navigation whose
          // hashchange has not fired yet has already changed it, and
          // replacing it would undo that navigation.
          if (parseHash().name === "home") go(href(["t", tenants[0]]), { replace: true });
          return;
        }
        replaceKeepingFocus($("tenant-list"), tenants.map((t) => h("li", null,
          h("a", { class: "tenant", href: href(["t", t]), "data-tenant": t, text: t }))));
        show($("tenants-empty"), tenants.length === 0);
        show($("tenant-form"), Boolean(data.admin));
      },
    };
  }

  $("tenant-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = $("tenant-name").value.trim();
    if (name) go(href(["t", name]));
  });

  // A device by its id or the id's start, whatever its state: the tiles
  // asked for the state first, which someone looking for one device may not
  // know (page probe), and an exact id had to be typed whole and in its case.
  // An id found exactly opens its device; else the devices whose id starts
  // so are listed with their state. Spaces at the ends are dropped, as a
  // pasted id may carry them.
  const FIND_LIMIT = 20;
  let finding = null; // the search under way (an AbortController)

  function clearFound() {
    if (finding) finding.abort();
    finding = null;
    $("found-meta").textContent = "";
    $("found-list").replaceChildren();
  }

  $("device-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const r = current && current.route;
    const id = $("device-id").value.trim();
    if (!r || !r.tenant) return;
    clearFound();
    if (!id) {
      $("found-meta").textContent = "Type a device's id, or the start of it.";
      return;
    }
    const mine = new AbortController();
    finding = mine;
    $("found-meta").textContent = "Searching…";
    let data;
    try {
      ({ data } = await api(pathOf("tenants", r.tenant, "devices"),
        { prefix: id, limit: FIND_LIMIT }, mine.signal));
    } catch (err) {
      if (mine.signal.aborted) return;
      finding = null;
      if (loggedOutBy(err)) return;
      const words = err instanceof ApiError && err.status === 403 ? problemWords(err, r)
        : "The search could not be done; try again in a moment.";
      $("found-meta").textContent = `${words} (${err instanceof ApiError ? err.describe() : err.message})`;
      return;
    }
    if (mine.signal.aborted) return;
    finding = null;
    const devices = data.devices || [];
    if (devices.length && devices[0].device_id === id) {
      go(href(["t", r.tenant, "d", id]));
      return;
    }
    renderFound(r, id, data);
  });

  function renderFound(r, id, data) {
    const devices = data.devices || [];
    const n = devices.length;
    let said = n ? `${n} device${n === 1 ? "'s id starts" : "s' ids start"} with “${id}”:`
      : `No device of ${r.tenant} has an id that starts with “${id}”.`;
    if ((data.cut_short || []).length) {
      said += ` Not every device was searched: ${data.cut_short.join(", ")} hold`
        + `${data.cut_short.length === 1 ? "s" : ""} too many to search at once; the search of`
        + " a state's list goes on through them.";
    } else if (!data.complete) {
      said = `${n} of the devices whose id starts with “${id}”; type more of the id to`
        + " find fewer:";
    }
    $("found-meta").textContent = visibleText(said);
    $("found-list").replaceChildren(...devices.map((d) => {
      const state = d.state == null
        ? h("span", { class: "hint", text: "no state" })
        : h("span", { class: "dot-label", text: d.state });
      if (d.state != null) state.style.setProperty("--state-color", stateInk(d.state));
      return h("li", null,
        h("a", { href: href(["t", r.tenant, "d", d.device_id]), class: "device-link",
          "data-testid": "found-device", text: d.device_id }), " ", state, " ",
        h("span", { class: "age" }, timeEl(d.ts)));
    }));
  }

  function statesView(r) {
    showView("states");
    $("device-id").value = "";
    clearFound();
    $("states-title").textContent = `States of ${r.tenant}`;
    document.title = `${r.tenant} · Device states`;
    $("rejected-link").setAttribute("href", href(["t", r.tenant, "rejected"]));
    $("tiles").replaceChildren();
    $("states-meta").textContent = "Loading…";
    show($("states-empty"), false);
    let drawn = false;
    return {
      crumbs: () => tenantCrumbs(r),
      failed() {
        if (!drawn) {
          $("states-meta").textContent =
            "The states could not be loaded; the page will try again by itself.";
        }
      },
      async refresh(signal) {
        const { data, changed } = await api(pathOf("tenants", r.tenant, "states"), null, signal);
        // No states: an empty tenant, or a name nobody has used (a typo)?
        // An admin's /me lists the known tenants and says which.
        let unknown = null;
        if (!(data.states || []).length && me && me.admin) {
          me = (await api("me", null, signal)).data;
          unknown = unknownTenant(r.tenant, me.tenants || []);
        }
        if (!changed && drawn && (unknown || "") === $("states-empty").dataset.unknown) {
          // The same counts (a 304): they hold as of this answer.
          renderStatesMeta(Date.now(), data.cached_for_s);
          return;
        }
        drawn = true;
        renderTiles(r, data, unknown);
        renderStatesMeta(changed ? tsMillis(data.as_of) : Date.now(), data.cached_for_s);
      },
    };
  }

  const KNOWN_MAX = 1000; // /me lists at most this many tenants
  const KNOWN_SHOWN = 20;

  // What to say of a tenant that has no states, or null if it is known.
  function unknownTenant(tenant, tenants) {
    if (tenants.includes(tenant)) return null;
    if (tenants.length >= KNOWN_MAX) {
      return `No devices yet, or no tenant named ${tenant} has sent anything: it is not among `
        + `the ${tenants.length} tenants the gateway lists.`;
    }
    if (!tenants.length) return `No tenant named ${tenant} has sent anything (no tenant has yet).`;
    const names = tenants.slice(0, KNOWN_SHOWN).join(", ");
    const more = tenants.length > KNOWN_SHOWN ? `, … (${tenants.length} in all)` : "";
    return `No tenant named ${tenant} has sent anything (known tenants: ${names}${more}).`;
  }

  function renderTiles(r, data, unknown) {
    const tiles = $("tiles");
    const old = new Map([...tiles.querySelectorAll("a.tile")].map((a) => [a.dataset.state, a]));
    const states = [...(data.states || [])].sort((a, b) => String(a.state).localeCompare(String(b.state)));
    const items = states.map((st) => {
      const count = Number(st.devices) || 0;
      let tile = old.get(String(st.state));
      if (!tile) {
        tile = h("a", { class: "tile", href: href(["t", r.tenant, "s", st.state]),
          "data-state": st.state, "data-testid": "tile" },
        h("span", { class: "state-name", text: st.state }),
        h("span", { class: "count", text: count }),
        h("span", { class: "unit" }));
        tile.style.setProperty("--state-color", stateColor(st.state));
      } else if (tile.querySelector(".count").textContent !== String(count)) {
        tile.querySelector(".count").textContent = String(count);
        flash(tile);
      }
      tile.querySelector(".unit").textContent = count === 1 ? "device" : "devices";
      tile.setAttribute("aria-label", `${st.state}: ${count} ${count === 1 ? "device" : "devices"}`);
      return h("li", null, tile);
    });
    replaceKeepingFocus(tiles, items);
    const empty = $("states-empty");
    empty.textContent = unknown || "This tenant has no devices yet.";
    empty.dataset.unknown = unknown || "";
    show(empty, states.length === 0);
  }

  // "Counts as of 18:20:01, may be up to 1 s old": asOf is the answer's
  // as_of, or the time of a 304 (the server found the same counts then).
  function renderStatesMeta(asOf, cachedFor) {
    const parts = [];
    if (asOf != null) parts.push(`Counts as of ${formatTime(asOf)}`);
    if (isNumber(cachedFor) && cachedFor > 0) parts.push(`may be up to ${cachedFor} s old`);
    $("states-meta").textContent = parts.join(", ");
  }

  // Previous-page links: the cursor that led to each page, per list, kept for
  // the tab so "previous" works after a reload too. Keyed by cursors (from
  // the API and the address): an object without a prototype (Object.hasOwn
  // is newer than the ES2020 this page keeps to), so that a cursor
  // "__proto__" or "constructor" is a key like any other.
  function prevKey(r) {
    return `gateway.prev:${JSON.stringify([r.tenant, r.state, r.prefix, r.tag])}`;
  }
  function prevMap(r) {
    const map = Object.create(null);
    try {
      const saved = JSON.parse(sessionStorage.getItem(prevKey(r)) || "{}");
      if (saved && typeof saved === "object") Object.assign(map, saved);
    } catch {
      // a damaged entry: start afresh
    }
    return map;
  }
  function prevOf(r) {
    const map = prevMap(r);
    return map[r.cursor] || null;
  }
  function rememberPrev(r, nextCursor) {
    const map = prevMap(r);
    map[nextCursor] = { cursor: r.cursor, page: r.page };
    const keys = Object.keys(map);
    if (keys.length > 200) delete map[keys[0]];
    sessionStorage.setItem(prevKey(r), JSON.stringify(map));
  }

  let filterTimer = null;

  function devicesView(r) {
    showView("devices");
    $("devices-title").textContent = `Devices in state ${r.state}`;
    $("device-caption").textContent = `Devices of ${r.tenant} in state ${r.state}`;
    document.title = `${r.state} · ${r.tenant} · Device states`;
    for (const [id, value] of [["prefix", r.prefix], ["tag", r.tag]]) {
      const input = $(id);
      if (input.value !== value && document.activeElement !== input) input.value = value;
    }
    checkTag();
    $("device-rows").replaceChildren();
    show($("new-devices"), false);
    $("devices-meta").textContent = "Loading…";
    show($("devices-empty"), false);
    $("page-no").textContent = r.page > 1 || r.cursor ? `page ${r.page}` : "";
    const prev = $("prev-page");
    const next = $("next-page");
    // Paging with the keyboard keeps the focus on the pager: Next stays as it
    // was until the answer says whether there is a next page.
    disableKeepingFocus(prev, !r.cursor, "devices-title");
    if (document.activeElement !== next) next.disabled = true;
    show($("pager"), Boolean(r.cursor));
    let nextCursor = null; // the newest answer's
    // The cursor of the page the rows show: Next goes on after the last row
    // shown. While the reader is scrolled into the list the rows hold still
    // and the newest answer's page may end later (a device above left), at
    // a device never shown: its cursor skipped that one.
    let shownNext = null;
    // Next pressed while this page is still loading (it stays enabled, to
    // keep the keyboard focus): followed as soon as the answer says where.
    let nextWanted = false;
    const base = ["t", r.tenant, "s", r.state];
    const filters = { prefix: r.prefix, tag: r.tag };
    prev.onclick = () => {
      const back = prevOf(r);
      go(href(base, back && back.cursor ? { ...filters, cursor: back.cursor, p: back.page }
        : filters));
    };
    next.onclick = () => {
      if (!shownNext) {
        nextWanted = !drawn;
        return;
      }
      rememberPrev(r, shownNext);
      go(href(base, { ...filters, cursor: shownNext, p: r.page + 1 }));
    };
    let drawn = false;
    let total = null;
    let knownStates = null; // the tenant's states, when the states endpoint answered
    let tagKeys = null; // the tenant's tag keys, asked for when a tag filter found none
    let devices = []; // the newest answer's page
    let onPage = { shown: 0, left: 0, fresh: 0 }; // what the rows show of it
    const pickTag = (tag) => {
      $("tag").value = tag;
      go(href(base, { ...filters, tag }));
      // The chip pressed goes with its row: focus on the filter it set, not
      // lost to the page's top (Tab started over from there: page probe).
      $("tag").focus({ preventScroll: true });
    };
    // Draw the newest page. While the reader is scrolled into the list, a
    // live update keeps every row where it is (see renderDeviceRows); with
    // reflow (at the top of the list, or asked for) the rows become the page.
    const draw = (reflow) => {
      const steady = !reflow && scrolledIntoList();
      // Anything above the screen that changes height (the line of counts,
      // a row marked "left") must not move the rows on it either.
      keepingTopRow(steady, null, () => {
        onPage = renderDeviceRows(r, devices, pickTag, Boolean(nextCursor), steady,
          { knownStates, tagKeys });
        renderDevicesMeta(r, onPage, total);
      });
      if (!steady) shownNext = nextCursor; // the rows are this answer's page
      disableKeepingFocus($("next-page"), !shownNext, "devices-title");
      show($("pager"), Boolean(r.cursor || shownNext));
      const bar = $("new-devices");
      const pending = onPage.fresh || onPage.left;
      if (pending) {
        const parts = [];
        if (onPage.fresh) parts.push(`${onPage.fresh} new`);
        if (onPage.left) parts.push(`${onPage.left} left`);
        bar.textContent = `${parts.join(", ")} — show`;
        bar.setAttribute("aria-label", `${parts.join(", ")}: update the list`);
      }
      if (!pending && document.activeElement === bar) focusHeading("devices-title");
      show(bar, Boolean(pending));
    };
    $("new-devices").onclick = () => {
      // Bring the list up to date, keeping the row at the top of the window
      // (the first that stays) where it was.
      const stays = new Set(devices.map((d) => String(d.device_id)));
      keepingTopRow(true, (id) => stays.has(id), () => draw(true));
    };
    return {
      crumbs: () => tenantCrumbs(r, [r.state, href(base)]),
      // A 400 here is a cursor or filter from the URL: back to page 1, or
      // the whole list.
      recover(err) {
        if (err.status !== 400) return null;
        if (r.cursor) return ["Back to page 1", href(base, filters)];
        return [`All devices in state ${r.state}`, href(base)];
      },
      async refresh(signal) {
        // The state's total comes from the states endpoint (cached by the
        // server for a second or more); the list's pages do not count.
        const [{ data, changed }, counts] = await Promise.all([
          api(pathOf("tenants", r.tenant, "states", r.state, "devices"),
            { limit: PAGE_SIZE, cursor: r.cursor, prefix: r.prefix,
              // As the address has it: typed filters are tidied on the way
              // in (applyFilter), a chip's is its tag exactly ("3 " is not "3").
              tag: r.tag }, signal),
          api(pathOf("tenants", r.tenant, "states"), null, signal).catch((err) => {
            if (err.name === "AbortError") throw err;
            return null; // the list is still worth showing without its total
          })]);
        const entry = counts && (counts.data.states || []).find((st) => st.state === r.state);
        knownStates = counts ? (counts.data.states || []).map((st) => String(st.state)) : null;
        // A tag filter that found nothing: is its key one the tenant's
        // devices ever sent? ("No devices match." for a misspelt key: page
        // probe.) Unknown when metadata is off, capped or does not answer.
        tagKeys = null;
        if (r.tag && !(data.devices || []).length && !data.next_cursor) {
          const meta = await api(pathOf("tenants", r.tenant, "meta", "tags"), null, signal)
            .catch((err) => {
              if (err.name === "AbortError") throw err;
              return null;
            });
          tagKeys = meta && !meta.data.truncated && !meta.data.capped
            ? (meta.data.tags || []).map(String) : null;
        }
        // The counts may be up to 10 s old (the server keeps them when
        // counting was slow); a whole list, unfiltered, is its own count.
        const whole = !r.cursor && !data.next_cursor && !(r.prefix || r.tag);
        total = whole ? (data.devices || []).length : entry ? Number(entry.devices) : null;
        if (changed || !drawn) {
          const first = !drawn;
          drawn = true;
          nextCursor = data.next_cursor || null;
          devices = data.devices || [];
          draw(false);
          if (first) restoreScroll();
          if (nextWanted) {
            nextWanted = false;
            if (shownNext) next.onclick();
          }
        } else {
          keepingTopRow(scrolledIntoList(), null, () => renderDevicesMeta(r, onPage, total));
        }
      },
      failed() {
        if (!drawn) {
          $("devices-meta").textContent =
            "The device list could not be loaded; the page will try again by itself.";
        }
      },
      // Back at the top of the list, what waited is shown.
      scrolled() {
        if ((onPage.fresh || onPage.left) && !scrolledIntoList()) draw(true);
      },
    };
  }

  // Whether the reader has scrolled into the device list: its first row is
  // above the window's top (under the status line). Rows moving then would
  // move under their finger.
  function scrolledIntoList(tbody = $("device-rows")) {
    return tbody.rows.length > 0 && tbody.getBoundingClientRect().top < coveredTop();
  }

  // Where the window's top stops being covered: under the status line, and
  // on a desktop under the bar that sticks below it.
  function coveredTop() {
    return Math.max($("status").getBoundingClientRect().bottom,
      document.querySelector("header.bar").getBoundingClientRect().bottom);
  }

  // The row of ``tbody`` at the top of the window: the first there whose
  // ``key`` (a data- attribute) passes stays(), if given.
  function topRow(tbody, key, stays = null) {
    const below = coveredTop();
    return [...tbody.rows].find((row) => row.getBoundingClientRect().bottom > below
      && (!stays || stays(row.dataset[key])));
  }

  // Run change() keeping the row of ``tbody`` at the top of the window (the
  // first there for which stays(id) holds) where it is on the screen; rows
  // are told apart by their data-``key``: the device list's by device, a
  // device's history by time and state. The browser's own scroll anchoring
  // is off for these views (style.css): Safari has none, and it would add
  // its correction to this one.
  function keepingTopRow(active, stays, change, tbody = $("device-rows"), key = "device") {
    const anchor = active ? topRow(tbody, key, stays) : null;
    const id = anchor && anchor.dataset[key];
    const top = anchor && anchor.getBoundingClientRect().top;
    change();
    if (!anchor) return;
    const now = [...tbody.rows].find((row) => row.dataset[key] === id);
    const moved = now ? now.getBoundingClientRect().top - top : 0;
    if (Math.abs(moved) >= 1) window.scrollBy(0, moved);
  }

  let scrollQueued = false;
  window.addEventListener("scroll", () => {
    if (scrollQueued) return;
    scrollQueued = true;
    requestAnimationFrame(() => {
      scrollQueued = false;
      if (current && current.scrolled && !halted) current.scrolled();
    });
  }, { passive: true });

  // The page's rows. steady (the reader is scrolled into the list): rows
  // stay where they are: a changed device is updated in its row, one that
  // left the state stays, greyed and marked "left", and one that entered it
  // is only counted (the "N new — show" bar). Otherwise the rows become the
  // page. Returns what the rows show: {shown, left, fresh}.
  function renderDeviceRows(r, devices, pickTag, more, steady, { knownStates, tagKeys }) {
    const tbody = $("device-rows");
    const old = new Map([...tbody.rows].map((row) => [row.dataset.device, row]));
    const build = (d) => {
      const signature = JSON.stringify([d.ts, d.value, d.tags]);
      const existing = old.get(String(d.device_id));
      if (existing && existing.dataset.sig === signature && !existing.classList.contains("left")) {
        return existing;
      }
      const link = href(["t", r.tenant, "d", d.device_id]);
      const row = h("tr", { "data-device": d.device_id, "data-sig": signature },
        h("th", { scope: "row", "data-label": "Device" }, h("span", { class: "device-cell" },
          h("a", { href: link, class: "device-link", text: d.device_id }))),
        h("td", { "data-label": "Value", class: "value" },
          textCell(formatValue(d.value), d.device_id, false)),
        h("td", { "data-label": "Tags" }, tagChips(d.tags, pickTag)),
        h("td", { "data-label": "Last seen" }, timeEl(d.ts)),
        h("td", { "data-label": "Age" }, ageEl(d.ts)));
      // The whole row opens the device (the link inside serves keyboards).
      // Ctrl- or Cmd-click and the middle button open it beside this one,
      // as on the link (the new tab asks this one for the login); a
      // Shift-click stays a selection of text.
      row.addEventListener("click", (e) => {
        if (e.target.closest("a, button") || e.shiftKey) return;
        if (e.ctrlKey || e.metaKey) window.open(link, "_blank", "noopener");
        else go(link);
      });
      row.addEventListener("auxclick", (e) => {
        if (e.button === 1 && !e.target.closest("a, button")) window.open(link, "_blank", "noopener");
      });
      if (existing) flash(row);
      return row;
    };
    let result;
    if (steady) {
      const byId = new Map(devices.map((d) => [String(d.device_id), d]));
      const active = document.activeElement;
      const find = active && tbody.contains(active) ? deviceRowTwin(tbody)(active) : null;
      // On the whole list (one page) a device missing has left the state;
      // on one of several pages it may have only moved to the next page.
      const whole = !r.cursor && !more;
      let left = 0;
      for (const row of [...tbody.rows]) {
        const d = byId.get(row.dataset.device);
        if (d) {
          const fresh = build(d);
          if (fresh !== row) row.replaceWith(fresh);
        } else {
          left += 1;
          if (!row.classList.contains("left")) {
            row.classList.add("left");
            row.querySelector(".device-cell").append(
              h("span", { class: "left-note", text: whole ? `left ${r.state}` : "left this page" }));
          }
        }
      }
      if (find && !active.isConnected) {
        const target = find();
        if (target) target.focus({ preventScroll: true });
      }
      const fresh = devices.filter((d) => !old.has(String(d.device_id))).length;
      result = { shown: tbody.rows.length - left, left, fresh, whole, more };
    } else {
      replaceKeepingFocus(tbody, devices.map(build), deviceRowTwin(tbody));
      result = { shown: devices.length, left: 0, fresh: 0, more };
    }
    const filtered = r.prefix || r.tag;
    show($("devices-empty"), tbody.rows.length === 0);
    // A filtered page reads at most 10,000 devices: an empty one with a cursor
    // means none matched so far, not none at all.
    const key = r.tag ? tagKey(r.tag) : null;
    $("devices-empty").textContent = filtered
      ? (more ? "No match among the devices searched so far: Next searches on."
        : key && tagKeys && tagKeys.length && !tagKeys.includes(key)
          ? `No device of ${r.tenant} has ever sent a tag ${key}; its tag keys: `
            + `${tagKeys.slice(0, 20).join(", ")}${tagKeys.length > 20 ? ", …" : ""}.`
          : "No devices match.")
      : knownStates && !knownStates.includes(r.state)
        // A misspelt state in the address read as an empty one (page probe).
        ? `No device of ${r.tenant} has ever been in state ${r.state}`
          + (knownStates.length ? `; its states: ${[...knownStates].sort().join(", ")}.` : ".")
        : `No devices are in state ${r.state} right now.`;
    return result;
  }

  // "page 2 · 100 shown · 310 devices in on": the page, and the state's
  // total when the states endpoint gave it.
  function renderDevicesMeta(r, { shown, left, fresh, whole, more }, total) {
    const filtered = r.prefix || r.tag;
    const parts = [];
    const paged = r.page > 1 || r.cursor || more;
    if (r.page > 1 || r.cursor) parts.push(`page ${r.page}`);
    // "on this page" only when there are others ("5 match on this page" on
    // the only one left the reader unsure it was every match: page probe).
    if (shown) parts.push(filtered ? `${shown} match${paged ? " on this page" : ""}` : `${shown} shown`);
    if (left) parts.push(`${left} left ${whole ? r.state : "this page"}`);
    if (fresh) parts.push(`${fresh} new`);
    if (total != null) {
      // "250 devices in on in all" read oddly (page probe).
      parts.push(`${total} ${total === 1 ? "device" : "devices"} in ${r.state}${filtered ? ", unfiltered" : ""}`);
    }
    const text = parts.join(" · ");
    if ($("devices-meta").textContent !== text) $("devices-meta").textContent = text;
  }

  $("filter-form").addEventListener("submit", (event) => {
    event.preventDefault();
    applyFilter(false);
  });
  $("clear-filter").addEventListener("click", () => {
    $("prefix").value = "";
    $("tag").value = "";
    applyFilter(false);
  });
  for (const id of ["prefix", "tag"]) {
    // Search as you type, without a history entry per keystroke.
    $(id).addEventListener("input", () => {
      if (id === "tag") checkTag();
      clearTimeout(filterTimer);
      filterTimer = setTimeout(() => applyFilter(true), 400);
    });
  }

  // A tag filter as the API takes it: KEY:VALUE, or KEY=VALUE as the CLI
  // writes it, with spaces around the separator dropped. A key that holds
  // ":", "=" or "\\" writes them "\\:", "\\=", "\\\\" (queries.parse_tag). ""
  // for no filter, null for text that is not (yet) a tag: "floor" while
  // typing "floor:3".
  function normalizeTag(raw) {
    const text = raw.trim();
    if (!text) return "";
    const m = /^((?:\\.|[^\\:=])*?)\s*[:=]\s*(.*)$/s.exec(text);
    return m && m[1] && m[2] ? `${m[1]}:${m[2]}` : null;
  }

  // The key of a tag filter, its escapes undone ("a\\:b:c" is key "a:b").
  function tagKey(filter) {
    const m = /^((?:\\.|[^\\:=])*)[:=]/s.exec(filter);
    return m ? m[1].replace(/\\(.)/gs, "$1") : null;
  }

  // The filter for one tag, its key escaped: a chip for key "a:b" filtered
  // on key "a", value "b:...".
  function tagFilter(key, value) {
    return `${key.replace(/[\\:=]/g, "\\$&")}:${value}`;
  }

  // Say under the field what is missing, instead of asking the API.
  function checkTag() {
    const input = $("tag");
    const hint = $("tag-hint");
    const ok = normalizeTag(input.value) !== null;
    if (ok) input.removeAttribute("aria-invalid");
    else input.setAttribute("aria-invalid", "true");
    hint.textContent = ok ? "key:value" : "Type KEY:VALUE, such as floor:3";
    hint.classList.toggle("invalid", !ok);
    return ok;
  }

  function applyFilter(replace) {
    clearTimeout(filterTimer);
    const r = current && current.route;
    if (!r || r.name !== "devices") return;
    const prefix = $("prefix").value.trim();
    // The field as a chip left it is that chip's filter, exactly ("3 " is
    // not "3"): only what the user typed is tidied.
    const typed = $("tag").value;
    const tag = typed === r.tag ? r.tag : normalizeTag(typed);
    if (tag === null) {
      checkTag();
      if (!replace) $("tag").focus();
      return;
    }
    if (prefix === r.prefix && tag === r.tag) return;
    go(href(["t", r.tenant, "s", r.state], { prefix, tag }), { replace });
  }

  let lastHistory = null; // for redrawing the chart on resize
  let lastRollups = null; // { step, rows }: the value's windows, when charted from them
  // { route, ts }: the device's latest ts, for a range that holds no event (the
  // chart is drawn again on a resize too)
  let lastSeen = null;

  function deviceView(r) {
    if (r.badRange) history.replaceState(null, "", href(["t", r.tenant, "d", r.device]));
    showView("device");
    $("device-title").textContent = visibleText(r.device);
    document.title = `${r.device} · ${r.tenant} · Device states`;
    $("range").value = r.range;
    $("device-latest").replaceChildren(h("p", { class: "hint", text: "Loading…" }));
    show($("device-history"), true);
    $("chart").replaceChildren();
    $("history-rows").replaceChildren();
    $("history-meta").textContent = "";
    lastHistory = null;
    lastRollups = null;
    lastSeen = null;
    let stateCrumb = null;
    let shown = null; // "missing" or "found": a missing device is drawn once, not every poll
    const devicePath = pathOf("tenants", r.tenant, "devices", r.device);
    const crumbs = () => tenantCrumbs(r, ...(stateCrumb == null ? []
      : [[String(stateCrumb), href(["t", r.tenant, "s", stateCrumb])]]), [r.device, ""]);
    return {
      crumbs,
      failed() {
        if (shown === null) {
          $("device-latest").replaceChildren(h("p", { class: "hint",
            text: "This device could not be loaded; the page will try again by itself." }));
        }
      },
      async refresh(signal) {
        const params = { since: r.range, limit: HISTORY_LIMIT };
        const [latest, hist] = await Promise.all([
          api(devicePath, null, signal).catch((err) => {
            if (err instanceof ApiError && err.status === 404) return { missing: err, changed: true };
            throw err;
          }),
          // A device the tenant never had is a 404 here too: the latest's
          // 404 says it; no history to show.
          api(`${devicePath}/history`, params, signal).catch((err) => {
            if (err instanceof ApiError && err.status === 404) {
              return { data: { events: [], next_cursor: null },
                changed: !lastHistory || lastHistory.events.length > 0 };
            }
            throw err;
          }),
        ]);
        const latestChanged = latest.missing ? shown !== "missing"
          : latest.changed || shown !== "found";
        if (latestChanged) {
          renderLatest(r, latest.missing ? null : latest.data, latest.missing, shown !== null);
          shown = latest.missing ? "missing" : "found";
          lastSeen = latest.missing ? null : { route: r, ts: latest.data.ts };
          const state = latest.missing ? null : latest.data.state;
          if (state !== stateCrumb) {
            stateCrumb = state;
            setCrumbs(crumbs());
          }
        }
        const step = hist.data.next_cursor ? ROLLUP_STEPS[r.range] : undefined;
        // Without them (an error, a gateway with roll-ups off) the events alone are charted.
        const windows = step ? await api(`${devicePath}/rollups`,
          { metric: "value", step, since: r.range }, signal).catch((err) => {
          if (signal && signal.aborted) throw err;
          return null;
        }) : null;
        if (hist.changed || latestChanged || !lastHistory || (windows && windows.changed)
            || (lastRollups !== null) !== (windows !== null)) {
          lastHistory = hist.data;
          lastRollups = windows ? { step, rows: windows.data.rollups || [] } : null;
          renderHistory(hist.data);
        }
      },
    };
  }

  $("range").addEventListener("change", () => {
    const r = current && current.route;
    if (!r || r.name !== "device") return;
    const range = $("range").value;
    go(href(["t", r.tenant, "d", r.device], { range: range === DEFAULT_RANGE ? "" : range }),
      { replace: true });
  });

  function renderLatest(r, d, missing, again) {
    const box = $("device-latest");
    // A device not known (yet): its message and a way back, and no empty
    // chart and history under it (page probe). The page keeps asking, so a
    // device's first event shows here without a reload.
    show($("device-history"), Boolean(d));
    if (!d) {
      box.replaceChildren(
        h("p", { class: "error", "data-testid": "device-missing",
          text: missing ? missing.describe() : "No such device." }),
        h("p", { class: "hint", text: "Nothing has come from this device, or its id is "
          + "misspelt. It shows here as soon as it sends its first event." }),
        h("p", null, h("a", { class: "button-link", "data-testid": "device-missing-back",
          href: href(["t", r.tenant]), text: `Back to ${r.tenant}` })));
      return;
    }
    // Events without a state leave a device in none (no tile lists it): said
    // in words, not an empty badge (page probe).
    const badge = d.state == null
      ? h("span", { class: "hint", "data-testid": "device-state",
        text: "no state: its events carry none, so no state lists it" })
      : h("a", { class: "badge", href: href(["t", r.tenant, "s", d.state]),
        "data-testid": "device-state", text: d.state });
    if (d.state != null) badge.style.setProperty("--state-color", stateInk(d.state));
    const metrics = Object.entries(d.metrics || {}).sort(([a], [b]) => a.localeCompare(b));
    const value = formatValue(d.value);
    const parts = [
      h("dl", { class: "facts" },
        h("div", null, h("dt", { text: "State" }), h("dd", null, badge)),
        h("div", null, h("dt", { text: "Value" }),
          // Long text cut here too (a screen of it pushed the history down),
          // and kept open across the live redraws of the card.
          h("dd", { class: Array.from(value).length > 40 ? "value long" : "value",
            "data-testid": "device-value" },
          textCell(value, "latest", openTexts(box).has("latest")))),
        h("div", null, h("dt", { text: "Last seen" }), h("dd", null, timeEl(d.ts), " · ", ageEl(d.ts))),
        h("div", null, h("dt", { text: "Tags" }), h("dd", null, tagChips(d.tags, null)))),
      metrics.length ? h("dl", { class: "metrics", "aria-label": "Metrics" }, metrics.map(([k, v]) =>
        h("div", null, h("dt", { text: k }), h("dd", { text: formatValue(v) })))) : null];
    box.replaceChildren(...parts.filter(Boolean));
    if (again) flash(box);
  }

  function renderHistory(data) {
    const events = data.events || [];
    const rows = $("history-rows");
    // Reading down the table (its top above the screen), the row at the top
    // of the screen stays where it is as newer events come in above it: a
    // busy device's slid it down a row per event (page probe).
    keepingTopRow(scrolledIntoList(rows), null, () => {
      renderChart($("chart"), events, Boolean(data.next_cursor), lastRollups);
      const open = openTexts(rows);
      rows.replaceChildren(...events.slice(0, HISTORY_ROWS).map((e) => {
        const state = h("span", { class: "dot-label", text: e.state == null ? "—" : e.state });
        state.style.setProperty("--state-color", stateColor(e.state));
        const metrics = Object.entries(e.metrics || {}).map(([k, v]) => `${k}=${formatValue(v)}`);
        const key = `${e.ts}|${e.state}`; // a row, across redraws
        return h("tr", { "data-key": key },
          h("td", { "data-label": "Time" }, timeEl(e.ts)),
          h("td", { "data-label": "State" }, state),
          h("td", { "data-label": "Value", class: "value" },
            textCell(formatValue(e.value), key, open.has(key))),
          h("td", { class: "metrics-cell", text: metrics.join(", ") || "—" }));
      }));
    }, rows, "key");
    const more = !data.next_cursor ? ""
      : lastRollups ? " (the range holds older events: the value line covers them, the table not)"
        : " (the range holds older events, not shown)";
    $("history-meta").textContent = events.length
      ? `${events.length} event${events.length === 1 ? "" : "s"} in the chart, `
        + `newest ${Math.min(events.length, HISTORY_ROWS)} listed${more}.`
      : "No events in this range.";
  }

  // What the chart says in its place when the range holds no event: when the
  // device's last one came, if before the range (a device last seen days ago
  // read only "No events to chart." on the last 24 hours), with a link to the
  // shortest range that holds it.
  function noEvents() {
    const ms = lastSeen && tsMillis(lastSeen.ts);
    const now = Date.now();
    const r = lastSeen && lastSeen.route;
    if (ms == null || now - ms <= RANGE_MS[r.range]) {
      return [h("p", { class: "hint", text: "No events to chart." })];
    }
    const wider = RANGES.find((x) => now - ms <= RANGE_MS[x]);
    // Not formatAge's rounding down: "1 h ago" for an event 1 h 40 min old
    // read as inside the last hour it was said to be outside of.
    const said = `No events in this range: the last one came ${spanPast(now - ms)} ago.`;
    const longest = RANGES[RANGES.length - 1];
    return [h("p", { class: "hint", "data-testid": "empty-range",
      text: wider ? said : `${said} That is before the longest range here (the `
        + `${rangeLabel(longest)}).` }),
    wider ? h("p", null, h("a", { class: "button-link", "data-testid": "wider-range",
      href: href(["t", r.tenant, "d", r.device], { range: wider === DEFAULT_RANGE ? "" : wider }),
      text: `Show the ${rangeLabel(wider)}` })) : null].filter(Boolean);
  }

  // A span with its second unit, rounded up: "1 h 40 min", "3 d 6 h",
  // "3 d 2 min"; a number and its unit never split over two lines.
  function spanPast(spanMs) {
    const min = Math.ceil(spanMs / 60e3);
    const span = (...parts) => parts.filter(([n]) => n).map(([n, unit]) => `${n}\u00a0${unit}`)
      .join(" ");
    if (min < 60) return span([min, "min"]);
    const hours = Math.floor(min / 60);
    if (hours < 48) return span([hours, "h"], [min % 60, "min"]);
    const days = Math.floor(hours / 24);
    const rest = min - days * 1440; // minutes past the whole days
    return span([days, "d"], rest < 60 ? [rest, "min"] : [Math.ceil(rest / 60), "h"]);
  }

  function rangeLabel(range) {
    const option = $("range").querySelector(`option[value="${range}"]`);
    return option ? option.textContent : range;
  }

  // An inline SVG: the numeric value over time (if there is one), a strip of
  // the state over time beneath it, and a line at every change of state.
  // `more`: the range holds older events than these (the API gives at most
  // HISTORY_LIMIT a page), so the chart says how far back it really goes.
  // `rollups` ({ step, rows }, when the range holds more events than these):
  // the value is drawn from its windows over the whole range, each window's
  // average as the line and its min to max shaded; the state strip still
  // comes from the events, the newest of the range.
  function renderChart(figure, events, more, rollups) {
    const now = Date.now();
    const evs = events.map((e) => ({ ...e, ms: tsMillis(e.ts) })).filter((e) => e.ms != null)
      .sort((a, b) => a.ms - b.ms);
    if (!evs.length) {
      figure.replaceChildren(...noEvents());
      return;
    }
    const stepMs = rollups && rollups.step === "1h" ? 3600e3 : 60e3;
    const windows = rollups ? rollups.rows
      .map((w) => ({ start: tsMillis(w.start), value: w.sum == null ? null : w.sum / w.count,
        min: w.min, max: w.max, count: w.count }))
      .filter((w) => w.start != null && isNumber(w.value)).sort((a, b) => a.start - b.start)
      // Drawn at the middle of its window (at its start, the hourly line ended
      // up to an hour before the newest reading: page probe), the window
      // still under way at most at now.
      .map((w) => ({ ...w, ms: Math.min(w.start + stepMs / 2, Math.max(now, w.start)) }))
      : [];
    const fromRollups = windows.length > 0;
    const numeric = fromRollups ? windows : evs.filter((e) => isNumber(e.value));
    const W = Math.max(280, Math.floor(figure.clientWidth || 600));
    // The value axis: its lowest and highest readings, with a margin.
    let lo = 0;
    let hi = 0;
    let margin = 0;
    if (numeric.length) {
      lo = Math.min(...numeric.map((e) => (fromRollups ? e.min : e.value)));
      hi = Math.max(...numeric.map((e) => (fromRollups ? e.max : e.value)));
      // Halves: the range of two readings near the double's limits is past
      // it (hi - lo was Infinity, and every point NaN: page probe, -1e308).
      // One value: a band around it, 1 either side, or 1% of it when larger
      // (-1e308 - 1 is -1e308: the scale was 0 high).
      margin = hi === lo ? Math.max(Math.abs(hi) / 100, 1) : (hi / 2 - lo / 2) * 0.16;
    }
    const top = Math.min(hi + margin, Number.MAX_VALUE);
    const bottom = Math.max(lo - margin, -Number.MAX_VALUE);
    // Four significant digits are enough for an axis ("1.2345678901234568e+29"
    // was cut to "68e+29"), and it is wide enough for them. Its highest and
    // lowest readings, or, of one value, the band's ends (not one number twice).
    const axisValue = (v) => (Math.abs(v) >= 1e6 || (v !== 0 && Math.abs(v) < 0.01)
      ? String(Number(v.toPrecision(4))) : formatValue(v));
    const labels = !numeric.length ? [] : hi === lo ? [axisValue(top), axisValue(bottom)]
      : [axisValue(hi), axisValue(lo)];
    const padL = numeric.length ? Math.max(48, 10 + 7 * Math.max(...labels.map((t) => t.length))) : 8;
    const padR = 10;
    const plotTop = 8;
    const plotH = numeric.length ? 150 : 0;
    const stripTop = plotTop + plotH + (numeric.length ? 8 : 0);
    const stripH = 26;
    const H = stripTop + stripH + 22;
    const last = Math.max(evs[evs.length - 1].ms, ...windows.map((w) => w.ms));
    // The newest state holds until now, the end of the chosen range: the
    // strip reaches it however long ago the last event was (it used to stop
    // a minute after a lone event, and the caption read "from 1:08 to 1:08").
    let t0 = fromRollups ? Math.min(evs[0].ms, windows[0].start) : evs[0].ms;
    const t1 = Math.max(now, last);
    const untilNow = t1 === now;
    if (t1 - t0 < 60e3) t0 = t1 - 60e3;
    const x = (ms) => padL + ((ms - t0) / (t1 - t0)) * (W - padL - padR);

    const changes = evs.filter((e, i) => i > 0 && e.state !== evs[i - 1].state);
    const end = untilNow ? "now" : formatTime(t1);
    const newest = evs[evs.length - 1].state;
    const heldFrom = changes.length ? changes[changes.length - 1].ms : evs[0].ms;
    const held = `${stateName(newest)} since ${formatTime(heldFrom)}`;
    const changeCount = changes.length === 1 ? "1 change of state" : `${changes.length} changes of state`;
    const per = rollups && rollups.step === "1h" ? "hour" : "minute";
    // "between 1 and 3", or "all 1" when they are one value ("between 1 and 1").
    const span = (lowest, highest, all) => (lowest === highest
      ? `${all} ${formatValue(lowest)}` : `between ${formatValue(lowest)} and ${formatValue(highest)}`);
    const windowCount = numeric.length === 1 ? `1 ${per}` : `${numeric.length} ${per}s`;
    // From the axis's start: the chart spans at least a minute, so a lone
    // (or future-dated) event read "from 9:13:42 to 9:13:42" (page probe).
    const summary = fromRollups
      ? `Value from ${formatTime(t0)} to ${end}: the average of each ${per} with readings `
        + `(${windowCount}, shaded from lowest to highest), `
        + `${span(Math.min(...numeric.map((w) => w.min)), Math.max(...numeric.map((w) => w.max)), "all")}`
        + `; states from ${formatTime(evs[0].ms)}: `
        + `${changes.length ? changeCount : "no change of state"}; ${held}.`
      : numeric.length
      ? `Value from ${formatTime(t0)} to ${end}: ${numeric.length} `
        + `${numeric.length === 1 ? "reading" : "readings"} `
        + `${span(Math.min(...numeric.map((e) => e.value)), Math.max(...numeric.map((e) => e.value)),
          numeric.length === 1 ? "of" : "all")}; `
        + `${changes.length ? changeCount : "no change of state"}; ${held}.`
      : changes.length
        ? `State from ${formatTime(t0)} to ${end}: ${changeCount}; ${held}.`
        : `State ${held}: no change of state in this range.`;
    const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
      "aria-label": summary, "data-testid": "chart-svg", "data-numeric": numeric.length > 0,
      "data-series": fromRollups ? `rollups-${rollups.step}` : "events" });

    if (numeric.length) {
      const y = (v) => plotTop + (1 - (v / 2 - bottom / 2) / (top / 2 - bottom / 2)) * plotH;
      svg.append(
        s("rect", { class: "plot-bg", x: padL, y: plotTop, width: W - padL - padR, height: plotH }),
        s("text", { class: "axis", x: padL - 4, y: plotTop + 10, "text-anchor": "end",
          text: labels[0] }),
        s("text", { class: "axis", x: padL - 4, y: plotTop + plotH, "text-anchor": "end",
          text: labels[1] }));
      if (fromRollups && numeric.length <= 200) {
        // A point per window, so that one window (a week's chart of a device
        // seen only this hour) is not an empty plot: a path of one point has
        // no length (page probe).
        for (const w of numeric) {
          svg.append(s("circle", { class: "point rollup-point", cx: x(w.ms).toFixed(1),
            cy: y(w.value).toFixed(1), r: 3 },
          s("title", { text: `The ${per} from ${formatTime(w.start)}: average ${formatValue(w.value)}, `
            + `${span(w.min, w.max, "all")} (${w.count} ${w.count === 1 ? "reading" : "readings"})` })));
        }
      }
      if (fromRollups) {
        // Lowest to highest of each window: along the maxima, back along the minima.
        const upper = numeric.map((w, i) => `${i ? "L" : "M"}${x(w.ms).toFixed(1)},${y(w.max).toFixed(1)}`);
        const lower = numeric.slice().reverse()
          .map((w) => `L${x(w.ms).toFixed(1)},${y(w.min).toFixed(1)}`);
        svg.append(s("path", { class: "band", d: `${upper.join(" ")} ${lower.join(" ")} Z` }));
      }
      const d = numeric.map((e, i) => `${i ? "L" : "M"}${x(e.ms).toFixed(1)},${y(e.value).toFixed(1)}`);
      svg.append(s("path", { class: "line", d: d.join(" ") }));
      if (!fromRollups && numeric.length <= 200) {
        for (const e of numeric) {
          svg.append(s("circle", { class: "point", cx: x(e.ms).toFixed(1), cy: y(e.value).toFixed(1),
            r: 3.5, fill: stateColor(e.state) },
          s("title", { text: `${formatTime(e.ms)}: ${formatValue(e.value)} (${stateName(e.state)})` })));
        }
      }
    }

    // The state strip: each event's state lasts until the next event.
    evs.forEach((e, i) => {
      const start = x(e.ms);
      const end = i + 1 < evs.length ? x(evs[i + 1].ms) : W - padR;
      const width = Math.max(end - start, 1.5);
      svg.append(s("rect", { class: "state-seg", x: start.toFixed(1), y: stripTop,
        width: width.toFixed(1), height: stripH, fill: stateColor(e.state) },
      s("title", { text: `${stateName(e.state)} from ${formatTime(e.ms)}` })));
    });
    // Label the strip where a state's run is wide enough for its name.
    let runStart = 0;
    evs.forEach((e, i) => {
      const last = i + 1 === evs.length || evs[i + 1].state !== e.state;
      if (!last) return;
      const a = x(evs[runStart].ms);
      const b = i + 1 < evs.length ? x(evs[i + 1].ms) : W - padR;
      const label = stateName(e.state);
      if (b - a > label.length * 7 + 8) {
        svg.append(s("text", { class: "seg-label", x: ((a + b) / 2).toFixed(1),
          y: stripTop + stripH / 2 + 4, "text-anchor": "middle", text: label }));
      }
      runStart = i + 1;
    });

    for (const e of changes) {
      const cx = x(e.ms).toFixed(1);
      svg.append(s("line", { class: "change", "data-state": e.state, x1: cx, x2: cx,
        y1: plotTop, y2: stripTop + stripH },
      s("title", { text: `${formatTime(e.ms)}: now ${stateName(e.state)}` })));
    }

    svg.append(
      s("text", { class: "axis", x: padL, y: H - 6, "text-anchor": "start", text: formatTime(t0) }),
      s("text", { class: "axis", x: W - padR, y: H - 6, "text-anchor": "end", text: end }));

    const states = [...new Set(evs.map((e) => e.state))];
    const legend = h("ul", { class: "legend" }, states.map((st) => {
      const item = h("li", { text: stateName(st) });
      item.style.setProperty("--state-color", stateColor(st));
      return item;
    }));
    const limit = more ? h("p", { class: "chart-limit", "data-testid": "chart-limit",
      text: fromRollups
        ? `The value covers the whole range, a point per ${per}; the states, the newest `
          + `${evs.length} events, back to ${formatTime(evs[0].ms)}.`
        : `Showing the newest ${evs.length} events, back to ${formatTime(evs[0].ms)}: `
          + "older events in this range are not shown." }) : null;
    figure.replaceChildren(...[limit, svg, h("figcaption", { class: "hint", text: summary }), legend]
      .filter(Boolean));
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      if (lastHistory && current && current.route && current.route.name === "device") {
        renderChart($("chart"), lastHistory.events || [], Boolean(lastHistory.next_cursor),
          lastRollups);
      }
    }, 150);
  });

  // A rejection's reason in a manager's words, with what it means; the code
  // (as `gateway rejected`, the API and the metrics name it) stays under it,
  // for whoever runs the gateway. The README's table of reasons says the same.
  const REASONS = {
    topic: ["Bad topic", "Its topic matches no topic template of the gateway, or its tenant "
      + "or device part is empty, too long or holds a character ids may not hold."],
    empty: ["Empty message", "The device sent nothing in it."],
    too_large: ["Too large", "It is larger than the gateway takes in one message."],
    unsupported_content_type: ["Unknown format",
      "It says it is neither JSON nor MessagePack, the two formats the gateway reads."],
    invalid_json: ["Not valid JSON", "It could not be read as JSON; the detail says where."],
    invalid_msgpack: ["Not valid MessagePack",
      "It could not be read as MessagePack; the detail says where."],
    not_an_object: ["Not an event", "It is valid, but not one event (a list or a number)."],
    unknown_field: ["Unknown field", "It has a field the gateway does not know."],
    invalid_field: ["Bad value", "A field has the wrong type, size or value; the detail names it."],
    invalid_ts: ["Bad time", "Its time cannot be read, is too old or is too far ahead."],
    too_many_states: ["Too many states",
      "It brings a new state to a tenant that has as many states as the gateway allows."],
    quota: ["Device limit reached",
      "It comes from a new device of a tenant that has as many devices as the gateway allows."],
  };

  function reasonCell(code) {
    const known = Object.hasOwn(REASONS, code) ? REASONS[code] : null;
    return h("td", { "data-label": "Reason", title: known ? known[1] : null }, h("div", null,
      h("span", { class: "reason-words", text: known ? known[0] : code }),
      known ? h("code", { class: "reason-code", "data-testid": "reason-code", text: code }) : null));
  }

  function rejectedView(r) {
    showView("rejected");
    $("rejected-title").textContent = `Rejected messages of ${r.tenant}`;
    document.title = `Rejected · ${r.tenant} · Device states`;
    $("rejected-rows").replaceChildren();
    // Not the last tenant's "Nothing rejected" while this one's load.
    show($("rejected-empty"), false);
    const meta = $("rejected-meta");
    meta.textContent = "Loading…";
    let drawn = false;
    return {
      crumbs: () => tenantCrumbs(r, ["Rejected", ""]),
      failed() {
        if (!drawn) {
          meta.textContent =
            "The rejected messages could not be loaded; the page will try again by itself.";
        }
      },
      async refresh(signal) {
        const { data, changed } = await api(pathOf("tenants", r.tenant, "rejected"),
          { since: REJECTED_SINCE, limit: REJECTED_LIMIT }, signal);
        if (!changed && drawn) return;
        drawn = true;
        const items = data.rejected || [];
        // The newest come first: at the cap, older ones of the 24 hours are left out.
        meta.textContent = data.truncated
          ? `The newest ${items.length} are shown, back to `
            + `${formatTime(tsMillis(items[items.length - 1].received_at))}; older ones of `
            + "the last 24 hours are not listed."
          : "";
        const open = openTexts($("rejected-rows"));
        $("rejected-rows").replaceChildren(...items.map((m) => h("tr", null,
          h("td", { "data-label": "Received" }, timeEl(m.received_at)),
          // The device's page, to see what it sent before and after (page probe).
          h("td", { "data-label": "Device", class: "wrap-anywhere", title: m.topic },
            m.device_id == null ? m.topic : h("a", { href: href(["t", r.tenant, "d", m.device_id]),
              "data-testid": "rejected-device", text: m.device_id })),
          reasonCell(m.reason),
          h("td", { "data-label": "Detail", class: "detail", text: m.detail == null ? "" : m.detail }),
          h("td", { "data-label": "Payload", class: "payload" },
            payloadCell(m, `${m.received_at} ${m.topic}`, open)),
          h("td", { "data-label": "Size", class: "nowrap",
            text: Number.isFinite(m.payload_size) ? `${m.payload_size.toLocaleString()} B` : "" }))));
        show($("rejected-empty"), items.length === 0);
      },
    };
  }

  // ------------------------------------------------------------------ the router

  const VIEWS = { home: homeView, states: statesView, devices: devicesView, device: deviceView,
    rejected: rejectedView };

  function viewKey(r) {
    return JSON.stringify([r.name, r.tenant, r.state, r.device]);
  }

  // Where the reader was in each list (by address, the newest SCROLLS_KEPT):
  // back from a device, the list comes back there once drawn, not at its top,
  // with the row that was at the top of the screen where it was. The offset
  // alone put another row under the thumb once devices had come in above it
  // (page probe: the row left at 309 px came back at 711).
  const SCROLLS_KEPT = 50;
  const scrolls = new Map();
  let pendingScroll = null;
  let listAddress = null; // the address of the list shown, filters included
  window.addEventListener("scroll", () => {
    if (!current || !current.route || current.route.name !== "devices") return;
    remember(scrolls, location.hash, { y: window.scrollY }, SCROLLS_KEPT);
  }, { passive: true });

  // Leaving a list: where it was, and its row at the top of the screen.
  function rememberList() {
    const row = topRow($("device-rows"), "device");
    remember(scrolls, listAddress, { y: window.scrollY, device: row ? row.dataset.device : null,
      top: row ? row.getBoundingClientRect().top : 0 }, SCROLLS_KEPT);
  }

  // Called by a list once its rows are drawn the first time.
  function restoreScroll() {
    const saved = pendingScroll;
    pendingScroll = null;
    if (!saved) return;
    window.scrollTo(0, saved.y);
    const row = saved.device != null
      && [...$("device-rows").rows].find((tr) => tr.dataset.device === saved.device);
    if (row) window.scrollBy(0, row.getBoundingClientRect().top - saved.top);
  }

  function route({ focus = false } = {}) {
    if (askingTabs) return; // routed once the other tabs answered, or did not
    if (!token) {
      showLogin($("login-message").textContent);
      return;
    }
    const r = parseHash();
    // A device search under way must not open its answer over the view
    // chosen meanwhile.
    clearFound();
    const moved = !current || !current.route || viewKey(current.route) !== viewKey(r);
    if (moved && current && current.route && current.route.name === "devices") rememberList();
    if (r.name === "devices") listAddress = location.hash;
    // Taken now: the scroll to the top below is recorded for this address too.
    pendingScroll = moved && r.name === "devices" ? scrolls.get(location.hash) || null : null;
    stopPolling();
    showError(null);
    show($("logout"), true);
    failures = 0;
    halted = null;
    lastOk = null;
    viewSince = Date.now();
    current = VIEWS[r.name](r);
    current.route = r;
    setCrumbs(current.crumbs());
    // Move the focus to the new view's heading (for screen readers), but not
    // while someone is typing a filter or choosing a range in it.
    if (focus || moved) {
      const view = document.querySelector("main > .view:not([hidden])");
      const heading = view && view.querySelector("h1");
      const active = document.activeElement;
      const typing = active && view && view.contains(active) && active.matches("input, select");
      if (heading && !typing) {
        heading.setAttribute("tabindex", "-1");
        heading.focus({ preventScroll: true });
      }
      if (moved) window.scrollTo(0, 0);
    }
    tick();
  }

  window.addEventListener("hashchange", () => route());
  setInterval(() => {
    updateAges();
    renderLive();
  }, 1000);
  route({ focus: true });
})();
