// Approval cards: a call the session's policy holds shows in the chat with what it wants to
// run or change, who asked and the time left; Approve lets it run, Deny (with a reason) refuses
// it and the agent reads why. The session waits under "Waiting for you" meanwhile.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { gatewayFor, gitRepo, pageFor, shot } from './harness.mjs';

const SCRIPT = `
[[turns]]
text = "Cleaning the build."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-up" }

[[turns]]
text = "Editing the readme."
[[turns.tool_calls]]
name = "write"
arguments = { path = "README.md", content = "# sample\\n\\nA rewritten project.\\n" }

[[turns]]
text = "Done."
`;

test('an approval card approves a command and denies a write with a reason', async (t) => {
  const gw = await gatewayFor(t, SCRIPT);
  const started = gw.cli('session', 'new', '--detach', '--json', '--workspace', gitRepo(), '--model', 'fake/x',
    '--approval', '{ exec = ["rm *"], write_outside = ["src/**"] }', 'tidy up');
  const id = JSON.parse(started).session.id;
  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/s/${id}`);

  const card = page.locator('li.approval.ap-pending');
  await card.waitFor();
  assert.match(await card.locator('.approval-subject').innerText(), /rm -rf build && echo cleaned-up/);
  assert.match(await card.innerText(), /asked by agent/);
  assert.match(await card.innerText(), /denied in .+ unless decided/);
  // The sidebar puts the session under "Waiting for you".
  await page.locator('section.group', { has: page.locator('h2', { hasText: 'Waiting for you' }) })
    .locator(`[data-session-id="${id}"]`).waitFor();
  await shot(page, 'approval-card-1280');
  await card.getByRole('button', { name: 'Approve' }).click();
  await page.locator('li.approval.ap-approved').waitFor();

  // The write waits next, with its diff; denied with a reason.
  const write = page.locator('li.approval.ap-pending');
  await write.waitFor();
  const diff = await write.locator('.approval-subject').innerText();
  assert.match(diff, /-A small project\./);
  assert.match(diff, /\+A rewritten project\./);
  await page.setViewportSize({ width: 390, height: 844 });
  // Not `settled`: the waiting session's state dot pulses for as long as it waits.
  await page.waitForFunction((w) => window.innerWidth === w, 390);
  await shot(page, 'approval-card-390');
  await write.getByRole('textbox', { name: 'Reason for the decision' }).fill('leave the readme alone');
  await write.getByRole('button', { name: 'Deny' }).click();
  await page.locator('li.approval.ap-denied').waitFor();
  assert.match(await page.locator('li.approval.ap-denied').innerText(), /denied by .+: leave the readme alone/);
  await page.waitForSelector('.runend.rs-succeeded');

  const detail = await gw.api(`/v1/sessions/${id}`);
  const results = detail.transcript.filter((e) => e.body.kind === 'tool_result').map((e) => e.body);
  assert.equal(results[0].is_error, false);
  assert.match(results[0].content, /cleaned-up/);
  assert.equal(results[1].is_error, true);
  assert.match(results[1].content, /leave the readme alone/);
});
