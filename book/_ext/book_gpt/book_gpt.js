/* Chapter 14's GPT in the page: "The GPT in your browser" (book/gpt_in_your_browser.md).

   Plain JavaScript, no library, one thread. The data (book_gpt_data.js, written by the book's
   build with tfcore.browser.page_data_script) holds the weights in 16-bit floats as a safetensors
   file, and chapter 14's byte-level BPE as its vocabulary and merges. This file:
     1. reads them (base64 -> bytes -> safetensors -> float16 -> Float32Array);
     2. tokenizes as the tokenizers library does (chapter 24 writes the same algorithm in Python);
     3. runs the forward pass of tfcore.GPT (chapter 14): embeddings, then per block
        x + attention(LN1(x)) and x + feed-forward(LN2(x)), a final LayerNorm, the tied output layer;
     4. filters the next-token distribution as tfcore.next_token_probs does (temperature, top-k,
        top-p) and samples it by inverse CDF with mulberry32, the generator tfcore.browser.Mulberry32
        also writes;
     5. draws the widget.
   window.BookGPT exposes 1-4 for the browser test (tests/test_gpt_page.py), which compares them
   with tfcore. Activations are Float32Arrays (a row of attention scores a Float64Array); each sum runs
   in JavaScript's 64-bit numbers. */
(function () {
  "use strict";

  // ---------------------------------------------------------------- 1. the data
  function base64Bytes(text) {
    const binary = atob(text);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }

  function halfToFloat(h) {  // IEEE 754 binary16 -> number
    const sign = h & 0x8000 ? -1 : 1, exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
    if (exponent === 0) return sign * fraction * 2 ** -24;  // zero and subnormals
    if (exponent === 31) return fraction ? NaN : sign * Infinity;
    return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
  }

  function readSafetensors(bytes) {  // 8 bytes of header length, a JSON header, the raw tensors
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const headerLength = Number(view.getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)));
    const tensors = {};
    for (const [name, info] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      if (info.dtype !== "F16") throw new Error(`${name} is ${info.dtype}; the page reads F16 weights`);
      const [begin, end] = info.data_offsets, start = 8 + headerLength + begin;
      const values = new Float32Array((end - begin) / 2);
      for (let i = 0; i < values.length; i++) values[i] = halfToFloat(view.getUint16(start + 2 * i, true));
      tensors[name] = values;
    }
    return { tensors, config: JSON.parse(header.__metadata__.config) };
  }

  // ---------------------------------------------------------------- 2. the tokenizer
  // GPT-2's pattern. JavaScript's \s is not the tokenizers library's: it adds U+FEFF and lacks U+0085,
  // so the white space is written out as Unicode's White_Space set.
  const WS = "\\t\\n\\v\\f\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
  const PATTERN = new RegExp(`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${WS}\\p{L}\\p{N}]+` +
                             `|[${WS}]+(?![^${WS}])|[${WS}]+`, "gu");

  function bytesToUnicode() {  // each byte -> one printable character (the space byte -> "Ġ")
    const printable = (b) => (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    const table = [];
    let extra = 0;
    for (let b = 0; b < 256; b++) table.push(String.fromCharCode(printable(b) ? b : 256 + extra++));
    return table;
  }
  const BYTE_TO_CHAR = bytesToUnicode();
  const CHAR_TO_BYTE = new Map(BYTE_TO_CHAR.map((c, b) => [c, b]));

  class Tokenizer {
    constructor({ vocab, merges }) {
      this.vocab = vocab;
      this.ids = new Map(vocab.map((token, id) => [token, id]));
      this.ranks = new Map(merges.map(([left, right], rank) => [left + " " + right, rank]));
      this.cache = new Map();
    }

    encodeWord(word) {  // apply the merge of lowest rank, everywhere in the word, until none applies
      if (this.cache.has(word)) return this.cache.get(word);
      let symbols = Array.from(word);
      while (symbols.length > 1) {
        let best = -1, bestRank = Infinity;
        for (let i = 0; i + 1 < symbols.length; i++) {
          const rank = this.ranks.get(symbols[i] + " " + symbols[i + 1]);
          if (rank !== undefined && rank < bestRank) { best = i; bestRank = rank; }
        }
        if (best < 0) break;
        const left = symbols[best], right = symbols[best + 1], merged = [];
        for (let i = 0; i < symbols.length; i++) {
          if (i + 1 < symbols.length && symbols[i] === left && symbols[i + 1] === right) {
            merged.push(left + right);
            i++;
          } else merged.push(symbols[i]);
        }
        symbols = merged;
      }
      this.cache.set(word, symbols);
      return symbols;
    }

    encode(text) {  // text -> ids: GPT-2's words, each spelled in UTF-8 bytes, then merged
      const ids = [], utf8 = new TextEncoder();
      for (const match of text.matchAll(PATTERN)) {
        const word = Array.from(utf8.encode(match[0]), (b) => BYTE_TO_CHAR[b]).join("");
        for (const token of this.encodeWord(word)) ids.push(this.ids.get(token));
      }
      return ids;
    }

    bytes(ids) { return Uint8Array.from(ids.flatMap((id) => Array.from(this.vocab[id], (c) => CHAR_TO_BYTE.get(c)))); }

    decode(ids) { return new TextDecoder().decode(this.bytes(ids)); }  // a broken character -> U+FFFD

    label(id) {  // one token as the reader sees it: a space as ␣, a line break as ↵, a lone byte as <F0>
      const bytes = this.bytes([id]);
      let text;
      try { text = new TextDecoder("utf-8", { fatal: true }).decode(bytes); } catch (e) {
        return Array.from(bytes, (b) => "<" + b.toString(16).toUpperCase().padStart(2, "0") + ">").join("");
      }
      return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
    }
  }

  // ---------------------------------------------------------------- 3. the model
  function linear(x, rows, weight, bias, nIn, nOut) {  // x [rows, nIn] @ weight[nOut, nIn]^T + bias
    const y = new Float32Array(rows * nOut);
    for (let r = 0; r < rows; r++) {
      for (let o = 0; o < nOut; o++) {
        let sum = bias ? bias[o] : 0;
        for (let i = 0; i < nIn; i++) sum += x[r * nIn + i] * weight[o * nIn + i];
        y[r * nOut + o] = sum;
      }
    }
    return y;
  }

  function layerNorm(x, rows, n, weight, bias, eps) {  // over the last dimension, biased variance
    const y = new Float32Array(rows * n);
    for (let r = 0; r < rows; r++) {
      let mean = 0, variance = 0;
      for (let i = 0; i < n; i++) mean += x[r * n + i];
      mean /= n;
      for (let i = 0; i < n; i++) variance += (x[r * n + i] - mean) ** 2;
      const scale = 1 / Math.sqrt(variance / n + eps);
      for (let i = 0; i < n; i++) y[r * n + i] = (x[r * n + i] - mean) * scale * weight[i] + bias[i];
    }
    return y;
  }

  const GELU_C = Math.sqrt(2 / Math.PI);
  function gelu(x) {  // GPT-2's tanh approximation, in place
    for (let i = 0; i < x.length; i++) {
      const v = x[i];
      x[i] = 0.5 * v * (1 + Math.tanh(GELU_C * (v + 0.044715 * v * v * v)));
    }
    return x;
  }

  class GPT {
    constructor({ tensors, config }) {
      this.w = tensors;
      this.config = config;
      this.eps = config.layer_norm_eps;
      for (const key of ["token_embeddings.weight", "position_embeddings.weight", "final_layer_norm.weight"]) {
        if (!(key in tensors)) throw new Error(`the weights lack ${key}`);
      }
    }

    // ids [L] (1 <= L <= max positions), query (0 .. L - 1, the last by default) ->
    // { logits [L * V], attention[layer][head] [query + 1]: that token's weights over itself and the tokens before it }
    forward(ids, query = ids.length - 1) {
      const { hidden_size: H, num_attention_heads: heads, vocab_size: V, intermediate_size: F } = this.config;
      const L = ids.length, d = H / heads, w = this.w;
      if (L < 1 || L > this.config.max_position_embeddings) throw new Error(`the model takes 1 to ${this.config.max_position_embeddings} tokens, got ${L}`);
      const bad = ids.findIndex((id) => !Number.isInteger(id) || id < 0 || id >= V);
      if (bad >= 0) throw new Error(`token ids are whole numbers from 0 to ${V - 1}; ids[${bad}] is ${ids[bad]}`);
      if (!Number.isInteger(query) || query < 0 || query >= L) {
        throw new Error(`the query is a position from 0 to ${L - 1}, got ${query}`);
      }
      let x = new Float32Array(L * H);
      for (let t = 0; t < L; t++) {
        const position = t;  // the t-th token of the window takes position t
        for (let i = 0; i < H; i++) {
          x[t * H + i] = w["token_embeddings.weight"][ids[t] * H + i] + w["position_embeddings.weight"][position * H + i];
        }
      }
      const attention = [];
      for (let b = 0; b < this.config.num_hidden_layers; b++) {
        const p = `blocks.${b}.`;
        const h = layerNorm(x, L, H, w[p + "layer_norm_1.weight"], w[p + "layer_norm_1.bias"], this.eps);
        const q = linear(h, L, w[p + "attention.query.weight"], w[p + "attention.query.bias"], H, H);
        const k = linear(h, L, w[p + "attention.key.weight"], w[p + "attention.key.bias"], H, H);
        const v = linear(h, L, w[p + "attention.value.weight"], w[p + "attention.value.bias"], H, H);
        const context = new Float32Array(L * H), rows = [];
        const scores = new Float64Array(L);
        for (let head = 0; head < heads; head++) {
          const offset = head * d;
          for (let i = 0; i < L; i++) {
            const keys = i + 1;  // causal: query i sees keys 0 .. i
            let max = -Infinity;
            for (let j = 0; j < keys; j++) {
              let s = 0;
              for (let e = 0; e < d; e++) {
                s += q[i * H + offset + e] * k[j * H + offset + e];
              }
              scores[j] = s / Math.sqrt(d);
              if (scores[j] > max) max = scores[j];
            }
            let total = 0;
            for (let j = 0; j < keys; j++) {
              scores[j] = Math.exp(scores[j] - max);
              total += scores[j];
            }
            for (let j = 0; j < keys; j++) scores[j] /= total;
            for (let e = 0; e < d; e++) {
              let s = 0;
              for (let j = 0; j < keys; j++) {
                s += scores[j] * v[j * H + offset + e];
              }
              context[i * H + offset + e] = s;
            }
            if (i === query) rows.push(Float32Array.from(scores.subarray(0, keys)));
          }
        }
        attention.push(rows);
        const attended = linear(context, L, w[p + "attention.output_linear.weight"], w[p + "attention.output_linear.bias"], H, H);
        for (let i = 0; i < x.length; i++) x[i] += attended[i];
        const h2 = layerNorm(x, L, H, w[p + "layer_norm_2.weight"], w[p + "layer_norm_2.bias"], this.eps);
        const inner = gelu(linear(h2, L, w[p + "feed_forward.linear_1.weight"], w[p + "feed_forward.linear_1.bias"], H, F));
        const out = linear(inner, L, w[p + "feed_forward.linear_2.weight"], w[p + "feed_forward.linear_2.bias"], F, H);
        for (let i = 0; i < x.length; i++) x[i] += out[i];
      }
      x = layerNorm(x, L, H, w["final_layer_norm.weight"], w["final_layer_norm.bias"], this.eps);
      const logits = linear(x, L, w["token_embeddings.weight"], null, H, V);  // tied to the embeddings
      return { logits, attention };
    }
  }

  // ---------------------------------------------------------------- 4. sampling
  function mulberry32(seed) {  // uniforms in [0, 1), as tfcore.browser.Mulberry32
    let a = seed | 0;
    return function () {
      a = (a + 0x6d2b79f5) | 0;
      let t = Math.imul(a ^ (a >>> 15), a | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  // The distribution a sampler draws from, as tfcore.next_token_probs: logits [V] -> probabilities [V].
  // topK null or >= V: no cut; topP null or 1: no cut; temperature 0: all the mass on the argmax.
  function nextTokenProbs(logits, temperature, topK, topP) {
    const V = logits.length, probs = new Float64Array(V);
    if (temperature === 0) {
      let best = 0;
      for (let i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;  // the first of equal maxima
      probs[best] = 1;
      return probs;
    }
    const z = Float64Array.from(logits, (l) => l / temperature);
    if (topK !== null && topK < V) {  // keep the logits at least as large as the k-th largest
      const kth = Float64Array.from(z).sort()[V - topK];
      for (let i = 0; i < V; i++) if (z[i] < kth) z[i] = -Infinity;
    }
    let max = -Infinity, total = 0;
    for (let i = 0; i < V; i++) if (z[i] > max) max = z[i];
    for (let i = 0; i < V; i++) { probs[i] = Math.exp(z[i] - max); total += probs[i]; }
    for (let i = 0; i < V; i++) probs[i] /= total;
    if (topP !== null && topP < 1) {  // keep the most probable tokens until their mass reaches topP
      const order = Array.from(probs.keys()).sort((a, b) => probs[b] - probs[a] || a - b);
      let cumulative = 0, kept = 0;
      for (const i of order) {
        cumulative += probs[i];
        if (cumulative - probs[i] >= topP) probs[i] = 0;  // the mass ranked above it already reaches topP
        else kept += probs[i];
      }
      for (let i = 0; i < V; i++) probs[i] /= kept;
    }
    return probs;
  }

  function inverseCdf(probs, u) {  // the first token whose cumulative probability exceeds u
    let cumulative = 0, below = 0;
    for (let i = 0; i < probs.length; i++) { cumulative += probs[i]; if (cumulative <= u) below++; }
    return Math.min(below, probs.length - 1);
  }

  function lastLogits(model, ids) {
    const V = model.config.vocab_size, { logits } = model.forward(window_(ids, model));
    return logits.subarray(logits.length - V);
  }

  function window_(ids, model) {  // the model sees the last max_position_embeddings tokens
    if (ids.length === 0) throw new Error("an empty prompt has no token to predict from");
    return ids.slice(-model.config.max_position_embeddings);
  }

  // n tokens after ids, one Mulberry32(seed) uniform each (temperature 0: greedy)
  function sample(model, ids, n, temperature, topK, topP, seed) {
    const random = mulberry32(seed), out = ids.slice();
    for (let step = 0; step < n; step++) {
      const probs = nextTokenProbs(lastLogits(model, out), temperature, topK, topP);
      out.push(inverseCdf(probs, random()));
    }
    return out;
  }

  // ---------------------------------------------------------------- 5. the widget
  function element(tag, attributes = {}, children = []) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes)) {
      if (key === "text") node.textContent = value; else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function slider(label, min, max, step, value, show) {
    const input = element("input", { type: "range", min, max, step, value, "aria-label": label });
    const shown = element("span", { class: "bg-value" });
    const row = element("label", { class: "bg-slider" }, [element("span", { text: label }), input, shown]);
    const update = () => { shown.textContent = show(Number(input.value)); };
    input.addEventListener("input", update);
    update();
    return { row, input };
  }

  function widget(root, model, tokenizer) {
    const V = model.config.vocab_size, P = model.config.max_position_embeddings;
    const prompt = element("textarea", { class: "bg-prompt", rows: 3, "aria-label": "prompt",
                                         spellcheck: "false" });
    prompt.value = root.dataset.prompt || "The attention weights of each head";
    const temperature = slider("temperature", 0, 2, 0.05, 1, (t) => (t === 0 ? "0 (greedy)" : t.toFixed(2)));
    const topK = slider("top-k", 0, 50, 1, 0, (k) => (k === 0 ? "off" : String(k)));
    const topP = slider("top-p", 0.05, 1, 0.05, 1, (p) => (p === 1 ? "off" : p.toFixed(2)));
    const seed = element("input", { type: "number", min: 0, max: 4294967295, value: 0, class: "bg-seed",
                                    "aria-label": "seed" });
    const sampleOne = element("button", { type: "button", text: "sample the next token" });
    const sampleTen = element("button", { type: "button", text: "sample 10" });
    const clear = element("button", { type: "button", text: "clear the samples" });
    const tokens = element("div", { class: "bg-tokens" });
    const status = element("p", { class: "bg-status" });
    const chart = element("div", { class: "bg-chart" });
    const heads = element("div", { class: "bg-attention" });
    const attentionHeading = element("div", { class: "bg-heading bg-query-heading" });
    root.replaceChildren(
      prompt,
      element("div", { class: "bg-controls" }, [temperature.row, topK.row, topP.row,
        element("label", { class: "bg-slider" }, [element("span", { text: "seed" }), seed]),
        element("div", { class: "bg-buttons" }, [sampleOne, sampleTen, clear])]),
      element("div", { class: "bg-heading", text: "tokens" }), tokens, status,
      element("div", { class: "bg-heading", text: "the next token: the model's top 12, and what the sliders leave" }), chart,
      attentionHeading, heads);

    let promptIds = [], sampled = [], random = null, query = null;  // query: a position in the window; null, the last
    const settings = () => ({
      t: Number(temperature.input.value),
      k: Number(topK.input.value) === 0 ? null : Number(topK.input.value),
      p: Number(topP.input.value) === 1 ? null : Number(topP.input.value),
    });

    function draw() {
      const ids = promptIds.concat(sampled), seen = ids.slice(-P), dropped = ids.length - seen.length;
      chart.replaceChildren();
      heads.replaceChildren();
      if (ids.length === 0) {
        tokens.replaceChildren();
        status.textContent = "An empty prompt: there is no token to predict from. Type something.";
        return;
      }
      const q = query === null || query >= seen.length ? seen.length - 1 : query;
      const started = performance.now();
      const { logits, attention } = model.forward(seen, q);
      const elapsed = performance.now() - started;
      // each token of the window after the first: the probability the model gave it from the tokens before it
      const given = seen.map((id, j) => (j === 0 ? null : nextTokenProbs(logits.subarray((j - 1) * V, j * V), 1, null, null)[id]));
      const loss = given.slice(1).reduce((sum, q) => sum - Math.log(q), 0) / Math.max(seen.length - 1, 1);
      const about = (i) => `id ${ids[i]}` + (i < dropped ? " (outside the window: the model does not see it)" :
        given[i - dropped] === null ? "" : `; the model gave it ${(100 * given[i - dropped]).toPrecision(2)}%`);
      tokens.replaceChildren(...ids.map((id, i) => {
        const token = element("span", {
          class: "bg-token" + (i < dropped ? " bg-dropped" : "") + (i >= promptIds.length ? " bg-sampled" : "") +
                 (i - dropped === q ? " bg-query" : ""),
          title: about(i), text: tokenizer.label(id), ...(i >= dropped ? { tabindex: 0, role: "button" } : {}) });
        if (i >= dropped) {  // a click (or Enter) makes it the token whose attention is drawn
          const choose = () => { query = i - dropped === seen.length - 1 ? null : i - dropped; draw(); };
          token.addEventListener("click", choose);
          token.addEventListener("keydown", (e) => { if (e.key === "Enter") choose(); });
        }
        return token;
      }));
      status.textContent = `${ids.length} tokens` + (dropped ? `; the model sees the last ${P}, ` +
        `the ${dropped} before them (greyed) are dropped` : "") +
        (seen.length > 1 ? `. Its loss on the ${seen.length - 1} it predicts: ${loss.toFixed(2)} nats per token` : "") +
        `. This forward pass over ${seen.length} tokens took ${elapsed.toFixed(1)} ms in your browser.`;
      const last = logits.subarray(logits.length - V), { t, k, p } = settings();
      const model1 = nextTokenProbs(last, 1, null, null), left = nextTokenProbs(last, t, k, p);
      const top = Array.from(model1.keys()).sort((a, b) => model1[b] - model1[a] || a - b).slice(0, 12);
      let kept = 0;
      for (let i = 0; i < V; i++) if (left[i] > 0) kept++;
      const longest = Math.max(...top.map((id) => Math.max(model1[id], left[id])));  // the longest bar's value
      for (const id of top) {
        chart.append(element("div", { class: "bg-bar-row" }, [
          element("span", { class: "bg-bar-label", text: tokenizer.label(id) }),
          element("span", { class: "bg-bar-track" }, [
            element("span", { class: "bg-bar-model", style: `width:${(100 * model1[id] / longest).toFixed(2)}%` }),
            element("span", { class: "bg-bar-left", style: `width:${(100 * left[id] / longest).toFixed(2)}%` })]),
          element("span", { class: "bg-bar-value",
                            text: `${(100 * model1[id]).toFixed(1)}% → ${(100 * left[id]).toFixed(1)}%` })]));
      }
      chart.append(element("p", { class: "bg-note", text: `The sliders leave ${kept} of the ${V} tokens. ` +
        `The longest bar is ${(100 * longest).toFixed(1)}%.` }));
      attentionHeading.replaceChildren(`the attention of token ${q + 1} of ${seen.length} (${tokenizer.label(seen[q])}; ` +
        `${about(dropped + q)}), each head of each layer`, element("span", { class: "bg-plain", text: ": a cell's " +
        "darkness is its weight over the row's largest, and the tokens after it are masked (×). Click a token to choose another." }));
      const table = element("table", { class: "bg-heads" });
      table.append(element("tr", {}, [element("th"), ...seen.map((id) => element("th", { text: tokenizer.label(id) }))]));
      attention.forEach((layer, l) => layer.forEach((weights, h) => {
        const largest = Math.max(...weights);  // each row shaded against its own largest weight
        table.append(element("tr", {}, [element("th", { text: `layer ${l + 1}, head ${h + 1} (max ${largest.toFixed(2)})` }),
          ...Array.from(weights, (a) => element("td", {
            style: `background: rgba(38, 99, 170, ${(a / largest).toFixed(3)})`, title: a.toFixed(3) })),
          ...seen.slice(q + 1).map(() => element("td", { class: "bg-masked", title: "masked: a later token", text: "×" }))]));
      }));
      heads.append(table);
    }

    function drawSamples(n) {
      const ids = promptIds.concat(sampled);
      if (ids.length === 0) return draw();
      if (random === null) random = mulberry32(seedValue());
      const { t, k, p } = settings();
      for (let i = 0; i < n; i++) {
        const probs = nextTokenProbs(lastLogits(model, promptIds.concat(sampled)), t, k, p);
        sampled.push(inverseCdf(probs, random()));
      }
      query = null;  // the attention follows the newest token
      draw();
    }

    function seedValue() {  // a whole number from 0 to 2**32 - 1; anything else is said, and 0 is used
      const value = Number(seed.value), valid = seed.value !== "" && Number.isInteger(value) && value >= 0 && value < 2 ** 32;
      seed.classList.toggle("bg-invalid", !valid);
      seed.title = valid ? "" : "the seed is a whole number from 0 to 4294967295: 0 is used";
      return valid ? value : 0;
    }
    const restart = () => { sampled = []; random = null; query = null; seedValue(); };
    prompt.addEventListener("input", () => { promptIds = tokenizer.encode(prompt.value); restart(); draw(); });
    for (const control of [temperature.input, topK.input, topP.input]) control.addEventListener("input", draw);
    seed.addEventListener("input", () => { restart(); draw(); });
    sampleOne.addEventListener("click", () => drawSamples(1));
    sampleTen.addEventListener("click", () => drawSamples(10));
    clear.addEventListener("click", () => { restart(); draw(); });
    promptIds = tokenizer.encode(prompt.value);
    draw();
  }

  // ---------------------------------------------------------------- start
  const data = window.BOOK_GPT_DATA;
  const tokenizer = new Tokenizer(data.tokenizer);
  const model = new GPT(readSafetensors(base64Bytes(data.weights)));
  window.BookGPT = {
    tokenizer, model, nextTokenProbs, inverseCdf, mulberry32, sample,
    context: (ids) => window_(ids, model),
    encode: (text) => tokenizer.encode(text),
    forward: (ids, query) => { const { logits, attention } = model.forward(ids, query ?? ids.length - 1);
                        return { logits: Array.from(logits), attention: attention.map((l) => l.map((h) => Array.from(h))) }; },
    greedy: (ids, n) => sample(model, ids, n, 0, null, null, 0),
  };
  const start = () => document.querySelectorAll(".book-gpt").forEach((root) => widget(root, model, tokenizer));
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
