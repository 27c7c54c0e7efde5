// The SQL page: the `gagpo sql` sandbox; the table shows the CSV `gagpo sql --format csv` writes.
"use strict";

const $ = (id) => document.getElementById(id);

async function run(store) {
  const query = $("query").value;
  $("sql-status").textContent = "running…";
  $("result").innerHTML = "";
  $("csv-link").hidden = true;
  try {
    const result = await G.get(`/api/sql?${new URLSearchParams({store})}`, null, {query});
    G.error(null);
    const groupAt = result.columns.indexOf("group_id");
    const head = result.columns.map((c) => `<th>${G.esc(c)}</th>`).join("");
    const rows = result.rows.map((row) => "<tr>" + row.map((cell, i) =>
      `<td>${i === groupAt && cell ? G.groupLink(store, cell) : G.esc(cell)}</td>`).join("") + "</tr>").join("");
    $("result").innerHTML = `<table id="sql-table"><thead><tr>${head}</tr></thead><tbody>${rows}</tbody></table>`;
    $("sql-status").textContent = result.total > result.rows.length
      ? `${result.total} rows, first ${result.rows.length} shown (the CSV holds all)` : `${result.total} rows`;
    $("csv-link").href = `/api/sql.csv?${new URLSearchParams({store, query})}`;
    $("csv-link").hidden = false;
  } catch (err) {
    $("sql-status").textContent = "";
    G.error(err);
  }
}

async function main() {
  G.nav("SQL");
  const {current} = await G.storeSelect($("store-select"), () => {});
  if (G.params().get("query")) $("query").value = G.params().get("query");
  $("sql-form").onsubmit = (e) => { e.preventDefault(); run($("store-select").value || current); };
}

main().catch(G.error);
