// firsttoken chat page: one prompt at a time, streamed over the native SSE API.
// No framework, no build step. Text is batched per animation frame and handed to a streaming
// Markdown renderer (markdown.js) that renders only the last open block: the cost per frame
// is the new text, never the whole answer. Reasoning shows folded under "Thinking…", tool
// calls as cards whose arguments grow as they stream.

import { MarkdownStream } from "./markdown.js";

const GIVE_UP_MS = 5000; // without a working connection this long, the answer is interrupted
// The API key, when the server wants one: sessionStorage keeps it for this tab only, gone
// when the tab closes, never shared with other tabs or written to disk like localStorage.
const KEY_STORAGE = "firsttoken.apiKey";
// Error codes that, on a Retry's resume, mean the server no longer has the whole answer.
const GONE = new Set(["stream_not_found", "resume_expired", "stream_abandoned"]);

const $ = (id) => document.getElementById(id);
const log = $("log");
const form = $("composer");
const promptBox = $("prompt");
const sendButton = $("send");
const stopButton = $("stop");
const statusLine = $("status");
const stateText = $("state");
const statsText = $("stats");
const options = {
  style: $("opt-style"),
  reasoning: $("opt-reasoning"),
  tool: $("opt-tool"),
  toolArgs: $("opt-tool-args"),
};

const params = new URLSearchParams(location.search);
const requestExtras = readExtras(params);
// ?perf=1: every render call's time, for tests and curious readers (window.renderTimings).
const timings = params.has("perf") ? (window.renderTimings = []) : null;
let active = null; // the stream being shown, or null

// Optional request fields from the page URL (e.g. /?max_tokens=50&itl_ms=40&fail_after=10):
// handy for demos and tests of the synthetic engine's timing and fault injection. The
// style, reasoning and tool-call knobs fill the Options panel, which has the last word.
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
  for (const name of ["ttft_ms", "itl_ms", "fail_after", "answer_tokens"]) {
    if (int(name) !== undefined) synthetic[name] = int(name);
  }
  if (params.get("error_code")) synthetic.error_code = params.get("error_code");
  if (Object.keys(synthetic).length) extras.synthetic = synthetic;
  if (["prose", "markdown", "hostile"].includes(params.get("style"))) {
    options.style.value = params.get("style");
  }
  if (int("reasoning_tokens") !== undefined) options.reasoning.value = int("reasoning_tokens");
  if (params.get("tool")) options.tool.value = params.get("tool");
  if (params.get("tool_args")) options.toolArgs.value = params.get("tool_args");
  return extras;
}

// The request body for a prompt: URL extras, then the Options panel.
function requestBody(prompt) {
  const synthetic = { ...requestExtras.synthetic };
  if (options.style.value) synthetic.style = options.style.value;
  const reasoning = options.reasoning.value.trim();
  if (/^\d+$/.test(reasoning) && Number(reasoning) > 0) {
    synthetic.reasoning_tokens = Number(reasoning);
  }
  const tool = options.tool.value.trim();
  if (tool) {
    let args = {};
    try {
      args = JSON.parse(options.toolArgs.value.trim() || "{}");
    } catch {
      args = { input: options.toolArgs.value };
    }
    synthetic.tool_call = { name: tool, arguments: args };
  }
  const body = { prompt, ...requestExtras };
  if (Object.keys(synthetic).length) body.synthetic = synthetic;
  else delete body.synthetic;
  return body;
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
  const tools = document.createElement("div");
  tools.className = "tools";
  const note = document.createElement("p");
  note.className = "retry-note";
  note.setAttribute("role", "status");
  note.hidden = true;
  const notice = document.createElement("div");
  notice.className = "notice";
  notice.hidden = true;
  turn.append(question, answer, tools, note, notice);
  log.append(turn);
  scrollToBottom();
  return {
    element: turn,
    prompt,
    body: requestBody(prompt),
    answer,
    tools,
    note,
    notice,
    stream: null,
  };
}

function setTurnState(turn, state) {
  turn.element.dataset.state = state;
}

// After a Retry: say whether the answer went on where it stopped or started over.
function showRetryNote(turn, outcome, message) {
  turn.element.dataset.retry = outcome;
  turn.note.textContent = message;
  turn.note.hidden = false;
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
      const s = turn.stream;
      // Interrupted: the server may still have the answer, so go on from the last event seen.
      if (kind === "interrupted" && s?.eventsUrl) resume(s);
      else start(turn);
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

function newStream(turn) {
  return {
    turn,
    id: null,
    token: null,
    eventsUrl: null,
    cancelUrl: null,
    source: null,
    controller: new AbortController(),
    md: null,
    pending: "",
    pendingTokens: 0,
    reasoning: "",
    thinking: null, // {box, summary, body}
    thinkStart: 0,
    thinkEnd: 0,
    toolFragments: [],
    tools: new Map(), // index -> {card, args, text}
    frame: 0,
    lastSeq: 0,
    received: 0,
    sentAt: performance.now(),
    firstAt: 0,
    lastAt: 0,
    meta: {},
    lostAt: 0,
    giveUpTimer: 0,
    resuming: false,
    finished: false,
  };
}

// A new answer for the turn (its first, or after Retry when the old one cannot go on).
async function start(turn) {
  const s = newStream(turn);
  turn.stream = s;
  active = s;
  turn.answer.replaceChildren();
  turn.tools.replaceChildren();
  turn.element.querySelector(".thinking")?.remove();
  const md = new MarkdownStream(turn.answer);
  s.md = md;
  // The answer's text as the model wrote it (tests compare it with the server's tokens).
  Object.defineProperty(turn.answer, "rawText", { get: () => md.text, configurable: true });
  turn.notice.hidden = true;
  turn.note.hidden = true;
  delete turn.element.dataset.retry;
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
      body: JSON.stringify(turn.body),
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
  s.eventsUrl = created.events_url;
  s.cancelUrl = created.cancel_url || `v1/streams/${encodeURIComponent(s.id)}/cancel`;
  if (s.finished) return sendCancel(s); // Stop pressed before the stream existed
  listen(s, new URL(s.eventsUrl, location.href));
  setState("streaming", "Waiting for the first token…");
}

// Retry after an interruption: the same stream from the last event seen, appended to the
// same answer, if the server still has it; otherwise (onError) a new answer.
function resume(s) {
  const { turn } = s;
  s.finished = false;
  s.resuming = true;
  s.lostAt = 0;
  s.controller = new AbortController();
  active = s;
  turn.notice.hidden = true;
  turn.note.hidden = true;
  setTurnState(turn, "resuming");
  setBusy(true);
  setState("reconnecting", "Resuming…");
  const url = new URL(s.eventsUrl, location.href);
  if (s.lastSeq > 0) url.searchParams.set("last_event_id", String(s.lastSeq));
  listen(s, url);
}

function startOver(s) {
  end(s, "restarting");
  start(s.turn);
  showRetryNote(
    s.turn,
    "restarted",
    "Started over: the server no longer had the interrupted answer.",
  );
}

function listen(s, url) {
  const source = new EventSource(url);
  s.source = source;
  source.addEventListener("open", () => onOpen(s));
  source.addEventListener("message", (e) => onMessage(s, e));
  source.addEventListener("meta", (e) => onMeta(s, e));
  source.addEventListener("error", (e) => onError(s, e));
  setTurnState(s.turn, "streaming");
}

function onOpen(s) {
  // A (re)connection was accepted: EventSource sent Last-Event-ID, so no gap, no repeat.
  s.lostAt = 0;
  clearTimeout(s.giveUpTimer);
  if (s.finished) return;
  if (s.resuming) {
    s.resuming = false;
    showRetryNote(s.turn, "resumed", "Resumed where the answer was interrupted.");
  }
  setTurnState(s.turn, "streaming");
  setState("streaming", s.received ? "Streaming" : "Waiting for the first token…");
}

// Belt and braces against a replayed event after a reconnect: true when already seen.
function seen(s, e) {
  if (e.lastEventId === "") return false;
  const seq = Number(e.lastEventId);
  if (!Number.isFinite(seq)) return false;
  if (seq <= s.lastSeq) return true;
  s.lastSeq = seq;
  return false;
}

function onMessage(s, e) {
  if (s.finished) return;
  if (e.data === "[DONE]") return finish(s, "done");
  if (seen(s, e)) return;
  let payload;
  try {
    payload = JSON.parse(e.data);
  } catch {
    return;
  }
  const now = performance.now();
  if (typeof payload.token === "string") {
    s.pending += payload.token;
    s.pendingTokens += 1;
    if (s.thinkStart && !s.thinkEnd) s.thinkEnd = now;
  } else if (typeof payload.reasoning === "string") {
    s.reasoning += payload.reasoning;
    if (!s.thinkStart) s.thinkStart = now;
  } else if (payload.tool_call && typeof payload.tool_call === "object") {
    s.toolFragments.push(payload.tool_call);
    if (s.thinkStart && !s.thinkEnd) s.thinkEnd = now;
  } else {
    return;
  }
  if (!s.firstAt) {
    s.firstAt = now;
    setState("streaming", "Streaming");
  }
  s.lastAt = now;
  s.received += 1;
  schedule(s);
}

function onMeta(s, e) {
  if (seen(s, e)) return;
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
    let code = "";
    try {
      const body = JSON.parse(e.data);
      code = body?.error?.code || "";
      message = body?.error?.message || code || message;
    } catch {
      // not JSON: show the raw text
    }
    if (s.retried && GONE.has(code)) return startOver(s);
    return fail(s, message);
  }
  if (s.source.readyState === EventSource.CLOSED) {
    // The server refused: a Retry's resume (404 for a stream it no longer knows) starts
    // over; a reconnect mid-answer leaves the answer interrupted, for Retry to decide.
    return s.resuming ? startOver(s) : interrupt(s);
  }
  // EventSource is reconnecting on its own; give it GIVE_UP_MS in total.
  if (!s.lostAt) {
    s.lostAt = performance.now();
    s.giveUpTimer = setTimeout(() => {
      if (s.lostAt) interrupt(s);
    }, GIVE_UP_MS);
  }
  setTurnState(s.turn, "reconnecting");
  setState("reconnecting", s.resuming ? "Resuming…" : "Connection lost, resuming…");
}

// ---- rendering ----------------------------------------------------------------------------

function schedule(s) {
  if (!s.frame) s.frame = requestAnimationFrame(() => flush(s));
}

function flush(s) {
  cancelAnimationFrame(s.frame);
  s.frame = 0;
  const follow = atBottom();
  if (s.reasoning) {
    thinking(s).body.append(s.reasoning); // a text node per frame: never copies what is there
    s.reasoning = "";
  }
  if (s.thinking) renderThinking(s);
  for (const fragment of s.toolFragments) toolCall(s, fragment);
  s.toolFragments = [];
  if (s.pending) {
    const t0 = performance.now();
    s.md.append(s.pending);
    if (timings) {
      timings.push({ tokens: s.received, n: s.pendingTokens, ms: performance.now() - t0 });
    }
    s.pending = "";
    s.pendingTokens = 0;
  }
  if (follow) scrollToBottom();
  if (active === s) renderStats(s);
}

// The reasoning, folded: "Thinking…" while it streams, "Thought for 1.2 s" after.
function thinking(s) {
  if (!s.thinking) {
    const box = document.createElement("details");
    box.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = "Thinking…";
    const body = document.createElement("div");
    body.className = "reasoning";
    box.append(summary, body);
    s.turn.answer.before(box);
    s.thinking = { box, summary, body };
  }
  return s.thinking;
}

function renderThinking(s) {
  const { box, summary } = s.thinking;
  if (!s.thinkEnd || box.dataset.done) return;
  const seconds = Math.max(0, s.thinkEnd - s.thinkStart) / 1000;
  summary.textContent = `Thought for ${seconds.toFixed(1)} s`;
  box.dataset.done = "true";
  box.dataset.seconds = seconds.toFixed(3);
}

// A tool call: a card with its name, and its arguments as they stream.
function toolCall(s, fragment) {
  const index = Number.isInteger(fragment.index) ? fragment.index : 0;
  let call = s.tools.get(index);
  if (!call) {
    const card = document.createElement("section");
    card.className = "tool-call";
    const head = document.createElement("div");
    head.className = "tool-head";
    const label = document.createElement("span");
    label.className = "tool-label";
    label.textContent = "Tool call";
    const name = document.createElement("code");
    name.className = "tool-name";
    const args = document.createElement("pre");
    args.className = "tool-args";
    head.append(label, " ", name);
    card.append(head, args);
    s.turn.tools.append(card);
    call = { card, name, args, text: "" };
    s.tools.set(index, call);
  }
  if (typeof fragment.name === "string" && fragment.name) call.name.textContent = fragment.name;
  if (typeof fragment.id === "string") call.card.dataset.callId = fragment.id;
  if (typeof fragment.arguments === "string" && fragment.arguments) {
    call.text += fragment.arguments;
    call.args.append(fragment.arguments);
  }
}

// Once the call is complete its arguments are shown pretty-printed (or as sent, if not JSON).
function completeToolCalls(s) {
  for (const call of s.tools.values()) {
    try {
      call.args.textContent = JSON.stringify(JSON.parse(call.text), null, 2);
    } catch {
      // not JSON after all: leave the text as it came
    }
    call.card.dataset.complete = "true";
  }
}

function renderStats(s) {
  const parts = [];
  // The server's meta events carry no TTFT: the page measures it, from Send to the first token.
  const ttft = s.firstAt ? s.firstAt - s.sentAt : null;
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

// `final`: the answer will get no more text, so the renderer closes its last block.
function end(s, state, final = true) {
  s.finished = true;
  clearTimeout(s.giveUpTimer);
  if (s.source) s.source.close();
  if (s.thinkStart && !s.thinkEnd && final) s.thinkEnd = performance.now();
  flush(s);
  if (final) {
    s.md?.end();
    completeToolCalls(s);
  }
  setTurnState(s.turn, state);
  if (active === s) {
    active = null;
    setBusy(false);
  }
}

function finish(s, state) {
  end(s, state);
  const reason =
    s.meta.finish_reason === "length"
      ? " (reached max tokens)"
      : s.meta.finish_reason === "tool_calls"
        ? " (tool call)"
        : "";
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
  end(s, "interrupted", false);
  s.retried = true; // the next error on this stream comes after a Retry
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
