"""The real-link harness (diloco/bench/links.py): a capped veth link carries a site's bytes and the kernel counts
them; a cut link is down, then up; nothing is left behind — on exit, on error, and when its owner is killed
outright (the next harness sweeps it); without
CAP_NET_ADMIN it refuses in one line. Tests that build links are skipped (reason printed) without the privilege.
Run: .venv/bin/pytest tests/integration/test_links.py -ra
"""

from __future__ import annotations

import multiprocessing as mp
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from diloco.bench import links
from diloco.bench.links import LinkNet, LinksUnavailable

netadmin = pytest.mark.skipif(not links.has_net_admin(), reason="needs CAP_NET_ADMIN (network namespaces, veth, tc)")


def leftovers(tag: str) -> list[str]:
    """Every interface or namespace of harness `tag` still on this host."""
    names = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return re.findall(rf"{links.PREFIX}{tag}\w+", names) + re.findall(rf"{links.PREFIX}-{tag}-\d+", spaces)


def _send(net: LinkNet, port: int, num_bytes: int, out) -> None:
    net.enter(0)
    try:
        with socket.create_connection((net.host_addr, port), timeout=10) as conn:
            conn.sendall(b"x" * num_bytes)
        out.put("sent")
    except OSError as err:
        out.put(f"{type(err).__name__}: {err}")


def _receive(server: socket.socket, got: list[int]) -> None:
    conn, _ = server.accept()
    with conn:
        while chunk := conn.recv(1 << 16):
            got[0] += len(chunk)


@netadmin
def test_a_capped_link_carries_the_bytes_and_the_kernel_counts_them() -> None:
    num_bytes = 300_000
    with LinkNet(1, 1.0) as net:
        assert net.host_addr.startswith(("198.18.", "198.19."))
        shaped = subprocess.run(["tc", "qdisc", "show", "dev", net.sites[0].host_if], capture_output=True, text=True)
        assert "tbf" in shaped.stdout and "rate 8Mbit" in shaped.stdout
        server = socket.create_server((net.host_addr, 0))
        got = [0]
        reader = threading.Thread(target=_receive, args=(server, got))
        reader.start()
        before = net.counters()[0]
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_send, args=(net, server.getsockname()[1], num_bytes, out))
        child.start()
        child.join(60)
        reader.join(60)
        server.close()
        after = net.counters()[0]
        assert out.get(timeout=5) == "sent" and got[0] == num_bytes
        sent = after["sent"] - before["sent"]
        # whole frames: payload + Ethernet/IP/TCP headers (66 B per <= 1448 B segment) + handshake and ACKs
        assert num_bytes < sent < num_bytes * 1.08
        assert after["received"] - before["received"] < 0.05 * num_bytes  # only ACKs come back
        tag = net.tag
    assert leftovers(tag) == []


@netadmin
def test_a_cut_link_is_down_then_up_and_an_error_inside_tears_down() -> None:
    with pytest.raises(RuntimeError, match="boom"), LinkNet(2, 2.0) as net:
        tag, host_if = net.tag, net.sites[1].host_if
        cut = net.cut(1, 0.5)
        time.sleep(0.2)
        state = subprocess.run(["ip", "-o", "link", "show", host_if], capture_output=True, text=True).stdout
        assert "state DOWN" in state
        cut.join(10)
        state = subprocess.run(["ip", "-o", "link", "show", host_if], capture_output=True, text=True).stdout
        assert "DOWN" not in state.split(">")[0] and cut.times[1] - cut.times[0] >= 0.5
        assert leftovers(tag)
        raise RuntimeError("boom")
    assert leftovers(tag) == []


@netadmin
def test_a_harness_whose_owner_was_killed_outright_is_swept() -> None:
    code = textwrap.dedent("""
        import os, signal
        from diloco.bench.links import LinkNet
        net = LinkNet(2, 1.0).__enter__()
        print(net.tag, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    tag = proc.stdout.strip()
    assert proc.returncode == -signal.SIGKILL and tag and leftovers(tag)
    assert tag in links.sweep_stale()
    assert leftovers(tag) == []


def test_without_the_privilege_it_refuses_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(links, "has_net_admin", lambda: False)
    with pytest.raises(LinksUnavailable, match=r"--links real needs CAP_NET_ADMIN .*--links modelled"):
        LinkNet(2, 1.0).__enter__()
