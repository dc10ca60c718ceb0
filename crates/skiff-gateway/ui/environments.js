// Environments (leased worker boxes): state, provider, lease, age, idle time, attached
// sessions, tunnel and controlled-egress accounting, with a confirmed, staged destroy.
// Refreshed every few seconds while open. A gateway without environment support (404) gets
// the same calm empty state as one with no environments.

import { h, replace, fmtAgo, fmtInt, fmtBytes } from './dom.js';
import { api } from './api.js';

const REFRESH_MS = 4000;
const STATE_CLASS = {
  attached: 'running', ready: 'idle', idle: 'idle', requested: 'provisioning', provisioning: 'provisioning',
  bootstrapping: 'provisioning', draining: 'provisioning', destroying: 'provisioning', destroyed: 'idle',
  failed: 'failed', orphaned: 'failed',
};

export class EnvironmentsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.body = h('div', { class: 'env-body', 'aria-live': 'polite' }, h('p', { class: 'muted pad' }, 'Loading environments…'));
    this.el = h('section', { class: 'chat envs', 'aria-labelledby': 'env-title' },
      h('header', { class: 'chat-head' },
        h('div', { class: 'title-row' }, h('h1', { id: 'env-title', class: 'chat-title' }, 'Environments'))),
      h('div', { class: 'transcript' }, this.body));
    this.refresh();
    this.timer = setInterval(() => this.refresh(), REFRESH_MS);
  }

  destroy() {
    clearInterval(this.timer);
  }

  focus() {
    this.el.querySelector('h1')?.focus?.();
  }

  async refresh() {
    let envs;
    try {
      envs = (await api.environments())?.environments || [];
    } catch (e) {
      if (e.status === 404) envs = [];
      else {
        replace(this.body, h('p', { class: 'form-error' }, `Could not load environments: ${e.message}`));
        return;
      }
    }
    this.ctx.setWorkers(envs.filter((e) => e.state !== 'destroyed').length);
    if (envs.length === 0) {
      replace(this.body, h('div', { class: 'empty' },
        h('p', {}, 'No environments.'),
        h('p', { class: 'muted' }, 'Worker environments appear here once a worker profile is configured and a session runs on one.')));
      return;
    }
    const now = Date.now();
    const head = ['Environment', 'State', 'Provider', 'Lease', 'Age · idle', 'Sessions', 'Tunnel', 'Requests', 'Tokens in / out', 'Bytes in / out', 'GW tools', ''];
    const numeric = new Set(['Requests', 'Tokens in / out', 'Bytes in / out', 'GW tools']);
    const rows = envs.map((env) => {
      const a = env.accounting || {};
      const cls = STATE_CLASS[env.state] || 'idle';
      const destroyable = !['destroying', 'destroyed'].includes(env.state);
      const cells = [
        ['Environment', h('span', { class: 'mono' }, env.id, env.development_only ? h('span', { class: 'tag warn', title: 'Not isolated: for development only' }, 'dev') : null)],
        ['State', h('span', { class: `state st-${cls}`, title: env.error || env.state }, env.state)],
        ['Provider', h('span', { title: `profile ${env.profile}` }, env.provider)],
        ['Lease', h('span', { class: 'mono' }, env.lease_id || '—')],
        ['Age · idle', h('span', { title: `created ${new Date(env.created_at_ms).toLocaleString()}, last used ${new Date(env.last_used_at_ms).toLocaleString()}` },
          `${fmtAgo(env.created_at_ms, now)} · ${fmtAgo(env.last_used_at_ms, now)}`)],
        // Short ids keep the table narrow; the full id is the link's title.
        ['Sessions', env.attached_sessions.length
          ? env.attached_sessions.map((id, i) => [i ? ' ' : null, h('a', { href: `#/s/${id}`, class: 'mono', title: id, 'aria-label': id }, `…${id.slice(-6)}`)])
          : '—'],
        ['Tunnel', env.tunnel],
        ['Requests', fmtInt(a.model_requests)],
        ['Tokens in / out', `${fmtInt(a.input_tokens)} / ${fmtInt(a.output_tokens)}`],
        ['Bytes in / out', `${fmtBytes(a.bytes_in)} / ${fmtBytes(a.bytes_out)}`],
        ['GW tools', fmtInt(a.gateway_tool_calls)],
        ['', destroyable ? h('button', { type: 'button', class: 'danger small', 'aria-label': `Destroy ${env.id}…`, onclick: () => this.confirmDestroy(env) }, 'Destroy') : null],
      ];
      return h('tr', {}, cells.map(([label, v]) => h('td', { 'data-label': label, class: numeric.has(label) ? 'num' : null }, v)));
    });
    replace(this.body, h('table', { class: 'env-table' },
      h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col', class: numeric.has(c) ? 'num' : null, title: c === 'Requests' ? 'Model requests through the gateway' : c === 'GW tools' ? 'Gateway-tool calls' : null }, c)))),
      h('tbody', {}, rows)));
  }

  confirmDestroy(env) {
    const dialog = document.getElementById('confirm');
    const text = dialog.querySelector('.confirm-text');
    text.textContent = `Destroy ${env.id} (${env.provider}, lease ${env.lease_id || 'not yet assigned'})? Its ${env.attached_sessions.length} attached session(s) lose their worker. Removal is staged: drain, then destroy.`;
    dialog.returnValue = '';
    dialog.onclose = async () => {
      if (dialog.returnValue !== 'destroy') return;
      try {
        await api.destroyEnvironment(env.id);
      } catch (e) {
        replace(this.body, h('p', { class: 'form-error', role: 'alert' }, `Could not destroy ${env.id}: ${e.message}`));
        return;
      }
      this.refresh();
    };
    dialog.showModal();
    dialog.querySelector('[value=cancel]')?.focus();
  }
}
