"""Time the book page's forward-pass options in Chromium in the same rounds (issue 32): its plain JavaScript
(book_gpt.js) and onnxruntime-web (wasm) with export.py's model in fp16 and fp32. See README.md.

    OMP_NUM_THREADS=1 .venv/bin/python tools/page_options/measure.py --wait-quiet
        [--work /tmp/page_options] [--book _build/html/_tfcore/book_gpt] [--out benchmarks/page_options.json]
"""
import argparse
import datetime
import hashlib
import http.server
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHROMIUM, BROWSER_ARGS = "/usr/bin/chromium", ["--headless", "--no-sandbox", "--disable-gpu"]
ORT = [f"ort/{n}" for n in ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")]
OPTIONS = {  # name -> (page.html's options, the files the option needs)
    "plain_js": ({"option": "js", "precision": "js"}, ["plainjs/book_gpt.js", "plainjs/book_gpt_data.js"]),
    **{f"ort_{p}": ({"option": "ort", "precision": p, "model": f"models/book_gpt.{p}.onnx"},
                    ORT + [f"models/book_gpt.{p}.onnx"]) for p in ("fp16", "fp32")}}
PLANTED = {"plain_js": {"plant": True}, "ort_fp16": {"model": "models/planted.fp16.onnx"},
           "ort_fp32": {"model": "models/planted.fp32.onnx"}}  # every check must fail on these
TYPES = {".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm"}


def routes(work: Path, book: Path) -> dict:
    """URL path -> file: the only files served. Exits with the fix if one is missing."""
    dist, models = work / "npm/node_modules/onnxruntime-web/dist", work / "models"
    table = {"page.html": HERE / "page.html", "timing.js": HERE / "timing.js", **{u: dist / u[4:] for u in ORT},
             **{f"plainjs/{n}": book / n for n in ("book_gpt.js", "book_gpt_data.js")},
             **{f"models/{n}": models / n for n in ("reference.json", "export.json", "book_gpt.fp16.onnx",
                                                    "book_gpt.fp32.onnx", "planted.fp16.onnx", "planted.fp32.onnx")}}
    fixes = {book: "build the book, or pass --book", models: "run export.py first",
             dist: f"cd {work / 'npm'} && npm install onnxruntime-web@1.30.0"}
    for path in table.values():
        if not path.is_file():
            sys.exit(f"measure.py: {path} is missing: {fixes.get(path.parent, 'see README.md')}")
    return table


def serve(table: dict, log: list):
    """http://127.0.0.1:<free port>, cross-origin isolated (COOP/COEP), no caching; logs every path asked for."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = urlparse(self.path).path.lstrip("/")
            log.append(path if path in table else f"404 {path}")
            if path not in table:
                return self.send_error(404)
            body = table[path].read_bytes()
            self.send_response(200)
            for header in (("Content-Type", TYPES.get(table[path].suffix, "application/octet-stream")),
                           ("Content-Length", str(len(body))), ("Cache-Control", "no-store"),
                           ("Cross-Origin-Opener-Policy", "same-origin"),
                           ("Cross-Origin-Embedder-Policy", "require-corp")):
                self.send_header(*header)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_page(browser, base: str, script: str, arg, log: list) -> dict:
    """One page in a fresh context, every request to another host aborted and listed."""
    log.clear()
    blocked, context = [], browser.new_context()
    context.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).netloc == urlparse(base).netloc
                  else (blocked.append(r.request.url), r.abort()))
    page = context.new_page()
    page.goto(f"{base}/page.html")
    result = page.evaluate(script, arg)
    context.close()
    return {"page": result, "requests": sorted(set(log)), "blocked": blocked}


PROBE = """<!DOCTYPE html><html><head><meta charset="utf-8"><script src="ort/ort.wasm.min.js"></script></head>
<body></body></html>"""
START_ORT = """async (b64) => {  // onnxruntime-web as page.html starts it, on the fp32 model's bytes
  Object.assign(ort.env.wasm, {numThreads: 1, proxy: false, wasmPaths: new URL("ort/", location.href).href});
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  try { await ort.InferenceSession.create(bytes, {executionProviders: ["wasm"]}); return "started"; }
  catch (e) { return "failed: " + e.message; }
}"""


def file_probe(browser, table: dict, base: str, folder: Path) -> dict:
    """Does onnxruntime-web start in a page opened from disk (file://)? The same page and model served
    over http is the control. ``folder`` gets the probe page and a copy of ORT's files."""
    import base64
    import shutil

    (folder / "ort").mkdir(parents=True, exist_ok=True)
    for url in ORT:
        shutil.copy(table[url], folder / url)
    (folder / "probe.html").write_text(PROBE)
    table["probe.html"] = folder / "probe.html"
    model = base64.b64encode(table["models/book_gpt.fp32.onnx"].read_bytes()).decode()
    outcome = {}
    for name, url in (("file", (folder / "probe.html").as_uri()), ("http", f"{base}/probe.html")):
        context = browser.new_context()
        context.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", base)) else r.abort())
        page = context.new_page()
        page.goto(url)
        outcome[name] = page.evaluate(START_ORT, model)
        context.close()
    del table["probe.html"]
    return outcome


def summary(runs: list, table: dict, files: list) -> dict:
    """One option's rounds: the values per round and their median, the check, the files' sizes."""
    def gzip9(path):  # as `gzip -9` (the command-line tool) compresses it
        return len(subprocess.run(["gzip", "-9", "-c", str(path)], capture_output=True, check=True).stdout)

    rs = [r["page"] for r in runs]
    sizes = {u: {"raw": table[u].stat().st_size, "gzip9": gzip9(table[u]),
                 "sha256": hashlib.sha256(table[u].read_bytes()).hexdigest()[:16]} for u in files}
    values = {"startup_ms": [r["startup_ms"] for r in rs], **{f"startup_{k}": [r["steps"][k] for r in rs]
                                                              for k in rs[0]["steps"]},
              **{f"{f}_{k}": [r[f][k] for r in rs] for f in ("forward64", "forward8") for k in ("median_ms", "min_ms")},
              **{f"greedy20_{k}": [r["greedy20"][k] for r in rs] for k in ("total_ms_median", "per_token_ms_median")}}
    return {"page_weight_bytes": {k: sum(f[k] for f in sizes.values()) for k in ("raw", "gzip9")}, "files": sizes,
            "median_over_rounds": {k: round(statistics.median(v), 3) for k, v in values.items()},
            "per_round": {k: [round(x, 3) for x in v] for k, v in values.items()},
            "timer_step_ms": max(r["timer"]["smallest_step_ms"] for r in rs),
            "check": {"max_abs_vs_torch64": max(r["check"]["max_abs_vs_torch64"] for r in rs),
                      "tolerance": rs[0]["check"]["tolerance"]}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/page_options", help="holds npm/ and models/ (README.md)")
    parser.add_argument("--book", default=str(REPO / "_build/html/_tfcore/book_gpt"), help="the built page's files")
    parser.add_argument("--out", default=str(REPO / "benchmarks/page_options.json"))
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 11), metavar="1..10")
    parser.add_argument("--wait-quiet", type=float, nargs="?", const=300, default=0, metavar="SECONDS",
                        help="first wait (up to 300 s, or SECONDS) for the 1-minute load average to fall below 0.5")
    args = parser.parse_args()
    table = routes(Path(args.work), Path(args.book))
    if not Path(CHROMIUM).exists():
        sys.exit(f"measure.py: {CHROMIUM} is missing: install Debian's chromium (never a downloaded browser)")
    from playwright.sync_api import sync_playwright

    started = time.time()
    while os.getloadavg()[0] >= 0.5 and time.time() - started < args.wait_quiet:
        time.sleep(5)
    export = json.loads(table["models/export.json"].read_text())
    cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    results = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"nproc": os.cpu_count(), "cpu_model": cpu[0] if cpu else "unknown"},
               "load": {"waited_s": round(time.time() - started), "before": [round(x, 2) for x in os.getloadavg()]},
               "versions": {**export["versions"], "onnxruntime_web": json.loads(
                   (table[ORT[0]].parents[1] / "package.json").read_text())["version"]},
               "protocol": {"rounds": args.rounds, "browser_args": BROWSER_ARGS,
                            "forward": "median, min of 50 calls after 5 warm-ups",
                            "greedy": "20 tokens after 8, the whole sequence rerun per step; median of 5"},
               "export": {k: export[k] for k in ("max_abs_vs_torch64", "tolerance", "unpatched_export")}}
    log, runs, checks = [], {name: [] for name in OPTIONS}, {}
    server = serve(table, log)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            results["versions"]["chromium"] = browser.version
            for r in range(args.rounds):  # interleaved, the order rotating
                for name in list(OPTIONS)[r % 3:] + list(OPTIONS)[:r % 3]:
                    runs[name].append(run_page(browser, base, "o => runOption(o)", OPTIONS[name][0], log))
                    print(f"round {r + 1} {name}: start-up {runs[name][-1]['page']['startup_ms']:.1f} ms", flush=True)
            for name, plant in PLANTED.items():
                got = run_page(browser, base, "o => runOption(o)", {**OPTIONS[name][0], **plant, "time": False}, log)
                checks[f"planted_{name}_fails"] = not got["page"]["check"]["pass"]
            probe = run_page(browser, base, "u => fetch(u).then(() => 'fetched', () => 'failed')",
                             "https://cdn.jsdelivr.net/npm/onnxruntime-web", log)
            checks["other_hosts_blocked"] = probe["page"] == "failed" and len(probe["blocked"]) == 1
            results["ort_from_disk"] = file_probe(browser, table, base, Path(args.work) / "probe")
            checks["ort_starts_over_http"] = results["ort_from_disk"]["http"] == "started"
            browser.close()
    finally:
        server.shutdown()
    results["load"]["after"] = [round(x, 2) for x in os.getloadavg()]
    results["options"] = {name: summary(rs, table, OPTIONS[name][1]) for name, rs in runs.items()}
    for name, rs in runs.items():
        expected = {"page.html", "timing.js", "models/reference.json", *OPTIONS[name][1]}
        checks[f"{name}_checks"] = all(r["page"]["check"]["pass"] for r in rs)  # logits, 20 greedy tokens vs torch
        checks[f"{name}_fetched_its_files_only"] = all(set(r["requests"]) == expected for r in rs)
        checks[f"{name}_isolated_offline"] = all(r["page"]["timer"]["crossOriginIsolated"] and not r["blocked"]
                                                 for r in rs)
    results["checks"] = checks
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({"load": results["load"], "checks": checks}, indent=1), f"\nwrote {args.out}")
    if not all(checks.values()):
        sys.exit(f"measure.py: a check failed (see 'checks' in {args.out})")


if __name__ == "__main__":
    main()
