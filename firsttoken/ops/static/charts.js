// Time-series charts on a canvas: lines over the last 15 minutes, a dashed threshold,
// nice y ticks. No library. A chart redraws whole on each update (one snapshot a second),
// inside requestAnimationFrame, so nothing in between is ever shown: no flicker.
'use strict';

const PALETTE = ['#2f6fdb', '#d1495b', '#2a9d8f', '#e9a03b', '#7b5ea7', '#6c757d', '#3fa34d', '#c2185b'];
const WINDOW_S = 900;

function niceStep(span, ticks) {
  const raw = span / Math.max(1, ticks);
  const mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

class TimeChart {
  // series: [{key, label, color?}] or a function of the points giving them (by route…)
  constructor(canvas, legend, { series, format = (v) => String(v), threshold = null, thresholdLabel = '' }) {
    this.canvas = canvas;
    this.legend = legend;
    this.series = series;
    this.format = format;
    this.threshold = threshold;
    this.thresholdLabel = thresholdLabel;
    this.points = [];
    this.legendKeys = '';
    this.pending = false;
    new ResizeObserver(() => this.schedule()).observe(canvas);
  }

  setPoints(points) { this.points = points; this.schedule(); }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  currentSeries() {
    const list = typeof this.series === 'function' ? this.series(this.points) : this.series;
    return list.map((s, i) => ({ color: PALETTE[i % PALETTE.length], ...s }));
  }

  updateLegend(series) {
    const keys = series.map((s) => s.label + s.color).join('|') + this.thresholdLabel;
    if (keys === this.legendKeys) return; // unchanged: the DOM is left alone
    this.legendKeys = keys;
    const items = series.map((s) => {
      const span = document.createElement('span');
      const swatch = document.createElement('i');
      swatch.style.background = s.color;
      span.append(swatch, document.createTextNode(s.label));
      return span;
    });
    if (this.thresholdLabel) {
      const span = document.createElement('span');
      span.textContent = '- - ' + this.thresholdLabel;
      items.push(span);
    }
    this.legend.replaceChildren(...items);
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const muted = style.getPropertyValue('--muted').trim() || '#888';
    const line = style.getPropertyValue('--line').trim() || '#ddd';
    const bad = style.getPropertyValue('--bad').trim() || '#c00';
    const series = this.currentSeries();
    this.updateLegend(series);

    const points = this.points;
    const end = points.length ? points[points.length - 1].ts : Date.now() / 1000;
    const start = end - WINDOW_S;
    let top = this.threshold ?? 0;
    for (const p of points) for (const s of series) {
      const v = s.value ? s.value(p) : p[s.key];
      if (typeof v === 'number' && v > top) top = v;
    }
    if (top <= 0) top = 1;
    const step = niceStep(top, 4);
    top = Math.ceil(top / step) * step;
    ctx.font = '11px system-ui, sans-serif';
    const labelWidth = Math.max(...[0, 1, 2, 3, 4].map((i) => ctx.measureText(this.format(i * step)).width));
    const left = Math.ceil(labelWidth) + 8, right = 6, upper = 6, lower = 16;
    const w = width - left - right, h = height - upper - lower;
    const x = (ts) => left + ((ts - start) / WINDOW_S) * w;
    const y = (v) => upper + h - (v / top) * h;

    ctx.strokeStyle = line; ctx.fillStyle = muted; ctx.lineWidth = 1;
    ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    for (let v = 0; v <= top + step / 2; v += step) {
      const py = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, py); ctx.lineTo(left + w, py); ctx.stroke();
      ctx.fillText(this.format(v), left - 4, py);
    }
    ctx.textAlign = 'center'; ctx.textBaseline = 'top';
    for (let m = 15; m >= 0; m -= 5) {
      ctx.fillText(m ? `-${m} min` : 'now', Math.min(left + w - 12, x(end - m * 60)), upper + h + 3);
    }
    if (this.threshold !== null) {
      ctx.save();
      ctx.strokeStyle = bad; ctx.setLineDash([5, 4]);
      const py = Math.round(y(this.threshold)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, py); ctx.lineTo(left + w, py); ctx.stroke();
      ctx.restore();
    }
    ctx.lineWidth = 1.6; ctx.lineJoin = 'round';
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let drawing = false;
      for (const p of points) {
        if (p.ts < start) continue;
        const v = s.value ? s.value(p) : p[s.key];
        if (typeof v !== 'number') { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(p.ts), y(v)); else ctx.moveTo(x(p.ts), y(v));
        drawing = true;
      }
      ctx.stroke();
    }
  }
}

window.TimeChart = TimeChart;
