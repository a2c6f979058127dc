// Streaming Markdown for the chat page: text in, DOM out, as the text arrives.
//
// Our own renderer rather than a vendored parser, decided by measurement. A 4,000-token
// Markdown answer from the synthetic engine, fed 16 tokens per call (a frame at 1 ms per
// token) in headless Chromium on a 2-core VM, layout forced after each call:
//                               per token, first 1,000   last 1,000   worst frame at the end
//   this file                    0.036 ms                0.031 ms     0.5 ms
//   marked 18 + DOMPurify 3      0.36 ms                 1.44 ms      23 ms (over budget)
//   marked 18 alone (unsafe)     0.20 ms                 0.74 ms      10 ms
// A maintained parser (marked, markdown-it) turns a whole document into an HTML string: to
// stream, it re-parses the whole answer every frame (work per token grows with the answer)
// and needs innerHTML plus a sanitiser to be safe. Size: this file is 27 KB unminified (8 KB
// gzipped); marked is 52 KB minified (16 KB gzipped), DOMPurify 29 KB (12 KB gzipped).
//
// How it stays cheap and safe:
//   - Lines are parsed once, when complete. Only the last open block (and, inside lists and
//     tables, only its last item or row) is rendered again as text arrives; a closed block's
//     nodes are never touched again. Inside a block, plain text appends to the last text node.
//   - Safe by construction: every node is made with createElement / text nodes; model text
//     never goes through innerHTML, so raw HTML stays text. Links are kept only for http:,
//     https: and mailto: URLs (parsed with URL), set as a property; anything else is text.
//     Images are never loaded (a link to the image instead).
//   - Half-open constructs render sensibly while open: an unclosed fence is already a code
//     block, a table shows its header row before any body row, `**bold` is bold until closed.
//   - Streamed in any pieces, the answer ends with the same DOM as the whole text rendered at
//     once (tests/system/test_web_markdown.py checks it on random splits).
// Supported: ATX headings, paragraphs, bulleted/numbered (nested) lists, blockquotes, rules,
// fenced code (with Copy), GFM tables and strikethrough, bold/italic/inline code, links and
// bare http(s) URLs, backslash escapes. Not: HTML (shown as text), setext headings, indented
// code blocks, reference links, footnotes.

// Characters that can change how the text before them parses; a delta without any is
// appended to the last text node as it is.
const INLINE_SPECIAL = /[\\`*_~[\]()!:]/;
const PUNCT = /[!-/:-@[-`{-~\p{P}\p{S}]/u;
const SPACE = /\s/;

const FENCE = /^(\s*)(`{3,}|~{3,})(.*)$/;
const HEADING = /^ {0,3}(#{1,6})(?=[ \t]|$)/;
const HR = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const ITEM = /^( *)([-*+]|(\d{1,9})[.)])(?:([ \t]+)(.*))?$/;
const ITEM_OPEN = /^( *)([-*+]|(\d{1,9})[.)])[ \t]/; // the marker is settled once a space follows
const QUOTE = /^ {0,3}> ?(.*)$/;
const DELIM_ROW = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const DELIM_PREFIX = /^\s*\|?[\s:|-]*$/;
const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);

// ---- inline -----------------------------------------------------------------------------------

// Parse inline Markdown into a small tree: strings, and {tag, kids, href?, tail?} nodes.
// `open`: the text may go on (the block is still streaming), so constructs that reach the end
// unclosed are shown as they will most likely end (bold, code) instead of as raw markers.
function parseInline(src, open) {
  const out = []; // strings, element nodes, and delimiter runs {delim, ch, n, canOpen, canClose}
  const openers = [];
  let text = "";
  const flushText = () => {
    if (text) out.push(text);
    text = "";
  };
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === "\\" && i + 1 < src.length && PUNCT.test(src[i + 1]) && src[i + 1] < "\x7f") {
      text += src[i + 1];
      i += 2;
    } else if (c === "`") {
      let n = 1;
      while (src[i + n] === "`") n++;
      const fence = "`".repeat(n);
      let end = src.indexOf(fence, i + n);
      while (end >= 0 && src[end + n] === "`") {
        let m = end;
        while (src[m] === "`") m++;
        end = src.indexOf(fence, m);
      }
      if (end >= 0) {
        let code = src.slice(i + n, end).replace(/\n/g, " ");
        if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
        flushText();
        out.push({ tag: "code", kids: [code] });
        i = end + n;
      } else if (open) {
        flushText();
        out.push({ tag: "code", kids: [src.slice(i + n)], tail: true });
        i = src.length;
      } else {
        text += fence;
        i += n;
      }
    } else if (c === "[" || (c === "!" && src[i + 1] === "[")) {
      const link = parseLink(src, i, open);
      if (link) {
        flushText();
        out.push(link.node);
        i = link.end;
      } else {
        text += c;
        i += 1;
      }
    } else if (c === "*" || c === "_" || c === "~") {
      let n = 1;
      while (src[i + n] === c) n++;
      const before = i > 0 ? src[i - 1] : " ";
      const after = i + n < src.length ? src[i + n] : " ";
      const left =
        !SPACE.test(after) && (!PUNCT.test(after) || SPACE.test(before) || PUNCT.test(before));
      const right =
        !SPACE.test(before) && (!PUNCT.test(before) || SPACE.test(after) || PUNCT.test(after));
      let canOpen = left;
      let canClose = right;
      if (c === "_") {
        canOpen = left && (!right || PUNCT.test(before));
        canClose = right && (!left || PUNCT.test(after));
      }
      if (c === "~" && n !== 2) canOpen = canClose = false;
      flushText();
      const run = { delim: true, ch: c, n, canOpen, canClose };
      if (canClose) closeEmphasis(out, openers, run);
      if (run.n > 0) {
        out.push(run);
        if (run.canOpen) openers.push(run);
      }
      i += n;
    } else if (
      (c === "h" || c === "H") &&
      /^https?:\/\//i.test(src.slice(i, i + 8)) &&
      !/\w/.test(src[i - 1] || " ")
    ) {
      const m = /^https?:\/\/[^\s<>"]*[^\s<>".,:;'")\]!?*_~]/i.exec(src.slice(i));
      const href = m && safeHref(m[0]);
      if (href) {
        flushText();
        out.push({ tag: "a", href, kids: [m[0]], tail: i + m[0].length === src.length });
        i += m[0].length;
      } else {
        text += c;
        i += 1;
      }
    } else {
      let j = i + 1;
      while (j < src.length && !/[\\`[!*_~hH]/.test(src[j])) j++;
      text += src.slice(i, j);
      i = j;
    }
  }
  flushText();
  // Still open at the end: shown as it will most likely close (last opener first).
  if (open) {
    for (let k = openers.length - 1; k >= 0; k--) {
      const run = openers[k];
      const at = out.indexOf(run);
      if (at < 0 || run.n === 0) continue;
      const kids = out.splice(at + 1).map((item) => (item.delim ? item.ch.repeat(item.n) : item));
      if (!kids.some((kid) => typeof kid !== "string" || kid.trim())) {
        out.push(...kids);
        continue;
      }
      const tag = run.ch === "~" ? "del" : run.n >= 2 ? "strong" : "em";
      out.splice(at, 1, { tag, kids, tail: true });
    }
  }
  return out.map((item) => (item.delim ? item.ch.repeat(item.n) : item));
}

// CommonMark's emphasis rule, simplified: a closer takes the nearest opener of its character.
function closeEmphasis(out, openers, closer) {
  while (closer.n > 0) {
    let k = openers.length - 1;
    // A bounded search: pathological input (thousands of openers) stays cheap.
    const floor = Math.max(0, openers.length - 64);
    for (; k >= floor; k--) {
      const o = openers[k];
      if (o.ch !== closer.ch || o.n === 0) continue;
      if (closer.ch === "~" && o.n !== closer.n) continue;
      if ((o.canClose || closer.canOpen) && (o.n + closer.n) % 3 === 0 && (o.n % 3 || closer.n % 3))
        continue;
      break;
    }
    if (k < floor) return;
    const opener = openers[k];
    const use = closer.ch === "~" ? 2 : opener.n >= 2 && closer.n >= 2 ? 2 : 1;
    const at = out.indexOf(opener);
    const kids = out.splice(at + 1).map((item) => (item.delim ? item.ch.repeat(item.n) : item));
    const tag = closer.ch === "~" ? "del" : use === 2 ? "strong" : "em";
    opener.n -= use;
    closer.n -= use;
    openers.length = k + (opener.n > 0 ? 1 : 0); // openers inside are plain text now
    if (opener.n === 0) out.splice(at, 1);
    out.push({ tag, kids });
  }
}

// [text](url "title") or ![alt](url): the node, or null when it is not a link (yet).
function parseLink(src, start, open) {
  const image = src[start] === "!";
  const textStart = start + (image ? 2 : 1);
  let depth = 1;
  let i = textStart;
  for (; i < src.length; i++) {
    const c = src[i];
    if (c === "\\") i++;
    else if (c === "[") depth++;
    else if (c === "]" && --depth === 0) break;
  }
  if (i >= src.length) return null; // "[text" so far: plain text
  const label = src.slice(textStart, i);
  if (src[i + 1] !== "(") return null;
  let j = i + 2;
  let parens = 1;
  for (; j < src.length; j++) {
    const c = src[j];
    if (c === "\\") j++;
    else if (c === "(") parens++;
    else if (c === ")" && --parens === 0) break;
  }
  if (j >= src.length) {
    // "[text](http://ex" so far: show the text; the URL is not known yet.
    if (!open) return null;
    return {
      node: { tag: "span", kids: parseInline(label, false), pending: true },
      end: src.length,
    };
  }
  const target = src.slice(i + 2, j).trim();
  const url = target.match(/^<([^>]*)>|^\S+/);
  const href = url && safeHref(url[1] ?? url[0]);
  if (!href) return { node: src.slice(start, j + 1), end: j + 1 }; // shown as written
  const kids = image ? [`🖼 ${label || "image"}`] : parseInline(label, false);
  return { node: { tag: "a", href, kids }, end: j + 1 };
}

function safeHref(raw) {
  let url;
  try {
    url = new URL(raw.replace(/\\(.)/g, "$1"));
  } catch {
    return null; // relative, or not a URL at all
  }
  return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
}

// Build DOM for parsed inline content into `parent`. Returns the text node that ends the
// source, when more plain text may simply be appended to it.
function buildInline(parent, items) {
  let last = null;
  for (const item of items) {
    if (typeof item === "string") {
      if (last && parent.lastChild === last) last.appendData(item);
      else parent.append((last = document.createTextNode(item)));
      continue;
    }
    const el = document.createElement(item.tag);
    if (item.href) {
      el.href = item.href;
      el.rel = "noopener noreferrer nofollow";
      el.target = "_blank";
    }
    if (item.pending) el.className = "link-pending";
    const inner = buildInline(el, item.kids);
    parent.append(el);
    last = item.tail && item.tag !== "a" ? inner : null;
  }
  return last;
}

// One run of inline content in one element, re-rendered as its source grows.
class Inline {
  constructor(el) {
    this.el = el;
    this.src = "";
    this.open = false;
    this.end = null;
  }

  set(src, open) {
    if (src === this.src && open === this.open) return;
    if (open && this.open && this.end && src.length > this.src.length && src.startsWith(this.src)) {
      const delta = src.slice(this.src.length);
      if (!INLINE_SPECIAL.test(delta) && !INLINE_SPECIAL.test(this.src.at(-1))) {
        this.end.appendData(delta);
        this.src = src;
        return;
      }
    }
    const frag = document.createDocumentFragment();
    const end = buildInline(frag, parseInline(src, open));
    this.el.replaceChildren(frag);
    this.src = src;
    this.open = open;
    // Plain text may be appended where the source's last character is plain text.
    this.end = open && src && !INLINE_SPECIAL.test(src.at(-1)) ? end : null;
  }
}

// ---- blocks -----------------------------------------------------------------------------------

const el = (tag, className) => {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
};

function kindOf(line) {
  if (!line.trim()) return null;
  let m;
  if ((m = FENCE.exec(line)) && !(m[2][0] === "`" && m[3].includes("`"))) return { kind: "fence" };
  if ((m = HEADING.exec(line))) return { kind: "heading", level: m[1].length };
  if (HR.test(line)) return { kind: "hr" };
  if ((m = ITEM.exec(line))) return { kind: "list", ordered: m[3] !== undefined, ch: m[2].at(-1) };
  if (QUOTE.test(line)) return { kind: "quote" };
  return { kind: "paragraph" };
}

const stripIndent = (line) => line.replace(/^[ \t]+/, "");

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

const isTableLine = (line) => /^\s*\|/.test(line);

class Block {
  constructor(root, k) {
    this.root = root;
    this.k = k;
  }
  same(k) {
    return (
      !!k &&
      k.kind === this.k.kind &&
      k.level === this.k.level &&
      k.ordered === this.k.ordered &&
      k.ch === this.k.ch
    );
  }
  mount(node) {
    this.el = node;
    this.root.append(node);
  }
  remove() {
    this.el?.remove();
  }
  continues() {
    return false;
  }
  setTail() {}
  close() {}
}

class Paragraph extends Block {
  constructor(root, k) {
    super(root, k);
    this.lines = [];
    this.tail = "";
    this.mount(el("p"));
    this.inline = new Inline(this.el);
  }
  headerCandidate() {
    if (this.lines.length === 0)
      return isTableLine(this.tail) && this.tail.includes("|", this.tail.indexOf("|") + 1);
    return this.lines.length === 1 && isTableLine(this.lines[0]) && DELIM_PREFIX.test(this.tail);
  }
  continues(line, partial) {
    if (this.lines.length === 1 && isTableLine(this.lines[0])) {
      if (partial ? DELIM_PREFIX.test(line) : isDelimiterFor(line, this.lines[0])) return true;
    }
    return kindOf(line)?.kind === "paragraph";
  }
  add(line) {
    if (
      this.lines.length === 1 &&
      isTableLine(this.lines[0]) &&
      isDelimiterFor(line, this.lines[0])
    ) {
      const table = new Table(this.root, this.k, this.lines[0], line);
      this.el.replaceWith(table.el);
      return table;
    }
    this.lines.push(line);
    this.tail = "";
    this.render(true);
    return null;
  }
  setTail(tail) {
    this.tail = tail;
    this.render(true);
  }
  close() {
    this.tail = "";
    this.render(false);
  }
  render(open) {
    if (open && this.headerCandidate()) {
      // A table on its way: its header row already, as a table.
      const cells = splitRow(this.lines[0] ?? this.tail);
      if (this.headerCells !== cells.join("\u0000")) {
        this.headerCells = cells.join("\u0000");
        const view = tableSkeleton(cells, [], true).wrap;
        this.el.replaceWith(view);
        this.el = view;
      }
      return;
    }
    if (this.el.tagName !== "P") {
      const p = el("p");
      this.el.replaceWith(p);
      this.el = p;
      this.inline = new Inline(p);
      this.headerCells = null;
    }
    const lines = this.tail ? [...this.lines, this.tail] : this.lines;
    let src = lines.map(stripIndent).join("\n");
    if (!open) src = src.trimEnd();
    this.inline.set(src, open);
  }
}

function isDelimiterFor(line, header) {
  return (
    DELIM_ROW.test(line) && line.includes("-") && splitRow(line).length === splitRow(header).length
  );
}

function tableSkeleton(cells, aligns, open) {
  const wrap = el("div", "table-wrap");
  const table = el("table");
  const head = el("thead");
  const row = el("tr");
  cells.forEach((cell, i) => {
    const th = el("th");
    if (aligns[i]) th.style.textAlign = aligns[i];
    new Inline(th).set(cell, open);
    row.append(th);
  });
  head.append(row);
  const body = el("tbody");
  table.append(head, body);
  wrap.append(table);
  return { wrap, body };
}

class Table extends Block {
  constructor(root, k, header, delimiter) {
    super(root, k);
    this.aligns = splitRow(delimiter).map((d) =>
      d.startsWith(":") && d.endsWith(":")
        ? "center"
        : d.endsWith(":")
          ? "right"
          : d.startsWith(":")
            ? "left"
            : "",
    );
    this.width = this.aligns.length;
    const { wrap, body } = tableSkeleton(splitRow(header), this.aligns, false);
    this.el = wrap;
    this.body = body;
    this.row = null; // the row being streamed: {tr, cells: [Inline]}
  }
  continues(line) {
    return line.includes("|") && kindOf(line)?.kind === "paragraph";
  }
  add(line) {
    this.fill(line, false);
    this.row = null;
    return null;
  }
  setTail(tail) {
    if (!tail.trim()) {
      this.row?.tr.remove();
      this.row = null;
      return;
    }
    this.fill(tail, true);
  }
  fill(line, open) {
    if (!this.row) {
      const tr = el("tr");
      const cells = [];
      for (let i = 0; i < this.width; i++) {
        const td = el("td");
        if (this.aligns[i]) td.style.textAlign = this.aligns[i];
        tr.append(td);
        cells.push(new Inline(td));
      }
      this.body.append(tr);
      this.row = { tr, cells };
    }
    let values = splitRow(line);
    if (open && /\|\s*$/.test(line) && values.at(-1) === "") values = values.slice(0, -1);
    this.row.cells.forEach((cell, i) => cell.set(values[i] ?? "", open && i === values.length - 1));
  }
  close() {
    this.row?.tr.remove();
    this.row = null;
  }
}

class Heading extends Block {
  constructor(root, k) {
    super(root, k);
    this.mount(el(`h${k.level}`));
    this.inline = new Inline(this.el);
    this.done = false;
  }
  static text(line) {
    const text = line.replace(/^ {0,3}#{1,6}[ \t]*/, "").replace(/(^|[ \t]+)#+[ \t]*$/, "");
    return text.trim();
  }
  add(line) {
    this.inline.set(Heading.text(line), false);
    this.done = true;
    return null;
  }
  setTail(tail) {
    if (!this.done) this.inline.set(Heading.text(tail).trimStart(), true);
  }
}

class Rule extends Block {
  constructor(root, k) {
    super(root, k);
    this.mount(el("hr"));
  }
  add() {
    return null;
  }
}

class Quote extends Block {
  constructor(root, k) {
    super(root, k);
    this.lines = [];
    this.tail = "";
    this.mount(el("blockquote"));
    const p = el("p");
    this.el.append(p);
    this.inline = new Inline(p);
  }
  continues(line) {
    return QUOTE.test(line);
  }
  add(line) {
    this.lines.push(QUOTE.exec(line)[1]);
    this.setTail("");
    return null;
  }
  setTail(tail) {
    const m = tail && QUOTE.exec(tail);
    this.inline.set((m ? [...this.lines, m[1]] : this.lines).join("\n"), true);
  }
  close() {
    this.inline.set(this.lines.join("\n").trimEnd(), false);
  }
}

class Fence extends Block {
  constructor(root, k) {
    super(root, k);
    this.opener = null;
    this.done = false;
    const box = el("div", "code-block");
    const head = el("div", "code-head");
    this.lang = el("span", "code-lang");
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyCode(this.code, copy));
    head.append(this.lang, copy);
    const pre = el("pre");
    this.code = el("code");
    this.tail = document.createTextNode("");
    this.code.append(this.tail);
    pre.append(this.code);
    box.append(head, pre);
    this.mount(box);
  }
  static parse(line) {
    const m = FENCE.exec(line);
    return { indent: m[1].length, ch: m[2][0], n: m[2].length, info: m[3].trim().split(/\s+/)[0] };
  }
  closes(line) {
    const m = /^\s*(`{3,}|~{3,})\s*$/.exec(line);
    return !!m && m[1][0] === this.opener.ch && m[1].length >= this.opener.n;
  }
  continues() {
    return !this.done;
  }
  strip(line) {
    return line.replace(new RegExp(`^ {0,${this.opener.indent}}`), "");
  }
  add(line) {
    if (!this.opener) {
      this.opener = Fence.parse(line);
      this.lang.textContent = this.opener.info;
      if (this.opener.info) this.code.className = `language-${this.opener.info}`;
    } else if (this.closes(line)) {
      this.done = true;
      this.tail.data = "";
      this.el.dataset.closed = "true";
    } else {
      // A node per line: appending never copies the code so far.
      this.code.insertBefore(document.createTextNode(`${this.strip(line)}\n`), this.tail);
    }
    return null;
  }
  setTail(tail) {
    if (!this.opener) {
      const info = Fence.parse(tail).info;
      if (this.lang.textContent !== info) this.lang.textContent = info;
      return;
    }
    if (this.done) return;
    // The closing fence on its way is not code.
    const text =
      /^\s*(`+|~+)\s*$/.test(tail) && tail.trim()[0] === this.opener.ch ? "" : this.strip(tail);
    if (this.tail.data !== text) this.tail.data = text;
  }
  close() {
    this.tail.data = "";
  }
}

function copyCode(code, button) {
  const text = code.textContent.replace(/\n$/, "");
  const done = (ok) => {
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => (button.textContent = "Copy"), 1500);
  };
  if (navigator.clipboard?.writeText) {
    navigator.clipboard.writeText(text).then(
      () => done(true),
      () => done(fallbackCopy(code)),
    );
  } else {
    done(fallbackCopy(code));
  }
}

function fallbackCopy(code) {
  const range = document.createRange();
  range.selectNodeContents(code);
  const selection = getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
  try {
    return document.execCommand("copy");
  } catch {
    return false;
  } finally {
    selection.removeAllRanges();
  }
}

// Lists: one level per nesting depth; only the last item of each is open.
class List extends Block {
  constructor(root, k) {
    super(root, k);
    this.levels = [];
    this.blank = false;
    this.eager = null; // the tail's item, started before its line is complete
  }
  openLevel(m, parent) {
    const ordered = m[3] !== undefined;
    const list = el(ordered ? "ol" : "ul");
    if (ordered && Number(m[3]) !== 1) list.start = Number(m[3]);
    const level = { list, ordered, ch: m[2].at(-1), indent: m[1].length, content: 0, item: null };
    if (parent) parent.item.li.append(list);
    else this.mount(list);
    this.levels.push(level);
    return level;
  }
  startItem(m) {
    const indent = m[1].length;
    let top = this.levels.at(-1);
    if (!top) top = this.openLevel(m, null);
    else if (indent >= top.content) {
      this.endItem(top);
      top = this.openLevel(m, top);
    } else {
      while (this.levels.length > 1 && indent < top.indent) {
        this.endItem(top);
        this.levels.pop();
        top = this.levels.at(-1);
      }
      this.endItem(top);
    }
    top.content = indent + m[2].length + Math.min((m[4] || " ").length, 4);
    const li = el("li");
    const text = el("span", "li-text");
    li.append(text);
    top.list.append(li);
    top.item = { li, inline: new Inline(text), lines: [] };
    return top;
  }
  endItem(level) {
    if (level.item) level.item.inline.set(level.item.lines.join("\n").trimEnd(), false);
  }
  continues(line, partial) {
    if (!line.trim()) return true;
    const m = ITEM.exec(line);
    if (m && !HR.test(line)) {
      const first = this.levels[0];
      if (m[1].length >= first.content) return true;
      return (m[3] !== undefined) === first.ordered && m[2].at(-1) === first.ch;
    }
    if (partial && this.levels[0].ordered && /^\s*\d{1,9}[.)]?$/.test(line)) return true;
    const k = kindOf(line);
    if (k.kind !== "paragraph") return false;
    return !this.blank || /^\s{2,}/.test(line);
  }
  add(line) {
    if (!line.trim()) {
      this.blank = true;
      return null;
    }
    const m = ITEM.exec(line);
    const itemLine = m && !HR.test(line);
    let item;
    if (this.eager && itemLine) {
      item = this.eager.item;
    } else if (itemLine) {
      item = this.startItem(m).item;
    } else {
      item = this.levels.at(-1).item;
      if (this.blank) item.lines.push("");
      item.lines.push(stripIndent(line));
      item.inline.set(item.lines.join("\n"), true);
      this.blank = false;
      this.eager = null;
      return null;
    }
    this.eager = null;
    this.blank = false;
    item.lines.push(m[5] ?? "");
    item.inline.set(item.lines.join("\n"), true);
    return null;
  }
  setTail(tail) {
    const item = this.levels.at(-1)?.item;
    if (ITEM_OPEN.test(tail) && !HR.test(tail)) {
      if (!this.eager) this.eager = this.startItem(ITEM.exec(tail));
      this.eager.item.inline.set(ITEM.exec(tail)[5] ?? "", true);
      return;
    }
    if (!item) return;
    if (!tail.trim() || ITEM.test(tail) || /^\s*\d{1,9}[.)]?$/.test(tail)) {
      item.inline.set(item.lines.join("\n"), true); // nothing to show yet, or a marker on its way
      return;
    }
    const lines = this.blank
      ? [...item.lines, "", stripIndent(tail)]
      : [...item.lines, stripIndent(tail)];
    item.inline.set(lines.join("\n"), true);
  }
  close() {
    for (const level of this.levels) this.endItem(level);
  }
}

const BLOCKS = {
  paragraph: Paragraph,
  heading: Heading,
  hr: Rule,
  quote: Quote,
  fence: Fence,
  list: List,
};

// The renderer of one answer: append() text as it arrives, end() once it has all come.
export class MarkdownStream {
  constructor(root) {
    this.root = root;
    this.src = "";
    this.buf = ""; // the line being received
    this.open = null; // the last block, still taking lines
    this.tent = null; // a block the partial line starts, shown before its line is complete
  }

  get text() {
    return this.src;
  }

  append(text) {
    if (!text) return;
    this.src += text;
    this.buf += text;
    let nl = this.buf.indexOf("\n");
    if (nl >= 0) {
      let from = 0;
      while (nl >= 0) {
        this.line(this.buf.slice(from, nl).replace(/\r$/, ""));
        from = nl + 1;
        nl = this.buf.indexOf("\n", from);
      }
      this.buf = this.buf.slice(from);
    }
    this.partial(this.buf);
  }

  end() {
    if (this.buf) this.line(this.buf);
    this.buf = "";
    this.open?.close();
    this.open = null;
    this.dropTent();
  }

  line(line) {
    if (this.open?.continues(line, false)) {
      this.dropTent();
      this.open = this.open.add(line) ?? this.open;
      return;
    }
    this.open?.close();
    this.open = null;
    const k = kindOf(line);
    if (!k) return this.dropTent();
    if (this.tent?.same(k)) {
      this.open = this.tent;
      this.tent = null;
    } else {
      this.dropTent();
      this.open = new BLOCKS[k.kind](this.root, k);
    }
    this.open = this.open.add(line) ?? this.open;
  }

  partial(tail) {
    if (!tail.trim()) {
      this.open?.setTail("");
      return this.dropTent();
    }
    if (this.open?.continues(tail, true)) {
      this.dropTent();
      return this.open.setTail(tail);
    }
    this.open?.setTail("");
    const k = kindOf(tail);
    if (!this.tent?.same(k)) {
      this.dropTent();
      this.tent = new BLOCKS[k.kind](this.root, k);
    }
    this.tent.setTail(tail);
  }

  dropTent() {
    this.tent?.remove();
    this.tent = null;
  }
}
