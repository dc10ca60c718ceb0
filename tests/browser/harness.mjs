// A real gateway (the `skiff` binary from target/debug), a scripted model, a git repository,
// and Debian's chromium driven by playwright-core. Nothing here downloads a browser.
//
// Tests share nothing they can change: each opens its own browser context and its own sessions,
// and a test that depends on a gateway's state as a whole (restarting it, listing all its
// sessions or environments) starts its own gateway. So any test passes alone and in any order.

import { after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync, mkdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
export const ROOT = resolve(here, '../..');
export const SKIFF = process.env.SKIFF_BIN || join(ROOT, 'target/debug/skiff');
export const SHOTS = join(here, 'screenshots');
mkdirSync(SHOTS, { recursive: true });

// Every temporary directory of this test process goes when the process does.
const temporaries = [];
process.on('exit', () => {
  for (const dir of temporaries) rmSync(dir, { recursive: true, force: true });
});

export function tempDir(prefix) {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  temporaries.push(dir);
  return dir;
}

const gatewayLogs = [];
process.on('exit', (code) => {
  if ((code || process.exitCode) && gatewayLogs.length) {
    for (const { name, text } of gatewayLogs) process.stderr.write(`--- gateway log (${name})\n${text}`);
  }
});

export class Gateway {
  /**
   * `scripts` is one scripted model's TOML, served as provider `fake`, or `{ provider: toml }`:
   * a scripted model per provider (`<provider>/x`), so that tests sharing a gateway each start
   * their sessions at the turns they need (a session's turn is its count of assistant messages).
   */
  constructor(scripts) {
    this.dir = tempDir('skiff-ui-');
    this.stateDir = join(this.dir, 'state');
    this.config = join(this.dir, 'skiff.toml');
    let config = '';
    for (const [name, script] of Object.entries(typeof scripts === 'string' ? { fake: scripts } : scripts)) {
      writeFileSync(join(this.dir, `script-${name}.toml`), script);
      config += `[providers.${name}]\napi = "scripted"\nscript = "script-${name}.toml"\n`;
    }
    writeFileSync(this.config, config);
  }

  /** Starts `skiff gateway` (on `listen`, default any free port) and waits for its URL. */
  async start(listen = '127.0.0.1:0') {
    this.child = spawn(SKIFF, ['--state-dir', this.stateDir, 'gateway', '--listen', listen, '--config', this.config], {
      // A home of the test's own: the machine's login profile stays out of `exec`'s `bash -l`.
      env: { ...process.env, RUST_LOG: 'warn', HOME: this.dir },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    // The gateway's log is shown only when a test of this file failed: a passing run prints
    // nothing that reads like a failure (tests provoke warnings on purpose).
    const log = { name: this.dir, text: '' };
    gatewayLogs.push(log);
    this.child.stderr.setEncoding('utf8');
    this.child.stderr.on('data', (chunk) => { log.text += chunk; });
    const lines = createInterface({ input: this.child.stdout });
    const first = await new Promise((ok, fail) => {
      lines.once('line', ok);
      this.child.once('exit', (code) => fail(new Error(`skiff gateway exited with ${code} before listening:\n${log.text}`)));
    });
    const prefix = 'skiff gateway listening on ';
    if (!first.startsWith(prefix)) throw new Error(`unexpected first line from the gateway: ${first}`);
    this.url = first.slice(prefix.length).trim();
    this.listen = this.url.replace('http://', '');
    return this;
  }

  async stop() {
    if (!this.child || this.child.exitCode !== null) return;
    const exited = new Promise((ok) => this.child.once('exit', ok));
    this.child.kill('SIGKILL');
    await exited;
  }

  /** Stops the gateway; first destroys its boxes (sshd, a user, a namespace), which outlive it. */
  async shutdown() {
    if (this.child && this.child.exitCode === null) {
      const { environments = [] } = await this.api('/v1/environments').catch(() => ({}));
      for (const env of environments.filter((e) => e.state !== 'destroyed')) await this.destroyEnvironment(env.id).catch(() => {});
    }
    await this.stop();
  }

  /** `DELETE /v1/environments/{id}?force=true`; the view it answers. */
  async destroyEnvironment(id) {
    const resp = await fetch(`${this.url}/v1/environments/${id}?force=true`, {
      method: 'DELETE',
      headers: { authorization: `Bearer ${this.token()}` },
    });
    assert.ok(resp.ok, `destroying ${id}: ${resp.status} ${await resp.clone().text()}`);
    return resp.json();
  }

  cli(...args) {
    return execFileSync(SKIFF, ['--state-dir', this.stateDir, ...args], {
      encoding: 'utf8',
      env: { ...process.env, SKIFF_URL: '', SKIFF_TOKEN: '' },
    });
  }

  /** A fresh one-use login link, as `skiff ui` prints it. */
  loginUrl() {
    return JSON.parse(this.cli('ui', '--json')).url;
  }

  token() {
    return JSON.parse(execFileSync('cat', [join(this.stateDir, 'gateway.json')], { encoding: 'utf8' })).token;
  }

  async api(path) {
    const resp = await fetch(`${this.url}${path}`, { headers: { authorization: `Bearer ${this.token()}` } });
    return resp.json();
  }

  /** Starts a session with `skiff session new` and waits for its first turn to end; its id. */
  session(prompt, { workspace, model = 'fake/x', profile } = {}) {
    const where = profile ? ['--profile', profile] : [];
    const started = this.cli('session', 'new', '--detach', '--json', '--workspace', workspace, '--model', model, ...where, prompt);
    const id = JSON.parse(started).session.id;
    this.cli('session', 'watch', id, '--json');
    return id;
  }
}

// What a test set up, undone when it ends, last first (a page closes before its gateway stops).
const cleanups = new WeakMap();
function defer(t, fn) {
  let stack = cleanups.get(t);
  if (!stack) {
    stack = [];
    cleanups.set(t, stack);
    t.after(async () => {
      let failed;
      while (stack.length) await stack.pop()().catch((e) => { failed ??= e; });
      if (failed) throw failed;
    });
  }
  stack.push(fn);
}

/** A gateway of the test `t` alone, shut down when it ends. */
export async function gatewayFor(t, scripts) {
  return shutDownAfter(t, await new Gateway(scripts).start());
}

/**
 * Shuts `gw` down when the test `t` ends, after the pages the test opens later have closed (a
 * gateway stopped under an open page cuts its event streams, which the page reports as errors).
 */
export function shutDownAfter(t, gw) {
  defer(t, () => gw.shutdown());
  return gw;
}

/** A git repository with one commit. */
export function gitRepo(extra = {}) {
  const dir = tempDir('skiff-repo-');
  writeFileSync(join(dir, 'README.md'), '# sample\n\nA small project.\n');
  writeFileSync(join(dir, 'main.py'), 'print("hello")\n');
  for (const [path, text] of Object.entries(extra)) {
    mkdirSync(dirname(join(dir, path)), { recursive: true });
    writeFileSync(join(dir, path), text);
  }
  const git = (...args) => execFileSync('git', ['-C', dir, '-c', 'user.name=t', '-c', 'user.email=t@example.com', ...args], { stdio: 'ignore' });
  git('init', '-q', '-b', 'main');
  git('add', '.');
  git('commit', '-q', '-m', 'init');
  return dir;
}

// One chromium per test file, started by the first test that needs it.
let browser;
after(async () => (await browser)?.close());

/**
 * A page of the test `t` in a browser context of its own (cookies, viewport, colour scheme,
 * routes), logged in to `gw` unless `login` is false; the context closes when the test ends.
 * The test fails on a page error, or on a console error other than those it provokes
 * (`expected`, matched against "console error: <text> (<url>)").
 */
export async function pageFor(t, gw, { login = true, expected = [] } = {}) {
  browser ??= chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: [
      '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync',
    ],
  });
  const context = await (await browser).newContext({ viewport: { width: 1280, height: 800 } });
  const problems = [];
  defer(t, async () => {
    const real = problems.filter((p) => !(p.startsWith('console error') && expected.some((re) => re.test(p))));
    await context.close();
    assert.deepEqual(real, [], 'the page raised errors');
  });
  const page = await context.newPage();
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error') problems.push(`console error: ${m.text()} (${m.location()?.url ?? ''})`);
  });
  if (login) {
    await page.goto(gw.loginUrl());
    await page.waitForSelector('#health[data-state="live"]');
  }
  return page;
}

export const shot = (page, name) => page.screenshot({ path: join(SHOTS, `${name}.png`) });

/** Resolves once the viewport has the given width and no animation or transition runs. */
export async function settled(page, width) {
  if (width) await page.waitForFunction((w) => window.innerWidth === w, width);
  await page.waitForFunction(() => document.getAnimations().every((a) => a.playState !== 'running'));
}
