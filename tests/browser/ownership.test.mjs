// Someone else's session: only its owner sends it messages, so the composer gives way to one
// quiet line naming the owner and what the signed-in role may do there (an operator stops a
// turn, dispatches or pulls back, answers approvals; a viewer reads). The transcript labels the
// owner's messages with their name, not "you", and Dispatch… shows only to a role the server
// lets move someone else's session. The owner still has the composer.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { SKIFF, gatewayFor, gitRepo, pageFor, settled, shot } from './harness.mjs';

const SCRIPT = '[[turns]]\ntext = "Looked around the parser."\n';
// Real-length names: the line must still read at both widths.
const OWNER = 'anastasia.lindqvist-moreau@platform-engineering.alpha-robotics.example';
const OPERATOR = 'otto.operator@platform-engineering.alpha-robotics.example';
const VIEWER = 'vera.viewer@platform-engineering.alpha-robotics.example';

/** Adds a user of tenant `alpha` with the first admin's token and returns a token of theirs. */
function person(gw, email, role, scope) {
  gw.cli('admin', 'user', 'add', email, '--role', role, '--tenant', 'alpha');
  // The token on stdout; the notice on stderr stays out of the test's output.
  return execFileSync(SKIFF, ['--state-dir', gw.stateDir, 'admin', 'token', 'create', '--user', email, '--scope', scope, '--expires', '1d'],
    { encoding: 'utf8', env: { ...process.env, SKIFF_URL: '', SKIFF_TOKEN: '' }, stdio: ['ignore', 'pipe', 'ignore'] }).trim();
}

/** The CLI as someone holding `token`. */
function asUser(gw, token, ...args) {
  return execFileSync(SKIFF, ['--state-dir', gw.stateDir, ...args], {
    encoding: 'utf8',
    env: { ...process.env, SKIFF_URL: gw.url, SKIFF_TOKEN: token },
  });
}

/** A page signed in as the holder of `token`, on session `id`. */
async function signedIn(t, gw, token, id) {
  const page = await pageFor(t, gw, { login: false });
  await page.goto(JSON.parse(asUser(gw, token, 'ui', '--json')).url);
  await page.waitForSelector('#health[data-state="live"]');
  await page.goto(`${gw.url}/#/s/${id}`);
  await page.locator('.msg.agent', { hasText: 'Looked around the parser.' }).waitFor();
  return page;
}

test("a member's session opened by an operator names its owner and has no composer", async (t) => {
  const gw = await gatewayFor(t, SCRIPT);
  const ana = person(gw, OWNER, 'member', 'write');
  const otto = person(gw, OPERATOR, 'operator', 'write');
  const vera = person(gw, VIEWER, 'viewer', 'read');
  const started = JSON.parse(asUser(gw, ana, 'session', 'new', '--detach', '--json', '--workspace', gitRepo(),
    '--model', 'fake/x', 'look at the parser'));
  const id = started.session.id;
  asUser(gw, ana, 'session', 'watch', id, '--json');

  const page = await signedIn(t, gw, otto, id);
  const note = page.locator('.others-note');
  await note.waitFor();
  const line = await note.innerText();
  assert.match(line, new RegExp(`^${OWNER.replaceAll('.', '\\.')}'s session`));
  assert.match(line, /you may stop its turn, dispatch it or pull it back, and answer approvals/);
  assert.match(line, /only its owner sends messages/);
  assert.equal(await page.locator('form.composer').isVisible(), false, 'no composer on her session');
  assert.equal(await page.locator('#composer-input').isVisible(), false);
  // Her message is labelled with her name (all of her email on hover), never "you".
  const who = page.locator('.msg.user .who').first();
  assert.equal(await who.innerText(), OWNER.split('@')[0]);
  assert.equal(await who.getAttribute('title'), OWNER);
  // The server lets an operator dispatch anyone's session of the tenant: the action is offered.
  const dispatch = page.locator('.head-actions button', { hasText: 'Dispatch…' });
  assert.equal(await dispatch.isVisible(), true, 'an operator may dispatch her session');
  // The header names her too; the line is one line, the whole of it on hover.
  assert.match(await page.locator('.chat-meta .owner').innerText(), new RegExp(OWNER.replaceAll('.', '\\.')));
  assert.equal(await note.locator('.others-text').getAttribute('title'), line.trim());
  const height = await note.locator('.others-text').evaluate((el) => el.getBoundingClientRect().height);
  assert.ok(height < 30, `one line, not ${height}px`);
  await settled(page, 1280);
  await shot(page, 'ownership-operator-1280');
  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  await shot(page, 'ownership-operator-390');
  // No hover on a phone: the whole line shows, wrapped.
  assert.equal(await note.locator('.others-text').evaluate((el) => el.scrollWidth <= el.clientWidth), true);

  // A viewer reads.
  const viewer = await signedIn(t, gw, vera, id);
  const theirs = viewer.locator('.others-note');
  await theirs.waitFor();
  assert.match(await theirs.innerText(), /you may read it; only its owner sends messages/);
  assert.doesNotMatch(await theirs.innerText(), /stop|pull|dispatch/);
  assert.equal(await viewer.locator('form.composer').isVisible(), false);
  assert.equal(await viewer.locator('.msg.user .who').first().innerText(), OWNER.split('@')[0]);
  assert.equal(await viewer.locator('.head-actions button', { hasText: 'Dispatch…' }).isVisible(), false,
    'a viewer may not dispatch');

  // Her own view keeps the composer and has no such line.
  const own = await signedIn(t, gw, ana, id);
  await own.locator('#composer-input').waitFor();
  assert.equal(await own.locator('.others-note').isVisible(), false);
  assert.equal(await own.locator('.msg.user .who').first().innerText(), 'you');
  assert.equal(await own.locator('.head-actions button', { hasText: 'Dispatch…' }).isVisible(), true);
});
