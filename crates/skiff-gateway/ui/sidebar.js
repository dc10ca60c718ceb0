// The session list: grouped Running / Waiting for you / Recent, newest activity first, patched
// live from the `/v1/events` stream and re-rendered at most once per animation frame.

import { h, replace, fmtAgo, isoTime, frameBatcher, otherOwner } from './dom.js';
import { api } from './api.js';

const ACTIVE_RUN = ['queued', 'starting', 'running', 'cancelling'];
const FAILED_RUN = ['failed', 'timed_out', 'orphaned'];
/**
 * Placement states shown instead of the run state: being set up or torn down, or without a box
 * (parked: it gave its box back between turns; the next message places it again).
 */
const PLACEMENT_STATES = ['requested', 'provisioning', 'syncing', 'setup', 'starting', 'draining', 'handing_off', 'reconciling', 'parked', 'reclaimed', 'failed_over', 'failed'];

export const STATE_SYMBOL = {
  running: '●',
  waiting: '◐',
  idle: '○',
  failed: '✕',
  provisioning: '◌',
  requested: '◌',
  syncing: '◌',
  starting: '◌',
  draining: '◌',
  handing_off: '◌',
  reconciling: '◌',
  parked: '◇',
  reclaimed: '⊘',
  failed_over: '◌',
};

/** Where a session runs: `gateway`, or `worker · <environment>` with a placement state. */
export function placementOf(s) {
  const raw = typeof s.placement === 'string' ? s.placement : 'local';
  // A session pulled back keeps its worker record (profile, epoch) but runs here.
  if (raw === 'local') return { kind: 'gateway', label: 'gateway', state: null };
  // `placement` is the worker placement's state; `worker` says where it runs.
  const env = s.worker?.environment_id || null;
  const word = PLACEMENT_STATES.find((w) => raw === w) || null;
  return { kind: 'worker', label: env ? `worker · ${env}` : `worker · ${s.worker?.profile || 'pending'}`, env, state: word };
}

/** running, waiting, idle, failed — or a placement state (provisioning, syncing, parked…). */
export function sessionState(s) {
  const p = placementOf(s);
  if (p.state && PLACEMENT_STATES.includes(p.state)) return p.state;
  const status = s.last_run?.status;
  if (ACTIVE_RUN.includes(status)) return 'running';
  if (status && status.startsWith('waiting')) return 'waiting';
  if (FAILED_RUN.includes(status)) return 'failed';
  return 'idle';
}

/** A fan-out group's state: running while any attempt is, failed when every one failed. */
export function groupState(attempts) {
  const states = attempts.map(sessionState);
  const live = states.find((st) => group(st) === 'running');
  if (live) return live;
  if (states.includes('waiting')) return 'waiting';
  if (states.every((st) => st === 'failed')) return 'failed';
  return 'idle';
}

export function activityAt(s) {
  return Math.max(s.updated_at_ms || 0, s.last_run?.created_at_ms || 0, s.last_run?.finished_at_ms || 0);
}

function group(state) {
  if (state === 'running' || ['requested', 'provisioning', 'syncing', 'setup', 'starting', 'draining', 'handing_off', 'reconciling', 'failed_over'].includes(state)) return 'running';
  if (state === 'waiting') return 'waiting';
  return 'recent';
}

const GROUPS = [
  ['running', 'Running'],
  ['waiting', 'Waiting for you'],
  ['recent', 'Recent'],
];

const SEEN_KEY = 'skiff.seen';
/** The live list starts with the newest page (the gateway's SESSION_PAGE_DEFAULT). */
const PAGE = 100;

export class Sidebar {
  constructor(container, search) {
    this.container = container;
    this.search = search;
    this.sessions = new Map();
    this.ready = false;
    this.current = null;
    // Older sessions than the live list's first page: `undefined` until asked, then the
    // session to page after (`null`: there are no more).
    this.older = undefined;
    this.loadingOlder = false;
    this.olderError = null;
    // What this browser has seen of each session (updated_at_ms), for unread marks. Not a
    // secret; kept across reloads.
    try {
      this.seen = JSON.parse(localStorage.getItem(SEEN_KEY) || '{}');
    } catch {
      this.seen = {};
    }
    this.schedule = frameBatcher(() => this.render());
    search.addEventListener('input', () => this.schedule());
    this.clock = setInterval(() => this.schedule(), 30_000);
  }

  saveSeen() {
    try {
      localStorage.setItem(SEEN_KEY, JSON.stringify(this.seen));
    } catch {
      // Storage full or disabled: unread marks just reset on reload.
    }
  }

  upsert(session) {
    if (!this.ready && this.seen[session.id] === undefined) {
      // First sight in this browser: what already happened is not "new".
      this.seen[session.id] = session.updated_at_ms;
    }
    this.sessions.set(session.id, session);
    if (session.id === this.current) this.markSeen(session.id);
    this.schedule();
  }

  setReady() {
    this.ready = true;
    this.saveSeen();
    this.schedule();
  }

  setCurrent(id) {
    this.current = id;
    if (id) this.markSeen(id);
    this.schedule();
  }

  markSeen(id) {
    const s = this.sessions.get(id);
    if (!s) return;
    this.seen[id] = s.updated_at_ms;
    this.saveSeen();
  }

  unread(s) {
    return s.id !== this.current && s.updated_at_ms > (this.seen[s.id] ?? 0);
  }

  visible() {
    const q = this.search.value.trim().toLowerCase();
    return [...this.sessions.values()]
      .filter((s) => !q || s.title.toLowerCase().includes(q) || s.id.includes(q))
      .sort((a, b) => activityAt(b) - activityAt(a));
  }

  render() {
    const list = this.visible();
    if (!this.ready && list.length === 0) {
      replace(this.container, h('p', { class: 'muted pad' }, 'Loading sessions…'));
      return;
    }
    if (list.length === 0) {
      replace(
        this.container,
        h('p', { class: 'muted pad' }, this.search.value ? 'No session matches.' : 'No sessions yet. Start one with New session (n).'),
      );
      return;
    }
    const focusedId = document.activeElement?.dataset?.sessionId;
    const now = Date.now();
    // Sessions an agent dispatched sit under the session that dispatched them (in its group);
    // one whose parent is not listed stands on its own.
    const shown = new Set(list.map((s) => s.id));
    const childrenOf = (s) => list.filter((c) => c.parent_id === s.id);
    const item = (s) => {
      const children = childrenOf(s);
      return h('li', {}, this.row(s, now),
        children.length ? h('ul', { class: 'rows children', 'aria-label': `Dispatched by ${s.title || s.id}` }, children.map(item)) : null);
    };
    // A fan-out's attempts sit under one row for their group (where its newest attempt
    // would be); the group row opens the comparison.
    const siblings = new Map();
    for (const s of list) {
      if (!s.group_id) continue;
      if (!siblings.has(s.group_id)) siblings.set(s.group_id, []);
      siblings.get(s.group_id).push(s);
    }
    const stateOf = (s) => (s.group_id ? groupState(siblings.get(s.group_id)) : sessionState(s));
    const entry = (s) => (s.group_id ? this.groupItem(siblings.get(s.group_id), now) : item(s));
    const tops = list.filter((s) => (!s.parent_id || !shown.has(s.parent_id))
      && (!s.group_id || siblings.get(s.group_id)[0] === s));
    const sections = [];
    for (const [key, label] of GROUPS) {
      const rows = tops.filter((s) => group(stateOf(s)) === key);
      if (rows.length === 0) continue;
      const headingId = `group-${key}`;
      sections.push(
        h('section', { class: 'group', 'aria-labelledby': headingId },
          h('h2', { id: headingId, class: 'group-title' }, label),
          h('ul', { class: 'rows' }, rows.map(entry))),
      );
    }
    replace(this.container, ...sections, this.olderButton());
    if (focusedId) this.container.querySelector(`[data-session-id="${CSS.escape(focusedId)}"]`)?.focus();
  }

  /** "Show older sessions" while the gateway may hold more than the sidebar lists. */
  olderButton() {
    const more = this.older === undefined ? this.sessions.size >= PAGE : this.older !== null;
    if (!this.ready || !more) return null;
    const button = h('button', { type: 'button', class: 'older', disabled: this.loadingOlder || null },
      this.loadingOlder ? 'Loading older sessions…' : 'Show older sessions');
    button.addEventListener('click', () => this.loadOlder());
    return h('div', { class: 'older-wrap' }, button,
      this.olderError ? h('p', { class: 'older-error', role: 'alert' }, this.olderError) : null);
  }

  async loadOlder() {
    if (this.loadingOlder) return;
    this.loadingOlder = true;
    this.schedule();
    try {
      const after = this.older ?? this.oldest()?.id;
      const page = await api.sessions(PAGE, after);
      for (const s of page.sessions) {
        if (this.sessions.has(s.id)) continue;
        // Old news, not unread.
        if (this.seen[s.id] === undefined) this.seen[s.id] = s.updated_at_ms;
        this.upsert(s);
      }
      this.saveSeen();
      this.older = page.next ?? null;
      this.olderError = null;
    } catch (e) {
      this.olderError = `Could not load older sessions: ${e.message}`;
    } finally {
      this.loadingOlder = false;
      this.schedule();
    }
  }

  /** The last session of the gateway's order (least recent activity, then highest id). */
  oldest() {
    let last = null;
    for (const s of this.sessions.values()) {
      if (!last || s.updated_at_ms < last.updated_at_ms || (s.updated_at_ms === last.updated_at_ms && s.id > last.id)) last = s;
    }
    return last;
  }

  row(s, now) {
    const state = sessionState(s);
    const p = placementOf(s);
    const unread = this.unread(s);
    return h('a', {
      class: `srow${s.id === this.current ? ' current' : ''}`,
      href: `#/s/${s.id}`,
      'aria-current': s.id === this.current ? 'page' : null,
      dataset: { sessionId: s.id, state },
    },
    h('span', { class: `dot st-${state}`, 'aria-hidden': 'true' }, STATE_SYMBOL[state] || '○'),
    h('span', { class: 'stitle' }, s.title || s.id,
      otherOwner(s) ? h('span', { class: 'sowner', title: `${otherOwner(s)}'s session` }, ` · ${otherOwner(s)}`) : null),
    h('span', { class: 'sr-only' }, `, ${state}, runs on ${p.label}${unread ? ', unread' : ''}`),
    unread ? h('span', { class: 'unread', title: 'New activity', 'aria-hidden': 'true' }) : null,
    h('time', { class: 'ago', datetime: isoTime(activityAt(s)), title: new Date(activityAt(s)).toLocaleString() }, fmtAgo(activityAt(s), now)),
    h('span', { class: `badge pl-${p.kind}`, title: p.label, 'aria-hidden': 'true' }, p.kind === 'gateway' ? 'G' : 'W'));
  }

  /** A fan-out group's row (opens its comparison) with its attempts, oldest first, under it. */
  groupItem(attempts, now) {
    const ordered = [...attempts].sort((a, b) => a.created_at_ms - b.created_at_ms || (a.id < b.id ? -1 : 1));
    const first = ordered[0];
    const id = first.group_id;
    const state = groupState(ordered);
    const at = Math.max(...ordered.map(activityAt));
    const row = h('a', {
      class: `srow grow${id === this.current ? ' current' : ''}`,
      href: `#/g/${id}`,
      'aria-current': id === this.current ? 'page' : null,
      dataset: { groupId: id, state },
    },
    h('span', { class: `dot st-${state}`, 'aria-hidden': 'true' }, STATE_SYMBOL[state] || '○'),
    h('span', { class: 'stitle' }, first.title || id),
    h('span', { class: 'sr-only' }, `, fan-out of ${ordered.length} attempts, ${state}`),
    h('time', { class: 'ago', datetime: isoTime(at), title: new Date(at).toLocaleString() }, fmtAgo(at, now)),
    h('span', { class: 'badge pl-worker', title: `${ordered.length} attempts on worker boxes` }, `×${ordered.length}`));
    return h('li', {}, row,
      h('ul', { class: 'rows children attempts', 'aria-label': `Attempts of ${first.title || id}` },
        ordered.map((s, i) => h('li', {}, this.row({ ...s, title: `Attempt ${i + 1}` }, now)))));
  }

  /** Moves keyboard focus to the next (+1) or previous (-1) session row. */
  move(step) {
    const rows = [...this.container.querySelectorAll('a.srow')];
    if (rows.length === 0) return;
    const at = rows.indexOf(document.activeElement);
    const from = at >= 0 ? at : rows.findIndex((r) => r.dataset.sessionId === this.current);
    const next = from < 0 ? (step > 0 ? 0 : rows.length - 1) : Math.max(0, Math.min(rows.length - 1, from + step));
    rows[next].focus();
  }
}
