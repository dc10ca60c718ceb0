// A fan-out group (#/g/<grp_…>): its attempts side by side — status, diffstat, the last exec's
// exit code ("tests") and the final message's first line — with Pick behind a confirmation.
// Refreshed while any attempt still runs a turn. What `skiff session compare` shows.
//
// Ids are whole in the table (monospace; a session id is 20 characters), so the attempt column
// never truncates; the final message takes the rest of the width and is cut with an ellipsis,
// its whole text on hover.

import { h, replace, fmtInt } from './dom.js';
import { api } from './api.js';

const REFRESH_MS = 3000;
const RUNNING = ['queued', 'starting', 'running', 'cancelling', 'waiting_input', 'waiting_approval'];
const STATE_CLASS = { succeeded: 'idle', failed: 'failed', timed_out: 'failed', orphaned: 'failed', cancelled: 'idle' };

export class GroupView {
  constructor(id, ctx) {
    this.id = id;
    this.ctx = ctx;
    this.view = null;
    this.error = null;
    this.body = h('div', { class: 'group-body', 'aria-live': 'polite' }, h('p', { class: 'muted pad' }, 'Loading attempts…'));
    this.title = h('h1', { id: 'group-title', class: 'chat-title', tabindex: '-1' }, 'Attempts');
    this.meta = h('div', { class: 'chat-meta' }, h('span', { class: 'mono' }, id));
    this.el = h('section', { class: 'chat group-view', 'aria-labelledby': 'group-title' },
      h('header', { class: 'chat-head' }, h('div', { class: 'title-row' }, this.title), this.meta),
      h('div', { class: 'transcript' }, this.body));
    this.refresh();
    this.timer = setInterval(() => {
      if (this.running()) this.refresh();
    }, REFRESH_MS);
  }

  destroy() {
    clearInterval(this.timer);
  }

  focus() {
    this.title.focus();
  }

  running() {
    return !this.view || this.view.attempts.some((a) => RUNNING.includes(a.status || 'queued'));
  }

  async refresh() {
    try {
      this.view = await api.group(this.id);
      this.error = null;
    } catch (e) {
      this.error = e.status === 404 ? `No group ${this.id}.` : `Could not load the group: ${e.message}`;
    }
    this.render();
  }

  render() {
    if (this.error) {
      replace(this.body, h('p', { class: 'form-error', role: 'alert' }, this.error));
      return;
    }
    const v = this.view;
    this.title.textContent = v.title || 'Attempts';
    const picked = v.picked
      ? h('span', { class: 'picked-note' }, '★ picked ', h('span', { class: 'mono' }, v.picked),
        v.result_branch ? [': its branch ', h('span', { class: 'mono' }, v.result_branch), ' is the group\'s result'] : ': its workspace is the group\'s result')
      : h('span', { class: 'muted' }, 'no attempt picked yet');
    replace(this.meta, h('span', { class: 'mono' }, v.id), ' · ', `${v.attempts.length} attempts`, ' · ', picked);
    const head = ['Attempt', 'Status', 'Files', '+/−', 'Tests', 'Final message', ''];
    const busy = this.running();
    const rows = v.attempts.map((a) => {
      const s = a.session;
      const status = a.status || 'queued';
      const parked = s.placement === 'parked';
      const cls = RUNNING.includes(status) ? 'running' : (STATE_CLASS[status] || 'idle');
      const d = a.diff;
      const tests = a.last_exec_exit === null || a.last_exec_exit === undefined
        ? h('span', { class: 'muted' }, '—')
        : h('span', { class: `tests ${a.last_exec_exit === 0 ? 'pass' : 'fail'}` }, a.last_exec_exit === 0 ? '✓ exit 0' : `✕ exit ${a.last_exec_exit}`);
      const action = a.picked
        ? h('span', { class: 'tag picked' }, '★ Picked')
        : v.picked
          ? null
          : h('button', {
            type: 'button',
            class: 'primary small needs-write',
            disabled: busy || null,
            title: busy ? 'Wait for every attempt to finish' : null,
            'aria-label': `Pick ${s.id}…`,
            onclick: () => this.confirmPick(a),
          }, 'Pick');
      const cells = [
        ['Attempt', h('a', { href: `#/s/${s.id}`, class: 'mono id', title: s.id }, s.id)],
        ['Status', h('span', { class: `state st-${cls}` }, parked ? `${status} · parked` : status)],
        ['Files', d ? fmtInt(d.files) : h('span', { class: 'muted', title: a.diff_error || '' }, '?')],
        ['+/−', d ? h('span', { class: 'mono' }, h('span', { class: 'ins' }, `+${fmtInt(d.insertions)}`), ' ', h('span', { class: 'del' }, `−${fmtInt(d.deletions)}`)) : '—'],
        ['Tests', tests],
        ['Final message', h('span', { class: 'final', title: a.final_line || '' }, a.final_line || '—')],
        ['', action],
      ];
      return h('tr', { class: a.picked ? 'picked' : null, dataset: { sessionId: s.id } },
        cells.map(([label, value]) => h('td', { 'data-label': label, class: ['Files', '+/−'].includes(label) ? 'num' : null }, value)));
    });
    replace(this.body, h('table', { class: 'env-table group-table' },
      h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col', class: ['Files', '+/−'].includes(c) ? 'num' : null }, c)))),
      h('tbody', {}, rows)));
  }

  confirmPick(attempt) {
    const dialog = document.getElementById('pick');
    const others = this.view.attempts.length - 1;
    dialog.querySelector('.pick-text').textContent = `Pick ${attempt.session.id} as the result of this group? `
      + `Its branch becomes the group's result; ${others === 1 ? 'the other attempt is' : `the ${others} other attempts are`} parked `
      + '(their boxes go back to the pool; they stay readable).';
    dialog.returnValue = '';
    dialog.onclose = async () => {
      if (dialog.returnValue !== 'pick') return;
      try {
        const done = await api.pick(attempt.session.id);
        this.view = done.group;
        this.error = null;
        this.render();
        document.getElementById('announcer').textContent = `Picked ${attempt.session.id}; ${done.parked.length} attempts parked.`;
      } catch (e) {
        replace(this.body, h('p', { class: 'form-error', role: 'alert' }, `Could not pick ${attempt.session.id}: ${e.message}`));
      }
    };
    dialog.showModal();
    dialog.querySelector('[value=cancel]')?.focus();
  }
}
