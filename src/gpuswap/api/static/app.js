// gpuswap dashboard: polls the daemon's JSON API once a second; no build step, no third-party code.
// The token comes from the URL fragment (#token=...) that `gpuswap token create` prints, is kept in
// sessionStorage (this tab only) and sent as `Authorization: Bearer`. Every decision (who may act,
// why a job waits) is made by the API; this page only shows it.
"use strict";

const KEY = "gpuswap.token";
const POLL_MS = 1000;
const FADE_MS = 5000;   // how long an action's outcome stays on screen
const $ = (sel) => document.querySelector(sel);
let lastOk = 0;
let timer = null;
let flashKind = "";
let flashTimer = null;

// Every value from the API (job names, commands, users, reasons, log text) is user-controlled, so
// the page never parses it as HTML: elements are built with h(), whose string children become
// text nodes, and no innerHTML/insertAdjacentHTML is used anywhere. Together with the daemon's
// Content-Security-Policy (scripts only from this origin, no inline script or style), a job
// named `<img src=x onerror=...>` is shown as those characters and runs nothing.
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "width") el.style.width = `${Number(v) || 0}%`;   // CSSOM: allowed by the CSP
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c != null && c !== false) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function bar(pct, title) {
  return h("div", { class: "bar", title }, h("span", { width: pct }));
}

function stateSpan(state, extra = "", tag = "span", attrs = {}) {
  return h(tag, { ...attrs, class: `state s-${String(state).replace(/[^A-Z]/g, "")}` }, state, extra);
}

function size(n) {
  if (!n) return "0 B";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 10 || i === 0 ? 0 : 1)} ${u[i]}`;
}

// "45s", "3m 05s", "2h 10m", "7 days", "1 day 3h": the two largest units, a zero second one dropped.
function dur(s) {
  if (s == null) return "-";
  s = Math.floor(s);
  const two = (big, unit, small, sunit) =>
    (small ? `${big}${unit} ${String(small).padStart(2, "0")}${sunit}` : `${big}${unit}`);
  if (s < 60) return `${s}s`;
  if (s < 3600) return two(Math.floor(s / 60), "m", s % 60, "s");
  if (s < 86400) return two(Math.floor(s / 3600), "h", Math.floor(s % 3600 / 60), "m");
  const d = Math.floor(s / 86400), hours = Math.floor(s % 86400 / 3600);
  return `${d} day${d === 1 ? "" : "s"}${hours ? ` ${hours}h` : ""}`;
}

function token() { return sessionStorage.getItem(KEY); }

// A message's kind says when it goes away, so the banner never outlives what it reports:
// "poll" (a failed poll) at the next successful poll; "ok" and "action" (an action's outcome)
// after FADE_MS; "" (sign-in prompts) only when replaced.
function flash(msg, kind = "") {
  const f = $("#flash");
  clearTimeout(flashTimer);
  f.textContent = msg;
  f.className = kind === "ok" ? "ok" : "";
  f.hidden = !msg;
  flashKind = msg ? kind : "";
  if (msg && (kind === "ok" || kind === "action")) flashTimer = setTimeout(() => flash(""), FADE_MS);
}

async function api(method, path, body) {
  const r = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${token()}`, ...(body ? { "Content-Type": "application/json" } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  if (r.status === 401) { showLogin("the token was refused; create a new one with `gpuswap token create`"); throw new Error("unauthenticated"); }
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
    const e = new Error(detail);
    e.status = r.status;
    throw e;
  }
  const type = r.headers.get("content-type") || "";
  return type.includes("json") ? r.json() : r.text();
}

// -- state text, the same words as the CLI ------------------------------------------------
function where(j) {
  if (j.state === "PAUSED") {
    if (j.tier === "ram") return "parked in RAM";
    if (j.tier === "disk") return "parked on disk";
    return j.stopped ? "GPU (SIGSTOP)" : "-";
  }
  if (["RUNNING", "PAUSING", "RESUMING"].includes(j.state)) return "GPU";
  return "-";
}

// A parked job always shows its tier's size; a driver-frozen job whose footprint could not be
// measured (NVML gave no figure for its process) has none to show, which "size unknown" says instead of "-".
function parkedSize(j) {
  if (!j.tier) return "-";
  return (j.parked_bytes ? size(j.parked_bytes) : "size unknown") + residueText(j);
}

// What a job parked in RAM by its runtime still holds on its GPUs (its CUDA context and what it
// did not attach): "; 512 MiB stays on GPU 0", or "".
function residueText(j) {
  return (j.residue || []).map((r) => `; ${size(r.bytes)} stays on GPU ${gpuName(j.node, r.gpu)}`).join("");
}

// What an event records, from its fields (never its sentence): " · parked_ram, ram, cooperative, by user".
function eventFacts(e) {
  const facts = [e.kind, e.tier, e.mechanism, e.initiator && `by ${e.initiator}`].filter(Boolean);
  return facts.length ? h("span", { class: "muted event-facts" }, ` · ${facts.join(", ")}`) : null;
}

function actionButtons(j) {
  if (!j.mine || j.ended) return [];
  const button = (action, label) => h("button", { "data-action": action, "data-id": j.id }, label);
  const b = [];
  if (j.state === "RUNNING" && !j.held) b.push(button("pause", "Pause"));
  if (j.held) b.push(button("resume", "Resume"));
  b.push(button("cancel", "Cancel"));
  return b;
}

async function act(action, id) {
  try {
    const j = await api("POST", `/v1/jobs/${id}/${action}`, action === "pause" ? { to: "ram" } : {});
    flash(j.nothing_done ? `job ${id}: ${j.nothing_done}` : `job ${id}: ${action} requested — now ${j.state}`, "ok");
  } catch (e) {
    if (e.message !== "unauthenticated") flash(`cannot ${action} job ${id}: ${e.message}`, "action");
  }
  tick();
}

document.addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-action]");
  if (b) { ev.preventDefault(); act(b.dataset.action, b.dataset.id); }
});

// -- overview ------------------------------------------------------------------------------
// A GPU as `gpuswap gpus` names it: its index on one machine, "node:index" in a pool (docs/ray.md).
function gpuName(node, index) { return node ? `${node}:${index}` : String(index); }

function renderOverview(o) {
  $("#node").textContent = `${o.description} · policy ${o.policy}`;
  $("#sim").hidden = !o.simulated;
  $("#who").replaceChildren(o.caller.user, ...(o.caller.admin ? [" ", h("span", { class: "badge admin" }, "admin")] : []));
  const byId = Object.fromEntries(o.jobs.map((j) => [j.id, j]));
  $("#gpus").replaceChildren(...o.gpus.map((g) => {
    const pct = g.mem_total ? Math.min(100, 100 * g.mem_used / g.mem_total) : 0;
    const holders = g.jobs.map((id) => {
      const j = byId[id];
      return j ? h("div", { "data-gpu-job": id }, `job ${id} `, j.user, " ", stateSpan(j.state)) : `job ${id}`;
    }).concat((g.residue || []).map((r) => h("div", { "data-gpu-residue": r.job, class: "muted" },
      `job ${r.job} parked in RAM keeps ${size(r.bytes)}`)));
    return h("div", { class: "gpu", "data-gpu": gpuName(g.node, g.index) },
      h("h3", {}, `GPU ${gpuName(g.node, g.index)} · `, g.name, g.simulated ? [" ", h("span", { class: "badge sim" }, "simulated")] : []),
      bar(pct, `${pct.toFixed(0)}%`),
      h("div", { class: "muted" }, `${size(g.mem_used)} / ${size(g.mem_total)}`),
      holders.length ? holders : h("div", { class: "muted" }, "free"));
  }));
  const rp = o.ram.budget ? Math.min(100, 100 * o.ram.parked / o.ram.budget) : 0;
  $("#ram").replaceChildren(h("strong", {}, "Host RAM for parked jobs"), bar(rp),
    h("div", { class: "muted", id: "ram-text" },
      `${size(o.ram.parked)} parked of a ${size(o.ram.budget)} budget · ${size(o.parked_bytes.disk)} parked on disk`));
  const rows = o.jobs.map((j) => {
    const reason = j.pending_reason
      ? [h("span", { class: "code", title: j.pending_reason_text }, j.pending_reason), " ",
         h("span", { class: "muted" }, j.pending_reason_text)]
      : h("span", { class: "muted" }, j.reason);
    const name = j.mine ? h("a", { href: `#/job/${Number(j.id)}` }, j.name) : h("span", { class: "muted" }, "(other user)");
    const fin = j.ended;
    return h("tr", { "data-job-id": j.id, class: fin ? "finished" : "" },
      h("td", {}, j.id), h("td", {}, name), h("td", { class: "owner" }, j.user), h("td", {}, j.priority),
      stateSpan(j.state, j.held ? " (held)" : "", "td"), h("td", { class: "where" }, where(j)),
      h("td", { class: "parked" }, parkedSize(j)),
      h("td", { class: "gpus" }, j.gpus, j.assigned_gpus.length
        ? ` [${j.assigned_gpus.map((i) => gpuName(j.node, i)).join(",")}]` : ""),
      h("td", {}, dur(j.time_in_state_s)), h("td", { class: "left" }, leftText(j)), h("td", { class: "reason" }, reason),
      h("td", { class: "actions" }, actionButtons(j)));
  });
  $("#jobs tbody").replaceChildren(...(rows.length ? rows
    : [h("tr", {}, h("td", { colspan: 12, class: "muted" }, "no jobs"))]));
  $("#fair-hint").textContent = `GPU-seconds of service, decayed with a half-life of ${dur(o.fair_share_half_life_s)}; lower usage is served first among equals.`;
  const fair = o.fair_share.map((u) => h("tr", { "data-user": u.user }, h("td", {}, u.user),
    h("td", {}, `${u.usage_gpu_s.toFixed(1)} GPU·s`),
    h("td", {}, bar(100 * u.share), `${(100 * u.share).toFixed(1)}%`), h("td", {}, u.gpus_now)));
  $("#fair tbody").replaceChildren(...(fair.length ? fair
    : [h("tr", {}, h("td", { colspan: 4, class: "muted" }, "no usage yet"))]));
}

// The run time a live job's estimate says it still needs, as `gpuswap ls`' LEFT says it
// (cli/render.py, left_text): "1h 59m", "outlived", or "-" (no estimate, ended, another user's).
function leftText(j) {
  if (j.estimate_s == null || j.ended) return "-";
  return j.estimate_outlived ? "outlived" : dur(j.estimate_left_s);
}

// -- one job -------------------------------------------------------------------------------
const SIMULATED_GPUS = "(SIMULATED GPUs — no real GPU is in use)";   // as `gpuswap show` says it (cli/render.py)

// The runtime estimate as `gpuswap show` says it (cli/render.py, estimate_text).
function estimateText(j) {
  const text = j.estimate || "none";
  if (j.estimate_s == null || j.ended) return text;
  if (j.estimate_outlived) return `${text}; outlived (ranked by attained service)`;
  return j.estimate_left_s != null ? `${text}; ${dur(j.estimate_left_s)} left` : text;
}

async function renderJob(id) {
  let j;
  try {
    j = await api("GET", `/v1/jobs/${id}`);
  } catch (e) {
    if (e.message !== "unauthenticated") {
      $("#job-title").textContent = `Job ${id}`;
      $("#job-actions").replaceChildren();
      $("#job-body").hidden = true;
      $("#overview").hidden = true;
      $("#jobpage").hidden = false;
      e.text = `cannot show job ${id}: ${e.message}`;
    }
    throw e;   // a failed poll: tick() shows it until one succeeds
  }
  $("#job-body").hidden = false;
  // A job page opened on its own never draws the overview: it says itself that the GPUs are
  // simulated, in the header and on the GPUs line, as `gpuswap show` does.
  $("#sim").hidden = !j.gpus_simulated;
  const log = await api("GET", `/v1/jobs/${id}/log/tail?size=8192`).catch(() => "");
  $("#job-title").replaceChildren(`Job ${j.id} · `, j.name, " ", stateSpan(j.state));
  $("#job-actions").replaceChildren(...actionButtons({ ...j, mine: true, tier: j.parked }));
  const facts = [["owner", j.user], ...(j.pending_reason ? [["waiting", `${j.pending_reason}: ${j.pending_reason_text}`]] : []),
    ["priority", j.priority + (j.preemptible ? "" : ", no-preempt")],
    ["where", where({ ...j, tier: j.parked })],
    ["parked", (j.parked ? `${j.parked} (${size(j.parked_bytes)})` : "-") + residueText(j)],
    ["GPUs", `${j.gpus} requested; assigned ${j.assigned_gpus.join(",") || "-"}${j.node ? ` on node ${j.node}` : ""}`
      + (j.gpus_simulated ? ` ${SIMULATED_GPUS}` : "")],
    ["step", j.step ?? "-"],
    ["in state", dur(j.time_in_state_s)], ["preemptions", j.preemptions],
    ["service", `${dur(j.run_s)} running, ${dur(j.switch_s)} switching`], ["estimate", estimateText(j)],
    ["command", j.argv.join(" ")]];
  $("#job-facts").replaceChildren(...facts.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  $("#job-events").replaceChildren(...(j.events || []).map((e) =>
    h("li", { "data-kind": e.kind }, h("span", { class: "muted" }, new Date(e.time * 1000).toLocaleTimeString()), " ",
      stateSpan(e.state), " ", e.reason, eventFacts(e))));
  const pre = $("#job-log");
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = log || "(no output yet)";
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

// -- routing and polling -------------------------------------------------------------------
// The fragment is "#/PATH" optionally followed by "&token=..." or "?token=..." (the link printed by
// `gpuswap dashboard-url` is "#token=...", and a job link may carry one too): split it once here.
function parseHash(hash) {
  const body = hash.replace(/^#/, "");
  const cut = body.search(/[&?]|(^|\/)token=/);
  const path = cut < 0 ? body : body.slice(0, cut).replace(/\/$/, "");
  const m = body.match(/(?:^|[&?\/])token=([^&?]*)/);
  let token = null;
  if (m) { try { token = decodeURIComponent(m[1]); } catch (_) { token = m[1]; } }   // a stray "%" is no crash
  return { path: path.startsWith("/") ? path : `/${path}`, token };
}

function route() {
  const m = parseHash(location.hash).path.match(/^\/job\/(\d+)\/?$/);
  return m ? { page: "job", id: m[1] } : { page: "overview" };
}

async function tick() {
  if (!token()) return;
  const r = route();
  try {
    if (r.page === "job") await renderJob(r.id);
    else renderOverview(await api("GET", "/v1/overview"));
    $("#overview").hidden = r.page !== "overview";
    $("#jobpage").hidden = r.page !== "job";
    lastOk = Date.now();
    if (flashKind === "poll") flash("");
  } catch (e) {
    if (e.message !== "unauthenticated") flash(e.text || `lost the daemon: ${e.message}`, "poll");
  }
  const live = $("#live");
  const age = (Date.now() - lastOk) / 1000;
  live.textContent = lastOk ? `updated ${new Date(lastOk).toLocaleTimeString()}` : "connecting…";
  live.className = age > 5 ? "live stale" : "live";
}

function showLogin(msg) {
  sessionStorage.removeItem(KEY);
  $("#login").hidden = false;
  $("#overview").hidden = $("#jobpage").hidden = true;
  $("#logout").hidden = true;
  if (msg) flash(msg);
}

function start() {
  const { path, token: t } = parseHash(location.hash);
  if (t) {
    sessionStorage.setItem(KEY, t);
    history.replaceState(null, "", `${location.pathname}#${path}`);   // the secret out of history; the page kept
  }
  if (!token()) { showLogin(); return; }
  $("#login").hidden = true;
  $("#logout").hidden = false;
  tick();
  clearInterval(timer);
  timer = setInterval(tick, POLL_MS);
}

$("#login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const t = $("#token-input").value.trim();
  if (t) { sessionStorage.setItem(KEY, t); flash(""); start(); }
});
$("#logout").addEventListener("click", () => { clearInterval(timer); showLogin(); });
window.addEventListener("hashchange", () => { flash(""); tick(); });
start();
