// Small DOM and formatting helpers. Everything the UI shows goes through textContent or
// createElement: no HTML strings, so nothing a model or a tool prints can become markup.

/** Creates an element: h('a', {href: '#', class: 'x', onclick: fn}, 'text', child…). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') {
      el.addEventListener(key.slice(2), value);
    } else if (key === 'class') {
      el.className = value;
    } else if (key === 'dataset') {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(key, '');
    } else {
      el.setAttribute(key, String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

/** Replaces an element's children. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

const numberFmt = new Intl.NumberFormat('en');
export const fmtInt = (n) => numberFmt.format(n || 0);

export function fmtDuration(ms) {
  if (ms === undefined || ms === null) return '';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${Math.round(s % 60)}s`;
  const hrs = Math.floor(m / 60);
  return `${hrs}h ${m % 60}m`;
}

/** "now", "3m", "2h", "4d": compact relative time for lists. */
export function fmtAgo(atMs, now = Date.now()) {
  const s = Math.max(0, (now - atMs) / 1000);
  if (s < 45) return 'now';
  if (s < 3600) return `${Math.round(s / 60)}m`;
  if (s < 86400) return `${Math.round(s / 3600)}h`;
  return `${Math.round(s / 86400)}d`;
}

export function fmtBytes(n) {
  if (!n) return '0 B';
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(v < 10 && i > 0 ? 1 : 0)} ${units[i]}`;
}

export function isoTime(ms) {
  return new Date(ms).toISOString().replace('.000Z', 'Z');
}

/** Runs fn once per animation frame however often it is scheduled. */
export function frameBatcher(fn) {
  let queued = false;
  return () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      fn();
    });
  };
}

/** Polite screen-reader announcements (status changes). */
export function announce(text) {
  const el = document.getElementById('announcer');
  if (!el) return;
  el.textContent = '';
  // A fresh text node after a tick makes screen readers read it even if it repeats.
  setTimeout(() => {
    el.textContent = text;
  }, 50);
}

/** The owner's email of a session that is not the signed-in user's, or null. */
export function otherOwner(s) {
  return s.owner && s.owner !== document.body.dataset.me ? s.owner : null;
}
