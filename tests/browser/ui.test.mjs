// The Control UI end to end: the real `skiff` gateway, a scripted model, Debian's chromium.
// The file shares one gateway; each test has its own page, its own sessions and, where it needs
// the gateway to itself, its own gateway.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Gateway, gatewayFor, gitRepo, pageFor, settled, shot } from './harness.mjs';

// A first prompt's run: a tool row, then an answer in markdown.
const LOOK = `
[[turns]]
text = "I'll look at the files first."
[[turns.tool_calls]]
name = "ls"
arguments = {}

[[turns]]
text = """
Here is what I found:

- \`README.md\` describes the project
- **main.py** prints a greeting

\`\`\`sh
python3 main.py
\`\`\`

All done."""
`;
const LONG = Array.from({ length: 70 }, (_, i) => `word${i}`).join(' ');
// Text streamed slowly enough to be seen arriving (and reloaded in the middle of).
const PACED = 'chunk_delay_ms = 40\n';
// One scripted model per kind of test, each starting with the same first run. Every gateway of
// this file serves them all.
const SCRIPTS = {
  fake: PACED + LOOK,
  // At once: sessions a test needs to exist before it starts.
  quick: LOOK,
  slow: `${LOOK}
[[turns]]
text = "Running a slow command now."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "sleep 30" }
`,
  story: `${PACED}${LOOK}
[[turns]]
text = "Streaming start. ${LONG} Streaming end."
`,
  again: `${LOOK}
[[turns]]
text = "Back after the restart."
`,
};

// No test on the shared gateway creates an environment: two of them want none.
let gw;
before(async () => {
  gw = await new Gateway(SCRIPTS).start();
});
after(() => gw?.shutdown());

const transcriptText = (page) => page.locator('.turns').innerText();

/** Resolves once `cond()` holds (checked on every turn of the event loop, for up to 15 s). */
async function until(cond, what) {
  const end = Date.now() + 15_000;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((ok) => setImmediate(ok));
  }
}

/** A session on `gw` whose first run (LOOK) has ended; its id. */
const newSession = (gw, model = 'quick/x') => gw.session('Tell me about this project.', { workspace: gitRepo(), model });

/** A session on `gw` whose first run (LOOK) has ended, shown on `page`. */
async function openSession(page, gw, model) {
  const id = newSession(gw, model);
  await page.goto(`${gw.url}/#/s/${id}`);
  await page.waitForSelector('.runend.rs-succeeded');
  await page.waitForSelector('#composer-input');
  return id;
}

test('the login link trades its ticket once for an HttpOnly cookie and leaves the URL', async (t) => {
  const page = await pageFor(t, gw, { login: false });
  const link = gw.loginUrl();
  assert.match(link, /\/ui\/login\?ticket=skt_/);
  await page.goto(link);
  await page.waitForSelector('#app:not([hidden])');
  assert.equal(page.url(), `${gw.url}/`, 'the ticket left the address bar');
  const cookie = (await page.context().cookies()).find((c) => c.name === 'skiff_session');
  assert.ok(cookie, 'a session cookie is set');
  assert.equal(cookie.httpOnly, true);
  assert.equal(cookie.sameSite, 'Strict');
  const visible = await page.evaluate(() => ({
    cookie: document.cookie,
    storage: JSON.stringify({ ...localStorage }) + JSON.stringify({ ...sessionStorage }),
    html: document.documentElement.outerHTML,
  }));
  assert.ok(!visible.cookie.includes('skiff_session'), 'the page cannot read the cookie');
  const token = gw.token();
  for (const place of [visible.storage, visible.html]) assert.ok(!place.includes(token), 'no token in the page');
  await page.waitForSelector('#health[data-state="live"]');

  // The same link again: refused (no cookie, sent to the login page to say why).
  const again = await page.request.get(link, { maxRedirects: 0 });
  assert.equal(again.status(), 303);
  assert.equal(again.headers().location, '/#login-expired');
  assert.equal(again.headers()['set-cookie'], undefined);
});

test('a request without the session cookie is refused, and a cross-site change too', async (t) => {
  const page = await pageFor(t, gw, { expected: [/status of 401 /] });
  const bare = await fetch(`${gw.url}/v1/sessions`);
  assert.equal(bare.status, 401);
  const omitted = await page.evaluate(async () => (await fetch('/v1/sessions', { credentials: 'omit' })).status);
  assert.equal(omitted, 401);
  const withCookie = await page.evaluate(async () => (await fetch('/v1/sessions')).status);
  assert.equal(withCookie, 200);
  // The browser's cookie, sent with another site's Origin, may not change anything.
  const cross = await page.request.post(`${gw.url}/v1/sessions`, {
    headers: { origin: 'http://evil.example', 'content-type': 'application/json' },
    data: { prompt: 'x', workspace: '/tmp' },
  });
  assert.equal(cross.status(), 403);
  const csp = (await page.request.get(`${gw.url}/`)).headers()['content-security-policy'];
  assert.match(csp, /default-src 'self'/);
});

test('a session created from the target bar streams text and tool rows', async (t) => {
  const page = await pageFor(t, gw);
  const repo = gitRepo();
  await page.keyboard.press('n');
  await page.waitForSelector('#workspace');
  assert.equal(await page.isChecked('#where-gateway'), true);
  // Worker profiles come from the configuration; without any, the choice is calmly disabled.
  const listed = await fetch(`${gw.url}/v1/profiles`, { headers: { authorization: `Bearer ${gw.token()}` } });
  const profiles = listed.ok ? (await listed.json()).profiles : [];
  if (profiles.length === 0) {
    await page.waitForSelector('#profile option:text("no worker profiles configured")', { state: 'attached' });
    assert.equal(await page.isDisabled('#where-worker'), true);
  } else {
    await page.waitForSelector(`#profile option[value="${profiles[0].name}"]`, { state: 'attached' });
    await page.check('#where-worker');
    assert.match(await page.locator('#target-policy').innerText(), /idle timeout .* TTL/);
    await page.check('#where-gateway');
  }
  await page.fill('#workspace', repo);
  await page.fill('#model', 'fake/x');
  await page.fill('#new-prompt', 'Tell me about this project.');
  await shot(page, 'new-session-1280');
  await page.press('#new-prompt', 'Control+Enter');
  await page.waitForURL(/#\/s\/ses_/);
  const sessionId = page.url().split('#/s/')[1];

  // Text arrives while it streams, then the committed message replaces it.
  await page.waitForSelector('.msg.agent.streaming');
  await page.waitForSelector('.tool .tname:text("ls")');
  await page.waitForSelector('.runend.rs-succeeded');
  await page.waitForSelector('#composer-input');
  const text = await transcriptText(page);
  assert.match(text, /I'll look at the files first\./);
  assert.match(text, /All done\./);
  assert.equal(await page.locator('.md pre.code').count(), 1, 'the code block is rendered as code');
  assert.equal(await page.locator('.md strong:text("main.py")').count(), 1);
  assert.equal(await page.locator('.streaming').count(), 0);

  // The tool row expands to its arguments and output.
  const row = page.locator('.tool').first();
  assert.equal(await row.getAttribute('data-status'), 'ok');
  await row.locator('.tool-head').click();
  await row.locator('.tool-body pre').nth(1).waitFor();
  assert.match(await row.locator('.tool-body').innerText(), /README\.md/);
  await row.locator('.tool-head').press('Enter');
  assert.equal(await row.locator('.tool-body').isHidden(), true, 'Enter collapses it again');

  // Usage and model per turn; the scripted model says so.
  assert.match(await page.locator('.runend').innerText(), /in · .* out tokens · fake\/x \(scripted\)/);
  assert.equal(await page.locator('.chat-meta .tag').innerText(), 'scripted');
  assert.match(await page.locator('.chip').innerText(), /gateway · idle/);

  // The sidebar lists it live, with its badge and state.
  const srow = page.locator(`.srow[data-session-id="${sessionId}"]`);
  await srow.waitFor();
  assert.equal(await srow.locator('.badge').innerText(), 'G');
  assert.equal(await srow.locator('.badge').getAttribute('title'), 'gateway');
  assert.equal(await srow.getAttribute('data-state'), 'idle');
  await shot(page, 'chat-1280');
});

test('the stop button (Esc) cancels the running turn', async (t) => {
  const page = await pageFor(t, gw);
  const sessionId = await openSession(page, gw, 'slow/x');
  await page.fill('#composer-input', 'Now run the slow thing.');
  await page.press('#composer-input', 'Control+Enter');
  await page.waitForSelector('.tool[data-status="running"] .tname:text("exec")');
  await page.waitForSelector(`.srow[data-session-id="${sessionId}"][data-state="running"]`);
  assert.equal(await page.isVisible('button:text("■ Stop")'), true);
  await page.press('#composer-input', 'Escape');
  await page.waitForSelector('.runend.rs-cancelled');
  const exec = page.locator('.tool', { has: page.locator('.tname:text("exec")') });
  assert.notEqual(await exec.getAttribute('data-status'), 'running');
  await page.waitForSelector('button:text("■ Stop")', { state: 'hidden' });
  assert.match(await transcriptText(page), /cancel/i);
});

test('with a turn running, Dispatch… offers to move the turn with it and says so before confirming', async (t) => {
  const page = await pageFor(t, gw);
  const sessionId = await openSession(page, gw, 'slow/x');
  // This gateway has no worker profile: the page is shown one, and the dispatch is answered here.
  await page.route('**/v1/profiles', (route) => route.fulfill({ json: { profiles: [{ name: 'local', provider: 'local', development_only: true, ttl: '1h' }] } }));
  let body = null;
  await page.route('**/v1/sessions/*/dispatch', (route) => {
    body = route.request().postDataJSON();
    return route.fulfill({ status: 202, json: { moved: false, message: 'not moved in this test', after_cursor: 0 } });
  });
  await page.fill('#composer-input', 'Now run the slow thing.');
  await page.press('#composer-input', 'Control+Enter');
  await page.waitForSelector('.tool[data-status="running"] .tname:text("exec")');
  await page.click('button:text("Dispatch…")');
  await page.waitForSelector('dialog#move[open]');
  assert.equal(await page.isVisible('dialog#move .move-live'), true, 'the live option is offered while a turn runs');
  assert.doesNotMatch(await page.locator('dialog#move .move-text').innerText(), /turn moves/);
  await page.check('dialog#move input[name="live"]');
  assert.match(await page.locator('dialog#move .move-text').innerText(), /running turn moves with it/);
  await shot(page, 'move-live-1280');
  await page.click('dialog#move button[value="move"]');
  await until(() => body !== null, 'the dispatch request');
  assert.deepEqual(body, { profile: 'local', live: true });
  await page.press('#composer-input', 'Escape');
  await page.waitForSelector('.runend.rs-cancelled');
  assert.ok(sessionId);
});

test('reloading mid-stream loses nothing and doubles nothing', async (t) => {
  const page = await pageFor(t, gw);
  const sessionId = await openSession(page, gw, 'story/x');
  await page.fill('#composer-input', 'Tell me a long story.');
  await page.press('#composer-input', 'Control+Enter');
  await page.waitForFunction(() => document.querySelector('.msg.agent.streaming')?.innerText.includes('word5'));
  await page.reload();
  await page.waitForSelector('.runend.rs-succeeded >> nth=1', { timeout: 20_000 });
  await page.waitForSelector('.streaming', { state: 'detached' });
  const text = await transcriptText(page);
  const count = (needle) => text.split(needle).length - 1;
  assert.equal(count('Streaming start.'), 1);
  assert.equal(count('Streaming end.'), 1);
  assert.equal(count('word69'), 1);

  // The page shows exactly what the gateway holds.
  const detail = await gw.api(`/v1/sessions/${sessionId}`);
  const users = detail.transcript.filter((e) => e.body.kind === 'user_message');
  const calls = detail.transcript.flatMap((e) => (e.body.kind === 'assistant_message' ? e.body.tool_calls : []));
  assert.equal(await page.locator('.msg.user').count(), users.length);
  assert.equal(await page.locator('.tool').count(), calls.length);
  assert.equal(await page.locator('.runend').count(), detail.runs.length);
  await shot(page, 'chat-streamed-1280');
});

test('the UI reconnects after a gateway restart and resumes from its cursor', async (t) => {
  // A gateway of its own: it is the one restarted.
  const gw = await gatewayFor(t, SCRIPTS);
  // A request in flight when the gateway stops is refused or reset: both are what a restart looks like.
  const page = await pageFor(t, gw, { expected: [/net::ERR_INCOMPLETE_CHUNKED_ENCODING/, /net::ERR_CONNECTION_REFUSED/, /net::ERR_CONNECTION_RESET/] });
  await openSession(page, gw, 'again/x');
  const before = await page.locator('.turns > li').count();
  await gw.stop();
  await page.waitForSelector('#health[data-state="reconnecting"]');
  await gw.start(gw.listen);
  await page.waitForSelector('#health[data-state="live"]', { timeout: 20_000 });
  await page.fill('#composer-input', 'Are you still there?');
  await page.press('#composer-input', 'Control+Enter');
  await page.waitForFunction(() => document.querySelectorAll('.runend').length === 2, null, { timeout: 20_000 });
  const text = await transcriptText(page);
  assert.equal(text.split('Back after the restart.').length - 1, 1);
  assert.equal(text.split('All done.').length - 1, 1);
  assert.ok((await page.locator('.turns > li').count()) > before);
});

test('keyboard alone: j/k move through sessions, Enter opens, / searches', async (t) => {
  // A gateway of its own: j goes to the first of all its sessions.
  const gw = await gatewayFor(t, SCRIPTS);
  const page = await pageFor(t, gw);
  const sessionId = newSession(gw);
  await page.goto(`${gw.url}/#/environments`);
  await page.waitForSelector('.srow');
  await page.locator('body').press('j');
  assert.equal(await page.evaluate(() => document.activeElement?.dataset.sessionId), sessionId);
  await page.keyboard.press('Enter');
  await page.waitForURL(new RegExp(`#/s/${sessionId}$`));
  await page.locator('.transcript').focus();
  await page.keyboard.press('/');
  assert.equal(await page.evaluate(() => document.activeElement?.id), 'search');
  await page.keyboard.type('no such title');
  await page.waitForSelector('.session-groups :text("No session matches.")');
  await page.keyboard.press('Escape');
  await page.waitForSelector('.srow');
});

test('the sidebar lists the newest page of sessions and shows older ones on request', async (t) => {
  // A gateway of its own: the count of its sessions is the point.
  const gw = await gatewayFor(t, { ...SCRIPTS, done: '[[turns]]\ntext = "ok"\n' });
  const workspace = gitRepo();
  const ids = [];
  for (let i = 0; i < 103; i += 1) {
    const resp = await fetch(`${gw.url}/v1/sessions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${gw.token()}`, 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: `Task number ${i}`, workspace, model: 'done/x' }),
    });
    assert.equal(resp.status, 201);
    ids.push((await resp.json()).session.id);
  }
  // Every turn has ended, so nothing moves in the list while the page reads it.
  for (const id of ids) gw.cli('session', 'watch', id, '--json');
  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/environments`);
  await page.waitForSelector('button.older');
  assert.equal(await page.locator('.srow').count(), 100, 'the live list starts with the newest 100');
  await page.click('button.older');
  await page.waitForFunction(() => document.querySelectorAll('.srow').length === 103);
  assert.equal(await page.locator('button.older').count(), 0, 'nothing older is left to show');
  const shown = await page.locator('.srow').evaluateAll((rows) => rows.map((r) => r.dataset.sessionId));
  assert.deepEqual([...shown].sort(), [...ids].sort(), 'every session once');
});

test('environments show a calm empty state when the gateway has none', async (t) => {
  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/environments`);
  await page.waitForSelector('.envs .empty');
  assert.match(await page.locator('.envs').innerText(), /No environments/);
  await shot(page, 'environments-1280');
});

test('the environments table shows state, lease, accounting, and destroys after confirmation', async (t) => {
  const page = await pageFor(t, gw);
  const sessionId = 'ses_0f3a9c2e7b1d4a58';
  // The gateway here has no environments; serve two to the page to see how they are shown.
  const now = Date.now();
  const env = (id, state, extra) => ({
    id, profile: 'cloud', provider: 'crabbox', state, lease_id: `lease-${id.slice(-3)}`, development_only: false,
    ssh_target: 'skiff@10.0.0.7:22', bundle_hash: null, created_at_ms: now - 3 * 3600e3, updated_at_ms: now,
    last_used_at_ms: now - 300e3, expires_at_ms: null, attached_sessions: [sessionId], tunnel: 'up', error: null,
    accounting: { model_requests: 42, input_tokens: 123456, output_tokens: 7890, bytes_in: 5_300_000, bytes_out: 81_000, gateway_tool_calls: 3 },
    ...extra,
  });
  let deleted = null;
  await page.route('**/v1/environments', (route) => route.fulfill({
    json: { environments: [env('env_7f2', 'attached', { egress_hosts: [
      { phase: 'setup', host: 'pypi.org', connections: 3, bytes_out: 4200, bytes_in: 2_400_000, refused: 0 },
      { phase: 'setup', host: 'files.pythonhosted.org', connections: 5, bytes_out: 9100, bytes_in: 31_000_000, refused: 0 },
      { phase: 'agent', host: 'registry.npmjs.org', connections: 0, bytes_out: 0, bytes_in: 0, refused: 2 },
    ] }), env('env_9c1', 'failed', { error: 'lease lost', attached_sessions: [], tunnel: 'down' })] },
  }));
  await page.route('**/v1/environments/*', (route) => {
    deleted = route.request().url().split('/').pop();
    return route.fulfill({ status: 202, json: {} });
  });
  await page.goto(`${gw.url}/#/environments`);
  await page.waitForSelector('.env-table');
  const table = await page.locator('.env-table').innerText();
  for (const want of ['env_7f2', 'attached', 'lease-7f2', 'crabbox', '123,456', '5.1 MB', '3h · 5m', sessionId.slice(-6)]) assert.ok(table.includes(want), `${want} in ${table}`);
  // What the box reached through the egress proxy: a summary that opens into per-host rows.
  const network = page.locator('tr', { hasText: 'env_7f2' }).locator('details.egress');
  assert.match(await network.locator('summary').innerText(), /3 hosts\s*2 refused/);
  await network.locator('summary').click();
  const hosts = await network.locator('ul').innerText();
  for (const want of ['files.pythonhosted.org\nsetup · 5 conn · 30 MB in', 'registry.npmjs.org\nagent · 0 conn', '2 refused']) assert.ok(hosts.includes(want), `${want} in ${hosts}`);
  assert.equal(await page.locator('tr', { hasText: 'env_9c1' }).locator('td[data-label="Network"]').innerText(), '—');
  await shot(page, 'environments-table-1280');
  await page.locator('tr', { hasText: 'env_9c1' }).locator('button.danger').click();
  await page.waitForSelector('dialog[open]');
  await shot(page, 'environments-confirm-1280');
  await page.keyboard.press('Escape');
  await page.waitForSelector('dialog[open]', { state: 'detached' });
  assert.equal(deleted, null, 'closing the dialog destroys nothing');
  await page.locator('tr', { hasText: 'env_9c1' }).locator('button.danger').click();
  await page.click('dialog button[value="destroy"]');
  await page.waitForFunction(() => !document.querySelector('dialog[open]'));
  await until(() => deleted !== null, 'the destroy request');
  assert.equal(deleted, 'env_9c1');
  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  await shot(page, 'environments-table-390');
});

test('a large transcript (1,800 entries, a 1 MB tool output) renders quickly and collapsed', async (t) => {
  const page = await pageFor(t, gw);
  // Real tools cap their output at 64 KB, so the gateway cannot be made to hold this; the
  // page is served a synthetic session through the same API shapes.
  const id = 'ses_bigtranscript';
  const run = 'run_big';
  const events = [];
  const push = (kind) => events.push({ session_id: id, cursor: events.length + 1, at_ms: 1_700_000_000_000 + events.length, run_id: run, ...kind });
  const entry = (body) => push({ type: 'entry', entry: { id: `ent_${events.length}`, parent_id: null, run_id: run, created_at_ms: 0, body } });
  push({ type: 'run_status', status: 'queued' });
  const big = Array.from({ length: 16_000 }, (_, i) => `line ${i} ${'x'.repeat(56)}`).join('\n');
  for (let i = 0; i < 600; i += 1) {
    entry({ kind: 'user_message', text: `question ${i}` });
    entry({ kind: 'assistant_message', text: `Answer **${i}** with \`code\`.`, tool_calls: [{ id: `c${i}`, name: 'read', arguments: { path: `f${i}.txt` } }], model: 'fake/x (scripted)', usage: { input_tokens: 10, output_tokens: 5 }, stop_reason: 'tool_use' });
    push({ type: 'tool_finished', call_id: `c${i}`, name: 'read', is_error: false, duration_ms: 3 });
    entry({ kind: 'tool_result', call_id: `c${i}`, name: 'read', content: i === 599 ? big : `contents of f${i}`, is_error: false });
  }
  push({ type: 'run_status', status: 'succeeded' });
  const sse = events.map((e) => `id: ${e.cursor}\ndata: ${JSON.stringify(e)}\n\n`).join('');
  const view = {
    id, title: 'A very long session', placement: 'local', created_at_ms: 0, updated_at_ms: 0, last_run: null,
    workspace: { kind: 'plain', source: '/src', path: '/work' }, model: { ref: 'fake/x', scripted: true, label: 'fake/x (scripted)' },
  };
  await page.route(`**/v1/sessions/${id}`, (route) => route.fulfill({ json: { session: view, runs: [], transcript: [] } }));
  await page.route(`**/v1/sessions/${id}/events*`, (route) => route.fulfill({
    headers: { 'content-type': 'text/event-stream' },
    body: route.request().url().endsWith('after=0') ? sse : '',
  }));
  const started = Date.now();
  await page.goto(`${gw.url}/#/s/${id}`);
  await page.waitForSelector('.runend.rs-succeeded');
  const took = Date.now() - started;
  assert.ok(took < 8000, `rendered in ${took} ms`);
  const rendered = await page.locator('.turns > li').count();
  assert.ok(rendered <= 160, `${rendered} blocks in the DOM at first`);
  assert.match(await page.locator('.earlier').innerText(), /Show earlier/);
  const last = page.locator('.tool').last();
  await last.locator('.tool-head').click();
  const shown = await last.locator('pre.out').nth(1).innerText();
  assert.ok(shown.length <= 16_000, `${shown.length} characters shown before "show all"`);
  assert.match(await last.locator('button').last().innerText(), /Show all \(1\.\d MB, 16,000 lines\)/);
  await page.locator('.earlier').click();
  assert.ok((await page.locator('.turns > li').count()) > rendered, 'earlier blocks render on demand');
});

test('screenshots at phone width and in dark mode', async (t) => {
  const page = await pageFor(t, gw, { login: false, expected: [/status of 401 /] });
  // Logged in with a link of its own, used again at the end once spent.
  const expiredLink = gw.loginUrl();
  await page.goto(expiredLink);
  await page.waitForSelector('#health[data-state="live"]');
  const sessionId = newSession(gw);
  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  await page.goto(`${gw.url}/#/s/${sessionId}`);
  await page.waitForSelector('.runend');
  await shot(page, 'chat-390');
  await page.click('#menu');
  await page.waitForSelector('body.drawer-open');
  await settled(page);
  await shot(page, 'sidebar-390');
  await page.keyboard.press('Escape');
  await page.waitForSelector('body:not(.drawer-open)');
  await settled(page);
  await page.goto(`${gw.url}/#/new`);
  await page.waitForSelector('#workspace');
  await shot(page, 'new-session-390');
  await page.goto(`${gw.url}/#/environments`);
  await page.waitForSelector('.envs .empty');
  await shot(page, 'environments-390');

  await page.setViewportSize({ width: 1280, height: 800 });
  await page.emulateMedia({ colorScheme: 'dark' });
  await page.goto(`${gw.url}/#/s/${sessionId}`);
  await page.waitForSelector('.runend');
  await page.locator('.tool').first().locator('.tool-head').click();
  await shot(page, 'chat-1280-dark');
  await page.emulateMedia({ colorScheme: 'light' });

  await page.click('#logout');
  await page.waitForSelector('#login:not([hidden])');
  await shot(page, 'login-1280');
  await page.goto(expiredLink);
  await page.waitForSelector('#login:not([hidden])');
  assert.match(await page.locator('#login-error').innerText(), /already used or has expired/);
  assert.equal(page.url(), `${gw.url}/`);
  const after = await page.evaluate(async () => (await fetch('/v1/sessions')).status);
  assert.equal(after, 401, 'logged out means refused');
  await page.setViewportSize({ width: 390, height: 844 });
  await shot(page, 'login-390');
});

test('a worker session on the local profile shows where it runs, its placement steps, and its turn', async (t) => {
  // A gateway of its own: the box it leases would show in the others' environments views.
  const gw = await gatewayFor(t, SCRIPTS);
  const page = await pageFor(t, gw);
  // A gateway session beside it, to tell the two apart.
  const sessionId = newSession(gw);
  await page.keyboard.press('n');
  await page.waitForSelector('#profile option[value="local"]', { state: 'attached' });
  await page.selectOption('#profile', 'local');
  assert.equal(await page.isChecked('#where-worker'), true, 'picking a profile picks the worker');
  assert.match(await page.locator('#target-policy').innerText(), /Runs on a local worker \(profile local\) · idle timeout .* · TTL /);
  // Its setup prints a few lines and asks the egress proxy for a host no rule allows.
  const setupRepo = gitRepo({
    '.skiff/setup.sh': 'echo "installing the toolchain"\nfor i in 1 2 3; do echo "step $i of 3"; done\n'
      + 'curl -s -x "$HTTP_PROXY" http://registry.blocked.example/simple/ || true\n',
  });
  await page.fill('#workspace', setupRepo);
  await page.fill('#model', 'fake/x');
  await page.fill('#new-prompt', 'Look at this project on a worker.');
  await shot(page, 'new-session-worker-1280');
  const created = page.waitForResponse((r) => r.url().endsWith('/v1/sessions') && r.request().method() === 'POST');
  await page.press('#new-prompt', 'Control+Enter');
  const body = (await created).request().postDataJSON();
  assert.equal(body.profile, 'local');
  await page.waitForURL(/#\/s\/ses_/);
  const workerId = page.url().split('#/s/')[1];
  assert.notEqual(workerId, sessionId);

  // The slot is claimed, the box leased, synced and started before the turn streams; each
  // step is a quiet row.
  await page.waitForSelector('.placement-step');
  await page.waitForSelector('.runend.rs-succeeded', { timeout: 120_000 });
  await page.waitForSelector('.streaming', { state: 'detached' });
  const steps = await page.locator('.placement-step .mono').allInnerTexts();
  const order = ['requested', 'provisioning', 'syncing', 'setup', 'starting', 'active'];
  assert.deepEqual(steps.slice(0, 6), order, `placement steps: ${steps}`);
  // The setup step holds its output, closed until asked for.
  const setupStep = page.locator('.placement-step:has(details.setup-output)');
  assert.equal(await setupStep.count(), 1);
  assert.match(await setupStep.locator('summary').innerText(), /setup .*running \.skiff\/setup\.sh · \d+ lines of output/);
  assert.equal(await setupStep.locator('pre').isVisible(), false);
  await setupStep.locator('summary').click();
  const output = await setupStep.locator('pre').innerText();
  assert.match(output, /installing the toolchain\nstep 1 of 3\nstep 2 of 3\nstep 3 of 3/);
  assert.match(output, /refused registry\.blocked\.example:80 \(profiles\.local\.egress\.setup allows no egress\)/);
  await shot(page, 'chat-worker-setup-1280');
  await setupStep.locator('summary').click();
  assert.equal(steps.at(-1), 'active', `placement steps: ${steps}`);
  for (const row of await page.locator('.placement-step').allInnerTexts()) assert.ok(row.trim().split(' ').length > 1, `a step says what happens: ${row}`);

  // The session view says where: the worker, its profile and environment.
  const { session } = await gw.api(`/v1/sessions/${workerId}`);
  assert.equal(session.placement, 'active');
  assert.equal(session.worker.profile, 'local');
  const envId = session.worker.environment_id;
  assert.match(envId, /^env_/);

  // The turn reads exactly as a gateway session's does.
  const text = await transcriptText(page);
  assert.match(text, /I'll look at the files first\./);
  assert.match(text, /All done\./);
  assert.equal(await page.locator('.md pre.code').count(), 1);
  const row = page.locator('.tool').first();
  assert.equal(await row.locator('.tname').innerText(), 'ls');
  assert.equal(await row.getAttribute('data-status'), 'ok');
  await row.locator('.tool-head').click();
  await row.locator('.tool-body pre').nth(1).waitFor();
  assert.match(await row.locator('.tool-body').innerText(), /README\.md/);
  await row.locator('.tool-head').press('Enter');
  assert.match(await page.locator('.runend').innerText(), /done · .* in · .* out tokens · fake\/x \(scripted\)/);

  // Header chip and sidebar badge: the worker, with its environment.
  const chip = page.locator('.chip');
  await page.waitForFunction((env) => document.querySelector('.chip')?.innerText.includes(env), envId);
  assert.equal((await chip.innerText()).replace(/\s+/g, ' '), `○ worker · ${envId} · idle`);
  assert.match(await chip.getAttribute('class'), /\bpl-worker\b/);
  const srow = page.locator(`.srow[data-session-id="${workerId}"]`);
  await page.waitForFunction((id) => document.querySelector(`.srow[data-session-id="${id}"] .badge`)?.title.startsWith('worker · env_'), workerId);
  const badge = srow.locator('.badge');
  assert.equal(await badge.innerText(), 'W');
  assert.equal(await badge.getAttribute('title'), `worker · ${envId}`);
  assert.match(await badge.getAttribute('class'), /\bpl-worker\b/);
  assert.match(await srow.locator('.sr-only').innerText(), new RegExp(`runs on worker · ${envId}`));
  assert.equal(await srow.getAttribute('data-state'), 'idle');
  // The gateway session next to it keeps its G.
  assert.equal(await page.locator(`.srow[data-session-id="${sessionId}"] .badge`).innerText(), 'G');

  // Nothing spills sideways, on a desktop or a phone, and the long chip leaves the title room.
  const fits = () => page.evaluate(() => {
    const over = (el) => el.scrollWidth > el.clientWidth + 1;
    const header = document.querySelector('.chat-head');
    const chipBox = document.querySelector('.chip').getBoundingClientRect();
    document.querySelector('.transcript').scrollTop = 1e9;
    return {
      page: !over(document.documentElement),
      chipInside: chipBox.right <= header.getBoundingClientRect().right + 1 && chipBox.left >= 0,
      titleRoom: document.querySelector('.chat-title').getBoundingClientRect().width >= 120,
      steps: [...document.querySelectorAll('.placement-step')].every((el) => !over(el)),
    };
  });
  const fine = { page: true, chipInside: true, titleRoom: true, steps: true };
  assert.deepEqual(await fits(), fine);
  await shot(page, 'chat-worker-1280');
  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  assert.deepEqual(await fits(), fine);
  await shot(page, 'chat-worker-390');
  await page.click('#menu');
  await page.waitForSelector('body.drawer-open');
  await settled(page);
  await shot(page, 'sidebar-worker-390');
  await page.keyboard.press('Escape');
  await page.waitForSelector('body:not(.drawer-open)');
  await page.setViewportSize({ width: 1280, height: 800 });

  // No box is left behind. The session sees its box go: reclaimed, with the reason on hover
  // and in the chat; the conversation stays.
  const destroyed = await gw.destroyEnvironment(envId);
  assert.equal(destroyed.state, 'destroyed', JSON.stringify(destroyed));
  await page.waitForSelector(`.srow[data-session-id="${workerId}"][data-state="reclaimed"]`, { timeout: 30_000 });
  await page.waitForFunction(() => document.querySelector('.chip')?.innerText.includes('reclaimed'));
  const reclaimed = (await gw.api(`/v1/sessions/${workerId}`)).session;
  assert.equal(reclaimed.placement, 'reclaimed');
  assert.ok(reclaimed.worker.error, 'a reclaimed placement says why');
  assert.equal(await chip.getAttribute('title'), reclaimed.worker.error);
  assert.equal((await page.locator('.placement-step .mono').allInnerTexts()).at(-1), 'reclaimed');
  await page.waitForSelector('.notice:has-text("Your next message starts a fresh box")');
  assert.match(await transcriptText(page), /All done\./);
});
