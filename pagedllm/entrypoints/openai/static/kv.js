// /kv: the pool (kv_pool.js), the requests (kv_rows.js), the pool's totals and its events, from
// /kv/events: one whole snapshot a message, 10 a second at most. Messages that arrive while the page is
// busy are merged into the newest (their events kept), so a slow machine draws less often, never late.
// Hand-written, no build, no CDN.

import { HTTPError, apiKey, escapeHTML, fmtBytes, fmtInt, getJSON, setApiKey, sseMessages, withKey } from "/static/common.js";
import { PoolView } from "/static/kv_pool.js";
import { RequestRows } from "/static/kv_rows.js";

const MAX_EVENTS = 200; // lines kept in the event log
const MAX_HOLDERS = 3; // request ids a block's hover lists
const RETRY_MS = 1000;

const $ = (id) => document.getElementById(id);
const pool = new PoolView($("pool"), $("cells"), $("pool-wrap"));
const rows = new RequestRows($("rows"));
const tip = $("tip");
const statusEl = $("status");
const pauseButton = $("pause");

apiKey(); // takes ?api_key= off the address bar before anything else reads the URL
const wanted = new URL(window.location.href).searchParams.get("request");
// A server of several models shows one model's pool at a time: ?model=NAME (its routes take it too).
const model = new URL(window.location.href).searchParams.get("model");
const forModel = (path) => (model === null ? path : `${path}${path.includes("?") ? "&" : "?"}model=${encodeURIComponent(model)}`);

const view = {
  snapshot: null,
  pending: null, // the newest snapshot not applied yet
  selected: new Set(wanted ? [wanted] : []), // request ids, or an id's prefix (an API response's id)
  hoverRow: null,
  lastTables: new Map(), // selected request -> its last table, drawn dashed once it has finished
  paused: false,
  controller: null,
  tipBlock: -1,
  tipController: null,
  applyMs: 0,
};

$("chat-link").href = withKey("/");

// The model selector: shown when /v1/models lists models with a status (a server of several models).
async function listModels() {
  try {
    const models = (await getJSON("/v1/models")).data.filter((m) => m.status !== undefined);
    if (models.length < 2) return;
    const select = $("model");
    const current = model ?? models[0].id;
    for (const m of models) select.add(new Option(`${m.id} (${m.status})`, m.id, false, m.id === current));
    select.hidden = false;
    select.addEventListener("change", () => {
      window.location.href = withKey(`/kv?model=${encodeURIComponent(select.value)}`);
    });
  } catch {
    // no list (a key not given yet): the page still shows the default model
  }
}
listModels();

// ---- selection ----------------------------------------------------------------------------------

function isSelected(requestId) {
  for (const id of view.selected) {
    if (requestId === id || requestId.startsWith(`${id}-`) || requestId.startsWith(`${id}#`)) return true;
  }
  return false;
}

// [table, finished] of the selected and hovered requests, and where the selected finished ones were.
function tablesToDraw() {
  const out = [];
  const live = new Set();
  for (const row of view.snapshot ? view.snapshot.requests : []) {
    if (isSelected(row.id) || row.id === view.hoverRow) {
      out.push([row.table, false]);
      live.add(row.id);
      if (isSelected(row.id)) view.lastTables.set(row.id, row.table);
    }
  }
  for (const [id, table] of view.lastTables) if (!live.has(id)) out.push([table, true]);
  return out;
}

function redraw() {
  if (!view.snapshot) return;
  rows.render(view.snapshot, (id) => pool.stateOf(id), isSelected, view.hoverRow);
  pool.draw(tablesToDraw());
}

// ---- totals, events, status ---------------------------------------------------------------------

function renderTotals(snapshot) {
  const t = { ...snapshot.totals, num_blocks: snapshot.num_blocks };
  for (const dd of document.querySelectorAll("[data-total]")) {
    const key = dd.dataset.total;
    dd.dataset.value = t[key];
    if (key === "waste_tokens") dd.textContent = `${fmtInt(t.waste_tokens)} tokens · ${fmtBytes(t.waste_bytes)}`;
    else if (key === "naive_waste_tokens") {
      dd.textContent = `${fmtInt(t.naive_waste_tokens)} tokens · ${fmtBytes(t.naive_waste_bytes)}`;
    } else dd.textContent = fmtInt(t[key]);
  }
}

function describe(event) {
  if (event.kind === "preempt") return `request ${event.request_id} preempted: its blocks are freed, it will recompute`;
  if (event.kind === "evict") return `block ${event.block_id} evicted: cached prefix ${event.hash} dropped for new contents`;
  return `copy-on-write: block ${event.src} copied into ${event.block_id} for ${event.request_id ?? "?"}`;
}

function renderEvents(events) {
  const log = $("event-log");
  for (const event of events.slice(-MAX_EVENTS)) {
    const li = document.createElement("li");
    li.dataset.kind = event.kind;
    li.textContent = `step ${event.step} · ${describe(event)}`;
    log.prepend(li);
  }
  while (log.children.length > MAX_EVENTS) log.lastElementChild.remove();
}

function setStatus(text, connected) {
  statusEl.textContent = text;
  statusEl.dataset.connected = String(connected);
}

function apply() {
  const snapshot = view.pending;
  view.pending = null;
  if (!snapshot || view.paused) return;
  const start = performance.now();
  const moved = pool.update(snapshot.states, snapshot.state_names, snapshot.ref_cnts);
  view.snapshot = snapshot;
  rows.render(snapshot, (id) => pool.stateOf(id), isSelected, view.hoverRow);
  if (moved || view.selected.size || view.hoverRow !== null) pool.draw(tablesToDraw());
  renderTotals(snapshot);
  renderEvents(snapshot.events);
  statusEl.dataset.seq = snapshot.seq;
  statusEl.dataset.step = snapshot.step;
  setStatus(`live · step ${snapshot.step} · ${snapshot.requests.length} requests`, true);
  view.applyMs = performance.now() - start;
}

function receive(snapshot) {
  if (view.pending) snapshot = { ...snapshot, events: [...view.pending.events, ...snapshot.events] };
  else requestAnimationFrame(apply);
  view.pending = snapshot;
}

// ---- the stream ---------------------------------------------------------------------------------

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function connect() {
  while (!view.paused) {
    const controller = new AbortController();
    view.controller = controller;
    try {
      for await (const snapshot of sseMessages(forModel("/kv/events"), { signal: controller.signal })) {
        if (view.paused) return; // a message read before the pause is not drawn after it
        receive(snapshot);
      }
      setStatus("the server ended the stream; reconnecting…", false);
    } catch (error) {
      if (view.paused || error.name === "AbortError") return;
      if (error instanceof HTTPError && error.status === 401) {
        setStatus("this server wants an API key", false);
        $("key-form").hidden = false;
        return;
      }
      if (error instanceof HTTPError && error.status < 500) {
        setStatus(error.message, false); // e.g. 409: data-parallel replicas have no single pool
        return;
      }
      setStatus(`disconnected (${error.message}); retrying…`, false);
    }
    await sleep(RETRY_MS);
  }
}

pauseButton.addEventListener("click", () => {
  view.paused = !view.paused;
  pauseButton.dataset.paused = String(view.paused);
  pauseButton.textContent = view.paused ? "Resume" : "Pause";
  if (view.paused) {
    view.pending = null;
    if (view.controller) view.controller.abort(); // the server stops taking snapshots for us
    setStatus(`paused at step ${statusEl.dataset.step}`, false);
  } else {
    connect();
  }
});

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("key-input").value);
  $("key-form").hidden = true;
  $("chat-link").href = withKey("/");
  connect();
});

// ---- hover and selection ------------------------------------------------------------------------

function placeTip(clientX, clientY) {
  const rect = $("pool-wrap").getBoundingClientRect();
  tip.style.left = `${Math.min(clientX - rect.left + 14, rect.width - 320)}px`;
  tip.style.top = `${clientY - rect.top + 14}px`;
}

async function showBlock(id) {
  tip.dataset.blockId = id;
  tip.dataset.loaded = "false";
  tip.innerHTML = `<b>block ${id}</b> · ${pool.stateOf(id)}`;
  tip.hidden = false;
  if (view.tipController) view.tipController.abort();
  const controller = new AbortController();
  view.tipController = controller;
  try {
    const info = await getJSON(forModel(`/kv/blocks/${id}`), controller.signal);
    if (view.tipBlock !== id) return;
    const text = info.text === null ? "<i>tokens not recorded (filled before this page opened)</i>"
      : `“${escapeHTML(info.text)}”`;
    const holders = info.holders.slice(0, MAX_HOLDERS).map(escapeHTML).join(", ");
    const more = info.holders.length > MAX_HOLDERS ? ` and ${info.holders.length - MAX_HOLDERS} more` : "";
    tip.innerHTML =
      `<b>block ${id}</b> · <span data-field="state">${info.state}</span> · ` +
      `ref_cnt <span data-field="ref_cnt">${info.ref_cnt}</span><br>` +
      `hash <code data-field="hash">${info.hash ?? "none (not full, or not cached)"}</code><br>` +
      `<span data-field="text">${text}</span><br>` +
      `<small>held by <span data-field="holders" data-count="${info.holders.length}">${holders || "nobody"}</span>` +
      `${more}</small>`;
    tip.dataset.loaded = "true";
  } catch (error) {
    if (error.name !== "AbortError" && view.tipBlock === id) tip.textContent = `block ${id}: ${error.message}`;
  }
}

$("pool").addEventListener("mousemove", (e) => {
  const id = pool.blockAt(e.clientX, e.clientY);
  placeTip(e.clientX, e.clientY);
  if (id === view.tipBlock) return;
  view.tipBlock = id;
  if (id < 0) tip.hidden = true;
  else showBlock(id);
});
$("pool").addEventListener("mouseleave", () => {
  view.tipBlock = -1;
  tip.hidden = true;
});

function select(ids) {
  view.selected = new Set(ids);
  view.lastTables.clear();
  redraw();
}

$("rows").addEventListener("click", (e) => {
  const tr = e.target.closest("tr[data-request-id]");
  if (!tr) return;
  const id = tr.dataset.requestId;
  if (view.selected.has(id)) {
    view.selected.delete(id);
    view.lastTables.delete(id);
  } else view.selected.add(id);
  redraw();
});
$("rows").addEventListener("mouseover", (e) => {
  const tr = e.target.closest("tr[data-request-id]");
  const id = tr ? tr.dataset.requestId : null;
  if (id !== view.hoverRow) {
    view.hoverRow = id;
    redraw();
  }
});
$("rows").addEventListener("mouseleave", () => {
  view.hoverRow = null;
  redraw();
});
// The chat page beside us says which request it just sent.
window.addEventListener("message", (e) => {
  if (e.origin === window.location.origin && e.data && typeof e.data.kvSelect === "string") select([e.data.kvSelect]);
});
window.addEventListener("resize", () => {
  pool.layout();
  redraw();
});

// For tests and the console: where a block's cell is on screen, the last snapshot, what it cost here.
window.kvPage = {
  cellCenter: (id) => pool.cellCenter(id),
  snapshot: () => view.snapshot,
  stats: () => ({ applyMs: view.applyMs, drawMs: pool.drawMs }),
};

connect();
