// Usage against budgets in the session header: a turn that used 30 tokens of a 20-token
// session budget shows the figures and says, in words and colour, that the budget is used up.
// The model is a fake Anthropic server that reports usage.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import { appendFileSync } from 'node:fs';
import { Gateway, shutDownAfter, gitRepo, pageFor, settled, shot } from './harness.mjs';

const sse = (type, data) => `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;

function answer() {
  return [
    sse('message_start', { message: { id: 'msg_1', type: 'message', role: 'assistant', content: [], model: 'claude-fake', usage: { input_tokens: 10, output_tokens: 1 } } }),
    sse('content_block_start', { index: 0, content_block: { type: 'text', text: '' } }),
    sse('content_block_delta', { index: 0, delta: { type: 'text_delta', text: 'Done.' } }),
    sse('content_block_stop', { index: 0 }),
    sse('message_delta', { delta: { stop_reason: 'end_turn', stop_sequence: null }, usage: { output_tokens: 20 } }),
    sse('message_stop', {}),
  ].join('');
}

test('the session header shows usage against each budget and a used-up one in words', async (t) => {
  const server = createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      res.writeHead(200, { 'content-type': 'text/event-stream', connection: 'close' });
      res.end(answer());
    });
  });
  await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
  t.after(() => server.close());
  const gw = new Gateway('[[turns]]\ntext = "ok"\n');
  appendFileSync(gw.config, `[providers.claude]\napi = "anthropic-messages"\nbase_url = "http://127.0.0.1:${server.address().port}"\n[budgets]\nsession_tokens = 20\nuser_tokens_per_day = 100000\n`);
  await gw.start();
  shutDownAfter(t, gw);

  const started = gw.cli('session', 'new', '--detach', '--json', '--workspace', gitRepo(), '--model', 'claude/claude-sonnet-4-5', 'Finish up.');
  const id = JSON.parse(started).session.id;
  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/s/${id}`);
  await page.waitForSelector('.runend.rs-succeeded');
  const out = page.locator('.chat-head .budget.out');
  await out.waitFor();
  assert.equal(await out.innerText(), 'session 30/20 tokens ⚠ used up');
  const budgets = await page.locator('.chat-head .budget').allInnerTexts();
  assert.deepEqual(budgets, ['session 30/20 tokens ⚠ used up', 'user today 30/100k tokens']);
  await settled(page);
  await shot(page, 'budgets-1280');
  await page.setViewportSize({ width: 390, height: 844 });
  await settled(page, 390);
  await shot(page, 'budgets-390');
});
