"""The lighthouse address (--lighthouse) and scripts/train_ft.py's checks: an address that cannot
work is refused before anything starts, one that finds no lighthouse ends within --timeout in one
line naming what it found, Ctrl-C while a group connects stops at once, and train_ft.py runs
train.py's checks before it starts the lighthouse. Addresses on the loopback interface only."""

import http.server
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing, contextmanager

import pytest
from test_train import CORPUS, ROOT

from minipar.extras import replicas
from minipar.extras.replicas import check_lighthouse, lighthouse_address, lighthouse_url
from minipar.ops.command_line import parse_args
from minipar.run.config import ConfigError

_spec = importlib.util.spec_from_file_location("train_ft", ROOT / "scripts" / "train_ft.py")
train_ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_ft)

GROUP = ["--model=tiny", "--vocab-size=512", "--seq-len=32", "--global-batch=8", "--micro-batch=2", "--steps=3",
         "--dtype=float64", "--no-wandb", f"--data={CORPUS}", "--replica-groups=2"]


def train(argv, nproc=None, **popen):
    """scripts/train.py as a user starts it (with --nproc-per-node: minipar's launcher), without RUST_LOG."""
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    agent = [f"--nproc-per-node={nproc}"] if nproc else []
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *agent, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def one_line(err: str, code: int, returncode: int) -> str:
    """stderr's one minipar line (tqdm's bar aside), exit `code`, no traceback."""
    said = [line for line in err.splitlines() if "minipar:" in line]
    assert returncode == code and len(said) == 1 and "Traceback" not in err, (returncode, err[-3000:])
    return said[0][said[0].index("minipar:"):]


def closed_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again at once: a connect is refused


@contextmanager
def foreign_server():
    """An HTTP server on 127.0.0.1 that is not a lighthouse (it lists a folder)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def silent_server():
    """A socket on 127.0.0.1 that accepts connections and never answers; yields (address, socket)."""
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}", s


@contextmanager
def lighthouse():
    """torchft's own lighthouse, in this process, on 127.0.0.1."""
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer
    port = closed_port()
    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=200)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()


# -- the address, parsed before anything starts ---------------------------------------------------
@pytest.mark.parametrize("address", ["localhost", "localhost:99999", "http://http://localhost:29510",
                                     "http:// localhost:29510", "localhost:0", ":29510", "https://localhost:29510",
                                     "localhost:29510/x", "localhost:-1", "local host:29510"])
def test_a_malformed_address_is_refused_in_one_line_in_under_a_second(address):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(f"--lighthouse {address!r}: give HOST:PORT")):
        replicas.check(parse_args([*GROUP, f"--lighthouse={address}"]))  # the plug-in's check: no probe yet
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("address,host,port", [("localhost:29510", "localhost", 29510),
                                               ("http://localhost:29510", "localhost", 29510),
                                               ("127.0.0.1:1", "127.0.0.1", 1), ("[::1]:65535", "[::1]", 65535)])
def test_a_well_formed_address_gives_its_host_and_port_and_torchft_one_scheme(address, host, port):
    assert lighthouse_address(address) == (host, port)
    assert lighthouse_url(address) == f"http://{host}:{port}"  # never http://http://


def test_train_py_refuses_a_malformed_address_with_exit_2_before_any_process_group(tmp_path):
    proc = train([*GROUP, "--lighthouse=localhost:99999", f"--out={tmp_path / 'out'}"])
    out, err = proc.communicate(timeout=120)
    assert one_line(err, 2, proc.returncode).startswith("minipar: error: --lighthouse 'localhost:99999': give")
    assert "effective config" not in out and not (tmp_path / "out").exists()


# -- an address that parses, but where no lighthouse answers ---------------------------------------
def probe(address, timeout=2.0) -> str:
    """check_lighthouse's refusal, checked to come within the timeout."""
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        check_lighthouse(address, timeout)
    assert time.monotonic() - t0 < timeout + 0.5
    return str(refused.value)


def test_the_probe_names_a_closed_port_a_foreign_server_and_no_answer_within_the_timeout():
    port = closed_port()
    assert probe(f"127.0.0.1:{port}") == (f"--lighthouse 127.0.0.1:{port}: connection refused: nothing listens "
                                          f"there (start the lighthouse first, or give its port)")
    with foreign_server() as address:
        assert probe(address).startswith(f"--lighthouse {address}: not a lighthouse: an HTTP server answered")
    with silent_server() as (address, _):
        assert probe(address, 1.0).startswith(f"--lighthouse {address}: no answer within --timeout 1 s")


def test_the_probe_passes_torchfts_lighthouse():
    with lighthouse() as address:
        check_lighthouse(address, 5.0)
        check_lighthouse(f"http://{address}", 5.0)


@pytest.mark.parametrize("where", ["closed port", "foreign server"])
def test_train_py_ends_in_one_line_naming_the_address_when_no_lighthouse_answers(where, tmp_path):
    with foreign_server() as foreign:
        address = f"127.0.0.1:{closed_port()}" if where == "closed port" else foreign
        proc = train([*GROUP, f"--lighthouse={address}", "--timeout=5", f"--out={tmp_path / 'out'}"])
        out, err = proc.communicate(timeout=120)
    found = "connection refused" if where == "closed port" else "not a lighthouse"
    assert one_line(err, 2, proc.returncode).startswith(f"minipar: error: --lighthouse {address}: {found}")


def test_under_torchrun_a_foreign_server_ends_every_rank_in_one_line(tmp_path):
    # train.py --nproc-per-node 2: the launcher probes once, before any worker starts
    with foreign_server() as address:
        proc = train([*GROUP, "--cp=2", f"--lighthouse={address}", "--timeout=5", f"--out={tmp_path / 'out'}"],
                     nproc=2)
        out, err = proc.communicate(timeout=180)
    assert one_line(err, 2, proc.returncode).startswith(f"minipar: error: --lighthouse {address}: not a lighthouse")
    assert "effective config" not in out  # no worker started


def test_a_silent_server_ends_the_run_within_its_timeout(tmp_path):
    with silent_server() as (address, s):
        proc = train([*GROUP, f"--lighthouse={address}", "--timeout=3", f"--out={tmp_path / 'out'}"])
        s.settimeout(120)
        connection, _ = s.accept()  # the probe is connected (and held open, silent): from here, the --timeout
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        connection.close()
    assert time.monotonic() - t0 < 3 + 5  # its timeout, and the exit
    assert one_line(err, 2, proc.returncode).startswith(f"minipar: error: --lighthouse {address}: no answer within "
                                                        f"--timeout 3 s")


# -- Ctrl-C while a group connects -------------------------------------------------------------------
def stops_at_once(proc) -> str:
    """SIGINT, as Ctrl-C sends it: the run ends within 5 s with exit 130 and minipar's one line."""
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 5 s after Ctrl-C:\n{proc.communicate()[1][-3000:]}") from None
    assert time.monotonic() - t0 < 5
    line = one_line(err, 130, proc.returncode)
    assert line.startswith("minipar: interrupted: stopped at once; "), line
    return out


def test_ctrl_c_while_the_lighthouse_never_answers_stops_at_once(tmp_path):
    with silent_server() as (address, s):
        proc = train([*GROUP, f"--lighthouse={address}", "--timeout=120", f"--out={tmp_path / 'out'}"])
        s.settimeout(120)
        connection, _ = s.accept()  # the run is connecting, and waits for an answer
        time.sleep(0.2)
        stops_at_once(proc)
        connection.close()


def test_ctrl_c_while_a_group_waits_at_the_lighthouse_for_the_others_stops_at_once_and_torchft_is_quiet(tmp_path):
    # Group 0 of 2, alone: its first quorum waits (up to --timeout) for group 1, which never comes.
    with lighthouse() as address:
        proc = train([*GROUP, f"--lighthouse={address}", "--timeout=120", f"--out={tmp_path / 'out'}",
                      "--replica-group-id=0"])
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("replica group 0 of 2"):
                break
        else:
            raise AssertionError("".join(lines) + proc.stderr.read()[-3000:])
        time.sleep(0.5)
        out = "".join(lines) + stops_at_once(proc)
    assert "[INFO]" not in out  # torchft's Rust half, quiet without RUST_LOG


# -- train_ft.py: train.py's checks before the lighthouse --------------------------------------------
@pytest.mark.parametrize("argv,says", [
    (["--groups=3"], "--global-batch 8 is not divisible by --replica-groups 3"),
    (["--nproc-per-group=2", "--dp=1"], "= 1 ranks, but the world has 2"),
    (["--", "--bogus"], "unrecognized arguments: --bogus"),
    ([], None),  # make train-ft's own command: the checks pass, and the lighthouse would start
    (["--costs", "--groups=3"], "--costs prints figures and runs nothing: leave out --groups"),
    (["--costs", "--", "--dp=2"], "--costs prints figures and runs nothing: leave out the train.py flags after --"),
])
def test_train_ft_refuses_what_train_py_would_before_the_lighthouse_starts(argv, says, monkeypatch, capsys):
    def started(*a):
        raise AssertionError("the lighthouse and the groups started")
    monkeypatch.setattr(train_ft, "demonstrate", started)
    if says is None:
        with pytest.raises(AssertionError, match="started"):
            train_ft.main(argv)
        return
    with pytest.raises(SystemExit) as refused:
        train_ft.main(argv)
    err = capsys.readouterr().err.splitlines()
    assert refused.value.code == 2 and len(err) == 1 and err[0].startswith("minipar: error: ") and says in err[0], err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
