// Results in plain sight: an expanded tool row scrolls into view (the last row of a long chat
// too), `exec` rows carry their exit code, and the environments table keeps real-length ids
// whole at 1280 px. A real gateway, real sessions and real local boxes; Debian's chromium.
// Any page error fails the test it happens in.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Gateway, gitRepo, pageFor, shot } from './harness.mjs';

/** Steps before the failing one: enough rows that the transcript scrolls several screens. */
const STEPS = 30;
const SCRIPT = Array.from({ length: STEPS }, (_, i) => `
[[turns]]
text = "Step ${i + 1}: checking part ${i + 1}."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "seq 1 ${20 + i}" }
`).join('') + `
[[turns]]
text = "Running the tests."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "printf 'line %s\\\\n' $(seq 1 150); echo 'assertion failed: x == 2' >&2; exit 1" }

[[turns]]
text = "The test fails: x is not 2."
`;

let gw;
before(async () => {
  gw = await new Gateway(SCRIPT).start();
});
after(() => gw?.shutdown());

test('expanding the last tool row of a long chat scrolls its output into view, exit code first', async (t) => {
  const page = await pageFor(t, gw);
  const chatId = gw.session('run the tests', { workspace: gitRepo() });
  await page.goto(`${gw.url}/#/s/${chatId}`);
  await page.waitForSelector('.runend.rs-succeeded');
  const rows = page.locator('.tool');
  assert.equal(await rows.count(), STEPS + 1);
  const scroller = page.locator('.transcript');
  const size = await scroller.evaluate((s) => ({ height: s.clientHeight, content: s.scrollHeight }));
  assert.ok(size.content > 2 * size.height, `a long chat: ${JSON.stringify(size)}`);

  // Every exec row says how its command ended; the failing one in red, with "exit 1".
  const last = rows.last();
  assert.equal(await last.getAttribute('data-status'), 'error');
  assert.equal(await last.locator('.tool-head .texit').innerText(), 'exit 1');
  assert.match(await last.locator('.tool-head .texit').getAttribute('class'), /\bbad\b/);
  assert.equal(await rows.first().locator('.tool-head .texit').innerText(), 'exit 0');
  assert.match(await last.locator('.tool-head .sr-only').innerText(), /failed, exit code 1/);
  await shot(page, 'chat-exec-rows-1280');

  // The chat sits at its end; the last row's output opens below the fold and is brought up.
  const before = await scroller.evaluate((s) => s.scrollTop);
  await last.locator('.tool-head').click();
  const output = last.locator('pre.result');
  await output.waitFor();
  await page.waitForFunction(() => {
    const pre = [...document.querySelectorAll('.tool')].at(-1)?.querySelector('pre.result');
    if (!pre) return false;
    const box = pre.getBoundingClientRect();
    const view = document.querySelector('.transcript').getBoundingClientRect();
    return box.height > 0 && box.top >= view.top - 0.5 && box.bottom <= view.bottom + 0.5
      && box.top >= 0 && box.bottom <= window.innerHeight;
  });
  assert.ok((await scroller.evaluate((s) => s.scrollTop)) > before, 'the transcript scrolled to the output');

  // The output reads from its end: the reason the command failed is what shows.
  assert.equal(await last.locator('.out-head .texit').innerText(), 'exit 1');
  assert.match(await last.locator('.cut-note').innerText(), /… 31 earlier lines/);
  const tail = await output.evaluate((pre) => ({
    text: pre.textContent,
    atEnd: pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 1,
    lastLine: (() => {
      const box = pre.getBoundingClientRect();
      const range = document.createRange();
      range.selectNodeContents(pre);
      const lines = [...range.getClientRects()];
      const end = lines.at(-1);
      return end && end.bottom <= box.bottom + 0.5 && end.top >= box.top - 0.5;
    })(),
  }));
  assert.ok(tail.text.trimEnd().endsWith('assertion failed: x == 2'), tail.text.slice(-200));
  assert.ok(!tail.text.includes('line 31\n'), 'the preview starts at the tail');
  assert.ok(tail.atEnd && tail.lastLine, 'the last line of the output is visible');
  await shot(page, 'chat-exec-output-1280');

  // "Show all" gives the whole output, from line 1.
  await last.locator('button', { hasText: 'Show all' }).click();
  await page.waitForFunction(() => [...document.querySelectorAll('.tool')].at(-1)?.querySelector('pre.result')?.textContent.startsWith('line 1\n'));
});

test('the environments table fits real-length ids at 1280 px, every id whole', async (t) => {
  const page = await pageFor(t, gw);
  // The long chat's turn on a worker box (an attached environment with a real session id and
  // accounting), then an idle box of its own.
  const workerId = gw.session('run the tests on a box', { workspace: gitRepo(), profile: 'local' });
  gw.cli('env', 'create', '--profile', 'local', '--json');
  const { environments } = await gw.api('/v1/environments');
  const live = environments.filter((e) => e.state !== 'destroyed');
  assert.ok(live.length >= 2, `two real environments: ${JSON.stringify(live)}`);
  const attached = live.find((e) => e.attached_sessions.includes(workerId));
  assert.ok(attached, 'the worker session is attached to one of them');
  for (const env of live) {
    assert.match(env.id, /^env_[0-9a-z]{16}$/);
    assert.match(env.lease_id, /^lbx_[0-9a-f]{12}$/);
    assert.match(env.ssh_target, /^skf-[0-9a-f]{12}@127\.0\.0\.1:\d+$/);
  }

  for (const width of [1280, 390]) {
    await page.setViewportSize({ width, height: width === 1280 ? 800 : 844 });
    await page.goto(`${gw.url}/#/environments`);
    // At phone width the sidebar is a drawer: wait until it has slid away.
    await page.waitForFunction(() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0 || window.innerWidth > 760);
    await page.waitForFunction((n) => document.querySelectorAll('.env-table tbody tr').length >= n, live.length);
    for (const env of live) {
      const row = page.locator('.env-table tbody tr', { hasText: env.id });
      const text = await row.textContent();
      for (const id of [env.id, env.lease_id, env.ssh_target, ...env.attached_sessions]) {
        assert.ok(text.includes(id), `${id} whole in the row at ${width} px: ${text}`);
      }
    }
    const fit = await page.evaluate(() => {
      const body = document.querySelector('.env-body');
      // Every id and SSH target lies inside its cell and the window: nothing is cut off.
      const cut = [...document.querySelectorAll('.env-table .mono')].filter((el) => {
        const box = el.getBoundingClientRect();
        const cell = el.closest('td').getBoundingClientRect();
        return box.left < cell.left - 0.5 || box.right > cell.right + 0.5 || box.right > window.innerWidth;
      }).map((el) => el.textContent);
      return { page: document.documentElement.scrollWidth, body: body.scrollWidth - body.clientWidth, cut };
    });
    assert.ok(fit.page <= width, `the page is ${fit.page} px wide at ${width} px`);
    assert.equal(fit.body, 0, `the table scrolls sideways at ${width} px`);
    assert.deepEqual(fit.cut, [], `ids cut off at ${width} px`);
    // The attached session is a link to its chat.
    assert.equal(await page.locator(`.env-table a[href="#/s/${workerId}"]`).innerText(), workerId);
    await shot(page, `environments-real-${width}`);
  }
});
