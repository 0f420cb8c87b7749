#!/usr/bin/env python3
"""One TCP stream for `ciera sim --validate`'s cost of moving a byte:
   tcp_probe.py serve HOST PORT          # receive until the sender closes; print bytes/s
   tcp_probe.py send HOST PORT SECONDS   # send 4 MiB writes for SECONDS
   tcp_probe.py idle SECONDS             # the host's busy CPU seconds per second at rest
The receiver prints {"tcp_bps": ..., "bytes": ..., "seconds": ..., "busy_s": ...}. Unshaped, the
stream is bound by the cores, so a byte costs a side about 1/tcp_bps. On a shaped link the
stream is bound by the link, and what a byte costs the host is busy_s (every core's busy time
while it ran, from /proc/stat: both sides, the kernel's shaping and forwarding included) over
the bytes, less the host's busy time at rest."""
import json
import os
import socket
import sys
import time

BUF = 4 << 20
TICK = os.sysconf("SC_CLK_TCK")


def busy_s():
    """Busy CPU seconds of every core so far: user, nice, system, irq and softirq."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / TICK


def serve(host, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1)
    c, _ = s.accept()
    buf = bytearray(BUF)
    view = memoryview(buf)
    total, t0, b0 = 0, None, 0.0
    while True:
        n = c.recv_into(view)
        if n == 0:
            break
        if t0 is None:
            t0, b0 = time.perf_counter(), busy_s()
        total += n
    dt = time.perf_counter() - t0
    busy = busy_s() - b0
    print(json.dumps({"tcp_bps": total / dt, "bytes": total, "seconds": dt, "busy_s": busy}))


def idle(seconds):
    b0, t0 = busy_s(), time.perf_counter()
    time.sleep(seconds)
    print(json.dumps({"busy_per_s": (busy_s() - b0) / (time.perf_counter() - t0)}))


def send(host, port, seconds):
    for _ in range(100):
        try:
            c = socket.create_connection((host, port))
            break
        except OSError:
            time.sleep(0.05)
    data = memoryview(bytes(BUF))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c.sendall(data)
    c.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "idle":
        idle(float(sys.argv[2]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
