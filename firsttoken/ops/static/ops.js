// The operator's page: one EventSource on /v1/admin/events (docs/ops.md). Every snapshot
// updates the page in place (text nodes changed only where the value changed, rows kept by
// name), so nothing flickers; the charts redraw on their canvas once per snapshot.
'use strict';

const state = { snapshots: 0, last: null, points: [], connected: false, events: 0 };
window.opsState = state; // for tests and the curious

const MAX_POINTS = 900;
const MAX_EVENTS = 60;
const $ = (selector, root = document) => root.querySelector(selector);

// ---- formatting ------------------------------------------------------------------------------

const ms = (s) => (s === null || s === undefined ? '–' : s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`);
const pct = (r) => (r === null || r === undefined ? '–' : `${(r * 100).toFixed(r > 0.999 ? 2 : 1)} %`);
const num = (n, digits = 1) =>
  n === null || n === undefined ? '–' : Number.isInteger(n) || Math.abs(n) >= 1000 ? Math.round(n).toLocaleString('en-US') : n.toFixed(digits);
const clock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function setClass(node, name, on) {
  if (node.classList.contains(name) !== on) node.classList.toggle(name, on);
}

// Rows of a table kept by name: a new name adds a row, a gone name removes it, the others
// only have their cells' text updated.
function syncRows(tbody, entries, columns, key = 'name') {
  const seen = new Set();
  let previous = null;
  for (const [name, row] of entries) {
    seen.add(name);
    let tr = tbody.querySelector(`tr[data-${key}="${CSS.escape(name)}"]`);
    if (!tr) {
      tr = document.createElement('tr');
      tr.dataset[key] = name;
      for (const column of columns) {
        const td = document.createElement('td');
        td.dataset.field = column.field;
        if (column.num) td.className = 'num';
        tr.append(td);
      }
    }
    const wanted = previous ? previous.nextSibling : tbody.firstChild;
    if (wanted !== tr) tbody.insertBefore(tr, wanted);
    previous = tr;
    columns.forEach((column, i) => column.render(tr.children[i], row, name));
  }
  for (const tr of [...tbody.children]) if (!seen.has(tr.dataset[key])) tr.remove();
}

function meter(td, text, used, limit) {
  let label = td.firstChild, bar = td.querySelector('.meter');
  if (!label || label.nodeType !== Node.TEXT_NODE) {
    td.replaceChildren(document.createTextNode(''));
    label = td.firstChild;
  }
  setText(label, text);
  if (limit) {
    if (!bar) {
      bar = document.createElement('span');
      bar.className = 'meter';
      bar.append(document.createElement('b'));
      td.append(bar);
    }
    const share = Math.min(1, used / limit);
    bar.firstChild.style.width = `${(share * 100).toFixed(1)}%`;
    setClass(bar, 'high', share >= 0.8 && share < 1);
    setClass(bar, 'full', share >= 1);
  } else if (bar) bar.remove();
}

// ---- service levels --------------------------------------------------------------------------

const LEVELS = [
  ['ttft_p50', 'TTFT p50', ms],
  ['ttft_p99', 'TTFT p99', ms],
  ['inter_chunk_p50', 'inter-chunk p50', ms],
  ['inter_chunk_p99', 'inter-chunk p99', ms],
  ['inter_chunk_mean', 'inter-chunk mean', ms],
  ['completion', 'completed', pct],
];

function renderLevels(slo) {
  const box = $('#slo .levels');
  for (const [name, title, format] of LEVELS) {
    let card = box.querySelector(`[data-level="${name}"]`);
    if (!card) {
      card = document.createElement('div');
      card.className = 'level';
      card.dataset.level = name;
      const head = document.createElement('div');
      head.className = 'name';
      const label = document.createElement('span');
      label.textContent = title;
      const sign = document.createElement('span');
      sign.className = 'sign';
      head.append(label, sign);
      const now = document.createElement('div');
      now.className = 'now';
      const rest = document.createElement('div');
      rest.className = 'rest';
      card.append(head, now, rest);
      box.append(card);
    }
    const level = slo[name] || {};
    const targeted = level.target !== undefined;
    setClass(card, 'untargeted', !targeted);
    setClass(card, 'broken', !!level.broken);
    card.dataset.broken = level.broken ? 'true' : 'false';
    setText($('.sign', card), level.broken ? '⚠ BROKEN' : '');
    setText($('.now', card), format(level.now));
    const target = targeted ? ` · target ${name === 'completion' ? '≥' : '<'} ${format(level.target)}` : '';
    setText($('.rest', card), `15 min ${format(level['15m'])}${target}`);
  }
}

// ---- sections --------------------------------------------------------------------------------

function renderTraffic(traffic) {
  setText(
    $('#traffic .totals'),
    `${traffic.active} active · ${num(traffic.new_per_s)} new/s · ` +
      `${num(traffic.tokens_generated_per_s, 0)} tokens/s generated, ${num(traffic.tokens_sent_per_s, 0)} delivered, ` +
      `${num(traffic.tokens_undelivered_per_s, 0)} never delivered`,
  );
  syncRows($('#traffic tbody'), Object.entries(traffic.routes), [
    { field: 'route', render: (td, r, name) => setText(td, name) },
    { field: 'active', num: true, render: (td, r) => setText(td, String(r.active)) },
    { field: 'new_per_s', num: true, render: (td, r) => setText(td, num(r.new_per_s)) },
    { field: 'handoffs_per_min', num: true, render: (td, r) => setText(td, num(r.handoffs_per_min)) },
  ]);
}

function renderTargets(targets) {
  syncRows($('#targets tbody'), Object.entries(targets), [
    { field: 'target', render: (td, t, name) => setText(td, name) },
    {
      field: 'state',
      render: (td, t) => {
        setText(td, t.up ? 'up' : t.probe_in_s ? `ejected · probe in ${Math.ceil(t.probe_in_s)} s` : 'ejected · next request probes');
        setClass(td, 'up', t.up);
        setClass(td, 'down', !t.up);
        td.dataset.up = t.up ? 'true' : 'false';
      },
    },
    {
      field: 'in_flight',
      render: (td, t) => meter(td, t.max_concurrency ? `${t.in_flight} / ${t.max_concurrency}` : String(t.in_flight), t.in_flight, t.max_concurrency),
    },
    { field: 'queue', num: true, render: (td, t) => { setText(td, String(t.queue)); setClass(td, 'warn', t.queue > 0); } },
    { field: 'queue_wait_s', num: true, render: (td, t) => setText(td, ms(t.queue_wait_s)) },
    { field: 'failovers_per_min', num: true, render: (td, t) => setText(td, num(t.failovers_per_min)) },
    { field: 'splices_per_min', num: true, render: (td, t) => setText(td, num(t.splices_per_min)) },
    { field: 'handoffs_per_min', num: true, render: (td, t) => setText(td, num(t.handoffs_per_min)) },
    { field: 'first_token_s', num: true, render: (td, t) => setText(td, ms(t.first_token_s)) },
  ]);
}

function renderKeys(keys) {
  const entries = Object.entries(keys);
  const spend = entries.some(([, k]) => k.spend !== undefined);
  for (const th of document.querySelectorAll('#keys th.spend')) th.hidden = !spend;
  syncRows($('#keys tbody'), entries, [
    { field: 'key', render: (td, k, name) => setText(td, name) },
    {
      field: 'streams',
      render: (td, k) => meter(td, k.max_streams ? `${k.active} / ${k.max_streams}` : String(k.active), k.active, k.max_streams),
    },
    {
      field: 'tokens_per_min',
      render: (td, k) =>
        meter(td, k.tokens_per_min_limit ? `${num(k.tokens_per_min, 0)} / ${num(k.tokens_per_min_limit)}` : num(k.tokens_per_min, 0), k.tokens_per_min, k.tokens_per_min_limit),
    },
    {
      field: 'spend',
      num: true,
      render: (td, k) => {
        td.hidden = !spend;
        td.className = 'num spend';
        // Since this process started; a budget's own period is shown beside it.
        const since = k.spend === undefined ? '' : `${k.spend.toFixed(4)} (+${k.spend_per_min.toFixed(4)}/min)`;
        const b = k.budget;
        setText(td, b ? `${since} · budget ${b.spent.toFixed(4)} / ${b.amount.toFixed(4)} per ${b.per}` : since);
      },
    },
  ]);
}

function renderErrors(errors) {
  const rows = errors.slice().reverse().map((e, i) => [`${e.ts}-${e.trace_id || e.stream || i}`, e]);
  syncRows($('#errors tbody'), rows, [
    { field: 'time', render: (td, e) => setText(td, clock(e.ts)) },
    { field: 'code', render: (td, e) => setText(td, e.code || '') },
    { field: 'route', render: (td, e) => setText(td, e.route || '–') },
    { field: 'target', render: (td, e) => setText(td, e.target || '–') },
    { field: 'key', render: (td, e) => setText(td, e.key || '–') },
    { field: 'trace_id', render: (td, e) => setText(td, e.trace_id || '–') },
  ], 'error');
}

function renderProtection(snapshot) {
  const dl = $('#protection dl');
  const shedding = Object.entries(snapshot.shedding).filter(([, on]) => on).map(([r]) => r);
  const deps = snapshot.deps;
  const rows = [
    ['breaker', snapshot.breaker, snapshot.breaker === 'closed' ? 'up' : 'down'],
    ['shedding', shedding.length ? `yes: ${shedding.join(', ')}` : 'no', shedding.length ? 'down' : 'up'],
    ['Redis', deps.redis ?? 'not configured', deps.redis === 'away' ? 'down' : deps.redis ? 'up' : ''],
    ['OpenTelemetry', deps.otel ?? 'not configured', deps.otel === 'away' ? 'down' : deps.otel ? 'up' : ''],
    ['ledger', deps.ledger ?? 'not configured', deps.ledger === 'away' ? 'down' : deps.ledger ? 'up' : ''],
    ['workers', String(snapshot.workers), ''],
  ];
  if (dl.children.length !== rows.length * 2) {
    dl.replaceChildren(...rows.flatMap(([name]) => {
      const dt = document.createElement('dt');
      dt.textContent = name;
      const dd = document.createElement('dd');
      dd.dataset.field = name.toLowerCase();
      return [dt, dd];
    }));
  }
  rows.forEach(([, value, kind], i) => {
    const dd = dl.children[i * 2 + 1];
    setText(dd, value);
    setClass(dd, 'up', kind === 'up');
    setClass(dd, 'down', kind === 'down');
  });
}

function addEvent(kind, data) {
  const list = $('#events ol');
  const li = document.createElement('li');
  const { ts, level, event, ...rest } = data;
  li.className = level || (kind === 'change' && /ejected|away|open/.test(JSON.stringify(rest)) ? 'warning' : '');
  li.dataset.kind = kind;
  const what = event || rest.kind;
  if (kind === 'change') delete rest.kind;
  li.textContent = `${clock(ts || Date.now() / 1000)} ${what} ${JSON.stringify(rest)}`;
  list.prepend(li);
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  state.events += 1;
}

// ---- charts ----------------------------------------------------------------------------------

function keysOf(points, field) {
  const names = new Set();
  for (const p of points) for (const name of Object.keys(p[field] || {})) names.add(name);
  return [...names].sort();
}

const charts = {};

function makeCharts() {
  const chart = (id, options) => {
    const canvas = document.getElementById(id);
    return new window.TimeChart(canvas, canvas.nextElementSibling, options);
  };
  charts.ttft = chart('chart-ttft', {
    series: [{ key: 'ttft_p50', label: 'p50' }, { key: 'ttft_p99', label: 'p99' }],
    format: ms, threshold: 0.3, thresholdLabel: 'p99 target 300 ms',
  });
  charts.itl = chart('chart-itl', {
    series: [{ key: 'itl_p50', label: 'p50' }, { key: 'itl_p99', label: 'p99' }],
    format: ms, threshold: 0.08, thresholdLabel: 'mean target 80 ms',
  });
  const byName = (field) => (points) => keysOf(points, field).map((name) => ({ label: name, value: (p) => (p[field] || {})[name] ?? null }));
  charts.active = chart('chart-active', { series: byName('active'), format: (v) => num(v, 0) });
  charts.newStreams = chart('chart-new', { series: byName('new_per_s'), format: (v) => num(v, 1) });
  charts.tokens = chart('chart-tokens', {
    series: [
      { key: 'generated_per_s', label: 'generated' },
      { key: 'sent_per_s', label: 'delivered' },
      { key: 'undelivered_per_s', label: 'never delivered' },
    ],
    format: (v) => num(v, 0),
  });
  charts.targets = chart('chart-targets', {
    series: (points) => [
      ...keysOf(points, 'in_flight').map((name) => ({ label: `${name} in flight`, value: (p) => (p.in_flight || {})[name] ?? null })),
      ...keysOf(points, 'queued').map((name) => ({ label: `${name} queued`, value: (p) => (p.queued || {})[name] ?? null })),
    ],
    format: (v) => num(v, 0),
  });
}

function redrawCharts() {
  for (const chart of Object.values(charts)) chart.setPoints(state.points);
}

// ---- the feed --------------------------------------------------------------------------------

function status(text, stateName) {
  const node = $('#status');
  setText(node, text);
  node.dataset.state = stateName;
}

function connect() {
  const source = new EventSource('/v1/admin/events');
  source.addEventListener('open', () => {
    state.connected = true;
    status('live', 'live');
  });
  source.addEventListener('error', () => {
    // EventSource reconnects by itself (the feed says `retry: 1000`): a restarted gateway
    // is back on the page within a second of answering again.
    state.connected = false;
    status('connection lost, reconnecting…', 'reconnecting');
  });
  source.addEventListener('history', (e) => {
    state.points = JSON.parse(e.data); // the server's 15 minutes replace what we had
    redrawCharts();
  });
  source.addEventListener('snapshot', (e) => {
    const snapshot = JSON.parse(e.data);
    state.last = snapshot;
    state.snapshots += 1;
    const last = state.points[state.points.length - 1];
    if (!last || last.ts < snapshot.point.ts) state.points.push(snapshot.point);
    if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
    render(snapshot);
  });
  source.addEventListener('change', (e) => addEvent('change', JSON.parse(e.data)));
  source.addEventListener('log', (e) => addEvent('log', JSON.parse(e.data)));
}

function render(snapshot) {
  renderLevels(snapshot.slo);
  renderTraffic(snapshot.traffic);
  renderTargets(snapshot.targets);
  renderKeys(snapshot.keys);
  renderErrors(snapshot.errors);
  renderProtection(snapshot);
  redrawCharts();
  status(`live · ${clock(snapshot.ts)}${snapshot.broken.length ? ` · ${snapshot.broken.length} service level(s) broken` : ''}`, 'live');
  document.title = `${snapshot.broken.length ? '⚠ ' : ''}firsttoken · operations`;
}

makeCharts();
connect();
