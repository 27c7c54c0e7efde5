// The run page: every store served, on shared axes, one colour per store.
"use strict";

const col = (rows, name) => rows.map((r) => r[name]);

async function main() {
  G.nav("Run");
  const stores = await G.get("/api/stores");
  document.getElementById("stores").textContent =
    stores.map((s) => `${s.label}: ${s.url}`).join(" · ");
  const runs = await Promise.all(stores.map((s) => G.get("/api/run", {store: s.label})));
  const per = (fn) => runs.flatMap((run, i) => fn(run, G.colours[i % G.colours.length]));
  const add = (parent, title, series, x) => {
    const div = document.createElement("div");
    document.getElementById(parent).appendChild(div);
    G.chart(div, title, series, x);
  };

  add("curves", "training success rate per policy version", per((r, c) => [{
    label: r.store, colour: c, xs: col(r.versions, "version"), ys: col(r.versions, "success_rate")}]), "policy version");
  add("curves", "mean return per policy version", per((r, c) => [{
    label: r.store, colour: c, xs: col(r.versions, "version"), ys: col(r.versions, "mean_return")}]), "policy version");
  add("curves", "held-out success (95 % Wilson band)", per((r, c) => [{
    label: `${r.store} held-out`, colour: c, xs: col(r.heldout, "policy_version"),
    ys: col(r.heldout, "success_rate"), band: [col(r.heldout, "low"), col(r.heldout, "high")]}]), "policy version");

  add("actors", "environment steps per second, per policy version", per((r, c) => [{
    label: r.store, colour: c, xs: col(r.versions, "version"), ys: col(r.versions, "steps_per_s")}]), "policy version");
  add("actors", "groups per policy version", per((r, c) => [{
    label: r.store, colour: c, xs: col(r.versions, "version"), ys: col(r.versions, "groups")}]), "policy version");

  const learner = (title, names) => add("learner", title, per((r, c) => names
    .filter((name) => r.learner.length && name in r.learner[0])
    .map((name, j) => ({label: `${r.store} ${name}`, colour: c, dash: j ? [6, 4] : undefined,
                        xs: col(r.learner, "update"), ys: col(r.learner, name)}))), "update");
  learner("loss", ["loss", "pg_loss"]);
  learner("approx. KL (π_θ vs π_prox) and KL to the reference", ["approx_kl", "kl_ref"]);
  learner("clip fraction", ["clip_frac"]);
  learner("behaviour weight (mean, max dashed)", ["behavior_weight_mean", "behavior_weight_max"]);
  learner("behaviour/learner mismatch (KL)", ["mismatch_kl"]);
  learner("staleness of trained groups (mean, max dashed)", ["staleness_mean", "staleness_max"]);
  learner("groups dropped as too stale, per update", ["stale_groups"]);
  learner("learner throughput (tokens/s)", ["tokens_per_s"]);

  const tables = await Promise.all(stores.map((s) => G.get("/api/groups", {store: s.label, limit: 20})));
  document.getElementById("groups").innerHTML = tables.map((rows, i) => `<h2>${G.esc(stores[i].label)}</h2>` +
    G.table(rows, ["group_id", "task_id", "policy_version", "rollouts", "steps", "success_rate", "mean_return", "return_spread"],
      (c, v) => (c === "group_id" ? G.groupLink(stores[i].label, v) : undefined))).join("");
}

main().catch(G.error);
