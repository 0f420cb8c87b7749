#!/usr/bin/env python3
"""One TCP stream, as fast as it goes, for `ciera sim --validate`'s cost of moving a byte:
   tcp_probe.py serve HOST PORT          # receive until the sender closes; print bytes/s
   tcp_probe.py send HOST PORT SECONDS   # send 4 MiB writes for SECONDS
The receiver prints {"tcp_bps": ...}: the CPU cost of a byte on either side is about 1/tcp_bps
when, as here, the stream is bound by the cores and not by a link."""
import json
import socket
import sys
import time

BUF = 4 << 20


def serve(host, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1)
    c, _ = s.accept()
    buf = bytearray(BUF)
    view = memoryview(buf)
    total, t0 = 0, None
    while True:
        n = c.recv_into(view)
        if n == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        total += n
    dt = time.perf_counter() - t0
    print(json.dumps({"tcp_bps": total / dt, "bytes": total, "seconds": dt}))


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
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
