// What both pages share: the API key, server-sent events read through fetch, number formatting.
// Hand-written, no build, no CDN: this file is served as it is from the installed package.

const KEY_STORE = "pagedllm.api_key";

// The API key: ?api_key=KEY on first load (then dropped from the address bar, kept for this tab), or
// whatever the key form stored. "" when the server has none.
export function apiKey() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("api_key");
  if (given !== null) {
    sessionStorage.setItem(KEY_STORE, given);
    url.searchParams.delete("api_key");
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_STORE, key);
}

export function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// A page URL that carries the key (an iframe or a new tab cannot send the header when it opens).
export function withKey(path) {
  const key = apiKey();
  if (!key) return path;
  return path + (path.includes("?") ? "&" : "?") + "api_key=" + encodeURIComponent(key);
}

export class HTTPError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return new HTTPError(response.status, body.error ? body.error.message : response.statusText);
  } catch {
    return new HTTPError(response.status, response.statusText);
  }
}

// The `data:` payloads of a server-sent event stream, parsed as JSON ("[DONE]" ends it). fetch rather
// than EventSource, so that the key travels as a header, and POST works (the chat's completions).
export async function* sseMessages(url, { method = "GET", body = undefined, signal } = {}) {
  const init = { method, signal, headers: authHeaders(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(url, init);
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue; // a comment (keep-alive) or a retry: line
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

export async function getJSON(url, signal) {
  const response = await fetch(url, { headers: authHeaders(), signal });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

export function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

export function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}
