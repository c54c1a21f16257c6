// The timing protocol for the book page's forward-pass options (issue 32). runFn(ids) returns (or resolves
// to) the logits of every position of the sequence ids, row-major [L, V]; all it does is timed.
// timeForward: `warmup` calls, then `runs` calls each timed alone with performance.now().
// timeGreedy: greedy decoding, no cache: each step reruns the whole sequence and appends the last position's
// argmax (the lowest id wins a tie); `warmup` untimed generations, then `repeats` timed ones.
// timerInfo: performance.now()'s smallest step (Chromium: 5 us if cross-origin isolated, else 100 us).
(function (root) {
  "use strict";
  function check(ok, message) { if (!ok) throw new TypeError(message); }
  function checkArgs(who, runFn, ids, counts) {
    check(typeof runFn === "function", `${who}: runFn must be a function ids -> logits, got ${typeof runFn}`);
    check(ids && ids.length > 0, `${who}: ids must be a non-empty array of token ids; pass e.g. [12, 7, 431]`);
    ids.forEach((v, i) => check(Number.isInteger(v) && v >= 0, `${who}: ids[${i}] = ${v} is not a whole ` +
                                "number >= 0 (convert a BigInt64Array with Array.from(x, Number))"));
    for (const [name, v, min] of counts) check(Number.isInteger(v) && v >= min, `${who}: ${name} must be a whole number >= ${min}, got ${v}`);
  }
  function vocabSize(logits, L, who) {
    check(logits && logits.length > 0 && logits.length % L === 0, `${who}: runFn must return the logits of all ${L} ` +
          `positions, row-major [L, V]; got ${logits && logits.length !== undefined ? "length " + logits.length : typeof logits}`);
    return logits.length / L;
  }
  function summarize(times) {
    const s = times.slice().sort((a, b) => a - b), n = s.length;
    return {median_ms: n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2, min_ms: s[0], max_ms: s[n - 1], times_ms: times};
  }
  async function timeForward(runFn, ids, {warmup = 5, runs = 50} = {}) {
    checkArgs("timeForward", runFn, ids, [["warmup", warmup, 1], ["runs", runs, 1]]);
    vocabSize(await runFn(ids), ids.length, "timeForward");  // the first warm-up call, checked
    for (let i = 1; i < warmup; i++) await runFn(ids);
    const times = [];
    for (let i = 0; i < runs; i++) {
      const t0 = performance.now();
      await runFn(ids);
      times.push(performance.now() - t0);
    }
    return {L: ids.length, warmup, runs, ...summarize(times)};
  }
  async function greedyOnce(runFn, prompt, steps) {
    const seq = Array.from(prompt);
    for (let s = 0; s < steps; s++) {
      const logits = await runFn(seq), L = seq.length, V = vocabSize(logits, L, "timeGreedy");
      let best = 0;
      for (let j = 1, off = (L - 1) * V; j < V; j++) if (logits[off + j] > logits[off + best]) best = j;
      seq.push(best);
    }
    return seq.slice(prompt.length);
  }
  async function timeGreedy(runFn, prompt, {steps = 20, repeats = 5, warmup = 1} = {}) {
    checkArgs("timeGreedy", runFn, prompt, [["steps", steps, 1], ["repeats", repeats, 1], ["warmup", warmup, 0]]);
    let tokens = null;
    for (let i = 0; i < warmup; i++) tokens = await greedyOnce(runFn, prompt, steps);
    const totals = [];
    for (let r = 0; r < repeats; r++) {
      const t0 = performance.now(), got = await greedyOnce(runFn, prompt, steps);
      totals.push(performance.now() - t0);
      check(tokens === null || got.join() === tokens.join(), `timeGreedy: two runs gave different tokens ` +
            `([${tokens}] then [${got}]): runFn is not deterministic`);
      tokens = got;
    }
    const total = summarize(totals);
    return {steps, repeats, total_ms_median: total.median_ms, per_token_ms_median: total.median_ms / steps, totals_ms: totals, tokens};
  }
  function timerInfo() {  // the smallest step of performance.now() seen in 20 ms
    let step = Infinity, last = performance.now();
    for (const end = last + 20; last <= end;) { const now = performance.now(); if (now !== last) step = Math.min(step, now - last); last = now; }
    return {crossOriginIsolated: !!root.crossOriginIsolated, smallest_step_ms: step};
  }
  const api = {timeForward, timeGreedy, timerInfo, summarize};
  if (typeof module !== "undefined" && module.exports) module.exports = api; else Object.assign(root, api);
})(typeof globalThis !== "undefined" ? globalThis : this);
