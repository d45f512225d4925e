// gpulane live dashboard: polls the same JSON routes as any client (/queues,
// /workers, /stats) and keeps its own short history for the queue chart and each
// GPU's utilization and memory, so the server stores nothing for it. Text goes in through textContent only: worker
// names and task ids are data, never markup.
"use strict";

const POLL_MS = 1000;
const HISTORY_MS = 5 * 60 * 1000;
const SVG_NS = "http://www.w3.org/2000/svg";
const KEY_STORE = "gpulane-api-key";

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  history: [], // {t, depth: {class: n}, rejected: {class: n}}
  classes: [],
  gpus: new Map(), // worker name -> [{t, util, mem}] (fractions; null: no sample)
};

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child != null) node.append(child);
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

// ---- formatting ----

function seconds(s) {
  if (s == null) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s`;
  return `${Math.floor(s / 3600)}h ${Math.round((s % 3600) / 60)}m`;
}

function gib(bytes) {
  return bytes == null ? "–" : `${(bytes / 2 ** 30).toFixed(1)}`;
}

function span(ms) {
  const s = Math.max(1, Math.round(ms / 1000));
  return s < 90 ? `${s} s` : `${Math.round(s / 60)} min`;
}

// ---- fetching ----

class HttpError extends Error {
  constructor(status, body) {
    super((body && body.message) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error;
  }
}

async function getJson(path) {
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) throw new HttpError(response.status, body);
  return body;
}

async function poll() {
  try {
    const [queues, stats, workers] = await Promise.all([
      getJson("/queues"),
      getJson("/stats"),
      // A tenant key that is not an admin sees classes but not workers (404).
      getJson("/workers").catch((e) => (e.status === 404 ? null : Promise.reject(e))),
    ]);
    $("key-form").hidden = true;
    remember(queues, stats);
    rememberGpus(workers);
    renderTotals(queues, workers);
    renderChart();
    renderClasses(queues, stats);
    renderWorkers(workers);
    renderTokens(stats.tokens || {});
    renderDevice(stats.device_seconds || {});
    setConnection("live", "live");
    $("updated").textContent = `· ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    if (error.status === 401) {
      $("key-form").hidden = false;
      setConnection("error", "needs an API key");
    } else {
      setConnection("error", `cannot reach the API (${error.message}); retrying`);
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function setConnection(kind, text) {
  $("conn").className = `conn ${kind}`;
  const announced = $("conn-state");
  if (announced.textContent !== text) announced.textContent = text;
  document.body.classList.toggle("stale", kind !== "live");
}

function remember(queues, stats) {
  const now = Date.now();
  const depth = {};
  const rejected = {};
  for (const c of queues.classes) depth[c.name] = c.depth;
  for (const c of stats.classes) {
    rejected[c.name] = Object.values(c.rejected).reduce((a, b) => a + b, 0);
  }
  state.classes = queues.classes.map((c) => c.name);
  state.history.push({ t: now, depth, rejected });
  while (state.history.length && now - state.history[0].t > HISTORY_MS) state.history.shift();
}

// One sample per poll and GPU worker, for the sparklines in the worker rows. A worker
// that left keeps its samples until they age out, so a restart continues its line.
function rememberGpus(workers) {
  const now = Date.now();
  for (const w of workers ? workers.workers : []) {
    const d = w.device;
    if (!d || d.kind !== "gpu") continue;
    const total = d.memory_total_bytes;
    const used = d.memory_used_bytes;
    const sample = {
      t: now,
      util: d.utilization ?? null,
      mem: total && used != null ? used / total : null,
    };
    if (!state.gpus.has(w.name)) state.gpus.set(w.name, []);
    state.gpus.get(w.name).push(sample);
  }
  for (const [name, samples] of state.gpus) {
    while (samples.length && now - samples[0].t > HISTORY_MS) samples.shift();
    if (!samples.length) state.gpus.delete(name);
  }
}

// ---- header totals ----

function renderTotals(queues, workers) {
  const sum = (key) => queues.classes.reduce((a, c) => a + c[key], 0);
  $("total-queued").textContent = sum("depth");
  $("total-running").textContent = sum("running");
  if (workers) {
    const busy = workers.workers.filter((w) => w.state === "busy").length;
    $("total-workers").textContent = `${busy} / ${workers.workers.length}`;
  } else {
    $("total-workers").textContent = "–";
  }
}

// ---- queue depth chart ----

function niceMax(value) {
  if (value <= 4) return 4;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

// The time axis covers the history the page has (at least 30 s, at most
// HISTORY_MS), so a freshly opened page does not squeeze its data into a corner.
function chartSpan(now) {
  const have = state.history.length ? now - state.history[0].t : 0;
  const rounded = have <= 30000 ? 30000 : Math.ceil(have / 60000) * 60000;
  return Math.min(HISTORY_MS, rounded);
}

function tickLabel(ms) {
  if (ms === 0) return "now";
  return ms % 60000 === 0 ? `−${ms / 60000}m` : `−${ms / 1000}s`;
}

function renderChart() {
  const chart = $("depth-chart");
  const width = Math.max(chart.clientWidth, 200);
  const height = Math.max(chart.clientHeight, 120);
  const pad = { left: 40, right: 14, top: 10, bottom: 22 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const now = Date.now();
  const spanMs = chartSpan(now);
  const top = niceMax(Math.max(0, ...state.history.flatMap((h) => Object.values(h.depth))));
  const x = (t) => pad.left + plotW * (1 - (now - t) / spanMs);
  const y = (v) => pad.top + plotH * (1 - v / top);

  $("chart-span").textContent = `last ${span(spanMs)}`;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  chart.replaceChildren();
  const axisLabel = (text, attrs) => {
    const label = svg("text", { class: "axis", ...attrs });
    label.textContent = text;
    chart.append(label);
  };
  for (const v of [0, top / 2, top]) {
    const at = y(v);
    chart.append(svg("line", { class: "grid", x1: pad.left, x2: width - pad.right, y1: at, y2: at }));
    const text = Number.isInteger(v) ? v : v.toFixed(1);
    axisLabel(text, { x: pad.left - 6, y: at + 4, "text-anchor": "end" });
  }
  // The shortest tick step that leaves room for its label.
  const steps = [5000, 10000, 15000, 30000, 60000, 120000, 300000];
  const step = steps.find((s) => (plotW * s) / spanMs >= 56) || spanMs;
  for (let ago = spanMs; ago >= 0; ago -= step) {
    const anchor = ago === 0 ? "end" : ago === spanMs ? "start" : "middle";
    axisLabel(tickLabel(ago), { x: x(now - ago), y: height - 6, "text-anchor": anchor });
  }
  const legend = $("legend");
  legend.replaceChildren();
  const described = [];
  state.classes.forEach((name, i) => {
    const points = state.history
      .filter((h) => name in h.depth)
      .map((h) => `${x(h.t).toFixed(1)},${y(h.depth[name]).toFixed(1)}`);
    if (points.length) {
      chart.append(svg("polyline", { class: `series s${i % 4}`, points: points.join(" ") }));
    }
    const latest = state.history.length ? state.history.at(-1).depth[name] : null;
    described.push(`${name} ${latest ?? "unknown"}`);
    const swatch = el("i", { "aria-hidden": "true" });
    const value = el("b", { text: latest ?? "–" });
    legend.append(el("span", { class: `key s${i % 4}` }, swatch, `${name} `, value));
  });
  const over = $("chart-span").textContent;
  chart.setAttribute("aria-label", `Queue depth over the ${over}; now: ${described.join(", ")}`);
}

// ---- class cards ----

function stat(label, value, extraClass = "") {
  const pair = [el("dt", { text: label }), el("dd", { text: value })];
  return el("div", { class: `stat ${extraClass}` }, ...pair);
}

function rejectedRecently(name) {
  const first = state.history[0];
  const last = state.history.at(-1);
  if (!first || first === last || !(name in first.rejected)) return null;
  return { n: last.rejected[name] - first.rejected[name], over: last.t - first.t };
}

function renderClasses(queues, stats) {
  const byName = Object.fromEntries(stats.classes.map((c) => [c.name, c]));
  const cards = queues.classes.map((c, i) => {
    const s = byName[c.name];
    const lat = s ? s.latency_s : null;
    const reasons = s ? Object.entries(s.rejected).filter(([, n]) => n > 0) : [];
    const totalRejected = reasons.reduce((a, [, n]) => a + n, 0);
    const recent = rejectedRecently(c.name);
    const over = lat && lat.window_s != null ? `last ${span(lat.window_s * 1000)}` : "all time";
    const basis = lat && lat.count ? `${lat.count} tasks, ${over}` : "no finished tasks yet";
    const swatch = el("i", { class: `swatch s${i % 4}`, "aria-hidden": "true" });
    return el(
      "article",
      { class: "panel card", "aria-labelledby": `class-${i}` },
      el("header", {},
        el("h3", { id: `class-${i}` }, swatch, c.name),
        el("span", { class: `badge pressure-${c.pressure}`, text: c.pressure })),
      el("dl", { class: "stats" },
        stat("queued", c.depth, "big"),
        stat("running", c.running, "big"),
        stat("workers busy", `${c.busy_workers} / ${c.workers}`),
        stat("oldest wait", seconds(c.oldest_wait_s)),
        stat("est. wait", seconds(c.estimated_wait_s))),
      el("h4", {}, "Latency ", el("span", { class: "muted", text: basis })),
      el("dl", { class: "stats latency" },
        stat("p50", seconds(lat && lat.p50)),
        stat("p95", seconds(lat && lat.p95)),
        stat("p99", seconds(lat && lat.p99))),
      el("dl", { class: "stats outcomes" },
        stat("succeeded", s ? s.finished.succeeded : "–", s && s.finished.succeeded ? "ok" : ""),
        stat("failed", s ? s.finished.failed : "–", s && s.finished.failed ? "bad" : ""),
        stat("rejected", totalRejected, totalRejected ? "warn" : ""),
        stat("requeued", s ? s.requeued : "–")),
      el("p", { class: "note", text: rejectionNote(reasons, recent) }),
    );
  });
  $("class-cards").replaceChildren(...cards);
}

function rejectionNote(reasons, recent) {
  if (!reasons.length) return "No submits refused.";
  const parts = reasons.map(([reason, n]) => `${reason.replaceAll("_", " ")} ${n}`).join(", ");
  const since = recent && recent.n > 0 ? `; ${recent.n} in the last ${span(recent.over)}` : "";
  return `Refused: ${parts}${since}.`;
}

// ---- workers ----

function meter(label, fraction, text) {
  if (fraction == null) return el("span", { class: "muted", text });
  const pct = Math.round(Math.min(1, Math.max(0, fraction)) * 100);
  const fill = el("span", { class: `fill ${pct >= 90 ? "hot" : ""}` });
  fill.style.width = `${pct}%`;
  const bar = el("span", {
    class: "meter",
    role: "meter",
    "aria-label": label,
    "aria-valuemin": "0",
    "aria-valuemax": "100",
    "aria-valuenow": String(pct),
  }, fill);
  return el("span", { class: "meter-wrap" }, bar, el("span", { class: "meter-text", text }));
}

const muted = (text) => el("span", { class: "muted", text });

function cell(label, ...content) {
  return el("td", { "data-label": label }, ...content);
}

// A cpu worker (no GPU: invariant 6) says so instead of showing empty bars.
function deviceCells(w) {
  if (w.backend) { // fronts an inference server: its slots are its utilization
    const b = w.backend;
    return [
      el("span", { class: "device backend", text: `backend · ${b.url}`, title: (b.models || []).join(", ") }),
      meter(`${w.name} slots in use`, b.slots ? b.busy / b.slots : null, `${b.busy} / ${b.slots} slots`),
      muted("n/a (backend)"),
    ];
  }
  if (!w.device) { // registered, still choosing or waiting for a GPU
    return [muted("none yet"), muted("–"), muted("–")];
  }
  const d = w.device;
  if (d.kind !== "gpu") {
    const name = d.name && d.name !== "cpu" ? `cpu · ${d.name}` : "cpu";
    return [el("span", { class: "device cpu", text: name }), muted("n/a (cpu)"), muted("n/a (cpu)")];
  }
  const util = d.utilization;
  const used = d.memory_used_bytes;
  const total = d.memory_total_bytes;
  const samples = state.gpus.get(w.name) || [];
  return [
    el("span", { class: "device gpu", text: `gpu${d.index} · ${d.name}` }),
    gpuMetric(
      meter(`${w.name} GPU utilization`, util, util == null ? "no sample" : `${Math.round(util * 100)}%`),
      `${w.name} GPU utilization`, samples, "util"),
    gpuMetric(
      total
        ? meter(`${w.name} GPU memory`, used == null ? null : used / total,
          `${gib(used)} / ${gib(total)} GiB`)
        : muted("no sample"),
      `${w.name} GPU memory`, samples, "mem"),
  ];
}

// A small chart of one GPU metric (a fraction) over the same span as the queue chart.
const SPARK_W = 160;
const SPARK_H = 28;

function sparkline(label, samples, key) {
  const now = Date.now();
  const spanMs = chartSpan(now);
  const points = samples.filter((s) => s[key] != null && now - s.t <= spanMs);
  const x = (t) => SPARK_W * (1 - (now - t) / spanMs);
  const y = (v) => SPARK_H - 1 - (SPARK_H - 2) * Math.min(1, Math.max(0, v));
  const node = svg("svg", {
    class: `spark spark-${key}`,
    viewBox: `0 0 ${SPARK_W} ${SPARK_H}`,
    preserveAspectRatio: "none",
    role: "img",
    "data-samples": String(points.length),
  });
  const pct = (v) => `${Math.round(v * 100)}%`;
  node.append(svg("rect", { class: "spark-bg", width: SPARK_W, height: SPARK_H }));
  if (!points.length) {
    node.setAttribute("aria-label", `${label}: no samples yet`);
    return node;
  }
  const coords = points.map((s) => `${x(s.t).toFixed(1)},${y(s[key]).toFixed(1)}`);
  const first = x(points[0].t).toFixed(1);
  const last = x(points.at(-1).t).toFixed(1);
  node.append(
    svg("polygon", { class: "spark-area", points: `${first},${SPARK_H} ${coords.join(" ")} ${last},${SPARK_H}` }),
    svg("polyline", { class: "spark-line", points: coords.join(" ") }),
  );
  const values = points.map((s) => s[key]);
  const summary = `min ${pct(Math.min(...values))}, max ${pct(Math.max(...values))}, now ${pct(values.at(-1))}`;
  node.setAttribute("aria-label", `${label} over the last ${span(spanMs)}: ${summary}`);
  const title = svg("title");
  title.textContent = `last ${span(spanMs)}: ${summary}`;
  node.append(title);
  return node;
}

// The current bar and, below it, the last minutes of the same metric.
function gpuMetric(current, label, samples, key) {
  return el("div", { class: "gpu-metric" }, current, sparkline(label, samples, key));
}

function workerRow(w) {
  const [device, util, memory] = deviceCells(w);
  const task = w.current_task
    ? el("span", {},
      el("code", { text: w.current_task.slice(0, 12), title: w.current_task }),
      w.current_class ? muted(` ${w.current_class}`) : null)
    : muted("–");
  const failed = el("span", { class: w.tasks_failed ? "bad" : "", text: w.tasks_failed });
  return el("tr", {},
    el("th", { scope: "row" }, w.name, el("span", { class: "host", text: w.host || "" })),
    cell("Device", device),
    cell("State", el("span", { class: `badge state-${w.state}`, text: w.state, title: w.reason || "" })),
    cell("Current task", task),
    cell("Utilization", util),
    cell("Memory", memory),
    el("td", { class: "num", "data-label": "Done / failed" },
      el("span", {}, `${w.tasks_done} / `, failed)),
  );
}

function renderWorkers(workers) {
  const note = $("workers-note");
  if (workers == null) {
    $("worker-rows").replaceChildren();
    $("worker-count").textContent = "";
    note.hidden = false;
    note.textContent = "Workers are shown to admin keys only.";
    return;
  }
  const list = workers.workers.slice().sort((a, b) => a.name.localeCompare(b.name));
  $("worker-count").textContent = `${list.length} live`;
  $("worker-rows").replaceChildren(...list.map(workerRow));
  note.hidden = list.length > 0;
  note.textContent = "No live worker. Start one with `gpulane worker` (or `gpulane up`).";
}

// Model tokens of generations through backend workers, per tenant and model.
function renderTokens(tokens) {
  const rows = [];
  for (const [tenant, models] of Object.entries(tokens).sort()) {
    for (const [model, n] of Object.entries(models).sort()) {
      rows.push(el("tr", {},
        el("th", { scope: "row", text: tenant }),
        cell("Model", el("code", { text: model })),
        el("td", { class: "num", "data-label": "Prompt", text: n.prompt.toLocaleString() }),
        el("td", { class: "num", "data-label": "Completion", text: n.completion.toLocaleString() }),
      ));
    }
  }
  $("tokens-panel").hidden = rows.length === 0;
  $("token-rows").replaceChildren(...rows);
}

// Device seconds per tenant, class and type (what fair share splits by weight), with
// each row's share of all the device time shown.
function renderDevice(usage) {
  const all = Object.values(usage).reduce((sum, t) => sum + t.total, 0);
  const rows = [];
  for (const [tenant, entry] of Object.entries(usage).sort()) {
    for (const [cls, types] of Object.entries(entry.classes).sort()) {
      for (const [type, seconds] of Object.entries(types).sort()) {
        const share = all > 0 ? `${((100 * seconds) / all).toFixed(1)} %` : "-";
        rows.push(el("tr", {},
          el("th", { scope: "row", text: tenant }),
          cell("Class", document.createTextNode(cls)),
          cell("Type", el("code", { text: type })),
          el("td", { class: "num", "data-label": "Device seconds", text: seconds.toFixed(2) }),
          el("td", { class: "num", "data-label": "Share", text: share }),
        ));
      }
    }
  }
  $("device-panel").hidden = rows.length === 0;
  $("device-rows").replaceChildren(...rows);
}

// ---- start ----

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-input").value = "";
});
window.addEventListener("resize", () => renderChart());
poll();
