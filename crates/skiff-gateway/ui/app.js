// The Control UI: login, the live session list, and the routed main view
// (#/s/<id> chat, #/g/<group> a fan-out's attempts, #/new, #/environments). Plain ES modules, no build step.

import { h, replace } from './dom.js';
import { api, follow, onUnauthorized } from './api.js';
import { Sidebar } from './sidebar.js';
import { ChatView } from './chat.js';
import { NewSessionView } from './newsession.js';
import { EnvironmentsView } from './environments.js';
import { GroupView } from './groups.js';

const $ = (id) => document.getElementById(id);

const app = {
  sidebar: null,
  view: null,
  stopList: null,
  running: false,
};

function setHealth(state) {
  const el = $('health');
  el.dataset.state = state;
  const [sym, text] = state === 'live' ? ['●', 'healthy'] : ['◌', 'reconnecting…'];
  replace(el, h('span', { class: 'dot', 'aria-hidden': 'true' }, sym), ` ${text}`);
}

function setWorkers(n) {
  const el = $('workers');
  el.hidden = !n;
  el.textContent = `workers ${n}`;
}

// ---- login ----

function showLogin(message) {
  stopApp();
  $('app').hidden = true;
  $('login').hidden = false;
  const note = $('login-error');
  note.hidden = !message;
  note.textContent = message || '';
  $('login-token').focus();
  offerSso();
}

// "Sign in with SSO" when the gateway has an identity provider ([auth.oidc]).
async function offerSso() {
  try {
    const resp = await fetch('/auth/methods', { credentials: 'same-origin' });
    if (resp.ok) $('login-sso').hidden = !(await resp.json()).sso;
  } catch {
    // Without an answer the token form alone is offered.
  }
}

async function submitLogin(e) {
  e.preventDefault();
  const input = $('login-token');
  const token = input.value.trim();
  try {
    await api.login(token);
    input.value = '';
    $('login-error').hidden = true;
    startApp();
  } catch (err) {
    input.value = '';
    showLogin(err.status === 401 ? 'That token is not valid.' : err.message);
  }
}

// ---- the app ----

/** Who is signed in (small, in the header); the body's `data-can` hides what they cannot do. */
async function showWhoami() {
  try {
    const me = await api.me();
    const el = $('whoami');
    el.textContent = `${me.email} · ${me.role}`;
    el.title = `tenant ${me.tenant}, token scope ${me.scope}`;
    el.hidden = false;
    document.body.dataset.can = me.can.join(' ');
    // Lists of a whole tenant mix people: a session of someone else's names them.
    document.body.dataset.me = me.email;
    // A session view opened before this answer shows now whether it is someone else's.
    app.view?.onMe?.();
  } catch {
    // The health and event streams report a gateway that cannot be reached.
  }
}

function startApp() {
  if (app.running) return;
  app.running = true;
  $('login').hidden = true;
  $('app').hidden = false;
  showWhoami();
  app.sidebar = new Sidebar($('session-groups'), $('search'));
  app.stopList = follow(() => '/v1/events', {
    session: (s) => {
      app.sidebar.upsert(s);
      if (app.view?.id === s.id) app.view.onSession(s);
    },
    ready: () => app.sidebar.setReady(),
  }, setHealth);
  api.environments().then((l) => setWorkers((l?.environments || []).filter((e) => e.state !== 'destroyed').length)).catch(() => {});
  route();
}

function stopApp() {
  if (!app.running) return;
  app.running = false;
  if (app.stopList) app.stopList();
  if (app.view) app.view.destroy();
  app.view = null;
  clearInterval(app.sidebar?.clock);
}

const ctx = {
  get sidebar() {
    return app.sidebar;
  },
  setWorkers,
};

function route() {
  if (!app.running) return;
  const hash = location.hash || '#/';
  const m = hash.match(/^#\/s\/(ses_[A-Za-z0-9_-]+)$/);
  const g = hash.match(/^#\/g\/(grp_[A-Za-z0-9_-]+)$/);
  if (app.view) app.view.destroy();
  let view;
  if (m) {
    view = new ChatView(m[1], ctx);
    app.sidebar.setCurrent(m[1]);
  } else if (g) {
    view = new GroupView(g[1], ctx);
    app.sidebar.setCurrent(g[1]);
  } else {
    app.sidebar.setCurrent(null);
    if (hash === '#/new') view = new NewSessionView(ctx);
    else if (hash === '#/environments') view = new EnvironmentsView(ctx);
    else view = homeView();
  }
  app.view = view;
  replace($('main'), view.el);
  document.title = m ? `Skiff · ${m[1]}` : g ? `Skiff · ${g[1]}` : 'Skiff';
  for (const a of document.querySelectorAll('#env-link, #new-session')) {
    a.toggleAttribute('aria-current', a.getAttribute('href') === hash);
  }
  closeDrawer();
  view.focus?.();
}

function homeView() {
  return {
    el: h('section', { class: 'chat home' },
      h('div', { class: 'empty' },
        h('h1', {}, 'Skiff'),
        h('p', {}, 'Pick a session on the left, or start a new one.'),
        h('p', {}, h('a', { class: 'button primary', href: '#/new' }, '+ New session')),
        h('p', { class: 'muted' }, 'Keyboard: ', h('kbd', {}, 'n'), ' new · ', h('kbd', {}, '/'), ' search · ',
          h('kbd', {}, 'j'), ' ', h('kbd', {}, 'k'), ' move · ', h('kbd', {}, 'Enter'), ' open'))),
    destroy() {},
  };
}

// ---- phone drawer ----

function openDrawer() {
  document.body.classList.add('drawer-open');
  $('menu').setAttribute('aria-expanded', 'true');
  $('scrim').hidden = false;
  $('search').focus();
}

function closeDrawer() {
  document.body.classList.remove('drawer-open');
  $('menu').setAttribute('aria-expanded', 'false');
  $('scrim').hidden = true;
}

// ---- keyboard ----

function onKey(e) {
  if (!app.running || e.defaultPrevented || e.altKey || e.ctrlKey || e.metaKey) return;
  const t = e.target;
  const typing = t instanceof HTMLElement && (t.isContentEditable || ['INPUT', 'TEXTAREA', 'SELECT'].includes(t.tagName));
  if (e.key === 'Escape') {
    if (document.body.classList.contains('drawer-open')) {
      closeDrawer();
      return;
    }
    if (t === $('search')) {
      t.value = '';
      t.dispatchEvent(new Event('input'));
      t.blur();
      return;
    }
    if (!typing && app.view instanceof ChatView && app.view.activeRun()) app.view.stop();
    return;
  }
  if (typing || document.querySelector('dialog[open]')) return;
  switch (e.key) {
    case 'j':
      app.sidebar.move(1);
      break;
    case 'k':
      app.sidebar.move(-1);
      break;
    case '/':
      if (window.matchMedia('(max-width: 760px)').matches) openDrawer();
      $('search').focus();
      break;
    case 'n':
      location.hash = '#/new';
      break;
    default:
      return;
  }
  e.preventDefault();
}

// ---- boot ----

async function boot() {
  onUnauthorized(() => showLogin(app.running ? 'Your session ended; log in again.' : null));
  $('login-form').addEventListener('submit', submitLogin);
  $('logout').addEventListener('click', async () => {
    try {
      await api.logout();
    } finally {
      showLogin('Logged out.');
    }
  });
  $('menu').addEventListener('click', () => (document.body.classList.contains('drawer-open') ? closeDrawer() : openDrawer()));
  $('scrim').addEventListener('click', closeDrawer);
  window.addEventListener('hashchange', () => {
    if (location.hash === '#login-expired') return;
    route();
  });
  document.addEventListener('keydown', onKey);

  const expired = location.hash === '#login-expired';
  if (expired) history.replaceState(null, '', '/');
  try {
    await api.health();
    startApp();
  } catch (e) {
    if (e.status === 401) {
      showLogin(expired ? 'That login link was already used or has expired. Run `skiff ui` for a new one, or paste the admin token.' : null);
    } else {
      showLogin(`The gateway cannot be reached (${e.message}). Reload to try again.`);
    }
  }
}

boot();
