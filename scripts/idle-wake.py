#!/usr/bin/env python3
"""An idle server's wake against a cold start (issue 46), on the real model.

Starts the main job `--model smollm2 --listen 127.0.0.1:0 --idle-after 1` (the binary given,
default the release example), times a cold start to its first streamed token, a warm request,
then sleeps past the idle time and times the first request after it (the wake) and one more;
reads from `/metrics` the layers on disk and the approved bytes before and after sleeping.
`--runs N` fresh processes (3).

    cargo build --release --example inference_server
    python3 scripts/idle-wake.py
"""
import argparse
import http.client
import json
import re
import subprocess
import time

MSG = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
       "max_tokens": 8, "temperature": 0, "stream": True}


def first_token(port):
    start = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(MSG), {"content-type": "application/json"})
    r = c.getresponse()
    while True:
        line = r.readline()
        if not line:
            raise SystemExit("the stream ended with no token")
        if line.startswith(b"data:") and b'"content"' in line and b'"content":""' not in line:
            took = time.time() - start
            r.read()
            return took


def metric(port, name, label=""):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    page = c.getresponse().read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in page.splitlines()
               if l.startswith(name) and l[len(name)] in " {" and label in l)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="target/release/examples/inference_server")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for run in range(args.runs):
        t0 = time.time()
        p = subprocess.Popen([args.server, "--model", "smollm2", "--listen", "127.0.0.1:0",
                              "--idle-after", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        port = None
        for line in p.stdout:
            m = re.search(r"listening on http://127.0.0.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            raise SystemExit("the server did not listen")
        first_token(port)
        cold = time.time() - t0
        warm = first_token(port)
        awake = metric(port, "procmem_governor_approved_bytes")
        time.sleep(3)
        on_disk = metric(port, "procmem_residency_layers", 'placement="disk"')
        asleep = metric(port, "procmem_governor_approved_bytes")
        wake = first_token(port)
        again = first_token(port)
        print(f"run {run}: cold start to first token {cold * 1e3:.0f} ms; warm {warm * 1e3:.0f} ms; "
              f"asleep {on_disk:.0f} layers on disk, approved {awake:.0f} -> {asleep:.0f} B "
              f"(freed {awake - asleep:.0f}); wake {wake * 1e3:.0f} ms; warm again {again * 1e3:.0f} ms; "
              f"wake / cold {wake / cold:.2f}", flush=True)
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
