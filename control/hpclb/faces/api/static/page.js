// hpclb status page: plain ES2020, no framework, no build step, nothing fetched
// from anywhere but the appliance. Data: GET /api/v1/{status,vips,backends,history};
// live updates from GET /api/v1/events (server-sent events, one a second), or by
// polling every 2 s when no event came for a while (or with ?transport=poll).
// Rows are built once per backend and only their changed cells are written;
// plots are drawn only for rows on screen, so 1,000 backends stay cheap.
"use strict";

const API = "/api/v1";
const WINDOW_S = 300; // what the plots show
const POLL_MS = 2000;
const STALE_MS = 3500; // no event for this long: poll instead
const SSE_RETRY_MS = 30000; // a closed event stream is tried again this often
const TOKEN_KEY = "hpclb.token";
const PLOT_W = 80;
const PLOT_H = 24;
const SWEEP_MS = 10000; // rows off screen are brought up to date this often

const $ = (id) => document.getElementById(id);

// --- small helpers ----------------------------------------------------------------

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function setClass(node, name, on) {
  if (node.classList.contains(name) !== on) node.classList.toggle(name, on);
}

function fmtNumber(x, digits = 2) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(1) + "k";
  if (Number.isInteger(x)) return String(x);
  const fixed = x.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : digits);
  return fixed.includes(".") ? fixed.replace(/\.?0+$/, "") : fixed;
}

function fmtPercent(part, whole) {
  if (part === null || part === undefined || !whole) return null;
  return Math.round((100 * part) / whole) + "%";
}

function fmtTime(unix) {
  if (!unix) return "–";
  return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
}

// --- the last minutes of samples, one column per series ---------------------------

class Ring {
  constructor(capacity) {
    this.cap = capacity;
    this.times = new Float64Array(capacity);
    this.cols = new Map();
    this.start = 0;
    this.n = 0;
  }

  get lastTime() {
    return this.n ? this.times[(this.start + this.n - 1) % this.cap] : 0;
  }

  // values: Map key -> number; a series absent from a sample reads 0 there.
  push(t, values) {
    let pos;
    if (this.n < this.cap) {
      pos = (this.start + this.n) % this.cap;
      this.n += 1;
    } else {
      pos = this.start;
      this.start = (this.start + 1) % this.cap;
    }
    this.times[pos] = t;
    for (const col of this.cols.values()) col[pos] = 0;
    for (const [key, v] of values) {
      let col = this.cols.get(key);
      if (!col) {
        col = new Float32Array(this.cap).fill(Number.NaN); // unknown before it appeared
        this.cols.set(key, col);
      }
      col[pos] = v;
    }
  }

  // fn(t, v) over the samples of `key`, oldest first.
  each(key, fn) {
    const col = this.cols.get(key);
    for (let i = 0; i < this.n; i++) {
      const pos = (this.start + i) % this.cap;
      fn(this.times[pos], col ? col[pos] : Number.NaN);
    }
  }

  latest(key) {
    const col = this.cols.get(key);
    return col && this.n ? col[(this.start + this.n - 1) % this.cap] : Number.NaN;
  }
}

function sampleValues(sample) {
  const values = new Map();
  for (const [name, p] of Object.entries(sample.vips || {})) {
    values.set(`v:${name}:pps`, p.pps);
    values.set(`v:${name}:bps`, p.bps);
  }
  for (const [name, p] of Object.entries(sample.backends || {})) {
    values.set(`b:${name}:pps`, p.pps);
    values.set(`b:${name}:share`, p.share);
  }
  return values;
}

// GET /history's aligned series as samples, those newer than `after` only.
function historySamples(h, after) {
  const out = [];
  (h.t || []).forEach((t, i) => {
    if (t <= after) return;
    const vips = {};
    const backends = {};
    for (const [name, s] of Object.entries(h.vips || {})) {
      vips[name] = { pps: s.pps[i], bps: s.bps[i] };
    }
    for (const [name, s] of Object.entries(h.backends || {})) {
      backends[name] = { pps: s.pps[i], share: s.share[i] };
    }
    out.push({ t, vips, backends });
  });
  return out;
}

// --- plots ---------------------------------------------------------------------------

function makePlot(label) {
  const canvas = el("canvas", { class: "plot", role: "img", "aria-label": label });
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(PLOT_W * ratio);
  canvas.height = Math.round(PLOT_H * ratio);
  canvas.style.width = `${PLOT_W}px`;
  canvas.style.height = `${PLOT_H}px`;
  return canvas;
}

// One series of the ring on a canvas, time on x (the newest sample at the right
// edge), 0..top on y (top: `fixedTop`, else the series' own peak); returns the peak.
function drawPlot(canvas, ring, key, fixedTop, colour) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width;
  const h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const end = ring.lastTime;
  let peak = 0;
  ring.each(key, (t, v) => {
    if (v > peak) peak = v;
  });
  const top = fixedTop || peak || 1;
  const pad = 1.5 * (window.devicePixelRatio || 1);
  const x = (t) => w - ((end - t) / WINDOW_S) * w;
  const y = (v) => h - pad - (v / top) * (h - 2 * pad);
  ctx.lineWidth = pad;
  ctx.strokeStyle = colour;
  ctx.fillStyle = colour + "33";
  ctx.beginPath();
  let prevT = null;
  let firstX = null;
  let lastX = null;
  const closeArea = () => {
    if (firstX === null) return;
    ctx.stroke();
    ctx.lineTo(lastX, h);
    ctx.lineTo(firstX, h);
    ctx.closePath();
    ctx.fill();
    ctx.beginPath();
    firstX = null;
  };
  ring.each(key, (t, v) => {
    if (end - t > WINDOW_S || Number.isNaN(v)) {
      closeArea();
      prevT = null;
      return;
    }
    if (prevT !== null && t - prevT > 5) closeArea(); // a gap: no line across it
    const px = x(t);
    if (firstX === null) {
      ctx.moveTo(px, y(v));
      firstX = px;
    } else ctx.lineTo(px, y(v));
    lastX = px;
    prevT = t;
  });
  closeArea();
  return peak;
}

// --- the API --------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const kind = body && body.error ? body.error : `HTTP ${status}`;
    const msg = body && body.message ? body.message : "";
    super(`${kind} (${status})${msg ? ": " + msg : ""}`);
    this.status = status;
    this.problems = (body && body.problems) || [];
  }
}

const page = {
  token: null,
  role: null, // "read" | "write" | null (not known: buttons shown, a 403 says so)
  ring: new Ring(WINDOW_S),
  backends: new Map(), // name -> row record
  vips: new Map(), // name -> row record
  vipData: [],
  backendOrder: "",
  revision: null,
  es: null,
  esOpenedAt: 0,
  lastEventAt: 0,
  forcePoll: new URLSearchParams(location.search).get("transport") === "poll",
  timer: null,
  polling: false,
  visible: new Set(),
  observer: null,
  firstRender: false,
  lastSweep: 0,
};

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${page.token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(API + path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
  });
  const role = res.headers.get("X-Hpclb-Role"); // when the server tells the token's role
  if (role === "read" || role === "write") setRole(role);
  let data = null;
  try {
    data = await res.json();
  } catch (_) {
    data = null;
  }
  if (!res.ok) throw new ApiError(res.status, data);
  return data;
}

// --- messages, role, transport ------------------------------------------------------

function say(text, kind = "info") {
  const m = $("message");
  m.hidden = !text;
  m.dataset.kind = kind;
  setText(m, text || "");
}

function setRole(role) {
  page.role = role;
  document.body.dataset.role = role || "unknown";
  setText($("role"), role === "write" ? "read-write token" : role === "read"
    ? "read-only token" : "");
}

function setTransport(kind) {
  document.body.dataset.transport = kind;
  const words = {
    sse: "live (server-sent events)",
    poll: `polling every ${POLL_MS / 1000} s`,
    off: "not connected",
    error: "connection lost: retrying",
  };
  setText($("transport"), words[kind] || kind);
}

function failed(err, what) {
  if (err instanceof ApiError && err.status === 401) {
    say(`The token was refused (${err.message}). Enter a valid token.`, "error");
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    page.token = null;
    $("token").focus();
    return;
  }
  if (err instanceof ApiError && err.status === 403) {
    setRole("read");
    say(`${what}: this token may read, not write (403): drain, undrain and pin need a ` +
      "write token.", "error");
    return;
  }
  const problems = err.problems && err.problems.length ? ` — ${err.problems.join("; ")}` : "";
  say(`${what}: ${err.message}${problems}`, "error");
}

// --- header -----------------------------------------------------------------------------

function applyStatus(s) {
  setText($("appliance"), s.appliance);
  document.title = `${s.appliance} · hpclb status`;
  const dp = s.dataplane || {};
  setText($("dataplane"), `${dp.kind}${dp.attach_mode ? ` (${dp.attach_mode})` : ""}` +
    (s.pushes_pending ? " · tables not yet pushed" : ""));
  setClass($("dataplane"), "warn", !!s.pushes_pending);
  setText($("revision"), s.revision);
  const c = s.counts || {};
  setText($("backends-up"), `${c.backends_up} of ${c.backends}`);
  setClass($("backends-up"), "warn", c.backends_up < c.backends);
  setText($("updated"), fmtTime(s.time));
  const alarms = s.alarms || [];
  $("alarms-section").hidden = alarms.length === 0;
  const text = alarms.map((a) => `${a.source}: ${a.message}`);
  const list = $("alarms");
  if (list.dataset.text !== text.join("\n")) {
    list.dataset.text = text.join("\n");
    list.replaceChildren(...text.map((t) => el("li", {}, t)));
  }
  if (page.revision !== null && s.revision !== page.revision) {
    loadVips().catch((e) => failed(e, "VIPs")); // a write changed the configuration
  }
  page.revision = s.revision;
}

// --- VIP table ----------------------------------------------------------------------------

function vipRow(v) {
  const tr = el("tr", { "data-vip": v.name });
  const cells = {};
  for (const f of ["name", "address", "mode", "pool", "up", "pps", "bps"]) {
    cells[f] = el("td", { "data-field": f });
    tr.append(cells[f]);
  }
  cells.name.textContent = v.name;
  cells.bps.className = "num";
  const plot = makePlot(`packets per second of VIP ${v.name}, last 5 minutes`);
  const now = el("span", { class: "now" });
  cells.pps.append(plot, now);
  return { tr, cells, plot, now, name: v.name };
}

function renderVips() {
  const body = $("vips").tBodies[0];
  const names = page.vipData.map((v) => v.name);
  if (names.join("\n") !== [...page.vips.keys()].join("\n")) {
    page.vips = new Map(page.vipData.map((v) => [v.name, vipRow(v)]));
    body.replaceChildren(...[...page.vips.values()].map((r) => r.tr));
  }
  const upByPool = new Map();
  const allByPool = new Map();
  for (const r of page.backends.values()) {
    const b = r.data;
    allByPool.set(b.pool, (allByPool.get(b.pool) || 0) + 1);
    if (b.state === "up") upByPool.set(b.pool, (upByPool.get(b.pool) || 0) + 1);
  }
  for (const v of page.vipData) {
    const r = page.vips.get(v.name);
    const host = v.address.includes(":") ? `[${v.address}]` : v.address;
    setText(r.cells.address, `${host}:${v.port}/${v.protocol}`);
    setText(r.cells.mode, v.mode);
    setText(r.cells.pool, v.pool);
    const up = upByPool.get(v.pool) || 0;
    const all = allByPool.get(v.pool) || 0;
    setText(r.cells.up, `${up} of ${all}`);
    setClass(r.cells.up, "down", up === 0);
    drawVip(r);
  }
}

function drawVip(r) {
  const top = drawPlot(r.plot, page.ring, `v:${r.name}:pps`, 0, "#1f6feb");
  const pps = page.ring.latest(`v:${r.name}:pps`);
  setText(r.now, fmtNumber(pps));
  r.plot.setAttribute("aria-label",
    `packets per second of VIP ${r.name}, last 5 minutes: now ${fmtNumber(pps)}, ` +
    `peak ${fmtNumber(top)}`);
  setText(r.cells.bps, fmtNumber(page.ring.latest(`v:${r.name}:bps`)));
}

async function loadVips() {
  page.vipData = await api("GET", "/vips");
  renderVips();
}

// --- backend table ------------------------------------------------------------------------

const BACKEND_FIELDS = ["name", "pool", "address", "health", "state", "weight", "pin",
  "inputs", "pps", "share", "actions"];

function backendRow(name) {
  const tr = el("tr", { "data-backend": name });
  const cells = {};
  for (const f of BACKEND_FIELDS) {
    cells[f] = el(f === "name" ? "th" : "td", { "data-field": f });
    tr.append(cells[f]);
  }
  cells.name.setAttribute("scope", "row");
  cells.name.textContent = name;
  cells.weight.className = "num";
  cells.actions.className = "actions";
  const admin = el("button", { type: "button", "data-action": "drain", "data-name": name,
    "aria-label": `drain ${name}` }, "drain");
  const pin = el("button", { type: "button", "data-action": "pin", "data-name": name,
    "aria-label": `pin the weight of ${name}`, title: "pin the weight for some minutes" },
    "pin");
  cells.actions.append(admin, pin);
  const ppsPlot = makePlot(`packets per second of ${name}`);
  const ppsNow = el("span", { class: "now" });
  cells.pps.append(ppsPlot, ppsNow);  // no space between: the cell's width is fixed
  const sharePlot = makePlot(`share of new flows of ${name}`);
  const shareNow = el("span", { class: "now" });
  cells.share.append(sharePlot, shareNow);
  const r = { tr, cells, admin, ppsPlot, ppsNow, sharePlot, shareNow, name, data: null };
  if (page.observer) page.observer.observe(tr);
  return r;
}

function inputsText(b) {
  const i = b.weight.inputs;
  const parts = [];
  if (i) {
    if (i.cpu_load !== null && i.cpu_load !== undefined) parts.push(`cpu ${fmtNumber(i.cpu_load)}`);
    const mem = fmtPercent(i.mem_used, i.mem_total);
    if (mem) parts.push(`mem ${mem}`);
  }
  const rtt = i && i.rtt_ms !== null && i.rtt_ms !== undefined ? i.rtt_ms : b.health.rtt_ms;
  if (rtt !== null && rtt !== undefined) parts.push(`rtt ${fmtNumber(rtt)} ms`);
  if (i) {
    const gpu = fmtPercent(i.gpu_mem_used, i.gpu_mem_total);
    if (gpu) parts.push(`gpu mem ${gpu}`);
    if (i.score !== null && i.score !== undefined) parts.push(`score ${fmtNumber(i.score)}`);
    if (i.age_s !== undefined && i.age_s > 5) parts.push(`${Math.round(i.age_s)} s old`);
  }
  return parts.length ? parts.join(" · ") : "–";
}

function healthText(h) {
  if (h.unknown) return "unknown";
  if (h.up) return "up";
  return "down";
}

// A row's data is kept on every update but written into the DOM only while the
// row is on screen, and every SWEEP_MS for the others: any text change makes the
// browser lay the table out again, and 1,000 rows of changes cost ~4x one row's.
function updateBackend(r, b) {
  r.data = b;
  r.dirty = true;
  if (page.visible.has(r)) renderBackend(r);
}

function renderBackend(r) {
  const b = r.data;
  r.dirty = false;
  const c = r.cells;
  setText(c.pool, b.pool);
  setText(c.address, b.address);
  const health = healthText(b.health);
  const why = [];
  if (!b.health.probe_up && !b.health.unknown) why.push("probe failing");
  if (b.health.beats_missed) why.push("heartbeats missed");
  if (b.health.damping && b.health.damping.suppressed) why.push("flap damping");
  setText(c.health, health + (why.length && health !== "up" ? ` (${why.join(", ")})` : ""));
  setClass(c.health, "down", health === "down");
  setClass(c.health, "unknown", health === "unknown");
  setClass(r.tr, "down", b.state === "down");
  setClass(r.tr, "draining", b.state === "draining");
  setClass(r.tr, "health-down", health === "down");
  const state = b.state === b.admin_state ? b.state : `${b.state} (admin: ${b.admin_state})`;
  setText(c.state, state);
  c.state.dataset.state = b.state;
  c.state.dataset.admin = b.admin_state;
  setText(c.weight, `${fmtNumber(b.weight.live)} / ${fmtNumber(b.weight.configured)}`);
  const pin = b.weight.pinned;
  setText(c.pin, pin ? `${fmtNumber(pin.weight)} until ${fmtTime(pin.until)}` : "–");
  setClass(c.pin, "pinned", !!pin);
  setText(c.inputs, inputsText(b));
  const action = b.admin_state === "draining" ? "undrain" : b.admin_state === "down" ? "up"
    : "drain";
  if (r.admin.dataset.action !== action) {
    r.admin.dataset.action = action;
    r.admin.textContent = action;
    r.admin.setAttribute("aria-label", `${action} ${b.name}`);
  }
}

function applyBackends(list) {
  const order = list.map((b) => b.name).join("\n");
  if (order !== page.backendOrder) {
    const rows = new Map();
    for (const b of list) rows.set(b.name, page.backends.get(b.name) || backendRow(b.name));
    for (const [name, r] of page.backends) {
      if (!rows.has(name)) {
        if (page.observer) page.observer.unobserve(r.tr);
        page.visible.delete(r);
      }
    }
    page.backends = rows;
    const frag = document.createDocumentFragment();
    for (const r of rows.values()) frag.append(r.tr);
    $("backends").tBodies[0].replaceChildren(frag);
    page.backendOrder = order;
    applyFilter();
  }
  for (const b of list) updateBackend(page.backends.get(b.name), b);
  if (Date.now() - page.lastSweep > SWEEP_MS) {
    page.lastSweep = Date.now();
    for (const r of page.backends.values()) if (r.dirty) renderBackend(r);
  }
  if (page.vipData.length) renderVips();
  if (!page.firstRender && list.length) {
    page.firstRender = true;
    performance.mark("hpclb-first-render"); // tests read it
    document.body.dataset.ready = "true";
  }
}

function drawBackend(r) {
  const pps = page.ring.latest(`b:${r.name}:pps`);
  const share = page.ring.latest(`b:${r.name}:share`);
  const top = drawPlot(r.ppsPlot, page.ring, `b:${r.name}:pps`, 0, "#1f6feb");
  const topShare = drawPlot(r.sharePlot, page.ring, `b:${r.name}:share`, 1, "#8250df");
  setText(r.ppsNow, fmtNumber(pps));
  setText(r.shareNow, Number.isNaN(share) ? "–" : `${Math.round(share * 100)}%`);
  r.ppsPlot.setAttribute("aria-label", `packets per second of ${r.name}, last 5 minutes: ` +
    `now ${fmtNumber(pps)}, peak ${fmtNumber(top)}`);
  r.sharePlot.setAttribute("aria-label", `share of new flows of ${r.name}, last 5 minutes: ` +
    `now ${r.shareNow.textContent}, peak ${Math.round(topShare * 100)}%`);
}

function drawVisible() {
  for (const r of page.visible) drawBackend(r);
  for (const r of page.vips.values()) drawVip(r);
}

function addSamples(samples) {
  let added = false;
  for (const s of samples) {
    if (s.t > page.ring.lastTime) {
      page.ring.push(s.t, sampleValues(s));
      added = true;
    }
  }
  if (added) drawVisible();
}

function applyFilter() {
  const q = $("filter").value.trim().toLowerCase();
  const onlyDown = $("only-down").checked;
  let shown = 0;
  for (const r of page.backends.values()) {
    const b = r.data;
    const text = b ? `${b.name} ${b.pool} ${b.address}` : r.name;
    const hide = (q && !text.toLowerCase().includes(q)) || (onlyDown && b && b.state === "up");
    if (r.tr.hidden !== hide) r.tr.hidden = hide;
    if (!hide) shown += 1;
  }
  setText($("shown"), `${shown} of ${page.backends.size} shown`);
}

// --- actions (write token) ------------------------------------------------------------------

async function act(button, what, method, path, body, done) {
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  try {
    const res = await api(method, path, body);
    if (res && res.backend) updateBackend(page.backends.get(res.backend.name), res.backend);
    if (res && res.revision) page.revision = res.revision;
    say(done(res), "ok");
    if (page.role === null) setRole("write");
  } catch (err) {
    failed(err, what);
  } finally {
    button.disabled = false;
    button.removeAttribute("aria-busy");
  }
}

function onTableClick(ev) {
  const button = ev.target.closest("button[data-action]");
  if (!button) return;
  const name = button.dataset.name;
  const path = `/backends/${encodeURIComponent(name)}`;
  const action = button.dataset.action;
  if (action === "drain" || action === "undrain" || action === "up") {
    act(button, `${action} ${name}`, "POST", `${path}/${action}`, undefined, (res) =>
      `${name}: ${action} done; admin state ${res.backend.admin_state}` +
      (res.revision ? ` (configuration revision ${res.revision})` : ""));
  } else if (action === "pin") {
    const r = page.backends.get(name);
    setText($("pin-name"), name);
    const pinned = r && r.data && r.data.weight.pinned;
    $("pin-weight").value = pinned ? pinned.weight : (r && r.data ? r.data.weight.configured : 1);
    $("pin-dialog").dataset.name = name;
    $("pin-dialog").returnValue = ""; // Escape keeps the last value: not a second pin
    $("pin-dialog").showModal();
    $("pin-weight").focus();
  }
}

function onPinClose() {
  const dialog = $("pin-dialog");
  const name = dialog.dataset.name;
  const path = `/backends/${encodeURIComponent(name)}/pin`;
  const row = page.backends.get(name);
  const button = row ? row.cells.actions.querySelector('[data-action="pin"]') : $("pin-form");
  if (dialog.returnValue === "pin") {
    const weight = Number($("pin-weight").value);
    const minutes = Number($("pin-minutes").value);
    act(button, `pin ${name}`, "PUT", path, { weight, duration_s: minutes * 60 }, (res) =>
      `${name}: weight pinned at ${fmtNumber(weight)} until ` +
      `${fmtTime(res.backend.weight.pinned && res.backend.weight.pinned.until)}`);
  } else if (dialog.returnValue === "unpin") {
    act(button, `unpin ${name}`, "DELETE", path, undefined, () => `${name}: pin removed`);
  }
}

// --- updates: events, else polling ------------------------------------------------------------

function onEvent(ev) {
  let d;
  try {
    d = JSON.parse(ev.data);
  } catch (_) {
    return; // a torn event: the next one comes in a second
  }
  page.lastEventAt = Date.now();
  setTransport("sse");
  applyStatus(d.status);
  applyBackends(d.backends);
  if (d.sample) addSamples([d.sample]);
}

function openEvents() {
  if (page.forcePoll || typeof EventSource === "undefined") return;
  const es = new EventSource(`${API}/events?token=${encodeURIComponent(page.token)}`);
  es.addEventListener("status", onEvent);
  es.onerror = () => {
    // EventSource reconnects by itself unless the server refused (then CLOSED);
    // meanwhile the timer polls once no event came for STALE_MS.
    if (es.readyState === EventSource.CLOSED && page.es === es) page.es = null;
  };
  page.es = es;
  page.esOpenedAt = Date.now();
}

async function poll() {
  if (page.polling || !page.token) return;
  page.polling = true;
  try {
    const since = page.ring.lastTime;
    const seconds = since ? Math.min(900, Math.max(3, Math.ceil(Date.now() / 1000 - since) + 2))
      : WINDOW_S;
    const [status, backends, history] = await Promise.all([
      api("GET", "/status"), api("GET", "/backends"), api("GET", `/history?seconds=${seconds}`),
    ]);
    if (!page.token) return;
    applyStatus(status);
    applyBackends(backends);
    addSamples(historySamples(history, page.ring.lastTime));
    setTransport("poll");
  } catch (err) {
    if (err instanceof ApiError) failed(err, "update");
    else setTransport("error");
  } finally {
    page.polling = false;
  }
}

function tick() {
  if (!page.token) return;
  const stale = Date.now() - page.lastEventAt > STALE_MS;
  if (page.forcePoll || stale) poll();
  if (!page.forcePoll && !page.es && Date.now() - page.esOpenedAt > SSE_RETRY_MS) openEvents();
}

function stop() {
  if (page.es) page.es.close();
  page.es = null;
  clearInterval(page.timer);
  page.timer = null;
  setTransport("off");
}

async function start() {
  stop();
  say("");
  setTransport("off");
  try {
    // Status first: a refused token is told once, not three times.
    const status = await api("GET", "/status");
    const [vips, backends, history] = await Promise.all([
      api("GET", "/vips"), api("GET", "/backends"), api("GET", `/history?seconds=${WINDOW_S}`),
    ]);
    applyStatus(status);
    page.vipData = vips;
    addSamples(historySamples(history, page.ring.lastTime));
    applyBackends(backends);
    renderVips();
    drawVisible();
  } catch (err) {
    failed(err, "loading");
    if (!page.token) return;
  }
  page.lastEventAt = 0;
  openEvents();
  page.timer = setInterval(tick, POLL_MS);
  if (page.forcePoll) setTransport("poll");
}

// --- wiring -------------------------------------------------------------------------------------

function init() {
  page.observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      const r = page.backends.get(e.target.dataset.backend);
      if (!r) continue;
      if (e.isIntersecting) {
        page.visible.add(r);
        if (r.dirty) renderBackend(r);
        drawBackend(r);
      } else page.visible.delete(r);
    }
  }, { rootMargin: "200px" });
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    $("token").value = "";
    sessionStorage.setItem(TOKEN_KEY, t);
    page.token = t;
    setRole(null);
    start();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    page.token = null;
    stop();
    setRole(null);
    document.body.dataset.role = "none";
    say("Token forgotten.");
  });
  $("backends").addEventListener("click", onTableClick);
  $("pin-dialog").addEventListener("close", onPinClose);
  $("filter").addEventListener("input", applyFilter);
  $("only-down").addEventListener("change", applyFilter);
  page.token = sessionStorage.getItem(TOKEN_KEY);
  if (page.token) {
    setRole(null);
    start();
  } else {
    say("Enter an API token (read or write) to see the appliance.");
    $("token").focus();
  }
}

document.addEventListener("DOMContentLoaded", init);
