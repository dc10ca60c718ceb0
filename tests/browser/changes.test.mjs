// A turn's "Changes" view: a session whose turn wrote a file shows that file, with its diff,
// when the turn's Changes button is opened. The real gateway, a scripted model, chromium.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Gateway, gitRepo, pageFor, shot } from './harness.mjs';

const SCRIPT = `
[[turns]]
text = "Writing a greeting."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes/hello.txt", content = "Hello from the agent\\n" }
[[turns.tool_calls]]
name = "edit"
arguments = { path = "main.py", edits = [{ old_text = "hello", new_text = "hello, world" }] }

[[turns]]
text = "Done."
`;

let gw;
before(async () => {
  gw = await new Gateway(SCRIPT).start();
});
after(() => gw?.shutdown());

test("a finished turn's Changes view lists the file it wrote, with the diff", async (t) => {
  const page = await pageFor(t, gw);
  const id = gw.session('Write a greeting', { workspace: gitRepo() });
  assert.match(id, /^ses_/);

  await page.goto(`${gw.url}/#/s/${id}`);
  await page.waitForSelector('.runend.rs-succeeded');
  const button = page.locator('.runend .changes-btn');
  assert.equal(await button.getAttribute('aria-expanded'), 'false');
  await button.click();
  assert.equal(await button.getAttribute('aria-expanded'), 'true');

  const file = page.locator('.change-file[data-path="notes/hello.txt"]');
  await file.waitFor();
  assert.equal(await file.getAttribute('data-status'), 'added');
  assert.match(await file.locator('.change-head').innerText(), /A\s*added\s*notes\/hello\.txt\s*\+1 −0/);
  // A small turn opens its diffs at once: the added line, marked with its +.
  const added = file.locator('pre.diff .d-add', { hasText: 'Hello from the agent' });
  await added.waitFor();
  assert.equal((await added.innerText()).trim(), '+Hello from the agent');
  const edited = page.locator('.change-file[data-path="main.py"]');
  assert.equal(await edited.getAttribute('data-status'), 'modified');
  assert.equal((await edited.locator('pre.diff .d-del').innerText()).trim(), '-print("hello")');
  assert.equal((await edited.locator('pre.diff .d-add').innerText()).trim(), '+print("hello, world")');
  assert.match(await page.locator('.changes-summary').innerText(), /2 files changed · \+2 · −1/);

  // The page shows what the API holds.
  const run = (await gw.api(`/v1/sessions/${id}`)).runs[0].id;
  const api = await gw.api(`/v1/sessions/${id}/runs/${run}/changes`);
  assert.deepEqual(api.files.map((f) => f.path), ['main.py', 'notes/hello.txt']);

  // A file's diff folds away and back.
  await file.locator('.change-head').click();
  assert.equal(await file.locator('.change-body').isHidden(), true);
  await file.locator('.change-head').press('Enter');
  await added.waitFor();
  await shot(page, 'changes-1280');
  await page.setViewportSize({ width: 390, height: 844 });
  // At phone width the sidebar slides away into a drawer.
  await page.waitForFunction(() => document.querySelector('.sidebar').getBoundingClientRect().right <= 0);
  await page.locator('.changes').scrollIntoViewIfNeeded();
  await shot(page, 'changes-390');
  await page.setViewportSize({ width: 1280, height: 800 });

  // Closing the view hides it.
  await button.click();
  assert.equal(await page.locator('.changes').isHidden(), true);
});
