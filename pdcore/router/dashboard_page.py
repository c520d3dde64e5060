"""The HTML of the live cluster page (pdcore.router.dashboard serves it).

Kept in a Python module so it ships in the wheel without package-data settings. The page polls
`/dashboard/data` every __REFRESH_MS__ ms (filled in when served) and redraws one table per
role. Each worker row carries `data-url` and `data-status` (up, down, starting, circuit_open),
and `<body data-refreshes=N>` counts completed refreshes, so a script (or a test) can tell
what the page shows and when it last changed.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pdserve cluster</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 .3em; }
 h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
 #summary { color: #555; }
 #banner { display: none; background: #fdd; border: 1px solid #c00; padding: .4em .8em; }
 table { border-collapse: collapse; width: 100%; background: #fff; }
 th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: left; white-space: nowrap; }
 th { background: #eee; font-weight: 600; }
 td.num { text-align: right; font-variant-numeric: tabular-nums; }
 .status { font-weight: 600; padding: .1em .5em; border-radius: .3em; }
 .up { background: #cfc; } .down { background: #fbb; } .starting { background: #ffc; }
 .circuit_open { background: #fc9; }
 .bar { display: inline-block; width: 6em; height: .8em; background: #eee;
        vertical-align: middle; margin-right: .4em; }
 .bar > span { display: block; height: 100%; background: #48c; }
 .err { color: #a00; font-size: .85em; white-space: normal; }
</style>
</head>
<body data-refreshes="0">
<h1>pdserve cluster</h1>
<div id="summary">loading...</div>
<div id="banner"></div>
<div id="roles"></div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const ROLES = ["prefill", "decode"];
let refreshes = 0;

function esc(s) {
  return String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;"}[c]));
}
function fmt(x, digits) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }
function speed(g) {  // GB/s in, MB/s below 1 GB/s
  return g >= 1 ? g.toFixed(2) + " GB/s" : (g * 1000).toFixed(2) + " MB/s";
}
function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function row(w) {
  const l = w.load, t = w.transfer;
  const pct = l ? (l.pool_usage * 100).toFixed(1) : null;
  const pool = l ? `<span class="bar"><span style="width:${pct}%"></span></span>` +
    `${pct}% (${l.pages_used}/${l.pages_total})` : "-";
  const queues = l && Object.keys(l.queues).length
    ? Object.entries(l.queues).map(([k, v]) => `${esc(k)} ${v}`).join(", ") : "-";
  const rate = t ? (t.recent_speed_gb_s !== null ? speed(t.recent_speed_gb_s)
    : (t.last_speed_gb_s !== null && t.last_speed_gb_s !== undefined
       ? "last " + speed(t.last_speed_gb_s) : "-")) : "-";
  const xfer = t ? `${t.transfers} (${bytes(t.bytes)}), ${t.failures} failed` : "-";
  const why = w.error || (!w.healthy && w.health_error) || "";
  return `<tr data-url="${esc(w.url)}" data-status="${esc(w.status)}">` +
    `<td>${esc(w.url)}</td>` +
    `<td><span class="status ${esc(w.status)}">${esc(w.status)}</span>` +
    (why ? `<div class="err">${esc(why)}</div>` : "") + `</td>` +
    `<td class="num">${l ? l.running : "-"}</td><td class="num">${l ? l.waiting : "-"}</td>` +
    `<td>${queues}</td><td>${pool}</td>` +
    `<td class="num">${l ? Math.round(l.cache_hit_rate * 100) + "%" : "-"}</td>` +
    `<td class="num">${w.router_in_flight}</td>` +
    `<td class="num">${rate}</td>` +
    `<td class="num">${t && t.last_latency_ms !== null && t.last_latency_ms !== undefined
      ? fmt(t.last_latency_ms, 1) + " ms" : "-"}</td>` +
    `<td>${xfer}</td><td>${esc(w.circuit)}</td></tr>`;
}

function render(data) {
  const r = data.router;
  const up = data.workers.filter(w => w.status === "up").length;
  document.getElementById("summary").textContent =
    `router ${r.version}, ${r.ready ? "ready" : "NOT ready"}; ` +
    `${up}/${data.workers.length} workers up; policies prefill=${r.prefill_policy} ` +
    `decode=${r.decode_policy}; updated ${new Date().toLocaleTimeString()}` +
    ` (every ${REFRESH_MS / 1000} s)`;
  document.getElementById("roles").innerHTML = ROLES.map(role => {
    const ws = data.workers.filter(w => w.role === role);
    return `<h2>${role} (${ws.length})</h2><table id="${role}"><thead><tr>` +
      "<th>worker</th><th>status</th><th>running</th><th>waiting</th><th>PD queues</th>" +
      "<th>KV pool</th><th>cache hits</th><th>router in flight</th>" +
      "<th>recent transfer speed</th>" +
      "<th>last transfer</th><th>transfers</th><th>circuit</th></tr></thead><tbody>" +
      (ws.length ? ws.map(row).join("") : '<tr><td colspan="12">none registered</td></tr>') +
      "</tbody></table>";
  }).join("");
}

async function refresh() {
  const banner = document.getElementById("banner");
  const headers = {};
  const key = sessionStorage.getItem("pdserve-api-key");
  if (key) headers["Authorization"] = "Bearer " + key;
  try {
    const resp = await fetch("dashboard/data", {headers, cache: "no-store"});
    if (resp.status === 401) {
      const k = window.prompt("This router wants its --api-key:");
      if (k) sessionStorage.setItem("pdserve-api-key", k);
      throw new Error("the router wants an API key (401)");
    }
    if (!resp.ok) throw new Error("/dashboard/data answered " + resp.status);
    render(await resp.json());
    banner.style.display = "none";
  } catch (e) {
    banner.textContent = "cannot refresh: " + e.message;
    banner.style.display = "block";
  } finally {
    refreshes++;
    document.body.dataset.refreshes = String(refreshes);
    setTimeout(refresh, REFRESH_MS);
  }
}
refresh();
</script>
</body>
</html>
"""
