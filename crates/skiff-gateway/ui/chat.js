// One session: its header, the transcript as it streams, and the composer.
//
// The transcript is built from the session's event stream alone (from cursor 0, then live):
// events are applied idempotently (entries by id, tool rows by run and call id, cursors
// never re-applied), so a reconnect that resumes from the last cursor — or a reload that
// replays everything — shows each thing exactly once. DOM work is batched per animation
// frame, only the newest blocks are rendered at first, and long tool output stays collapsed.
// An expanded tool row is scrolled into view; `exec` rows carry their exit code, and their
// output shows its end first (where a failing command says why).

import { h, replace, fmtDuration, fmtInt, fmtBytes, frameBatcher, announce, otherOwner } from './dom.js';
import { renderMarkdown } from './markdown.js';
import { api, follow, request } from './api.js';
import { placementOf, sessionState, STATE_SYMBOL } from './sidebar.js';
import { TurnChanges } from './changes.js';

const TERMINAL = ['succeeded', 'failed', 'cancelled', 'timed_out', 'orphaned'];
const ACTIVE = ['queued', 'starting', 'running', 'cancelling', 'waiting_input', 'waiting_approval'];
/** Blocks rendered when a session opens; older ones wait behind "Show earlier". */
const WINDOW = 150;
const PREVIEW_CHARS = 16_000;
const PREVIEW_LINES = 120;

/** The one-line "main argument" of a tool call, as the gateway summarizes it. */
function summarize(args) {
  if (!args || typeof args !== 'object') return typeof args === 'string' ? args : '';
  for (const key of ['path', 'command', 'pattern', 'file', 'url', 'query']) {
    if (typeof args[key] === 'string') return args[key];
  }
  const first = Object.values(args).find((v) => typeof v === 'string');
  return first || '';
}

/** `exec`'s result split into its exit code and output ("exit code: 1\n…"), else null. */
function execResult(tool) {
  if (tool.name !== 'exec' || typeof tool.output !== 'string') return null;
  const m = /^exit code: (-?\d+)(\n|$)/.exec(tool.output);
  return m ? { code: Number(m[1]), output: tool.output.slice(m[0].length) } : null;
}

function exitBadge(code) {
  return h('span', { class: `texit ${code === 0 ? 'ok' : 'bad'}`, title: `exit code ${code}` }, `exit ${code}`);
}

const TOOL_SYMBOL = { pending: '○', running: '◌', ok: '✓', error: '✕', cancelled: '⊘' };
const TOOL_LABEL = { pending: 'queued', running: 'running', ok: 'done', error: 'failed', cancelled: 'not run' };
/** What a run's tokens cost at `prices` (dollars per million tokens), reckoned as the gateway
 *  does: cache reads and writes are parts of the input, each at its own price. */
function costOf(r, prices) {
  const uncached = Math.max(0, r.usageIn - r.usageCached - r.usageWritten);
  return (uncached * prices.input + r.usageCached * prices.cache_read
    + r.usageWritten * prices.cache_write + r.usageOut * prices.output) / 1e6;
}

/** Cents are too coarse for one turn of a cheap model. */
const ATTEMPT_SYMBOL = { succeeded: '✓', failed: '✕', cancelled: '⊘', orphaned: '✕', running: '◌', starting: '○' };

/** A run that moved between boxes: each attempt, where it ran and how it ended. */
function attemptsView(attempts) {
  if (!attempts || attempts.length < 2) return null;
  const rows = attempts.map((a, i) => h('li', { class: `attempt as-${a.status}` },
    h('span', { class: 'sym', 'aria-hidden': 'true' }, ATTEMPT_SYMBOL[a.status] || '•'),
    h('span', {}, [
      `attempt ${i + 1}`,
      a.node === 'gateway' ? 'on the gateway' : `on ${a.node}`,
      `epoch ${a.owner_epoch}`,
      a.from_checkpoint != null ? `from checkpoint ${a.from_checkpoint}` : null,
      a.status,
    ].filter(Boolean).join(' · ')),
    a.error ? h('span', { class: 'attempt-error' }, a.error) : null));
  return h('details', { class: 'attempts' },
    h('summary', {}, `moved: ${attempts.length} attempts`),
    h('ol', {}, ...rows));
}

/** 12345 → "12.3k", 2000000 → "2M". */
function fmtCount(n) {
  if (n >= 1e6) return `${+(n / 1e6).toFixed(1)}M`;
  if (n >= 1e4) return `${+(n / 1e3).toFixed(1)}k`;
  return String(n);
}

function fmtDollars(x) {
  return x >= 1 ? `$${x.toFixed(2)}` : `$${x.toFixed(4)}`;
}

const RUN_SYMBOL = { succeeded: '✓', failed: '✕', cancelled: '⊘', timed_out: '✕', orphaned: '✕' };

export class ChatView {
  constructor(id, ctx) {
    this.id = id;
    this.ctx = ctx;
    this.cursor = 0;
    this.queue = [];
    this.blocks = [];
    this.entries = new Set();
    this.tools = new Map();
    this.runs = new Map();
    this.streaming = null;
    this.renderStart = null;
    this.session = ctx.sidebar.sessions.get(id) || null;
    this.openedAt = Date.now();
    this.schedule = frameBatcher(() => this.flush());
    /** Whose messages the transcript labels: '' the signed-in user's ("you"), else an email. */
    this.labelledFor = '';
    this.build();
    this.renderHeader();
    this.load();
  }

  build() {
    this.titleEl = h('h1', { class: 'chat-title' }, '…');
    this.chipEl = h('span', { class: 'chip' });
    this.actionsEl = h('div', { class: 'head-actions' });
    this.metaEl = h('div', { class: 'chat-meta' });
    this.bannerEl = h('div', { class: 'banner', role: 'status', hidden: true });
    this.earlierBtn = h('button', { class: 'link-btn earlier', hidden: true, onclick: () => this.showEarlier() });
    this.listEl = h('ol', { class: 'turns' });
    this.jumpBtn = h('button', { class: 'jump', hidden: true, onclick: () => this.scrollToBottom() }, '↓ New activity');
    this.scroller = h('div', { class: 'transcript', tabindex: '0', role: 'log', 'aria-label': 'Transcript' },
      this.earlierBtn, this.listEl);
    this.scroller.addEventListener('scroll', () => {
      if (this.atBottom()) this.jumpBtn.hidden = true;
    });
    this.statusEl = h('div', { class: 'run-status', role: 'status' });
    this.input = h('textarea', {
      id: 'composer-input',
      rows: '3',
      placeholder: 'Message…',
      'aria-label': 'Message',
      'aria-describedby': 'composer-hint',
    });
    this.input.addEventListener('keydown', (e) => this.onKey(e));
    this.sendBtn = h('button', { type: 'submit', class: 'primary' }, 'Send');
    this.stopBtn = h('button', { type: 'button', class: 'danger', onclick: () => this.stop(), hidden: true }, '■ Stop');
    this.errorEl = h('p', { class: 'form-error', role: 'alert', hidden: true });
    this.form = h('form', { class: 'composer needs-write', onsubmit: (e) => { e.preventDefault(); this.sendMessage(); } },
      this.statusEl,
      this.input,
      h('div', { class: 'composer-bar' },
        h('span', { id: 'composer-hint', class: 'hint' }, h('kbd', {}, 'Ctrl'), '+', h('kbd', {}, '↵'), ' send · ', h('kbd', {}, 'Esc'), ' stop'),
        this.stopBtn, this.sendBtn),
      this.errorEl);
    // On someone else's session the composer gives way to one line (see renderOwnership).
    this.othersText = h('span', { class: 'others-text' });
    this.othersStopBtn = h('button', { type: 'button', class: 'danger small', onclick: () => this.stop(), hidden: true }, '■ Stop');
    this.othersEl = h('div', { class: 'others-note', role: 'note', hidden: true }, this.othersText, this.othersStopBtn);
    this.el = h('section', { class: 'chat', 'aria-labelledby': 'chat-title' },
      h('header', { class: 'chat-head' },
        h('div', { class: 'title-row' }, this.titleEl, this.chipEl, this.actionsEl),
        this.metaEl),
      this.bannerEl,
      h('div', { class: 'transcript-wrap' }, this.scroller, this.jumpBtn),
      this.form,
      this.othersEl);
    this.titleEl.id = 'chat-title';
  }

  async load() {
    try {
      const detail = await api.session(this.id);
      this.session = detail.session;
      for (const run of detail.runs) {
        const r = this.run(run.id);
        r.model = r.model || run.model;
      }
      this.takeAttempts(detail.attempts);
      this.usage = detail.usage || [];
      this.renderHeader();
    } catch (e) {
      if (e.status === 404) {
        replace(this.el, h('div', { class: 'empty' },
          h('h1', {}, 'No such session'),
          h('p', {}, `${this.id} does not exist, or belongs to someone else.`),
          h('a', { href: '#/new' }, 'Start a new session')));
        return;
      }
      this.showBanner(`Could not load the session: ${e.message}`);
    }
    if (this.stopped) return;
    this.stopFollow = follow(
      () => `/v1/sessions/${encodeURIComponent(this.id)}/events?after=${this.cursor}`,
      { message: (ev) => { this.queue.push(ev); this.schedule(); } },
      (state) => this.showBanner(state === 'reconnecting' ? 'Connection lost — reconnecting… (nothing will be missed)' : null),
    );
  }

  destroy() {
    this.stopped = true;
    if (this.stopFollow) this.stopFollow();
  }

  /** The session view from the list stream changed (title, state, placement). */
  onSession(session) {
    this.session = { ...this.session, ...session };
    this.renderHeader();
  }

  showBanner(text) {
    this.bannerEl.hidden = !text;
    this.bannerEl.textContent = text || '';
  }

  renderHeader() {
    const s = this.session;
    if (!s) return;
    this.titleEl.textContent = s.title || s.id;
    this.titleEl.title = s.title || s.id;
    const p = placementOf(s);
    const state = this.activeRun() ? 'running' : sessionState(s);
    replace(this.chipEl,
      h('span', { class: `dot st-${state}`, 'aria-hidden': 'true' }, STATE_SYMBOL[state] || '○'),
      ` ${p.label} · ${state}`);
    this.chipEl.className = `chip pl-${p.kind}`;
    // Reclaimed or failed: the reason on hover.
    const why = ['reclaimed', 'failed_over', 'failed'].includes(state) ? s.worker?.error : null;
    this.chipEl.title = why || s.last_run?.error || `${p.label}: ${state}`;
    this.renderActions(s);
    this.renderOwnership(s);
    const ws = s.workspace || {};
    const owner = otherOwner(s);
    replace(this.metaEl,
      owner ? [h('span', { class: 'owner', title: `${owner}'s session` }, owner),
        h('span', { class: 'sep', 'aria-hidden': 'true' }, '·')] : null,
      h('span', { class: 'model', title: s.model?.ref }, s.model?.ref || ''),
      s.model?.scripted ? h('span', { class: 'tag', title: 'A scripted stand-in model, not a real one' }, 'scripted') : null,
      // The agent spec version the session is pinned to: name and short digest.
      s.agent ? [h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
        h('span', { class: 'mono agent', title: `agent spec ${s.agent.name}@${s.agent.digest}` },
          `${s.agent.name}@${s.agent.digest.slice(0, 12)}`)] : null,
      ws.branch ? [h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'), h('span', { class: 'mono', title: `branch ${ws.branch}` }, ws.branch)] : null,
      h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
      // A session cloned from a URL is known by that URL; its worktree path is on hover.
      ws.remote
        ? h('span', { class: 'mono path', title: `worktree ${ws.path}` }, ws.remote)
        : h('span', { class: 'mono path', title: ws.path }, ws.path || ''),
      h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
      h('span', { class: 'mono muted' }, s.id),
      s.group_id ? [h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
        h('a', { class: 'group-link', href: `#/g/${s.group_id}`, title: `Compare the attempts of ${s.group_id}` }, 'attempt of a fan-out · compare')] : null,
      this.totalEl(),
      this.usageEl());
  }

  /**
   * Only a session's owner sends it messages: on someone else's, the composer is replaced by
   * one quiet line naming the owner and what the signed-in role may do (an operator or admin
   * stops a turn here, pulls back from the header, answers approval cards; a viewer reads).
   * Until `/v1/me` has answered, the session counts as one's own; the answer renders it again.
   */
  renderOwnership(s) {
    const owner = document.body.dataset.me ? otherOwner(s) : null;
    const operates = (document.body.dataset.can || '').split(' ').includes('operate');
    this.othersOperates = Boolean(owner) && operates;
    this.form.hidden = Boolean(owner);
    this.othersEl.hidden = !owner;
    // The owner's messages carry their name, not "you": relabel once whose it is is known.
    if (this.labelledFor !== (owner || '')) {
      this.labelledFor = owner || '';
      this.scroller.classList.toggle('theirs', Boolean(owner));
      for (const b of this.blocks) if (b.kind === 'user') b.dirty = true;
      this.schedule();
    }
    if (!owner) return;
    this.othersText.textContent = operates
      ? `${owner}'s session — you may stop its turn, dispatch it or pull it back, and answer approvals; only its owner sends messages.`
      : `${owner}'s session — you may read it; only its owner sends messages.`;
    this.othersText.title = this.othersText.textContent;
    this.renderComposer();
  }

  /** Usage against each budget in force (none configured: nothing shown). */
  usageEl() {
    const limited = (this.usage || []).filter((l) => l.tokens_limit != null || l.cost_usd_limit != null);
    if (!limited.length) return null;
    const part = (l) => {
      const bits = [];
      if (l.tokens_limit != null) bits.push(`${fmtCount(l.tokens)}/${fmtCount(l.tokens_limit)} tokens`);
      if (l.cost_usd_limit != null) bits.push(`${fmtDollars(l.cost_usd)}/${fmtDollars(l.cost_usd_limit)}`);
      const when = l.window === 'session' ? '' : ' today';
      return h('span', {
        class: l.exhausted ? 'budget out' : 'budget',
        title: `${l.subject} ${l.id}${l.window === 'session' ? '' : ` on ${l.window} (UTC)`}${l.exhausted ? ': used up, the next model call is refused' : ''}`,
      }, `${l.subject}${when} ${bits.join(' · ')}${l.exhausted ? ' ⚠ used up' : ''}`);
    };
    return [h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
      h('span', { class: 'usage', 'aria-label': 'Usage against budgets' }, ...limited.map(part))];
  }

  /** After a turn ends, the budgets' usage is read again. */
  async refreshUsage() {
    try {
      const detail = await api.session(this.id);
      if (this.stopped) return;
      this.usage = detail.usage || [];
      this.renderHeader();
    } catch {
      // The header keeps what it had; the next load shows the rest.
    }
  }

  /** The session's cost so far, when its model has prices. */
  totalEl() {
    const prices = this.session?.model?.prices;
    if (!prices) return null;
    let total = 0;
    for (const r of this.runs.values()) total += costOf(r, prices);
    return [h('span', { class: 'sep', 'aria-hidden': 'true' }, '·'),
      h('span', { class: 'cost', title: 'Session cost at the configured prices' }, `${fmtDollars(total)} total`)];
  }

  /**
   * Pull back (on a worker) and Dispatch… (not on a box), each behind a confirmation. As the
   * server's rules go, the owner moves their session (write); someone else's needs an operator
   * (operate), and until `/v1/me` answers no session counts as someone else's.
   */
  renderActions(s) {
    const raw = typeof s.placement === 'string' ? s.placement : 'local';
    const settled = ['local', 'parked', 'reclaimed', 'failed'];
    const onWorker = raw !== 'local' && ['active', ...settled].includes(raw);
    const theirs = document.body.dataset.me ? otherOwner(s) : null;
    const needs = theirs ? 'needs-operate' : 'needs-write';
    replace(this.actionsEl,
      onWorker ? h('button', { type: 'button', class: `small ${needs}`, onclick: () => this.confirmMove('pull-back') }, '⟲ Pull back') : null,
      settled.includes(raw) ? h('button', { type: 'button', class: `small ${needs}`, onclick: () => this.confirmMove('dispatch') }, 'Dispatch…') : null);
  }

  async confirmMove(kind) {
    const dialog = document.getElementById('move');
    const form = dialog.querySelector('form');
    const profileRow = dialog.querySelector('.move-profile');
    const cancelRow = dialog.querySelector('.move-cancel');
    const liveRow = dialog.querySelector('.move-live');
    const select = form.elements.profile;
    const s = this.session;
    const running = Boolean(this.activeRun());
    const text = dialog.querySelector('.move-text');
    const texts = kind === 'pull-back'
      ? {
        plain: `The worker on ${s.worker?.environment_id || 'its box'} stops, the box's work comes back into the session's workspace, and the box goes back to the pool. The next message runs on the gateway.`,
        live: `The running turn moves with it: its current step finishes on ${s.worker?.environment_id || 'its box'}, the worker stops, the box's work comes back, and the same turn goes on on the gateway.`,
      }
      : {
        plain: 'The session is placed on a worker box of this profile now; the next message runs there.',
        live: 'The running turn moves with it: its current step finishes on the gateway, and the same turn goes on on a worker box of this profile.',
      };
    // Live and stop-first exclude each other; the text says what the confirmation does.
    const showText = () => { text.textContent = form.elements.live.checked ? texts.live : texts.plain; };
    form.elements.live.checked = false;
    form.elements.cancel.checked = false;
    form.elements.live.onchange = () => { if (form.elements.live.checked) form.elements.cancel.checked = false; showText(); };
    form.elements.cancel.onchange = () => { if (form.elements.cancel.checked) form.elements.live.checked = false; showText(); };
    liveRow.hidden = !running;
    showText();
    dialog.querySelector('#move-title').textContent = kind === 'pull-back' ? 'Pull this session back?' : 'Dispatch this session?';
    if (kind === 'pull-back') {
      profileRow.hidden = true;
      cancelRow.hidden = !running;
    } else {
      cancelRow.hidden = true;
      profileRow.hidden = false;
      let profiles = [];
      try {
        profiles = (await api.profiles())?.profiles || [];
      } catch (e) {
        this.showError(`Could not list worker profiles: ${e.message}`);
        return;
      }
      if (profiles.length === 0) {
        this.showError('No worker profiles are configured: add a [profiles.NAME] table to skiff.toml.');
        return;
      }
      replace(select, profiles.map((p) => h('option', { value: p.name }, `${p.name} (${p.provider})`)));
      if (s.worker?.profile) select.value = s.worker.profile;
    }
    dialog.returnValue = '';
    dialog.onclose = async () => {
      if (dialog.returnValue !== 'move') return;
      this.showError(null);
      try {
        const live = !liveRow.hidden && form.elements.live.checked;
        const moved = kind === 'pull-back'
          ? await api.pullBack(this.id, !cancelRow.hidden && form.elements.cancel.checked, live)
          : await api.dispatch(this.id, select.value, live);
        // The steps arrive as placement rows in the transcript; a no-op says why here.
        if (!moved.moved) this.showError(moved.message);
      } catch (e) {
        this.showError(e.code === 'session_busy'
          ? 'A turn is running: wait for it, or pull back again and stop it first.'
          : `Not moved: ${e.message}`);
      }
    };
    dialog.showModal();
    dialog.querySelector('[value=cancel]')?.focus();
  }

  run(id) {
    if (!id) return { usageIn: 0, usageOut: 0, usageCached: 0, usageWritten: 0, steps: 0 };
    let r = this.runs.get(id);
    if (!r) {
      r = { id, status: null, startedAt: null, endedAt: null, model: null, usageIn: 0, usageOut: 0, usageCached: 0, usageWritten: 0, steps: 0, error: null };
      this.runs.set(id, r);
    }
    return r;
  }

  /** Files each run's attempts; a run that moved (failover) shows them under its summary. */
  takeAttempts(attempts) {
    for (const a of attempts || []) {
      const r = this.run(a.run_id);
      r.attempts = (r.attempts || []).filter((x) => x.id !== a.id);
      r.attempts.push(a);
    }
    for (const b of this.blocks) if (b.kind === 'runend') b.dirty = true;
  }

  /** After a turn whose box was given up ends, its attempts are read again (a failover adds one). */
  async refreshAttempts() {
    try {
      const detail = await api.session(this.id);
      if (this.stopped) return;
      this.takeAttempts(detail.attempts);
      this.schedule();
    } catch {
      // The summary keeps what it had; the next load shows the rest.
    }
  }

  activeRun() {
    for (const r of this.runs.values()) {
      if (r.status && ACTIVE.includes(r.status)) return r;
    }
    return null;
  }

  // ---- events → model ----

  apply(ev) {
    if (ev.cursor <= this.cursor) return;
    this.cursor = ev.cursor;
    const run = this.run(ev.run_id);
    switch (ev.type) {
      case 'run_status': {
        run.status = ev.status;
        if (run.startedAt === null) run.startedAt = ev.at_ms;
        if (TERMINAL.includes(ev.status)) {
          run.endedAt = ev.at_ms;
          run.error = ev.error || null;
          this.endStreaming(ev.run_id);
          for (const tool of this.tools.values()) {
            if (tool.runId === ev.run_id && (tool.status === 'pending' || tool.status === 'running')) {
              tool.status = 'cancelled';
              this.touchTool(tool);
            }
          }
          this.add({ key: `end:${ev.run_id}`, kind: 'runend', run });
          if (run.moved) this.refreshAttempts();
          if (ev.at_ms >= this.openedAt - 1000) this.refreshUsage();
          if (ev.at_ms >= this.openedAt - 1000) announce(`Turn ${ev.status.replace('_', ' ')}`);
        }
        break;
      }
      case 'model_request':
        run.model = ev.model;
        break;
      case 'text_delta': {
        const s = this.stream(ev);
        // The answer began: the thinking before it took this long.
        if (s.thinkStart !== null && s.thinkEnd === null) s.thinkEnd = ev.at_ms;
        s.text += ev.text;
        s.block.dirty = true;
        break;
      }
      case 'reasoning_delta': {
        // Shown collapsed while it streams; the committed entry carries the whole block.
        const s = this.stream(ev);
        if (s.thinkStart === null) s.thinkStart = ev.at_ms;
        s.thinking += ev.text;
        s.block.dirty = true;
        break;
      }
      case 'tool_started': {
        if (this.streaming && this.streaming.runId === ev.run_id && this.streaming.thinkStart !== null && this.streaming.thinkEnd === null) {
          this.streaming.thinkEnd = ev.at_ms;
        }
        const tool = this.tool(ev.run_id, ev.call_id, ev.name);
        tool.summary = ev.summary || tool.summary;
        tool.status = 'running';
        tool.startedAt = ev.at_ms;
        this.touchTool(tool);
        break;
      }
      case 'tool_finished': {
        const tool = this.tool(ev.run_id, ev.call_id, ev.name);
        tool.status = ev.is_error ? 'error' : 'ok';
        tool.duration = ev.duration_ms;
        this.touchTool(tool);
        break;
      }
      case 'entry':
        this.applyEntry(ev.entry, run);
        break;
      case 'placement':
        // Worker placement progress (provisioning, syncing, …): one quiet line each.
        this.setupStep = null;
        this.add({ key: `pl:${ev.cursor}`, kind: 'placement', state: ev.state, text: ev.detail });
        if (ev.state === 'setup') this.setupStep = this.blocks[this.blocks.length - 1];
        // A box given up under a running turn: the turn may go on as a new attempt.
        if (ev.state === 'reclaimed' && ev.run_id) run.moved = true;
        break;
      case 'approval': {
        // A call waiting for a person: one card per approval, updated as it is decided.
        const a = ev.approval;
        const key = `apr:${a.id}`;
        const existing = this.blocks.find((b) => b.key === key);
        if (existing) {
          existing.approval = a;
          existing.dirty = true;
        } else {
          this.add({ key, kind: 'approval', approval: a });
        }
        if (a.state === 'pending' && ev.at_ms >= this.openedAt - 1000) announce(`Approval needed: ${a.tool}`);
        break;
      }
      case 'setup_output': {
        // The box's setup output, under its `setup` step (bounded by the gateway; the whole
        // log is `skiff session setup-log`).
        const step = this.setupStep;
        if (!step) break;
        step.output = (step.output || '') + ev.text;
        step.dirty = true;
        break;
      }
      default:
        break;
    }
  }

  applyEntry(entry, run) {
    if (this.entries.has(entry.id)) return;
    this.entries.add(entry.id);
    const body = entry.body;
    const runId = entry.run_id;
    switch (body.kind) {
      case 'user_message':
        this.add({ key: entry.id, kind: 'user', text: body.text, at: entry.created_at_ms });
        break;
      case 'assistant_message': {
        // How long the model thought, when its reasoning streamed here (not kept in the entry).
        const s = this.streaming && this.streaming.runId === runId ? this.streaming : null;
        const thinkMs = s && s.thinkStart !== null ? (s.thinkEnd ?? entry.created_at_ms) - s.thinkStart : null;
        if (s) this.endStreaming(runId, true);
        const tools = body.tool_calls.map((call) => {
          const tool = this.tool(runId, call.id, call.name);
          tool.args = call.arguments;
          if (!tool.summary) tool.summary = summarize(call.arguments);
          return tool;
        });
        run.usageIn += body.usage?.input_tokens || 0;
        run.usageOut += body.usage?.output_tokens || 0;
        run.usageCached += body.usage?.cache_read_tokens || 0;
        run.usageWritten += body.usage?.cache_write_tokens || 0;
        run.steps += 1;
        run.model = body.model || run.model;
        this.add({ key: entry.id, kind: 'assistant', text: body.text, tools, model: body.model, usage: body.usage, reasoning: body.reasoning || [], thinkMs });
        break;
      }
      case 'tool_result': {
        const key = `${runId}:${body.call_id}`;
        let tool = this.tools.get(key);
        const orphan = !tool || !tool.block;
        tool = this.tool(runId, body.call_id, body.name);
        tool.output = body.content;
        tool.images = body.images || [];
        tool.isError = body.is_error;
        if (tool.status === 'pending' || tool.status === 'running') tool.status = body.is_error ? 'error' : 'ok';
        if (orphan) this.add({ key: entry.id, kind: 'assistant', text: '', tools: [tool] });
        this.touchTool(tool);
        break;
      }
      case 'notice':
        this.add({ key: entry.id, kind: 'notice', text: body.text });
        break;
      case 'compaction':
        this.add({ key: entry.id, kind: 'compaction', summary: body.summary, entries: body.entries || 0, files: body.files || [] });
        break;
      default:
        break;
    }
  }

  tool(runId, callId, name) {
    const key = `${runId}:${callId}`;
    let tool = this.tools.get(key);
    if (!tool) {
      tool = { key, runId, callId, name, summary: '', args: undefined, status: 'pending', duration: null, output: null, isError: false, el: null, block: null, open: false, full: false };
      this.tools.set(key, tool);
    }
    if (name) tool.name = name;
    return tool;
  }

  touchTool(tool) {
    tool.dirty = true;
  }

  /** The run's streaming block (text and reasoning as they arrive), started if need be. */
  stream(ev) {
    if (!this.streaming || this.streaming.runId !== ev.run_id) {
      this.endStreaming(null);
      this.streaming = { runId: ev.run_id, text: '', thinking: '', thinkStart: null, thinkEnd: null };
      this.streaming.block = this.add({ key: `stream:${ev.cursor}`, kind: 'streaming', stream: this.streaming });
    }
    return this.streaming;
  }

  /** Ends the streaming block: dropped when its committed entry replaces it, else kept. */
  endStreaming(runId, replaced = false) {
    const s = this.streaming;
    if (!s || (runId !== null && s.runId !== runId)) return;
    this.streaming = null;
    const block = s.block;
    if (replaced || !s.text.trim()) {
      this.remove(block);
    } else {
      block.kind = 'assistant';
      block.text = s.text;
      block.tools = [];
      block.dirty = true;
    }
  }

  add(block) {
    block.dirty = true;
    this.blocks.push(block);
    if (block.tools) for (const t of block.tools) t.block = block;
    this.fresh = true;
    return block;
  }

  remove(block) {
    const i = this.blocks.indexOf(block);
    if (i >= 0) this.blocks.splice(i, 1);
    if (block.el) block.el.remove();
    if (this.renderStart !== null && i >= 0 && i < this.renderStart) this.renderStart -= 1;
  }

  // ---- model → DOM ----

  atBottom() {
    const s = this.scroller;
    return s.scrollHeight - s.scrollTop - s.clientHeight < 48;
  }

  scrollToBottom() {
    this.scroller.scrollTop = this.scroller.scrollHeight;
    this.jumpBtn.hidden = true;
  }

  flush() {
    if (this.stopped) return;
    const first = this.renderStart === null;
    const stick = first || this.atBottom();
    this.fresh = false;
    const events = this.queue;
    this.queue = [];
    for (const ev of events) this.apply(ev);
    if (first) this.renderStart = Math.max(0, this.blocks.length - WINDOW);
    let prev = null;
    for (let i = this.renderStart; i < this.blocks.length; i += 1) {
      const block = this.blocks[i];
      if (!block.el || block.dirty) {
        const el = this.renderBlock(block);
        if (block.el && block.el.isConnected) block.el.replaceWith(el);
        block.el = el;
        block.dirty = false;
      }
      if (!block.el.isConnected) {
        if (prev) prev.after(block.el);
        else this.listEl.prepend(block.el);
      }
      if (block.tools) for (const t of block.tools) if (t.dirty) this.updateTool(t);
      prev = block.el;
    }
    for (const t of this.tools.values()) if (t.dirty && t.el) this.updateTool(t);
    this.earlierBtn.hidden = this.renderStart === 0;
    if (this.renderStart > 0) this.earlierBtn.textContent = `Show earlier (${fmtInt(this.renderStart)} more)`;
    this.renderComposer();
    this.renderHeader();
    if (stick) this.scrollToBottom();
    else if (events.length) this.jumpBtn.hidden = false;
  }

  showEarlier() {
    const before = this.scroller.scrollHeight;
    const from = Math.max(0, this.renderStart - WINDOW);
    const frag = document.createDocumentFragment();
    for (let i = from; i < this.renderStart; i += 1) {
      const block = this.blocks[i];
      block.el = this.renderBlock(block);
      block.dirty = false;
      frag.append(block.el);
    }
    this.listEl.prepend(frag);
    this.renderStart = from;
    this.earlierBtn.hidden = from === 0;
    this.earlierBtn.textContent = `Show earlier (${fmtInt(from)} more)`;
    this.scroller.scrollTop += this.scroller.scrollHeight - before;
  }

  renderBlock(block) {
    switch (block.kind) {
      case 'user': {
        // Someone else's session: their name (the email's local part; all of it on hover).
        const owner = this.labelledFor;
        const who = owner
          ? h('div', { class: 'who', title: owner }, owner.split('@')[0])
          : h('div', { class: 'who' }, 'you');
        return h('li', { class: 'msg user' }, who, h('div', { class: 'body plain' }, block.text));
      }
      case 'assistant':
      case 'streaming': {
        const text = block.kind === 'streaming' ? block.stream.text : block.text;
        const body = text ? h('div', { class: 'body md' }, renderMarkdown(text)) : null;
        if (body && block.kind === 'streaming') body.append(h('span', { class: 'caret', 'aria-hidden': 'true' }, '▌'));
        const tools = block.tools?.length ? h('ul', { class: 'tools' }, block.tools.map((t) => this.toolEl(t))) : null;
        const thinking = this.thinkingEl(block);
        return h('li', { class: `msg agent${block.kind === 'streaming' ? ' streaming' : ''}` },
          h('div', { class: 'who' }, text ? 'agent' : ''),
          h('div', { class: 'stack' }, thinking, body, tools));
      }
      case 'notice':
        return h('li', { class: 'notice' }, h('span', { 'aria-hidden': 'true' }, '⚠ '), block.text);
      case 'compaction': {
        // A divider: the model reads only the summary from here on; the chat above stays.
        const open = block.el?.querySelector('details')?.open ? { open: '' } : {};
        const what = block.entries ? ` · ${block.entries} entr${block.entries === 1 ? 'y' : 'ies'} summarised` : '';
        return h('li', { class: 'compaction', role: 'separator', 'aria-label': 'Conversation compacted' },
          h('details', open,
            h('summary', {}, 'Conversation compacted', h('span', { class: 'muted' }, what)),
            h('div', { class: 'body plain' }, block.summary),
            block.files.length ? h('div', { class: 'muted mono' }, `files: ${block.files.join(', ')}`) : null));
      }
      case 'placement': {
        const line = [h('span', { class: 'mono' }, block.state), ' ', block.text];
        if (!block.output) return h('li', { class: 'placement-step' }, ...line);
        const lines = block.output.split('\n').filter((l) => l.trim()).length;
        // Open while it runs would push the chat around; the summary names the newest line.
        // A re-render (more output arrived) keeps the reader's choice to open it.
        const open = block.el?.querySelector('details')?.open ? { open: '' } : {};
        return h('li', { class: 'placement-step' },
          h('details', { class: 'setup-output', ...open },
            h('summary', {}, ...line, h('span', { class: 'muted' }, ` · ${lines} line${lines === 1 ? '' : 's'} of output`)),
            h('pre', { class: 'setup-log' }, block.output)));
      }
      case 'approval':
        return this.approvalEl(block);
      case 'runend': {
        const r = block.run;
        const parts = [
          r.status === 'succeeded' ? 'done' : r.status.replace('_', ' '),
          r.startedAt && r.endedAt ? fmtDuration(r.endedAt - r.startedAt) : null,
          r.steps ? `${r.steps} step${r.steps === 1 ? '' : 's'}` : null,
          `${fmtInt(r.usageIn)} in${r.usageCached ? ` (${fmtInt(r.usageCached)} cached)` : ''} · ${fmtInt(r.usageOut)} out tokens`,
          this.session?.model?.prices ? fmtDollars(costOf(r, this.session.model.prices)) : null,
          r.model,
        ].filter(Boolean);
        // The turn's Changes view keeps its state across re-renders of this line.
        if (!block.changes && r.id) block.changes = new TurnChanges(this.id, r.id);
        return h('li', { class: `runend rs-${r.status}`, title: r.error || '' },
          h('span', { class: 'sym', 'aria-hidden': 'true' }, RUN_SYMBOL[r.status] || '•'),
          h('span', {}, parts.join(' · ')),
          r.error && r.status !== 'cancelled' ? h('span', { class: 'run-error' }, r.error) : null,
          attemptsView(r.attempts),
          block.changes?.el);
      }
      default:
        return h('li', {});
    }
  }

  /**
   * An approval card: what the agent wants to run or change, who asked, the time left, and
   * Approve / Deny (with an optional reason the agent reads) while it waits.
   */
  approvalEl(block) {
    const a = block.approval;
    const pending = a.state === 'pending';
    const left = Math.max(0, a.expires_at_ms - Date.now());
    const what = { exec: 'run', write: 'change files', call: 'call a tool', request: 'ask' }[a.kind] || 'act';
    const reason = h('input', { type: 'text', class: 'approval-reason', placeholder: 'Reason (optional, the agent reads it)', 'aria-label': 'Reason for the decision', maxlength: '2000' });
    const decide = async (approve) => {
      for (const b of block.el?.querySelectorAll('button') || []) b.disabled = true;
      try {
        const body = reason.value.trim() ? { reason: reason.value.trim() } : {};
        const row = await request('POST', `/v1/approvals/${encodeURIComponent(a.id)}/${approve ? 'approve' : 'deny'}`, body);
        block.approval = row;
      } catch (e) {
        block.error = e.message;
      }
      block.dirty = true;
      this.schedule();
    };
    const outcome = pending
      ? null
      : h('div', { class: 'approval-outcome' },
        h('span', { class: 'sym', 'aria-hidden': 'true' }, a.state === 'approved' ? '✓' : '✕'),
        ` ${a.state}`,
        a.decided_by ? ` by ${a.decided_by}` : '',
        a.reason ? `: ${a.reason}` : '');
    return h('li', { class: `approval ap-${a.state}`, role: 'group', 'aria-label': `Approval ${a.id}: ${a.state}` },
      h('div', { class: 'approval-head' },
        h('strong', {}, pending ? `The agent waits for you to let it ${what}` : `Approval ${a.state}`),
        h('span', { class: 'mono muted', title: a.id }, ` ${a.id}`)),
      h('div', { class: 'muted' },
        `${a.tool} · asked by ${a.requested_by}`,
        pending ? ` · denied in ${fmtDuration(left)} unless decided` : ''),
      a.request_reason ? h('div', { class: 'approval-why' }, `Why: ${a.request_reason}`) : null,
      h('pre', { class: `approval-subject mono${a.kind === 'write' ? ' diff' : ''}` }, a.subject),
      pending
        ? h('div', { class: 'approval-actions' },
          h('button', { type: 'button', class: 'primary', onclick: () => decide(true) }, 'Approve'),
          h('button', { type: 'button', class: 'danger', onclick: () => decide(false) }, 'Deny'),
          reason)
        : outcome,
      block.error ? h('div', { class: 'run-error', role: 'alert' }, block.error) : null);
  }

  /**
   * The model's reasoning, collapsed: "Thinking" and how long, when that is known; opened, the
   * readable text (a redacted block says so). Streaming, it reads "Thinking…" until the answer
   * begins. A re-render keeps the reader's choice to open it.
   */
  thinkingEl(block) {
    let parts;
    let label;
    if (block.kind === 'streaming') {
      const s = block.stream;
      if (s.thinkStart === null) return null;
      parts = s.thinking ? [h('div', { class: 'thinking-text' }, s.thinking)] : [];
      label = s.thinkEnd === null ? 'Thinking…' : `Thinking · ${fmtDuration(s.thinkEnd - s.thinkStart)}`;
    } else {
      const reasoning = block.reasoning || [];
      if (!reasoning.length) return null;
      parts = reasoning.map((r) => {
        if (r.type === 'redacted_thinking') return h('div', { class: 'thinking-text muted' }, 'redacted');
        const text = r.type === 'thinking' ? r.thinking : (r.summary || []).join('\n\n');
        return h('div', { class: 'thinking-text' }, text || '(no readable text)');
      });
      label = block.thinkMs !== null && block.thinkMs !== undefined ? `Thinking · ${fmtDuration(block.thinkMs)}` : 'Thinking';
    }
    const open = block.el?.querySelector('details.thinking')?.open ? { open: '' } : {};
    return h('details', { class: 'thinking', ...open },
      h('summary', {}, label),
      ...parts);
  }

  toolEl(tool) {
    const head = h('button', { type: 'button', class: 'tool-head', 'aria-expanded': 'false' });
    const body = h('div', { class: 'tool-body', hidden: true });
    const li = h('li', { class: 'tool' }, head, body);
    head.addEventListener('click', () => {
      tool.open = !tool.open;
      this.updateTool(tool);
      if (tool.open) this.reveal(li, li.querySelector('pre.result'));
    });
    tool.el = li;
    tool.dirty = true;
    this.updateTool(tool);
    return li;
  }

  /**
   * Scrolls the transcript just enough to show `el` whole, or, when it is taller than the
   * transcript, `target` (its output) whole, or else from its top.
   */
  reveal(el, target) {
    const view = this.scroller.getBoundingClientRect();
    const fits = (e) => e && e.getBoundingClientRect().height <= view.height;
    const show = fits(el) ? el : fits(target) ? target : (target || el);
    const box = show.getBoundingClientRect();
    let delta = 0;
    if (box.bottom > view.bottom) delta = Math.min(box.bottom - view.bottom, box.top - view.top);
    else if (box.top < view.top) delta = box.top - view.top;
    if (delta) this.scroller.scrollTop += delta;
  }

  updateTool(tool) {
    tool.dirty = false;
    const li = tool.el;
    if (!li) return;
    const [head, body] = li.children;
    li.dataset.status = tool.status;
    head.setAttribute('aria-expanded', String(tool.open));
    const exec = execResult(tool);
    const label = exec ? `${TOOL_LABEL[tool.status]}, exit code ${exec.code}` : TOOL_LABEL[tool.status];
    replace(head,
      h('span', { class: 'chev', 'aria-hidden': 'true' }, tool.open ? '▾' : '▸'),
      h('span', { class: 'tname' }, tool.name),
      h('span', { class: 'targ', title: tool.summary }, tool.summary),
      h('span', { class: `tstatus ts-${tool.status}`, title: label },
        h('span', { 'aria-hidden': 'true' }, TOOL_SYMBOL[tool.status], exec ? [' ', exitBadge(exec.code)] : null),
        h('span', { class: 'sr-only' }, label)),
      h('span', { class: 'tdur' }, tool.duration !== null ? fmtDuration(tool.duration) : ''));
    body.hidden = !tool.open;
    if (!tool.open) {
      body.replaceChildren();
      return;
    }
    const args = tool.args === undefined ? '' : JSON.stringify(tool.args, null, 2);
    const out = exec ? exec.output : tool.output;
    const parts = [h('h4', {}, 'Arguments'), h('pre', { class: 'out' }, args || '(none)'),
      exec ? h('h4', { class: 'out-head' }, 'Output ', exitBadge(exec.code)) : h('h4', {}, tool.isError ? 'Error' : 'Output')];
    let pre = null;
    if (out === null) {
      parts.push(h('p', { class: 'muted' }, tool.status === 'running' ? 'Running…' : 'No output yet.'));
    } else {
      let shown = out;
      let cut = false;
      if (!tool.full) {
        // A command's output is read from its end (the failure, the summary); the rest from
        // its start.
        if (exec) {
          const lines = out.replace(/\n$/, '').split('\n');
          if (lines.length > PREVIEW_LINES) {
            parts.push(h('p', { class: 'muted cut-note' }, `… ${fmtInt(lines.length - PREVIEW_LINES)} earlier lines`));
            shown = lines.slice(-PREVIEW_LINES).join('\n');
            cut = true;
          }
          if (shown.length > PREVIEW_CHARS) {
            shown = shown.slice(-PREVIEW_CHARS);
            cut = true;
          }
        } else {
          const lines = out.split('\n', PREVIEW_LINES + 1);
          if (lines.length > PREVIEW_LINES) {
            shown = lines.slice(0, PREVIEW_LINES).join('\n');
            cut = true;
          }
          if (shown.length > PREVIEW_CHARS) {
            shown = shown.slice(0, PREVIEW_CHARS);
            cut = true;
          }
        }
      }
      pre = h('pre', { class: `out result${tool.isError && !exec ? ' err' : ''}` }, shown || '(empty)');
      parts.push(pre);
      if (cut) {
        parts.push(h('button', { type: 'button', class: 'link-btn', onclick: () => { tool.full = true; this.updateTool(tool); } },
          `Show all (${fmtBytes(new Blob([out]).size)}, ${fmtInt(out.split('\n').length)} lines)`));
      }
    }
    for (const image of tool.images || []) {
      // Only the image types `read` produces; the browser never treats the data as anything else.
      if (!/^image\/(png|jpeg|gif|webp)$/.test(image.media_type)) continue;
      const src = `data:${image.media_type};base64,${image.data_base64}`;
      const button = h('button', { type: 'button', class: 'thumb', 'aria-pressed': 'false', title: 'Show larger',
        onclick: () => button.setAttribute('aria-pressed', String(button.getAttribute('aria-pressed') !== 'true')) },
      h('img', { src, alt: `The image ${tool.name} ${tool.summary} returned to the model`, decoding: 'async' }));
      parts.push(button);
    }
    replace(body, ...parts);
    // The end of a command's output is what matters: start there when it scrolls.
    if (exec && pre && pre.isConnected) pre.scrollTop = pre.scrollHeight;
  }

  renderComposer() {
    const active = this.activeRun();
    this.stopBtn.hidden = !active;
    this.stopBtn.disabled = active?.status === 'cancelling';
    this.othersStopBtn.hidden = !active || !this.othersOperates;
    this.othersStopBtn.disabled = this.stopBtn.disabled;
    this.sendBtn.disabled = Boolean(active) || this.sending;
    if (!active) {
      this.statusEl.replaceChildren();
      this.statusEl.hidden = true;
      return;
    }
    this.statusEl.hidden = false;
    const running = [...this.tools.values()].find((t) => t.runId === active.id && t.status === 'running');
    const what = active.status === 'cancelling' ? 'stopping…'
      : running ? `running ${running.name}`
        : this.streaming ? 'writing'
          : active.status === 'running' ? 'thinking' : active.status;
    replace(this.statusEl,
      h('span', { class: 'dot st-running pulse', 'aria-hidden': 'true' }, '●'),
      ` ${what}`,
      active.model ? h('span', { class: 'muted' }, ` · ${active.model}`) : null);
  }

  onKey(e) {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      this.sendMessage();
    } else if (e.key === 'Escape' && this.activeRun()) {
      e.preventDefault();
      this.stop();
    }
  }

  showError(text) {
    this.errorEl.hidden = !text;
    this.errorEl.textContent = text || '';
  }

  async sendMessage() {
    const prompt = this.input.value;
    if (!prompt.trim()) {
      this.showError('Write a message first.');
      return;
    }
    if (this.activeRun()) {
      this.showError('A turn is still running: wait for it, or stop it (Esc).');
      return;
    }
    this.sending = true;
    this.sendBtn.disabled = true;
    this.showError(null);
    try {
      await api.send(this.id, prompt);
      this.input.value = '';
    } catch (e) {
      this.showError(e.code === 'session_busy'
        ? 'A turn is still running: wait for it, or stop it (Esc).'
        : `Not sent: ${e.message}`);
    } finally {
      this.sending = false;
      this.renderComposer();
    }
  }

  async stop() {
    this.stopBtn.disabled = true;
    this.othersStopBtn.disabled = true;
    try {
      await api.cancel(this.id);
    } catch (e) {
      this.showError(`Could not stop the turn: ${e.message}`);
      if (!this.othersEl.hidden) this.othersText.textContent = `Could not stop the turn: ${e.message}`;
      this.stopBtn.disabled = false;
      this.othersStopBtn.disabled = false;
    }
  }

  /** `/v1/me` answered: whose session this is can be told now. */
  onMe() {
    this.renderHeader();
  }

  focus() {
    if (this.form.hidden) this.scroller.focus();
    else this.input.focus();
  }
}
