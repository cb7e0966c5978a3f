"""What crosses a link in the clear: a bounded packet capture that looks for known byte patterns.

Run inside the namespace whose interface carries the link (``ip netns exec ROUTER python -m
pdx.faults.wire --iface eth-prefill --pattern HEX ...``, root): an ``AF_PACKET`` socket takes
every frame the interface sends or receives, and each TCP or UDP payload is searched for every
pattern. It prints ``ready`` once the socket is bound, captures until its stdin closes, its time
or its byte or packet budget runs out, and prints one JSON line: frames seen, payload-carrying
packets (``captures``), payload bytes, and how many captures held a pattern. Only counts leave
the program: no payload is kept or written.

Hand-written because it is only a count over raw frames: a capture library (tcpdump, scapy)
would add a dependency to find a byte string. IPv4 and IPv6 (no extension headers) over
Ethernet; a pattern split across two segments is not seen, so callers repeat their pattern.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time
from typing import Any

ETH_P_ALL = 0x0003
FRAME_MAX = 65_536 + 64  # a GSO super-frame on a veth is at most 64 KiB of IP


def payload(frame: bytes) -> bytes:
    """The TCP or UDP payload of an Ethernet frame (b"" for anything else)."""
    if len(frame) < 14:
        return b""
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    if ethertype == 0x0800 and len(frame) >= 34:
        ihl = (frame[14] & 0x0F) * 4
        proto, start = frame[23], 14 + ihl
        total = struct.unpack_from("!H", frame, 16)[0]
        end = min(len(frame), 14 + total) if total else len(frame)
    elif ethertype == 0x86DD and len(frame) >= 54:
        proto, start = frame[20], 54
        end = min(len(frame), 54 + struct.unpack_from("!H", frame, 18)[0])
    else:
        return b""
    if proto == 6 and len(frame) >= start + 20:
        return frame[start + (frame[start + 12] >> 4) * 4 : end]
    if proto == 17 and len(frame) >= start + 8:
        return frame[start + 8 : end]
    return b""


def capture(
    iface: str, patterns: list[bytes], seconds: float, max_bytes: int, max_packets: int
) -> dict[str, Any]:
    """Count what ``iface`` carries until stdin closes or a budget runs out."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.setblocking(False)
    print("ready", flush=True)
    frames = captures = payload_bytes = hits = 0
    by_pattern = [0] * len(patterns)
    stopped_by = "time"
    start = time.monotonic()
    deadline = start + seconds
    watch = [sock, sys.stdin]
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watch, [], [], min(left, 0.5))
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                stopped_by = "stdin"
                break
            if sock not in ready:
                continue
            while True:
                try:
                    frame = sock.recv(FRAME_MAX)
                except BlockingIOError:
                    break
                frames += 1
                data = payload(frame)
                if not data:
                    continue
                captures += 1
                payload_bytes += len(data)
                found = [i for i, p in enumerate(patterns) if p in data]
                for i in found:
                    by_pattern[i] += 1
                hits += 1 if found else 0
            if payload_bytes >= max_bytes or captures >= max_packets:
                stopped_by = "budget"
                break
    finally:
        sock.close()
    return {"iface": iface, "frames": frames, "captures": captures,
            "payload_bytes": payload_bytes, "hits": hits, "hits_by_pattern": by_pattern,
            "stopped_by": stopped_by, "seconds": round(time.monotonic() - start, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m pdx.faults.wire``: see the module's docstring."""
    ap = argparse.ArgumentParser(prog="python -m pdx.faults.wire")
    ap.add_argument("--iface", required=True)
    ap.add_argument("--pattern", action="append", default=[], help="hex bytes to look for")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-bytes", type=int, default=256 * 2**20)
    ap.add_argument("--max-packets", type=int, default=200_000)
    args = ap.parse_args(argv)
    try:
        patterns = [bytes.fromhex(p) for p in args.pattern]
    except ValueError as exc:
        ap.error(f"--pattern: expected hex bytes ({exc})")
    if not patterns or any(len(p) < 8 for p in patterns):
        ap.error("--pattern: give at least one, each of 8 bytes or more")
    try:
        out = capture(args.iface, patterns, args.seconds, args.max_bytes, args.max_packets)
    except OSError as exc:  # no such interface, no CAP_NET_RAW
        print(json.dumps({"error": f"capture on {args.iface}: {exc}"}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
