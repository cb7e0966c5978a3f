"""NIXL (vLLM's KV transport) across the emulated WAN, next to iperf3 and pdx, in one run.

    .venv/bin/python benchmarks/bench_nixl.py [--rtt 10 40 80] [--loss-rtt 40]
        [--tokens 512 1024 2048 4096] [--rounds 3] [--json] [--json-out FILE]
                                                                   (root; exits 2 otherwise)

**Path.** ``pdx faults netns`` with prefix ``pdxbn``: prefill site 10.77.1.1, decode site
10.77.2.1, a router hop between them where pdx's userspace emulator applies per-packet delay,
loss and a 1 Gbit/s cap (as ``bench_transfer.py --wan``), at each ``--rtt`` without loss and at
``--loss-rtt`` with 0.1 % loss. Every socket lives in those namespaces; they go in ``finally``.

**Object.** What vLLM's NixlConnector ships for a prompt of N tokens: ceil(N / block_tokens)
blocks (``--block-tokens`` 16, vLLM's GPU block; CPU backends use 128) of every layer, with
``--kv-bytes-per-token`` (llama-3.1-8b bf16: 32 layers x 8 KV heads x 128 x (K,V) x 2 B =
131,072) spread evenly over ``--layers``. Layout as vLLM registers it with K and V packed per
layer: per-layer regions of one contiguous buffer per agent, ``[layer][pool block][block]``,
registered once (``register_memory``), and one transfer descriptor per (layer, block),
``block_tokens x kv_bytes_per_token / layers`` bytes (64 KiB by default), layer-major, prepared
once for the whole pool (``prep_xfer_dlist``); a transfer picks the object's blocks by index
(``make_prepped_xfer``), as vLLM's pull worker does. The pool holds twice the largest object
and an object takes a seeded random sample of its blocks (a busy engine's blocks are scattered);
NIXL merges adjacent descriptors and the count it posted is reported.

**NIXL.** Two processes of ``.venv-vllm``'s Python running this file in its agent mode, one per
site (``ip netns exec``), configured as vLLM's worker configures them:
``nixl_agent_config(num_threads=4, capture_telemetry=True)`` (progress thread on),
``UCX_RCACHE_MAX_UNRELEASED=1024``, plus ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=eth-router``
(the interface toward the router); the API is imported from ``nixl_cu12._api``, the module
``nixl`` resolves to here, skipping the shim's 5 s torch import. The prefill agent serves
``get_agent_metadata()`` and its buffer address on a TCP side channel (10.77.1.1, through the
WAN, like vLLM's handshake); the decode agent loads it (``add_remote_agent``) and READs, pulling as
vLLM's decode does. A transfer is timed from ``transfer()`` to ``check_xfer_state() == "DONE"``
and a marker in every descriptor is checked after. Per object and round, on a fresh connection
(``remove_remote_agent`` then ``add_remote_agent``: UCX opens new TCP connections, the old
ones linger; TCP metrics flushed in both sites): **cold** (the first transfer; UCX connects
lazily, as in vLLM, so the connection setup is inside it), ``--warm`` transfers back to back
(their **median**), then ``--idle-s`` of silence and one more (**idle**: slow start after
idle). Over tcp this UCX runs a
READ as software emulation (the prefill's worker, i.e. NIXL's progress thread, answers with
active messages), which ``UCX_PROTO_INFO`` shows and the report quotes. The CPU of both agents
during each transfer is reported (their progress threads poll, ~0.5 core each even when idle;
on a 2-core machine NIXL can be CPU-bound, which the JSON's ``cpu_s_per_gb`` shows).

**iperf3.** Server in the prefill site, client in the decode site with ``-R``: prefill → decode,
the way KV travels; ``-C`` the profile's ``net.ipv4.tcp_congestion_control``, which is what
NIXL's sockets get (UCX sets none; ``ss -tin`` on NIXL's sockets is recorded to show it). With
``num_threads=4`` NIXL splits a large READ over its worker threads, each with a TCP connection
of its own: P, the connections that carried at least a tenth of an object's bytes, is read
with ``ss`` per object, and iperf3 runs with ``-P P``. ``-n SIZE`` is the same job on fresh
connections (the peer of NIXL's cold transfer, TCP metrics flushed); ``-t 2 -O 1`` is the
steady rate (the peer of the warm median). Per profile and path, iperf3's one-stream steady
rate is measured first: an object one transfer of which would take longer than
``--max-transfer-s`` at that rate is not measured for that profile (NIXL nor ``-n``), and the
table says so with the predicted time (CUBIC at 40 ms and 0.1 % loss moves ~15 Mbit/s).

**pdx.** ``kv-serve`` in the prefill site, ``kv-bench --target`` in the decode site, one stream,
Get (prefill → decode) after kv-bench's own warm-up round: a warm number, held against iperf3's
one-stream steady rate, with the congestion control and sysctls of the last profile.

**Profiles.** *default*: UCX's defaults; the kernel's stock congestion control (CUBIC) and slow
start after idle (on); the namespaces' own ``tcp_wmem``/``tcp_rmem`` (recorded). A namespace
may only default to a congestion control the host allows (``tcp_allowed_congestion_control``,
host-wide): the script adds cubic/bbr there if missing and restores the list at the end, its
only change outside its namespaces. The sweep is greedy: at the largest ``--rtt`` and at the
lossy path, with ``--sweep-tokens`` objects (halved until the current settings move one in a
third of ``--max-transfer-s``), each candidate is added to the best profile so far and measured
(cold, one warm, idle), in this order: BBR (it changes the regime the rest is measured in);
the kernel's buffer caps (``tcp_wmem``/``tcp_rmem`` max = the next power of two above twice the
BDP at the largest RTT) against UCX's own (``UCX_TCP_SNDBUF``/``RCVBUF``), rivals for the same
limit of which at most one is kept (the kernel's on a tie within 10 %: autotuning stays on and
no host-wide ``net.core`` limit caps it); ``tcp_slow_start_after_idle=0``; UCX's segment sizes
(``UCX_TCP_TX_SEG_SIZE``/``RX_SEG_SIZE``). ``UCX_RNDV_THRESH``/``UCX_ZCOPY_THRESH`` are checked
with ``UCX_PROTO_INFO`` instead: whether they change the protocol of a READ at all. *default*
is measured twice first; a candidate is kept when its gain (geometric mean over cold, warm and
idle) is >= 1 + d at some path and >= 1 / (1 + d) at all, d = the larger of 10 % and
*default*'s drift between its two runs there. *recommended* = the profile the sweep ends with,
measured in the main table like *default*.

**The rule of the fight** (``bench_transfer.py``'s): a tool and the iperf3 it is held against run
the same congestion control, on the same path, under the same kernel buffer caps (each profile
gets its own iperf3 runs under its own sysctls), with as many TCP connections (iperf3 ``-P``
= NIXL's; pdx's one stream against ``-P 1``); who goes first alternates from round to round
and path to path (which profile, and pdx before or after them; within a profile NIXL runs
before its iperf3, which needs NIXL's connection count); ratios are computed from the numbers
and labels from the ratios.

About 17 minutes with ``--rounds 1`` on a 2-core machine (the default paths and sizes).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import random
import re
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
VLLM_PYTHON = SCRIPT.parents[1] / ".venv-vllm" / "bin" / "python"
PREFIX = "pdxbn"
PREFILL_ADDR = "10.77.1.1"
DECODE_ADDR = "10.77.2.1"
SITE_IFACE = "eth-router"  # each site's interface toward the router
CAP_MBIT = 1000.0
LOSS = 0.001
ADOPT_GAIN = 0.10  # a candidate must gain this much somewhere and lose no more anywhere
ON_PAR = 0.90  # ratio to iperf3 that counts as matching the link
FLOOR_MBIT = 10.0  # slowest rate a transfer may take before its timeout
UCX_BASE = {
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": SITE_IFACE,
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
}
CC_NAMES = ("cubic", "bbr", "reno", "htcp", "dctcp", "vegas", "westwood")
CC, SSAI = "net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle"
WMEM, RMEM = "net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"
UCX_CONFIG_KEYS = (
    "UCX_TCP_SNDBUF",
    "UCX_TCP_RCVBUF",
    "UCX_TCP_TX_SEG_SIZE",
    "UCX_TCP_RX_SEG_SIZE",
    "UCX_RNDV_THRESH",
    "UCX_ZCOPY_THRESH",
    "UCX_TCP_NODELAY",
    "UCX_TCP_PUT_ENABLE",
    "UCX_TCP_MAX_BW",
    "UCX_PROTO_ENABLE",
)


# --- agent mode: runs under .venv-vllm, inside a site namespace ---------------------------


def _say(doc: dict[str, Any]) -> None:
    """One protocol line on stdout; UCX logs there too, so only ``@@`` lines count."""
    sys.stdout.write("@@ " + json.dumps(doc) + "\n")
    sys.stdout.flush()


def _descs(base: int, a: argparse.Namespace) -> Any:
    """(address, length, device) per (layer, block), layer-major like vLLM's descriptors."""
    import numpy as np

    n = a.layers * a.pool_blocks
    out = np.zeros((n, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(n, dtype=np.uint64) * a.block_bytes
    out[:, 1] = a.block_bytes
    return out


def _nixl_api() -> Any:
    """``nixl._api`` as the ``nixl`` shim resolves it, without the shim's torch import (5 s)."""
    try:
        import nixl_cu12._api as api
    except ImportError:
        import nixl._api as api
    return api


def _agent_setup(a: argparse.Namespace, role: str) -> tuple[Any, Any]:
    import numpy as np

    api = _nixl_api()

    conf = api.nixl_agent_config(
        enable_prog_thread=bool(a.progress_thread),
        num_threads=a.num_threads,
        capture_telemetry=True,
    )
    agent = api.nixl_agent(f"{role}-{os.getpid()}", conf)
    # Touched up front, as a serving engine's KV cache is: no page faults inside the timing.
    buf = np.full(a.layers * a.pool_blocks * a.block_bytes, 7, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    return agent, buf


def _prefill_agent(a: argparse.Namespace) -> None:
    agent, buf = _agent_setup(a, "prefill")
    n = a.layers * a.pool_blocks
    buf.view("uint64")[:: a.block_bytes // 8][:n] = range(1, n + 1)  # descriptor i holds i+1
    srv = socket.create_server((a.listen, 0))
    doc = {"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "base": buf.ctypes.data}
    line = (json.dumps(doc) + "\n").encode()
    _say({"port": srv.getsockname()[1]})
    while True:  # until the orchestrator closes stdin
        ready, _, _ = select.select([srv, sys.stdin], [], [], 0.5)
        agent.get_new_notifs()  # drain the per-transfer notifications, as vLLM's prefill does
        if sys.stdin in ready and not sys.stdin.readline():
            return
        if srv in ready:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(10)
                conn.sendall(line)


class _Decode:
    """The pulling side: vLLM's decode worker reading an object's blocks from prefill."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.agent, self.buf = _agent_setup(a, "decode")
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(self.buf.ctypes.data, a), "DRAM"
        )
        self.remote: Any = None
        self.peer_name = ""
        self.count = 0

    def connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        host, port = str(cmd["peer"]).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=float(cmd["timeout_s"])) as s:
            doc = json.loads(s.makefile("rb").readline())
        self.peer_name = self.agent.add_remote_agent(base64.b64decode(doc["meta"]))
        self.remote = self.agent.prep_xfer_dlist(
            self.peer_name, _descs(int(doc["base"]), self.a), "DRAM"
        )
        return {"handshake_s": time.perf_counter() - t0}

    def disconnect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.remote.release()
        self.agent.remove_remote_agent(self.peer_name)
        return {}

    def read(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        a, n = self.a, int(cmd["blocks"])
        rng = random.Random(int(cmd["seed"]))
        layer0 = np.arange(a.layers, dtype=np.int64)[:, None] * a.pool_blocks
        lidx = (layer0 + np.array(sorted(rng.sample(range(a.pool_blocks), n)))).ravel()
        ridx = (layer0 + np.array(sorted(rng.sample(range(a.pool_blocks), n)))).ravel()
        marks, pos = self.buf.view("uint64"), lidx * (a.block_bytes // 8)
        marks[pos] = 0
        self.count += 1
        handle = self.agent.make_prepped_xfer(
            "READ",
            self.local,
            lidx.astype(np.int32),
            self.remote,
            ridx.astype(np.int32),
            notif_msg=f"req-{self.count}".encode(),
        )
        t0 = time.perf_counter()
        state = self.agent.transfer(handle)
        deadline = t0 + float(cmd["timeout_s"])
        while state == "PROC" and time.perf_counter() < deadline:
            time.sleep(a.poll_s)
            state = self.agent.check_xfer_state(handle)
        seconds = time.perf_counter() - t0
        out = {
            "state": state,
            "seconds": seconds,
            "bytes": int(lidx.size) * a.block_bytes,
            "descs": int(lidx.size),
        }
        if state == "DONE":
            out["verified"] = bool((marks[pos] == ridx.astype(np.uint64) + 1).all())
            out["posted_descs"] = int(self.agent.get_xfer_telemetry(handle).descCount)
            handle.release()
        return out


def _decode_agent(a: argparse.Namespace) -> None:
    dec = _Decode(a)
    _say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        try:
            _say({"ok": True, **getattr(dec, cmd["op"])(cmd)})
        except Exception as exc:  # handed to the orchestrator, which raises
            _say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _ucx_config_agent(a: argparse.Namespace) -> None:
    """``ucx_info -c`` for the UCX that nixl-cu12 bundles (no ucx_info binary ships with it)."""
    import ctypes
    import glob

    import nixl_cu12

    libs = Path(nixl_cu12.__file__).parent.with_name("nixl_cu12.libs")
    for name in ("libucs", "libucm", "libuct", "libucp"):
        ctypes.CDLL(glob.glob(str(libs / f"{name}-*.so*"))[0], mode=ctypes.RTLD_GLOBAL)
    ucp = ctypes.CDLL(glob.glob(str(libs / "libucp-*.so*"))[0])
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    ucs = ctypes.CDLL(glob.glob(str(libs / "libucs-*.so*"))[0])
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile("r", suffix=".ucx") as tmp:
        stream = ctypes.c_void_p(libc.fopen(tmp.name.encode(), b"w"))
        config_list = ctypes.c_void_p.in_dll(ucs, "ucs_config_global_list")
        # UCX 1.23: (stream, env prefix, flags = UCS_CONFIG_PRINT_CONFIG, list, filter)
        ucs.ucs_config_parser_print_all_opts(stream, b"UCX_", 1, ctypes.byref(config_list), b"")
        libc.fclose(stream)
        values = dict(ln.split("=", 1) for ln in tmp.read().splitlines() if "=" in ln)
    _say({"version": ucp.ucp_get_version_string().decode(), "values": values})


def agent_main(argv: list[str]) -> None:
    """Entry point of the agent processes (``--agent prefill|decode|ucx-config``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", choices=["prefill", "decode", "ucx-config"], required=True)
    ap.add_argument("--listen", default=PREFILL_ADDR)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=65536)
    ap.add_argument("--num-threads", type=int, default=4)
    ap.add_argument("--progress-thread", type=int, default=1)
    ap.add_argument("--poll-s", type=float, default=0.0005)
    a = ap.parse_args(argv)
    {"prefill": _prefill_agent, "decode": _decode_agent, "ucx-config": _ucx_config_agent}[a.agent](
        a
    )


# --- orchestration: runs under .venv as root ----------------------------------------------


@dataclass
class KvShape:
    """What vLLM ships per token and how it cuts it into descriptors."""

    kv_bytes_per_token: int
    layers: int
    block_tokens: int

    @property
    def block_bytes(self) -> int:
        """One descriptor: one block of one layer."""
        return self.block_tokens * self.kv_bytes_per_token // self.layers

    def blocks(self, tokens: int) -> int:
        """Blocks a prompt of ``tokens`` occupies (vLLM ships whole blocks)."""
        return math.ceil(tokens / self.block_tokens)

    def object_bytes(self, tokens: int) -> int:
        """Bytes NIXL moves for a prompt of ``tokens``."""
        return self.blocks(tokens) * self.layers * self.block_bytes


@dataclass
class Profile:
    """UCX environment and site sysctls a pair of vLLM instances would run with."""

    name: str
    ucx: dict[str, str] = field(default_factory=dict)
    sysctl: dict[str, str] = field(default_factory=dict)
    group: str = ""  # candidates of one group fix the same limit: at most one is adopted

    def plus(self, other: Profile, name: str) -> Profile:
        """This profile with ``other``'s settings on top."""
        return Profile(name, {**self.ucx, **other.ucx}, {**self.sysctl, **other.sysctl})

    @property
    def cc(self) -> str:
        """The congestion control new sockets in the sites get."""
        return self.sysctl[CC]


@dataclass
class WanPath:
    """One emulated path: RTT added by the router hop and per-packet loss, both ways."""

    rtt_ms: float
    loss: float = 0.0

    @property
    def label(self) -> str:
        """``RTT 40 ms, 0.1 % loss``."""
        return f"RTT {self.rtt_ms:g} ms" + (f", {self.loss * 100:g} % loss" if self.loss else "")


def _run(cmd: list[str], timeout_s: float = 30.0, check: bool = True) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(out.stderr or out.stdout).strip()[-300:]}")
    return out.stdout


def _in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def _timeout_s(nbytes: int) -> float:
    return nbytes * 8 / (FLOOR_MBIT * 1e6) + 30


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


class Site:
    """Sysctls, TCP metrics and sockets of the two site namespaces."""

    def __init__(self, topo: Any) -> None:
        self.topo = topo

    def read_sysctl(self, key: str) -> str:
        """A sysctl as the prefill site sees it (tabs folded)."""
        return " ".join(_run(_in_ns(self.topo.prefill, "sysctl", "-n", key)).split())

    def apply(self, sysctls: dict[str, str]) -> None:
        """Set ``sysctls`` in both sites (per-namespace keys only)."""
        for ns in (self.topo.prefill, self.topo.decode):
            for key, value in sysctls.items():
                _run(_in_ns(ns, "sysctl", "-qw", f"{key}={value}"))

    def flush_metrics(self) -> None:
        """Forget cached ssthresh/RTT per peer, so a new connection starts cold."""
        for ns in (self.topo.prefill, self.topo.decode):
            _run(["ip", "-n", ns, "tcp_metrics", "flush", "all"], check=False)

    def sockets(self) -> dict[str, dict[str, Any]]:
        """Prefill-site TCP sockets toward the decode site, by peer address."""
        out = _run(
            _in_ns(self.topo.prefill, "ss", "-tinmH", "state", "established", "dst", DECODE_ADDR)
        )
        return {s["peer"]: s for s in _parse_ss(out)}

    def data_sockets(self, before: dict[str, dict[str, Any]], min_bytes: int) -> list[Any]:
        """Sockets that sent ``min_bytes`` or more since ``before`` (a :meth:`sockets`)."""
        out = []
        for peer, s in self.sockets().items():
            sent = s.get("bytes_acked", 0) - before.get(peer, {}).get("bytes_acked", 0)
            if sent >= min_bytes:
                out.append({**s, "sent_bytes": sent})
        return out


def _parse_ss(text: str) -> list[dict[str, Any]]:
    """``ss -tinm`` output: per socket its congestion control, cwnd, buffers, bytes."""
    socks: list[dict[str, Any]] = []
    for line in text.splitlines():
        if line and not line[0].isspace():
            parts = line.split()
            socks.append({"local": parts[-2], "peer": parts[-1]})
            continue
        if not socks:
            continue
        s, words = socks[-1], line.split()
        cc = next((w for w in words if w in CC_NAMES), None)
        if cc:
            s["cc"] = cc
        for key in ("bytes_acked", "cwnd"):
            m = re.search(rf"\b{key}:(\d+)", line)
            if m:
                s[key] = int(m.group(1))
        m = re.search(r"skmem:\(([^)]*)\)", line)
        if m:
            mem = {
                re.sub(r"\d+$", "", kv): int(re.sub(r"^\D+", "", kv))
                for kv in m.group(1).split(",")
            }
            s["sndbuf"], s["rcvbuf"] = mem.get("tb"), mem.get("rb")
    return socks


class Agent:
    """One NIXL agent process in a site namespace, driven by JSON lines."""

    def __init__(
        self, ns: str, role: str, args: list[str], env: dict[str, str], log_dir: Path
    ) -> None:
        self.role = role
        self.log = log_dir / f"{role}-{time.monotonic_ns()}.log"
        envs = [f"{k}={v}" for k, v in env.items()]
        cmd = _in_ns(ns, "env", *envs, str(VLLM_PYTHON), str(SCRIPT), "--agent", role, *args)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
            )
        self.noise: list[str] = []  # UCX's own stdout lines (warnings, UCX_PROTO_INFO tables)
        self._buf = b""

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next protocol line; raises if the agent dies or says nothing in time."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"@@ "):
                    doc: dict[str, Any] = json.loads(line[3:])
                    return doc
                self.noise.append(line.decode(errors="replace"))
            left = deadline - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise TimeoutError(f"NIXL {self.role} agent: no answer in {timeout_s:.0f} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"NIXL {self.role} agent exited: {' | '.join(tail)}")
            self._buf += chunk

    def drain(self, timeout_s: float = 0.0) -> None:
        """Keep what the agent printed besides protocol lines (so its pipe never fills)."""
        assert self.proc.stdout is not None
        while select.select([self.proc.stdout], [], [], timeout_s)[0]:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        self.noise += [ln.decode(errors="replace") for ln in lines]

    def ask(self, timeout_s: float, **cmd: Any) -> dict[str, Any]:
        """Send one command to the decode agent and return its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**cmd, "timeout_s": timeout_s}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self.recv(timeout_s + 30)
        if not reply.get("ok"):
            raise RuntimeError(f"NIXL {cmd['op']}: {reply.get('error')}")
        return reply

    def cpu_s(self) -> float:
        """CPU seconds this agent used so far, all threads."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """End of stdin ends the agent; killed if it lingers."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.drain(timeout_s=2.0)
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self.proc.kill()
            self.proc.wait(timeout=10)


class NixlPair:
    """A prefill agent holding KV and a decode agent pulling it, with one profile's UCX env."""

    def __init__(
        self,
        site: Site,
        shape: KvShape,
        pool_blocks: int,
        profile: Profile,
        args: argparse.Namespace,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        env = {**UCX_BASE, **profile.ucx, **(extra_env or {})}
        common = [
            "--layers",
            str(shape.layers),
            "--pool-blocks",
            str(pool_blocks),
            "--block-bytes",
            str(shape.block_bytes),
            "--num-threads",
            str(args.num_threads),
            "--progress-thread",
            str(int(args.progress_thread)),
        ]
        self.site, self.shape = site, shape
        self.prefill = Agent(
            site.topo.prefill, "prefill", ["--listen", PREFILL_ADDR, *common], env, log_dir
        )
        self.decode: Agent | None = None
        try:  # both start at once; the decode agent learns the side channel at connect
            self.decode = Agent(site.topo.decode, "decode", common, env, log_dir)
            self.peer = f"{PREFILL_ADDR}:{self.prefill.recv(120)['port']}"
            self.decode.recv(120)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop both agents."""
        for agent in (self.decode, self.prefill):
            if agent is not None:
                agent.close()

    def __enter__(self) -> NixlPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, blocks: int, seed: int) -> dict[str, Any]:
        """One timed READ of ``blocks`` blocks of every layer; Gbit/s and CPU of both ends."""
        assert self.decode is not None
        nbytes = blocks * self.shape.layers * self.shape.block_bytes
        self.prefill.drain()
        cpu0 = self.prefill.cpu_s() + self.decode.cpu_s()
        r = self.decode.ask(_timeout_s(nbytes), op="read", blocks=blocks, seed=seed)
        cpu = self.prefill.cpu_s() + self.decode.cpu_s() - cpu0
        if r["state"] != "DONE" or not r.get("verified"):
            raise RuntimeError(
                f"NIXL READ of {nbytes} B ended {r['state']}, verified {r.get('verified')}"
            )
        return {
            "gbps": round(_gbps(r["bytes"], r["seconds"]), 4),
            "seconds": r["seconds"],
            "posted_descs": r["posted_descs"],
            "descs": r["descs"],
            "cpu_s_per_gb": round(cpu / (r["bytes"] / 1e9), 3),
        }

    def object_run(self, tokens: int, warm: int, idle_s: float, seed: int) -> dict[str, Any]:
        """Fresh connection: cold transfer, ``warm`` back to back, one after ``idle_s``."""
        assert self.decode is not None
        blocks = self.shape.blocks(tokens)
        self.site.flush_metrics()
        hs = self.decode.ask(60, op="connect", peer=self.peer)["handshake_s"]
        before = self.site.sockets()  # earlier connections linger after remove_remote_agent
        cold = self.read(blocks, seed)
        warms = [self.read(blocks, seed + 1 + k) for k in range(warm)]
        # NIXL splits a large READ over its worker threads, each with a TCP connection of its
        # own: count the connections that carried at least a tenth of the bytes.
        moved = (1 + warm) * self.shape.object_bytes(tokens)
        socks = self.site.data_sockets(before, moved // 10)
        time.sleep(idle_s)
        idle = self.read(blocks, seed + 99)
        self.decode.ask(60, op="disconnect")
        return {
            "cold": cold,
            "warm": warms,
            "idle": idle,
            "handshake_s": round(hs, 3),
            "sockets": socks,
        }


def _summarise_nixl(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of cold, warm (each round's median) and idle Gbit/s."""
    if not runs:
        return {}
    socks = [s for r in runs for s in r["sockets"]]
    return {
        "cold_gbps": _median([r["cold"]["gbps"] for r in runs]),
        "warm_gbps": _median([statistics.median(w["gbps"] for w in r["warm"]) for r in runs]),
        "idle_gbps": _median([r["idle"]["gbps"] for r in runs]),
        "cpu_s_per_gb": _median([w["cpu_s_per_gb"] for r in runs for w in r["warm"]]),
        "posted_descs": runs[-1]["warm"][-1]["posted_descs"],
        "descs": runs[-1]["warm"][-1]["descs"],
        "streams": max(1, round(statistics.median(len(r["sockets"]) for r in runs))),
        "cc_seen": sorted({s.get("cc", "?") for s in socks}),
        "sndbuf_seen": max((s.get("sndbuf") or 0 for s in socks), default=None),
        "rcvbuf_seen": max((s.get("rcvbuf") or 0 for s in socks), default=None),
        "handshake_s": _median([r["handshake_s"] for r in runs]),
    }


# --- iperf3 and pdx on the same path -------------------------------------------------------


def iperf3_ns(
    site: Site, cc: str, nbytes: int | None = None, streams: int = 1, seconds: int = 2
) -> dict[str, Any]:
    """iperf3 prefill → decode (``-R``), ``streams`` connections: ``-n nbytes`` (in all) on
    fresh connections, else the steady rate."""
    port = str(random.randint(20000, 29999))
    topo = site.topo
    server = subprocess.Popen(
        _in_ns(topo.prefill, "iperf3", "-s", "-1", "-B", PREFILL_ADDR, "-p", port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    mode = ["-n", str(nbytes)] if nbytes else ["-t", str(seconds), "-O", "1"]
    mode += ["-P", str(streams)]
    cmd = _in_ns(topo.decode, "iperf3", "-c", PREFILL_ADDR, "-p", port, "-R", "-J", "-C", cc, *mode)
    timeout_s = _timeout_s(nbytes) if nbytes else seconds + 40
    try:
        if nbytes:
            site.flush_metrics()
        for _ in range(50):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            doc = json.loads(out.stdout or "{}")
            if "refused" in str(doc.get("error", "")):
                time.sleep(0.1)
                continue
            if "error" in doc or "end" not in doc:
                raise RuntimeError(f"iperf3: {doc.get('error') or out.stderr.strip()[-200:]}")
            recv = doc["end"]["sum_received"]
            return {
                "gbps": round(recv["bits_per_second"] / 1e9, 4),
                "seconds": round(recv["seconds"], 3),
                "cc": doc["end"].get("sender_tcp_congestion"),
            }
        raise RuntimeError("iperf3 server never came up")
    finally:
        server.kill()
        server.wait(timeout=10)


class PdxStore:
    """``pdx kv-serve`` in the prefill site (started once, like ``bench_transfer --wan``)."""

    def __init__(self, site: Site, log_dir: Path) -> None:
        pdx = str(Path(sys.executable).with_name("pdx"))
        out = log_dir / "kv-serve.out"  # a file, not a pipe nobody drains later
        cmd = [pdx, "kv-serve", "--host", PREFILL_ADDR, "--port", "0", "--budget-gb", "4", "--json"]
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                _in_ns(site.topo.prefill, *cmd), stdout=f, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = out.read_text(errors="replace")
            end = text.find("\n}")  # the end of the pretty-printed ready document
            if end >= 0:
                self.port = int(json.loads(text[text.index("{") : end + 2])["port"])
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"pdx kv-serve did not start: {out.read_text()[-300:]}")

    def stop(self) -> None:
        """SIGTERM, then wait."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def pdx_get(site: Site, store: PdxStore, nbytes: int, cc: str) -> dict[str, Any]:
    """One ``kv-bench --target`` (one stream, repeat 1): Get goodput prefill → decode."""
    pdx = str(Path(sys.executable).with_name("pdx"))
    out = _run(
        _in_ns(
            site.topo.decode,
            pdx,
            "kv-bench",
            "--target",
            f"{PREFILL_ADDR}:{store.port}",
            "--bytes",
            str(nbytes),
            "--streams",
            "1",
            "--connections",
            "1",
            "--repeat",
            "1",
            "--congestion-control",
            cc,
            "--json",
        ),
        timeout_s=4 * _timeout_s(nbytes),
    )
    doc = json.loads(out)
    return {"gbps": round(doc["get_gbytes_per_s"] * 8, 4), "cc": doc.get("congestion_control")}


# --- UCX: its configuration and the protocol it picks for a READ --------------------------


def ucx_config(env: dict[str, str]) -> dict[str, Any]:
    """The bundled UCX's version and parsed values of the candidate variables under ``env``."""
    cmd = [
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        str(VLLM_PYTHON),
        str(SCRIPT),
        "--agent",
        "ucx-config",
    ]
    try:
        out = _run(cmd, timeout_s=60)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)[-200:]}
    for line in out.splitlines():
        if line.startswith("@@ "):
            doc = json.loads(line[3:])
            values = doc["values"]
            return {
                "version": doc["version"],
                "values": {k: values.get(k, "(unknown to this UCX)") for k in UCX_CONFIG_KEYS},
            }
    return {"error": "no output"}


def _proto_tables(noise: list[str], operation: str) -> dict[str, list[str]]:
    """``UCX_PROTO_INFO`` tables of one operation (e.g. ``ucp_get``) toward the peer site."""
    tables: dict[str, list[str]] = {}
    cfg, rows = "", None
    for line in noise:
        cell = " ".join(line.split("]", 2)[-1].strip().strip("|").split())
        if "cfg#" in cell:
            cfg, rows = cell.split(" ", 1)[-1], None
        elif operation in cell and " self " not in f" {cfg} ":
            rows = tables.setdefault(f"{cfg}: {cell}", [])
        elif rows is not None and line.rstrip().endswith("|") and "Range" not in cell:
            rows.append(cell.replace(" | ", " "))
        elif rows is not None and "+--" not in line and not line.rstrip().endswith("|"):
            rows = None
    return tables


def proto_probe(
    site: Site, shape: KvShape, profile: Profile, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    """One small READ with ``UCX_PROTO_INFO=y``: the protocol UCX chose, and its warnings."""
    with NixlPair(site, shape, 2, profile, args, log_dir, {"UCX_PROTO_INFO": "y"}) as pair:
        assert pair.decode is not None
        pair.decode.ask(60, op="connect", peer=pair.peer)
        pair.read(1, 0)
        pair.decode.ask(60, op="disconnect")
    noise = pair.decode.noise + pair.prefill.noise
    warnings = sorted({" ".join(ln.split("]", 2)[-1].split()) for ln in noise if "WARN" in ln})
    return {"get": _proto_tables(pair.decode.noise, "ucp_get"), "warnings": warnings}


# --- the sweep and the table ---------------------------------------------------------------


def candidates(buf_bytes: int) -> list[Profile]:
    """Settings that plausibly change a READ's rate over TCP, in the order the sweep tries them
    (congestion control first: it changes the regime the others are measured in)."""
    return [
        Profile("congestion control bbr", sysctl={CC: "bbr"}),
        Profile(
            "tcp_wmem/tcp_rmem max",
            sysctl={WMEM: f"4096 16384 {buf_bytes}", RMEM: f"4096 131072 {buf_bytes}"},
            group="socket buffers",
        ),
        Profile(
            "UCX_TCP_SNDBUF/RCVBUF",
            ucx={"UCX_TCP_SNDBUF": str(buf_bytes), "UCX_TCP_RCVBUF": str(buf_bytes)},
            group="socket buffers",
        ),
        Profile("tcp_slow_start_after_idle=0", sysctl={SSAI: "0"}),
        Profile(
            "UCX_TCP_TX_SEG_SIZE/RX_SEG_SIZE",
            ucx={"UCX_TCP_TX_SEG_SIZE": "64K", "UCX_TCP_RX_SEG_SIZE": "128K"},
        ),
    ]


PROTO_ONLY = [
    Profile("UCX_RNDV_THRESH=0", ucx={"UCX_RNDV_THRESH": "0"}),
    Profile("UCX_ZCOPY_THRESH=0", ucx={"UCX_ZCOPY_THRESH": "0"}),
]


def _nixl_profile_run(
    site: Site,
    shape: KvShape,
    profile: Profile,
    tokens: list[int],
    warm: int,
    args: argparse.Namespace,
    log_dir: Path,
    seed: int,
) -> dict[int, dict[str, Any]]:
    site.apply(profile.sysctl)
    if not tokens:
        return {}
    pool = 2 * max(shape.blocks(t) for t in tokens)
    out = {}
    with NixlPair(site, shape, pool, profile, args, log_dir) as pair:
        for k, t in enumerate(tokens):
            out[t] = pair.object_run(t, warm, args.idle_s, seed + 1000 * k)
    return out


def _fits(shape: KvShape, tokens: int, gbps: float, budget_s: float) -> bool:
    """Whether one transfer of ``tokens`` takes at most ``budget_s`` at ``gbps``."""
    return shape.object_bytes(tokens) * 8 / (gbps * 1e9) <= budget_s


def _geomean(xs: list[float]) -> float | None:
    return round(math.exp(statistics.fmean(math.log(x) for x in xs)), 3) if xs else None


class Sweep:
    """Greedy, one setting at a time on top of the best profile so far (coordinate ascent),
    at each sweep path; ``--sweep-tokens`` objects, halved until one transfer takes at most a
    third of ``--max-transfer-s`` at iperf3's steady rate under the current settings."""

    METRICS = ("cold", "warm", "idle")

    def __init__(
        self,
        site: Site,
        shape: KvShape,
        paths: list[WanPath],
        args: argparse.Namespace,
        log_dir: Path,
        log: Any,
    ) -> None:
        self.site, self.shape, self.paths, self.args = site, shape, paths, args
        self.log_dir, self.log = log_dir, log
        self.rows: list[dict[str, Any]] = []

    def sizes(self, prof: Profile) -> dict[str, int]:
        """Object size per path for ``prof`` (from iperf3's one-stream steady rate)."""
        out = {}
        for p in self.paths:
            set_path(self.site, p)
            self.site.apply(prof.sysctl)
            rate = iperf3_ns(self.site, prof.cc)["gbps"]
            tokens = self.args.sweep_tokens
            while tokens > self.shape.block_tokens and not _fits(
                self.shape, tokens, rate, self.args.max_transfer_s / 3
            ):
                tokens = max(self.shape.block_tokens, tokens // 2)
            out[p.label] = tokens
        return out

    def measure(self, prof: Profile, step: str, sizes: dict[str, int]) -> dict[str, Any]:
        """Cold, warm and idle Gbit/s of ``prof`` at every path."""
        out = {}
        for p in self.paths:
            t = sizes[p.label]
            self.log(f"sweep, {p.label}, {t} tokens: {step}")
            set_path(self.site, p)
            run = _nixl_profile_run(self.site, self.shape, prof, [t], 1, self.args, self.log_dir, 7)
            out[p.label] = {"tokens": t, **_summarise_nixl([run[t]])}
            self.rows.append({"step": step, "path": p.label, **out[p.label]})
        return out

    def gains(self, new: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
        """Per path, the geometric mean over cold, warm and idle of new / base."""
        out = {}
        for path, n in new.items():
            rs = [_ratio(n[f"{m}_gbps"], base[path][f"{m}_gbps"]) for m in self.METRICS]
            out[path] = _geomean([r for r in rs if r])
        return out

    def run(self, default: Profile) -> dict[str, Any]:
        """Measure ``default`` twice (its drift is the noise a gain must beat), then each
        candidate (or group of rival candidates) on top of the best so far."""
        sizes = self.sizes(default)
        first = self.measure(default, "default", sizes)
        again = self.measure(default, "default, again", sizes)
        drift = self.gains(again, first)
        need = {
            p: round(max(ADOPT_GAIN, abs(1 - (g or 1)), abs(1 - 1 / (g or 1))), 3)
            for p, g in drift.items()
        }
        base = {
            p: {
                f"{m}_gbps": statistics.fmean([first[p][f"{m}_gbps"], again[p][f"{m}_gbps"]])
                for m in self.METRICS
            }
            for p in first
        }
        current, adopted, steps = default, [], []
        for group in _groups(self.args.candidates):
            tried = []
            for c in group:
                prof = current.plus(c, f"{current.name} + {c.name}")
                res = self.measure(prof, f"+ {c.name}", sizes)
                g = self.gains(res, base)
                ok = any((g[p] or 0) >= 1 + need[p] for p in g) and all(
                    (g[p] or 0) >= 1 / (1 + need[p]) for p in g
                )
                tried.append((min(g[p] or 0 for p in g), c, prof, res, ok))
                steps.append(
                    {
                        "candidate": c.name,
                        "on_top_of": current.name,
                        "gain": g,
                        "adopted": False,
                        "passes": ok,
                    }
                )
            passing = [t for t in tried if t[4]]
            if not passing:
                continue
            # the rival with the best worst-path gain; an earlier one within 10 % of it wins
            # (the kernel's caps before UCX's fixed buffers: autotuning stays on)
            top = max(t[0] for t in passing)
            _, c, prof, res, _ = next(t for t in passing if t[0] >= top / (1 + ADOPT_GAIN))
            next(st for st in steps if st["candidate"] == c.name)["adopted"] = True
            adopted.append(c)
            current = Profile(prof.name, prof.ucx, prof.sysctl)
            new_sizes = self.sizes(current)
            if new_sizes != sizes:  # faster now: a bigger object, so measure the base again
                sizes = new_sizes
                res = self.measure(current, "re-measured at the new object size", sizes)
            base = res
        self.site.apply(default.sysctl)
        return {
            "rows": self.rows,
            "steps": steps,
            "adopted": [c.name for c in adopted],
            "adopted_profiles": adopted,
            "adopt_gain": need,
            "drift": drift,
        }


def _groups(cands: list[Profile]) -> list[list[Profile]]:
    """Candidates in order, rivals (same ``group``) together: at most one of each is kept."""
    out: list[list[Profile]] = []
    for c in cands:
        same = [g for g in out if c.group and g[0].group == c.group]
        if same:
            same[0].append(c)
        else:
            out.append([c])
    return out


def set_path(site: Site, p: WanPath) -> None:
    """Apply one path's RTT and loss to the router hop (live; established sockets carry on)."""
    from pdx.faults import netns

    netns.up(
        netns.make_config(
            prefix=site.topo.prefix,
            emulator="userspace",
            rate_mbit=CAP_MBIT,
            seed=5,
            delay_ms=p.rtt_ms / 2,
            loss=p.loss,
        )
    )


def _profile_round(
    site: Site,
    shape: KvShape,
    prof: Profile,
    mine: dict[str, Any],
    args: argparse.Namespace,
    log_dir: Path,
    seed: int,
    log: Any,
) -> None:
    """One round of one profile on the current path: iperf3's one-stream steady rate, NIXL
    on every object that fits, then iperf3 with NIXL's stream count (``-n`` and steady)."""
    site.apply(prof.sysctl)
    one = iperf3_ns(site, prof.cc)
    mine["steady1"].append(one["gbps"])
    mine["iperf3_cc"].add(one["cc"])
    fit = [t for t in args.tokens if _fits(shape, t, one["gbps"], args.max_transfer_s)]
    for t in set(args.tokens) - set(fit):
        mine["skipped"][t] = round(shape.object_bytes(t) * 8 / one["gbps"] / 1e9)
    log(f"round {seed // 100 + 1}, {prof.name}: NIXL, tokens {fit}")
    runs = _nixl_profile_run(site, shape, prof, fit, args.warm, args, log_dir, seed)
    streams = {}
    for t, run in runs.items():
        mine["nixl"][t].append(run)
        streams[t] = max(1, len(run["sockets"]))
    log(f"round {seed // 100 + 1}, {prof.name}: iperf3, streams {streams}")
    site.apply(prof.sysctl)
    for t in fit:
        one = iperf3_ns(site, prof.cc, nbytes=shape.object_bytes(t), streams=streams[t])
        mine["iperf3_n"][t].append(one["gbps"])
        mine["iperf3_cc"].add(one["cc"])
    for n in sorted(set(streams.values())):
        mine["steady"].setdefault(n, []).append(iperf3_ns(site, prof.cc, streams=n)["gbps"])


def measure_path(
    site: Site,
    shape: KvShape,
    p: WanPath,
    profiles: list[Profile],
    store: PdxStore,
    args: argparse.Namespace,
    log_dir: Path,
    first: bool,
    log: Any,
) -> list[dict[str, Any]]:
    """``--rounds`` rounds of every profile and of pdx (under the last profile's sysctls);
    which profile goes first, and whether pdx goes first or last, alternate."""
    set_path(site, p)
    res: dict[str, Any] = {
        pr.name: {
            "nixl": {t: [] for t in args.tokens},
            "iperf3_n": {t: [] for t in args.tokens},
            "steady": {},
            "steady1": [],
            "iperf3_cc": set(),
            "skipped": {},
        }
        for pr in profiles
    }
    pdx: dict[int, list[float]] = {t: [] for t in args.tokens}
    pdx_cc: set[str] = set()
    rec = profiles[-1]

    def pdx_round() -> None:
        site.apply(rec.sysctl)
        rate = iperf3_ns(site, rec.cc)["gbps"]
        log(f"{p.label}: pdx")
        for t in args.tokens:
            if _fits(shape, t, rate, args.max_transfer_s):
                one = pdx_get(site, store, shape.object_bytes(t), rec.cc)
                pdx[t].append(one["gbps"])
                pdx_cc.add(str(one["cc"]))

    for r in range(args.rounds):
        order = profiles if first == (r % 2 == 0) else profiles[::-1]
        if order[0] is not profiles[0]:
            pdx_round()
        for prof in order:
            log(f"{p.label}: {prof.name}")
            _profile_round(site, shape, prof, res[prof.name], args, log_dir, 100 * r, log)
        if order[0] is profiles[0]:
            pdx_round()
    return _path_rows(shape, p, profiles, res, pdx, pdx_cc, args.tokens)


def _path_rows(
    shape: KvShape,
    p: WanPath,
    profiles: list[Profile],
    res: dict[str, Any],
    pdx: dict[int, list[float]],
    pdx_cc: set[str],
    tokens: list[int],
) -> list[dict[str, Any]]:
    rows = []
    for t in tokens:
        row: dict[str, Any] = {
            "path": p.label,
            "rtt_ms": p.rtt_ms,
            "loss": p.loss,
            "tokens": t,
            "bytes": shape.object_bytes(t),
            "descriptors": shape.blocks(t) * shape.layers,
        }
        for prof in profiles:
            mine = res[prof.name]
            n = row[prof.name] = {**_summarise_nixl(mine["nixl"][t]), "cc": prof.cc}
            streams = n.get("streams")
            n.update(
                {
                    "iperf3_n_gbps": _median(mine["iperf3_n"][t]),
                    "iperf3_steady_gbps": _median(mine["steady"].get(streams, [])),
                    "iperf3_steady_1_stream_gbps": _median(mine["steady1"]),
                    "iperf3_cc": sorted(str(c) for c in mine["iperf3_cc"]),
                    "skipped_predicted_s": mine["skipped"].get(t),
                }
            )
            n["cold_vs_iperf3_n"] = _ratio(n.get("cold_gbps"), n["iperf3_n_gbps"])
            n["warm_vs_iperf3_steady"] = _ratio(n.get("warm_gbps"), n["iperf3_steady_gbps"])
        ref = row[profiles[-1].name]["iperf3_steady_1_stream_gbps"]
        row["pdx"] = {
            "get_gbps": _median(pdx[t]),
            "cc": sorted(pdx_cc),
            "streams": 1,
            "vs_iperf3_steady_1_stream": _ratio(_median(pdx[t]), ref),
        }
        row["label"] = _label(row, profiles)
        rows.append(row)
    return rows


def _label(row: dict[str, Any], profiles: list[Profile]) -> str:
    """Computed from the ratios: does NIXL match iperf3 (same settings, same number of
    connections), and how much of the link does it get (iperf3's best steady rate)?"""
    link = max(row[p.name]["iperf3_steady_gbps"] or 0 for p in profiles) or None
    parts = []
    for prof in profiles:
        n = row[prof.name]
        if n.get("warm_gbps") is None:
            parts.append(f"{prof.name}: not measured (~{n['skipped_predicted_s']} s a transfer)")
            continue
        x = n["warm_vs_iperf3_steady"]
        word = "?" if x is None else ("on par with" if x >= ON_PAR else "below")
        parts.append(
            f"{prof.name}: warm {word} iperf3 -P {n['streams']} ({_f(x, '.2f')}x), "
            f"{_f(_ratio(n['warm_gbps'], link), '.2f')}x of the link"
        )
    return "; ".join(parts)


# --- output --------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def print_ucx(ucx: dict[str, Any], probes: dict[str, Any]) -> None:
    """What the bundled UCX makes of the candidate variables, and the READ protocol it picks."""
    d, st = ucx["defaults"], ucx["as_set"]
    print(
        f"\nUCX bundled with nixl-cu12: {d.get('version', d.get('error'))} (config as "
        f"ucx_info -c prints it: default -> parsed value with the candidates set)"
    )
    for key, value in d.get("values", {}).items():
        print(f"  {key:<22} {value} -> {st.get('values', {}).get(key, '?')}")
    for name, pr in probes.items():
        print(f"  UCX_PROTO_INFO, READ, with {name}:")
        for title, rows in pr["get"].items() or [("(no ucp_get table printed)", [])]:
            print(f"    {title}: {'; '.join(rows)}")
        for w in pr["warnings"]:
            print(f"    UCX warning: {w}")


def print_sweep(sw: dict[str, Any]) -> None:
    """Every sweep measurement, then each candidate's gains and whether it was kept."""
    print("\nSweep, greedy: each candidate on top of the best profile so far (Gbit/s)")
    fmt = "{:<58} {:<22} {:>5} {:>6} {:>6} {:>6} {:>6} {:>3} {:>9} {:>8}"
    print(
        fmt.format("step", "path", "tok", "cold", "warm", "idle", "cc", "P", "sndbuf", "CPU-s/GB")
    )
    for r in sw["rows"]:
        print(
            fmt.format(
                r["step"],
                r["path"],
                r["tokens"],
                _f(r["cold_gbps"]),
                _f(r["warm_gbps"]),
                _f(r["idle_gbps"]),
                ",".join(r["cc_seen"]),
                r["streams"],
                r["sndbuf_seen"] or "-",
                _f(r["cpu_s_per_gb"], ".1f"),
            )
        )
    print(
        f"default's drift between its two runs (geometric mean of cold/warm/idle): "
        f"{sw['drift']}; gain needed per path, d: {sw['adopt_gain']}"
    )
    print(
        "rule: keep a candidate when its gain (geometric mean over cold, warm, idle, against "
        "the profile it was added to) is >= 1 + d at some path and >= 1 / (1 + d) at all"
    )
    for st in sw["steps"]:
        verdict = (
            "kept" if st["adopted"] else ("passes, rival kept" if st["passes"] else "not kept")
        )
        print(f"  {st['candidate']:<34} gain {st['gain']} -> {verdict}")


def _nixl_cell(n: dict[str, Any]) -> str:
    if n.get("warm_gbps") is None:
        return f"skip (~{n['skipped_predicted_s']} s)"
    return "/".join(_f(n.get(k), ".2f") for k in ("cold_gbps", "warm_gbps", "idle_gbps"))


def print_table(rows: list[dict[str, Any]], profiles: list[Profile]) -> None:
    """Rows = (path, tokens); NIXL default and recommended, iperf3 per profile, pdx."""
    d, r = profiles[0].name, profiles[-1].name
    print(
        "\nGbit/s prefill → decode. NIXL cold/warm/idle and P, the TCP connections its data "
        "took; iperf3 with -P P under the same profile's sysctls: -n SIZE (fresh connections) "
        "and -t 2 (steady); d = default, r = recommended. pdx Get (warm, one stream) under r. "
        "Ratios: NIXL cold / iperf3 -n, NIXL warm / iperf3 steady, pdx / iperf3 -P 1 steady (r)."
    )
    fmt = "{:<22} {:>5} {:>4} {:>16} {:>16} {:>5} {:>11} {:>11} {:>6} {:>6} {:>11} {:>11} {:>6}"
    print(
        fmt.format(
            "path",
            "tok",
            "MiB",
            f"NIXL {d}",
            f"NIXL {r}",
            "P",
            "iperf3 -n",
            "steady",
            "1-str",
            "pdx",
            "d c/n w/st",
            "r c/n w/st",
            "pdx/1",
        )
    )
    print(fmt.format("", "", "", "c/w/i", "c/w/i", "d/r", "d/r", "d/r", "r", "", "", "", ""))
    for row in rows:
        a, b = row[d], row[r]
        print(
            fmt.format(
                row["path"],
                row["tokens"],
                row["bytes"] >> 20,
                _nixl_cell(a),
                _nixl_cell(b),
                f"{a.get('streams', '-')}/{b.get('streams', '-')}",
                f"{_f(a['iperf3_n_gbps'], '.2f')}/{_f(b['iperf3_n_gbps'], '.2f')}",
                f"{_f(a['iperf3_steady_gbps'], '.2f')}/{_f(b['iperf3_steady_gbps'], '.2f')}",
                _f(b["iperf3_steady_1_stream_gbps"], ".2f"),
                _f(row["pdx"]["get_gbps"], ".2f"),
                f"{_f(a['cold_vs_iperf3_n'], '.2f')} {_f(a['warm_vs_iperf3_steady'], '.2f')}",
                f"{_f(b['cold_vs_iperf3_n'], '.2f')} {_f(b['warm_vs_iperf3_steady'], '.2f')}",
                _f(row["pdx"]["vs_iperf3_steady_1_stream"], ".2f"),
            )
        )
        ccs = [f"NIXL {row[x].get('cc_seen', '-')}" for x in dict.fromkeys((d, r))]
        posted = b.get("posted_descs") or a.get("posted_descs")
        print(
            f"{'':<22} {row['label']}\n{'':<22} {', '.join(ccs)}; iperf3 {a['iperf3_cc']}/"
            f"{b['iperf3_cc']}; pdx {row['pdx']['cc']}; {posted} of {row['descriptors']} "
            "descriptors posted"
        )


def paste_block(adopted: list[Profile], buf_bytes: int) -> str:
    """The adopted settings as a user pastes them: env for vLLM, sysctls for both hosts."""
    env = {k: v for p in adopted for k, v in p.ucx.items()}
    ctl = {k: v for p in adopted for k, v in p.sysctl.items()}
    lines = [
        "# vLLM prefill and decode instances (environment), NIXL over UCX/TCP:",
        "export UCX_TLS=tcp,self  # as measured; also UCX_NET_DEVICES=<WAN iface>",
    ]
    lines += [f"export {k}={v}" for k, v in env.items()]
    if "UCX_TCP_SNDBUF" in env:
        lines.append(
            f"# UCX_TCP_SNDBUF/RCVBUF are capped by net.core.wmem_max/rmem_max "
            f"(host-wide): sysctl -w net.core.wmem_max={buf_bytes} "
            f"net.core.rmem_max={buf_bytes}"
        )
    lines.append("# both hosts (prefill site and decode site):")
    lines += [f'sysctl -w {k}="{v}"' for k, v in ctl.items()]
    if not env and not ctl:
        lines.append("# nothing measured beat the defaults by the adoption rule")
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------


def _preflight(cc: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces)"
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} missing (the venv with vllm and NIXL)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import nixl._api"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        return f"NIXL does not import in .venv-vllm: {probe.stderr.strip()[-200:]}"
    for tool in ("ip", "ss", "sysctl"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found"
    have = _run(["sysctl", "-n", "net.ipv4.tcp_available_congestion_control"]).split()
    if cc not in have or "bbr" not in have:
        return f"the kernel offers congestion controls {have}; needs {cc} and bbr"
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line of the benchmark."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rtt", type=float, nargs="+", default=[10, 40, 80])
    ap.add_argument("--loss-rtt", type=float, default=40)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2, help="warm transfers per round (median)")
    ap.add_argument("--idle-s", type=float, default=1.5, help="silence before the idle transfer")
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--sweep-tokens", type=int, default=1024)
    ap.add_argument(
        "--max-transfer-s",
        type=float,
        default=15,
        help="skip objects one transfer of which would take longer at iperf3's steady rate",
    )
    ap.add_argument("--num-threads", type=int, default=4, help="nixl_agent_config (vLLM: 4)")
    ap.add_argument("--no-progress-thread", dest="progress_thread", action="store_false")
    ap.add_argument("--default-cc", default="cubic", help="congestion control of 'default'")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the report")
    ap.add_argument("--json-out", type=Path, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    if args.kv_bytes_per_token % args.layers or min(args.tokens) < 1 or args.rounds < 1:
        ap.error("--kv-bytes-per-token must split evenly over --layers; tokens, rounds >= 1")
    bdp_bytes = CAP_MBIT * 1e6 / 8 * max(*args.rtt, args.loss_rtt) / 1e3
    args.buf_bytes = 1 << math.ceil(math.log2(2 * bdp_bytes))
    args.candidates = candidates(args.buf_bytes)
    return args


def main() -> None:
    """Run the checks, the sweep and the table; print them (or JSON) and the settings."""
    if "--agent" in sys.argv:
        agent_main(sys.argv[1:])
        return
    args = parse_args(sys.argv[1:])
    why = _preflight(args.default_cc)
    if why is None:
        sys.path.insert(0, str(SCRIPT.parent))
        from bench_transfer import ensure_iperf3

        why = None if ensure_iperf3() else "iperf3 not available"
    if why:
        print(f"bench_nixl: {why}", file=sys.stderr)
        sys.exit(2)
    from pdx.faults import netns

    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    topo = netns.make_config(prefix=PREFIX, emulator="userspace", rate_mbit=CAP_MBIT, seed=5)
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-nixl-")))
        netns.down(topo)  # leftovers of an interrupted run
        stack.callback(netns.down, topo)
        netns.up(topo)
        host_change = allow_congestion_controls([args.default_cc, "bbr"], stack, log)
        result = run_all(Site(topo), args, log_dir, stack, log)
        result["host_change"] = host_change
    result["elapsed_s"] = round(time.monotonic() - t0)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, default=sorted))
    emit(result, args)


def allow_congestion_controls(
    names: list[str], stack: contextlib.ExitStack, log: Any
) -> str | None:
    """A namespace may only default to a congestion control the host allows to everyone
    (``tcp_allowed_congestion_control``, host-wide): add the missing ones until the end."""
    key = "net.ipv4.tcp_allowed_congestion_control"
    before = _run(["sysctl", "-n", key]).split()
    missing = [n for n in names if n not in before]
    if not missing:
        return None
    _run(["sysctl", "-qw", f"{key}={' '.join(before + missing)}"])
    stack.callback(_run, ["sysctl", "-qw", f"{key}={' '.join(before)}"])
    change = f"{key}: {' '.join(before)} -> {' '.join(before + missing)} (restored at the end)"
    log(change)
    return change


def run_all(
    site: Site, args: argparse.Namespace, log_dir: Path, stack: contextlib.ExitStack, log: Any
) -> dict[str, Any]:
    """UCX checks, the sweep, then every path with default and recommended, and pdx."""
    shape = KvShape(args.kv_bytes_per_token, args.layers, args.block_tokens)
    host = {
        k: " ".join(_run(["sysctl", "-n", k]).split())
        for k in (CC, SSAI, WMEM, RMEM, "net.core.wmem_max", "net.core.rmem_max")
    }
    default = Profile(
        "default",
        sysctl={
            CC: args.default_cc,
            SSAI: "1",
            WMEM: site.read_sysctl(WMEM),
            RMEM: site.read_sysctl(RMEM),
        },
    )
    every_ucx = {k: v for c in [*args.candidates, *PROTO_ONLY] for k, v in c.ucx.items()}
    ucx = {"defaults": ucx_config(UCX_BASE), "as_set": ucx_config({**UCX_BASE, **every_ucx})}
    set_path(site, WanPath(min(args.rtt)))
    site.apply(default.sysctl)
    probes = {}
    seg = [c for c in args.candidates if "UCX_TCP_TX_SEG_SIZE" in c.ucx]
    for prof in [default, *seg, *PROTO_ONLY]:
        log(f"UCX_PROTO_INFO probe: {prof.name}")
        probes[prof.name] = proto_probe(site, shape, default.plus(prof, prof.name), args, log_dir)
    sweep_paths = [WanPath(max(args.rtt)), WanPath(args.loss_rtt, LOSS)]
    sw = Sweep(site, shape, sweep_paths, args, log_dir, log).run(default)
    adopted = sw.pop("adopted_profiles")
    rec = Profile("recommended", dict(default.ucx), dict(default.sysctl))
    for c in adopted:
        rec = rec.plus(c, "recommended")
    profiles = [default, rec] if adopted else [default]  # nothing adopted: one profile
    store = PdxStore(site, log_dir)
    stack.callback(store.stop)
    paths = [WanPath(rtt) for rtt in args.rtt] + [WanPath(args.loss_rtt, LOSS)]
    rows: list[dict[str, Any]] = []
    for k, p in enumerate(paths):
        rows += measure_path(site, shape, p, profiles, store, args, log_dir, k % 2 == 0, log)
    return {
        "shape": {
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "layers": shape.layers,
            "block_tokens": shape.block_tokens,
            "descriptor_bytes": shape.block_bytes,
        },
        "cap_mbit": CAP_MBIT,
        "host_sysctls": host,
        "ucx": ucx,
        "proto_probes": probes,
        "profiles": {p.name: {"ucx": {**UCX_BASE, **p.ucx}, "sysctl": p.sysctl} for p in profiles},
        "sweep": sw,
        "rows": rows,
        "rounds": args.rounds,
        "warm": args.warm,
        "idle_s": args.idle_s,
        "num_threads": args.num_threads,
        "progress_thread": args.progress_thread,
        "paste": paste_block(adopted, args.buf_bytes),
    }


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """JSON, or the human report: UCX checks, sweep, table, the settings block."""
    if args.json:
        print(json.dumps(result, indent=2, default=sorted))
        return
    profiles = [Profile(n, v["ucx"], v["sysctl"]) for n, v in result["profiles"].items()]
    print(f"host sysctls (outside the namespaces): {result['host_sysctls']}")
    print_ucx(result["ucx"], result["proto_probes"])
    print_sweep(result["sweep"])
    for p in profiles:
        print(f"profile {p.name}: sysctls {p.sysctl}; UCX env {p.ucx}")
    print_table(result["rows"], profiles)
    print("\nRecommended settings (adopted by the sweep's rule, measured above):\n")
    print(result["paste"])


if __name__ == "__main__":
    main()
