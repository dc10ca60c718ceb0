// Single sign-on in the Control UI: with [auth.oidc] the login page offers "Sign in with SSO",
// which goes to a real OpenID provider (node-oidc-provider, tests/oidc) and back signed in;
// without it the button is not there. A refusal comes back as a page naming the step.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { appendFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { Gateway, ROOT, SKIFF, gatewayFor, pageFor, shot, shutDownAfter, tempDir } from './harness.mjs';

const CLIENT_SECRET = 'browser-sso-client-secret-31c9e2';

/** The provider of the test `t`, stopped when it ends (its stdin closes). */
async function provider(t) {
  const dir = tempDir('skiff-oidc-');
  const config = join(dir, 'config.json');
  writeFileSync(config, JSON.stringify({
    clients: [],
    apps: [{ client_id: 'skiff-ui', client_secret: CLIENT_SECRET }],
    accounts: [
      { id: 'ana@example.com', email: 'ana@example.com' },
      { id: 'mallory@elsewhere.test', email: 'mallory@elsewhere.test' },
    ],
  }));
  const child = spawn('node', [join(ROOT, 'tests/oidc/provider.mjs'), config], {
    cwd: join(ROOT, 'tests/oidc'),
    stdio: ['pipe', 'pipe', 'ignore'],
  });
  t.after(() => child.stdin.end());
  const first = await new Promise((ok) => createInterface({ input: child.stdout }).once('line', ok));
  return JSON.parse(first).issuer;
}

test('the login page signs a user in through the identity provider', async (t) => {
  const issuer = await provider(t);
  const gw = new Gateway('[[turns]]\ntext = "Hi."\n');
  appendFileSync(gw.config, `[auth.oidc]\nissuer = "${issuer}"\nclient_id = "skiff-ui"\nclient_secret = "vault:oidc"\nallowed_domains = ["example.com"]\n`);
  shutDownAfter(t, await gw.start());
  execFileSync(SKIFF, ['--state-dir', gw.stateDir, 'secret', 'set', 'oidc'], {
    input: CLIENT_SECRET,
    env: { ...process.env, SKIFF_URL: '', SKIFF_TOKEN: '' },
    stdio: ['pipe', 'ignore', 'ignore'],
  });
  gw.cli('admin', 'user', 'add', 'ana@example.com', '--role', 'member');

  const page = await pageFor(t, gw, { login: false, expected: [/status of 401 /, /status of 403 /] });
  await page.goto(gw.url);
  const sso = page.locator('#login-sso a', { hasText: 'Sign in with SSO' });
  await sso.waitFor();
  await shot(page, 'login-sso-1280');

  await sso.click();
  // The provider's sign-in page, then back to the Control UI with a session cookie.
  await page.locator('a', { hasText: 'ana@example.com' }).click();
  await page.waitForSelector('#health[data-state="live"]');
  assert.equal(new URL(page.url()).origin, gw.url);
  await page.locator('#whoami', { hasText: 'ana@example.com · member' }).waitFor();

  // Someone of another domain (in a browser of their own: the provider remembers ana in this
  // one) gets a page saying which step refused them, and a way back.
  const other = await pageFor(t, gw, { login: false, expected: [/status of 401 /, /status of 403 /] });
  await other.goto(gw.url);
  await other.locator('#login-sso a').click();
  await other.locator('a', { hasText: 'mallory@elsewhere.test' }).click();
  const refused = other.locator('#sso-error');
  await refused.waitFor();
  assert.match(await refused.innerText(), /Sign-in failed while checking who you are/);
  assert.match(await refused.innerText(), /not in a domain allowed/);
  await shot(other, 'login-sso-refused-1280');
});

test('without [auth.oidc] the login page offers no SSO', async (t) => {
  const gw = await gatewayFor(t, '[[turns]]\ntext = "Hi."\n');
  const page = await pageFor(t, gw, { login: false, expected: [/status of 401 /] });
  const methods = page.waitForResponse((r) => r.url().endsWith('/auth/methods'));
  await page.goto(gw.url);
  assert.equal((await (await methods).json()).sso, false);
  await page.waitForSelector('#login:not([hidden])');
  assert.equal(await page.locator('#login-sso').isVisible(), false);
});
