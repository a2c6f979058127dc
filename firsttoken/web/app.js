// firsttoken chat page: one prompt at a time, streamed over the native SSE API.
// No framework, no build step. Tokens are batched per animation frame and appended to a
// text node, so the cost per frame is the new text only, never the whole answer.

const GIVE_UP_MS = 5000; // without a working connection this long, the answer is interrupted
// The API key, when the server wants one: sessionStorage keeps it for this tab only, gone
// when the tab closes, never shared with other tabs or written to disk like localStorage.
const KEY_STORAGE = "firsttoken.apiKey";

const $ = (id) => document.getElementById(id);
const log = $("log");
const form = $("composer");
const promptBox = $("prompt");
const sendButton = $("send");
const stopButton = $("stop");
const statusLine = $("status");
const stateText = $("state");
const statsText = $("stats");

const requestExtras = readExtras(new URLSearchParams(location.search));
let active = null; // the stream being shown, or null

// Optional request fields from the page URL (e.g. /?max_tokens=50&itl_ms=40&fail_after=10):
// handy for demos and tests of the synthetic engine's timing and fault injection.
function readExtras(params) {
  const extras = {};
  const int = (name) => {
    const value = params.get(name);
    return value !== null && /^\d+$/.test(value) ? Number(value) : undefined;
  };
  for (const name of ["max_tokens", "seed"]) {
    if (int(name) !== undefined) extras[name] = int(name);
  }
  const synthetic = {};
  for (const name of ["ttft_ms", "itl_ms", "fail_after"]) {
    if (int(name) !== undefined) synthetic[name] = int(name);
  }
  if (params.get("error_code")) synthetic.error_code = params.get("error_code");
  if (Object.keys(synthetic).length) extras.synthetic = synthetic;
  return extras;
}

function apiKey() {
  try {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled: the key lives only as long as the prompt's answer
  }
}

function setApiKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: nothing kept
  }
}

// ---- conversation turns -------------------------------------------------------------------

function addTurn(prompt) {
  const turn = document.createElement("article");
  turn.className = "turn";
  const question = document.createElement("p");
  question.className = "prompt";
  question.textContent = prompt;
  const answer = document.createElement("div");
  answer.className = "answer";
  const notice = document.createElement("div");
  notice.className = "notice";
  notice.hidden = true;
  turn.append(question, answer, notice);
  log.append(turn);
  scrollToBottom();
  return { element: turn, prompt, answer, notice };
}

function setTurnState(turn, state) {
  turn.element.dataset.state = state;
}

function showNotice(turn, kind, message) {
  const { notice } = turn;
  notice.replaceChildren();
  notice.className = `notice ${kind}`;
  notice.setAttribute("role", kind === "stopped" ? "status" : "alert");
  const text = document.createElement("span");
  text.className = "notice-text";
  text.textContent = message;
  notice.append(text);
  if (kind !== "stopped") {
    const retry = document.createElement("button");
    retry.type = "button";
    retry.className = "retry";
    retry.textContent = "Retry";
    retry.addEventListener("click", () => {
      if (active) stop(active);
      start(turn);
    });
    notice.append(" ", retry);
  }
  notice.hidden = false;
}

// The server answered 401: ask for a key in the turn itself, then send the prompt again.
function showKeyPrompt(turn, message) {
  const { notice } = turn;
  notice.replaceChildren();
  notice.className = "notice auth";
  notice.setAttribute("role", "alert");
  const text = document.createElement("span");
  text.className = "notice-text";
  text.textContent = message;
  const keyForm = document.createElement("form");
  keyForm.className = "key-form";
  const input = document.createElement("input");
  input.type = "password";
  input.name = "api-key";
  input.autocomplete = "off";
  input.required = true;
  input.placeholder = "API key";
  input.setAttribute("aria-label", "API key");
  const use = document.createElement("button");
  use.type = "submit";
  use.textContent = "Use key";
  keyForm.append(input, use);
  keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    setApiKey(key);
    if (active) stop(active);
    start(turn);
  });
  notice.append(text, keyForm);
  notice.hidden = false;
  input.focus();
}

// ---- scrolling: follow the text only while the reader is at the bottom ------------------

function atBottom() {
  return log.scrollHeight - log.scrollTop - log.clientHeight < 8;
}

function scrollToBottom() {
  log.scrollTop = log.scrollHeight;
}

// ---- one stream ---------------------------------------------------------------------------

async function start(turn) {
  const s = {
    turn,
    id: null,
    token: null,
    cancelUrl: null,
    source: null,
    controller: new AbortController(),
    text: document.createTextNode(""),
    pending: "",
    frame: 0,
    lastSeq: -1,
    received: 0,
    sentAt: performance.now(),
    firstAt: 0,
    lastAt: 0,
    meta: {},
    lostAt: 0,
    giveUpTimer: 0,
    finished: false,
  };
  active = s;
  turn.answer.replaceChildren(s.text);
  turn.notice.hidden = true;
  setTurnState(turn, "starting");
  setBusy(true);
  setState("starting", "Sending…");
  statsText.textContent = "";

  let created;
  try {
    const headers = { "Content-Type": "application/json" };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch("v1/streams", {
      method: "POST",
      headers,
      body: JSON.stringify({ prompt: turn.prompt, ...requestExtras }),
      signal: s.controller.signal,
    });
    const body = await response.json().catch(() => ({}));
    if (response.status === 401) {
      setApiKey(""); // a refused key is not kept
      const why = key ? "That API key was not accepted; enter another." : "";
      return needKey(s, why || "This server needs an API key.");
    }
    if (!response.ok) {
      const message = body?.error?.message || `${response.status} ${response.statusText}`;
      return fail(s, message);
    }
    created = body;
  } catch (err) {
    if (s.finished) return; // stopped while the request was in flight
    return fail(s, `Could not reach the server (${err.message || err}).`);
  }
  s.id = created.id;
  s.token = created.resume_token;
  s.cancelUrl = created.cancel_url || `v1/streams/${encodeURIComponent(s.id)}/cancel`;
  if (s.finished) return sendCancel(s); // Stop pressed before the stream existed

  const source = new EventSource(new URL(created.events_url, location.href));
  s.source = source;
  source.addEventListener("open", () => onOpen(s));
  source.addEventListener("message", (e) => onMessage(s, e));
  source.addEventListener("meta", (e) => onMeta(s, e));
  source.addEventListener("error", (e) => onError(s, e));
  setTurnState(turn, "streaming");
  setState("streaming", "Waiting for the first token…");
}

function onOpen(s) {
  // A (re)connection was accepted: EventSource sent Last-Event-ID, so no gap, no repeat.
  s.lostAt = 0;
  clearTimeout(s.giveUpTimer);
  if (s.finished) return;
  setTurnState(s.turn, "streaming");
  setState("streaming", s.received ? "Streaming" : "Waiting for the first token…");
}

function onMessage(s, e) {
  if (s.finished) return;
  if (e.data === "[DONE]") return finish(s, "done");
  // Belt and braces against a replayed event after a reconnect.
  if (e.lastEventId !== "") {
    const seq = Number(e.lastEventId);
    if (Number.isFinite(seq)) {
      if (seq <= s.lastSeq) return;
      s.lastSeq = seq;
    }
  }
  let payload;
  try {
    payload = JSON.parse(e.data);
  } catch {
    return;
  }
  if (typeof payload.token !== "string") return;
  const now = performance.now();
  if (!s.firstAt) {
    s.firstAt = now;
    setState("streaming", "Streaming");
  }
  s.lastAt = now;
  s.received += 1;
  s.pending += payload.token;
  schedule(s);
}

function onMeta(s, e) {
  try {
    Object.assign(s.meta, JSON.parse(e.data));
  } catch {
    return;
  }
  schedule(s);
}

function onError(s, e) {
  if (s.finished) return;
  // A server-sent `event: error` arrives as a MessageEvent with data; a connection
  // problem is a plain Event. Both use the same event type.
  if (e instanceof MessageEvent && e.data) {
    let message = e.data;
    try {
      const body = JSON.parse(e.data);
      message = body?.error?.message || body?.error?.code || message;
    } catch {
      // not JSON: show the raw text
    }
    return fail(s, message);
  }
  if (s.source.readyState === EventSource.CLOSED) {
    // The server refused the resume (e.g. 404 for a stream it no longer knows).
    return interrupt(s);
  }
  // EventSource is reconnecting on its own; give it GIVE_UP_MS in total.
  if (!s.lostAt) {
    s.lostAt = performance.now();
    s.giveUpTimer = setTimeout(() => {
      if (s.lostAt) interrupt(s);
    }, GIVE_UP_MS);
  }
  setTurnState(s.turn, "reconnecting");
  setState("reconnecting", "Connection lost, resuming…");
}

// ---- rendering ----------------------------------------------------------------------------

function schedule(s) {
  if (!s.frame) s.frame = requestAnimationFrame(() => flush(s));
}

function flush(s) {
  cancelAnimationFrame(s.frame);
  s.frame = 0;
  if (s.pending) {
    const follow = atBottom();
    s.text.appendData(s.pending);
    s.pending = "";
    if (follow) scrollToBottom();
  }
  if (active === s) renderStats(s);
}

function renderStats(s) {
  const parts = [];
  const ttft = s.meta.ttft_ms ?? (s.firstAt ? s.firstAt - s.sentAt : null);
  if (ttft != null) parts.push(`TTFT ${Math.round(ttft)} ms`);
  let speed = s.meta.speed;
  if (typeof speed !== "number" && s.received > 1 && s.lastAt > s.firstAt) {
    speed = ((s.received - 1) * 1000) / (s.lastAt - s.firstAt);
  }
  if (typeof speed === "number") parts.push(`${speed.toFixed(1)} tok/s`);
  const tokens = Math.max(s.received, Number(s.meta.tokens) || 0);
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  statsText.textContent = parts.join(" · ");
}

function setState(state, text) {
  statusLine.dataset.state = state;
  if (stateText.textContent !== text) stateText.textContent = text;
}

function setBusy(busy) {
  sendButton.disabled = busy;
  stopButton.disabled = !busy;
}

// ---- endings ------------------------------------------------------------------------------

function end(s, state) {
  s.finished = true;
  clearTimeout(s.giveUpTimer);
  if (s.source) s.source.close();
  flush(s);
  setTurnState(s.turn, state);
  if (active === s) {
    active = null;
    setBusy(false);
  }
}

function finish(s, state) {
  end(s, state);
  const reason = s.meta.finish_reason === "length" ? " (reached max tokens)" : "";
  setState(state, `Done${reason}`);
}

function fail(s, message) {
  end(s, "error");
  showNotice(s.turn, "error", `Error: ${message}`);
  setState("error", "Error");
}

function needKey(s, message) {
  end(s, "needs-key");
  showKeyPrompt(s.turn, message);
  setState("needs-key", "API key needed");
}

function interrupt(s) {
  end(s, "interrupted");
  showNotice(s.turn, "interrupted", "Response interrupted.");
  setState("interrupted", "Response interrupted");
}

function stop(s) {
  if (s.finished) return;
  s.controller.abort();
  end(s, "stopped");
  showNotice(s.turn, "stopped", "Stopped.");
  setState("stopped", "Stopped");
  if (s.id) sendCancel(s);
}

function sendCancel(s) {
  // Closing the EventSource alone would leave the server generating for its resume grace.
  return fetch(new URL(s.cancelUrl, location.href), {
    method: "POST",
    headers: { Authorization: `Bearer ${s.token}` },
    keepalive: true,
  }).catch(() => {});
}

// ---- input --------------------------------------------------------------------------------

form.addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = promptBox.value.trim();
  if (!prompt || active) return;
  promptBox.value = "";
  promptBox.focus(); // Send is disabled while streaming; keep keyboard focus useful
  start(addTurn(prompt));
});

promptBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    form.requestSubmit();
  }
});

stopButton.addEventListener("click", () => {
  if (active) stop(active);
  promptBox.focus();
});

document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && active) {
    e.preventDefault();
    stop(active);
    promptBox.focus();
  }
});

// Leaving the page: tell the server so it does not keep generating for nobody.
addEventListener("pagehide", () => {
  if (active) stop(active);
});
