"""Real thin links for the benchmarks: a bridge on the host and, per site (a learner), a network namespace
joined to it by a veth pair whose two ends are shaped with tbf at the cap, so a site's bytes cross a real
bottleneck.

Contract: `LinkNet(num_sites, mb_s)` is a context manager; on entry it refuses with LinksUnavailable (one
line) when the process lacks CAP_NET_ADMIN or `ip`/`tc`, then builds everything under names starting with
PREFIX and addresses in one /24 of the benchmarking range 198.18.0.0/15 (RFC 2544) only; on exit — normal, an
exception, or SIGINT/SIGTERM (turned into an exception in the main thread while it is up) — it removes every
namespace, veth and bridge it made; a process a signal did not end within SIGNAL_GRACE_S (its exception
lost) removes them and exits by itself. A forked child joins site i with `enter(i)` (setns) before it opens a
socket; only the creating process ever tears down. A harness whose owner was killed outright (SIGKILL) is
swept by the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from diloco.configs import ConfigError
from diloco.run.lease import pid_alive

PREFIX = "dlc"  # every interface and namespace this module makes starts with it
STATE_DIR = Path("/run/diloco-links")  # one file per live harness: its owner's pid and names (for the sweep)
CAP_NET_ADMIN = 12  # bit in /proc/self/status CapEff
CLONE_NEWNET = 0x40000000
HOST = 1  # the host's address on the bridge is .1 of the harness's /24; site i is .(i + 2)
MTU_BYTES = 1514  # an Ethernet frame at MTU 1500: tbf's bucket must hold one
# tbf's queue: packets waiting longer than this are dropped (a router buffer; TCP backs off on the drops)
QUEUE_S = 0.2
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# a signal's exception can be lost (raised while a finalizer runs, where Python prints and ignores it, or
# taken by code that catches everything): a process still up this long after a signal removes its links, ends
# its helpers and exits by itself (128 + the signal)
SIGNAL_GRACE_S = 10.0


class LinksUnavailable(ConfigError):
    """Real links cannot be built here (no privilege, no tools); the message says what to do instead."""


def has_net_admin() -> bool:
    """Whether this process holds CAP_NET_ADMIN (effective)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return False


def check_privilege() -> None:
    """LinksUnavailable unless the process can make namespaces, veths and qdiscs."""
    if not has_net_admin():
        raise LinksUnavailable("--links real needs CAP_NET_ADMIN (run as root, or use --links modelled)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinksUnavailable(f"--links real needs {' and '.join(missing)} (iproute2); or use --links "
                               "modelled")


def _run(*args: str, check: bool = True) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def tbf_args(mb_s: float) -> list[str]:
    """tc arguments of a tbf at `mb_s` MB/s (10^6 bytes): its bucket one frame or 4 ms of the rate, its queue
    QUEUE_S of the rate (at least a few frames)."""
    rate = mb_s * 1e6
    burst = max(MTU_BYTES, int(rate * 0.004))
    limit = max(4 * MTU_BYTES, int(rate * QUEUE_S))
    return ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst), "limit", str(limit)]


@dataclass(frozen=True)
class Site:
    """One site: its namespace, its veth ends (host side on the bridge, the other inside), its address."""

    index: int
    netns: str
    host_if: str
    inner_if: str
    addr: str


def _used_subnets() -> set[int]:
    """The third octets of 198.18.x.0/24 (x 0-255) and 198.19.x.0/24 (x 256-511) already on this host."""
    used = set()
    for word in _run("ip", "-4", "-o", "addr", "show").split():
        if word.startswith(("198.18.", "198.19.")):
            second, third = word.split(".")[1:3]
            used.add((int(second) - 18) * 256 + int(third))
    return used


class LinkNet:
    """The bridge `<PREFIX><tag>b` with the host at .1 (where the S3 server and the merger listen), and
    `num_sites` sites, each `<PREFIX>-<tag>-<i>` with veth `<PREFIX><tag>h<i>` (host) /
    `<PREFIX><tag>n<i>`."""

    def __init__(self, num_sites: int, mb_s: float | None, tag: str | None = None) -> None:
        if not 1 <= num_sites <= 200:
            raise ConfigError(f"real links: 1 to 200 sites, got {num_sites}")
        if mb_s is not None and mb_s <= 0:
            raise ConfigError(f"real links: the cap must be > 0 MB/s, got {mb_s}")
        self.num_sites, self.mb_s = num_sites, mb_s
        self.tag = tag or f"{random.randrange(16 ** 4):04x}"
        self.bridge = f"{PREFIX}{self.tag}b"
        self.sites: list[Site] = []
        self.host_addr = ""
        self._owner = os.getpid()
        self._old_handlers: dict[int, object] = {}
        self._lock = threading.Lock()  # cuts from a timer thread against teardown
        self._critical, self._pending = 0, 0  # a signal during a build or teardown waits for its end
        self._helpers: tuple[tuple[int, float], ...] = ()  # (pid, start time): the S3 server
        self._watchdog: threading.Thread | None = None  # started by the first signal

    # --- life ---
    def __enter__(self) -> LinkNet:
        check_privilege()
        sweep_stale()
        self._catch_signals()
        try:
            with self._held_signals():
                self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        free = sorted(set(range(512)) - _used_subnets())
        if not free:
            raise LinksUnavailable("real links: no free /24 left in 198.18.0.0/15")
        n = random.choice(free)
        net = f"198.{18 + n // 256}.{n % 256}"
        self.host_addr = f"{net}.{HOST}"
        self.sites = [Site(i, f"{PREFIX}-{self.tag}-{i}", f"{PREFIX}{self.tag}h{i}",
                           f"{PREFIX}{self.tag}n{i}", f"{net}.{i + HOST + 1}") for i in range(self.num_sites)]
        self._record()  # before the first name exists: a SIGKILL from here on is swept by the next harness
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _ipv6_off(self.bridge)
        _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for site in self.sites:
            _run("ip", "netns", "add", site.netns)
            _run("ip", "netns", "exec", site.netns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                 "net.ipv6.conf.default.disable_ipv6=1")
            _run("ip", "link", "add", site.host_if, "type", "veth", "peer", "name", site.inner_if, "netns",
                 site.netns)
            _ipv6_off(site.host_if)
            _run("ip", "link", "set", site.host_if, "master", self.bridge, "up")
            _run("ip", "-n", site.netns, "addr", "add", f"{site.addr}/24", "dev", site.inner_if)
            _run("ip", "-n", site.netns, "link", "set", site.inner_if, "up")
            _run("ip", "-n", site.netns, "link", "set", "lo", "up")
        self.set_rate(self.mb_s)

    def close(self) -> None:
        """Remove every veth, namespace and the bridge (what is already gone is skipped); only in the
        owner."""
        if os.getpid() != self._owner:
            return
        self._critical += 1
        try:
            self._remove()
        finally:
            self._critical -= 1
        self._restore_signals()
        if self._pending:
            self._raise(self._pending)

    def _remove(self) -> None:
        """Every name this harness made, and its record (the sweep's)."""
        with self._lock:
            _teardown(self.bridge, self.sites)
            (STATE_DIR / self.tag).unlink(missing_ok=True)

    def _record(self, helpers: tuple[tuple[int, float], ...] = ()) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        names = [self.bridge] + [f"{s.netns} {s.host_if}" for s in self.sites] \
            + [f"pid {p} {started!r}" for p, started in helpers]
        (STATE_DIR / self.tag).write_text(f"{os.getpid()}\n" + "\n".join(names) + "\n")

    def adopt(self, pid: int) -> None:
        """A helper process of this harness (the S3 server): the sweep ends it if the owner was killed
        outright."""
        self._helpers = (*self._helpers, (pid, _start_time(pid)))
        self._record(self._helpers)

    def _catch_signals(self) -> None:
        """SIGTERM / SIGHUP raise SystemExit (SIGINT: KeyboardInterrupt) in the main thread, so `with` tears
        down."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._watchdog is None and os.getpid() == self._owner:  # a forked child never tears down
            self._watchdog = threading.Thread(target=self._last_resort, args=(signum,), daemon=True,
                                              name="links-signal-watchdog")
            self._watchdog.start()
        if self._critical:
            self._pending = signum
            return
        self._raise(signum)

    def _last_resort(self, signum: int) -> None:
        """The watchdog a signal starts: SIGNAL_GRACE_S later, a process still running tears down and exits
        (the daemon thread dies with a process that ended in time)."""
        time.sleep(SIGNAL_GRACE_S)
        try:
            self._remove()
            for pid, started in self._helpers:
                _end_helper(pid, started)
        finally:
            os._exit(128 + signum)

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def _held_signals(self):
        """A signal that comes while names are made waits until they all exist (then `with` removes them)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self._pending and not self._critical:
            self._raise(self._pending)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    # --- use ---
    def set_rate(self, mb_s: float | None) -> None:
        """Shape both ends of every site's veth at `mb_s` MB/s each way (None: unshaped)."""
        self.mb_s = mb_s
        for site in self.sites:
            for ns, dev in ((None, site.host_if), (site.netns, site.inner_if)):
                where = ["-n", ns] if ns else []
                if mb_s is None:
                    _run("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _run("tc", *where, "qdisc", "replace", "dev", dev, "root", *tbf_args(mb_s))

    def counters(self) -> list[dict[str, int]]:
        """Per site, the bytes (whole frames, as the kernel counted them) it sent and received so far: its
        host-side veth's rx and tx."""
        out = []
        for site in self.sites:
            stats = Path(f"/sys/class/net/{site.host_if}/statistics")
            out.append({"sent": int((stats / "rx_bytes").read_text()),
                        "received": int((stats / "tx_bytes").read_text()),
                        "packets_sent": int((stats / "rx_packets").read_text()),
                        "packets_received": int((stats / "tx_packets").read_text())})
        return out

    def set_up(self, index: int, up: bool) -> None:
        """Site `index`'s link down (its host end down: the cable pulled) or up again."""
        with self._lock:
            _run("ip", "link", "set", self.sites[index].host_if, "up" if up else "down")

    def cut(self, index: int, down_s: float, at_s: float = 0.0) -> threading.Thread:
        """In a thread: after `at_s`, site `index`'s link down for `down_s` seconds, then up again. The
        thread's `times` holds (down at, up at) in time.time()."""
        def run() -> None:
            time.sleep(at_s)
            started = time.time()
            self.set_up(index, False)
            time.sleep(down_s)
            self.set_up(index, True)
            thread.times = (started, time.time())  # type: ignore[attr-defined]

        thread = threading.Thread(target=run, name=f"cut-{index}", daemon=True)
        thread.times = None  # type: ignore[attr-defined]
        thread.start()
        return thread

    def enter(self, index: int) -> None:
        """Move the calling process (a freshly forked child, before any thread or socket) into site `index`;
        its signals go back to their defaults (a child stuck in a collective must still die of SIGTERM)."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        enter_netns(self.sites[index].netns)


def enter_netns(name: str) -> None:
    """setns(2) into the named network namespace (/run/netns/<name>)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _ipv6_off(dev: str) -> None:
    """No IPv6 on the link: its neighbour and router chatter would show in the byte counters."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")


def _teardown(bridge: str, sites: list[Site]) -> None:
    # deleting either end of a veth deletes both, even with processes left in the namespace
    for site in sites:
        # a child left in it (killed owner)
        for pid in _run("ip", "netns", "pids", site.netns, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "link", "del", site.host_if, check=False)
        _run("ip", "netns", "del", site.netns, check=False)
    _run("ip", "link", "del", bridge, check=False)


def sweep_stale() -> list[str]:
    """Remove the harnesses whose owner process is gone (killed outright); returns their tags."""
    swept = []
    for path in STATE_DIR.glob("*") if STATE_DIR.is_dir() else []:
        lines = path.read_text().split("\n")
        with contextlib.suppress(ValueError, IndexError):
            if pid_alive(int(lines[0])):
                continue
            rest = [line.split() for line in lines[2:] if line]
            for words in (w for w in rest if w[0] == "pid" and len(w) == 3):
                _end_helper(int(words[1]), float(words[2]))
            sites = [Site(i, *words, "", "") for i, words in enumerate(w for w in rest if w[0] != "pid")]
            _teardown(lines[1], sites)
        path.unlink(missing_ok=True)
        swept.append(path.name)
    return swept


def _start_time(pid: int) -> float:
    """When process `pid` started (psutil's create_time): with the pid, who it is (a pid is reused, the pair
    is not); -1 when it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return -1.0


def _end_helper(pid: int, started: float) -> None:
    """SIGKILL a helper left by a killed owner, if that pid is still the process it was (its start time)."""
    if started >= 0 and _start_time(pid) == started:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


