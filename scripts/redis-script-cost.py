#!/usr/bin/env python3
"""Redis-side cost of the Redis store's lease scripts per message, from
Redis's own accounting (INFO commandstats, microseconds of Redis CPU per
call): the one-record protocol of this checkout (v2) against the layout of
an earlier commit (v1, default 3bbb8b1, the last with the fence hash), and
raw pipelined SET NX PX. Unlike wall-clock rates on a shared machine, these
numbers barely drift between runs.

Usage: scripts/redis-script-cost.py [MESSAGES] [V1_COMMIT]
(needs the redis module: target/bench-venv/bin/python, which
scripts/bench.sh installs; a Redis on 127.0.0.1:6379 whose stats it resets)."""
import os, re, subprocess, sys, uuid, time
import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V1 = sys.argv[2] if len(sys.argv) > 2 else '3bbb8b1'

def show(path):
    return subprocess.run(['git', '-C', ROOT, 'show', f'{V1}:{path}'], check=True, capture_output=True, text=True).stdout

def consts(src):
    out = {}
    for m in re.finditer(r'const (\w+): &str = r#"(.*?)"#;', src, re.S):
        out[m.group(1)] = m.group(2)
    return out

def v2_scripts():
    s = open(os.path.join(ROOT, 'crates/idemq/src/store/redis/scripts.rs')).read()
    b = open(os.path.join(ROOT, 'crates/idemq/src/store/redis/batch.rs')).read()
    now = re.search(r'macro_rules! lua_now \{\s*\(\) => \{\s*"(.*?)"\s*\};', s, re.S).group(1).encode().decode('unicode_escape')
    rec = re.search(r'macro_rules! lua_record \{\s*\(\) => \{\s*r#"(.*?)"#', s, re.S).group(1)
    parts = {}
    for src in (s, b):
        for m in re.finditer(r'const (\w+): &str = concat!\((.*?)\);', src, re.S):
            body = m.group(2)
            text = ''
            for piece in re.finditer(r'lua_now!\(\)|lua_record!\(\)|r#"(.*?)"#|"((?:[^"\\]|\\.)*)"', body, re.S):
                if piece.group(0) == 'lua_now!()': text += now
                elif piece.group(0) == 'lua_record!()': text += rec
                elif piece.group(1) is not None: text += piece.group(1)
                else: text += piece.group(2).encode().decode('unicode_escape')
            parts[m.group(1)] = text
    return parts

r = redis.Redis()
def usec():
    return r.info('commandstats').get('cmdstat_evalsha', {}).get('usec', 0)

def run(label, claim_fn, complete_fn, n, chunk):
    keys = [f"cost:{{c/{uuid.uuid4().hex}}}" for _ in range(n)]
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    replies = []
    for i in range(0, n, chunk):
        for call in claim_fn(keys[i:i + chunk], i):
            pipe.evalsha(*call)
        replies += pipe.execute()
    c = usec()
    r.config_resetstat()
    for i in range(0, n, chunk):
        for call in complete_fn(keys[i:i + chunk], i):
            pipe.evalsha(*call)
        pipe.execute()
    d = usec()
    for i in range(0, n, 1000):
        r.unlink(*[k + s for k in keys[i:i+1000] for s in (':rec', ':fence', ':att')])
    r.unlink(*IDX)
    print(f"{label:40s} claim {c / n:6.2f} us/msg, complete {d / n:6.2f} us/msg, total {(c + d) / n:6.2f} us/msg")
    return (c + d) / n

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
v1 = {**consts(show('crates/idemq/src/store/redis/scripts.rs')), **consts(show('crates/idemq/src/store/redis/batch.rs'))}
v2 = v2_scripts()
sha = lambda text: r.script_load(text)
IDX = ['cost:{c:c}:done', 'cost:{c:c}:failing', 'cost:consumers']
lease, ret = 30000, 86400000
now = int(time.time() * 1000)
tok = lambda i: f"tok{i}"

s1c, s1d = sha(v1['CLAIM']), sha(v1['COMPLETE_INDEXED'])
p1 = run("v1 per message (claim, complete+indexes)",
    lambda ks, o: [(s1c, 2, k + ':rec', k + ':fence', tok(o + j), lease, now, ret + lease) for j, k in enumerate(ks)],
    lambda ks, o: [(s1d, 6, k + ':rec', k + ':fence', k + ':att', *IDX, tok(o + j), 'done:{"fp":"x","result":null,"first_seen":1,"done_ms":2}', ret, now, k, now - ret, 'c') for j, k in enumerate(ks)],
    N, 64)
s2c, s2d = sha(v2['CLAIM']), sha(v2['COMPLETE_INDEXED'])
p2 = run("v2 per message (claim, complete+indexes)",
    lambda ks, o: [(s2c, 1, k + ':rec', tok(o + j), lease, ret + lease) for j, k in enumerate(ks)],
    lambda ks, o: [(s2d, 5, k + ':rec', k + ':att', *IDX, tok(o + j), 'done:{"fp":"x","result":null,"first_seen":1,"done_ms":2}', ret, now, k, now - ret, 'c', '0') for j, k in enumerate(ks)],
    N, 64)
def usec_all():
    stats = r.info('commandstats')
    return sum(stats.get(c, {}).get('usec', 0) for c in ('cmdstat_evalsha', 'cmdstat_set'))

def run_plain(label, n):
    """The per-message path of this checkout: the plain SET NX GET claim of
    a key without a record, then the completion script."""
    keys = [f"cost:{{c/{uuid.uuid4().hex}}}" for _ in range(n)]
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i in range(0, n, 64):
        for j, k in enumerate(keys[i:i + 64]):
            pipe.execute_command('SET', k + ':rec', f"in-flight:{tok(i + j)}:{now}:~{lease}/{ret + lease}:{now}", 'NX', 'GET', 'PX', ret + lease)
        pipe.execute()
    c = usec_all()
    r.config_resetstat()
    for i in range(0, n, 64):
        for j, k in enumerate(keys[i:i + 64]):
            pipe.evalsha(s2d, 5, k + ':rec', k + ':att', *IDX, tok(i + j), 'done:{"fp":"x","result":null,"first_seen":1,"done_ms":2}', ret, now, k, now - ret, 'c', '0')
        replies = pipe.execute()
        assert all(x == 1 for x in replies), replies[:3]
    d = usec_all()
    for i in range(0, n, 1000):
        r.unlink(*[k + ':rec' for k in keys[i:i+1000]])
    r.unlink(*IDX)
    print(f"{label:40s} claim {c / n:6.2f} us/msg, complete {d / n:6.2f} us/msg, total {(c + d) / n:6.2f} us/msg")
    return (c + d) / n

p3 = run_plain("v2 per message, plain SET NX GET claim", N)
b1c, b1d = sha(v1['BATCH_CLAIM']), sha(v1['BATCH_COMPLETE'])
def v1_batch_complete(ks, o):
    keys = IDX + [k + s for k in ks for s in (':rec', ':fence', ':att')]
    args = [ret, now - ret, 'c', len(ks)] + [a for j, k in enumerate(ks) for a in (f"b{o}.{j + 1}", 'done:{"fp":"x"}', now, k)]
    return [(b1d, len(keys), *keys, *args)]
q1 = run("v1 batches of 64",
    lambda ks, o: [(b1c, 2 * len(ks), *[k + s for k in ks for s in (':rec', ':fence')], f"b{o}.", lease, now, ret + lease)],
    v1_batch_complete, N, 64)
b2c, b2d = sha(v2['BATCH_CLAIM']), sha(v2['BATCH_COMPLETE'])
def v2_batch_complete(ks, o):
    keys = IDX + [k + s for k in ks for s in (':rec', ':att')]
    args = [ret, now - ret, 'c', len(ks), '0', ret + lease] + [a for j, k in enumerate(ks) for a in (f"b{o}.{j + 1}", 'done:{"fp":"x"}', now, k)]
    return [(b2d, len(keys), *keys, *args)]
q2 = run("v2 batches of 64",
    lambda ks, o: [(b2c, len(ks), *[k + ':rec' for k in ks], f"b{o}.", lease, ret + lease)],
    v2_batch_complete, N, 64)
r.config_resetstat()
pipe = r.pipeline(transaction=False)
keys = [f"cost:{{c/{uuid.uuid4().hex}}}:rec" for _ in range(N)]
for i in range(0, N, 64):
    for k in keys[i:i+64]:
        pipe.set(k, 'in-flight:' + uuid.uuid4().hex, nx=True, px=600000)
    pipe.execute()
raw = r.info('commandstats')['cmdstat_set']['usec'] / N
for i in range(0, N, 1000):
    r.unlink(*keys[i:i+1000])
print(f"{'raw SET NX PX':40s} {raw:6.2f} us/msg")
print(f"v2/v1 per message {p2 / p1:.2f}x (plain claim {p3 / p1:.2f}x), batches {q2 / q1:.2f}x; raw SET NX / v2: per message {raw / p3:.2f}, batches {raw / q2:.2f}")
