// The requests: one <tr data-request-id> each, kept across snapshots and changed only where its numbers,
// its table or its blocks' states changed, so that hundreds of rows stay cheap at 10 snapshots a second.

import { escapeHTML, fmtInt } from "/static/common.js";

const MAX_CHIPS = 24; // block ids listed in a row; the rest is counted

function chips(table, stateOf) {
  const shown = table.slice(0, MAX_CHIPS).map((id) => {
    if (id < 0) return '<span class="chip" data-state="free" title="freed: out of the sliding window">–</span>';
    return `<span class="chip" data-state="${stateOf(id)}">${id}</span>`;
  });
  if (table.length > MAX_CHIPS) shown.push(`<span class="more">+${table.length - MAX_CHIPS}</span>`);
  return shown.join("");
}

// used (green), tail waste (red), and what a max_model_len reservation would waste on top (hatched)
function slots(row, maxLen) {
  const pct = (n) => `${Math.max(n > 0 ? 0.4 : 0, (100 * n) / maxLen).toFixed(2)}%`;
  const naive = row.naive_waste === null ? 0 : Math.max(0, row.naive_waste - row.tail_waste);
  return (
    `<div class="slots" title="the ${maxLen} slots a max_model_len reservation would hold">` +
    `<i class="u" style="width:${pct(row.num_computed_tokens)}"></i>` +
    `<i class="w" style="width:${pct(row.tail_waste)}"></i><i class="n" style="width:${pct(naive)}"></i></div>`
  );
}

export class RequestRows {
  constructor(tbody) {
    this.tbody = tbody;
    this.rows = new Map(); // request id -> { tr, cells, keys }
    this.empty = null;
  }

  make(row) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = row.id;
    tr.dataset.group = row.group;
    const id = escapeHTML(row.id);
    tr.innerHTML = `<td class="id" title="${id}">${id}</td>${"<td></td>".repeat(6)}<td class="bar"></td>`;
    tr.children[4].className = "table";
    return { tr, cells: [...tr.children], keys: {} };
  }

  // Set a part of the row only when its key changed.
  put(entry, name, key, write) {
    if (entry.keys[name] === key) return;
    entry.keys[name] = key;
    write();
  }

  render(snapshot, stateOf, isSelected, hoverId) {
    const seen = new Set();
    snapshot.requests.forEach((row, i) => {
      let entry = this.rows.get(row.id);
      if (!entry) {
        entry = this.make(row);
        this.rows.set(row.id, entry);
      }
      seen.add(row.id);
      const { tr, cells } = entry;
      const d = tr.dataset;
      this.put(entry, "status", `${row.status}/${row.num_preemptions}`, () => {
        d.status = row.status;
        cells[1].textContent = row.num_preemptions ? `${row.status} (preempted ${row.num_preemptions}x)` : row.status;
      });
      this.put(entry, "tokens", `${row.num_computed_tokens}/${row.num_tokens}/${row.tail_waste}`, () => {
        d.numTokens = row.num_tokens;
        d.numComputed = row.num_computed_tokens;
        d.tailWaste = row.tail_waste;
        d.naiveWaste = row.naive_waste ?? "";
        cells[2].textContent = `${fmtInt(row.num_computed_tokens)} / ${fmtInt(row.num_tokens)}`;
        cells[5].textContent = fmtInt(row.tail_waste);
        cells[6].textContent = fmtInt(row.naive_waste);
        cells[7].innerHTML = slots(row, snapshot.max_model_len);
      });
      const table = row.table.join(",");
      const colors = row.table.slice(0, MAX_CHIPS).map((id) => (id < 0 ? "-" : stateOf(id))).join();
      this.put(entry, "table", `${table}|${colors}`, () => {
        d.table = table;
        cells[3].textContent = row.table.length;
        cells[4].innerHTML = chips(row.table, stateOf);
      });
      tr.classList.toggle("selected", isSelected(row.id));
      tr.classList.toggle("hover", row.id === hoverId);
      if (this.tbody.children[i] !== tr) this.tbody.insertBefore(tr, this.tbody.children[i] || null);
    });
    for (const [id, entry] of this.rows) {
      if (!seen.has(id)) {
        entry.tr.remove();
        this.rows.delete(id);
      }
    }
    this.showEmpty(snapshot.requests.length === 0);
  }

  showEmpty(empty) {
    if (empty && !this.empty) {
      this.empty = document.createElement("tr");
      this.empty.className = "empty";
      this.empty.innerHTML = '<td colspan="8">no request running or waiting</td>';
      this.tbody.append(this.empty);
    } else if (!empty && this.empty) {
      this.empty.remove();
      this.empty = null;
    }
  }
}
