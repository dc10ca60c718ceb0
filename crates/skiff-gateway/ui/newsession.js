// A new session: the composer with a target bar — where it runs (the gateway, or a worker
// profile from the configuration), the workspace, and the model.

import { h, replace } from './dom.js';
import { api } from './api.js';

const LAST_KEY = 'skiff.new';

export class NewSessionView {
  constructor(ctx) {
    this.ctx = ctx;
    let last = {};
    try {
      last = JSON.parse(localStorage.getItem(LAST_KEY) || '{}');
    } catch {
      last = {};
    }
    this.profiles = [];
    this.whereGateway = h('input', { type: 'radio', name: 'where', value: 'gateway', id: 'where-gateway', checked: true });
    this.whereWorker = h('input', { type: 'radio', name: 'where', value: 'worker', id: 'where-worker', disabled: true });
    this.profileSel = h('select', { id: 'profile', 'aria-label': 'Worker profile', disabled: true },
      h('option', { value: '' }, 'loading profiles…'));
    this.policyEl = h('p', { class: 'policy muted', id: 'target-policy', 'aria-live': 'polite' }, 'Runs on the gateway host, in its own worktree.');
    this.workspace = h('input', {
      id: 'workspace', type: 'text', required: true, spellcheck: 'false', autocomplete: 'off',
      placeholder: '/path/to/repository or https://git.example.com/app.git', value: last.workspace || '', class: 'mono',
    });
    const models = [...new Set([...ctx.sidebar.sessions.values()].map((s) => s.model?.ref).filter(Boolean))];
    this.model = h('input', {
      id: 'model', type: 'text', spellcheck: 'false', autocomplete: 'off', list: 'model-list',
      placeholder: 'default', value: last.model || '', class: 'mono',
    });
    this.prompt = h('textarea', { id: 'new-prompt', rows: '5', required: true, placeholder: 'What should the agent do?', 'aria-label': 'First message' });
    this.errorEl = h('p', { class: 'form-error', role: 'alert', hidden: true });
    this.submit = h('button', { type: 'submit', class: 'primary' }, 'Start session');
    for (const el of [this.whereGateway, this.whereWorker]) el.addEventListener('change', () => this.renderPolicy());
    this.profileSel.addEventListener('change', () => {
      // Picking a profile means "run it there".
      this.whereWorker.checked = true;
      this.renderPolicy();
    });
    this.prompt.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        this.form.requestSubmit();
      }
    });
    this.form = h('form', { class: 'composer new', 'aria-labelledby': 'new-title', onsubmit: (e) => { e.preventDefault(); this.create(); } },
      h('div', { class: 'target-bar', role: 'group', 'aria-label': 'Target' },
        h('fieldset', { class: 'where' },
          h('legend', {}, 'Where'),
          h('label', { class: 'seg' }, this.whereGateway, ' Gateway'),
          h('label', { class: 'seg' }, this.whereWorker, ' Worker'),
          this.profileSel),
        h('label', { class: 'field grow' }, h('span', {}, 'Workspace'), this.workspace),
        h('label', { class: 'field' }, h('span', {}, 'Model'), this.model,
          h('datalist', { id: 'model-list' }, models.map((m) => h('option', { value: m }))))),
      this.policyEl,
      this.prompt,
      h('div', { class: 'composer-bar' },
        h('span', { class: 'hint' }, h('kbd', {}, 'Ctrl'), '+', h('kbd', {}, '↵'), ' start'),
        this.submit),
      this.errorEl);
    this.el = h('section', { class: 'chat new-session' },
      h('header', { class: 'chat-head' },
        h('div', { class: 'title-row' }, h('h1', { id: 'new-title', class: 'chat-title' }, 'New session'))),
      h('div', { class: 'transcript intro' },
        h('div', { class: 'empty' },
          h('p', {}, 'Choose where the session runs, the workspace it works on (a git repository or directory on the gateway host, or a remote repository\'s URL — add #REF for a branch, tag or commit — which the gateway clones with its own credentials), and the model. The agent works in its own worktree on branch ', h('code', {}, 'skiff/<session>'), '; your checkout is never touched.'))),
      this.form);
    this.loadProfiles();
  }

  async loadProfiles() {
    try {
      const list = await api.profiles();
      this.profiles = list?.profiles || [];
    } catch (e) {
      // 404: this gateway has no worker support yet; the same calm state as "none configured".
      this.profiles = [];
      if (e.status && e.status !== 404) this.profileError = e.message;
    }
    if (this.profiles.length === 0) {
      replace(this.profileSel, h('option', { value: '' }, 'no worker profiles configured'));
      this.profileSel.disabled = true;
      this.whereWorker.disabled = true;
    } else {
      replace(this.profileSel, this.profiles.map((p) => h('option', { value: p.name }, `${p.name} (${p.provider})`)));
      this.profileSel.disabled = false;
      this.whereWorker.disabled = false;
    }
    this.renderPolicy();
  }

  selectedProfile() {
    if (!this.whereWorker.checked) return null;
    return this.profiles.find((p) => p.name === this.profileSel.value) || null;
  }

  renderPolicy() {
    const p = this.selectedProfile();
    if (!p) {
      this.policyEl.textContent = this.profiles.length === 0
        ? `Runs on the gateway host, in its own worktree. No worker profiles configured${this.profileError ? ` (${this.profileError})` : ''}.`
        : 'Runs on the gateway host, in its own worktree.';
      return;
    }
    this.policyEl.textContent = `Runs on a ${p.provider} worker (profile ${p.name}) · idle timeout ${p.idle_timeout} · TTL ${p.ttl}${p.development_only ? ' · development only: not isolated' : ''}`;
  }

  async create() {
    const workspace = this.workspace.value.trim();
    const prompt = this.prompt.value;
    // A remote repository: a URL (`https://…`, `ssh://…`, `git@host:path`), `#REF` after it.
    const remote = /^[a-z][a-z0-9+.-]*:\/\//i.test(workspace) || /^[\w.-]+@[\w.-]+:[^/]/.test(workspace);
    if (!remote && !workspace.startsWith('/')) {
      this.showError('The workspace must be an absolute path on the gateway host, e.g. /home/you/src/app, or a repository URL, e.g. https://git.example.com/app.git.');
      this.workspace.focus();
      return;
    }
    if (!prompt.trim()) {
      this.showError('Write the first message: what should the agent do?');
      this.prompt.focus();
      return;
    }
    let body = { prompt, workspace };
    if (remote) {
      const at = workspace.lastIndexOf('#');
      const url = at > 0 ? workspace.slice(0, at) : workspace;
      const ref = at > 0 ? workspace.slice(at + 1) : '';
      body = { prompt, repo: ref ? { url, ref } : { url } };
    }
    const model = this.model.value.trim();
    if (model) body.model = model;
    const profile = this.selectedProfile();
    if (profile) body.profile = profile.name;
    this.submit.disabled = true;
    this.showError(null);
    try {
      const started = await api.create(body);
      try {
        localStorage.setItem(LAST_KEY, JSON.stringify({ workspace, model }));
      } catch {
        // Only a convenience.
      }
      this.ctx.sidebar.upsert(started.session);
      location.hash = `#/s/${started.session.id}`;
    } catch (e) {
      this.showError(`Could not start the session: ${e.message}`);
      this.submit.disabled = false;
    }
  }

  showError(text) {
    this.errorEl.hidden = !text;
    this.errorEl.textContent = text || '';
  }

  focus() {
    (this.workspace.value ? this.prompt : this.workspace).focus();
  }

  destroy() {}
}
