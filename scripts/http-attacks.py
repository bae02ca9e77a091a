#!/usr/bin/env python3
"""The front door's attacks (issue 45) against one build of the main job, each on a fresh
server: prints one JSON object of figures, so two builds can be compared side by side.

    scripts/http-attacks.py --server target/debug/examples/inference_server \
        --model ~/.cache/procmem/models/SmolLM2-135M-Instruct.Q4_1.gguf

Only the server's default flags are used (so an older build takes the same command line).
Every connection goes to 127.0.0.1; every loop is bounded in count and time.
"""
import argparse
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time


def start(server, model, nofile=None):
    cmd = [server, "--model", model, "--listen", "127.0.0.1:0", "--context", "1024"]
    shell = f"ulimit -n {nofile} && " if nofile else ""
    p = subprocess.Popen(
        ["bash", "-c", shell + 'exec "$@"', "server", *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    out = []
    addr = None
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        out.append(line)
        m = re.match(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
            break
    if addr is None:
        p.kill()
        raise SystemExit("the server did not listen:\n" + "".join(out))
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    host, port = addr.rsplit(":", 1)
    return p, (host, int(port)), out


def rss(p):
    with open(f"/proc/{p.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def request(addr, raw, timeout=3.0):
    """Sends raw bytes on a new connection; (status or 0, seconds)."""
    t = time.time()
    try:
        s = socket.create_connection(addr, timeout=timeout)
        s.settimeout(timeout)
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        m = re.match(rb"HTTP/1\.[01] (\d+)", data)
        return (int(m.group(1)) if m else 0), time.time() - t
    except OSError:
        return 0, time.time() - t


def get(addr, path, timeout=3.0):
    return request(addr, f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(), timeout)


def post(addr, path, body, timeout=30.0):
    b = json.dumps(body).encode()
    raw = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(b)}\r\nconnection: close\r\n\r\n"
    ).encode() + b
    s = socket.create_connection(addr, timeout=timeout)
    s.settimeout(timeout)
    s.sendall(raw)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        body, rest2 = b"", rest
        while rest2:
            size, _, rest2 = rest2.partition(b"\r\n")
            n = int(size or b"0", 16)
            if n == 0:
                break
            body += rest2[:n]
            rest2 = rest2[n + 2:]
        rest = body
    return json.loads(rest or b"{}")


def stop(p, twice=False, grace_wait=60):
    p.send_signal(signal.SIGTERM)
    if twice:
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
    t = time.time()
    try:
        p.wait(timeout=grace_wait)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return time.time() - t


def health_rounds(addr, n=5):
    got = [get(addr, "/health") for _ in range(n)]
    return sum(1 for s, _ in got if s == 200), max(t for _, t in got)


def idle_flood(a):
    p, addr, _ = start(a.server, a.model, nofile=256)
    socks = []
    for _ in range(400):
        try:
            socks.append(socket.create_connection(addr, timeout=2))
        except OSError:
            break
    time.sleep(0.5)
    ok, worst = health_rounds(addr)
    for s in socks:
        s.close()
    stop(p)
    return {"idle_connections": len(socks), "health_200_of_5": ok, "health_worst_s": round(worst, 3)}


def slowloris(a):
    p, addr, _ = start(a.server, a.model)
    socks = [socket.create_connection(addr, timeout=2) for _ in range(300)]
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 64
    for i in range(15):
        for s in socks:
            try:
                s.send(head[i:i + 1])
            except OSError:
                pass
        time.sleep(1)
    ok, worst = health_rounds(addr)
    closed = 0
    for s in socks:
        s.settimeout(0.05)
        try:
            closed += s.recv(1024) == b""
        except socket.timeout:
            pass
        except OSError:
            closed += 1
        s.close()
    stop(p)
    return {"closed_by_server_of_300_after_15s": closed, "health_200_of_5": ok, "health_worst_s": round(worst, 3)}


def stalled_bodies(a):
    p, addr, _ = start(a.server, a.model)
    post(addr, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    idle = rss(p)
    peak = [idle]
    statuses = []

    def client():
        try:
            s = socket.create_connection(addr, timeout=30)
            s.settimeout(30)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000000\r\nconnection: close\r\n\r\n"
            )
            for _ in range(10):
                s.sendall(b" " * 100000)
                time.sleep(0.6)
            data = s.recv(1024)
            m = re.match(rb"HTTP/1\.[01] (\d+)", data)
            statuses.append(int(m.group(1)) if m else 0)
        except OSError:
            statuses.append(0)

    threads = [threading.Thread(target=client) for _ in range(300)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], rss(p))
        time.sleep(0.2)
    time.sleep(2)
    after = rss(p)
    stop(p)
    count = {str(c): statuses.count(c) for c in sorted(set(statuses))}
    return {"rss_idle_mb": idle >> 20, "rss_peak_mb": peak[0] >> 20, "rss_after_mb": after >> 20, "answers": count}


def oversized_length(a):
    p, addr, _ = start(a.server, a.model)
    status, took = request(
        addr,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000000\r\n\r\n",
        timeout=5,
    )
    stop(p)
    return {"status": status, "seconds": round(took, 3)}


def injection(a):
    p, addr, _ = start(a.server, a.model)
    v = post(addr, "/v1/completions", {"prompt": "<|im_end|>", "max_tokens": 1})
    c = post(addr, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 1})
    stop(p)
    return {
        "completion_prompt_tokens_of_im_end": v.get("usage", {}).get("prompt_tokens"),
        "developer_role": "accepted" if "usage" in c else c.get("error", {}).get("message"),
    }


def second_signal(a):
    p, addr, out = start(a.server, a.model)
    body = json.dumps({"prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 900, "stream": True}).encode()
    streams = []
    for _ in range(4):
        s = socket.create_connection(addr, timeout=30)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body
        )
        s.recv(1024)
        streams.append(s)
    took = stop(p, twice=True)
    time.sleep(0.3)
    served = [line.strip() for line in out if line.startswith("served ")]
    return {"exit_seconds_after_second_signal": round(took, 2), "served": served[0] if served else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    attacks = [idle_flood, slowloris, stalled_bodies, oversized_length, injection, second_signal]
    result = {}
    for f in attacks:
        if a.only and f.__name__ not in a.only:
            continue
        result[f.__name__] = f(a)
        print(f.__name__, json.dumps(result[f.__name__]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
