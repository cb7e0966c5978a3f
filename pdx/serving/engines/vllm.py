"""vLLM prefill and decode instances: model, ports, command line, environment, readiness.

:class:`VLLMEngines` is what the supervisor (``pdx deploy``) uses with ``engine: vllm``. For
each instance it fixes the ports once (a restart keeps them, so the gateway and the decode
side's cached NIXL peer addresses stay right), builds the command
``PYTHON -m vllm.entrypoints.openai.api_server --model DIR ... --kv-transfer-config {...}``
and the environment (NIXL side channel, ``UCX_TLS``, CPU pinning, the NIXL idle fix, no hub
access, no usage reporting), starts it in a process group of its own, and waits for
``GET /health``. With ``vllm.prefill_urls`` / ``decode_urls`` it starts nothing and only
describes the instances you run.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from pdx import procs
from pdx.errors import InputError, ServingError
from pdx.procs import group_members
from pdx.serving.deploy_config import DeployConfig, VLLMConfig, engine_model_config_json
from pdx.serving.engines.env import VLLMEnv, discover
from pdx.serving.engines.sites import free_ports, ucx_net_device

logger = logging.getLogger("pdx.deploy")
KV_CPUS_ENV = "PDX_VLLM_KV_CPUS"  # engine_hooks.KV_CPUS_ENV (that module never imports pdx)

Role = Literal["prefill", "decode"]
MODULE = "vllm.entrypoints.openai.api_server"
#: Head sizes vLLM's CPU attention backend computes (vllm/v1/attention/backends/cpu_attn.py);
#: anything else fails on the first request, not at start, so pdx checks it up front.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
#: The topic of the KV events of the decodes pdx starts (gateway.vllm_events follows it).
KV_EVENTS_TOPIC = "kv-events"


class ChildLike(Protocol):
    """The supervisor's view of one process (``pdx.serving.supervisor.Child``)."""

    role: str
    index: int
    proc: asyncio.subprocess.Process | None
    info: dict[str, Any]
    log_path: Path | None

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ..."""
        ...


class EngineStartError(ServingError):
    """An instance exited or did not answer ``/health`` in time (the message says which)."""


def kv_failures_path(audit_dir: Path, name: str) -> Path:
    """Where decode instance ``name`` records the requests whose KV load failed
    (``PDX_VLLM_KV_FAILURES``, see engine_hooks.py)."""
    return audit_dir / f"{name}.kv-load-failures.jsonl"


@dataclass
class Instance:
    """One vLLM server: where it listens and what it is given."""

    role: Role
    index: int
    host: str
    port: int
    side_channel_port: int
    cpus: list[int] = field(default_factory=list)
    gpu: int | None = None
    external_url: str | None = None
    #: The interface its KV traffic uses (``UCX_NET_DEVICES``; None: UCX's choice).
    ucx_net_device: str | None = None

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ..."""
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        """HTTP base URL (its ``/metrics`` is the engine's own)."""
        return self.external_url or f"http://{_url_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class ModelInfo:
    """The checkpoint the instances serve and what the gateway needs to know about it."""

    path: str
    served_name: str
    version: str
    max_context_tokens: int
    config: dict[str, Any]
    kv_dtype: str  # the KV element type vLLM keeps (measure-kv's name: bf16, fp16, fp32, fp8)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def resolve_model(v: VLLMConfig, cache_dir: Path) -> Path:
    """The checkpoint directory: a tiny preset exported once under ``cache_dir``, or yours."""
    from pdx.serving.backends.presets import TINY_PRESETS

    if v.model in TINY_PRESETS:
        from pdx.serving.engines.checkpoint import export_tiny_checkpoint

        return export_tiny_checkpoint(cache_dir, v.model)
    path = Path(v.model).expanduser()
    if not (path / "config.json").is_file():
        raise InputError(
            "vllm.model", v.model, f"a checkpoint directory with config.json or one of "
            f"{sorted(TINY_PRESETS)}",
        )  # fmt: skip
    return path.resolve()


def head_size(config: dict[str, Any]) -> int | None:
    """Attention head size from a config (``head_dim``, else hidden / heads)."""
    text = config.get("text_config") or config
    if text.get("head_dim"):
        return int(text["head_dim"])
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    return int(hidden) // int(heads) if heads and hidden else None


def check_model_for_device(config: dict[str, Any], device: str, model: str) -> None:
    """Refuse at start what the engine would only refuse at the first request."""
    size = head_size(config)
    if device == "cpu" and size is not None and size not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        raise InputError(
            "vllm.model", model,
            f"a model whose head size vLLM's CPU attention takes ({sizes}); this one has {size}",
        )  # fmt: skip


def kv_dtype(config: dict[str, Any], args: list[str]) -> str:
    """The KV element type vLLM will use: ``--kv-cache-dtype``, ``--dtype``, else the config's
    (vLLM serves float32 checkpoints in bfloat16: "Downcasting torch.float32 to bfloat16")."""
    names = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
             "float": "fp32", "bf16": "bf16", "fp16": "fp16"}  # fmt: skip
    cache = _flag(args, "--kv-cache-dtype")
    if cache and cache.startswith("fp8"):
        return "fp8"
    wanted = _flag(args, "--dtype")
    if wanted and wanted != "auto":
        return names.get(wanted, "bf16")
    text = config.get("text_config") or config
    declared = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "")
    return "fp16" if names.get(declared) == "fp16" else "bf16"


def _flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def model_info(cfg: DeployConfig, path: Path) -> ModelInfo:
    """Name, version, context and KV dtype of the served checkpoint."""
    v = cfg.vllm
    config = engine_model_config_json(str(path)) or {}
    stamp = path / "pdx-checkpoint.json"
    version = path.name
    if stamp.is_file():
        version = str(json.loads(stamp.read_text()).get("model_version", version))
    limit = int((config.get("text_config") or config).get("max_position_embeddings") or 2048)
    served = v.served_model_name or cfg.gateway.served_model_name or v.model.rstrip("/").split(
        "/")[-1]  # fmt: skip
    return ModelInfo(
        path=str(path), served_name=served, version=version,
        max_context_tokens=min(v.max_model_len or limit, limit), config=config,
        kv_dtype=kv_dtype(config, [*v.args, *v.decode_args]),
    )  # fmt: skip


class VLLMEngines:
    """The engine instances of one deployment, started and restarted by the supervisor."""

    def __init__(self, cfg: DeployConfig, work_dir: Path, cache_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.work_dir = work_dir
        self.cache_dir = cache_dir or Path.home() / ".cache" / "pdx" / "engines"
        self.env: VLLMEnv | None = None
        self.device = "cpu"
        self.model: ModelInfo | None = None
        self.instances: dict[str, Instance] = {}
        #: per instance: its process group and the segments it mapped, read once it was ready
        self.shm: dict[str, tuple[int, set[str]]] = {}
        self._tmp_root: Path | None = None  # instances' TMPDIRs when work_dir's are too long

    # --- set-up ------------------------------------------------------------------------

    def prepare(self) -> None:
        """Find the environment (unless fronting), the model, and every instance's ports."""
        v = self.cfg.vllm
        if not v.external:
            self.env = discover(v.python)
            self.device = _device(v.device, self.env)
        else:  # instances you run: what vllm.device says (auto: a GPU, as most are)
            self.device = "cuda" if v.device == "auto" else v.device
        path = resolve_model(v, self.cache_dir)
        self.model = model_info(self.cfg, path)
        check_model_for_device(self.model.config, self.device, v.model)
        if v.external:
            for role, urls in (("prefill", v.prefill_urls), ("decode", v.decode_urls)):
                for i, url in enumerate(urls):
                    inst = Instance(role, i, "", 0, 0, external_url=url)  # type: ignore[arg-type]
                    self.instances[inst.name] = inst
            return
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        roles: list[tuple[Role, int]] = [("prefill", i) for i in range(self.cfg.prefill.count)]
        roles += [("decode", i) for i in range(self.cfg.decode.count)]
        for k, (role, i) in enumerate(roles):
            self.instances[f"{role}-{i}"] = self._instance(role, i, k, cores)

    def _instance(self, role: Role, i: int, k: int, cores: list[int]) -> Instance:
        side = self.cfg.prefill if role == "prefill" else self.cfg.decode
        v = self.cfg.vllm
        # Asked for where the instance will listen: a namespace's address is not this one's.
        free = iter(free_ports(side.host, 2, side.netns))
        port = side.port + i if side.port else next(free)
        channel = v.side_channel_port + k if v.side_channel_port else next(free)
        cpus: list[int] = []
        if self.device == "cpu" and v.cpus_per_instance and cores:
            n = v.cpus_per_instance
            cpus = sorted({cores[(k * n + j) % len(cores)] for j in range(n)})
        gpu = k % self.env.gpus if self.device == "cuda" and self.env and self.env.gpus else None
        peer = None if role == "prefill" else self.cfg.prefill.host
        device = ucx_net_device(side.host, peer, side.netns)
        return Instance(role, i, side.host, port, channel, cpus, gpu, ucx_net_device=device)

    def children_roles(self) -> list[tuple[str, int]]:
        """(role, index) of every instance pdx starts (none when fronting)."""
        if self.cfg.vllm.external:
            return []
        return [(inst.role, inst.index) for inst in self.instances.values()]

    # --- one instance --------------------------------------------------------------------

    def argv(self, inst: Instance) -> list[str]:
        """The command that starts ``inst``."""
        assert self.env is not None and self.model is not None
        v = self.cfg.vllm
        kv = {"kv_connector": v.kv_connector, "kv_role": _ROLE[inst.role],
              "kv_buffer_device": self._buffer_device(),
              "kv_load_failure_policy": v.kv_load_failure_policy,
              "kv_connector_extra_config": {"kv_lease_duration": v.kv_lease_s}}  # fmt: skip
        argv = [self.env.python, "-m", MODULE, "--model", self.model.path,
                "--served-model-name", self.model.served_name, "--host", inst.host,
                "--port", str(inst.port), "--kv-transfer-config", json.dumps(kv),
                "--max-model-len", str(self.model.max_context_tokens),
                "--disable-uvicorn-access-log"]  # fmt: skip
        if v.kv_cache_bytes:
            argv += ["--kv-cache-memory-bytes", str(v.kv_cache_bytes)]
        if v.block_size:
            argv += ["--block-size", str(v.block_size)]
        if v.max_num_seqs:
            argv += ["--max-num-seqs", str(v.max_num_seqs)]
        if (events := self.kv_events_endpoint(inst)) is not None:
            conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                    "topic": KV_EVENTS_TOPIC}  # fmt: skip
            # the decode's own count of prompt tokens its caches supplied, in each usage
            argv += ["--kv-events-config", json.dumps(conf), "--enable-prompt-tokens-details"]
        argv += [*v.args, *(v.prefill_args if inst.role == "prefill" else v.decode_args)]
        netns = (self.cfg.prefill if inst.role == "prefill" else self.cfg.decode).netns
        return ["ip", "netns", "exec", netns, *argv] if netns else argv

    def kv_events_endpoint(self, inst: Instance) -> str | None:
        """Where decode ``inst`` publishes its KV events (None: it does not, or a prefill).

        An instance pdx starts binds a Unix socket in its own TMPDIR (the gateway runs on the
        same host; nothing listens on the network); one you run is where
        ``vllm.decode_kv_events`` says."""
        v = self.cfg.vllm
        if inst.role != "decode":
            return None
        if inst.external_url:
            return v.decode_kv_events[inst.index] if v.decode_kv_events else None
        return f"ipc://{self.instance_tmp(inst.name)}/kv-events" if v.kv_events else None

    def _buffer_device(self) -> str:
        chosen = self.cfg.vllm.kv_buffer_device
        return self.device if chosen == "auto" else chosen

    def environ(self, inst: Instance) -> dict[str, str]:
        """What the instance's process gets on top of this process's environment."""
        v = self.cfg.vllm
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": inst.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.side_channel_port),
            "PDX_NIXL_PROGRESS_DELAY_US": str(v.nixl_progress_delay_us),
            "PDX_VLLM_SHM_BUSY_LOOP_S": f"{v.shm_busy_loop_s:g}",
            "PDX_VLLM_SHM_RECHECK_MS": str(v.shm_recheck_ms),
            # The side channel's port changes nothing compiled: the next deployment, on
            # another free port, reuses this one's compiled model (engine_hooks.py).
            "PDX_VLLM_COMPILE_KEY_IGNORE": "VLLM_NIXL_SIDE_CHANNEL_PORT",
            # vLLM's bf16 attention uses AMX where the CPU has it without asking the kernel
            # for it: --enforce-eager then dies of SIGILL (engine_hooks.py)
            "PDX_VLLM_AMX": "1",
            # The checkpoint is local: never reach a hub, never report usage.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        tls = v.ucx_tls if v.ucx_tls != "auto" else ("tcp,self" if self.device == "cpu" else None)
        if tls:
            env["UCX_TLS"] = tls
        if inst.ucx_net_device:  # only the interface the other site routes to is offered
            env["UCX_NET_DEVICES"] = inst.ucx_net_device
        if inst.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, inst.cpus))
            # NIXL's worker would move itself to the machine's last core (engine_hooks.py)
            env[KV_CPUS_ENV] = env["VLLM_CPU_OMP_THREADS_BIND"]
        if inst.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(inst.gpu)
        if inst.role == "decode" and self.cfg.kv.audit_dir is not None:
            env["PDX_VLLM_KV_FAILURES"] = str(kv_failures_path(self.cfg.kv.audit_dir, inst.name))
        merged = {**env, **v.env}
        if "VLLM_CPU_OMP_THREADS_BIND" in v.env and KV_CPUS_ENV not in v.env:
            merged.pop(KV_CPUS_ENV, None)  # your own binding: pdx does not move NIXL's worker
        return merged

    async def spawn(self, child: ChildLike) -> None:
        """Start (or restart) the instance of ``child``; fill ``child.info`` once it is ready."""
        inst = self.instances[child.name]
        restart = child.proc is not None
        if restart:  # leftovers of the old process group go first
            await self._end_group(child)
        log_dir = self.cfg.vllm.log_dir or self.work_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.kv.audit_dir is not None:
            self.cfg.kv.audit_dir.mkdir(parents=True, exist_ok=True)
        child.log_path = log_dir / f"{child.name}.log"
        t0 = time.monotonic()
        v = self.cfg.vllm
        timeout = (
            min(v.ready_timeout_s, v.restart_ready_timeout_s) if restart else v.ready_timeout_s
        )
        for attempt in range(PORT_RETRIES + 1):
            with child.log_path.open("ab") as log:
                log_from = log.tell()
                child.proc = await asyncio.create_subprocess_exec(
                    *self.argv(inst), stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                    env={**os.environ, **self.tmp_environ(inst.name), **self.environ(inst)},
                    start_new_session=True,
                )  # fmt: skip
            try:
                await wait_healthy(inst.url, child.proc, timeout, child.log_path,
                                   ports=(inst.port, inst.side_channel_port),
                                   log_from=log_from)  # fmt: skip
                break
            except PortTakenError as exc:
                # A first start may move to other ports (nothing knows them yet); a restart
                # keeps its own, which the gateway and peers already use.
                fresh = (None if restart or attempt == PORT_RETRIES
                         else await asyncio.to_thread(self._new_ports, inst))  # fmt: skip
                if fresh is None:
                    raise
                logger.warning("%s: %s; starting it again on other ports", child.name, exc)
                await self._discard(child)
                inst = self.instances[child.name] = fresh
        assert child.proc is not None
        pid = child.proc.pid
        # read in a thread: the gateway shares this event loop, and vLLM's maps are long
        self.shm[child.name] = (pid, await asyncio.to_thread(group_shm, pid))
        child.info = {**self.describe(inst), "pid": pid,
                      "ready_after_s": round(time.monotonic() - t0, 1)}  # fmt: skip

    def _new_ports(self, inst: Instance) -> Instance | None:
        """``inst`` on freshly picked ports, but for those the config fixes; None when it
        fixes both."""
        side = self.cfg.prefill if inst.role == "prefill" else self.cfg.decode
        fixed_port, fixed_channel = bool(side.port), bool(self.cfg.vllm.side_channel_port)
        if fixed_port and fixed_channel:
            return None
        free = iter(free_ports(inst.host, 2, side.netns))
        return replace(inst, port=inst.port if fixed_port else next(free),
                       side_channel_port=(inst.side_channel_port if fixed_channel
                                          else next(free)))  # fmt: skip

    async def _discard(self, child: ChildLike) -> None:
        """Kill a start that failed and clear what its process group left (its segments are
        read first: a start that never got ready has none recorded)."""
        assert child.proc is not None
        pid = child.proc.pid
        self.shm[child.name] = (pid, await asyncio.to_thread(group_shm, pid))
        await self._end_group(child)

    async def _end_group(self, child: ChildLike) -> None:
        """Kill ``child``'s process group and clear what it left once it is gone, before the
        next instance starts: an engine worker tearing down its memory can take seconds, on
        cores the new instance is about to use."""
        assert child.proc is not None
        pid = child.proc.pid
        kill_group(pid)
        if not await group_gone(pid, GROUP_EXIT_WAIT_S):
            logger.warning("%s: processes of the old instance (group %d) still exiting after "
                           "%g s; starting the new one anyway", child.name, pid,
                           GROUP_EXIT_WAIT_S)  # fmt: skip
        await self.release_leftovers(child.name)

    async def release_leftovers(self, name: str) -> None:
        """What instance ``name``'s dead process group left in /dev/shm, unlinked (in a
        thread: every process's maps are read), and its TMPDIR removed."""
        pgid, names = self.shm.pop(name, (0, set()))
        gone = await asyncio.to_thread(release_shm, pgid, names) if pgid else []
        if gone:
            logger.info("%s: removed %d shared-memory segment(s) its killed processes left in "
                        "%s: %s", name, len(gone), SHM_DIR, ", ".join(gone))  # fmt: skip
        await asyncio.to_thread(shutil.rmtree, self.instance_tmp(name), ignore_errors=True)

    def instance_tmp(self, name: str) -> Path:
        """TMPDIR of instance ``name``: where vLLM puts its ZMQ sockets (one file per socket,
        never removed: 1,792 of them had piled up in /tmp here) and torch.distributed's
        rendezvous file. Under the work directory, or a directory of its own in the system's
        temporary directory where that path would be too long for a Unix socket's."""
        tmp = self.work_dir / "tmp" / name
        if len(os.fsencode(tmp)) + IPC_NAME_LEN > UNIX_PATH_MAX:
            if self._tmp_root is None:
                self._tmp_root = Path(tempfile.mkdtemp(prefix="pdx-vllm-"))
            tmp = self._tmp_root / name
        return tmp

    def tmp_environ(self, name: str) -> dict[str, str]:
        """TMPDIR for instance ``name`` (made now), and torch's compile cache kept where it
        was (``TORCHINDUCTOR_CACHE_DIR`` defaults to one under TMPDIR): both only for an
        instance this deployment starts on this host."""
        tmp = self.instance_tmp(name)
        tmp.mkdir(parents=True, exist_ok=True)
        env = {"TMPDIR": str(tmp)}
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            try:  # torch's own rule for that default
                user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
            except (KeyError, OSError):
                user = f"uid_{os.getuid()}"
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                          f"torchinductor_{user}")  # fmt: skip
        return env

    def close(self) -> None:
        """Remove what the instances' TMPDIRs were made in (once every instance stopped)."""
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None

    def describe(self, inst: Instance) -> dict[str, Any]:
        """The instance as ``pdx deploy --json`` lists it."""
        assert self.model is not None
        out: dict[str, Any] = {"name": inst.name, "engine": "vllm", "url": inst.url,
                               "model_path": self.model.path,
                               "external": bool(inst.external_url)}  # fmt: skip
        if not inst.external_url:
            out.update(host=inst.host, port=inst.port, cpus=inst.cpus, gpu=inst.gpu,
                       nixl_side_channel=f"{inst.host}:{inst.side_channel_port}",
                       ucx_net_devices=inst.ucx_net_device)  # fmt: skip
            if inst.role == "prefill":  # where decode pulls the KV from (the KV link's end)
                out["kv_endpoint"] = out["nixl_side_channel"]
        if (events := self.kv_events_endpoint(inst)) is not None:
            out["kv_events"] = events  # what the gateway follows (docs/deploy.md)
        return out

    def model_dict(self) -> dict[str, Any]:
        """``model`` of the endpoints JSON."""
        assert self.model is not None
        env = self.env.as_dict() if self.env else None
        return {"engine": "vllm", "model": self.model.served_name, "model_path": self.model.path,
                "model_version": self.model.version, "synthetic": False,
                "max_context_tokens": self.model.max_context_tokens,
                "kv_dtype": self.model.kv_dtype, "device": self.device,
                "block_size": self.block_size, "environment": env}  # fmt: skip

    @property
    def block_size(self) -> int:
        """The engine's KV block size in tokens (``vllm.block_size`` or vLLM's default)."""
        from pdx.kv.engines import vllm_block_size

        return vllm_block_size(self.cfg.vllm.block_size, "cpu" if self.device == "cpu" else "gpu")


def _device(choice: str, env: VLLMEnv) -> str:
    if choice == "auto":
        return "cuda" if env.gpus else "cpu"
    return choice


GROUP_EXIT_WAIT_S = 60.0
#: A Unix socket's path holds 107 bytes; vLLM names its sockets <TMPDIR>/<uuid4>.
UNIX_PATH_MAX, IPC_NAME_LEN = 107, 37
#: Starts of one instance on fresh ports after a port it was given was taken meanwhile.
PORT_RETRIES = 2
SHM_DIR = Path("/dev/shm")
# Python's multiprocessing.shared_memory names its segments psm_*: vLLM's processes create
# theirs so, for their own use. Other files a vLLM process maps in /dev/shm (UCX's, say) may
# be a peer's, and are never touched.
SHM_PREFIXES = ("psm_",)


def _mapped_shm(pids: list[int] | None = None) -> set[str]:
    """multiprocessing's segments in /dev/shm (SHM_PREFIXES) that ``pids`` (every process:
    None) have mapped."""
    names: set[str] = set()
    for pid in procs.pids() if pids is None else pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    at = line.find(f" {SHM_DIR}/")
                    name = line[at + len(str(SHM_DIR)) + 2 :].rstrip("\n") if at >= 0 else ""
                    if name.startswith(SHM_PREFIXES) and not name.endswith("(deleted)"):
                        names.add(name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return names


def group_shm(pgid: int) -> set[str]:
    """The multiprocessing segments process group ``pgid`` has mapped now."""
    return _mapped_shm(group_members(pgid))


def release_shm(pgid: int, names: set[str]) -> list[str]:
    """Unlink the segments ``names`` that a dead process group left in /dev/shm.

    A process killed with SIGKILL (a crash, a fault step, a stop past its grace) never
    unlinks its segments, nor does its resource tracker, killed with it: each killed vLLM
    instance left two (160 and 240 MiB, sparse) behind. Only once no process of the group
    lives, and only a segment no live process maps; the names unlinked."""
    if not names or group_members(pgid):
        return []
    left = {n for n in names if (SHM_DIR / n).exists()}
    gone = []
    for name in sorted(left - _mapped_shm()) if left else []:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
            gone.append(name)
    return gone


async def group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until process group ``pgid`` has no live process; False when time ran out."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal a process group this deployment started; False when it is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class PortTakenError(EngineStartError):
    """An instance could not bind a port picked for it: something took it in between."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


class _LogWatch:
    """What an instance's log says past ``offset``, read a little at a time (the log is
    appended to across restarts, and vLLM's grows long)."""

    def __init__(self, path: Path | None, offset: int, ports: tuple[int, ...]) -> None:
        self.path, self.offset, self.rest = path, offset, b""
        self.taken = [(p, re.compile(rf"(?<![0-9]){p}(?![0-9])".encode())) for p in ports if p]

    def port_taken(self) -> tuple[int, str] | None:
        """(port, line) of a failed bind of one of ``ports`` since the last look, or None."""
        if self.path is None or not self.taken:
            return None
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)
        except OSError:
            return None
        self.offset += len(data)
        # progress bars redraw with \r and no \n: a line is kept to its last 4 KiB
        *lines, rest = re.split(rb"[\r\n]", self.rest + data)
        self.rest = rest[-4096:]
        for line in lines:
            if b"already in use" not in line.lower():
                continue
            for port, pattern in self.taken:
                if pattern.search(line):
                    return port, line.decode(errors="replace").strip()[-200:]
        return None


async def wait_healthy(
    url: str,
    proc: asyncio.subprocess.Process | None,
    timeout_s: float,
    log: Path | None = None,
    *,
    ports: tuple[int, ...] = (),
    log_from: int = 0,
) -> None:
    """Poll ``url/health`` until 200; EngineStartError when ``proc`` exits or time runs out,
    PortTakenError as soon as the log past ``log_from`` says one of ``ports`` was in use (a
    server whose listener thread died of it may never answer, nor exit)."""
    import aiohttp

    t0 = time.monotonic()
    watch = _LogWatch(log, log_from, ports)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - t0 < timeout_s:
            if proc is not None and proc.returncode is not None:
                raise EngineStartError(
                    f"{url} exited with {proc.returncode} before it was ready: {_tail(log)}"
                )
            taken = watch.port_taken()
            if taken is not None:
                raise PortTakenError(f"{url}: port {taken[0]} was taken before the instance "
                                     f"bound it: {taken[1]}", taken[0])  # fmt: skip
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise EngineStartError(f"{url} not healthy within {timeout_s:g} s: {_tail(log)}")


def _tail(path: Path | None, lines: int = 3) -> str:
    if path is None or not path.is_file():
        return "(no log)"
    text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(line[-200:] for line in text[-lines:]) or "(empty log)"
