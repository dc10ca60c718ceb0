// Fan-out in the Control UI: a group of attempts on real local boxes (the real gateway, a
// scripted model, Debian's chromium). The sidebar shows the siblings under one row; the group
// view compares them and picks one behind a confirmation.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { gatewayFor, gitRepo, pageFor, settled, shot } from './harness.mjs';

// Each attempt writes a file, runs a check that fails, and says so.
const ATTEMPT = `
[[turns]]
text = "Writing the change."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "one\\ntwo\\n" }

[[turns]]
text = "Running the tests."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "grep -q three notes.txt" }

[[turns]]
text = "Wrote notes.txt; the check still fails.\\nDetails below."
`;

test('a fan-out shows as one sidebar row, compares its attempts and picks one after confirmation', async (t) => {
  // A gateway of its own: its boxes would show in other tests' environments views.
  const gw = await gatewayFor(t, { fake: ATTEMPT });
  const repo = gitRepo();
  const started = JSON.parse(gw.cli('session', 'new', '--attempts', '2', '--profile', 'local', '--json',
    '--workspace', repo, '--model', 'fake/x', 'Add notes and test them.'));
  const group = started.group_id;
  const ids = started.attempts.map((a) => a.session.id);
  assert.match(group, /^grp_[a-z0-9]+$/);
  for (const id of ids) gw.cli('session', 'watch', id, '--json');

  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/g/${group}`);
  // The sidebar: one row for the group, its attempts under it.
  const groupRow = page.locator(`.srow.grow[data-group-id="${group}"]`);
  await groupRow.waitFor();
  assert.equal(await groupRow.locator('.badge').innerText(), '×2');
  assert.equal(await page.locator('.srow.grow').count(), 1);
  for (const [i, id] of ids.entries()) {
    const row = page.locator(`.rows.attempts .srow[data-session-id="${id}"]`);
    await row.waitFor();
    assert.equal(await row.locator('.stitle').innerText(), `Attempt ${i + 1}`);
  }

  // The comparison: one row per attempt with status, diffstat, tests and the final message.
  await page.waitForSelector('.group-table tbody tr');
  await page.waitForFunction(() => [...document.querySelectorAll('.group-table td[data-label="Status"]')].every((td) => td.innerText.includes('succeeded')));
  const table = await page.locator('.group-table').innerText();
  for (const id of ids) assert.ok(table.includes(id), `${id} whole in ${table}`);
  assert.equal(await page.locator('.group-table tbody tr').count(), 2);
  for (const want of ['+2', '✕ exit 1', 'Wrote notes.txt; the check still fails.']) assert.ok(table.includes(want), `${want} in ${table}`);
  assert.ok(!table.includes('Details below.'), 'only the first line of the final message');
  assert.match(await page.locator('.group-view .chat-meta').innerText(), /no attempt picked yet/);
  await settled(page, 1280);
  await shot(page, 'group-1280');

  // Pick asks first; keeping it changes nothing.
  const pickButton = page.locator(`tr[data-session-id="${ids[1]}"] button`);
  await pickButton.click();
  await page.waitForSelector('dialog#pick[open]');
  assert.match(await page.locator('#pick .pick-text').innerText(), new RegExp(`Pick ${ids[1]} .* the other attempt is parked`));
  await shot(page, 'group-confirm-1280');
  await page.click('#pick button[value="cancel"]');
  await page.waitForSelector('dialog#pick[open]', { state: 'detached' });
  assert.equal((await gw.api(`/v1/groups/${group}`)).picked, null, 'closing the dialog picks nothing');

  await pickButton.click();
  await page.click('#pick button[value="pick"]');
  await page.waitForSelector(`tr.picked[data-session-id="${ids[1]}"]`);
  assert.match(await page.locator('.group-view .chat-meta').innerText(), new RegExp(`picked ${ids[1]}: its branch skiff/${ids[1]} is the group's result`));
  assert.equal(await page.locator('.group-table button').count(), 0, 'no more picks');
  await page.waitForFunction((id) => document.querySelector(`tr[data-session-id="${id}"] td[data-label="Status"]`)?.innerText.includes('parked'), ids[0]);
  const other = await gw.api(`/v1/sessions/${ids[0]}`);
  assert.equal(other.session.placement, 'parked');
  assert.equal(other.group.picked, ids[1]);
  await shot(page, 'group-picked-1280');

  // An attempt's chat links back to the comparison.
  await page.locator(`.rows.attempts .srow[data-session-id="${ids[0]}"]`).click();
  await page.locator('.group-link').click();
  await page.waitForURL(new RegExp(`#/g/${group}$`));
  await page.waitForSelector(`tr.picked[data-session-id="${ids[1]}"]`);

  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  await shot(page, 'group-390');
});
