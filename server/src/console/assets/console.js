// The zerotrain console's behaviour in the browser: htmx's configuration and each page's
// charts, live log, estimate and buttons. The pages' Content-Security-Policy forbids inline
// script, so everything the console runs is in this file; pages work as tables without it.
'use strict';

document.documentElement.classList.add('js');

if (window.htmx) {
  // htmx would otherwise add an inline <style>, which the CSP refuses.
  htmx.config.includeIndicatorStyles = false;
  htmx.config.allowEval = false;
  htmx.config.allowScriptTags = false;
  htmx.config.historyCacheSize = 0;
}

/** What the browser test inspects: the charts by name. */
const zerotrain = (window.zerotrain = { charts: {} });

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
const CATEGORIES = ['params', 'grads', 'optimizer', 'activations', 'buffers', 'overhead'];
const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#17becf'];

/** Bytes in decimal units, as the server prints them. */
function human(b) {
  if (b == null) return '';
  if (Math.abs(b) < 1000) return b + ' B';
  const units = ['kB', 'MB', 'GB', 'TB', 'PB'];
  let i = -1;
  do {
    b /= 1000;
    i++;
  } while (Math.abs(b) >= 1000 && i < units.length - 1);
  return b.toFixed(Math.abs(b) < 10 ? 2 : Math.abs(b) < 100 ? 1 : 0) + ' ' + units[i];
}

/** A problem+json body as one line. */
function problemText(p) {
  if (!p) return 'no answer';
  return (p.field ? p.field + ': ' : '') + (p.detail || p.title || 'error');
}

/** Calls the JSON API with the session cookie; a 401 sends the browser to the login page. */
async function api(method, path, body) {
  const init = { method, headers: {}, credentials: 'same-origin' };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = typeof body === 'string' ? body : JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const text = await r.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (_) {
    data = { detail: text };
  }
  if (r.status === 401 && document.body.dataset.page !== 'login') {
    location.href = '/login?next=' + encodeURIComponent(location.pathname + location.search);
  }
  return { ok: r.ok, status: r.status, data };
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

// ---- Charts ------------------------------------------------------------------------------

/**
 * A uPlot chart in `container` that keeps the user's zoom across updates: drag to zoom,
 * double-click to go back to following the data.
 */
function chart(name, container, { data, height, ...opts }) {
  let zoomed = false;
  const width = () => Math.max(320, container.clientWidth || 480);
  const u = new uPlot(
    {
      width: width(),
      height: height || 220,
      legend: { live: false },
      cursor: {
        bind: {
          dblclick: (u, target, handler) => (e) => {
            zoomed = false;
            return handler(e);
          },
        },
      },
      hooks: {
        setSelect: [
          (u) => {
            if (u.select.width > 0) zoomed = true;
          },
        ],
      },
      ...opts,
    },
    data,
    container
  );
  zerotrain.charts[name] = u;
  window.addEventListener('resize', () => u.setSize({ width: width(), height: u.height }));
  return {
    u,
    update(data) {
      u.setData(data, !zoomed);
    },
  };
}

/** Thousands as k and millions as M, so tick labels fit their axis. */
function compact(v) {
  if (v == null || !isFinite(v)) return '';
  const a = Math.abs(v);
  if (a >= 1e6) return +(v / 1e6).toPrecision(3) + 'M';
  if (a >= 1e4) return +(v / 1e3).toPrecision(3) + 'k';
  return +v.toPrecision(4);
}

const yAxis = { size: 60, values: (u, splits) => splits.map(compact) };
const stepAxis = { scales: { x: { time: false } }, axes: [{}, yAxis] };

function line(label, color) {
  return { label, stroke: color, width: 2, spanGaps: true };
}

/** A line through the steps that have a value (null elsewhere), each of them marked. */
function sparseLine(label, color) {
  return { ...line(label, color), points: { show: true, size: 7 } };
}

/** The job's steps, one per step number (a later attempt's replacing an earlier one's). */
function lastAttemptSteps(steps) {
  const byStep = new Map();
  for (const s of steps) byStep.set(s.step, s);
  return Array.from(byStep.values()).sort((a, b) => a.step - b.step);
}

/** Stacked bars per rank, measured (m) beside predicted (p), and the device budget line. */
function memoryData(m, worldSize) {
  const n = Math.max(worldSize, m.ranks.length, 1);
  const xs = [];
  const cats = CATEGORIES.map(() => []);
  const budget = [];
  for (let r = 0; r < n; r++) {
    const rec = m.ranks.find((x) => x.rank === r);
    const dev = m.devices.find((d) => d.rank === r);
    const pairs = [rec ? rec.measured : null, rec ? rec.predicted : m.predicted_per_rank_bytes];
    pairs.forEach((b, i) => {
      xs.push(2 * r + i);
      let sum = 0;
      CATEGORIES.forEach((c, k) => {
        sum += b ? b[c] || 0 : 0;
        // The axis is logarithmic: nothing to stack yet is no bar.
        cats[k].push(sum > 0 ? sum : null);
      });
      budget.push(dev ? dev.memory_bytes : null);
    });
  }
  // Drawn top of the stack first, so each lower category paints over the ones above it.
  return { xs, series: [xs, ...cats.reverse(), budget] };
}

function memoryChart(container, m, worldSize) {
  const { series } = memoryData(m, worldSize);
  const bars = uPlot.paths.bars({ size: [0.7, 60] });
  const cats = CATEGORIES.slice().reverse();
  return chart('memory', container, {
    height: 260,
    data: series,
    // Logarithmic, so that megabytes of state show beside a device budget of gigabytes.
    scales: {
      x: { time: false, range: (u) => [-0.6, u.data[0].length - 0.4] },
      y: { distr: 3 },
    },
    axes: [
      {
        splits: (u) => u.data[0],
        values: (u, splits) => splits.map((v) => 'r' + Math.floor(v / 2) + (v % 2 ? ' p' : ' m')),
      },
      { size: 80, values: (u, splits) => splits.map(human) },
    ],
    series: [
      { label: 'rank' },
      ...cats.map((c) => {
        const color = COLORS[CATEGORIES.indexOf(c)];
        return { label: c, stroke: color, fill: color, paths: bars, points: { show: false }, value: (u, v) => human(v) };
      }),
      { label: 'device budget', stroke: '#222', width: 2, dash: [6, 4], points: { show: false }, value: (u, v) => human(v) },
    ],
  });
}

function jobPage() {
  const root = $('#job');
  const id = root.dataset.id;
  const worldSize = Number(root.dataset.worldSize) || 1;
  let charts = null;

  function seriesOf(m) {
    const steps = lastAttemptSteps(m.steps);
    const x = steps.map((s) => s.step);
    return {
      // Only the steps after which validation ran have a validation loss.
      loss: [x, steps.map((s) => s.loss), steps.map((s) => s.validation_loss ?? null)],
      scale: [x, steps.map((s) => s.loss_scale), steps.map((s) => (s.skipped ? s.loss_scale : null))],
      tokens: [x, steps.map((s) => s.tokens_per_second)],
      step: [x, steps.map((s) => s.step_seconds)],
      memory: memoryData(m, worldSize).series,
    };
  }

  function draw(m) {
    const d = seriesOf(m);
    if (!charts) {
      charts = {
        loss: chart('loss', $('#chart-loss'), {
          ...stepAxis,
          data: d.loss,
          series: [{ label: 'step' }, line('loss', COLORS[0]), sparseLine('validation loss', COLORS[1])],
        }),
        scale: chart('scale', $('#chart-scale'), {
          data: d.scale,
          // Padded: a scale that never changes (fp32, or fp16 without overflow) sits inside.
          scales: { x: { time: false }, y: { distr: 3, range: (u, min, max) => (min > 0 ? [min / 4, max * 4] : [1, 10]) } },
          axes: [{}, yAxis],
          series: [
            { label: 'step' },
            line('loss scale', COLORS[1]),
            { label: 'skipped', stroke: '#d62728', fill: '#d62728', paths: () => null, points: { show: true, size: 9 } },
          ],
        }),
        tokens: chart('tokens', $('#chart-tokens'), { ...stepAxis, data: d.tokens, series: [{ label: 'step' }, line('tokens/s', COLORS[2])] }),
        step: chart('step', $('#chart-step'), { ...stepAxis, data: d.step, series: [{ label: 'step' }, line('step time (s)', COLORS[4])] }),
        memory: memoryChart($('#chart-memory'), m, worldSize),
      };
    } else {
      for (const k of Object.keys(charts)) charts[k].update(d[k]);
    }
    root.dataset.steps = String(m.steps.length);
    root.dataset.metricsState = m.state;
  }

  async function poll() {
    const r = await api('GET', `/v1/jobs/${id}/metrics`);
    if (!r.ok) return;
    draw(r.data);
    const live = ['queued', 'scheduled', 'running'].includes(r.data.state);
    if (live) setTimeout(poll, 1000);
  }
  poll();
  followLog(id);

  document.addEventListener('click', async (e) => {
    const b = e.target.closest('#cancel');
    if (!b) return;
    if (!confirm('Cancel this job?')) return;
    b.disabled = true;
    const r = await api('POST', `/v1/jobs/${b.dataset.id}/cancel`);
    if (!r.ok) {
      b.disabled = false;
      alert(problemText(r.data));
    }
  });
}

// ---- Log ---------------------------------------------------------------------------------

const RANK_TAG = /^\[ranks? ([\d,]+)\]/;

function tagLine(span) {
  const m = RANK_TAG.exec(span.textContent);
  if (m) span.dataset.ranks = ',' + m[1] + ',';
}

function filterLog() {
  const rank = $('#log-rank').value;
  for (const s of $$('#log [data-line]')) {
    s.hidden = rank !== '' && s.dataset.ranks !== undefined && !s.dataset.ranks.includes(',' + rank + ',');
  }
}

function followLog(id) {
  const pre = $('#log');
  $$('[data-line]', pre).forEach(tagLine);
  $('#log-rank').addEventListener('change', filterLog);
  const es = new EventSource(`/v1/jobs/${id}/logs?follow=true&after=${pre.dataset.after || 0}`);
  es.addEventListener('log', (e) => {
    const line = JSON.parse(e.data);
    const span = el('span', { 'data-line': '' }, line.line + '\n');
    tagLine(span);
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(span);
    filterLog();
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  });
  es.addEventListener('end', () => es.close());
}

// ---- Jobs --------------------------------------------------------------------------------

function jobsPage() {
  // Polling would replace the rows and drop the boxes ticked for an action.
  document.body.addEventListener('htmx:beforeRequest', (e) => {
    if (e.target.id === 'job-rows' && $$('#job-rows input:checked').length) e.preventDefault();
  });
  const bulk = $('#bulk-cancel');
  if (!bulk) return;
  bulk.addEventListener('click', async () => {
    const status = $('#bulk-status');
    const ids = $$('#job-rows input:checked').filter((c) => c.hasAttribute('data-live')).map((c) => c.value);
    if (!ids.length) {
      status.textContent = 'Tick queued or running jobs to cancel.';
      return;
    }
    if (!confirm(`Cancel ${ids.length} job(s)?`)) return;
    let done = 0;
    const failed = [];
    for (const id of ids) {
      const r = await api('POST', `/v1/jobs/${id}/cancel`);
      if (r.ok) done++;
      else failed.push(id.slice(-8) + ': ' + problemText(r.data));
    }
    status.textContent = `Cancelled ${done}.` + (failed.length ? ' Refused: ' + failed.join('; ') : '');
    $$('#job-rows input:checked').forEach((c) => (c.checked = false));
  });
}

// ---- Compare -----------------------------------------------------------------------------

async function comparePage() {
  const box = $('#chart-compare');
  if (!box) return;
  const ids = box.dataset.ids.split(',').filter(Boolean);
  let plot = null;
  async function draw() {
    const answers = await Promise.all(ids.map((id) => api('GET', `/v1/jobs/${id}/metrics`)));
    const runs = answers.filter((a) => a.ok).map((a) => a.data);
    const steps = new Set();
    const curves = runs.map((m) => {
      const byStep = new Map(lastAttemptSteps(m.steps).map((s) => [s.step, s.loss]));
      byStep.forEach((_, k) => steps.add(k));
      return byStep;
    });
    const x = Array.from(steps).sort((a, b) => a - b);
    const data = [x, ...curves.map((c) => x.map((s) => (c.has(s) ? c.get(s) : null)))];
    if (!plot) {
      plot = chart('compare', box, {
        ...stepAxis,
        height: 300,
        data,
        series: [{ label: 'step' }, ...runs.map((m, i) => line(m.job_id.slice(-8), COLORS[i % COLORS.length]))],
      });
    } else {
      plot.update(data);
    }
    if (runs.some((m) => ['queued', 'scheduled', 'running'].includes(m.state))) setTimeout(draw, 2000);
  }
  draw();
}

// ---- Plan & submit -----------------------------------------------------------------------

function getPath(obj, path) {
  return path.split('.').reduce((o, k) => (o && typeof o === 'object' ? o[k] : undefined), obj);
}

function setPath(obj, path, value) {
  const keys = path.split('.');
  let o = obj;
  for (const k of keys.slice(0, -1)) {
    if (!o[k] || typeof o[k] !== 'object') o[k] = {};
    o = o[k];
  }
  o[keys[keys.length - 1]] = value;
}

function planPage() {
  const spec = $('#spec');
  const out = $('#estimate');
  const error = $('#spec-error');
  const submit = $('#submit');
  const knobs = $$('#knobs [data-path]');
  let timer = null;
  let seq = 0;

  function parsed() {
    try {
      return JSON.parse(spec.value);
    } catch (e) {
      return e;
    }
  }

  /** The knob fields show the spec's values; a DeepSpeed config is edited as JSON only. */
  function fillKnobs() {
    const s = parsed();
    const native = !(s instanceof Error) && s && typeof s === 'object' && !('deepspeed' in s);
    for (const k of knobs) {
      k.disabled = !native;
      if (!native) continue;
      const v = getPath(s, k.dataset.path);
      if (v !== undefined && document.activeElement !== k) k.value = String(v);
    }
  }

  function knobChanged(e) {
    const s = parsed();
    if (s instanceof Error) return;
    const k = e.target;
    let v = k.value;
    const numeric = k.hasAttribute('data-number') || (k.selectedOptions && k.selectedOptions[0] && k.selectedOptions[0].hasAttribute('data-number'));
    if (numeric && v !== '') v = Number(v);
    if (v === '') return;
    setPath(s, k.dataset.path, v);
    spec.value = JSON.stringify(s, null, 2);
    schedule();
  }

  function deviceBytes() {
    return Math.round(Number($('#device-gib').value || 0) * 2 ** 30);
  }

  function render(report) {
    const mem = deviceBytes();
    const head = el('tr', {}, el('th', {}, 'ZeRO stage'), ...CATEGORIES.map((c) => el('th', {}, c)), el('th', {}, 'total per rank'), el('th', {}, 'sent per step'), el('th', {}, `on ${human(mem)} devices`));
    const rows = report.stages.map((s) => {
      const total = s.per_rank_bytes.total;
      const verdict = total <= mem ? el('td', { class: 'fits' }, 'fits') : el('td', { class: 'needs' }, `needs ${human(total - mem)} more`);
      return el('tr', { 'data-stage': s.stage }, el('th', {}, s.stage), ...CATEGORIES.map((c) => el('td', {}, human(s.per_rank_bytes[c]))), el('td', {}, human(total)), el('td', {}, human(s.comm_bytes_per_step)), verdict);
    });
    const table = el('table', { id: 'estimate-table' }, el('thead', {}, head), el('tbody', {}, ...rows));
    const p = report.plan;
    const plan = p.fits
      ? el('p', { class: 'fits', id: 'plan-verdict' }, `Fits on ${report.world_size} device(s): ZeRO stage ${p.zero_stage}, micro-batch ${p.micro_batch_size} × ${p.grad_accum_steps} accumulation, checkpointing ${p.activation_checkpointing ? 'on' : 'off'}, ${human(p.per_rank_bytes.total)} per rank; ${p.devices_that_fit} registered device(s) can hold a rank.`)
      : el('p', { class: 'needs', id: 'plan-verdict' }, 'Does not fit the registered devices: ' + p.reason);
    const nodes = el('ul', {}, ...report.nodes.map((n) => el('li', {}, `${n.name}: ${n.devices_that_fit} device(s) can hold a rank` + (n.holds_job ? '; holds the whole job' : ''))));
    // A LoRA job trains its adapters only: PEFT's `print_trainable_parameters` figures.
    const trained = report.trainable_parameters === report.parameters
      ? `${report.parameters.toLocaleString('en')} parameters`
      : `${report.trainable_parameters.toLocaleString('en')} trainable of ${report.parameters.toLocaleString('en')} parameters`;
    const parts = [el('p', { id: 'estimate-parameters' }, `${trained}, ${report.world_size} rank(s), micro-batch ${report.micro_batch_size}:`), table, plan, nodes];
    if (report.unsupported_keys && report.unsupported_keys.length) parts.push(el('p', { class: 'needs' }, 'Ignored DeepSpeed keys: ' + report.unsupported_keys.join(', ')));
    out.replaceChildren(...parts);
    out.dataset.ready = 'true';
    if (submit) submit.disabled = !p.fits;
  }

  async function estimate() {
    const s = parsed();
    fillKnobs();
    if (s instanceof Error) {
      error.textContent = 'spec: not JSON: ' + s.message;
      if (submit) submit.disabled = true;
      return;
    }
    const mine = ++seq;
    const r = await api('POST', '/v1/estimate', spec.value);
    if (mine !== seq) return; // a newer keystroke's answer is coming
    if (r.ok) {
      error.textContent = '';
      render(r.data);
    } else {
      error.textContent = problemText(r.data);
      if (submit) submit.disabled = true;
    }
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(estimate, 250);
  }

  spec.addEventListener('input', schedule);
  knobs.forEach((k) => k.addEventListener('change', knobChanged));
  $('#device-gib').addEventListener('input', schedule);
  if (submit) {
    submit.addEventListener('click', async () => {
      submit.disabled = true;
      const status = $('#submit-status');
      status.textContent = 'Submitting…';
      const r = await api('POST', '/v1/jobs', spec.value);
      if (r.ok) {
        location.href = '/jobs/' + r.data.id;
      } else {
        status.textContent = problemText(r.data);
        submit.disabled = false;
      }
    });
  }
  estimate();
}

// ---- Login and logout --------------------------------------------------------------------

function loginPage() {
  const form = $('#login');
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const token = $('#token').value.trim();
    const r = await fetch('/v1/session', { method: 'POST', headers: { Authorization: 'Bearer ' + token }, credentials: 'same-origin' });
    if (r.ok) {
      const next = form.elements.next.value;
      location.href = next.startsWith('/') && !next.startsWith('//') ? next : '/';
    } else {
      const p = await r.json().catch(() => null);
      $('#login-error').textContent = problemText(p);
    }
  });
}

document.addEventListener('click', async (e) => {
  if (!e.target.closest('#logout')) return;
  await api('DELETE', '/v1/session');
  location.href = '/login';
});

const PAGES = { login: loginPage, jobs: jobsPage, job: jobPage, compare: comparePage, plan: planPage };

document.addEventListener('DOMContentLoaded', () => {
  const page = PAGES[document.body.dataset.page];
  if (page) page();
});
