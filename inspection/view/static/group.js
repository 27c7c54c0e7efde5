// The group page: a group's rollouts side by side, turn by turn, each step coloured by its
// advantage under the chosen estimator; a state's pool highlighted on hover or click.
"use strict";

const RECOMPUTED = ["gagpo", "gagpo_lambda0", "gagpo_lambda1", "gigpo", "grpo", "rloo"];
const $ = (id) => document.getElementById(id);
let view = null; // the last /api/group answer
let pinned = null; // index of the pinned pool

// The estimator parameters the form holds, as the query of /api/group (only those the
// chosen estimator takes, so a recompute matches `gagpo advantages` with the same flags).
function estimatorQuery() {
  const estimator = $("estimator").value;
  const q = {estimator};
  if (!estimator.startsWith("stored:")) {
    q.gamma = $("gamma").value;
    if (estimator === "gagpo") q.lam = $("lam").value;
    const grouping = $("grouping").value.trim();
    if (grouping && grouping !== "exact") q.state_grouping = grouping;
    if ($("norm").value) q.norm = $("norm").value;
  }
  return q;
}

function syncForm() {
  const recomputed = !$("estimator").value.startsWith("stored:");
  for (const id of ["gamma", "grouping", "norm"]) $(id).disabled = !recomputed;
  $("lam").disabled = $("estimator").value !== "gagpo";
}

async function loadGroups(store) {
  const q = {store, order: $("order").value, limit: 30};
  if ($("version").value !== "") q.version = $("version").value;
  if ($("task").value.trim()) q.task = $("task").value.trim();
  const rows = await G.get("/api/groups", q);
  $("group-list").innerHTML = G.table(rows,
    ["group_id", "task_id", "policy_version", "rollouts", "steps", "success_rate", "mean_return", "return_spread"],
    (c, v) => (c === "group_id" ? G.groupLink(store, v) : undefined));
}

// Drift (the prompt_drift view, schemas/extends.py): this prompt neither begins with the
// previous turn's prompt and action nor is it that prompt with its oldest turn dropped (a
// history window sliding on, counted but not marked), so the learner starts a new segment.
function driftMark(step) {
  if (!step.drift) return "";
  const title = `prompt drift: this prompt does not begin with turn ${step.step - 1}'s prompt + action ` +
    `(it keeps the first ${step.shared_tokens} of those ${step.previous_tokens} tokens; ${step.prompt_tokens} tokens in this prompt), ` +
    "and is not that prompt with its oldest turn dropped. The sampled reply was re-tokenized differently, the template " +
    "rendered an earlier turn afresh, or the agent edited its history; the learner starts a new segment here.";
  return ` <span class="break-mark" title="${G.esc(title)}">⚠ prompt drift</span>`;
}

function stepCell(step, poolIndex, max) {
  const pool = poolIndex.get(step.pool_id);
  const obs = step.observation || "";
  const observation = obs.length <= 80 ? `<div class="muted">${G.esc(obs)}</div>`
    : `<details><summary>observation (${obs.length} characters)</summary><pre>${G.esc(obs)}</pre></details>`;
  const flags = [`<span>r ${G.num(step.reward, 3)}</span>`];
  if (!step.valid) flags.push(`<span class="bad">invalid</span>`);
  if (step.won) flags.push(`<span class="good">won</span>`);
  else if (step.done) flags.push(`<span>done</span>`);
  if (step.truncated) flags.push(`<span>truncated</span>`);
  let tokens = "";
  if (step.tokens.length) {
    const mean = step.tokens.reduce((s, [, lp]) => s + lp, 0) / step.tokens.length;
    const spans = step.tokens.map(([id, lp]) => {
      const p = Math.exp(lp);
      return `<span title="token ${id}: log-prob ${lp.toFixed(4)}, p ${p.toFixed(3)}" style="background:rgba(46,125,50,${p.toFixed(3)})">${lp.toFixed(2)}</span>`;
    }).join("");
    tokens = `<details><summary>behaviour log-probs: ${step.tokens.length} tokens, mean ${mean.toFixed(3)}</summary><div class="tokens">${spans}</div></details>`;
  }
  const adv = step.advantage;
  return `<div class="step${step.drift ? " prompt-break" : ""}" data-traj="${G.esc(step.traj_id)}" data-step="${step.step}" data-pool="${pool}" data-adv="${adv}" style="background:${G.diverging(adv, max)}">
    <div class="head"><span>t${step.step}${driftMark(step)}</span><span class="adv">A ${adv >= 0 ? "+" : ""}${G.num(adv)}</span></div>
    <pre class="state" data-pool="${pool}" title="state pool of ${step.state_group_size} steps: hover to see it, click to pin">${G.esc(step.state_key)}</pre>
    ${observation}
    <code class="action">${G.esc(step.action)}</code>
    <div class="flags">${flags.join("")}</div>
    <div class="muted" style="font-size:11px">G ${G.num(step.return, 3)} · V̂ ${G.num(step.value_proxy, 3)} · δ ${G.num(step.td_residual, 3)}</div>
    ${tokens}</div>`;
}

function render() {
  const v = view;
  $("title").textContent = `${v.group_id} · ${v.env} · task ${v.task_id} · policy v${v.policy_version}`;
  const s = v.summary;
  $("summary").innerHTML = `<span>estimator <b>${G.esc(v.estimator.tag)}</b></span>` +
    `<span>zero-advantage share <b id="zero-share">${G.pct(s.zero_share)}</b></span>` +
    `<span>IQR <b>${G.num(s.iqr)}</b></span><span>max |A| <b>${G.num(s.max_abs)}</b></span>` +
    `<span title="turns whose prompt neither begins with the previous turn's prompt + action nor drops only its oldest turn (the prompt_drift view)">` +
    `prompt drift <b id="prompt-drift">${v.drift.drift}</b> of ${v.drift.tested} turns</span>` +
    `<span class="muted" title="turns whose history window dropped its oldest turn: a new segment for the learner, not drift">` +
    `window slides <b id="window-slides">${v.drift.slides}</b></span>`;
  G.legend($("legend"), s.max_abs || 1, "advantage, one scale for the whole group");
  const poolIndex = new Map(v.pools.map((p, i) => [p.pool_id, i]));
  const turns = Math.max(...v.rollouts.map((r) => r.length));
  const head = v.rollouts.map((r) =>
    `<th title="${G.esc(r.traj_id)}">…${G.esc(r.traj_id.slice(-6))}<br>return ${G.num(r.return, 2)} ${r.won ? '<span class="good">won</span>' : ""}<br>${r.length} turns</th>`).join("");
  let body = "";
  for (let t = 0; t < turns; t++) {
    body += `<tr><td class="turn">${t}</td>` + v.rollouts.map((r) =>
      `<td>${r.steps[t] ? stepCell({...r.steps[t], traj_id: r.traj_id}, poolIndex, s.max_abs || 1) : ""}</td>`).join("") + "</tr>";
  }
  $("grid").innerHTML = `<table class="grid"><thead><tr><th class="turn">turn</th>${head}</tr></thead><tbody>${body}</tbody></table>`;
  for (const el of document.querySelectorAll("pre.state")) {
    el.addEventListener("mouseenter", () => highlight(+el.dataset.pool, "hover-pool"));
    el.addEventListener("mouseleave", () => highlight(null, "hover-pool"));
    el.addEventListener("click", () => pin(+el.dataset.pool));
  }
  pinned = null;
}

function highlight(pool, cls) {
  for (const el of document.querySelectorAll(".step")) {
    el.classList.toggle(cls, pool !== null && +el.dataset.pool === pool);
  }
  if (pool !== null) showPool(pool);
  else if (pinned !== null) showPool(pinned);
}

function pin(pool) {
  pinned = pinned === pool ? null : pool;
  for (const el of document.querySelectorAll(".step")) {
    const inside = pinned !== null && +el.dataset.pool === pinned;
    el.classList.toggle("in-pool", inside);
    el.classList.toggle("dim", pinned !== null && !inside);
  }
  if (pinned !== null) showPool(pinned);
}

function showPool(index) {
  const p = view.pools[index];
  const rollouts = new Set(p.members.map((m) => m[0])).size;
  const rows = p.members.map(([traj, step, ret, td, adv]) =>
    `<tr><td title="${G.esc(traj)}">…${G.esc(traj.slice(-6))}</td><td>${step}</td><td>${G.num(ret)}</td><td>${G.num(td)}</td><td style="background:${G.diverging(adv, view.summary.max_abs || 1)}">${G.num(adv)}</td></tr>`).join("");
  $("pool").innerHTML = `<b>State pool</b> ${pinned === index ? "(pinned: click the state again to release)" : ""}
    <p>size <b id="pool-size">${p.size}</b> steps in ${rollouts} rollouts · ${p.states.length} distinct state(s)<br>
    value proxy V̂ = mean return = <b id="pool-value">${G.num(p.value_proxy)}</b></p>
    <pre>${G.esc(p.states.slice(0, 3).join("\n\n"))}${p.states.length > 3 ? "\n…" : ""}</pre>
    <table><thead><tr><th>rollout</th><th>turn</th><th>return G</th><th>TD residual δ</th><th>advantage</th></tr></thead><tbody>${rows}</tbody></table>`;
}

async function loadGroup(store, group) {
  const q = {store, group, ...estimatorQuery()};
  history.replaceState(null, "", `/group?${new URLSearchParams({...q, store, group})}`);
  const cmp = {store, group, gamma: $("gamma").value, lam: $("lam").value};
  if ($("grouping").value.trim() !== "exact") cmp.state_grouping = $("grouping").value.trim();
  $("compare-link").href = `/compare?${new URLSearchParams(cmp)}`;
  $("grid").innerHTML = `<p class="muted">loading…</p>`;
  view = await G.get("/api/group", q);
  G.error(null);
  render();
}

async function main() {
  G.nav("Group");
  const p = G.params();
  const {current: store} = await G.storeSelect($("store-select"), (s) => { location.search = `?store=${encodeURIComponent(s)}`; });
  const choices = await G.get("/api/choices", {store});
  $("version").innerHTML += choices.versions.map((v) => `<option value="${v}">v${v}</option>`).join("");
  $("norm").insertAdjacentHTML("afterbegin", `<option value="" selected>default</option>`);
  $("estimator").innerHTML =
    choices.tags.map((t) => `<option value="stored:${G.esc(t.estimator)}">stored: ${G.esc(t.estimator)}</option>`).join("") +
    RECOMPUTED.map((n) => `<option value="${n}">${n} (recomputed)</option>`).join("");
  for (const [param, id] of [["gamma", "gamma"], ["lam", "lam"], ["state_grouping", "grouping"], ["norm", "norm"]]) {
    if (p.get(param)) $(id).value = p.get(param);
  }
  if (p.get("estimator")) $("estimator").value = p.get("estimator");
  syncForm();
  $("estimator").onchange = syncForm;
  const group = p.get("group");
  $("chooser").onsubmit = (e) => {
    e.preventDefault();
    const typed = $("group-input").value.trim();
    if (typed) location.search = `?${new URLSearchParams({store, group: typed})}`;
    else loadGroups(store).catch(G.error);
  };
  for (const id of ["version", "order"]) $(id).onchange = () => loadGroups(store).catch(G.error);
  $("estimator-form").onsubmit = (e) => {
    e.preventDefault();
    if (group) loadGroup(store, group).catch(G.error);
  };
  if (group) {
    $("group-input").value = group;
    await loadGroup(store, group);
  } else {
    $("estimator-form").hidden = true;
    await loadGroups(store);
  }
}

main().catch(G.error);
