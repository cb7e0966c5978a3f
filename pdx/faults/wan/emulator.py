"""The userspace delay line: packets of the router hop through a TUN device per direction.

Runs as root inside the router namespace (started by :mod:`pdx.faults.wan.supervisor`). The
router's policy routes send what arrives from the prefill site to ``wan-down`` and what arrives
from the decode site to ``wan-up``; this process reads each packet (a GSO aggregate of up to
64 KB, with TSO offload on the device), decides its fate per wire packet
(:mod:`pdx.faults.wan.model`), holds it until its release time, and writes it back into the
same device, from where the kernel forwards it on (through the rate-capping ``tbf``).

Two threads per direction: a reader blocked in ``read`` (which releases the interpreter lock)
and a writer that sleeps until the head packet is due (``Condition.wait`` has microsecond
resolution; ``epoll`` would round to milliseconds). A control thread answers JSON requests
on a Unix socket: ``status`` (conditions and counters), ``set`` (new conditions, applied to
the next packet; established connections carry on), ``stop``.

Hand-written because it is pdx's own: the kernel here has no ``sch_netem``, and no Python
package provides a TUN delay line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdx.faults.wan import packets
from pdx.faults.wan.conditions import DIRECTIONS, LinkConditions, WanConditions
from pdx.faults.wan.control import DEVICES, TABLES
from pdx.faults.wan.model import DirectionModel

log = logging.getLogger("pdx.wan")

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO_ECN = 0x01, 0x02, 0x08
READ_BYTES = 65536 + packets.VNET_LEN + 64
MAX_QUEUE_BYTES = 512 * 1024 * 1024  # held in the delay line per direction before drops
LATENESS_SAMPLES = 2048
COUNTERS = ("reads", "packets_in", "bytes_in", "packets_out", "bytes_out", "dropped_loss",
            "dropped_queue", "dropped_cut", "dropped_overflow", "duplicated", "reordered",
            "split_aggregates", "write_errors", "held_max_bytes")  # fmt: skip
MAX_LEAD_S = 0.0005  # the most a packet can leave before its release time


def open_tun(name: str) -> int:
    """A TUN device with a virtio-net header and TCP/IPv4 segmentation offload."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(
        fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
    )
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN)
    return fd


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def route_through(direction: str) -> None:
    """Bring the device up and make it the route of its direction's table."""
    dev, table = DEVICES[direction], str(TABLES[direction])
    _ip("link", "set", "dev", dev, "txqueuelen", "10000", "up")
    settings = (("ipv4", "rp_filter", "0"), ("ipv4", "accept_local", "1"),
                ("ipv6", "disable_ipv6", "1"))  # fmt: skip  # the sites speak IPv4 only
    for family, key, value in settings:
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/{family}/conf/{dev}/{key}").write_text(value)
    _ip("route", "replace", "default", "dev", dev, "metric", "1", "table", table)


class Lane:
    """One direction: its device, its model, its delay line and its counters."""

    def __init__(self, direction: str, fd: int, cond: LinkConditions, rng: random.Random) -> None:
        self.direction = direction
        self.fd = fd
        self.model = DirectionModel(cond, rng)
        self.rng = rng
        self.cut = False
        # Two release queues, each in due order: packets that wait out the delay, and the
        # ones reordering sends on as soon as they leave the bottleneck.
        self.delayed: collections.deque[tuple[float, bytes]] = collections.deque()
        self.early: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held_bytes = 0
        self.cv = threading.Condition()
        self.lateness: collections.deque[float] = collections.deque(maxlen=LATENESS_SAMPLES)
        self.c: collections.Counter[str] = collections.Counter({k: 0 for k in COUNTERS})

    def configure(self, cond: LinkConditions, cut: bool) -> None:
        """New conditions for the next packet; what is queued keeps its release time."""
        with self.cv:
            model = DirectionModel(cond, self.rng)
            model.carry_over(self.model)
            self.model = model
            self.cut = cut

    # --- reading --------------------------------------------------------------------

    def read_forever(self) -> None:
        """Read the device until the process ends."""
        while True:
            buf = os.read(self.fd, READ_BYTES)
            self.handle(buf, time.monotonic())

    def handle(self, buf: bytes, now: float) -> None:
        """Decide what happens to one read (every wire packet in it) and queue the result."""
        agg = packets.parse(buf)
        if agg is None:
            n, seg, last = 1, len(buf) - packets.VNET_LEN, len(buf) - packets.VNET_LEN
        else:
            n, head = agg.segments, agg.ihl + agg.thl
            seg, last = head + agg.mss, head + agg.payload - (agg.segments - 1) * agg.mss
        c = self.c
        c["reads"] += 1
        c["packets_in"] += n
        c["bytes_in"] += len(buf) - packets.VNET_LEN
        with self.cv:
            if self.cut:
                c["dropped_cut"] += n
                return
            model = self.model
            k, depart = model.bottleneck(now, n, seg, last)
            if k < n:
                c["dropped_queue"] += n - k
            if k == 0:
                return
            fate = model.fate(k)
            if fate.plain:
                whole = buf if k == n else packets.split(buf, [(0, k)])[0]
                self._hold(self.delayed, [whole], model.due(depart))
                return
            c["dropped_loss"] += len(fate.lost)
            c["duplicated"] += len(fate.duplicated)
            c["reordered"] += len(fate.early)
            if k == 1 and agg is None:
                if fate.lost:
                    return
                if fate.early:
                    self._hold(self.early, [buf], depart)
                    return
                self._hold(self.delayed, [buf, buf], model.due(depart))
                return
            c["split_aggregates"] += 1
            lost, dup, early_idx = set(fate.lost), set(fate.duplicated), set(fate.early)
            kept = [(a, b) for a, b in _runs(k, lost | dup | early_idx)
                    if not (b == a + 1 and a in lost)]  # fmt: skip
            early, later = [], []
            for (first, end), pkt in zip(kept, packets.split(buf, kept), strict=True):
                one = end == first + 1
                if one and first in early_idx:
                    early.append(pkt)
                    continue
                later.append(pkt)
                if one and first in dup:
                    later.append(pkt)
            if early:
                self._hold(self.early, early, depart)
            if later:
                self._hold(self.delayed, later, model.due(depart))

    def _hold(self, queue: collections.deque[tuple[float, bytes]], pkts: list[bytes],
              due: float) -> None:  # fmt: skip
        """(under ``cv``) Queue packets for release at ``due``."""
        size = sum(len(p) for p in pkts)
        if self.held_bytes + size > MAX_QUEUE_BYTES:
            self.c["dropped_overflow"] += sum(packets.wire_packets(p) for p in pkts)
            return
        wake = not (self.delayed or self.early) or (queue is self.early and not self.early)
        for p in pkts:
            queue.append((due, p))
        self.held_bytes += size
        self.c["held_max_bytes"] = max(self.c["held_max_bytes"], self.held_bytes)
        if wake:
            self.cv.notify()

    def _write(self, pkt: bytes) -> None:
        try:
            os.write(self.fd, pkt)
        except OSError as exc:  # the kernel refused a packet (e.g. a malformed split): count it
            self.c["write_errors"] += 1
            log.warning("%s: write failed: %s", self.direction, exc)
            return
        self.c["packets_out"] += packets.wire_packets(pkt)
        self.c["bytes_out"] += len(pkt) - packets.VNET_LEN

    # --- releasing ------------------------------------------------------------------

    def _next(self) -> collections.deque[tuple[float, bytes]] | None:
        if self.early and (not self.delayed or self.early[0][0] <= self.delayed[0][0]):
            return self.early
        return self.delayed if self.delayed else None

    def release_forever(self) -> None:
        """Write each held packet back into the device at its release time.

        A sleeping thread wakes some 0.05-0.2 ms after it asked to (more on a busy host).
        The writer asks to be woken earlier by the smallest lag it saw lately, so packets
        leave late by the lag's spread rather than by all of it, and almost never early.
        """
        lead = 0.0
        lags: collections.deque[float] = collections.deque(maxlen=32)
        while True:
            with self.cv:
                queue = self._next()
                if queue is None:
                    self.cv.wait()
                    continue
                due, pkt = queue[0]
                now = time.monotonic()
                if due - now > lead:
                    wake_at = due - lead
                    if not self.cv.wait(wake_at - now):  # timed out: how late did we wake?
                        lags.append(max(0.0, time.monotonic() - wake_at))
                        lead = min(MAX_LEAD_S, min(lags))
                    continue
                queue.popleft()
                self.held_bytes -= len(pkt)
            self.lateness.append(time.monotonic() - due)
            self._write(pkt)

    def status(self) -> dict[str, Any]:
        """Counters, queue depths and how late packets left (ms)."""
        now = time.monotonic()
        with self.cv:
            held = len(self.delayed) + len(self.early)
            held_bytes = self.held_bytes
            backlog_ms = self.model.backlog_s(now) * 1e3
        late = sorted(self.lateness)
        p99 = late[min(len(late) - 1, int(len(late) * 0.99))] if late else None
        out: dict[str, Any] = {k: int(v) for k, v in self.c.items()}
        out["delayed"] = out.get("packets_out", 0)
        out["held_packets"] = held
        out["held_bytes"] = held_bytes
        out["queue_ms"] = round(backlog_ms, 3)
        out["release_lateness_ms"] = {
            "samples": len(late),
            "p50": round(late[len(late) // 2] * 1e3, 3) if late else None,
            "p99": round(p99 * 1e3, 3) if p99 is not None else None,
        }
        return out


def _runs(n: int, single: set[int]) -> list[tuple[int, int]]:
    """``range(n)`` as runs: every index in ``single`` alone, the rest in contiguous ranges."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in sorted(single):
        if i > start:
            out.append((start, i))
        out.append((i, i + 1))
        start = i + 1
    if start < n:
        out.append((start, n))
    return out


class Emulator:
    """Both lanes and the control socket."""

    def __init__(self, state_dir: Path, cond: WanConditions) -> None:
        self.state_dir = state_dir
        self.cond = cond
        self.started = time.time()
        rng = random.Random(cond.seed)
        self.lanes: dict[str, Lane] = {}
        for d in DIRECTIONS:
            fd = open_tun(DEVICES[d])
            lane = Lane(d, fd, getattr(cond, d), random.Random(rng.random()))
            lane.cut = cond.cut
            self.lanes[d] = lane
        for d in DIRECTIONS:
            route_through(d)
        self._stop = threading.Event()

    def run(self) -> None:
        for lane in self.lanes.values():
            for target in (lane.read_forever, lane.release_forever):
                threading.Thread(target=target, name=f"wan-{lane.direction}", daemon=True).start()
        sock_path = self.state_dir / "emulator.sock"
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(sock_path))
        os.chmod(sock_path, 0o600)
        server.listen(8)
        server.settimeout(0.5)
        log.info("emulator ready: %s", self.cond.summary())
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                self._answer(conn)
        server.close()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        try:
            line = conn.makefile("r").readline()
            request = json.loads(line)
            reply = self.request(request)
        except Exception as exc:  # a bad request gets an error answer; the emulator goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps(reply) + "\n").encode())

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one control request."""
        op = request.get("op")
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "set":
            cond = WanConditions.model_validate(request["conditions"])
            for d in DIRECTIONS:
                self.lanes[d].configure(getattr(cond, d), cond.cut)
            self.cond = cond
            _write_json(self.state_dir / "conditions.json", cond.model_dump(mode="json"))
            log.info("conditions now: %s", cond.summary())
            return {"ok": True, **self.status()}
        if op == "stop":
            self._stop.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def status(self) -> dict[str, Any]:
        """Conditions in force and per-direction counters."""
        return {
            "pid": os.getpid(),
            "started_at": self.started,
            "conditions": self.cond.model_dump(mode="json"),
            "counters": {d: lane.status() for d, lane in self.lanes.items()},
        }


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    """``python -m pdx.faults.wan.emulator --state-dir DIR`` (root, in the router namespace)."""
    p = argparse.ArgumentParser(prog="python -m pdx.faults.wan.emulator")
    p.add_argument("--state-dir", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cond = WanConditions.model_validate_json((args.state_dir / "conditions.json").read_text())
    emu = Emulator(args.state_dir, cond)
    signal.signal(signal.SIGTERM, lambda *_: emu._stop.set())
    emu.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
