// The compare page: one group under several estimators, one colour scale for all columns.
"use strict";

const $ = (id) => document.getElementById(id);

// With a step oracle (Sokoban's solver): a move's cell says whether it was optimal.
const MARK = {true: ["optimal", "✓ optimal"], false: ["not-optimal", "✗ not optimal"], null: ["", ""]};

async function load(store, group) {
  const q = {store, group, estimators: $("estimators").value.replace(/\s+/g, ""), gamma: $("gamma").value, lam: $("lam").value};
  const grouping = $("grouping").value.trim();
  if (grouping && grouping !== "exact") q.state_grouping = grouping;
  if ($("traj").value) q.traj = $("traj").value;
  history.replaceState(null, "", `/compare?${new URLSearchParams(q)}`);
  const v = await G.get("/api/compare", q);
  G.error(null);
  $("title").textContent = v.traj_id ? `${v.group_id}, rollout ${v.traj_id}` : v.group_id;
  $("group-link").href = `/group?${new URLSearchParams({store, group})}`;
  const chosen = $("traj").value;
  $("traj").innerHTML = `<option value="">all rollouts</option>` + v.trajectories.map((t) =>
    `<option value="${G.esc(t)}"${t === chosen ? " selected" : ""}>…${G.esc(t.slice(-8))}</option>`).join("");
  const max = Math.max(1e-9, ...v.summaries.map((s) => s.max_abs || 0));
  G.legend($("legend"), max, "advantage, one scale for every estimator");
  const columns = ["estimator", "zero-advantage share", "IQR", "max |A|"];
  if (v.oracle) columns.push("credit AUC", "AUC within a state");
  $("summaries").innerHTML = G.table(v.estimators.map((e, i) => ({
    estimator: e.tag, "zero-advantage share": G.pct(v.summaries[i].zero_share),
    IQR: G.num(v.summaries[i].iqr), "max |A|": G.num(v.summaries[i].max_abs),
    "credit AUC": G.num(v.summaries[i].auc, 3), "AUC within a state": G.num(v.summaries[i].state_auc, 3)})),
    columns);
  $("oracle").textContent = v.oracle
    ? `${v.oracle.name}: ${v.oracle.labelled} moves judged, ${v.oracle.optimal} optimal (✓ starts a shortest solution). ` +
      "Credit AUC: the chance that an optimal move gets a higher advantage than another (ties ½; 0.5 = no credit), as make demo's credit table."
    : "";
  const head = ["rollout", "turn", "action", ...(v.oracle ? ["move"] : []), "reward", ...v.estimators.map((e) => e.choice)]
    .map((c) => `<th title="${G.esc(c)}">${G.esc(c)}</th>`).join("");
  const body = v.rows.map((r) => `<tr><td title="${G.esc(r.traj_id)}">…${G.esc(r.traj_id.slice(-6))}</td><td>${r.step}</td>` +
    `<td><code class="${r.valid ? "" : "bad"}">${G.esc(String(r.action).slice(0, 40))}</code></td>` +
    (v.oracle ? `<td class="move ${MARK[r.optimal][0]}" data-optimal="${r.optimal}"><code>${G.esc(String(r.move ?? "").slice(0, 12))}</code> ${MARK[r.optimal][1]}</td>` : "") +
    `<td>${G.num(r.reward, 2)}</td>` +
    r.advantages.map((a) => `<td class="adv-cell" data-adv="${a}" style="background:${G.diverging(a, max)}">${G.num(a)}</td>`).join("") + "</tr>").join("");
  $("matrix").innerHTML = `<table id="compare-table"><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

async function main() {
  G.nav("Compare");
  const p = G.params();
  const store = p.get("store") || (await G.get("/api/stores"))[0].label;
  for (const [param, id] of [["estimators", "estimators"], ["gamma", "gamma"], ["lam", "lam"], ["state_grouping", "grouping"]]) {
    if (p.get(param)) $(id).value = p.get(param);
  }
  if (p.get("traj")) $("traj").innerHTML = `<option value="${G.esc(p.get("traj"))}" selected></option>`;
  const group = p.get("group");
  if (!group) {
    $("matrix").innerHTML = `<p>Open a group from the <a href="/group?${new URLSearchParams({store})}">group page</a> first.</p>`;
    return;
  }
  $("compare-form").onsubmit = (e) => { e.preventDefault(); load(store, group).catch(G.error); };
  $("traj").onchange = () => load(store, group).catch(G.error);
  await load(store, group);
}

main().catch(G.error);
