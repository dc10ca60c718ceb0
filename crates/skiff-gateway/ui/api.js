// The gateway's public API, as the CLI uses it, authenticated by the HttpOnly session cookie
// (the page never sees a token). Every change is a same-origin fetch, which carries the
// Origin header the gateway checks.

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

const listeners = new Set();
/** Called with no arguments whenever the gateway says we are not (or no longer) logged in. */
export function onUnauthorized(fn) {
  listeners.add(fn);
}
function unauthorized() {
  for (const fn of listeners) fn();
}

export async function request(method, path, body) {
  let resp;
  try {
    resp = await fetch(path, {
      method,
      credentials: 'same-origin',
      headers: body === undefined ? {} : { 'content-type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(0, 'unreachable', 'The gateway cannot be reached. Is `skiff gateway` running?');
  }
  if (resp.status === 204) return null;
  const text = await resp.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = null;
  }
  if (!resp.ok) {
    if (resp.status === 401) unauthorized();
    throw new ApiError(resp.status, json?.code || String(resp.status), json?.message || text || resp.statusText);
  }
  return json;
}

export const api = {
  health: () => request('GET', '/v1/health'),
  me: () => request('GET', '/v1/me'),
  session: (id) => request('GET', `/v1/sessions/${encodeURIComponent(id)}`),
  sessions: (limit, before) => request('GET', `/v1/sessions?limit=${limit}${before ? `&before=${encodeURIComponent(before)}` : ''}`),
  create: (body) => request('POST', '/v1/sessions', body),
  send: (id, prompt) => request('POST', `/v1/sessions/${encodeURIComponent(id)}/messages`, { prompt }),
  cancel: (id) => request('POST', `/v1/sessions/${encodeURIComponent(id)}/cancel`, {}),
  pullBack: (id, cancel, live = false) => request('POST', `/v1/sessions/${encodeURIComponent(id)}/pull-back`, { cancel, live }),
  dispatch: (id, profile, live = false) => request('POST', `/v1/sessions/${encodeURIComponent(id)}/dispatch`, { profile, live }),
  group: (id) => request('GET', `/v1/groups/${encodeURIComponent(id)}`),
  pick: (id) => request('POST', `/v1/sessions/${encodeURIComponent(id)}/pick`, {}),
  turnChanges: (id, run) => request('GET', `/v1/sessions/${encodeURIComponent(id)}/runs/${encodeURIComponent(run)}/changes`),
  environments: () => request('GET', '/v1/environments'),
  destroyEnvironment: (id) => request('DELETE', `/v1/environments/${encodeURIComponent(id)}`),
  profiles: () => request('GET', '/v1/profiles'),
  login: (token) => request('POST', '/ui/login', { token }),
  logout: () => request('POST', '/ui/logout', {}),
};

/**
 * Follows an SSE stream with our own reconnects: on any error the stream is closed and
 * reopened after a short backoff, by `url()` (which may embed the last cursor). `onState`
 * hears 'live' and 'reconnecting'. Returns a function that stops following.
 */
export function follow(url, handlers, onState) {
  let source = null;
  let stopped = false;
  let delay = 500;
  let timer = null;
  const open = () => {
    if (stopped) return;
    source = new EventSource(url());
    source.onopen = () => {
      delay = 500;
      onState('live');
    };
    for (const [name, fn] of Object.entries(handlers)) {
      source.addEventListener(name, (e) => {
        let data;
        try {
          data = JSON.parse(e.data);
        } catch {
          return;
        }
        fn(data);
      });
    }
    source.onerror = () => {
      source.close();
      if (stopped) return;
      onState('reconnecting');
      // A refused stream looks like any other error to EventSource; ask whether we are still
      // logged in before trying again.
      request('GET', '/v1/health').catch(() => {});
      timer = setTimeout(open, delay);
      delay = Math.min(delay * 2, 8000);
    };
  };
  open();
  return () => {
    stopped = true;
    clearTimeout(timer);
    if (source) source.close();
  };
}
