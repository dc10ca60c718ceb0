// A model's thinking in the transcript: collapsed under "Thinking" with its duration, the
// readable text inside, a redacted block saying so. The model is a fake Anthropic server that
// streams thinking the way the Messages API does.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import { appendFileSync } from 'node:fs';
import { Gateway, shutDownAfter, gitRepo, pageFor, shot } from './harness.mjs';

const sse = (type, data) => `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;

function thinkingThenAnswer() {
  const block = (index, start, deltas) => [
    sse('content_block_start', { index, content_block: start }),
    ...deltas.map((delta) => sse('content_block_delta', { index, delta })),
    sse('content_block_stop', { index }),
  ];
  return [
    sse('message_start', { message: { id: 'msg_1', type: 'message', role: 'assistant', content: [], model: 'claude-fake', usage: { input_tokens: 10, output_tokens: 1 } } }),
    ...block(0, { type: 'thinking', thinking: '', signature: '' }, [
      { type: 'thinking_delta', thinking: 'The project is small; ' },
      { type: 'thinking_delta', thinking: 'say so.' },
      { type: 'signature_delta', signature: 'EqQBCgIYAhIM1gbcDa9G=' },
    ]),
    ...block(1, { type: 'redacted_thinking', data: 'EmwKAhgBEgy3va3pzix==' }, []),
    ...block(2, { type: 'text', text: '' }, [{ type: 'text_delta', text: 'A small project.' }]),
    sse('message_delta', { delta: { stop_reason: 'end_turn', stop_sequence: null }, usage: { output_tokens: 20 } }),
    sse('message_stop', {}),
  ].join('');
}

test('thinking shows collapsed under Thinking, with its text and a redacted block inside', async (t) => {
  const server = createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      res.writeHead(200, { 'content-type': 'text/event-stream', connection: 'close' });
      res.end(thinkingThenAnswer());
    });
  });
  await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
  t.after(() => server.close());
  const gw = new Gateway('[[turns]]\ntext = "ok"\n');
  appendFileSync(gw.config, `[providers.claude]\napi = "anthropic-messages"\nbase_url = "http://127.0.0.1:${server.address().port}"\n`);
  await gw.start();
  shutDownAfter(t, gw);

  // Detached: `gw.session` waits synchronously, and this process serves the model.
  const started = gw.cli('session', 'new', '--detach', '--json', '--workspace', gitRepo(), '--model', 'claude/claude-sonnet-4-5', 'What is this?');
  const id = JSON.parse(started).session.id;
  const page = await pageFor(t, gw);
  await page.goto(`${gw.url}/#/s/${id}`);
  await page.waitForSelector('.runend.rs-succeeded');

  const details = page.locator('.msg.agent details.thinking');
  assert.equal(await details.count(), 1);
  assert.equal(await details.evaluate((d) => d.open), false, 'closed by default');
  assert.match(await details.locator('summary').innerText(), /^Thinking( · .+)?$/);
  assert.equal(await details.locator('.thinking-text').first().isVisible(), false);
  await details.locator('summary').click();
  const texts = await details.locator('.thinking-text').allInnerTexts();
  assert.deepEqual(texts, ['The project is small; say so.', 'redacted']);
  assert.match(await page.locator('.msg.agent .md').innerText(), /A small project\./);
  await shot(page, 'thinking-1280');
});
