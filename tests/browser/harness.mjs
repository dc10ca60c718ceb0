// A real gateway (the `skiff` binary from target/debug), a scripted model, a git repository,
// and Debian's chromium driven by playwright-core. Nothing here downloads a browser.

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
  constructor(script) {
    this.dir = tempDir('skiff-ui-');
    this.stateDir = join(this.dir, 'state');
    this.config = join(this.dir, 'skiff.toml');
    writeFileSync(join(this.dir, 'script.toml'), script);
    writeFileSync(this.config, '[providers.fake]\napi = "scripted"\nscript = "script.toml"\n');
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

/** Debian's chromium with a fresh user-data dir, as one browser context. */
export async function launch() {
  const userDataDir = tempDir('skiff-chromium-');
  return chromium.launchPersistentContext(userDataDir, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: 1280, height: 800 },
    args: [
      '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync',
    ],
  });
}
