"""A zygote: one process that pays the imports once, then forks every role of a local run
(`python -m diloco.supervise.zygote_process`).

Contract: started by the supervisor (diloco.supervise.zygote.Zygote, which documents the protocol); imports
torch and every role's code and runs a throwaway training step (launch.warm_up; with --flows also prefect
and the flows, importing only: no client, no thread, before a fork), then forks on request: a child starts
its own session, takes its log and environment, and runs `diloco.launch` (or, entry "flows",
`diloco.flows`: the role as a flow run) with the given arguments. It exits when the supervisor closes its
stdin; children are never killed by it. It names its entries by module, as a command line does (ENTRIES), so
supervise/ stays below launch and flows: it starts their programs and imports none of their code itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import sys
import traceback

# entry -> (module, its warm-up): what a child runs (`main(argv)`, as `python -m <module>` would) and what the
# zygote imports first; the module's `main` and warm-up are looked up when the zygote starts, by name
ENTRIES = {"launch": ("diloco.launch", "warm_up"), "flows": ("diloco.flows.roles", "warm_up_flows")}

# ---- the zygote process ------------------------------------------------------------------------

def _set_name(name: str) -> None:
    """The process name `ps`/psutil show (Linux; best effort): the role, not the zygote's command."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(15, f"diloco-{name}".encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _child(request: dict) -> None:
    """In the forked child: become the role; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = os.open(request["log"] or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        _set_name(request["name"])
        if request.get("entry") == "flows":  # the role as its Prefect flow run (diloco.flows.roles)
            sys.argv = ["diloco.flows", *request["argv"]]
            entry = importlib.import_module(ENTRIES["flows"][0]).main
        else:
            sys.argv = ["diloco.launch", *request["argv"]]
            entry = importlib.import_module(ENTRIES["launch"][0]).main

        code = entry(request["argv"])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _send(msg: object) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to handle
    import torch

    torch.set_num_threads(1)  # no thread pool before forking; each role sets its own count
    # roles run as Prefect flow runs (--flows): pay prefect's and the flows' imports too
    module, warm_up = ENTRIES["flows" if "--flows" in sys.argv[1:] else "launch"]
    getattr(importlib.import_module(module), warm_up)()
    _send("ready")
    buf = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the supervisor closed us (or is gone); our children live on until it kills them
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                request = json.loads(line)
                pid = os.fork()
            except (ValueError, OSError) as err:
                _send({"error": str(err)})
                continue
            if pid == 0:
                _child(request)
            _send({"pid": pid})


if __name__ == "__main__":
    main()
