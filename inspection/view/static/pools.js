// The pools page: pools and singletons per state grouping; the largest pools; merged states.
"use strict";

const $ = (id) => document.getElementById(id);

async function main() {
  G.nav("Pools");
  const {current: store} = await G.storeSelect($("store-select"), (s) => { location.search = `?store=${encodeURIComponent(s)}`; });
  const v = await G.get("/api/pools", {store});
  const pre = (text) => `<pre style="font-size:10px;line-height:1.05;margin:0">${G.esc(text)}</pre>`;
  $("modes").innerHTML = G.table(v.modes.map((m) => ({...m, estimator: m.estimator ?? "(no stored advantages: exact pools)"})),
    ["estimator", "state_grouping", "pools", "steps", "singleton_share"],
    (c, x) => (c === "singleton_share" ? G.pct(x) : undefined));
  $("largest").innerHTML = G.table(v.largest, ["estimator", "group_id", "pool_id", "visits", "states", "value_proxy"],
    (c, x) => (c === "group_id" ? G.groupLink(store, x) : c === "pool_id" ? pre(x) : undefined));
  $("merged").innerHTML = v.merged.length ? G.table(v.merged, ["estimator", "state_grouping", "group_id", "visits", "states"],
    (c, x) => (c === "group_id" ? G.groupLink(store, x) : c === "states" ? x.map(pre).join("<hr>") : undefined))
    : `<p class="muted">No pool merges distinct states: every stored tag groups exact states. Recompute under another grouping with <code>gagpo advantages --store S --state-grouping minhash:0.8</code>.</p>`;
}

main().catch(G.error);
