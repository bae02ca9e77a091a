#!/usr/bin/env python3
# What a SmolLM2 server holds under load, inside and outside its books (docs/metrics.md, "What
# the process holds outside its books"):
#   scripts/rss-under-load.py target/debug/examples/inference_server "$(scripts/fetch-model.sh)"
# Starts the server on a port of its own, drives 8 chat conversations at once (two turns each,
# a ~450-token system prompt, 48-token greedy answers), samples /proc/<pid>/status and /metrics
# every 100 ms, stops it with SIGINT and prints one JSON line: the figures at rest, the peak of
# each, and the three samples with the most outside the books. `outside_computed` (the process's
# anonymous and file pages less the weights' eager allocations) also works on a binary that
# exports no `procmem_process_outside_books_bytes`.
import json, os, re, subprocess, sys, threading, time, http.client
binary = sys.argv[1]
model = sys.argv[2]
p = subprocess.Popen([binary, "--model", model, "--listen", "127.0.0.1:0", "--concurrency", "8",
                      "--context", "1024", "--kv-dtype", "f16", "--budget", "300MiB"],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = None
for line in p.stdout:
    m = re.match(r"listening on http://(\S+)", line)
    if m:
        addr = m.group(1); break
threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
host, port = addr.rsplit(":", 1)
def status():
    d = {}
    for l in open(f"/proc/{p.pid}/status"):
        k, _, v = l.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            d[k] = int(v.split()[0]) * 1024
    return d
def scrape():
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=5)
        c.request("GET", "/metrics"); t = c.getresponse().read().decode()
        out = {}
        for name in ("procmem_process_outside_books_bytes", "procmem_process_resident_bytes", "procmem_kv_leased_bytes", "procmem_kv_swapped_bytes", "procmem_residency_offloads_total", "procmem_kv_prefix_host_bytes", "procmem_governor_committed_bytes", "procmem_authority_os_resident_bytes", "procmem_kv_os_resident_bytes"):
            m = re.search(r"^" + name + r"(?:\{[^}]*\})? (\S+)$", t, re.M)
            if m: out[name] = float(m.group(1))
        return out
    except Exception:
        return {}
peak = {}
series = []
stop = False
def sampler():
    while not stop:
        s = status(); s.update(scrape())
        if "procmem_authority_os_resident_bytes" in s and "procmem_kv_os_resident_bytes" in s:
            eager = s["procmem_authority_os_resident_bytes"] - s["procmem_kv_os_resident_bytes"]
            s["outside_computed"] = s["RssAnon"] + s["RssFile"] - eager
        for k, v in s.items():
            peak[k] = max(peak.get(k, 0), v)
        series.append(s)
        time.sleep(0.1)
idle = status(); idle.update(scrape())
th = threading.Thread(target=sampler); th.start()
system = "You are a careful assistant. " * 40
def conv(i):
    for turn in range(2):
        c = http.client.HTTPConnection(host, int(port), timeout=300)
        body = json.dumps({"model": "m", "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {i} turn {turn}: tell me about the number {i*7+turn}."}]})
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse(); r.read(); assert r.status == 200, r.status
t0 = time.time()
ts = [threading.Thread(target=conv, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
wall = time.time() - t0
stop = True; th.join()
p.send_signal(2); p.wait(timeout=60)
top = sorted(series, key=lambda s: -s.get("procmem_process_outside_books_bytes", 0))[:3]
print(json.dumps({"idle": idle, "peak": peak, "wall_s": round(wall, 1), "top": top}))
