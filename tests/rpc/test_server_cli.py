"""`hgrt rpc-server` is safe by default: loopback unless told otherwise, a warning when it is
told otherwise, and no silent loopback server behind a tracker on another machine."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from conftest import _spawn, free_port

from hgrt.errors import InputError
from hgrt.rpc.cli import listen_address


def test_listen_address_defaults_to_loopback_and_asks_for_host_behind_a_remote_tracker():
    assert listen_address(None, None) == "127.0.0.1"
    assert listen_address(None, "127.0.0.1:9190") == "127.0.0.1"
    assert listen_address("10.0.0.7", "10.0.0.1:9190") == "10.0.0.7"
    with pytest.raises(InputError, match="--host"):
        listen_address(None, "10.0.0.1:9190")


def test_remote_tracker_without_host_is_refused_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "hgrt", "rpc-server", "--tracker",
                           "10.255.255.1:9190", "--key", "k"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--host" in proc.stderr


@pytest.mark.rpc
@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_server_listens_on_loopback_unless_told_and_warns_when_told(host, tmp_path):
    port = free_port()
    args = [sys.executable, "-m", "hgrt", "rpc-server", "--port", str(port), "--port-end",
            str(port + 1)] + (["--host", host] if host else [])
    proc = _spawn(args, str(tmp_path / "server.log"))
    try:
        deadline = time.monotonic() + 60
        while "rpc-server listening on" not in proc.output() and time.monotonic() < deadline:
            assert proc.popen.poll() is None, proc.output()
            time.sleep(0.1)
        out = proc.output()
        assert f"listening on {host or '127.0.0.1'}:{port}" in out
        assert ("warning: listening on 0.0.0.0" in out) == (host == "0.0.0.0")
    finally:
        proc.kill()


@pytest.mark.parametrize("ports, match", [
    (["--port", "70000"], r"port 70000 is not a TCP port \(1-65535\)"),
    (["--port", "9200", "--port-end", "9100"], r"the ports to try, \[9200, 9101\), hold none"),
    (["--port", "9200", "--port-end", "70000"], r"at most 65535"),
])
def test_ports_out_of_range_are_one_line_errors(ports, match):
    # a traceback before (bind's OverflowError; then an AttributeError in terminate)
    proc = subprocess.run([sys.executable, "-m", "hgrt", "rpc-server", *ports],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert re.search(match, proc.stderr), proc.stderr
