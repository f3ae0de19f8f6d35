#!/usr/bin/env python3
"""`idemq proxy`'s added latency, measured beside the direct call in the
same run: a small HTTP/1.1 upstream (Python's ThreadingHTTPServer, keep-alive,
TCP_NODELAY) answers GET and POST; one keep-alive client sends N (default
300, env N) sequential requests straight to it and N through the proxy
(GET: streamed through; POST: covered, a new Idempotency-Key each, so each
is a claim and a commit in the store). Prints the medians and the
difference.

    cargo build --release -p idemq-cli
    IDEMQ=target/release/idemq N=1000 scripts/proxy-latency.py sqlite:///tmp/p.db
    IDEMQ=target/release/idemq N=1000 scripts/proxy-latency.py redis://127.0.0.1:6379
"""
import http.client, http.server, threading, time, statistics, subprocess, sys, uuid, socket, os
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def _ok(self):
        n = int(self.headers.get("content-length", "0") or 0)
        if n: self.rfile.read(n)
        body = b'{"ok":true}'
        self.send_response(201 if self.command == "POST" else 200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    do_GET = _ok; do_POST = _ok
    def log_message(self, *a): pass
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
up = free()
srv = http.server.ThreadingHTTPServer(("127.0.0.1", up), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
store = sys.argv[1]
px = free()
proc = subprocess.Popen([os.environ.get("IDEMQ", "target/release/idemq"), "--store", store, "proxy", "--listen", f"127.0.0.1:{px}", "--upstream", f"http://127.0.0.1:{up}"], stderr=subprocess.DEVNULL)
for _ in range(100):
    try: socket.create_connection(("127.0.0.1", px), 0.2).close(); break
    except OSError: time.sleep(0.1)
def run(port, method, n, keyed):
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.connect(); c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lat = []
    for i in range(n):
        h = {"content-type": "application/json"}
        if keyed: h["idempotency-key"] = '"%s"' % uuid.uuid4()
        t = time.perf_counter()
        c.request(method, "/x", body=b'{"a":1}' if method == "POST" else None, headers=h)
        r = c.getresponse(); r.read()
        lat.append((time.perf_counter() - t) * 1000)
    return statistics.median(lat)
n = int(os.environ.get("N", "300"))
run(up, "GET", 200, False); run(px, "GET", 200, False); run(px, "POST", 200, True)
d_get, p_get = run(up, "GET", n, False), run(px, "GET", n, False)
d_post, p_post = run(up, "POST", n, False), run(px, "POST", n, True)
print(f"store {store.split('@')[-1]}: GET pass-through median direct {d_get:.3f} ms, via proxy {p_get:.3f} ms (+{p_get-d_get:.3f}); POST covered (new key each) direct {d_post:.3f} ms, via proxy {p_post:.3f} ms (+{p_post-d_post:.3f})")
proc.terminate(); proc.wait()
