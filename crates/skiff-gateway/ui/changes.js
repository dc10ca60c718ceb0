// The "Changes" view of a finished turn: the files it changed (status, +/− counts), the commits
// it made, and each file's diff, from `GET /v1/sessions/{id}/runs/{run}/changes` — the turn's
// checkpoint against the one before. Loaded when first opened, kept while the page lives.
// Diff lines keep their +/− marks, so colour is never the only sign of what changed.

import { h, replace, fmtInt } from './dom.js';
import { api } from './api.js';

const STATUS = {
  added: ['A', 'added'],
  modified: ['M', 'modified'],
  deleted: ['D', 'deleted'],
  type_changed: ['T', 'type changed'],
};
/** Open every file's diff at once when the turn is this small. */
const OPEN_FILES = 6;
const OPEN_LINES = 400;
/** Lines of one diff rendered before "Show all". */
const DIFF_LINES = 1500;
/** git's per-file header lines: the file's row already names the path. */
const HEADER = /^(diff --git |index |--- |\+\+\+ )/;

/** The patch's lines without git's headers (only before a file's first hunk: after it, a line
 * like `--- x` is a removed `-- x`). */
function bodyLines(patch) {
  let header = false;
  return patch.replace(/\n$/, '').split('\n').filter((line) => {
    if (line.startsWith('diff --git ')) header = true;
    else if (line.startsWith('@@')) header = false;
    return !(header && HEADER.test(line));
  });
}

let panels = 0;

function lineClass(line) {
  if (line.startsWith('@@')) return 'd-hunk';
  if (/^(new file mode|deleted file mode|old mode|new mode|Binary files )/.test(line)) return 'd-meta';
  if (line.startsWith('+')) return 'd-add';
  if (line.startsWith('-')) return 'd-del';
  if (line.startsWith('\\')) return 'd-meta';
  return 'd-ctx';
}

export class TurnChanges {
  constructor(sessionId, runId) {
    this.sessionId = sessionId;
    this.runId = runId;
    this.open = false;
    this.data = null;
    panels += 1;
    const panelId = `changes-${panels}`;
    this.button = h('button', {
      type: 'button',
      class: 'link-btn changes-btn',
      'aria-expanded': 'false',
      'aria-controls': panelId,
      onclick: () => this.toggle(),
    }, 'Changes');
    this.panel = h('section', { class: 'changes', id: panelId, hidden: true, 'aria-label': 'Changes of this turn' });
    this.el = [this.button, this.panel];
  }

  toggle() {
    this.open = !this.open;
    this.button.setAttribute('aria-expanded', String(this.open));
    this.button.textContent = this.open ? 'Hide changes' : 'Changes';
    this.panel.hidden = !this.open;
    if (this.open && !this.data && !this.loading) this.load();
  }

  async load() {
    this.loading = true;
    this.panel.setAttribute('aria-busy', 'true');
    replace(this.panel, h('p', { class: 'muted' }, 'Loading the changes…'));
    try {
      this.data = await api.turnChanges(this.sessionId, this.runId);
      this.render();
    } catch (e) {
      replace(this.panel, h('p', { class: 'changes-error', role: 'alert' }, `Could not load the changes: ${e.message}`));
    } finally {
      this.loading = false;
      this.panel.removeAttribute('aria-busy');
    }
  }

  render() {
    const d = this.data;
    const files = d.files || [];
    if (!files.length && !d.commits?.length) {
      replace(this.panel, h('p', { class: 'muted' }, 'No files changed in this turn.'));
      return;
    }
    const summary = [
      `${fmtInt(files.length)} file${files.length === 1 ? '' : 's'} changed`,
      h('span', { class: 'd-add-text' }, `+${fmtInt(d.insertions)}`),
      h('span', { class: 'd-del-text' }, `−${fmtInt(d.deletions)}`),
      d.commits?.length ? `${d.commits.length} commit${d.commits.length === 1 ? '' : 's'}` : null,
    ].filter(Boolean);
    const lines = files.reduce((n, f) => n + (f.patch ? f.patch.split('\n').length : 0), 0);
    const openAll = files.length <= OPEN_FILES && lines <= OPEN_LINES;
    replace(this.panel,
      h('p', { class: 'changes-summary' }, summary.flatMap((part, i) => (i ? [' · ', part] : [part]))),
      d.commits?.length ? h('ul', { class: 'commits', 'aria-label': 'Commits' }, d.commits.map((c) => h('li', {},
        h('span', { class: 'mono muted', title: c.commit }, c.commit.slice(0, 12)), ' ', c.summary))) : null,
      files.length ? h('ul', { class: 'change-files', 'aria-label': 'Files changed' }, files.map((f) => this.fileEl(f, openAll))) : null);
  }

  fileEl(f, open) {
    const [letter, label] = STATUS[f.status] || ['?', f.status];
    const body = h('div', { class: 'change-body', hidden: true });
    const head = h('button', { type: 'button', class: 'change-head', 'aria-expanded': 'false' },
      h('span', { class: 'chev', 'aria-hidden': 'true' }, '▸'),
      h('span', { class: `cstatus cs-${f.status}`, title: label }, letter, h('span', { class: 'sr-only' }, ` ${label}`)),
      h('span', { class: 'cpath', title: f.path }, f.path),
      h('span', { class: 'ccount' }, f.binary ? 'binary'
        : [h('span', { class: 'd-add-text' }, `+${fmtInt(f.insertions)}`), ' ', h('span', { class: 'd-del-text' }, `−${fmtInt(f.deletions)}`)]));
    const li = h('li', { class: 'change-file', dataset: { path: f.path, status: f.status } }, head, body);
    const show = (yes) => {
      head.setAttribute('aria-expanded', String(yes));
      head.firstChild.textContent = yes ? '▾' : '▸';
      body.hidden = !yes;
      if (yes && !body.firstChild) replace(body, this.diffEl(f));
    };
    head.addEventListener('click', () => show(body.hidden));
    if (open) show(true);
    return li;
  }

  diffEl(f, all = false) {
    if (!f.patch) {
      return h('p', { class: 'muted' }, f.omitted || (f.binary ? 'Binary file, not shown.' : 'No diff for this file.'));
    }
    const lines = bodyLines(f.patch);
    const shown = all ? lines : lines.slice(0, DIFF_LINES);
    const pre = h('pre', { class: 'diff', tabindex: '0', 'aria-label': `Diff of ${f.path}` },
      shown.map((line) => h('span', { class: lineClass(line) }, `${line}\n`)));
    if (shown.length === lines.length) return pre;
    const more = h('button', { type: 'button', class: 'link-btn' }, `Show all (${fmtInt(lines.length)} lines)`);
    const wrap = h('div', {}, pre, more);
    more.addEventListener('click', () => wrap.replaceWith(this.diffEl(f, true)));
    return wrap;
  }
}
