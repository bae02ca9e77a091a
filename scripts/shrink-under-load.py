#!/usr/bin/env python3
# One SmolLM2 server following its machine while the machine shrinks (issue 57, item 5;
# docs/cluster.md, "The machine shrinks under them"):
#   scripts/shrink-under-load.py BINARY MODEL [--limit-mib 300] [--at-s 20] [--no-limit]
# Makes a memory cgroup under this process's own (v1 or v2), starts the server in it
# (`--listen --concurrency 8 --context 1024 --kv-dtype f16 --follow-machine`), and drives 16
# conversations of 6 turns, 8 at once (a ~450-token system prompt, 48-token greedy answers).
# `--at-s` seconds in, the group's soft limit (v1 `memory.soft_limit_in_bytes`, v2
# `memory.high`) falls to `--limit-mib`. Samples the group's working set (usage less inactive
# file pages) every 100 ms; prints one JSON line: requests answered and failed, the wall
# time, how long after the limit the working set first came under limit + 30 MiB and stayed
# there, the most after that, OOM kills, the server's exit status, preemptions and the prompt
# tokens it computed (prompt tokens less those its answers say were cached).
import argparse, http.client, json, os, re, signal, subprocess, sys, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("binary"); ap.add_argument("model")
ap.add_argument("--limit-mib", type=int, default=300)
ap.add_argument("--at-s", type=float, default=20.0)
ap.add_argument("--no-limit", action="store_true")
ap.add_argument("--conversations", type=int, default=16)
ap.add_argument("--turns", type=int, default=6)
args = ap.parse_args()
MIB = 1 << 20

def own_group():
    for line in open("/proc/self/cgroup"):
        n, ctrl, path = line.rstrip("\n").split(":", 2)
        if "memory" in ctrl.split(","):
            return "/sys/fs/cgroup/memory" + path, 1
    for line in open("/proc/self/cgroup"):
        n, ctrl, path = line.rstrip("\n").split(":", 2)
        if n == "0":
            return "/sys/fs/cgroup" + path, 2
    sys.exit("no memory cgroup")

parent, version = own_group()
group = os.path.join(parent, f"procmem-shrink-{os.getpid()}")
os.mkdir(group)
def gfile(v1, v2):
    return os.path.join(group, v1 if version == 1 else v2)
def read(v1, v2):
    with open(gfile(v1, v2)) as f:
        return f.read()
def working_set():
    usage = int(read("memory.usage_in_bytes", "memory.current"))
    stat = read("memory.stat", "memory.stat")
    key = "total_inactive_file" if version == 1 else "inactive_file"
    m = re.search(r"^" + key + r" (\d+)$", stat, re.M)
    return usage - (int(m.group(1)) if m else 0)
def oom_kills():
    text = read("memory.oom_control", "memory.events")
    m = re.search(r"^oom_kill (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0

cmd = [args.binary, "--model", args.model, "--listen", "127.0.0.1:0", "--concurrency", "8",
       "--context", "1024", "--kv-dtype", "f16", "--follow-machine"]
# The server is moved into the group before it execs (so its first page is counted there).
procs = gfile("cgroup.procs", "cgroup.procs")
p = subprocess.Popen(["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"] + cmd,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
addr = None
for line in p.stdout:
    m = re.match(r"listening on http://(\S+)", line)
    if m:
        addr = m.group(1); break
if addr is None:
    sys.exit("the server never listened: " + p.stderr.read()[-2000:])
log = []
threading.Thread(target=lambda: [log.append(l) for l in p.stdout], daemon=True).start()
errlog = []
threading.Thread(target=lambda: [errlog.append(l) for l in p.stderr], daemon=True).start()
host, port = addr.rsplit(":", 1)

def metric(name):
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=5)
        c.request("GET", "/metrics"); t = c.getresponse().read().decode()
        return sum(float(v) for v in re.findall(r"^" + name + r"(?:\{[^}]*\})? (\S+)$", t, re.M))
    except Exception:
        return None

samples, stop = [], False
t0 = time.time()
limited_at = None
def sampler():
    global limited_at
    while not stop:
        now = time.time() - t0
        if not args.no_limit and limited_at is None and now >= args.at_s:
            with open(gfile("memory.soft_limit_in_bytes", "memory.high"), "w") as f:
                f.write(str(args.limit_mib * MIB))
            limited_at = now
        try:
            samples.append((now, working_set()))
        except OSError:
            pass
        time.sleep(0.1)
th = threading.Thread(target=sampler); th.start()

system = ("You are a careful assistant of a lending library. Answer briefly and plainly. "
          "Reference notes: " + " ".join(f"shelf {i} holds books on topic {i * 13 % 97}." for i in range(30)))
answered, failed, first_error, computed = 0, 0, None, 0
lock = threading.Lock()
def conv(i):
    global answered, failed, first_error, computed
    msgs = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        msgs.append({"role": "user", "content": f"Conversation {i}, turn {turn}: tell me about the number {i * 7 + turn}."})
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=600)
            body = json.dumps({"model": "m", "max_tokens": 48, "temperature": 0, "messages": msgs})
            c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse(); data = r.read()
            if r.status != 200:
                raise RuntimeError(f"{r.status} {data[:200]!r}")
            reply = json.loads(data)
            text = reply["choices"][0]["message"]["content"]
            usage = reply.get("usage", {})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            msgs.append({"role": "assistant", "content": text})
            with lock:
                answered += 1
                computed += usage.get("prompt_tokens", 0) - cached
        except Exception as e:
            with lock:
                failed += 1
                first_error = first_error or str(e)
            return
queue = list(range(args.conversations))
def worker():
    while True:
        with lock:
            if not queue: return
            i = queue.pop(0)
        conv(i)
ws = [threading.Thread(target=worker) for _ in range(8)]
[w.start() for w in ws]; [w.join() for w in ws]
wall = time.time() - t0
preemptions = metric("procmem_kv_preemptions_total")
stop = True; th.join()
p.send_signal(signal.SIGTERM)
try:
    status = p.wait(timeout=60)
except subprocess.TimeoutExpired:
    p.kill(); status = "killed after 60 s"
kills = oom_kills()
bound = (args.limit_mib + 30) * MIB
under_after, most_after = None, None
if limited_at is not None:
    after = [(t, w) for t, w in samples if t >= limited_at]
    for k, (t, w) in enumerate(after):
        if all(x <= bound for _, x in after[k:]):
            under_after = round(t - limited_at, 1); break
    most_after_25 = [w for t, w in after if t >= limited_at + 25]
    most_after = max(most_after_25) if most_after_25 else None
try:
    os.rmdir(group)
except OSError:
    pass
print(json.dumps({
    "limit_mib": None if args.no_limit else args.limit_mib,
    "limit_at_s": limited_at and round(limited_at, 1),
    "answered": answered, "failed": failed, "first_error": first_error,
    "wall_s": round(wall, 1),
    "working_set_peak_mib": round(max(w for _, w in samples) / MIB, 1),
    "working_set_under_limit_plus_30_after_s": under_after,
    "working_set_most_25s_after_limit_mib": most_after and round(most_after / MIB, 1),
    "oom_kills": kills, "exit_status": status,
    "preemptions": preemptions, "prompt_tokens_computed": computed,
}))
