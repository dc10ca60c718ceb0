// Environments (leased worker boxes): state, provider, lease, age, idle time, attached
// sessions, tunnel and controlled-egress accounting, with a confirmed, staged destroy.
// Refreshed every few seconds while open. A gateway without environment support (404) gets
// the same calm empty state as one with no environments.
//
// Real ids are long (env_7q2kd9xm3v8fjw4p, ses_…, lbx_0123456789ab, skf-…@host:22): the table
// keeps environment, lease and session ids whole at 1280 px by putting related values on a
// second line of the same cell (provider under the environment, tunnel under the state, the SSH
// target under the lease, in over out, gateway-tool calls under model requests). Only the SSH
// target may wrap (before its `@`, else anywhere), so when room runs short it gives way and no
// id is ever cut; below that the table scrolls inside its box, never the page.

import { h, replace, fmtAgo, fmtInt, fmtBytes } from './dom.js';
import { api } from './api.js';

const REFRESH_MS = 4000;

/** An SSH target, breakable before its `@` (and anywhere, when even that is too wide). */
function sshTarget(target) {
  const at = target.lastIndexOf('@');
  return h('span', { class: 'mono ssh' }, at > 0 ? [target.slice(0, at), h('wbr'), target.slice(at)] : target);
}

/** Two values stacked, each with its label ("12,345 in" over "678 out"). */
function stacked(a, aLabel, b, bLabel) {
  return [h('span', { class: 'line' }, a, h('span', { class: 'muted' }, ` ${aLabel}`)),
    h('span', { class: 'line' }, b, h('span', { class: 'muted' }, ` ${bLabel}`))];
}

/** The egress proxy's per-host counters: a summary that opens into a table. */
function egressCell(hosts) {
  if (hosts.length === 0) return '—';
  const refused = hosts.reduce((n, x) => n + x.refused, 0);
  const names = new Set(hosts.map((x) => x.host)).size;
  // One short line per host and phase: a nested table would not fit the cell.
  return h('details', { class: 'egress' },
    h('summary', {}, `${names} host${names === 1 ? '' : 's'}`, refused ? h('span', { class: 'tag warn' }, `${fmtInt(refused)} refused`) : null),
    h('ul', { class: 'egress-hosts' }, hosts.map((x) => h('li', {},
      h('span', { class: 'mono' }, x.host), ' ',
      h('span', { class: 'muted' }, [
        x.phase,
        `${fmtInt(x.connections)} conn`,
        `${fmtBytes(x.bytes_in)} in`,
        `${fmtBytes(x.bytes_out)} out`,
        x.refused ? `${fmtInt(x.refused)} refused` : null,
      ].filter(Boolean).join(' · '))))));
}

const TUNNEL = { none: 'no tunnel', up: 'tunnel up', reconnecting: 'tunnel reconnecting…', down: 'tunnel down' };

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
    const head = ['Environment', 'State', 'Lease · SSH', 'Age · idle', 'Sessions', 'Calls', 'Tokens', 'Bytes', 'Network', ''];
    const numeric = new Set(['Calls', 'Tokens', 'Bytes']);
    const titles = {
      Environment: 'Environment id, then its provider and profile',
      State: 'State, then the worker tunnel',
      'Lease · SSH': 'The provider\'s lease id, then the SSH target',
      Calls: 'Model requests, then gateway-tool calls, through the gateway',
      Tokens: 'Model tokens in and out',
      Bytes: 'Bytes in and out through the gateway',
      Network: 'Hosts the box reached through the egress proxy, per phase (setup, agent)',
    };
    const rows = envs.map((env) => {
      const a = env.accounting || {};
      const cls = STATE_CLASS[env.state] || 'idle';
      const destroyable = !['destroying', 'destroyed'].includes(env.state);
      const cells = [
        ['Environment', [
          h('span', { class: 'line' }, h('span', { class: 'mono id' }, env.id)),
          h('span', { class: 'line sub', title: `provider ${env.provider}, profile ${env.profile}` },
            env.provider === env.profile ? env.provider : `${env.provider} · ${env.profile}`,
            env.development_only ? h('span', { class: 'tag warn', title: 'Not isolated: for development only' }, 'dev') : null)]],
        ['State', [
          h('span', { class: 'line' }, h('span', { class: `state st-${cls}`, title: env.error || env.state }, env.state)),
          h('span', { class: 'line sub' }, TUNNEL[env.tunnel] || `tunnel ${env.tunnel}`)]],
        ['Lease · SSH', [
          h('span', { class: 'line' }, env.lease_id ? h('span', { class: 'mono id' }, env.lease_id) : '—'),
          env.ssh_target ? h('span', { class: 'line sub' }, sshTarget(env.ssh_target)) : null]],
        ['Age · idle', h('span', { title: `created ${new Date(env.created_at_ms).toLocaleString()}, last used ${new Date(env.last_used_at_ms).toLocaleString()}` },
          `${fmtAgo(env.created_at_ms, now)} · ${fmtAgo(env.last_used_at_ms, now)}`)],
        ['Sessions', env.attached_sessions.length
          ? env.attached_sessions.map((id) => h('span', { class: 'line' }, h('a', { href: `#/s/${id}`, class: 'mono id' }, id)))
          : '—'],
        ['Calls', stacked(fmtInt(a.model_requests), 'model', fmtInt(a.gateway_tool_calls), 'gw tool')],
        ['Tokens', stacked(fmtInt(a.input_tokens), 'in', fmtInt(a.output_tokens), 'out')],
        ['Bytes', stacked(fmtBytes(a.bytes_in), 'in', fmtBytes(a.bytes_out), 'out')],
        ['Network', egressCell(env.egress_hosts || [])],
        ['', destroyable ? h('button', { type: 'button', class: 'danger small needs-operate', 'aria-label': `Destroy ${env.id}…`, onclick: () => this.confirmDestroy(env) }, 'Destroy') : null],
      ];
      // A cell of several lines is one block, so the phone layout keeps them together.
      return h('tr', {}, cells.map(([label, v]) => h('td', { 'data-label': label, class: numeric.has(label) ? 'num' : null },
        Array.isArray(v) ? h('div', { class: 'lines' }, v) : v)));
    });
    replace(this.body, h('table', { class: 'env-table' },
      h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col', class: numeric.has(c) ? 'num' : null, title: titles[c] || null }, c)))),
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
