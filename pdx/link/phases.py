"""The measurement phases of ``probe-link``: UDP latency, TCP goodput, path MTU."""

from __future__ import annotations

import contextlib
import errno
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdx.errors import MeasurementError
from pdx.link import protocol as proto
from pdx.link import stats
from pdx.link.client import ProbeSession
from pdx.link.sockets import (
    ANCILLARY_BYTES,
    enable_rx_timestamps,
    kernel_path_mtu,
    rx_timestamp_ns,
    set_dont_fragment,
)
from pdx.tcp import congestion_control, tcp_info
from pdx.units import bytes_per_s_to_gbps

_BLOCK_BYTES = 256 * 1024


# --------------------------------------------------------------------------------------
# Phase 1 / 3: isochronous UDP probes
# --------------------------------------------------------------------------------------
@dataclass
class ProbeRun:
    """Raw outcome of one probe stream: what was sent, what came back, what the server saw."""

    sent: int
    rtt_ns_by_seq: dict[int, int]
    arrival_order: list[int]
    duplicates: int
    reordered: int
    server_received: int
    server_duplicates: int

    @property
    def received(self) -> int:
        """Distinct probes that made the round trip."""
        return len(self.rtt_ns_by_seq)


@dataclass
class LatencyResult:
    """RTT distribution, jitter and per-direction loss of one probe stream."""

    rtt_ms: dict[str, float]
    jitter_ms: float
    ipdv_ms: dict[str, float]
    loss: dict[str, Any]


def _udp_socket(session: ProbeSession) -> socket.socket:
    infos = socket.getaddrinfo(session.host, session.udp_port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.connect(addr)
    enable_rx_timestamps(sock)
    return sock


def _send_isochronous(
    sock: socket.socket,
    session: ProbeSession,
    stream: int,
    count: int,
    interval_s: float,
    probe_bytes: int,
    stop: threading.Event,
    sent: list[int],
) -> None:
    key = session.udp_key
    start = time.perf_counter()
    for seq in range(count):
        # Sleep to the slot's absolute time, so a late send never shifts later ones.
        delay = start + seq * interval_s - time.perf_counter()
        if stop.wait(delay) if delay > 0 else stop.is_set():
            break
        probe = proto.Probe(proto.KIND_REQUEST, stream, session.session_id, seq, time.time_ns())
        with contextlib.suppress(OSError):  # e.g. ECONNREFUSED from an earlier ICMP error
            sock.send(proto.pack_probe(probe, key, probe_bytes))
        sent[0] = seq + 1


def run_probes(
    session: ProbeSession,
    *,
    stream: int,
    duration_s: float,
    interval_ms: float,
    probe_bytes: int = 64,
    stop: threading.Event | None = None,
    drain_s: float = 1.0,
) -> ProbeRun:
    """Send probes every ``interval_ms`` for ``duration_s`` (or until ``stop``) and collect them."""
    stop = stop or threading.Event()
    interval_s = interval_ms / 1000.0
    count = max(1, int(duration_s / interval_s))
    sock = _udp_socket(session)
    sent = [0]
    sender = threading.Thread(
        target=_send_isochronous,
        args=(sock, session, stream, count, interval_s, probe_bytes, stop, sent),
        daemon=True,
    )
    rtts: dict[int, int] = {}
    order: list[int] = []
    dup = reordered = 0
    highest = -1
    key = session.udp_key
    sock.settimeout(0.05)
    sender.start()
    drain_until = math.inf
    try:
        while time.perf_counter() < drain_until:
            if not sender.is_alive() and drain_until == math.inf:
                drain_until = time.perf_counter() + drain_s
            if not sender.is_alive() and len(rtts) >= sent[0]:
                break
            try:
                data, anc, _f, _a = sock.recvmsg(65535, ANCILLARY_BYTES)
            except (TimeoutError, ConnectionRefusedError):
                continue
            rx_ns = rx_timestamp_ns(anc)
            try:
                reply = proto.unpack_probe(data, key)
            except proto.ProtocolError:
                continue
            if reply.kind != proto.KIND_REPLY or reply.stream != stream:
                continue
            if reply.seq in rtts:
                dup += 1
                continue
            server_ns = max(0, reply.server_tx_ns - reply.server_rx_ns)
            rtts[reply.seq] = rx_ns - reply.client_tx_ns - server_ns
            order.append(reply.seq)
            if reply.seq < highest:
                reordered += 1
            highest = max(highest, reply.seq)
    finally:
        stop.set()
        sender.join()
        sock.close()
    server = session.udp_stats(stream, sent[0])
    return ProbeRun(
        sent=sent[0],
        rtt_ns_by_seq=rtts,
        arrival_order=order,
        duplicates=dup,
        reordered=reordered,
        server_received=int(server["received"]),
        server_duplicates=int(server["duplicates"]),
    )


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def summarize_probes(run: ProbeRun) -> LatencyResult:
    """RTT percentiles, RFC 3550 jitter, IPDV and loss split into upstream and downstream."""
    if run.received == 0:
        raise MeasurementError(
            f"none of {run.sent} UDP probes came back; is the server's UDP port reachable?"
        )
    rtt_ms = {seq: ns / 1e6 for seq, ns in run.rtt_ns_by_seq.items()}
    summary = stats.summarize(list(rtt_ms.values()))
    ipdv_values = stats.ipdv(list(rtt_ms.items()))
    up_lost = max(0, run.sent - run.server_received)
    down_lost = max(0, run.server_received - run.received)
    runs = stats.loss_runs(run.sent, run.rtt_ns_by_seq)
    lo, hi = stats.wilson_interval(up_lost, run.sent)
    return LatencyResult(
        rtt_ms={
            "min": summary.min,
            "p50": summary.p50,
            "p90": summary.p90,
            "p99": summary.p99,
            "p999": summary.p999,
            "max": summary.max,
            "mean": summary.mean,
            "stddev": summary.stddev,
            "samples": summary.count,
        },
        jitter_ms=stats.rfc3550_jitter(rtt_ms[s] for s in run.arrival_order),
        ipdv_ms=_ipdv_summary(ipdv_values),
        loss={
            "probes": run.sent,
            "up": _pct(up_lost, run.sent),
            "down": _pct(down_lost, run.server_received),
            "up_count": up_lost,
            "down_count": down_lost,
            "up_ci95": [100.0 * lo, 100.0 * hi],
            "round_trip": _pct(runs.lost, run.sent),
            "bursts": runs.bursts,
            "max_burst": runs.max_burst,
            "reordered": run.reordered,
            "duplicated": run.duplicates + run.server_duplicates,
        },
    )


def _ipdv_summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    s = stats.summarize(values)
    return {"p50": s.p50, "p90": s.p90, "p99": s.p99, "max": s.max}


# --------------------------------------------------------------------------------------
# Phase 2: TCP goodput
# --------------------------------------------------------------------------------------
@dataclass
class ThroughputRun:
    """Goodput of one direction and stream count, from per-interval receiver-side samples."""

    direction: str
    streams: int
    gbps: float
    ci95_pct: float
    ci95_gbps: list[float]
    converged: bool
    rounds: int
    duration_s: float
    bytes: int
    intervals_gbps: list[float] = field(default_factory=list)
    # TCP_INFO of each sending socket in the last round (the client's when up, the server's
    # when down): RTT, retransmissions, and how long the send buffer or the receiver's window
    # limited it
    sender_tcp: list[dict[str, Any]] = field(default_factory=list)


def _send_stream(conn: Any, deadline: float, max_bytes: int, out: dict[int, Any], i: int) -> None:
    block = memoryview(bytes(_BLOCK_BYTES))
    sent = 0
    sock = conn.sock
    sock.settimeout(0.25)
    try:
        while time.monotonic() < deadline and sent < max_bytes:
            try:
                sent += sock.send(block[: min(_BLOCK_BYTES, max_bytes - sent)])
            except TimeoutError:
                continue
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(30.0)
        report = conn.receive()  # the sink has everything: the socket's stats are final
        info = tcp_info(sock)
        if info is not None:
            report["sender_tcp"] = {
                **info.as_dict(),
                "congestion_control": congestion_control(sock),
            }
        out[i] = report
    except (OSError, MeasurementError) as exc:
        out[i] = exc


def _recv_stream(
    conn: Any, epoch: float, interval_s: float, bins: dict[int, int], lock: threading.Lock
) -> None:
    buf = bytearray(_BLOCK_BYTES)
    sock = conn.sock
    sock.settimeout(30.0)
    local: dict[int, int] = {}
    with contextlib.suppress(OSError):
        while True:
            n = sock.recv_into(buf)
            if n == 0:
                break
            index = int((time.monotonic() - epoch) / interval_s)
            local[index] = local.get(index, 0) + n
    with lock:
        for index, n in local.items():
            bins[index] = bins.get(index, 0) + n


def _one_round(
    session: ProbeSession,
    direction: str,
    streams: int,
    duration_s: float,
    interval_s: float,
    max_bytes: int,
) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """Run one test of ``streams`` connections; bytes per interval index, and the sending
    sockets' TCP_INFO."""
    mode = "sink" if direction == "up" else "source"
    test = uuid.uuid4().hex
    per_stream = max(1, max_bytes // streams)
    conns = [
        session.open_data(
            mode, duration_s=duration_s, max_bytes=per_stream, interval_s=interval_s, test=test
        )
        for _ in range(streams)
    ]
    bins: dict[int, int] = {}
    threads: list[threading.Thread] = []
    reports: dict[int, Any] = {}
    lock = threading.Lock()
    epoch = time.monotonic()
    for i, conn in enumerate(conns):
        if direction == "up":
            args: tuple[Any, ...] = (conn, epoch + duration_s, per_stream, reports, i)
            threads.append(threading.Thread(target=_send_stream, args=args, daemon=True))
        else:
            args = (conn, epoch, interval_s, bins, lock)
            threads.append(threading.Thread(target=_recv_stream, args=args, daemon=True))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration_s + 40.0)
    finally:
        for conn in conns:
            conn.close()
    if direction == "up":
        _merge_sink_reports(reports, streams, bins)
        senders = [r["sender_tcp"] for r in reports.values() if isinstance(r, dict)
                   and "sender_tcp" in r]  # fmt: skip
    else:
        senders = session.tcp_report(test)
    return bins, senders


def _merge_sink_reports(reports: dict[int, Any], streams: int, bins: dict[int, int]) -> None:
    for i in range(streams):
        report = reports.get(i)
        if not isinstance(report, dict) or report.get("op") != "sink_report":
            raise MeasurementError(f"upload stream {i} got no report from the server: {report}")
        if report.get("stopped"):  # the session's budget cut it short: not a whole test
            raise MeasurementError(f"upload stream {i}: server stopped: {report['stopped']}")
        first = int(report["first_bin"])
        for offset, n in enumerate(report["bins"]):
            bins[first + offset] = bins.get(first + offset, 0) + int(n)


def _window_samples(
    bins: dict[int, int],
    omit_s: float,
    duration_s: float,
    interval_s: float,
    capped: bool = False,
) -> list[float]:
    """Gbps per interval, skipping slow start and the partial tail after the test ended."""
    first = math.ceil(omit_s / interval_s - 1e-9)
    last = int(duration_s / interval_s + 1e-9)  # exclusive
    if capped and bins:
        # The byte cap ended the test early: its last bin is partial and later ones empty.
        last = min(last, max(bins))
    return [bytes_per_s_to_gbps(bins.get(i, 0) / interval_s) for i in range(first, last)]


def measure_goodput(
    session: ProbeSession,
    *,
    direction: str,
    streams: int,
    duration_s: float,
    omit_s: float,
    interval_s: float,
    ci_target_pct: float,
    max_duration_s: float,
    max_bytes: int,
) -> ThroughputRun:
    """Repeat rounds until the 95 % interval of the mean is within ±``ci_target_pct`` or the cap."""
    samples: list[float] = []
    rounds = 0
    total_bytes = 0
    spent_s = 0.0
    while True:
        bins, senders = _one_round(
            session, direction, streams, duration_s + omit_s, interval_s, max_bytes
        )
        rounds += 1
        spent_s += duration_s + omit_s
        round_bytes = sum(bins.values())
        total_bytes += round_bytes
        capped = round_bytes >= (max_bytes // streams) * streams
        samples += _window_samples(bins, omit_s, duration_s + omit_s, interval_s, capped)
        ci = stats.mean_ci95(samples)
        converged = ci.relative_pct <= ci_target_pct
        if converged or spent_s + duration_s + omit_s > max_duration_s + 1e-9:
            break
    return ThroughputRun(
        direction=direction,
        streams=streams,
        gbps=ci.mean if samples else 0.0,
        ci95_pct=ci.relative_pct,
        ci95_gbps=[ci.low, ci.high],
        converged=converged,
        rounds=rounds,
        duration_s=spent_s,
        bytes=total_bytes,
        intervals_gbps=samples,
        sender_tcp=senders,
    )


# --------------------------------------------------------------------------------------
# Phase 4: path MTU by DF probing
# --------------------------------------------------------------------------------------
@dataclass
class MtuResult:
    """Largest IP packet that crossed the path with DF set, and how it was found."""

    mtu: int
    header_bytes: int
    probes: int
    kernel_mtu: int | None
    bytes_sent: int = 0  # IP bytes of every probe the search sent


def discover_mtu(
    session: ProbeSession, *, timeout_s: float = 0.3, tries: int = 3, max_mtu: int = 65535
) -> MtuResult:
    """Binary search over probe sizes with ``IP_PMTUDISC_DO``: the largest size echoed back wins
    (searched up to the kernel's path MTU and ``max_mtu``)."""
    sock = _udp_socket(session)
    set_dont_fragment(sock)
    header = 48 if sock.family == socket.AF_INET6 else 28
    counter = [0, 0]  # probes sent, their IP bytes
    try:
        low = proto.PROBE.size
        if not _probe_size(sock, session, low, timeout_s, tries, counter):
            raise MeasurementError("no UDP probe came back during the MTU search")
        high = min(kernel_path_mtu(sock) or 65535, 65535, max_mtu) - header
        while low < high:
            mid = (low + high + 1) // 2
            if _probe_size(sock, session, mid, timeout_s, tries, counter):
                low = mid
            else:
                high = mid - 1
        return MtuResult(low + header, header, counter[0], kernel_path_mtu(sock), counter[1])
    finally:
        sock.close()


def _probe_size(
    sock: socket.socket,
    session: ProbeSession,
    size: int,
    timeout_s: float,
    tries: int,
    counter: list[int],
) -> bool:
    key = session.udp_key
    for _ in range(tries):
        seq = counter[0]
        counter[0] += 1
        probe = proto.Probe(proto.KIND_REQUEST, 0xFFFF, session.session_id, seq, time.time_ns())
        try:
            sock.send(proto.pack_probe(probe, key, size))
            counter[1] += size + (48 if sock.family == socket.AF_INET6 else 28)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                return False  # the kernel already knows the path is smaller
            continue
        if _await_reply(sock, key, seq, timeout_s):
            return True
    return False


def _await_reply(sock: socket.socket, key: bytes | None, seq: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65535)
        except TimeoutError:
            return False
        except OSError:
            continue  # ICMP "frag needed" or "refused" surfaces here; keep waiting
        with contextlib.suppress(proto.ProtocolError):
            reply = proto.unpack_probe(data, key)
            if reply.kind == proto.KIND_REPLY and reply.seq == seq and reply.stream == 0xFFFF:
                return True
    return False
