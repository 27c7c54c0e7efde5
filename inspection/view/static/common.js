// Shared by the pages of gagpo view: requests, escaping, the diverging colour scale,
// small tables and uPlot line charts. No framework; no request leaves this server.
"use strict";

const G = {};

G.params = () => new URLSearchParams(location.search);

// GET (or POST JSON) on this server; an error answer is one line of text, thrown.
G.get = async (path, params, body) => {
  const url = params ? `${path}?${new URLSearchParams(params)}` : path;
  const init = body === undefined ? {} : {
    method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(body),
  };
  const response = await fetch(url, init);
  if (!response.ok) throw new Error((await response.text()).trim() || response.statusText);
  return response.json();
};

G.esc = (text) => String(text ?? "").replace(/[&<>"']/g,
  (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);

G.num = (x, digits = 4) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
G.pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`);

G.groupLink = (store, group, text) =>
  `<a class="group-link" href="/group?${new URLSearchParams({store, group})}">${G.esc(text ?? group)}</a>`;

// One diverging scale for every advantage on a page: blue below 0, red above, white at 0,
// saturated at ±max (RdBu, colour-blind safe).
G.diverging = (value, max) => {
  if (value === null || value === undefined || !isFinite(value)) return "#eee";
  const t = max > 0 ? Math.max(-1, Math.min(1, value / max)) : 0;
  const [r0, g0, b0] = t < 0 ? [33, 102, 172] : [178, 24, 43];
  const a = Math.abs(t);
  const mix = (c) => Math.round(255 + (c - 255) * a);
  return `rgb(${mix(r0)},${mix(g0)},${mix(b0)})`;
};

G.legend = (el, max, label) => {
  const stops = [-1, -0.5, 0, 0.5, 1].map((t) => G.diverging(t * max, max)).join(",");
  el.innerHTML = `<span>${G.num(-max, 3)}</span><span class="bar" style="background:linear-gradient(90deg,${stops})"></span><span>${G.num(max, 3)}</span> <span class="muted">${G.esc(label)}</span>`;
};

// A table from rows of objects; `cell(column, value, row)` may return HTML.
G.table = (rows, columns, cell) => {
  if (!rows.length) return `<p class="muted">no rows</p>`;
  const head = columns.map((c) => `<th>${G.esc(c)}</th>`).join("");
  const body = rows.map((row) => "<tr>" + columns.map((c) => {
    const html = cell ? cell(c, row[c], row) : undefined;
    return `<td>${html ?? G.esc(typeof row[c] === "number" && !Number.isInteger(row[c]) ? G.num(row[c]) : row[c])}</td>`;
  }).join("") + "</tr>").join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
};

G.colours = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"];

// A line chart of several series on one x axis: [{label, xs, ys, colour, dash, band: [lo, hi]}].
// Series with different xs are aligned (uPlot.join), gaps spanned.
G.chart = (el, title, series, xLabel) => {
  el.innerHTML = "";
  const usable = series.filter((s) => s.xs.length);
  if (!usable.length) {
    el.innerHTML = `<div class="chart-empty"><b>${G.esc(title)}</b><p class="muted">no data yet</p></div>`;
    return null;
  }
  const tables = [];
  const specs = [{}];
  const bands = [];
  for (const s of usable) {
    const cols = [s.xs, s.ys];
    if (s.band) cols.push(s.band[0], s.band[1]);
    tables.push(cols);
    const idx = specs.length;
    specs.push({label: s.label, stroke: s.colour, width: 2, dash: s.dash, spanGaps: true,
                points: {show: s.xs.length < 60}});
    if (s.band) {
      specs.push({label: `${s.label} low`, stroke: "transparent", spanGaps: true, points: {show: false}});
      specs.push({label: `${s.label} high`, stroke: "transparent", spanGaps: true, points: {show: false}});
      bands.push({series: [idx + 2, idx + 1], fill: s.colour + "33"});
    }
  }
  const data = uPlot.join(tables);
  const width = Math.max(320, Math.min(560, el.clientWidth || 480));
  const opts = {
    title, width, height: 220, series: specs, bands,
    scales: {x: {time: false}},
    axes: [{label: xLabel}, {}],
    legend: {live: true},
  };
  return new uPlot(opts, data, el);
};

// The navigation bar: the current page marked, the store carried along.
G.nav = (current) => {
  const store = G.params().get("store");
  const q = store ? `?${new URLSearchParams({store})}` : "";
  const pages = [["/", "Run"], ["/group", "Group"], ["/compare", "Compare"], ["/pools", "Pools"], ["/sql", "SQL"]];
  document.getElementById("nav").innerHTML = `<b>gagpo view</b> ` + pages.map(([href, name]) =>
    `<a href="${href}${q}" class="${name === current ? "current" : ""}">${name}</a>`).join(" ");
};

G.error = (err) => {
  const el = document.getElementById("error");
  el.textContent = err ? String(err.message || err) : "";
  el.hidden = !err;
};

G.storeSelect = async (select, onChange) => {
  const stores = await G.get("/api/stores");
  const current = G.params().get("store") || stores[0].label;
  select.innerHTML = stores.map((s) =>
    `<option value="${G.esc(s.label)}" ${s.label === current ? "selected" : ""}>${G.esc(s.label)}</option>`).join("");
  select.onchange = () => onChange(select.value);
  return {stores, current};
};
