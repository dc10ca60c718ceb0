// A small Markdown renderer for assistant text: fenced code, headings, lists, quotes,
// paragraphs, and inline code, bold, italics and http(s) links. It builds DOM nodes (never
// HTML strings), so text from a model cannot inject markup. Unfinished input (a stream cut
// mid-fence) renders as far as it goes.

import { h } from './dom.js';

export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, '\n').split('\n');
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) {
      frag.append(h('p', {}, ...inline(para.join('\n'))));
      para = [];
    }
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flush();
      const close = fence[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(close)) {
        body.push(lines[i]);
        i += 1;
      }
      i += 1;
      const code = h('code', {}, body.join('\n'));
      if (fence[2]) code.dataset.lang = fence[2];
      frag.append(h('pre', { class: 'code' }, code));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      flush();
      const level = Math.min(6, heading[1].length + 2);
      frag.append(h(`h${level}`, { class: 'md-h' }, ...inline(heading[2])));
      i += 1;
      continue;
    }
    const item = line.match(/^(\s*)([-*+]|\d+[.)])\s+(.*)$/);
    if (item) {
      flush();
      const ordered = /\d/.test(item[2]);
      const list = h(ordered ? 'ol' : 'ul');
      while (i < lines.length) {
        const m = lines[i].match(/^(\s*)([-*+]|\d+[.)])\s+(.*)$/);
        if (m && /\d/.test(m[2]) === ordered) {
          list.append(h('li', {}, ...inline(m[3])));
          i += 1;
        } else if (lines[i].match(/^\s{2,}\S/) && list.lastChild) {
          list.lastChild.append(' ', ...inline(lines[i].trim()));
          i += 1;
        } else {
          break;
        }
      }
      frag.append(list);
      continue;
    }
    if (/^>\s?/.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && /^>\s?/.test(lines[i])) {
        quoted.push(lines[i].replace(/^>\s?/, ''));
        i += 1;
      }
      frag.append(h('blockquote', {}, renderMarkdown(quoted.join('\n'))));
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flush();
      frag.append(h('hr'));
      i += 1;
      continue;
    }
    if (line.trim() === '') {
      flush();
    } else {
      para.push(line);
    }
    i += 1;
  }
  flush();
  return frag;
}

const INLINE = /(`+)([\s\S]*?)\1|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|\b_([^_\s][^_]*)_\b|\[([^\]]+)\]\(([^)\s]+)\)/g;

function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(text.slice(last, m.index));
    if (m[1]) out.push(h('code', {}, m[2]));
    else if (m[3] || m[4]) out.push(h('strong', {}, ...inline(m[3] || m[4])));
    else if (m[5] || m[6]) out.push(h('em', {}, ...inline(m[5] || m[6])));
    else if (m[7]) {
      const href = m[8];
      if (/^https?:\/\//i.test(href)) {
        out.push(h('a', { href, rel: 'noopener noreferrer', target: '_blank' }, m[7]));
      } else {
        out.push(m[0]);
      }
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}
