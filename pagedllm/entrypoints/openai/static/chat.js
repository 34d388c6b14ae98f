// The chat page: streams an answer from /v1/chat/completions, shows its tokens/s, and selects the
// request on the /kv picture beside it (an iframe of /kv, told which request by postMessage).

import { HTTPError, apiKey, el, getJSON, setApiKey, sseMessages, withKey } from "/static/common.js";

const messagesEl = document.getElementById("messages");
const promptEl = document.getElementById("prompt");
const sendButton = document.getElementById("send");
const stopButton = document.getElementById("stop");
const speedEl = document.getElementById("speed");
const frame = document.getElementById("kv-frame");
const keyForm = document.getElementById("key-form");

apiKey(); // takes ?api_key= off the address bar
const history = [];
let model = null;
let controller = null;

function showKeyForm() {
  keyForm.hidden = false;
}

async function loadModel() {
  try {
    const models = await getJSON("/v1/models");
    model = models.data[0].id;
    document.getElementById("model").textContent = `model ${model}`;
    frame.src = withKey("/kv");
    document.getElementById("kv-link").href = withKey("/kv");
  } catch (error) {
    if (error instanceof HTTPError && error.status === 401) showKeyForm();
    else document.getElementById("model").textContent = `cannot list models: ${error.message}`;
  }
}

function showSpeed(tokens, firstAt, lastAt, startAt, exact) {
  const decodeSeconds = (lastAt - firstAt) / 1000;
  const tps = tokens > 1 && decodeSeconds > 0 ? (tokens - 1) / decodeSeconds : null;
  speedEl.dataset.completionTokens = tokens;
  speedEl.dataset.tokensPerSecond = tps === null ? "" : tps.toFixed(2);
  const ttft = firstAt ? `first token after ${Math.round(firstAt - startAt)} ms` : "waiting for the first token";
  speedEl.textContent =
    `${exact ? "" : "~"}${tokens} tokens · ${tps === null ? "–" : tps.toFixed(1)} tokens/s · ${ttft}`;
}

function selectOnKv(requestId) {
  document.getElementById("request-id").textContent = requestId;
  document.getElementById("kv-link").href = withKey(`/kv?request=${encodeURIComponent(requestId)}`);
  if (frame.contentWindow) frame.contentWindow.postMessage({ kvSelect: requestId }, window.location.origin);
}

async function send(text) {
  history.push({ role: "user", content: text });
  messagesEl.append(el("div", { class: "msg", "data-role": "user" }, text));
  const answer = el("div", { class: "msg", "data-role": "assistant", "data-done": "false" });
  messagesEl.append(answer);
  const body = {
    model,
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number(document.getElementById("max-tokens").value),
    temperature: Number(document.getElementById("temperature").value),
  };
  controller = new AbortController();
  sendButton.disabled = true;
  stopButton.disabled = false;
  const startAt = performance.now();
  let firstAt = 0;
  let lastAt = 0;
  let tokens = 0;
  let answerText = "";
  let selected = false;
  try {
    for await (const chunk of sseMessages("/v1/chat/completions", { method: "POST", body, signal: controller.signal })) {
      if (!selected) {
        selected = true;
        selectOnKv(chunk.id);
      }
      if (chunk.usage) {
        showSpeed(chunk.usage.completion_tokens, firstAt, lastAt, startAt, true);
        continue;
      }
      const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
      if (!delta) continue;
      lastAt = performance.now();
      if (!firstAt) firstAt = lastAt;
      tokens += 1; // one chunk per step: about a token each, made exact by the usage chunk
      answerText += delta;
      answer.textContent = answerText;
      showSpeed(tokens, firstAt, lastAt, startAt, false);
      messagesEl.scrollTop = messagesEl.scrollHeight;
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      answer.append(el("div", { class: "error" }, `error: ${error.message}`));
      if (error instanceof HTTPError && error.status === 401) showKeyForm();
    }
  } finally {
    history.push({ role: "assistant", content: answerText });
    answer.dataset.done = "true";
    sendButton.disabled = false;
    stopButton.disabled = true;
    controller = null;
  }
}

document.getElementById("compose").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = promptEl.value.trim();
  if (!text || controller || !model) return;
  promptEl.value = "";
  send(text);
});
promptEl.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    document.getElementById("compose").requestSubmit();
  }
});
stopButton.addEventListener("click", () => controller && controller.abort());
document.getElementById("reset").addEventListener("click", () => {
  history.length = 0;
  messagesEl.replaceChildren();
});
keyForm.addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey(document.getElementById("key-input").value);
  keyForm.hidden = true;
  loadModel();
});

loadModel();
