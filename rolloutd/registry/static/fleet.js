// The fleet page: polls GET /v1/fleet with the registry's bearer token and renders it.
// Data is always inserted as text (textContent), never as markup: node names, errors and
// endpoints come from the nodes. The token stays in this tab's sessionStorage.
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "rolloutd.registry.token";
const STATES = ["SERVING", "UPDATING", "SYNCING", "STARTING", "BACKOFF", "FATAL", "STOPPING", "STOPPED"];
const STATE_COLORS = {SERVING: "--serving", UPDATING: "--updating", SYNCING: "--syncing", STARTING: "--starting",
  BACKOFF: "--backoff", FATAL: "--fatal", STOPPING: "--stopped", STOPPED: "--stopped"};
const PROBLEM_WORDS = {state: "failed", gate: "gate failed", refused: "refused newest", silent: "silent"};

// What tests and benchmarks read: render times and how many polls were shown.
const stats = window.rolloutdFleet = {renders: 0, lastRenderMs: null, maxRenderMs: 0, lastOkAt: null, status: "starting"};

const view = {page: 1, perPage: 50, node: "", state: "", problems: false};
let timer = null;
let inflight = null;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "title") node.title = v;
    else if (k === "style") Object.assign(node.style, v);  // CSSOM: the page's CSP forbids style attributes
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// -- formatting --------------------------------------------------------------------------------
function age(s) {
  if (s === null || s === undefined) return "–";
  if (s < 10) return s.toFixed(1) + " s";
  if (s < 60) return Math.floor(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + String(Math.floor(s % 60)).padStart(2, "0") + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + " min";
  return Math.floor(s / 86400) + " d " + Math.floor(s % 86400 / 3600) + " h";
}
function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  return s < 100 ? s.toFixed(2) + " s" : age(s);
}
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}
const ver = (v) => (v === null || v === undefined ? "–" : "v" + v);
const pct = (a, b) => (b ? Math.round(100 * a / b) + "%" : "–");

// -- the token ---------------------------------------------------------------------------------
function takeTokenFromFragment() {
  // #token=... lets an operator open the page from a link; it is moved to sessionStorage and
  // removed from the address bar (a fragment is never sent to the server).
  const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}
const token = () => sessionStorage.getItem(TOKEN_KEY);

function showLogin(message) {
  clearFleet();
  $("login").hidden = false;
  $("signout").hidden = true;
  $("login-error").textContent = message || "";
  $("token").focus();
}

function clearFleet() {
  // Nothing the registry sent stays on the page once the token is refused or forgotten.
  $("fleet").hidden = true;
  for (const id of ["cards", "statebar", "legend", "chart", "facts", "pageinfo", "footer"]) $(id).replaceChildren();
  for (const id of ["versions", "replicas"]) $(id).tBodies[0].replaceChildren();
  setLive("bad", "signed out");
}

// -- polling -----------------------------------------------------------------------------------
function query() {
  const p = new URLSearchParams({page: view.page, per_page: view.perPage});
  if (view.node) p.set("node", view.node);
  if (view.state) p.set("state", view.state);
  if (view.problems) p.set("problems", "true");
  return "/v1/fleet?" + p;
}

async function poll() {
  clearTimeout(timer);
  if (inflight) inflight.abort();
  const ctrl = inflight = new AbortController();
  const headers = {};
  const t = token();
  if (t) headers.Authorization = "Bearer " + t;
  try {
    const r = await fetch(query(), {headers, cache: "no-store", signal: ctrl.signal});
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      stats.status = "unauthorized";
      showLogin(t ? "The registry refused this token." : "");
      return;  // no more polling until a token is given
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const doc = await r.json();
    stats.lastOkAt = Date.now();
    stats.status = "ok";
    render(doc);
    setLive("ok", "live");
  } catch (e) {
    if (e.name === "AbortError") return;
    stats.status = "error";
    setLive("bad", "registry not answering (" + e.message + ")");
  } finally {
    if (inflight === ctrl) inflight = null;
  }
  timer = setTimeout(poll, POLL_MS);
}

function setLive(kind, text) {
  $("live-dot").className = "dot " + kind;
  $("live-text").textContent = text;
}

// -- rendering ---------------------------------------------------------------------------------
function render(doc) {
  const t0 = performance.now();
  $("login").hidden = true;
  $("fleet").hidden = false;
  $("signout").hidden = !token();
  renderFacts(doc);
  renderCards(doc.summary);
  renderStates(doc.summary);
  renderVersions(doc.versions);
  renderChart(doc.rollouts);
  renderReplicas(doc.nodes, doc.stale_s);
  const ms = performance.now() - t0;
  stats.renders += 1;
  stats.lastRenderMs = ms;
  stats.maxRenderMs = Math.max(stats.maxRenderMs, ms);
  $("footer").textContent = `registry instance ${doc.instance} · ${doc.summary.replicas} replicas · ` +
    `rendered in ${ms.toFixed(1)} ms · refreshed every ${POLL_MS / 1000} s`;
}

function renderFacts(doc) {
  const fact = (label, value) => el("div", null, label, el("b", null, value));
  const latest = doc.latest;
  $("facts").replaceChildren(
    fact("newest", latest ? `${ver(latest.version)} · ${age(latest.published_age_s)} ago` : "none published"),
    fact("demand", doc.demand === null ? "none" : "≥ " + ver(doc.demand)),
    fact("nodes", doc.summary.nodes),
    fact("replicas", doc.summary.replicas));
}

function card(label, value, sub, bad) {
  return el("div", {class: "card" + (bad ? " bad" : "")}, el("div", {class: "label"}, label),
    el("div", {class: "value"}, value), el("div", {class: "sub"}, sub));
}

function renderCards(s) {
  const serving = s.by_state.SERVING || 0;
  const b = s.behind;
  $("cards").replaceChildren(
    card("Replicas", s.replicas, `on ${s.nodes} node${s.nodes === 1 ? "" : "s"}`),
    card("Serving", serving, pct(serving, s.replicas) + " of the fleet"),
    card("On the newest version", b["0"], `${b["1"]} one behind · ${b["2"]} two · ${b["3+"]} three or more` +
      (b["start model"] ? ` · ${b["start model"]} on the start model` : "")),
    card("With problems", s.with_problems, s.silent ? `${s.silent} silent` : "failed, gate or silent",
      s.with_problems > 0));
}

function renderStates(s) {
  const bar = [], legend = [];
  const names = STATES.filter((n) => s.by_state[n]).concat(Object.keys(s.by_state).filter((n) => !STATES.includes(n)));
  for (const name of names) {
    const n = s.by_state[name];
    const color = `var(${STATE_COLORS[name] || "--stopped"})`;
    bar.push(el("div", {title: `${name}: ${n}`, style: {flex: String(n), background: color}}));
    legend.push(el("span", null, el("i", {style: {background: color}}), name.toLowerCase(), el("b", null, n)));
  }
  $("statebar").replaceChildren(...bar);
  $("legend").replaceChildren(...legend);
  const select = $("f-state");
  if (select.options.length === 1) {
    for (const name of STATES) select.append(el("option", {value: name}, name.toLowerCase()));
  }
}

function renderVersions(versions) {
  const rows = versions.slice().reverse().map((v) => el("tr", {"data-version": v.version},
    el("td", {class: "mono"}, ver(v.version)),
    el("td", {class: v.state === "live" ? "" : "muted"}, v.state),
    el("td", {class: "n"}, age(v.published_age_s) + " ago"),
    el("td", {class: "n"}, bytes(v.total_bytes)),
    el("td", {class: "n"}, v.files),
    el("td", {class: "n"}, v.leases),
    el("td", {class: "n"}, v.serving),
    el("td", {class: "n"}, v.held_by)));
  if (!rows.length) rows.push(el("tr", null, el("td", {colspan: 8, class: "muted"}, "Nothing published yet.")));
  $("versions").tBodies[0].replaceChildren(...rows);
}

function renderChart(rollouts) {
  const data = rollouts.filter((r) => r.reached > 0);
  const box = $("chart");
  if (!data.length) {
    box.replaceChildren(el("p", {class: "empty"}, "No version has reached a replica that was there when it was published."));
    return;
  }
  const NS = "http://www.w3.org/2000/svg";
  const svg = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  const W = 600, H = 210, L = 52, R = 10, T = 10, B = 34;
  const top = niceMax(Math.max(...data.map((r) => r.max_s)));
  const y = (s) => T + (H - T - B) * (1 - s / top);
  const step = (W - L - R) / data.length;
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
    "aria-label": "seconds from publish to serving, per version"});
  for (let i = 0; i <= 4; i++) {
    const s = top * i / 4, yy = y(s);
    root.append(svg("line", {class: i ? "gridline" : "axis", x1: L, x2: W - R, y1: yy, y2: yy}));
    root.append(svg("text", {x: L - 6, y: yy + 4, "text-anchor": "end"}, secs(s)));
  }
  data.forEach((r, i) => {
    const cx = L + step * (i + 0.5), w = Math.min(22, step * 0.6);
    const g = svg("g", {"data-version": r.version});
    g.append(svg("title", {}, `${ver(r.version)}: ${r.reached} replicas; min ${secs(r.min_s)}, ` +
      `p50 ${secs(r.p50_s)}, p90 ${secs(r.p90_s)}, max ${secs(r.max_s)}`));
    g.append(svg("line", {class: "range", x1: cx, x2: cx, y1: y(r.min_s), y2: y(r.max_s)}));
    g.append(svg("rect", {class: "box", x: cx - w / 2, width: w, y: y(r.p90_s),
      height: Math.max(1.5, y(r.p50_s) - y(r.p90_s))}));
    g.append(svg("circle", {class: "median", cx, cy: y(r.p50_s), r: 3}));
    if (data.length <= 16 || i % Math.ceil(data.length / 16) === 0) {
      g.append(svg("text", {x: cx, y: H - B + 16, "text-anchor": "middle"}, ver(r.version)));
    }
    root.append(g);
  });
  box.replaceChildren(root);
}

function niceMax(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

function renderReplicas(nodes, staleS) {
  const rows = [];
  for (const n of nodes.items) {
    const states = Object.entries(n.states).map(([s, c]) => `${c} ${s.toLowerCase()}`).join(", ");
    rows.push(el("tr", {class: "node", "data-node": n.node},
      el("td", {colspan: 13}, n.node, el("span", {class: "nodefacts"},
        `${n.replicas.length} replica${n.replicas.length === 1 ? "" : "s"} · ${states}` +
        (n.with_problems ? ` · ${n.with_problems} with problems` : "") +
        ` · oldest heartbeat ${age(n.max_age_s)} ago`))));
    for (const r of n.replicas) rows.push(replicaRow(r, staleS));
  }
  $("replicas").tBodies[0].replaceChildren(...rows);
  $("no-replicas").hidden = rows.length > 0;
  view.page = Math.min(view.page, nodes.pages);
  $("pageinfo").textContent = `nodes ${nodes.total ? (nodes.page - 1) * nodes.per_page + 1 : 0}–` +
    `${Math.min(nodes.total, nodes.page * nodes.per_page)} of ${nodes.total} · page ${nodes.page} of ${nodes.pages}`;
  $("prev").disabled = nodes.page <= 1;
  $("next").disabled = nodes.page >= nodes.pages;
}

function replicaRow(r, staleS) {
  const gate = r.gate === null ? el("span", {class: "muted"}, "–")
    : r.gate.ok ? el("span", {title: gateTitle(r.gate)}, r.gate.canary ? "passed" : "probe ok")
    : el("span", {class: "bad", title: gateTitle(r.gate)}, "failed");
  const behind = r.version === null ? el("span", {class: "muted"}, "start model")
    : r.lag === null ? el("span", {class: "muted"}, "?")
    : r.lag === 0 ? el("span", {class: "muted"}, "0")
    : el("span", {class: r.lag >= 2 ? "bad" : "warn"}, `${r.lag} · ${age(r.lag_s)}`);
  const beat = el("span", {class: r.age_s > staleS ? "bad" : ""}, age(r.age_s) + " ago");
  return el("tr", {class: r.problems.length ? "problem" : "", "data-replica": r.replica_id, "data-state": r.state},
    el("td", {class: "mono", title: r.endpoint || ""}, r.server),
    el("td", null, el("span", {class: "pill st-" + r.state, title: `for ${age(r.state_age_s)}`}, r.state),
      ...r.problems.filter((p) => p !== "state").map((p) => el("span", {class: "tag",
        title: p === "refused" ? refusedTitle(r.refused || []) : ""}, PROBLEM_WORDS[p] || p))),
    el("td", {class: "mono"}, r.version === null ? "start model" : ver(r.version)),
    el("td", {class: "n"}, behind),
    el("td", {class: "mono"}, r.target === r.version ? el("span", {class: "muted"}, ver(r.target)) : ver(r.target)),
    el("td", {class: "n", title: timingsTitle(r.timings)}, secs(r.paused_s)),
    el("td", {class: "n"}, secs(r.pull_s)),
    el("td", {class: "n", title: pullTitle(r.pull)}, fetched(r.pull)),
    el("td", {class: "n"}, secs(r.pull ? r.pull.reconstruct_s : null)),
    el("td", null, gate),
    el("td", {class: "n"}, beat),
    el("td", {class: "n"}, r.incarnation),
    el("td", {class: "err", title: r.error || ""}, r.error || ""));
}

// The node's last pull in a narrow cell: how it came and the share of the version's size it
// fetched ("delta 2.1% on v6"; "full"; "full 40%" when an earlier try had fetched the rest).
// A registry from before these fields sends no `pull`.
function fetched(p) {
  if (!p) return el("span", {class: "muted"}, "–");
  if (p.bytes_fetched === 0) return el("span", {class: "muted"}, "held");
  const share = p.fetched_ratio === null || p.fetched_ratio === undefined ? "?" : percent(p.fetched_ratio);
  if (p.kind === "delta") return `delta ${share}` + (p.base === null ? "" : ` on ${ver(p.base)}`);
  const whole = p.fetched_ratio === null || p.fetched_ratio >= 1 ? "full" : `full ${share}`;
  return p.delta_error ? el("span", {class: "warn"}, whole + " (delta failed)") : whole;
}
function percent(ratio) {  // as rolloutd fleet writes it (units.percent)
  const p = 100 * ratio;
  if (p > 0 && p < 0.005) return "<0.01%";
  return (p >= 10 || p === 0 ? p.toFixed(0) : p >= 0.1 ? p.toFixed(1) : p.toFixed(2)) + "%";
}
const pullTitle = (p) => !p ? "" : `${ver(p.version)} ${p.kind === "delta" ? "as a delta on " + ver(p.base) : "whole"}: ` +
  `${bytes(p.bytes_fetched)} fetched of ${bytes(p.version_bytes)} in ${secs(p.seconds)}` +
  (p.reconstruct_s === null ? "" : `; rebuilt from the base in ${secs(p.reconstruct_s)}`) +
  (p.delta_error ? `\nthe delta failed: ${p.delta_error}` : "");

// The versions the replica's node refused, one line each with why (the tag's tooltip).
const refusedTitle = (list) => list.map((x) => `version ${x.version} refused: ${x.reason}`).join("\n");
const gateTitle = (g) => `canary ${g.canary ? "scored" : "absent"}; ${g.tokens} tokens; ` +
  `max |Δlogprob| ${g.max_abs_dlogprob ?? "–"} (tolerance ${g.tolerance ?? "–"})`;
const timingsTitle = (t) => Object.entries(t).map(([k, v]) => `${k} ${secs(v)}`).join(", ");

// -- controls ----------------------------------------------------------------------------------
function wire() {
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    sessionStorage.setItem(TOKEN_KEY, t);
    $("token").value = "";
    $("login-error").textContent = "";
    poll();
  });
  $("signout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    clearTimeout(timer);
    if (inflight) inflight.abort();  // an answer still on its way must not bring the data back
    showLogin("");
  });
  let typing = null;
  $("f-node").addEventListener("input", (e) => {
    clearTimeout(typing);
    typing = setTimeout(() => { view.node = e.target.value.trim(); view.page = 1; poll(); }, 250);
  });
  $("f-state").addEventListener("change", (e) => { view.state = e.target.value; view.page = 1; poll(); });
  $("f-problems").addEventListener("change", (e) => { view.problems = e.target.checked; view.page = 1; poll(); });
  $("prev").addEventListener("click", () => { view.page = Math.max(1, view.page - 1); poll(); });
  $("next").addEventListener("click", () => { view.page += 1; poll(); });
}

takeTokenFromFragment();
wire();
poll();
